"""The Ascend compile gate: lower every kernel with triton-ascend's front end, on CPU.

``python -m megablocks_ascend lower`` (in the lowering venv made by ``tools/ascend_lowering_env.sh``)
runs triton-ascend's ``ttir`` and ``ttadapter`` stages for every kernel of
:mod:`megablocks_ascend.kernels.routing` and :mod:`megablocks_ascend.kernels.grouped` (vector
kernels) and
:mod:`megablocks_ascend.kernels.blocksparse` (cube kernels: ``tl.dot``) over a generated list of
configurations, and reads the resulting Ascend linalg/HIVM IR for the kernel's memory pattern. It stops before ``npubin``
(``bishengir-compile`` from CANN): see ``docs/notes/ascend-lowering.md`` for what that leaves
to a real NPU.

Configurations come from one table per kernel (:data:`KERNELS`): the cartesian product of its
axes (dtype, hidden size and every constexpr the launchers choose), with the tile constexprs
derived the way the launchers derive them on an NPU (``devices.tile(kind, dtype, hidden, "npu")``).
A test checks the table against the kernels' signatures and the launchers' keyword arguments,
so a new kernel or constexpr path cannot be forgotten.

What is counted in the IR (the markers are the ones triton-ascend 3.2.0's adapter emits):

``row_dma``      row copies inside an ``scf.for`` marked ``ExtractedLoadOrStore``: the adapter
                 splits a 2-D tile access whose row offsets come from an index vector into a loop
                 over rows, each iteration one contiguous DMA of ``1 x BLOCK_X`` elements: a
                 ``memref.copy`` for a load (the loop is also marked ``hivm.parallel_loop``), a
                 ``bufferization.materialize_in_destination`` of a ``tensor<1xN>`` slice for a store.
                 One op here is one DMA per row per tile. (A store whose mask depends on loaded data
                 is NOT lowered this way: it becomes element-wise scalar stores, counted below.)
``scalar_hot``   scalar memory accesses inside the feature-tile loop (the ``scf.for`` whose step
                 is the constant ``BLOCK_X``), i.e. executed per row (or per element) per feature
                 tile. A scalar access is a ``memref.load`` / ``memref.store`` of one global-memory
                 element, a ``bufferization.materialize_in_destination`` of a 1-element tensor (a
                 scalar store, as the adapter emits for masked discrete stores), or a
                 ``tensor.extract`` of a vector element that is NOT marked ``DiscreteMemAccess``
                 (the marked ones read an index to form a DMA or scalar address and are not data
                 accesses). Each op is counted once, statically, wherever it is nested.
``scalar_row``   the same scalar accesses outside the feature-tile loop: once per row (a 1-D gather
                 or scatter such as ``weights[slot]``); they scale with rows, not rows x hidden.
``int_vec_hot``  vector (``tensor<...>``) ``arith.cmpi`` on i32/i64 and ``arith.addi``/``arith.muli``
                 on i64 inside the feature-tile loop: triton-ascend's performance guide says A2/A3
                 vector units run these as scalar code.

Cube kernels (:func:`analyze_cube_ir`) are read around their **K loop**, the ``scf.for`` that holds
the ``linalg.matmul`` a ``tl.dot`` becomes:

``mmad``         ``linalg.matmul`` ops in K loops (the cube work; 0 means tl.dot did not lower to one).
``tile_dma``     ``memref.copy`` of a whole 2-D tile with a unit inner stride in K loops: one DMA per
                 operand tile. ``strided_dma`` counts tile copies whose inner stride is not 1 (a
                 transposing copy, element by element for the DMA engine): gated on 0.
``transposes``   ``linalg.transpose`` in K loops (a tile loaded with its contiguous dimension last and
                 transposed on chip).
``scalar_k``     scalar index reads in K loops (one block index per K-step); ``scalar_data_k`` scalar
                 accesses of floating-point data there (element-wise tile access): gated on 0, as is
                 any ``ExtractedLoadOrStore`` loop inside a K loop (``discrete_k``).
``tile_stores``  2-D tile stores (``materialize_in_destination`` of a ``tensor<AxB>``) outside K loops.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

TARGET_ARCH = "Ascend910B4"  # an A2-class (910B) device
VENV_HINT = (
    "triton-ascend is not installed in this Python environment ({python}). The Ascend compile gate "
    "needs its own virtualenv, because triton-ascend replaces the `triton` package: create it and run "
    "the gate with\n\n    tools/ascend_lowering_env.sh\n\n(it makes .venv-ascend in the repository root "
    "with torch==2.13.0, triton-ascend==3.2.0, pybind11 and numpy, then runs "
    "`PYTHONPATH=. .venv-ascend/bin/python -m megablocks_ascend lower`)."
)

# --------------------------------------------------------------------------------------------
# The configuration table.

DTYPES = {  # name -> (triton signature type, torch dtype attribute, element size)
    "fp32": ("fp32", "float32", 4),
    "fp16": ("fp16", "float16", 2),
    "bf16": ("bf16", "bfloat16", 2),
}
HIDDEN_SIZES = (1024, 1000)  # aligned (a multiple of 16 and of BLOCK_X) and not
SIZE_AXES = ("dtype", "hidden", "index")  # axes that are argument types and sizes, not constexprs
TOP_KS = (1, 2)
BOOLS = (False, True)
LAYOUTS = (0, 1, 2)  # routing.DROPLESS, PADDED, BINNED

# The representative problem whose sizes fill the scalar arguments (their divisibility by 16
# specialises the kernel the way the launcher's real call would).
TOKENS = 4096
EXPERTS = 8
PADDED_EXTRA = 8 * 128  # padded_bins[-1] - bins[-1]
ROUTE_MAP_BLOCK_M = 128  # route_map()'s block_m on a device (it uses 64 only for CPU tensors)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str  # attribute of megablocks_ascend.kernels.routing
    kind: str | None  # devices.tile / devices.ub_bytes kind; None: no feature tiles
    axes: dict  # configuration axes: "dtype", "hidden" and the constexprs the launcher chooses
    derived: tuple  # constexprs derived from the axes (tile sizes, BLOCK_E)
    data_ptrs: tuple  # pointer arguments of the data dtype (others are int32 index tensors)
    row_copy: bool  # moves feature rows: gated on scalar_hot == 0
    module: str = "routing"  # megablocks_ascend.kernels.<module>
    cube: bool = False  # a tl.dot kernel: tiles from devices.cube_tile(kind, ...), IR read by analyze_cube_ir
    ptr_types: tuple = ()  # (argument, triton pointer type) of index pointers that are not *i32
    hot_step: str = "BLOCK_X"  # the constexpr stepping the loop analyze_ir calls hot
    no_scalar_hot: bool = False  # gated on scalar_hot == 0 although it moves no feature rows
    unrolls_top_k: bool = False  # tl.static_range(TOP_K): its launcher passes top_k to devices.tile


ROUTING_KERNELS = (
    KernelSpec("_gather", "gather",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, LAYOUT=LAYOUTS, TOP_K=TOP_KS,
                    SCALE=BOOLS, INT64=BOOLS),
               ("BLOCK_M", "BLOCK_X", "BLOCK_E", "EVEN_X"), ("x", "out", "weights"), True),
    KernelSpec("_gather_tokens", "gather",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, LAYOUT=LAYOUTS, TOP_K=TOP_KS,
                    SCALE=BOOLS, INT64=BOOLS),
               ("BLOCK_M", "BLOCK_X", "BLOCK_E", "EVEN_X"), ("x", "out", "weights"), True, unrolls_top_k=True),
    KernelSpec("_route_map", None, dict(LAYOUT=LAYOUTS), ("BLOCK_M", "BLOCK_E"), (), False),
    KernelSpec("_scatter", "scatter",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, TOP_K=TOP_KS, SCALE=BOOLS, INT64=BOOLS),
               ("BLOCK_M", "BLOCK_X", "EVEN_X"), ("y", "out", "weights"), True, unrolls_top_k=True),
    KernelSpec("_scatter_one", "gather",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, LAYOUT=LAYOUTS, SCALE=BOOLS, INT64=BOOLS),
               ("BLOCK_M", "BLOCK_X", "BLOCK_E", "EVEN_X"), ("y", "out", "weights"), True),
    KernelSpec("_wgrad", "wgrad",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, TOP_K=TOP_KS, INT64=BOOLS),
               ("BLOCK_M", "BLOCK_X", "EVEN_X"), ("y", "grad", "out"), True),
    KernelSpec("_wgrad_one", "wgrad",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, LAYOUT=LAYOUTS, INT64=BOOLS),
               ("BLOCK_M", "BLOCK_X", "BLOCK_E", "EVEN_X"), ("y", "grad", "out"), True),
)

# The block-sparse matmuls (kernels/blocksparse.py): every operand layout stk's and MegaBlocks'
# calls produce (dense operands contiguous or transposed views, i.e. *_CM; blocks and outputs
# contiguous), both transposes of the sparse operand (GATHER: blocks found through
# block_offsets_t), an even and an uneven dense size ("hidden": sdd's K, dsd's N, dds's M).
CUBE_BLOCK = 128  # MegaBlocks' block size
_CUBE_TILE = ("BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP", "OUT_CM", "PRECISION", "WIDEN")
_STK_INDEX = (("row_indices", "*i16"), ("column_indices", "*i16"), ("indices", "*i16"))
INDEX_TYPES = ("i16", "i32")
CUBE_KERNELS = (
    KernelSpec("_sdd", "sdd",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, LHS_CM=BOOLS, RHS_CM=BOOLS, INT64=BOOLS),
               _CUBE_TILE + ("EVEN_K",), ("lhs", "rhs", "out"), False, module="blocksparse", cube=True,
               ptr_types=_STK_INDEX),
    KernelSpec("_dsd", "dsd",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, GATHER=BOOLS, RHS_CM=BOOLS, INT64=BOOLS),
               _CUBE_TILE + ("A_CM", "EVEN_N"), ("data", "rhs", "out"), False, module="blocksparse", cube=True,
               ptr_types=_STK_INDEX),
    KernelSpec("_dds", "dds",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, GATHER=BOOLS, LHS_CM=BOOLS, INT64=BOOLS),
               _CUBE_TILE + ("B_CM", "EVEN_M"), ("lhs", "data", "out"), False, module="blocksparse", cube=True,
               ptr_types=_STK_INDEX),
    KernelSpec("_row_indices", None, dict(index=INDEX_TYPES), ("BLOCK",), ("out",), False, module="blocksparse",
               hot_step="BLOCK", no_scalar_hot=True),
)
# The routing preparation (kernels/preparation.py): a counting sort of expert ids. Keys are the
# router's ids (int32 / int64) or, through the megablocks_ops stand-in, the sparse dMoE's int16 block
# column indices; PLACE=0 is the stand-in's histogram. The tiles come from devices.prep_tile for the
# problem's expert count (EXPERTS, or --experts) and a grid of PREP_PROGRAMS vector cores. Its
# scattered stores (a sort places each item at a computed position) are per-element by nature:
# nothing is gated on them.
PREP_INDEX_TYPES = ("i16", "i32", "i64")
PREP_PROGRAMS = 40  # the vector cores of an A2 (910B) device
ROUTES = (-1, 0, 1, 2)  # preparation.NO_ROUTE, then routing.DROPLESS, PADDED, BINNED
PREPARATION_KERNELS = (
    KernelSpec("_count", None, dict(index=PREP_INDEX_TYPES), ("BLOCK_M", "BLOCK_E"), ("keys",), False,
               module="preparation", hot_step="BLOCK_M"),
    KernelSpec("_place", None, dict(index=PREP_INDEX_TYPES, PLACE=BOOLS, PADDED=BOOLS, ROUTE=ROUTES),
               ("BLOCK_M", "BLOCK_E", "BLOCK_P"), ("keys",), False, module="preparation", hot_step="BLOCK_M"),
)
# The zero fill of the empty groups of a weight gradient (kernels/grouped.py): "hidden" is the
# gradient's last dimension N, with M = FILL_ROWS rows per group (768 x 1024 is a whole number of
# fill tiles, 768 x 1000 is not); ends int64, as the grouped GEMM stand-in passes them.
FILL_ROWS = 768
GROUPED_KERNELS = (
    KernelSpec("_zero_empty_groups", None, dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, INT64=BOOLS),
               ("BLOCK", "EVEN"), ("out",), False, module="grouped", ptr_types=(("ends", "*i64"),),
               hot_step="BLOCK", no_scalar_hot=True),
)
KERNELS = ROUTING_KERNELS + PREPARATION_KERNELS + CUBE_KERNELS + GROUPED_KERNELS


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
        if self.experts != EXPERTS and "BLOCK_E" in self.constexprs:
            parts.append(f"E={self.experts}")
        tiles = [f"{k}={self.constexprs[k]}" for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_X")
                 if k in self.constexprs]
        if "EVEN_X" in self.constexprs:
            tiles.append(f"EVEN_X={int(self.constexprs['EVEN_X'])}")
        tiles += [f"{k}={_show(self.constexprs[k])}" for k in self.overridden
                  if k not in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_X", "EVEN_X")]
        return " ".join(parts + tiles) + (" (set by hand)" if self.overridden else "")


def _show(v):
    return int(v) if isinstance(v, bool) else v


def _scalars(spec: KernelSpec, axes: dict, experts: int = EXPERTS) -> dict:
    top_k = axes.get("TOP_K", 2)
    n = TOKENS * top_k
    layout = axes.get("LAYOUT", 0)
    capacity = n // experts if layout == 2 else 0
    num_rows = {0: n, 1: n + PADDED_EXTRA, 2: experts * capacity}[layout]
    hidden = axes.get("hidden", 0)
    if spec.name == "_gather":
        return dict(num_rows=num_rows, num_positions=n, num_experts=experts, hidden=hidden, capacity=capacity)
    if spec.name == "_gather_tokens":
        return dict(num_tokens=TOKENS, num_rows=num_rows, num_experts=experts, hidden=hidden, capacity=capacity)
    if spec.name == "_route_map":
        return dict(num_positions=n, num_experts=experts, capacity=capacity)
    if spec.name == "_scatter":
        return dict(num_tokens=TOKENS, num_rows=n, hidden=hidden)
    if spec.name in ("_scatter_one", "_wgrad_one"):
        n1 = TOKENS  # top_k == 1
        capacity1 = n1 // experts if layout == 2 else 0
        rows1 = {0: n1, 1: n1 + PADDED_EXTRA, 2: experts * capacity1}[layout]
        return dict(num_positions=n1, num_experts=experts, num_rows=rows1, hidden=hidden, capacity=capacity1)
    if spec.name == "_wgrad":
        return dict(num_slots=n, num_rows=n, hidden=hidden)
    if spec.name in ("_count", "_place"):
        block_m = _prep_block_m(experts)
        chunk = -(-n // (PREP_PROGRAMS * block_m)) * block_m
        scalars = dict(num_items=n, num_keys=experts, key_mask=-1, chunk=chunk)
        if spec.name == "_place":
            scalars.update(block=128, capacity=n // experts)
        return scalars
    if spec.name == "_zero_empty_groups":
        numel, chunk = FILL_ROWS * hidden, _fill_block(axes) * _fill_chunk_blocks()
        return dict(group_numel=numel, group_stride=numel, chunk=chunk, num_items=experts * -(-numel // chunk))
    raise KeyError(spec.name)


def _fill_block(axes: dict) -> int:
    import torch  # noqa: PLC0415

    from megablocks_ascend import devices  # noqa: PLC0415
    return devices.fill_block(getattr(torch, DTYPES[axes["dtype"]][1]), "npu")


def _fill_chunk_blocks() -> int:
    from megablocks_ascend import devices  # noqa: PLC0415
    return devices.FILL_CHUNK_BLOCKS


def _prep_block_m(experts: int) -> int:
    from megablocks_ascend import devices  # noqa: PLC0415
    return devices.prep_tile(experts, "npu").block_m


# The representative block-sparse problem: a MegaBlocks topology of 64 block rows (8192 padded
# tokens) by 128 block columns (8 experts x 2048 ffn), 16 blocks per row.
CUBE_ROWS, CUBE_COLS, CUBE_PER_ROW = 64, 128, 16


def _cube_scalars(spec: KernelSpec, axes: dict) -> dict:
    b, dense = CUBE_BLOCK, axes.get("hidden", 0)
    m, n = CUBE_ROWS * b, CUBE_COLS * b
    nnz = CUBE_ROWS * CUBE_PER_ROW
    if spec.name == "_sdd":  # lhs [m, dense] @ rhs [dense, n]
        lhs = (1, m) if axes["LHS_CM"] else (dense, 1)
        rhs = (1, dense) if axes["RHS_CM"] else (n, 1)
        return dict(K=dense, nnz=nnz, block_rows=CUBE_ROWS, block_cols=CUBE_COLS, row_width=CUBE_PER_ROW,
                    stride_lm=lhs[0], stride_lk=lhs[1], stride_rk=rhs[0], stride_rn=rhs[1],
                    stride_ob=b * b, stride_om=b, stride_on=1)
    if spec.name == "_dsd":  # op(S) [m, n] @ rhs [n, dense]; GATHER: S transposed
        a = (1, b) if axes["GATHER"] else (b, 1)
        rhs = (1, n) if axes["RHS_CM"] else (dense, 1)
        return dict(M=m, N=dense, nnz=nnz, k_blocks=CUBE_COLS, stride_db=b * b, stride_am=a[0], stride_ak=a[1],
                    stride_rk=rhs[0], stride_rn=rhs[1], stride_om=dense, stride_on=1)
    if spec.name == "_dds":  # lhs [dense, m] @ op(S) [m, n]; GATHER: S itself (walked by columns)
        lhs = (1, dense) if axes["LHS_CM"] else (m, 1)
        bk = (b, 1) if axes["GATHER"] else (1, b)
        return dict(M=dense, N=n, nnz=nnz, k_blocks=CUBE_ROWS, stride_lm=lhs[0], stride_lk=lhs[1],
                    stride_db=b * b, stride_bk=bk[0], stride_bn=bk[1], stride_om=n, stride_on=1)
    if spec.name == "_row_indices":
        return dict(block_rows=CUBE_ROWS, nnz=nnz)
    raise KeyError(spec.name)


def _cube_constexprs(spec: KernelSpec, axes: dict):
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
        c["EVEN_K"] = dense % t.block_k == 0
    elif spec.name == "_dsd":
        c.update(A_CM=axes["GATHER"], EVEN_N=dense % t.block_n == 0)
    else:
        c.update(B_CM=not axes["GATHER"], EVEN_M=dense % t.block_m == 0)
    return c, devices.cube_bytes(t, es)


def configs(kernels: Iterable[KernelSpec] = KERNELS, *, axes: dict | None = None, experts: int = EXPERTS,
            overrides: dict | None = None) -> list[Config]:
    """Every configuration of every kernel: the product of its axes, tiles derived as on an NPU.

    ``axes`` replaces the values of the named axes in every kernel that has them (``--axis``: more
    hidden sizes or top_k values than the table's, or fewer); ``experts`` is the problem's expert
    count (``BLOCK_E``); ``overrides`` sets constexprs by hand after they are derived (``--set``:
    tiles no launcher would choose, to show what the back end does with them). The memory model
    (``ub_bytes``, ``cube_bytes``) is that of the tile the configuration ends up with."""
    import torch  # noqa: PLC0415

    from megablocks_ascend import devices  # noqa: PLC0415

    axes, overrides = dict(axes or {}), dict(overrides or {})
    out = []
    for spec in kernels:
        names = list(spec.axes)
        values = [tuple(axes[n]) if n in axes else spec.axes[n] for n in names]
        for combo in itertools.product(*values):
            ax = dict(zip(names, combo))
            if spec.module == "blocksparse":
                constexprs, cube = _cube_constexprs(spec, ax)
                scalars = _cube_scalars(spec, ax)
            else:
                constexprs = {k: v for k, v in ax.items() if k not in SIZE_AXES}
                cube = None
                if spec.module == "grouped":
                    block = _fill_block(ax)
                    constexprs.update(BLOCK=block, EVEN=FILL_ROWS * ax["hidden"] % block == 0)
                elif spec.kind is not None:
                    _, torch_name, _ = DTYPES[ax["dtype"]]
                    t = devices.tile(spec.kind, getattr(torch, torch_name), ax["hidden"], "npu",
                                     **_tile_args(spec, ax, experts))
                    constexprs.update(BLOCK_M=t.block_m, BLOCK_X=t.block_x, EVEN_X=ax["hidden"] % t.block_x == 0)
                elif spec.module == "preparation":
                    constexprs["BLOCK_M"] = _prep_block_m(experts)
                    if "BLOCK_P" in spec.derived:
                        constexprs["BLOCK_P"] = devices.prep_block_p(PREP_PROGRAMS, devices.block_e(experts))
                else:
                    constexprs["BLOCK_M"] = ROUTE_MAP_BLOCK_M
                if "BLOCK_E" in spec.derived:
                    constexprs["BLOCK_E"] = devices.block_e(experts)
                scalars = _scalars(spec, ax, experts)
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
            out.append(Config(spec.name, ax, constexprs, scalars, _model_ub(spec, ax, constexprs, experts), cube,
                              experts, tuple(sorted(mine))))
    return out


def _tile_args(spec: KernelSpec, axes: dict, experts: int) -> dict:
    """What a kernel's launcher passes to ``devices.tile`` besides the dtype and hidden size
    (``routing._tile``): its top_k (kernels that unroll their slots) and expert count (those that
    take the bins: the ``BLOCK_E`` kernels)."""
    return dict(top_k=axes.get("TOP_K", 1) if spec.unrolls_top_k else 1,
                num_experts=experts if "BLOCK_E" in spec.derived else 1)


def _model_ub(spec: KernelSpec, axes: dict, constexprs: dict, experts: int = EXPERTS) -> int | None:
    """``devices.ub_bytes`` of a vector kernel's configuration (None: no feature tiles)."""
    from megablocks_ascend import devices  # noqa: PLC0415
    if spec.module == "grouped":
        return devices.fill_ub_bytes(constexprs["BLOCK"], DTYPES[axes["dtype"]][2])
    if spec.kind is None or spec.cube:
        return None
    args = _tile_args(spec, axes, experts)
    return devices.ub_bytes(spec.kind, constexprs["BLOCK_M"], constexprs["BLOCK_X"], DTYPES[axes["dtype"]][2],
                            even=bool(constexprs["EVEN_X"]), top_k=args["top_k"],
                            block_e=devices.block_e(args["num_experts"]))


def kernel_params(fn: Callable) -> tuple[list[str], list[str]]:
    """(runtime argument names, constexpr names) of a kernel function, from its signature."""
    runtime, constexpr = [], []
    for p in inspect.signature(fn).parameters.values():
        ann = p.annotation
        is_const = "constexpr" in (ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann)))
        (constexpr if is_const else runtime).append(p.name)
    return runtime, constexpr


# --------------------------------------------------------------------------------------------
# Reading the IR.


@dataclasses.dataclass
class Loop:
    header: str
    depth: int
    attrs: str = ""
    ops: list = dataclasses.field(default_factory=list)  # lines directly in this loop (not nested loops)
    children: list = dataclasses.field(default_factory=list)
    parent: "Loop | None" = None

    def ancestors(self):
        p = self.parent
        while p is not None:
            yield p
            p = p.parent

    def all_ops(self):
        yield from self.ops
        for c in self.children:
            yield from c.all_ops()


_FOR_RE = re.compile(r"=?\s*scf\.for\s+%\S+\s*=\s*(\S+)\s+to\s+(\S+)\s+step\s+(%[\w.]+)")
_CONST_RE = re.compile(r"^\s*(%[\w.]+)\s*=\s*arith\.constant\s+(-?\d+)\s*:\s*(i\d+|index)\b")
_SCALAR_ACCESS_RE = re.compile(
    r"\bmemref\.(load|store)\s"  # one element of global memory
    r"|\bbufferization\.materialize_in_destination\s.*:\s*\(tensor<(1x)*1x[a-z]"  # a 1-element store
    r"|\btensor\.extract\s(?!.*\{DiscreteMemAccess\})")  # an element read that is not an address
# A row copy: a DMA load (memref.copy) or a DMA store of a 1 x N slice (materialize_in_destination).
_ROW_COPY_RE = re.compile(
    r"\bmemref\.copy\b"
    r"|\bbufferization\.materialize_in_destination\s.*:\s*\(tensor<1x(\?|[2-9]|\d\d+)")
_VEC_INT_RE = re.compile(r"\barith\.(cmpi|addi|muli)\b.*:\s*tensor<[^>]*x(i32|i64)>")


def parse_loops(ir: str) -> tuple[list[Loop], dict[str, int]]:
    """The ``scf.for`` loops of an IR module as a tree (roots returned) and its integer constants."""
    consts: dict[str, int] = {}
    roots: list[Loop] = []
    stack: list[Any] = []  # Loop for scf.for regions, None for other regions
    for line in ir.splitlines():
        s = line.strip()
        m = _CONST_RE.match(line)
        if m:
            consts[m.group(1)] = int(m.group(2))
        closes = s.startswith("}")
        if closes and stack:
            region = stack.pop()
            if isinstance(region, Loop):
                rest = s[1:].strip()
                region.attrs = rest
        current = next((r for r in reversed(stack) if isinstance(r, Loop)), None)
        if current is not None and not closes:
            current.ops.append(s)
        if s.endswith("{"):
            if "scf.for" in s and not closes:
                loop = Loop(header=s, depth=len(stack), parent=current)
                (current.children if current is not None else roots).append(loop)
                stack.append(loop)
            else:
                stack.append(None)
    return roots, consts


def _walk(loops: list[Loop]):
    for loop in loops:
        yield loop
        yield from _walk(loop.children)


def _step(loop: Loop, consts: dict[str, int]) -> int | None:
    m = _FOR_RE.search(loop.header)
    return consts.get(m.group(3)) if m else None


def analyze_ir(ir: str, block_x: int | None = None) -> dict:
    """Static counts of an Ascend linalg/HIVM module's memory pattern (see the module docstring).

    ``block_x`` identifies the feature-tile loop (step ``BLOCK_X``); without it nothing is "hot".
    """
    roots, consts = parse_loops(ir)
    loops = list(_walk(roots))

    def is_feature_loop(lp: Loop) -> bool:
        return block_x is not None and "ExtractedLoadOrStore" not in lp.attrs and _step(lp, consts) == block_x

    def in_feature_loop(lp: Loop) -> bool:
        return is_feature_loop(lp) or any(is_feature_loop(a) for a in lp.ancestors())

    res = dict(row_dma=0, row_dma_hot=0, scalar_hot=0, scalar_row=0, int_vec_hot=0, int_vec=0,
               discrete_loops=0, parallel_loops=0, feature_loops=0)
    for lp in loops:
        hot = in_feature_loop(lp)
        if is_feature_loop(lp):
            res["feature_loops"] += 1
        nested = any("ExtractedLoadOrStore" in a.attrs for a in lp.ancestors())
        if "ExtractedLoadOrStore" in lp.attrs and not nested:  # an outer one counts its nested loops
            res["discrete_loops"] += 1
            if "hivm.parallel_loop" in lp.attrs:
                res["parallel_loops"] += 1
            body = list(lp.all_ops())
            copies = sum(1 for op in body if _ROW_COPY_RE.search(op))
            if copies:
                res["row_dma"] += copies
                if hot:
                    res["row_dma_hot"] += copies
            scalars = sum(1 for op in body if _SCALAR_ACCESS_RE.search(op))
            res["scalar_hot" if hot else "scalar_row"] += scalars
        for op in lp.ops:
            if _VEC_INT_RE.search(op):
                kind, ty = _VEC_INT_RE.search(op).groups()
                if kind == "cmpi" or ty == "i64":
                    res["int_vec"] += 1
                    if hot:
                        res["int_vec_hot"] += 1
    # scalar accesses in loops the adapter did not mark (none seen in 3.2.0, but count them)
    unmarked = 0
    for lp in loops:
        if "ExtractedLoadOrStore" in lp.attrs:
            continue
        if any("ExtractedLoadOrStore" in a.attrs for a in lp.ancestors()):
            continue
        unmarked += sum(1 for op in lp.ops if _SCALAR_ACCESS_RE.search(op))
        # ... and any loop not marked counts as hot when inside the feature loop
        if in_feature_loop(lp):
            res["scalar_hot"] += sum(1 for op in lp.ops if _SCALAR_ACCESS_RE.search(op))
    res["scalar_unmarked"] = unmarked
    return res


_MATMUL_RE = re.compile(r"\blinalg\.(batch_)?matmul(_transpose_[ab])?\b")
_COPY_SRC_RE = re.compile(r"\bmemref\.copy\s[^:]*:\s*memref<(\d+|\?)x(\d+|\?)x\w+(?:,\s*strided<\[([^\]]*)\])?")
_TILE_STORE_RE = re.compile(r"\bbufferization\.materialize_in_destination\s.*:\s*\(tensor<(\d+|\?)x(\d+|\?)x")
_SCALAR_TYPE_RE = re.compile(r":\s*memref<(?:1x)*1x(\w+)|:\s*\(tensor<(?:1x)*1x(\w+)|:\s*tensor<[^>]*x(\w+)>\s*$")
_MIX_MODE_RE = re.compile(r'mix_mode\s*=\s*"(\w+)"')


def analyze_cube_ir(ir: str) -> dict:
    """Static counts of a cube kernel's Ascend IR around its K loops (see the module docstring)."""
    roots, _ = parse_loops(ir)
    loops = list(_walk(roots))
    k_loops = [lp for lp in loops if any(_MATMUL_RE.search(op) for op in lp.ops)]
    res = dict(mmad=0, tile_dma=0, strided_dma=0, transposes=0, scalar_k=0, scalar_data_k=0, discrete_k=0,
               tile_stores=0, k_loops=len(k_loops))
    mode = _MIX_MODE_RE.search(ir)
    res["mix_mode"] = mode.group(1) if mode else None
    in_k = set()
    for lp in k_loops:
        in_k.add(id(lp))
        for d in _walk(lp.children):
            in_k.add(id(d))
            if "ExtractedLoadOrStore" in d.attrs:
                res["discrete_k"] += 1
        for op in lp.all_ops():
            if _MATMUL_RE.search(op):
                res["mmad"] += 1
            if "linalg.transpose" in op:
                res["transposes"] += 1
            m = _COPY_SRC_RE.search(op)
            if m:
                strides = [x.strip() for x in (m.group(3) or "").split(",") if x.strip()]
                unit_inner = not strides or strides[-1] == "1"
                res["tile_dma" if unit_inner else "strided_dma"] += 1
            if _SCALAR_ACCESS_RE.search(op):
                t = _SCALAR_TYPE_RE.search(op)
                ty = next((g for g in t.groups() if g), "") if t else ""
                res["scalar_data_k" if ty.startswith(("f", "bf")) else "scalar_k"] += 1
    for lp in loops:
        if id(lp) in in_k:
            continue
        for op in lp.ops:
            m = _TILE_STORE_RE.search(op)
            if m and m.group(1) != "1":
                res["tile_stores"] += 1
    return res


def cube_problems(counts: dict) -> list[str]:
    """Why a cube kernel's IR fails the gate (empty: it passes)."""
    problems = []
    if counts["mmad"] == 0:
        problems.append("no linalg.matmul in a K loop: tl.dot did not lower to cube work")
    if counts["tile_dma"] == 0:
        problems.append("no whole-tile DMA in the K loop")
    if counts["strided_dma"]:
        problems.append(f"{counts['strided_dma']} tile copies with a non-unit inner stride in the K loop")
    if counts["scalar_data_k"]:
        problems.append(f"{counts['scalar_data_k']} scalar data accesses in the K loop")
    if counts["discrete_k"]:
        problems.append(f"{counts['discrete_k']} element-wise (ExtractedLoadOrStore) loops in the K loop")
    if counts["tile_stores"] == 0:
        problems.append("no whole-tile store of the result")
    return problems


# --------------------------------------------------------------------------------------------
# Lowering.


class TritonAscendMissing(RuntimeError):
    pass


def have_triton_ascend() -> bool:
    """Whether the installed ``triton`` is triton-ascend, without importing triton if it is not yet."""
    try:
        if "triton" in sys.modules:
            return importlib.util.find_spec("triton.backends.ascend") is not None
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(p) / "backends" / "ascend" / "compiler.py").is_file()
               for p in spec.submodule_search_locations)


def require_triton_ascend() -> None:
    if not have_triton_ascend():
        raise TritonAscendMissing(VENV_HINT.format(python=sys.executable))


def _prepare_triton() -> None:
    """Make sure ``triton.jit`` compiles rather than interprets in this process."""
    if "triton" not in sys.modules:
        # megablocks_ascend/__init__ switches the interpreter on when nothing imported triton yet;
        # the lowering gate never wants it ("0" also stops __init__ from setting it).
        os.environ["TRITON_INTERPRET"] = "0"
        return
    from megablocks_ascend import compat  # noqa: PLC0415
    if compat.interpreter_active():
        raise InterpreterOn(
            "triton was imported with TRITON_INTERPRET=1 before the lowering gate ran, so its kernels "
            "are interpreted and cannot be lowered; run it as `TRITON_INTERPRET=0 python -m "
            "megablocks_ascend lower`")


class InterpreterOn(RuntimeError):
    pass


class _Ptr:
    """Stands in for a tensor argument: 16-byte aligned, as torch allocations are."""

    def data_ptr(self) -> int:
        return 1 << 20


def _signature(spec: KernelSpec, cfg: Config, runtime: list[str]) -> tuple[dict, dict]:
    sig, values = {}, {}
    ptr_types = dict(spec.ptr_types)
    for name in runtime:
        if name in cfg.scalars:
            sig[name] = "i32"
            values[name] = cfg.scalars[name]
        elif name in spec.data_ptrs:
            elem = DTYPES[cfg.axes["dtype"]][0] if "dtype" in cfg.axes else cfg.axes["index"]
            sig[name] = "*" + elem
            values[name] = _Ptr()
        else:
            sig[name] = ptr_types.get(name, "*i32")
            values[name] = _Ptr()
    return sig, values


def _kernel(spec: KernelSpec):
    """The ``compat.Kernel`` a table entry names."""
    module = importlib.import_module(f"megablocks_ascend.kernels.{spec.module}")
    return getattr(module, spec.name)


class Lowerer:
    def __init__(self, arch: str = TARGET_ARCH):
        require_triton_ascend()  # does not import triton
        _prepare_triton()  # before anything imports triton
        from triton.backends.ascend.compiler import AscendBackend  # noqa: PLC0415
        from triton.backends.compiler import GPUTarget  # noqa: PLC0415
        self.target = GPUTarget("npu", arch, 0)
        self.backend = AscendBackend(self.target)

    def lower(self, spec: KernelSpec, cfg: Config) -> tuple[str, str]:
        """(TTIR, Ascend linalg/HIVM IR) of one configuration."""
        from triton._C.libtriton import ir  # noqa: PLC0415
        from triton.compiler.compiler import ASTSource  # noqa: PLC0415

        kern = _kernel(spec)
        jit = kern.jit
        runtime, constexpr = kernel_params(kern.fn)
        sig, values = _signature(spec, cfg, runtime)
        for name in constexpr:
            sig[name] = "constexpr"
        attrs = self.backend.get_attrs_descriptor(
            jit.params, [values[p.name] if p.name in values else cfg.constexprs[p.name] for p in jit.params])
        constants = dict(cfg.constexprs)
        for num in attrs.get_constants():  # scalar arguments equal to 1 become constants
            if jit.params[num].name in values:
                constants[jit.params[num].name] = values[jit.params[num].name]
        src = ASTSource(jit, sig, constants, attrs)
        options = self.backend.parse_options({})
        metadata = {"hash": f"gate-{spec.name}", "target": self.target, **options.__dict__}
        stages: dict = {}
        self.backend.add_stages(stages, options)
        context = ir.context()
        ir.load_dialects(context)
        self.backend.load_dialects(context)
        module = src.make_ir(options, self.backend.get_codegen_implementation(),
                             self.backend.get_module_map(), context)
        module = stages["ttir"](module, metadata)
        ttir = str(module)
        return ttir, stages["ttadapter"](module, metadata)


TOOL_CRASH_RETRIES = 2


def _tool_crash(exc: BaseException) -> bool:
    """A pass tool of the backend killed by a signal (not a compile error: those exit normally)."""
    import subprocess  # noqa: PLC0415
    return isinstance(exc, subprocess.CalledProcessError) and exc.returncode is not None and exc.returncode < 0


def _lower_retrying_tool_crashes(lowerer, spec, cfg):
    """``lowerer.lower`` with up to :data:`TOOL_CRASH_RETRIES` more tries when ``triton-adapter-opt``
    dies of a signal: triton-ascend 3.2.0's adapter aborts now and then on the same input
    ("Malformed type storage object", ~1-2% of runs for some int64 ``_dsd`` configurations, with
    or without MLIR threading; docs/notes/blocksparse-kernels.md). A crash that repeats fails the
    configuration; one that does not is reported in the row (``tool_crashes``) and after the tables."""
    for attempt in range(TOOL_CRASH_RETRIES + 1):
        try:
            ttir, linalg = lowerer.lower(spec, cfg)
            return ttir, linalg, attempt
        except Exception as exc:  # noqa: BLE001
            if not _tool_crash(exc) or attempt == TOOL_CRASH_RETRIES:
                raise


def _error_text(exc: BaseException) -> str:
    stderr = getattr(exc, "stderr", None)
    if isinstance(stderr, bytes):
        stderr = stderr.decode("utf-8", "replace")
    text = f"{type(exc).__name__}: {exc}"
    if stderr:
        text += "\n" + stderr
    return text.strip()


def _stem(cfg: Config) -> str:
    return f"{cfg.kernel}__" + re.sub(r"[^\w=.-]+", "_", cfg.label)


def run(kernels: Iterable[KernelSpec] = KERNELS, *, dump: str | None = None,
        lowerer: Lowerer | None = None, only: str | None = None, backend=None,
        cfgs: list[Config] | None = None) -> list[dict]:
    """Lower every configuration; one result dict per configuration.

    ``backend`` (a :class:`megablocks_ascend.cli.bishengir.Stage`) compiles each lowered module
    with bishengir-compile for every gated target, in a pool of threads (the compiler is a
    subprocess) while the front end goes on with the next configurations; None: the front end only.
    """
    lowerer = lowerer or Lowerer()
    specs = {s.name: s for s in kernels}
    cfgs = configs(specs.values()) if cfgs is None else cfgs
    results, pending = [], []
    pool = None
    if backend is not None:
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415
        pool = ThreadPoolExecutor(max_workers=backend.jobs)
    try:
        for cfg in cfgs:
            spec = specs[cfg.kernel]
            if only and only not in cfg.kernel:
                continue
            row, linalg = _front_end(lowerer, spec, cfg, dump)
            results.append(row)
            if pool is not None and linalg is not None:
                keep = Path(dump) / _stem(cfg) if dump else None
                futures = {t: pool.submit(backend.compile, linalg, t, keep=keep and str(keep) + f".{t}")
                           for t in backend.targets}
                pending.append((row, spec, cfg, futures))
        for row, spec, cfg, futures in pending:
            _back_end(row, spec, cfg, {t: f.result() for t, f in futures.items()})
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return results


def _front_end(lowerer, spec: KernelSpec, cfg: Config, dump: str | None) -> tuple[dict, str | None]:
    """triton-ascend's ttir and ttadapter stages and the IR's counts: (row, Ascend IR or None)."""
    from megablocks_ascend import devices  # noqa: PLC0415

    row = dict(kernel=cfg.kernel, config=cfg.label, axes=cfg.axes, constexprs=cfg.constexprs,
               ub_bytes=cfg.ub_bytes, row_copy=spec.row_copy, cube=spec.cube, cube_bytes=cfg.cube_bytes,
               experts=cfg.experts, overridden=list(cfg.overridden))
    t0 = time.perf_counter()
    linalg = None
    try:
        ttir, linalg, retries = _lower_retrying_tool_crashes(lowerer, spec, cfg)
    except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
        row.update(status="FAIL", error=_error_text(exc))
    else:
        if retries:
            row["tool_crashes"] = retries
        if spec.cube:
            counts = analyze_cube_ir(linalg)
            row.update(counts)
            problems = cube_problems(counts)
            over = {k: v for k, v in cfg.cube_bytes.items() if v > devices.CUBE_LIMITS[k]}
            if over:
                problems.append(f"cube tile over the A2 budget: {over}")
        else:
            counts = analyze_ir(linalg, cfg.constexprs.get(spec.hot_step))
            row.update(counts)
            row["mix_mode"] = (_MIX_MODE_RE.search(linalg) or [None, None])[1]
            problems = []
        if spec.no_scalar_hot and counts["scalar_hot"] > 0:
            problems.append(f"{counts['scalar_hot']} scalar accesses in the store loop")
        if spec.row_copy and counts["scalar_hot"] > 0:
            problems.append(f"{counts['scalar_hot']} scalar accesses in the feature-tile loop")
        if spec.row_copy and counts["row_dma"] == 0:
            problems.append("no per-row DMA: the row tiles did not lower to row copies")
        if cfg.ub_bytes is not None and cfg.ub_bytes > devices.UB_BYTES - devices.UB_RESERVE:
            problems.append(f"UB estimate {cfg.ub_bytes} over budget")
        row.update(status="FAIL" if problems else "ok", error="; ".join(problems))
        if dump:
            d = Path(dump)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{_stem(cfg)}.ttir.mlir").write_text(ttir)
            (d / f"{_stem(cfg)}.ttadapter.mlir").write_text(linalg)
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row, linalg


# What an A2/A3 launch needs of each kind of kernel (docs/notes/ascend-lowering.md, "Launch
# metadata"): triton-ascend 3.2.0 registers an "aiv" binary as a vector-core ELF and launches one
# block per vector core; any other mix_mode as an AI-core ELF, one block per AI core. bishengir's
# plan says what the kernel is: its module core type and the task type the launcher reads back.
LAUNCH = {False: dict(mix_modes=("aiv",), core_type="AIV", task_type=10),
          True: dict(mix_modes=("aic", "mix"), core_type="AIC", task_type=20)}


def _back_end(row: dict, spec: KernelSpec, cfg: Config, by_target: dict) -> None:
    """Fold the back end's results (one per target) into the row, with the gate's checks on them:
    the compile itself, the launch metadata, and the memory model against the plan."""
    problems = []
    row["backend"] = by_target
    first = next(iter(by_target.values()))
    for target, res in by_target.items():
        tag = f"{target}: " if len(by_target) > 1 else ""
        problems += [tag + p for p in res["problems"]]
    plan = first.get("plan")
    if plan is not None:
        peak = plan["peak"]
        row.update(plan=plan, core_type=plan["core_type"], task_type=plan["task_type"],
                   ub_plan=peak["ub"], l1_plan=peak["cbuf"], l0c_plan=peak["cc"],
                   buffers=sum(plan["buffers"].values()),
                   sync="{set_flag}/{wait_flag}/{pipe_barrier}".format(**plan["sync"]))
        want = LAUNCH[spec.cube]
        mode = first.get("mix_mode")
        if mode not in want["mix_modes"] or plan["core_type"] != want["core_type"] \
                or plan["task_type"] != want["task_type"]:
            problems.append(f"launch metadata: adapter mix_mode {mode!r}, planned core type "
                            f"{plan['core_type']}, task type {plan['task_type']}; a "
                            f"{'cube' if spec.cube else 'vector'} kernel needs {want}")
        problems += model_problems(cfg, plan)
        for target, res in list(by_target.items())[1:]:
            other = res.get("plan")
            if other is not None and other["peak"] != peak:
                row.setdefault("plan_differs", {})[target] = other["peak"]
    if problems:
        row["status"] = "FAIL"
        row["error"] = "; ".join(([row["error"]] if row.get("error") else []) + problems)


def model_problems(cfg: Config, plan: dict) -> list[str]:
    """Where ``devices``' memory model is not an upper bound of the planned peaks."""
    peak, out = plan["peak"], []
    if cfg.ub_bytes is not None and peak["ub"] > cfg.ub_bytes:
        out.append(f"memory model short: UB planned {peak['ub']} > devices.ub_bytes {cfg.ub_bytes}")
    if cfg.cube_bytes is not None:
        for space, key in (("cbuf", "l1"), ("cc", "l0c")):
            if peak[space] > cfg.cube_bytes[key]:
                out.append(f"memory model short: {key.upper()} planned {peak[space]} > "
                           f"devices.cube_bytes {cfg.cube_bytes[key]}")
    return out


def _pct(row: dict, key: str, space: str) -> str | None:
    plan = row.get("plan")
    if plan is None or row.get(key) is None:
        return None
    return f"{row[key]} {100 * row[key] / plan['capacity'][space]:.0f}%"


COLUMNS = (("kernel", "kernel"), ("config", "configuration"), ("status", "status"),
           ("row_dma", "row DMA"), ("scalar_hot", "scalar/hot"), ("scalar_row", "scalar/row"),
           ("int_vec_hot", "int-vec/hot"), ("ub_bytes", "UB model"), ("ub_plan%", "UB planned"),
           ("buffers", "buffers"), ("sync", "sync s/w/b"), ("core_type", "core"))


CUBE_COLUMNS = (("kernel", "kernel"), ("config", "configuration"), ("status", "status"),
                ("mix_mode", "mode"), ("mmad", "matmul"), ("tile_dma", "tile DMA"), ("transposes", "transp."),
                ("scalar_k", "index/K"), ("scalar_data_k", "scalar/K"), ("tile_stores", "tile st."),
                ("l0c", "L0C model"), ("l0c_plan%", "L0C planned"), ("l1", "L1 model"), ("l1_plan%", "L1 planned"),
                ("ub_plan%", "UB planned"), ("buffers", "buffers"), ("sync", "sync s/w/b"), ("core_type", "core"))

_PLANNED = {"ub_plan%": ("ub_plan", "ub"), "l1_plan%": ("l1_plan", "cbuf"), "l0c_plan%": ("l0c_plan", "cc")}


def _table(results: list[dict], columns) -> list[str]:
    def cell(r, k):
        if k in _PLANNED:
            v = _pct(r, *_PLANNED[k])
        else:
            v = r.get(k, (r.get("cube_bytes") or {}).get(k))
        return "-" if v is None else str(v)
    rows = [[cell(r, k) for k, _ in columns] for r in results]
    head = [h for _, h in columns]
    widths = [max([len(head[i])] + [len(row[i]) for row in rows]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def plan_summary(results: list[dict]) -> list[str]:
    """The back end in a few lines: the highest planned peak of each memory (and where), the
    smallest headroom of the memory model over the plan, and targets whose plans differ."""
    planned = [r for r in results if r.get("plan")]
    if not planned:
        return []
    lines = []
    for key, space, name in (("ub_plan", "ub", "UB"), ("l1_plan", "cbuf", "L1"), ("l0c_plan", "cc", "L0C")):
        top = max(planned, key=lambda r: r[key])
        if top[key]:
            lines.append(f"  highest planned {name}: {_pct(top, key, space)} of {top['plan']['capacity'][space]}"
                         f" ({top['kernel']} [{top['config']}])")
    vec = [r for r in planned if r.get("ub_bytes")]
    if vec:
        tight = min(vec, key=lambda r: r["ub_bytes"] - r["ub_plan"])
        lines.append(f"  memory model over the UB plan: least headroom {tight['ub_bytes'] - tight['ub_plan']} bytes "
                     f"({tight['kernel']} [{tight['config']}]), most "
                     f"{max(r['ub_bytes'] - r['ub_plan'] for r in vec)}")
    differs = [r for r in planned if r.get("plan_differs")]
    lines.append(f"  targets with a different plan from the first: {len(differs)} configurations")
    return lines


def format_table(results: list[dict], header: list[str] | None = None, footer: list[str] | None = None) -> str:
    """The report: one line per configuration (vector kernels, then cube kernels), the back end's
    summary and error details after the tables, ``lowered: N/M`` last."""
    vector = [r for r in results if not r.get("cube")]
    cube = [r for r in results if r.get("cube")]
    lines = list(header or [])
    if vector or not cube:
        lines += _table(vector, COLUMNS)
    if cube:
        lines += ([""] if lines else []) + _table(cube, CUBE_COLUMNS)
    summary = plan_summary(results)
    if summary:
        lines += ["", "memory plans (bishengir-compile, first target):"] + summary
    failures = [r for r in results if r["status"] != "ok"]
    if failures:  # one line per kernel and distinct error, with the first configuration that hit it
        groups: dict = {}
        for r in failures:
            first = (r.get("error") or "").strip().splitlines()
            groups.setdefault((r["kernel"], first[-1] if first else "?"), []).append(r["config"])
        lines.append("")
        lines.append("failures:")
        for (kernel, error), cfgs in groups.items():
            more = f" (+{len(cfgs) - 1} more)" if len(cfgs) > 1 else ""
            lines.append(f"  {kernel} [{cfgs[0]}]{more}: {error}")
    crashed = [r for r in results if r.get("tool_crashes")]
    if crashed:
        lines.append("")
        lines.append("tool crashes retried (triton-adapter-opt killed by a signal, then lowered):")
        lines.extend(f"  {r['kernel']} [{r['config']}]: {r['tool_crashes']}" for r in crashed)
    lines += list(footer or [])
    ok = sum(1 for r in results if r["status"] == "ok")
    lines.append(f"lowered: {ok}/{len(results)}")
    return "\n".join(lines)


def _parse_values(text: str):
    out = []
    for v in text.split(","):
        v = v.strip()
        if v.lower() in ("true", "false"):
            out.append(v.lower() == "true")
        else:
            try:
                out.append(int(v))
            except ValueError:
                out.append(v)
    return out


def _pairs(items, what: str, single: bool) -> dict:
    out = {}
    for item in items or ():
        name, sep, values = item.partition("=")
        if not sep or not name or not values:
            raise ValueError(f"{what} {item!r}: expected NAME=VALUE{'' if single else '[,VALUE...]'}")
        vals = _parse_values(values)
        if single and len(vals) != 1:
            raise ValueError(f"{what} {item!r}: one value")
        out[name] = vals[0] if single else tuple(vals)
    return out


def main(args) -> int:
    """The ``lower`` subcommand (see :func:`add_arguments`)."""
    from megablocks_ascend.cli import bishengir  # noqa: PLC0415
    try:
        axes = _pairs(getattr(args, "axis", None), "--axis", single=False)
        overrides = _pairs(getattr(args, "set", None), "--set", single=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chosen = [s for s in KERNELS if not args.only or args.only in s.name]
    unknown = [f"--axis {n}" for n in axes if not any(n in s.axes for s in chosen)]
    unknown += [f"--set {n}" for n in overrides if not any(n in s.derived or n in s.axes for s in chosen)]
    if unknown:
        print(f"error: {', '.join(unknown)}: no kernel{' matching --only ' + args.only if args.only else ''} "
              f"has it", file=sys.stderr)
        return 2
    try:
        lowerer = Lowerer(args.arch)
    except TritonAscendMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except InterpreterOn as exc:
        if os.environ.get("_MEGABLOCKS_ASCEND_LOWER_REEXEC") or not getattr(args, "argv", None):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        # Something imported triton in interpreter mode first (megablocks_ascend/__init__ does on a
        # machine without devices): start again in a process where TRITON_INTERPRET=0 from the outset.
        import subprocess  # noqa: PLC0415
        env = dict(os.environ, TRITON_INTERPRET="0", _MEGABLOCKS_ASCEND_LOWER_REEXEC="1")
        return subprocess.call([sys.executable, "-m", "megablocks_ascend", *args.argv], env=env)
    header, backend = [], None
    if getattr(args, "front_end_only", False):
        header.append("back end: not run (--front-end-only): triton-ascend's ttir and ttadapter stages only")
    else:
        try:
            backend = make_backend(lowerer, getattr(args, "targets", None) or bishengir.GATED_TARGETS,
                                   getattr(args, "jobs", None))
        except (bishengir.CompilerMissing, bishengir.StageMismatch) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        header += backend.describe()
    specs = KERNELS
    try:
        cfgs = configs(specs, axes=axes, experts=getattr(args, "experts", None) or EXPERTS, overrides=overrides)
    except (KeyError, ValueError) as exc:
        print(f"error: --axis/--set: {exc!r}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = run(specs, dump=args.dump, lowerer=lowerer, only=args.only, backend=backend, cfgs=cfgs)
    wall = time.perf_counter() - t0
    front = sum(r["seconds"] for r in results)
    back = sum(res["seconds"] for r in results for res in (r.get("backend") or {}).values())
    timing = (f"time: {wall:.0f} s for {len(results)} configurations (front end {front:.0f} s in one "
              f"process" + (f"; back end {back:.0f} s of compiler runs over {backend.jobs} jobs)" if backend
                            else ")"))
    print(format_table(results, header=header + [""] if header else None, footer=["", timing]))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            target=args.arch, targets=list(backend.targets) if backend else [],
            compiler=backend.compiler.describe() if backend else None,
            flags={t: backend.flags(t) for t in backend.targets} if backend else None,
            seconds=round(wall, 1), results=results), indent=1, default=str))
    if getattr(args, "plans", None):
        write_plans(args.plans, results, backend)
    failed = [r for r in results if r["status"] != "ok"]
    seen = set()  # full error text, once per distinct error, on stderr
    for r in failed:
        if r.get("error") and r["error"] not in seen:
            seen.add(r["error"])
            print(f"\n--- {r['kernel']} [{r['config']}]\n{r['error']}", file=sys.stderr)
    return 1 if failed or not results else 0


def make_backend(lowerer: Lowerer, targets, jobs: int | None = None):
    """The back-end stage: bishengir-compile from the ascendnpu-ir wheel with triton-ascend 3.2.0's
    npubin flags (checked against its source) and its own way of removing the adapter's metadata."""
    from triton.backends.ascend import compiler as ascend  # noqa: PLC0415

    from megablocks_ascend.cli import bishengir  # noqa: PLC0415
    stage, strip = (getattr(ascend, n, None) for n in ("linalg_to_bin_enable_npu_compile_A2_A3", "_parse_linalg_metadata"))
    if stage is None or strip is None:
        raise bishengir.StageMismatch(
            "this triton-ascend has no linalg_to_bin_enable_npu_compile_A2_A3 / _parse_linalg_metadata "
            "(the gate is written against triton-ascend 3.2.0's npubin stage)")
    problems = bishengir.check_npubin_source(inspect.getsource(stage))
    if problems:
        raise bishengir.StageMismatch(
            "triton-ascend's npubin stage differs from the flags the gate passes (megablocks_ascend/cli/"
            "bishengir.py, OPTION_FLAGS): " + "; ".join(problems))
    return bishengir.Stage(bishengir.find_compiler("a2a3"), tuple(targets), lowerer.backend.parse_options({}),
                           lambda linalg: strip(linalg, {}), jobs=jobs)


def write_plans(path: str, results: list[dict], backend) -> None:
    """Merge the planned peaks of ``results`` into the JSON file ``path`` (the memory model's
    evidence, ``tests/data/ascend_memory_plans.json``): one entry per kernel and configuration
    label, replacing an entry of the same key; one entry per line."""
    p = Path(path)
    data = json.loads(p.read_text()) if p.is_file() else {}
    entries = {(e["kernel"], e["config"]): e for e in data.get("plans", [])}
    capacity = data.get("capacity")
    for r in results:
        if not r.get("plan"):
            continue
        if capacity is not None and r["plan"]["capacity"] != capacity:
            raise ValueError(f"{r['kernel']} [{r['config']}]: capacities {r['plan']['capacity']} differ "
                             f"from the file's {capacity}: record one target per file")
        capacity = r["plan"]["capacity"]
        entries[(r["kernel"], r["config"])] = dict(
            kernel=r["kernel"], config=r["config"], axes=r["axes"], experts=r["experts"],
            constexprs={k: v for k, v in r["constexprs"].items() if not isinstance(v, str)},
            peak=r["plan"]["peak"], status=r["status"])
    head = dict(compiler=backend.compiler.describe() if backend else data.get("compiler"),
                target=backend.targets[0] if backend else data.get("target"), capacity=capacity)
    lines = [json.dumps(e, sort_keys=True, separators=(",", ":"))
             for e in sorted(entries.values(), key=lambda e: (e["kernel"], e["config"]))]
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(head, sort_keys=True)[:-1] + ', "plans": [\n' + ",\n".join(lines) + "\n]}\n")


def add_arguments(parser) -> None:
    from megablocks_ascend.cli import bishengir  # noqa: PLC0415
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--dump", metavar="DIR", help="write each configuration's TTIR and Ascend IR, and "
                        "the back end's input, temporaries (the planned module) and log per target")
    parser.add_argument("--only", metavar="NAME", help="only kernels whose name contains NAME")
    parser.add_argument("--arch", default=TARGET_ARCH, help=f"front-end target (default {TARGET_ARCH})")
    parser.add_argument("--targets", nargs="+", metavar="TARGET",
                        help=f"bishengir-compile --target values to gate (default: {' '.join(bishengir.GATED_TARGETS)})")
    parser.add_argument("--jobs", type=int, metavar="N", help="back-end compiler runs at once (default: the cores)")
    parser.add_argument("--front-end-only", action="store_true",
                        help="stop after triton-ascend's ttadapter stage (no bishengir-compile)")
    parser.add_argument("--axis", action="append", metavar="NAME=V[,V...]",
                        help="replace an axis's values in every kernel that has it (e.g. hidden=64,100 TOP_K=8)")
    parser.add_argument("--experts", type=int, metavar="N", help=f"the problem's expert count (default {EXPERTS})")
    parser.add_argument("--set", action="append", metavar="NAME=V",
                        help="set a constexpr by hand after the launchers' choice (e.g. BLOCK_M=64): shows "
                             "what the back end does with a tile no launcher picks")
    parser.add_argument("--plans", metavar="PATH", help="merge the planned peaks into this JSON file")
