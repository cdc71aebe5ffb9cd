"""The Ascend compile gate: lower every kernel with triton-ascend's front end, on CPU.

``python -m megablocks_ascend lower`` (in the lowering venv made by ``tools/ascend_lowering_env.sh``)
runs triton-ascend's ``ttir`` and ``ttadapter`` stages for every kernel of
:mod:`megablocks_ascend.kernels.routing` and :mod:`megablocks_ascend.kernels.grouped` (vector
kernels) and :mod:`megablocks_ascend.kernels.blocksparse` (cube kernels: ``tl.dot``) over a generated list of
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


ROUTING_KERNELS = (
    KernelSpec("_gather", "gather",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, LAYOUT=LAYOUTS, TOP_K=TOP_KS,
                    SCALE=BOOLS, INT64=BOOLS),
               ("BLOCK_M", "BLOCK_X", "BLOCK_E", "EVEN_X"), ("x", "out", "weights"), True),
    KernelSpec("_gather_tokens", "gather",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, LAYOUT=LAYOUTS, TOP_K=TOP_KS,
                    SCALE=BOOLS, INT64=BOOLS),
               ("BLOCK_M", "BLOCK_X", "BLOCK_E", "EVEN_X"), ("x", "out", "weights"), True),
    KernelSpec("_route_map", None, dict(LAYOUT=LAYOUTS), ("BLOCK_M", "BLOCK_E"), (), False),
    KernelSpec("_scatter", "scatter",
               dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, TOP_K=TOP_KS, SCALE=BOOLS, INT64=BOOLS),
               ("BLOCK_M", "BLOCK_X", "EVEN_X"), ("y", "out", "weights"), True),
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
# The zero fill of the empty groups of a weight gradient (kernels/grouped.py): "hidden" is the
# gradient's last dimension N, with M = FILL_ROWS rows per group (768 x 1024 is a whole number of
# fill tiles, 768 x 1000 is not); ends int64, as the grouped GEMM stand-in passes them.
FILL_ROWS = 768
GROUPED_KERNELS = (
    KernelSpec("_zero_empty_groups", None, dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, INT64=BOOLS),
               ("BLOCK", "EVEN"), ("out",), False, module="grouped", ptr_types=(("ends", "*i64"),),
               hot_step="BLOCK", no_scalar_hot=True),
)
KERNELS = ROUTING_KERNELS + CUBE_KERNELS + GROUPED_KERNELS


@dataclasses.dataclass(frozen=True)
class Config:
    kernel: str
    axes: dict  # the axis values of this configuration
    constexprs: dict  # every constexpr of the kernel
    scalars: dict  # the non-constexpr integer arguments
    ub_bytes: int | None
    cube_bytes: dict | None = None  # devices.cube_bytes of a cube kernel's tile

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
        tiles = [f"{k}={self.constexprs[k]}" for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_X")
                 if k in self.constexprs]
        if "EVEN_X" in self.constexprs:
            tiles.append(f"EVEN_X={int(self.constexprs['EVEN_X'])}")
        return " ".join(parts + tiles)


def _scalars(spec: KernelSpec, axes: dict) -> dict:
    top_k = axes.get("TOP_K", 2)
    n = TOKENS * top_k
    layout = axes.get("LAYOUT", 0)
    capacity = n // EXPERTS if layout == 2 else 0
    num_rows = {0: n, 1: n + PADDED_EXTRA, 2: EXPERTS * capacity}[layout]
    hidden = axes.get("hidden", 0)
    if spec.name == "_gather":
        return dict(num_rows=num_rows, num_positions=n, num_experts=EXPERTS, hidden=hidden, capacity=capacity)
    if spec.name == "_gather_tokens":
        return dict(num_tokens=TOKENS, num_rows=num_rows, num_experts=EXPERTS, hidden=hidden, capacity=capacity)
    if spec.name == "_route_map":
        return dict(num_positions=n, num_experts=EXPERTS, capacity=capacity)
    if spec.name == "_scatter":
        return dict(num_tokens=TOKENS, num_rows=n, hidden=hidden)
    if spec.name in ("_scatter_one", "_wgrad_one"):
        n1 = TOKENS  # top_k == 1
        capacity1 = n1 // EXPERTS if layout == 2 else 0
        rows1 = {0: n1, 1: n1 + PADDED_EXTRA, 2: EXPERTS * capacity1}[layout]
        return dict(num_positions=n1, num_experts=EXPERTS, num_rows=rows1, hidden=hidden, capacity=capacity1)
    if spec.name == "_wgrad":
        return dict(num_slots=n, num_rows=n, hidden=hidden)
    if spec.name == "_zero_empty_groups":
        numel, chunk = FILL_ROWS * hidden, _fill_block(axes) * _fill_chunk_blocks()
        return dict(group_numel=numel, group_stride=numel, chunk=chunk, num_items=EXPERTS * -(-numel // chunk))
    raise KeyError(spec.name)


def _fill_block(axes: dict) -> int:
    import torch  # noqa: PLC0415

    from megablocks_ascend import devices  # noqa: PLC0415
    return devices.fill_block(getattr(torch, DTYPES[axes["dtype"]][1]), "npu")


def _fill_chunk_blocks() -> int:
    from megablocks_ascend import devices  # noqa: PLC0415
    return devices.FILL_CHUNK_BLOCKS


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


def configs(kernels: Iterable[KernelSpec] = KERNELS) -> list[Config]:
    """Every configuration of every kernel: the product of its axes, tiles derived as on an NPU."""
    import torch  # noqa: PLC0415

    from megablocks_ascend import devices  # noqa: PLC0415

    out = []
    for spec in kernels:
        names = list(spec.axes)
        for values in itertools.product(*(spec.axes[n] for n in names)):
            axes = dict(zip(names, values))
            if spec.module == "blocksparse":
                constexprs, cube = _cube_constexprs(spec, axes)
                out.append(Config(spec.name, axes, constexprs, _cube_scalars(spec, axes), None, cube))
                continue
            constexprs = {k: v for k, v in axes.items() if k not in SIZE_AXES}
            ub = None
            if spec.module == "grouped":
                block = _fill_block(axes)
                constexprs.update(BLOCK=block, EVEN=FILL_ROWS * axes["hidden"] % block == 0)
                ub = devices.fill_ub_bytes(block, DTYPES[axes["dtype"]][2])
            elif spec.kind is not None:
                _, torch_name, es = DTYPES[axes["dtype"]]
                t = devices.tile(spec.kind, getattr(torch, torch_name), axes["hidden"], "npu")
                constexprs.update(BLOCK_M=t.block_m, BLOCK_X=t.block_x, EVEN_X=axes["hidden"] % t.block_x == 0)
                ub = devices.ub_bytes(spec.kind, t.block_m, t.block_x, es)
            else:
                constexprs["BLOCK_M"] = ROUTE_MAP_BLOCK_M
            if "BLOCK_E" in spec.derived:
                constexprs["BLOCK_E"] = devices.block_e(EXPERTS)
            missing = set(spec.derived) - set(constexprs)
            if missing:
                raise AssertionError(f"{spec.name}: derived constexprs {sorted(missing)} not computed")
            out.append(Config(spec.name, axes, constexprs, _scalars(spec, axes), ub))
    return out


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


def run(kernels: Iterable[KernelSpec] = KERNELS, *, dump: str | None = None,
        lowerer: Lowerer | None = None, only: str | None = None) -> list[dict]:
    """Lower every configuration; one result dict per configuration."""
    lowerer = lowerer or Lowerer()
    specs = {s.name: s for s in kernels}
    results = []
    for cfg in configs(specs.values()):
        spec = specs[cfg.kernel]
        if only and only not in cfg.kernel:
            continue
        row = dict(kernel=cfg.kernel, config=cfg.label, axes=cfg.axes, constexprs=cfg.constexprs,
                   ub_bytes=cfg.ub_bytes, row_copy=spec.row_copy, cube=spec.cube, cube_bytes=cfg.cube_bytes)
        t0 = time.perf_counter()
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
                from megablocks_ascend import devices  # noqa: PLC0415
                over = {k: v for k, v in cfg.cube_bytes.items() if v > devices.CUBE_LIMITS[k]}
                if over:
                    problems.append(f"cube tile over the A2 budget: {over}")
            else:
                counts = analyze_ir(linalg, cfg.constexprs.get(spec.hot_step))
                row.update(counts)
                problems = []
            if spec.no_scalar_hot and counts["scalar_hot"] > 0:
                problems.append(f"{counts['scalar_hot']} scalar accesses in the store loop")
            if spec.row_copy and counts["scalar_hot"] > 0:
                problems.append(f"{counts['scalar_hot']} scalar accesses in the feature-tile loop")
            if spec.row_copy and counts["row_dma"] == 0:
                problems.append("no per-row DMA: the row tiles did not lower to row copies")
            if (spec.kind is not None or spec.module == "grouped") and cfg.ub_bytes is not None:
                from megablocks_ascend import devices  # noqa: PLC0415
                if cfg.ub_bytes > devices.UB_BYTES - devices.UB_RESERVE:
                    problems.append(f"UB estimate {cfg.ub_bytes} over budget")
            row.update(status="FAIL" if problems else "ok", error="; ".join(problems))
            if dump:
                d = Path(dump)
                d.mkdir(parents=True, exist_ok=True)
                stem = f"{cfg.kernel}__" + re.sub(r"[^\w=.-]+", "_", cfg.label)
                (d / f"{stem}.ttir.mlir").write_text(ttir)
                (d / f"{stem}.ttadapter.mlir").write_text(linalg)
        row["seconds"] = round(time.perf_counter() - t0, 3)
        results.append(row)
    return results


COLUMNS = (("kernel", "kernel"), ("config", "configuration"), ("status", "status"),
           ("row_dma", "row DMA"), ("scalar_hot", "scalar/hot"), ("scalar_row", "scalar/row"),
           ("int_vec_hot", "int-vec/hot"), ("ub_bytes", "UB bytes"))


CUBE_COLUMNS = (("kernel", "kernel"), ("config", "configuration"), ("status", "status"),
                ("mix_mode", "mode"), ("mmad", "matmul"), ("tile_dma", "tile DMA"), ("transposes", "transp."),
                ("scalar_k", "index/K"), ("scalar_data_k", "scalar/K"), ("tile_stores", "tile st."),
                ("l0c", "L0C bytes"), ("l1", "L1 bytes"))


def _table(results: list[dict], columns) -> list[str]:
    def cell(r, k):
        v = r.get(k, (r.get("cube_bytes") or {}).get(k))
        return "-" if v is None else str(v)
    rows = [[cell(r, k) for k, _ in columns] for r in results]
    head = [h for _, h in columns]
    widths = [max([len(head[i])] + [len(row[i]) for row in rows]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def format_table(results: list[dict]) -> str:
    """The report: one line per configuration (vector kernels, then cube kernels), error details
    after the tables, ``lowered: N/M`` last."""
    vector = [r for r in results if not r.get("cube")]
    cube = [r for r in results if r.get("cube")]
    lines = _table(vector, COLUMNS) if vector or not cube else []
    if cube:
        lines += ([""] if lines else []) + _table(cube, CUBE_COLUMNS)
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
    ok = sum(1 for r in results if r["status"] == "ok")
    lines.append(f"lowered: {ok}/{len(results)}")
    return "\n".join(lines)


def main(args) -> int:
    """The ``lower`` subcommand; ``args`` has ``json``, ``dump``, ``only`` and ``arch``."""
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
    results = run(dump=args.dump, lowerer=lowerer, only=args.only)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(target=args.arch, results=results), indent=1, default=str))
    failed = [r for r in results if r["status"] != "ok"]
    seen = set()  # full error text, once per distinct error, on stderr
    for r in failed:
        if r.get("error") and r["error"] not in seen:
            seen.add(r["error"])
            print(f"\n--- {r['kernel']} [{r['config']}]\n{r['error']}", file=sys.stderr)
    return 1 if failed or not results else 0


def add_arguments(parser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--dump", metavar="DIR", help="write each configuration's TTIR and Ascend IR")
    parser.add_argument("--only", metavar="NAME", help="only kernels whose name contains NAME")
    parser.add_argument("--arch", default=TARGET_ARCH, help=f"Ascend target (default {TARGET_ARCH})")
