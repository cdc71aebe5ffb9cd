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
    why="MegaBlocks' shared expert crashes on its own defaults. `Arguments.return_bias` defaults to `True` "
        "and `bias` to `True`, so the routed experts (`ParallelMLP.forward`, for `MoE` and `dMoE`) return "
        "`(output, bias)` and leave the bias for the caller to add. With `shared_expert=True`, "
        "`MoE.forward` hands that tuple to `add_experts_sharedexpert`, which adds the shared expert's "
        "output to it:",
    how="`add_experts_sharedexpert` is wrapped. A tensor (`return_bias=False`, or no bias) goes to "
        "upstream's function unchanged. A tuple `(output, bias)` is unpacked; the outputs are combined by "
        "upstream's function, and the pair `(combined, bias')` is returned, so that `MoE` keeps its "
        "`return_bias=True` contract: the caller adds `bias'` and gets exactly what `return_bias=False` "
        "returns. Without the weighted sum `bias' = bias` (`shared + out + bias`); with it, upstream's "
        "`shared / (k + 1) + (out + bias) * k / (k + 1)` (k = `moe_top_k`) needs `bias' = bias * k / (k + "
        "1)`. The patch checks the function's parameters and the fingerprint of MegaBlocks 0.10.0's body, "
        "and refuses to install over a changed one.",
    upstream_fix="In `MoE.forward`, unpack `(output, bias)` before adding the shared expert (scaling the "
                 "bias under the weighted sum), or let `add_experts_sharedexpert` take the tuple, as here.",
    apply=apply,
)
