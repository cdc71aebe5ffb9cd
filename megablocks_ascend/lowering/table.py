"""The gate's table: which kernels it compiles, over which axes, for which representative problem.

One :class:`KernelSpec` per Triton kernel of :mod:`megablocks_ascend.kernels` (``routing``,
``preparation``, ``blocksparse``, ``grouped``, ``topology``): its configuration axes (dtype, hidden size and
every constexpr its launchers choose), the constexprs derived from them (tile sizes, ``BLOCK_E``),
which pointers carry data, what the gate checks of its IR, and its scalar arguments for the
representative :class:`Problem` (a function of the problem, so a new kernel is one entry).
:mod:`.configs` expands the table into configurations as an NPU's launchers would; a test checks
the table against the kernels' signatures and the launchers' keyword arguments, so a new kernel or
constexpr path cannot be forgotten.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Callable

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

# Expert counts of the table's configurations at many experts (KernelSpec.many): DeepSeek-V3 has
# 256 experts, Qwen3 128; the routing kernels an NPU runs must keep their tiles and per-row costs
# there (tests/test_census.py holds the recorded census to it).
MANY_EXPERTS = (64, 256)
TOP_K_MANY = (1, 2, 8)  # top_k of those configurations (8: DeepSeek-V3's and Qwen3's)

# The representative problem whose sizes fill the scalar arguments (their divisibility by 16
# specialises the kernel the way the launcher's real call would).
TOKENS = 4096
EXPERTS = 8
PADDED_EXTRA = 8 * 128  # padded_bins[-1] - bins[-1]
ROUTE_MAP_BLOCK_M = 128  # route_map()'s block_m on a device (it uses 64 only for CPU tensors)
# The representative block-sparse problem: a MegaBlocks topology of 64 block rows (8192 padded
# tokens) by 128 block columns (8 experts x 2048 ffn), 16 blocks per row, blocks of CUBE_BLOCK.
CUBE_BLOCK = 128  # MegaBlocks' block size
CUBE_ROWS, CUBE_COLS, CUBE_PER_ROW = 64, 128, 16
PREP_PROGRAMS = 40  # the preparation's grid: the vector cores of an A2 (910B) device
FILL_ROWS = 768  # the zero fill's rows per group (768 x 1024 is a whole number of fill tiles, x 1000 not)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The representative problem of one configuration: TOKENS tokens routed to ``experts``
    experts with ``top_k`` slots each (the ``TOP_K`` axis, else 2), in the configuration's
    ``LAYOUT``, ``hidden`` wide; ``axes`` are the configuration's own."""

    axes: dict
    experts: int = EXPERTS
    top_k: int = 2

    @classmethod
    def of(cls, axes: dict, experts: int = EXPERTS) -> "Problem":
        return cls(axes, experts, axes.get("TOP_K", 2))

    @property
    def hidden(self) -> int:
        return self.axes.get("hidden", 0)

    @property
    def positions(self) -> int:  # routed assignments (sorted positions)
        return TOKENS * self.top_k

    @property
    def layout(self) -> int:  # the LAYOUT axis; a row-mapped gather (MAPPED) stands for the padded layout
        return self.axes.get("LAYOUT", 1 if self.axes.get("MAPPED") else 0)

    @property
    def capacity(self) -> int:  # rows per expert of the binned layout, else 0
        return self.positions // self.experts if self.layout == 2 else 0

    @property
    def rows(self) -> int:  # expert-major rows of the layout: dropless, padded, binned
        return {0: self.positions, 1: self.positions + PADDED_EXTRA, 2: self.experts * self.capacity}[self.layout]

    def one_slot(self) -> "Problem":
        """The same problem with one slot per token (the ``top_k == 1`` kernels)."""
        return dataclasses.replace(self, top_k=1)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str  # attribute of megablocks_ascend.kernels.<module>
    kind: str | None  # devices.tile / devices.ub_bytes kind; None: no feature tiles
    axes: dict  # configuration axes: "dtype", "hidden" and the constexprs the launcher chooses
    derived: tuple  # constexprs derived from the axes (tile sizes, BLOCK_E)
    data_ptrs: tuple  # pointer arguments of the data dtype (others are int32 index tensors)
    row_copy: bool  # moves feature rows: gated on scalar_hot == 0
    scalars: Callable[[Problem], dict]  # the non-constexpr integer arguments for a problem
    module: str = "routing_kernels"  # megablocks_ascend.kernels.<module>
    cube: bool = False  # a tl.dot kernel: tiles from devices.cube_tile(kind, ...), IR read by analyze_cube_ir
    ptr_types: tuple = ()  # (argument, triton pointer type) of index pointers that are not *i32
    hot_step: str = "BLOCK_X"  # the constexpr stepping the loop analyze_ir calls hot
    no_scalar_hot: bool = False  # gated on scalar_hot == 0 although it moves no feature rows
    unrolls_top_k: bool = False  # tl.static_range(TOP_K): its launcher passes top_k to devices.tile
    # The census's targets (census.TARGETS): whether an NPU's launchers run this kernel (devices.STORES:
    # not the forms whose stores go to data-dependent rows), and the stores to computed positions
    # per row its result needs (a sort's, an inverse map's), as functions of the configuration's axes.
    npu_chosen: bool = True
    inherent_row_stores: Callable[[dict], int] = lambda axes: 0  # PLACE (preparation): 0, 1 or 2
    variant: str | None = None  # a module holding a variant of the kernel, to gate in its place (--variant)
    # The axes of its configurations at many experts (MANY_EXPERTS, and top_k 8 at EXPERTS too): a few
    # values each, in the table beside the full product at EXPERTS (today's fine-grained MoE shapes:
    # tiles and per-row costs that do not grow with the expert count, held from the recorded census);
    # None: none.
    many: dict | None = None
    # Which points of the axes the launchers can produce, given the derived constexprs too (None: all).
    when: Callable[[dict], bool] | None = None

    def kernel(self):
        """The ``compat.Kernel`` this entry names (from ``variant`` when one is given)."""
        return getattr(importlib.import_module(self.variant or f"megablocks_ascend.kernels.{self.module}"), self.name)


def source_digest(spec: "KernelSpec") -> str:
    """A digest of the Triton code a kernel's census depends on: every jit function and kernel of
    its module and of ``kernels.scan`` (their shared helper), as code (comments and docstrings do
    not count). Recorded with the census (``tests/data/ascend_census.json``) so that a test can
    tell the record is stale."""
    import ast  # noqa: PLC0415
    import hashlib  # noqa: PLC0415
    import textwrap  # noqa: PLC0415

    def code(fn) -> str:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, ast.FunctionDef) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        return ast.unparse(tree)
    parts = []
    for name in sorted({spec.kernel().fn.__module__, "megablocks_ascend.kernels.scan"}):
        module = importlib.import_module(name)
        for attr in sorted(vars(module)):
            fn = getattr(getattr(module, attr), "fn", None)
            # (under its own name only: an alias bound per Triton, routing_kernels._select_rows, is not code)
            if callable(fn) and getattr(fn, "__module__", None) == name and getattr(fn, "__name__", attr) == attr:
                parts.append(f"{name}.{attr}\n{code(fn)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def kernel_params(fn: Callable) -> tuple[list[str], list[str]]:
    """(runtime argument names, constexpr names) of a kernel function, from its signature."""
    runtime, constexpr = [], []
    for p in inspect.signature(fn).parameters.values():
        ann = p.annotation
        is_const = "constexpr" in (ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann)))
        (constexpr if is_const else runtime).append(p.name)
    return runtime, constexpr


def _one_slot(p: Problem) -> dict:  # _scatter_one, _wgrad_one
    q = p.one_slot()
    return dict(num_positions=q.positions, num_experts=q.experts, num_rows=q.rows, hidden=q.hidden,
                capacity=q.capacity)


_ROUTING = dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES)
_ROW_TILE = ("BLOCK_M", "BLOCK_X", "EVEN_X")
_ROW_TILE_E = ("BLOCK_M", "BLOCK_X", "BLOCK_E", "EVEN_X")  # and the bins' BLOCK_E
_MANY_ROWS = dict(dtype=("bf16",), hidden=(1024,), INT64=(False,), SELECT=BOOLS)  # the row kernels' at many experts


def _selectable(c: dict) -> bool:
    """SELECT (rows loaded through triton-ascend's index_select_simd) only where the launchers set it:
    int32 offsets and whole feature tiles (routing._select)."""
    return not c["SELECT"] or (c["EVEN_X"] and not c["INT64"])
ROUTING_KERNELS = (
    KernelSpec("_gather", "gather", dict(_ROUTING, MAPPED=BOOLS, TOP_K=TOP_KS, SCALE=BOOLS, INT64=BOOLS, SELECT=BOOLS),
               _ROW_TILE, ("x", "out", "weights"), True,
               lambda p: dict(num_rows=p.rows, map_rows=p.rows, num_positions=p.positions, hidden=p.hidden),
               many=dict(_MANY_ROWS, MAPPED=BOOLS, TOP_K=TOP_K_MANY, SCALE=(True,)), when=_selectable),
    KernelSpec("_gather_tokens", "gather_tokens", dict(_ROUTING, LAYOUT=LAYOUTS, TOP_K=TOP_KS, SCALE=BOOLS, INT64=BOOLS),
               _ROW_TILE_E, ("x", "out", "weights"), True,
               lambda p: dict(num_tokens=TOKENS, num_rows=p.rows, num_experts=p.experts, hidden=p.hidden,
                              capacity=p.capacity), unrolls_top_k=True, npu_chosen=False),
    KernelSpec("_route_map", None, dict(LAYOUT=LAYOUTS), ("BLOCK_M", "BLOCK_E"), (), False,
               lambda p: dict(num_positions=p.positions, num_experts=p.experts, capacity=p.capacity),
               inherent_row_stores=lambda axes: 1,  # the inverse of a permutation: one store per position
               many=dict(LAYOUT=LAYOUTS)),
    KernelSpec("_row_map", None, dict(LAYOUT=(1, 2)), ("BLOCK_M", "BLOCK_E"), (), False,
               lambda p: dict(num_rows=p.rows, num_experts=p.experts, capacity=p.capacity),
               many=dict(LAYOUT=(1, 2))),
    KernelSpec("_scatter", "scatter", dict(_ROUTING, TOP_K=TOP_KS, SCALE=BOOLS, INT64=BOOLS, SELECT=BOOLS),
               _ROW_TILE + ("BLOCK_K", "FLAT"), ("y", "out", "weights"), True,
               lambda p: dict(num_tokens=TOKENS, num_rows=p.positions, hidden=p.hidden), unrolls_top_k=True,
               many=dict(_MANY_ROWS, TOP_K=TOP_K_MANY, SCALE=(True,)), when=_selectable),
    KernelSpec("_scatter_one", "scatter_one", dict(_ROUTING, LAYOUT=LAYOUTS, SCALE=BOOLS, INT64=BOOLS),
               _ROW_TILE_E, ("y", "out", "weights"), True, _one_slot, npu_chosen=False),
    KernelSpec("_wgrad", "wgrad", dict(_ROUTING, TOP_K=TOP_KS, INT64=BOOLS, SELECT=BOOLS), _ROW_TILE,
               ("y", "grad", "out"), True, lambda p: dict(num_slots=p.positions, num_rows=p.positions, hidden=p.hidden),
               many=dict(_MANY_ROWS, TOP_K=TOP_K_MANY), when=_selectable),
    KernelSpec("_wgrad_one", "wgrad", dict(_ROUTING, LAYOUT=LAYOUTS, INT64=BOOLS),
               _ROW_TILE_E, ("y", "grad", "out"), True, _one_slot, npu_chosen=False),
)


# The routing preparation (kernels/preparation.py): a counting sort of expert ids. Keys are the
# router's ids (int32 / int64) or, through the megablocks_ops stand-in, the sparse dMoE's int16 block
# column indices; PLACE 0 is the stand-in's histogram, 1 the routing preparation, 2 the stand-in's
# sort. The tiles come from devices.prep_tile for the problem's expert count (EXPERTS, or
# --experts) and a grid of PREP_PROGRAMS vector cores. Its stores to computed positions (a sort
# places each item where it belongs) are per element by nature: the census allows them (one per
# item, two for the sort, which also places the values).
PREP_INDEX_TYPES = ("i16", "i32", "i64")
ROUTES = (-1, 0, 1, 2)  # preparation.NO_ROUTE, then routing.DROPLESS, PADDED, BINNED
PLACES = (0, 1, 2)  # preparation.HISTOGRAM, ROUTING, SORT


def prep_block_m(experts: int, count: bool = False) -> int:
    """The preparation's items per block on an NPU for ``experts`` experts: the placement's, or
    (``count``) the count's."""
    from megablocks_ascend import devices  # noqa: PLC0415
    t = devices.prep_tile(experts, "npu")
    return devices.prep_count_tile(t, devices.block_e(experts))[0] if count else t.block_m


def _count(p: Problem) -> dict:
    from megablocks_ascend import devices  # noqa: PLC0415
    block_m = max(prep_block_m(p.experts), prep_block_m(p.experts, count=True))  # both kernels' blocks
    chunk = -(-p.positions // (PREP_PROGRAMS * block_m)) * block_m  # items per program, whole tiles
    block_p = devices.prep_block_p(PREP_PROGRAMS, devices.block_e(p.experts))
    table_rows = -(-PREP_PROGRAMS // block_p) * block_p  # the count table's rows, whole BLOCK_P tiles
    return dict(num_items=p.positions, num_keys=p.experts, key_mask=-1, chunk=chunk, table_rows=table_rows)


PREPARATION_KERNELS = (
    KernelSpec("_count", None, dict(index=PREP_INDEX_TYPES), ("BLOCK_M", "BLOCK_E", "NPU_FORM", "CHUNK"), ("keys",),
               False, _count, module="preparation", hot_step="BLOCK_M", many=dict(index=("i32", "i64"))),
    KernelSpec("_place", None, dict(index=PREP_INDEX_TYPES, PLACE=PLACES, PADDED=BOOLS, ROUTE=ROUTES),
               ("BLOCK_M", "BLOCK_E", "BLOCK_P", "NPU_FORM"), ("keys",), False,
               lambda p: dict(_count(p), block=128, capacity=p.positions // p.experts),
               module="preparation", hot_step="BLOCK_M", inherent_row_stores=lambda axes: axes["PLACE"],
               many=dict(index=("i64",), PLACE=(1,), PADDED=BOOLS, ROUTE=ROUTES)),
)


# The block-sparse matmuls (kernels/blocksparse.py): every operand layout stk's and MegaBlocks'
# calls produce (dense operands contiguous or transposed views, i.e. *_CM; blocks and outputs
# contiguous), both transposes of the sparse operand (GATHER: blocks found through
# block_offsets_t), an even and an uneven dense size ("hidden": sdd's K, dsd's N, dds's M). The
# scalars give each operand's strides for its layout in the representative topology.
_CUBE_TILE = ("BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP", "OUT_CM", "PRECISION", "WIDEN")
_STK_INDEX = (("row_indices", "*i16"), ("column_indices", "*i16"), ("indices", "*i16"))
INDEX_TYPES = ("i16", "i32")
_NNZ = CUBE_ROWS * CUBE_PER_ROW
_M, _N = CUBE_ROWS * CUBE_BLOCK, CUBE_COLS * CUBE_BLOCK  # the sparse matrix's rows and columns


def _sdd(p: Problem) -> dict:  # lhs [m, dense] @ rhs [dense, n]
    b, dense, ax = CUBE_BLOCK, p.hidden, p.axes
    lhs = (1, _M) if ax["LHS_CM"] else (dense, 1)
    rhs = (1, dense) if ax["RHS_CM"] else (_N, 1)
    return dict(K=dense, nnz=_NNZ, block_rows=CUBE_ROWS, block_cols=CUBE_COLS, row_width=CUBE_PER_ROW,
                stride_lm=lhs[0], stride_lk=lhs[1], stride_rk=rhs[0], stride_rn=rhs[1],
                stride_ob=b * b, stride_om=b, stride_on=1)


def _dsd(p: Problem) -> dict:  # op(S) [m, n] @ rhs [n, dense]; GATHER: S transposed
    b, dense, ax = CUBE_BLOCK, p.hidden, p.axes
    a = (1, b) if ax["GATHER"] else (b, 1)
    rhs = (1, _N) if ax["RHS_CM"] else (dense, 1)
    return dict(M=_M, N=dense, nnz=_NNZ, k_blocks=CUBE_COLS, stride_db=b * b, stride_am=a[0], stride_ak=a[1],
                stride_rk=rhs[0], stride_rn=rhs[1], stride_om=dense, stride_on=1)


def _dds(p: Problem) -> dict:  # lhs [dense, m] @ op(S) [m, n]; GATHER: S itself (walked by columns)
    b, dense, ax = CUBE_BLOCK, p.hidden, p.axes
    lhs = (1, dense) if ax["LHS_CM"] else (_M, 1)
    bk = (b, 1) if ax["GATHER"] else (1, b)
    return dict(M=dense, N=_N, nnz=_NNZ, k_blocks=CUBE_ROWS, stride_lm=lhs[0], stride_lk=lhs[1],
                stride_db=b * b, stride_bk=bk[0], stride_bn=bk[1], stride_om=_N, stride_on=1)


_CUBE = dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES)
CUBE_KERNELS = (
    KernelSpec("_sdd", "sdd", dict(_CUBE, LHS_CM=BOOLS, RHS_CM=BOOLS, INT64=BOOLS), _CUBE_TILE + ("EVEN_K", "PAIRS"),
               ("lhs", "rhs", "out"), False, _sdd, module="blocksparse", cube=True, ptr_types=_STK_INDEX),
    KernelSpec("_dsd", "dsd", dict(_CUBE, GATHER=BOOLS, RHS_CM=BOOLS, INT64=BOOLS), _CUBE_TILE + ("A_CM", "EVEN_N", "AFFINE"),
               ("data", "rhs", "out"), False, _dsd, module="blocksparse", cube=True, ptr_types=_STK_INDEX),
    KernelSpec("_dds", "dds", dict(_CUBE, GATHER=BOOLS, LHS_CM=BOOLS, INT64=BOOLS), _CUBE_TILE + ("B_CM", "EVEN_M"),
               ("lhs", "data", "out"), False, _dds, module="blocksparse", cube=True, ptr_types=_STK_INDEX),
    KernelSpec("_row_indices", None, dict(index=INDEX_TYPES), ("BLOCK",), ("out",), False,
               lambda p: dict(block_rows=CUBE_ROWS, nnz=_NNZ), module="blocksparse", hot_step="BLOCK",
               no_scalar_hot=True),
)


# The zero fill of the empty groups of a weight gradient (kernels/grouped.py): "hidden" is the
# gradient's last dimension N, with M = FILL_ROWS rows per group; ends int64, as the grouped GEMM
# stand-in passes them.
def fill_block(dtype: str) -> int:
    """The zero fill's elements per tile on an NPU for the table's dtype name ``dtype``."""
    import torch  # noqa: PLC0415

    from megablocks_ascend import devices  # noqa: PLC0415
    return devices.fill_block(getattr(torch, DTYPES[dtype][1]), "npu")


def _fill(p: Problem) -> dict:
    from megablocks_ascend import devices  # noqa: PLC0415
    numel, chunk = FILL_ROWS * p.hidden, fill_block(p.axes["dtype"]) * devices.FILL_CHUNK_BLOCKS
    return dict(group_numel=numel, group_stride=numel, chunk=chunk, num_items=p.experts * -(-numel // chunk))


GROUPED_KERNELS = (
    KernelSpec("_zero_empty_groups", None, dict(dtype=tuple(DTYPES), hidden=HIDDEN_SIZES, INT64=BOOLS),
               ("BLOCK", "EVEN"), ("out",), False, _fill, module="grouped", ptr_types=(("ends", "*i64"),),
               hot_step="BLOCK", no_scalar_hot=True),
)
# The sparse dMoE's topology (kernels/topology.py): one launch writing stk's six index tensors from
# padded_bins. BPR: blocks per row (ffn / 128) of the fine-grained configs and of a mixtral-sized
# expert (qw128 6, ds64 11, 2048-wide 16, mixtral 112); the representative topology has the padded
# problem's block rows plus one expert's worth of spare ones.
TOPOLOGY_BPR = (6, 11, 16, 112)


def _topology(p: Problem) -> dict:
    return dict(num_experts=p.experts, block_rows=(p.positions + PADDED_EXTRA) // CUBE_BLOCK + 8)


TOPOLOGY_KERNELS = (
    KernelSpec("_topology", None, dict(BPR=TOPOLOGY_BPR), ("BLOCK_SIZE", "BLOCK_I", "BLOCK_K", "CHUNK"), (), False,
               _topology, module="topology", hot_step="BLOCK_I", no_scalar_hot=True,
               ptr_types=(("row_indices", "*i16"), ("column_indices", "*i16"), ("column_indices_t", "*i16"))),
)
KERNELS = ROUTING_KERNELS + PREPARATION_KERNELS + CUBE_KERNELS + GROUPED_KERNELS + TOPOLOGY_KERNELS
