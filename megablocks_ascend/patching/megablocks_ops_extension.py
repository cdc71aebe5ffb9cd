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
    why="megablocks/ops/{sort,histogram,cumsum,replicate,topology}.py import the CUDA extension "
        "megablocks_ops at import time, so `import megablocks` fails wherever it was not built.",
    how="When megablocks_ops cannot be found, a device-agnostic PyTorch module with the same "
        "functions (megablocks_ascend.native.megablocks_ops) is registered under that name.",
    upstream_fix="Import megablocks_ops lazily and fall back to PyTorch implementations off CUDA.",
    apply=apply,
    needs_megablocks=False,
)
