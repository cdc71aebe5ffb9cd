"""Reading the Ascend IR: static counts of a kernel's memory pattern in its ``ttadapter`` output.

Pure functions of the IR's text (nothing here imports triton). What is counted in the IR of a vector
kernel (:func:`analyze_ir`; the markers are the ones triton-ascend 3.2.0's adapter emits):

``row_dma``      row copies inside an ``scf.for`` marked ``ExtractedLoadOrStore``: the adapter
                 splits a 2-D tile access whose row offsets come from an index vector into a loop
                 over rows, each iteration one contiguous DMA of ``1 x BLOCK_X`` elements: a
                 ``memref.copy`` for a load (the loop is also marked ``hivm.parallel_loop``), a
                 ``bufferization.materialize_in_destination`` of a ``tensor<1xN>`` slice for a store.
                 One op here is one DMA per row per tile. (A store whose mask depends on loaded data
                 is NOT lowered this way: it becomes element-wise scalar stores, counted below.)
                 triton-ascend's ``index_select_simd`` builtin lowers to the same loop of row
                 copies, marked ``hivm.parallel_loop`` only (its row numbers read with an unmarked
                 ``tensor.extract`` of the index vector: an address, not data): counted here too,
                 and in ``select_loops``.
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

:func:`cube_problems` says why a cube kernel's counts fail the gate; :mod:`.gate` applies the vector
kernels' rules, which depend on the table's entry.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any


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
_INDEX_READ_RE = re.compile(r"\btensor\.extract\s.*:\s*tensor<\d+xi(32|64)>")  # a row number of an index vector


def _select_loop(lp: "Loop") -> bool:
    """index_select_simd's loop of row copies (see ``row_dma``)."""
    return ("hivm.parallel_loop" in lp.attrs and "ExtractedLoadOrStore" not in lp.attrs
            and any(_ROW_COPY_RE.search(op) for op in lp.ops))


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
               discrete_loops=0, parallel_loops=0, feature_loops=0, select_loops=0)
    for lp in loops:
        hot = in_feature_loop(lp)
        if is_feature_loop(lp):
            res["feature_loops"] += 1
        nested = any("ExtractedLoadOrStore" in a.attrs for a in lp.ancestors())
        select = _select_loop(lp)
        if ("ExtractedLoadOrStore" in lp.attrs or select) and not nested:  # an outer one counts its nested loops
            res["discrete_loops"] += 1
            res["select_loops"] += select
            if "hivm.parallel_loop" in lp.attrs:
                res["parallel_loops"] += 1
            body = list(lp.all_ops())
            copies = sum(1 for op in body if _ROW_COPY_RE.search(op))
            if copies:
                res["row_dma"] += copies
                if hot:
                    res["row_dma_hot"] += copies
            scalars = sum(1 for op in body if _SCALAR_ACCESS_RE.search(op) and not (select and _INDEX_READ_RE.search(op)))
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
        if "ExtractedLoadOrStore" in lp.attrs or _select_loop(lp):
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
    res["mix_mode"] = mix_mode(ir)
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


def mix_mode(ir: str) -> str | None:
    """The adapter's ``mix_mode`` attribute of the module (``aiv``, ``aic``, ``mix``), None without one."""
    mode = _MIX_MODE_RE.search(ir)
    return mode.group(1) if mode else None


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


