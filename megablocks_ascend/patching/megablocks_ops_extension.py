"""The ``megablocks-ops-extension`` patch (page: ``patches/megablocks-ops-extension.md``): where
MegaBlocks' CUDA extension ``megablocks_ops`` was not built, a PyTorch module with its functions
(:mod:`megablocks_ascend.native.megablocks_ops`) stands in for it, so that ``import megablocks`` works.
"""

from __future__ import annotations

from megablocks_ascend.patching.registry import Patch, module_absent


def apply(p: Patch) -> None:
    from megablocks_ascend.native import megablocks_ops  # noqa: PLC0415
    if module_absent("megablocks_ops"):
        p.set_module("megablocks_ops", megablocks_ops)


PATCH = Patch(
    name="megablocks-ops-extension",
    targets=("sys.modules['megablocks_ops']",),
    why="`megablocks/ops/{sort,histogram,cumsum,replicate,topology}.py` run `import megablocks_ops` at "
        "import time. That extension is built from CUDA sources only when CUDA is present, so on a CPU or "
        "NPU machine `import megablocks` fails with `ModuleNotFoundError: No module named "
        "'megablocks_ops'`.",
    how="`megablocks_ascend.native.megablocks_ops` implements the extension's seven functions in PyTorch, "
        "with the same signatures, the same output arguments and the same results, on any device: `sort` "
        "(a stable sort on the low `end_bit` bits, as CUB's radix sort), `histogram` (int32 counts of `[0, "
        "max_val)`, 1-D or batched), `inclusive_cumsum` / `exclusive_cumsum` (dim 1), `indices` (the "
        "block-sparse topology), `replicate_forward` / `replicate_backward`. MegaBlocks' own autograd "
        "wrappers in `megablocks.ops` are unchanged and call it.",
    upstream_fix="Import the extension lazily, and fall back to PyTorch implementations of these small "
                 "integer ops where it is not built (they are not on the hot path).",
    apply=apply,
    needs_megablocks=False,
)
