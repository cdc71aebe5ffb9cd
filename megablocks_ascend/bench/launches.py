"""What one training step of MegaBlocks' unchanged layers launches, counted on any device.

:func:`layer_step` builds one training step of MegaBlocks' ``MoE``, grouped ``dMoE`` or sparse
``dMoE`` (forward, load-balancing loss, backward), its routing served by a named backend or by
MegaBlocks' and stk's own kernels (:func:`upstream_kernels`, on CPU tensors too); :func:`count_step`
counts what one call of it launches with the harness's
:class:`~megablocks_ascend.bench.instruments.LaunchCounter`. ``tests/test_launch_counts.py`` holds
the counts, ``benchmarks/launches_per_step.py`` prints them line by line.

    step = layer_step("dMoE-grouped", backend="ascend")
    print(count_step(step, where=True).report())
"""

from __future__ import annotations

import contextlib

import torch

from megablocks_ascend.bench.instruments import LaunchCounter


# -- upstream's kernels on the CPU


UPSTREAM_PATCHES = ("routing-kernels", "routing-ops", "stk-kernels", "routing-preparation")


@contextlib.contextmanager
def upstream_kernels():
    """MegaBlocks' own routing preparation, routing ops and kernels, and stk's own block-sparse
    kernels, as shipped, for the block: the patches that route them through megablocks_ascend
    (``routing-kernels``, ``routing-ops``, ``stk-kernels``, ``routing-preparation``) are reverted,
    and applied again on exit. Upstream's autotuned
    routing kernels are narrowed to their first config (the interpreter cannot time configs; the
    config changes speed, not what launches). What a step launches on CPU tensors in the Triton
    interpreter is then what the same step launches on CUDA with the ``cuda`` backend, except that
    our wrappers (``megablocks_ascend.ops``) stand in for upstream's there: both launch the same
    kernels. The ``megablocks_ops`` stand-in and the grouped GEMM stand-in stay (there is no CUDA
    extension on either machine)."""
    from megablocks_ascend import patching  # noqa: PLC0415
    patches = [p for p in patching.PATCHES if p.name in UPSTREAM_PATCHES]
    if len(patches) != len(UPSTREAM_PATCHES):
        raise RuntimeError(f"patch registry lacks one of {UPSTREAM_PATCHES}: {[p.name for p in patching.PATCHES]}")
    import megablocks.backend.kernels as k  # noqa: PLC0415
    narrowed = []
    for p in reversed(patches):
        p.revert()
    try:
        for name in ("_padded_copy", "_padded_copy_wgrad", "_binned_copy", "_binned_copy_wgrad"):
            autotuned = getattr(k, name)
            narrowed.append((autotuned, autotuned.configs))
            autotuned.configs = autotuned.configs[:1]
        yield
    finally:
        for autotuned, configs in narrowed:
            autotuned.configs = configs
        for p in patches:
            p.apply(p)
            p.applied = True


# -- one training step of MegaBlocks' unchanged layers

LAYERS = ("MoE", "dMoE-grouped", "dMoE-sparse")


def layer_step(layer: str, *, experts: int = 16, top_k: int = 4, tokens: int = 64, hidden: int = 64,
               ffn: int = 128, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               seed: int = 0, backend: str | None = None, amp: torch.dtype | None = None):
    """``step()``: one training step of MegaBlocks' own layer ``layer`` (one of :data:`LAYERS`),
    its routing served by ``backend``: a ``MEGABLOCKS_BACKEND`` value, ``"upstream"`` (MegaBlocks'
    and stk's own kernels: the ``cuda`` backend on CUDA tensors, :func:`upstream_kernels` on CPU
    tensors), or ``None`` (whatever ``MEGABLOCKS_BACKEND`` says).

    The layer is built as :mod:`~megablocks_ascend.bench.steps` builds it (``return_bias=False``: the output bias is
    added inside the layer; capacity factor 1; the default load-balancing loss weight, 0.1), on
    ``tokens`` tokens (sequence ``tokens``, batch 1). A step is what a training loop does per
    layer: gradients set to ``None``, the forward, the load-balancing loss
    (``batched_load_balancing_loss``), one backward through the output (with a fixed output
    gradient) and the loss together, and the loss list cleared. With ``amp`` (``torch.bfloat16``,
    say) the parameters and input are ``dtype`` and the forward and the loss run under
    ``torch.autocast`` to ``amp`` (the backward outside it, as a training loop does). ``ffn`` must be a multiple of 128
    for the sparse dMoE (MegaBlocks' block size), and stk's own kernels (:func:`upstream_kernels`)
    also need ``hidden`` to be one.
    """
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE, batched_load_balancing_loss, clear_load_balancing_loss  # noqa: PLC0415

    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    device = torch.device(device)
    torch.manual_seed(seed)
    def serving():
        from megablocks_ascend import backends  # noqa: PLC0415
        if backend is None:
            return contextlib.nullcontext()
        if backend == "upstream":
            return backends.use_backend("cuda") if device.type == "cuda" else upstream_kernels()
        return backends.use_backend(backend)

    # A named backend serves the construction too: MegaBlocks' refusal of mlp_impl="sparse" is lifted
    # (or kept) in Arguments by the backend that will serve stk's matmuls on the layer's device, and
    # under MEGABLOCKS_BACKEND=auto that is stk's own kernels on CUDA. ("upstream" builds as the
    # environment says: on CPU its context takes our patches back, the refusal's lifting included.)
    with serving() if backend not in (None, "upstream") else contextlib.nullcontext():
        args = Arguments(hidden_size=hidden, ffn_hidden_size=ffn, moe_num_experts=experts, moe_top_k=top_k,
                         moe_capacity_factor=1, mlp_impl="sparse" if layer == "dMoE-sparse" else "grouped",
                         bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, return_bias=False,
                         device=torch.cuda.current_device() if device.type == "cuda" else device)
    module = (MoE if layer == "MoE" else dMoE)(args)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(tokens, 1, hidden, device=device, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(tokens, 1, hidden, device=device, generator=gen).to(dtype)

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        with serving():
            with torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
                out = module(x)
                loss = batched_load_balancing_loss(args)
            torch.autograd.backward([out, loss], [g.to(out.dtype), None])
        clear_load_balancing_loss()
        return out

    step.module, step.x, step.args = module, x, args
    return step


def count_step(step, *, warmup: int = 1, device=None, where: bool = False) -> LaunchCounter:
    """What one call of ``step()`` launches, after ``warmup`` calls (caches filled, autotuning done)."""
    for _ in range(warmup):
        step()
    with LaunchCounter(device=device, where=where) as counter:
        step()
    return counter
