"""The ``shared-expert-bias`` patch (page: ``patches/shared-expert-bias.md``): MegaBlocks' shared
expert with its own defaults. With ``return_bias=True`` (the default) the routed experts return
``(output, bias)``, and ``SharedMLP.add_experts_sharedexpert`` added the shared expert's output to
that tuple: ``MoE`` and ``dMoE`` with ``shared_expert=True`` crashed on every forward.
"""

from __future__ import annotations

from megablocks_ascend.patching.registry import Patch, expect_params, expect_source, owner

TARGET = "megablocks.layers.mlp:SharedMLP.add_experts_sharedexpert"  # SharedGLU inherits it
FINGERPRINT = "6f9259ec5813ef7f"  # MegaBlocks 0.10.0's body (registry.source_fingerprint)


def apply(p: Patch) -> None:
    cls, attr = owner(TARGET)
    upstream = cls.__dict__.get(attr)
    expect_params(TARGET, upstream, ("self", "shared_expert_out", "expert_out"))
    expect_source(TARGET, upstream, FINGERPRINT)

    def add_experts_sharedexpert(self, shared_expert_out, expert_out):
        if not isinstance(expert_out, tuple):  # return_bias=False, or no bias: upstream's case
            return upstream(self, shared_expert_out, expert_out)
        # return_bias=True: the experts' (output, bias), whose bias the caller adds. Combine the
        # outputs as upstream does, and return the bias that makes `output + bias` what
        # return_bias=False returns: the weighted sum scales the experts' bias by k / (k + 1) too.
        out, bias = expert_out
        combined = upstream(self, shared_expert_out, out)
        if self.args.shared_expert_weighted_sum:
            bias = bias * (self.args.moe_top_k / (self.args.moe_top_k + 1))
        return combined, bias

    add_experts_sharedexpert.__wrapped__ = upstream
    add_experts_sharedexpert.__doc__ = (
        "SharedMLP.add_experts_sharedexpert, also for experts that return (output, bias) "
        "(return_bias=True): returns (combined output, bias), whose sum is what return_bias=False returns.")
    p.replace(TARGET, add_experts_sharedexpert)


PATCH = Patch(
    name="shared-expert-bias",
    targets=(TARGET,),
    why="With shared_expert=True and the default return_bias=True (and bias=True), MoE.forward passes "
        "the routed experts' (output, bias) tuple to SharedMLP.add_experts_sharedexpert, which adds "
        "the shared expert's output to it: TypeError on every forward of MoE and dMoE (with "
        "shared_expert_weighted_sum too).",
    how="add_experts_sharedexpert is wrapped: a tuple (output, bias) is combined as upstream combines "
        "a tensor, and returned as (combined, bias) with the bias scaled by k / (k + 1) under the "
        "weighted sum, so that output + bias equals what return_bias=False returns; a tensor goes "
        "to upstream's function unchanged. Refused if upstream's body changed.",
    upstream_fix="In MoE.forward, unpack (output, bias) before adding the shared expert (and scale "
                 "the bias with the weighted sum), or let add_experts_sharedexpert take the tuple.",
    apply=apply,
)
