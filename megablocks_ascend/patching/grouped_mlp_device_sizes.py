"""The ``grouped-mlp-device-sizes`` patch (page: ``patches/grouped-mlp-device-sizes.md``):
``GroupedMLP.forward`` and ``GroupedGLU.forward`` hand ``tokens_per_expert`` to the grouped GEMMs on
the device where every GEMM of the step takes device sizes (:func:`expert_batch_sizes`), instead of
copying it to the host on every step; with ``memory_optimized_mlp`` they call the memory-optimized
functions of :mod:`megablocks_ascend.grouped_mlp` (upstream's, without copying the stand-in's
results into reused buffers); the rest of each forward is upstream's code. The patch checks the
fingerprint of every upstream body it replaces or follows.
"""

from __future__ import annotations

import torch

from megablocks_ascend import grouped_mlp
from megablocks_ascend.patching.registry import Patch, PatchError, expect_source, owner, replace_followed


def expert_batch_sizes(layer, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The group sizes a grouped expert MLP hands its grouped GEMMs: ``tokens_per_expert`` as it is
    (on the device) where every GEMM of the step takes device sizes
    (:func:`megablocks_ascend.native.grouped_gemm.takes_device_sizes`), else upstream's
    ``tokens_per_expert.cpu().to(torch.long)`` (a device-to-host copy)."""
    from megablocks.layers import mpu  # noqa: PLC0415
    from megablocks_ascend.native import grouped_gemm  # noqa: PLC0415
    experts = mpu.experts_per_rank(layer.args)
    if tokens_per_expert.device == x.device and _takes_device_sizes(
            grouped_gemm, x.device, x.dtype, (layer.args.hidden_size, layer.w1.shape[0] // experts), experts):
        return tokens_per_expert
    return tokens_per_expert.cpu().to(torch.long)


def _device_sizes_decision(device, dtype, dims, groups) -> bool:
    # Marked torch.compiler.assume_constant_result by apply (marking imports torch._dynamo, and
    # with it Triton, which importing the patch registry must not).
    from megablocks_ascend.native import grouped_gemm  # noqa: PLC0415
    return grouped_gemm.takes_device_sizes(device, dtype, dims, groups)


def _takes_device_sizes(grouped_gemm, device, dtype, dims, groups) -> bool:
    # Under torch.compile the decision is a constant of the trace (it depends on the device, the
    # dtype and static sizes only), evaluated once when the graph is traced.
    if torch.compiler.is_compiling():
        return _device_sizes_decision(device, dtype, dims, groups)
    return grouped_gemm.takes_device_sizes(device, dtype, dims, groups)


def _grouped_mlp_forward(self, x, tokens_per_expert):
    """``megablocks.layers.mlp.GroupedMLP.forward`` with the group sizes from
    :func:`expert_batch_sizes`; the rest as upstream's."""
    from megablocks import grouped_gemm_util as gg  # noqa: PLC0415
    from megablocks.layers import mlp, mpu  # noqa: PLC0415
    batch_sizes = expert_batch_sizes(self, x, tokens_per_expert)
    w1, w2 = (self.scale_grad(self.w1), self.scale_grad(self.w2))

    # Re-shape the weights for the grouped GEMMs.
    ne = mpu.experts_per_rank(self.args)
    w1 = mlp.resolve_dtensor(w1).view(ne, -1, self.args.hidden_size)
    w2 = mlp.resolve_dtensor(w2).view(ne, -1, self.args.hidden_size)

    if self.args.memory_optimized_mlp:
        return grouped_mlp.memory_optimized_grouped_mlp(x, w1, w2, batch_sizes, self.args.activation_fn)

    # Compute the MLP.
    assert gg.ops is not None
    x = gg.ops.gmm(x, w1, batch_sizes, trans_b=True)
    x = self.args.activation_fn(x)
    return gg.ops.gmm(x, w2, batch_sizes)


def _grouped_glu_forward(self, x, tokens_per_expert):
    """``megablocks.layers.glu.GroupedGLU.forward`` with the group sizes from
    :func:`expert_batch_sizes`; the rest as upstream's."""
    from megablocks import grouped_gemm_util as gg  # noqa: PLC0415
    from megablocks.layers import glu, mpu  # noqa: PLC0415
    batch_sizes = expert_batch_sizes(self, x, tokens_per_expert)
    w1, v1, w2 = (self.scale_grad(self.w1), self.scale_grad(self.v1), self.scale_grad(self.w2))
    w1, v1, w2 = glu.resolve_dtensor(w1), glu.resolve_dtensor(v1), glu.resolve_dtensor(w2)

    # Re-shape the weights for the grouped GEMMs.
    ne = mpu.experts_per_rank(self.args)
    w1 = w1.view(ne, -1, self.args.hidden_size)
    v1 = v1.view(ne, -1, self.args.hidden_size)
    w2 = w2.view(ne, -1, self.args.hidden_size)

    if self.args.memory_optimized_mlp:
        return grouped_mlp.memory_optimized_grouped_glu(x, w1, v1, w2, batch_sizes, self.args.activation_fn)

    # Compute the MLP.
    assert gg.ops is not None
    x1 = gg.ops.gmm(x, w1, batch_sizes, trans_b=True)
    x2 = gg.ops.gmm(x, v1, batch_sizes, trans_b=True)
    x1 = self.args.activation_fn(x1) * x2
    return gg.ops.gmm(x1, w2, batch_sizes)


# The forwards replaced, with the fingerprint (source_fingerprint) of MegaBlocks 0.10.0's code.
GROUPED_FORWARDS = {
    "megablocks.layers.mlp:GroupedMLP.forward": (_grouped_mlp_forward, "5cf27d163b10e7dc"),
    "megablocks.layers.glu:GroupedGLU.forward": (_grouped_glu_forward, "a9e48f69fbbb9b6d"),
}


def apply(p: Patch) -> None:
    import megablocks.grouped_gemm_util as gg  # noqa: PLC0415
    if not getattr(gg.backend, "__megablocks_ascend_standin__", False):
        return  # the real grouped_gemm package takes CPU sizes only: leave upstream's forwards alone
    torch.compiler.assume_constant_result(_device_sizes_decision)  # marks the function itself
    for target, fingerprint in grouped_mlp.UPSTREAM.items():  # followed by grouped_mlp's functions
        cls, attr = owner(target)
        method = cls.__dict__.get(attr)
        if method is None:
            raise PatchError(f"{target} is missing")
        expect_source(target, grouped_mlp._inner(method), fingerprint)
    grouped_mlp.bind()
    for target, (replacement, fingerprint) in GROUPED_FORWARDS.items():
        replace_followed(p, target, replacement, fingerprint, ("self", "x", "tokens_per_expert"))


PATCH = Patch(
    name="grouped-mlp-device-sizes",
    targets=tuple(GROUPED_FORWARDS),
    why="Both forwards begin with `batch_sizes = tokens_per_expert.cpu().to(torch.long)`: the real "
        "`grouped_gemm` package wants the per-expert token counts on the host. On a GPU or an NPU that is "
        "a device-to-host copy in every layer of every step: the host stops until the device has finished "
        "everything queued before it (router, sort, histogram, the gather), then queues the rest of the "
        "step, so the device idles while the host launches the expert GEMMs and everything after them. The "
        "same copy makes a training step impossible to capture in a CUDA graph (`Cannot copy between CPU "
        "and CUDA tensors during CUDA graph capture`) or an NPU graph. Where the step is short (many small "
        "experts) that stall is a large share of the step.",
    how="`torch._grouped_mm` takes its group offsets as a device tensor, and so does "
        "`torch_npu.npu_grouped_matmul` (its `group_list`); the stand-in accepts `batch_sizes` on the "
        "operands' device and then computes the offsets on the device, never reading them on the host "
        '(`megablocks_ascend/native/grouped_gemm/`, "Where the group sizes live"). The replaced forwards '
        "call `expert_batch_sizes` (`megablocks_ascend/patching/grouped_mlp_device_sizes.py`), which keeps "
        "`tokens_per_expert` on the device when `grouped_gemm.takes_device_sizes(device, dtype, (hidden, "
        "ffn per expert), experts)` says that every GEMM of the step (forward and backward) runs an "
        "implementation that reads device sizes:",
    upstream_fix="Pass `tokens_per_expert` to a grouped GEMM that takes device sizes (`torch._grouped_mm`, "
                 "which MegaBlocks could use directly where it is available) instead of copying it to the "
                 "host.",
    apply=apply,
)
