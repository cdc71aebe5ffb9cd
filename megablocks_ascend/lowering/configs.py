"""The table expanded into configurations, with the tiles an NPU's launchers would choose.

A configuration is one point of a kernel's axes (:mod:`.table`): every constexpr the kernel takes
(the axes', and the tiles derived as the launchers derive them on an NPU:
``devices.tile(kind, dtype, hidden, "npu")``, ``devices.cube_tile``, ``devices.prep_tile``,
``devices.fill_block``), its scalar arguments for the table's representative problem, and what
``devices``' memory model says the tile takes on chip (``ub_bytes``, ``cube_bytes``), which the back
end's plan is checked against.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterable

from megablocks_ascend.lowering.table import (
    CUBE_BLOCK,
    DTYPES,
    EXPERTS,
    FILL_ROWS,
    KERNELS,
    MANY_EXPERTS,
    PREP_PROGRAMS,
    ROUTE_MAP_BLOCK_M,
    SIZE_AXES,
    KernelSpec,
    Problem,
    fill_block,
)

_TILES = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_X")  # shown in a label


@dataclasses.dataclass(frozen=True)
class Config:
    kernel: str
    axes: dict  # the axis values of this configuration
    constexprs: dict  # every constexpr of the kernel
    scalars: dict  # the non-constexpr integer arguments
    ub_bytes: int | None  # devices.ub_bytes of a vector kernel's tile (the memory model)
    cube_bytes: dict | None = None  # devices.cube_bytes of a cube kernel's tile
    experts: int = EXPERTS  # the problem's expert count (BLOCK_E)
    overridden: tuple = ()  # constexprs set by hand (--set), not derived as a launcher would

    @property
    def label(self) -> str:
        parts = []
        for k, v in self.axes.items():
            if k == "dtype":
                parts.append(str(v))
            elif k == "hidden":
                parts.append(f"H={v}")
            elif isinstance(v, bool):
                parts.append(f"{k}={int(v)}")
            else:
                parts.append(f"{k}={v}")
        if self.experts != EXPERTS:
            parts.append(f"E={self.experts}")
        tiles = [f"{k}={self.constexprs[k]}" for k in _TILES if k in self.constexprs]
        if "EVEN_X" in self.constexprs:
            tiles.append(f"EVEN_X={int(self.constexprs['EVEN_X'])}")
        tiles += [f"{k}={_show(self.constexprs[k])}" for k in self.overridden if k not in _TILES + ("EVEN_X",)]
        return " ".join(parts + tiles) + (" (set by hand)" if self.overridden else "")


def _show(v):
    return int(v) if isinstance(v, bool) else v


def configs(kernels: Iterable[KernelSpec] = KERNELS, *, axes: dict | None = None, experts: int | None = None,
            overrides: dict | None = None) -> list[Config]:
    """Every configuration of every kernel: the product of its axes, tiles derived as on an NPU.

    ``axes`` replaces the values of the named axes in every kernel that has them (``--axis``: more
    hidden sizes or top_k values than the table's, or fewer); ``experts`` is the problem's expert
    count (``BLOCK_E``); ``overrides`` sets constexprs by hand after they are derived (``--set``:
    tiles no launcher would choose, to show what the back end does with them). The memory model
    (``ub_bytes``, ``cube_bytes``) is that of the tile the configuration ends up with.

    The table itself (neither ``axes`` nor ``experts`` given) is the product at ``EXPERTS`` and, for
    the kernels with ``many`` axes, their configurations at ``EXPERTS`` and ``MANY_EXPERTS`` experts
    that the product does not hold (labelled ``E=...`` at other expert counts)."""
    table = experts is None and not axes
    base = [(spec, spec.axes, EXPERTS if experts is None else experts) for spec in kernels]
    many = [(spec, spec.many, e) for spec in kernels if table and spec.many for e in (EXPERTS,) + MANY_EXPERTS]
    out, seen = [], set()
    for spec, spec_axes, count in base + many:
        for cfg in _expand(spec, spec_axes, dict(axes or {}), count, dict(overrides or {})):
            if (cfg.kernel, cfg.label) not in seen:
                seen.add((cfg.kernel, cfg.label))
                out.append(cfg)
    return out


def _expand(spec: KernelSpec, spec_axes: dict, axes: dict, experts: int, overrides: dict) -> list[Config]:
    """The configurations of one kernel over ``spec_axes`` (``axes`` replacing their values) at ``experts``."""
    from megablocks_ascend import devices  # noqa: PLC0415

    out = []
    names = list(spec_axes)
    values = [tuple(axes[n]) if n in axes else spec_axes[n] for n in names]
    for combo in itertools.product(*values):
        ax = dict(zip(names, combo))
        constexprs, cube = _constexprs(spec, ax, experts)
        if spec.when is not None and not spec.when({**ax, **constexprs}):
            continue  # a point no launcher produces
        scalars = spec.scalars(Problem.of(ax, experts))
        missing = set(spec.derived) - set(constexprs)
        if missing:
            raise AssertionError(f"{spec.name}: derived constexprs {sorted(missing)} not computed")
        mine = {k: v for k, v in overrides.items() if k in constexprs}
        if mine:
            constexprs.update(mine)
            if "BLOCK_X" in mine and "EVEN_X" not in mine and "EVEN_X" in constexprs:
                constexprs["EVEN_X"] = ax["hidden"] % constexprs["BLOCK_X"] == 0
            if spec.cube:
                t = devices.CubeTile(constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_K"])
                cube = devices.cube_bytes(t, DTYPES[ax["dtype"]][2])
        out.append(Config(spec.name, ax, constexprs, scalars, model_ub(spec, ax, constexprs, experts), cube,
                          experts, tuple(sorted(mine))))
    return out


def _constexprs(spec: KernelSpec, axes: dict, experts: int) -> tuple[dict, dict | None]:
    """The constexprs a kernel's launchers pass on an NPU, and a cube tile's ``devices.cube_bytes``."""
    import torch  # noqa: PLC0415

    from megablocks_ascend import devices  # noqa: PLC0415

    if spec.module == "blocksparse":
        return _cube_constexprs(spec, axes)
    constexprs = {k: v for k, v in axes.items() if k not in SIZE_AXES}
    if spec.module == "grouped":
        block = fill_block(axes["dtype"])
        constexprs.update(BLOCK=block, EVEN=FILL_ROWS * axes["hidden"] % block == 0)
    elif spec.module == "topology":
        from megablocks_ascend.kernels import topology  # noqa: PLC0415
        block_i, block_k = topology.tile(axes["BPR"])
        constexprs.update(BLOCK_SIZE=CUBE_BLOCK, BLOCK_I=block_i, BLOCK_K=block_k, CHUNK=topology.CHUNK)
        return constexprs, None  # (its BLOCK_K is the tile's block width, not a slot axis)
    elif spec.kind is not None:
        t = devices.tile(spec.kind, getattr(torch, DTYPES[axes["dtype"]][1]), axes["hidden"], "npu",
                         **tile_args(spec, axes, experts))
        constexprs.update(BLOCK_M=t.block_m, BLOCK_X=t.block_x, EVEN_X=axes["hidden"] % t.block_x == 0)
    elif spec.module == "preparation":
        t = devices.prep_tile(experts, "npu")
        constexprs["BLOCK_M"] = t.block_m
        if "CHUNK" in spec.derived:  # the count's own block of items, and its keys per compare
            constexprs["BLOCK_M"], constexprs["CHUNK"] = devices.prep_count_tile(t, devices.block_e(experts))
        if "BLOCK_P" in spec.derived:
            constexprs["BLOCK_P"] = devices.prep_block_p(PREP_PROGRAMS, devices.block_e(experts))
        if "NPU_FORM" in spec.derived:
            constexprs["NPU_FORM"] = devices.PREP_NPU_FORM["npu"]
    else:
        constexprs["BLOCK_M"] = ROUTE_MAP_BLOCK_M
    if "BLOCK_E" in spec.derived:
        constexprs["BLOCK_E"] = devices.block_e(experts)
    if "BLOCK_K" in spec.derived:  # the flat scatter's slot axis
        constexprs["BLOCK_K"] = devices.block_k(axes["TOP_K"])
    if "FLAT" in spec.derived:
        constexprs["FLAT"] = devices.STORES["npu"] == "contiguous"
    return constexprs, None


def _cube_constexprs(spec: KernelSpec, axes: dict) -> tuple[dict, dict | None]:
    """The constexprs the block-sparse launchers pass on an NPU, and the tile's cube bytes."""
    import torch  # noqa: PLC0415

    from megablocks_ascend import devices  # noqa: PLC0415
    from megablocks_ascend.kernels import blocksparse  # noqa: PLC0415

    if spec.name == "_row_indices":
        return dict(BLOCK=blocksparse.ROW_INDICES_BLOCK), None
    _, torch_name, es = DTYPES[axes["dtype"]]
    dense = axes["hidden"]
    t = devices.cube_tile(spec.kind, getattr(torch, torch_name), CUBE_BLOCK, dense, "npu")
    c = {k: v for k, v in axes.items() if k not in SIZE_AXES}
    c.update(BLOCK_SIZE=CUBE_BLOCK, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP=t.group,
             OUT_CM=False, PRECISION="ieee", WIDEN=False)
    if spec.name == "_sdd":
        c.update(EVEN_K=dense % t.block_k == 0, PAIRS=t.pairs)
    elif spec.name == "_dsd":
        c.update(A_CM=axes["GATHER"], EVEN_N=dense % t.block_n == 0, AFFINE=t.affine)
    else:
        c.update(B_CM=not axes["GATHER"], EVEN_M=dense % t.block_m == 0)
    return c, devices.cube_bytes(t, es)


def tile_args(spec: KernelSpec, axes: dict, experts: int) -> dict:
    """What a kernel's launcher passes to ``devices.tile`` besides the dtype and hidden size
    (``routing._tile``): its top_k (kernels that unroll their slots) and expert count (those that
    take the bins: the ``BLOCK_E`` kernels); the flat scatter's ``BLOCK_K`` slots for its top_k."""
    from megablocks_ascend import devices  # noqa: PLC0415
    top_k = axes.get("TOP_K", 1) if spec.unrolls_top_k else 1
    return dict(top_k=devices.block_k(top_k) if "BLOCK_K" in spec.derived else top_k,
                num_experts=experts if "BLOCK_E" in spec.derived else 1)


def model_ub(spec: KernelSpec, axes: dict, constexprs: dict, experts: int = EXPERTS) -> int | None:
    """``devices.ub_bytes`` of a vector kernel's configuration (None: no feature tiles)."""
    from megablocks_ascend import devices  # noqa: PLC0415
    if spec.module == "grouped":
        return devices.fill_ub_bytes(constexprs["BLOCK"], DTYPES[axes["dtype"]][2])
    if spec.kind is None or spec.cube:
        return None
    args = tile_args(spec, axes, experts)
    return devices.ub_bytes(spec.kind, constexprs["BLOCK_M"], constexprs["BLOCK_X"], DTYPES[axes["dtype"]][2],
                            even=bool(constexprs["EVEN_X"]), top_k=args["top_k"],
                            block_e=devices.block_e(args["num_experts"]))
