"""The ``routing-ops`` patch (page: ``patches/routing-ops.md``): MegaBlocks' six routing autograd
ops (``megablocks.ops``) are replaced by ours (:mod:`megablocks_ascend.ops`): upstream's forward and
backward over the dispatched kernels, with autocast for the tensors' own device.
"""

from __future__ import annotations

import inspect

from megablocks_ascend.patching.registry import Patch, PatchError, expect_params


def apply(p: Patch) -> None:
    from megablocks_ascend import ops  # noqa: PLC0415
    import megablocks.ops as upstream  # noqa: PLC0415
    for name, fn in ops.OPS.items():
        target = f"megablocks.ops.{name}"
        current = getattr(upstream, name, None)
        if current is None:
            raise PatchError(f"{target} is missing")
        # Upstream's parameters: ours without the optional ones we add after them (padded_gather's num_rows).
        expected = tuple(n for n, prm in inspect.signature(fn).parameters.items()
                         if prm.default is inspect.Parameter.empty)
        if hasattr(current, "__self__") and isinstance(current.__self__, type):  # Function.apply
            expect_params(target, current.__self__.forward, ("ctx",) + expected)
        else:
            expect_params(target, current, expected)
        p.replace(target, fn)


PATCH = Patch(
    name="routing-ops",
    targets=tuple(f"megablocks.ops.{n}" for n in (
        "binned_gather", "binned_scatter", "gather", "scatter", "padded_gather", "padded_scatter")),
    why="Upstream's autograd wrappers are decorated with stk's `custom_fwd`/`custom_bwd`, which only know "
        'CUDA autocast (`device_type="cuda"`, `x.is_cuda`).',
    how="Each op is replaced by `megablocks_ascend.ops.<op>`: an autograd Function with upstream's forward "
        "and backward (the same kernels in the same order, the same saved tensors) that calls the "
        "dispatched kernels (as `torch.library` custom ops while `torch.compile` traces, so the layers "
        "compile without graph breaks) and handles autocast for its inputs' own device. MegaBlocks' layers "
        "look these up at call time (`import megablocks.ops as ops`), so the replacement reaches every "
        "layer. The patch refuses to install if an upstream op's parameters differ from the ones it was "
        "written against.",
    upstream_fix="Device-aware autocast decorators in `megablocks.ops` (or `torch.amp.custom_fwd` with the "
                 "device type of the inputs).",
    apply=apply,
)
