"""The per-row pipeline census of a planned module: what one row of a kernel's hot loop costs an NPU.

``bishengir-compile`` keeps the module it hands to ``hivmc`` (``module.hivm.opt.mlir``: see
:mod:`.bishengir`). Besides the memory plan (:mod:`.plan`) it holds what an Ascend vector core will
execute, in order: DMA calls (``load_gm_to_ubuf_*`` on the MTE2 pipe, ``store_ubuf_to_gm_*`` on
MTE3), vector library calls (``vadd_*``, ``vcast_*``, ``vsel_*``, ``reduce_*``, ``cumsum_*``... on
the V pipe), scalar loads and stores (``memref.load`` / ``memref.store``: the S pipe, on the
Unified Buffer or on global memory), and the synchronisation the compiler inserted between the
pipes: ``hivm.hir.set_flag[<A>, <B>, id]`` / ``wait_flag[...]`` (pipe B waits for pipe A) and
``hivm.hir.pipe_barrier[<P>]`` (whatever is queued on pipe P completes first). Each has a cost an
NPU pays in cycles that the memory plan does not show.

:func:`census` counts, **per row of the kernel's hot loop** (one item of a sub-block: a buffer row,
a token, a slot, a routed item), the trip counts of the loops inside it applied (the per-row loops
of ``BLOCK_M`` iterations, the feature-tile loop of ``hidden / BLOCK_X``):

``flags``          ``set_flag`` + ``wait_flag`` ops, also by pipe pair (``S>V``: the scalar pipe
                   signals the vector pipe). ``handshakes_sv``: ``set_flag`` ops between the scalar
                   and vector pipes, either way (each pairs with a ``wait_flag``: one round trip in
                   which both pipes wait).
``barriers``       ``pipe_barrier`` ops, also by pipe; ``barriers_mte3`` those of the store pipe: a
                   barrier before each store to a data-dependent row keeps one store in flight.
``scalar_ub``, ``scalar_gm``  scalar loads and stores of the Unified Buffer, of global memory.
``vector_ops``     vector library calls; ``vector_lt64`` those over fewer than 64 elements (a vector
                   instruction's fixed cost for a few lanes), ``vector_1`` over one element (a value
                   the scalar unit cannot compute, such as a bf16 cast, sent through a one-element
                   buffer with a handshake each way); ``vector_i64`` int64 arithmetic, compares and
                   selects (which A2/A3 vector units run as scalar code; not the casts by which int64
                   ids come in, nor broadcasts and copies);
                   ``small_ops`` the commonest small ones by name.
``dma``, ``dma_bytes``  DMA calls between global memory and the UB, and their bytes;
                   ``row_stores`` the stores issued row by row (in a per-row loop): stores to
                   data-dependent rows or elements, each waiting for the last.
``scalar_loops``   per-element scalar loops anywhere in the kernel: a loop whose body does scalar
                   work on the UB and neither a DMA, nor a vector op, nor a global-memory access
                   (``tl.cumsum`` along a 1-D vector or a tile's last axis lowers to one), with
                   ``scalar_loop_iters`` their iterations per row in the hot loop.

"The hot loop": each top-level ``scf.for`` of the kernel whose bounds are not all constants (a
program's ``for blk in range(pid, n, num_programs)``, the preparation's walk over its chunk): one
iteration, with everything nested in it, divided by ``rows`` (the sub-block's items, ``BLOCK_M``).
The kernel's figure is the largest over its hot loops, metric by metric. What runs once per program
(before, between and after them, and loops of constant bounds: a scan of the experts' vector) is
reported apart (``per_program``). An ``scf.if`` counts as taken (the larger branch where there is an
``else``), except one the compiler marks ``hivm.unlikely_condition`` (the fill of a masked tail). A
loop whose trip count depends on loaded data counts once and is named in ``unknown_trips``.

What a library call costs inside (``cumsum_ra_*`` walks the rows of its tile; ``transpose_*``
moves elements) is not seen here: it is one vector op. The census is a count of what the compiler
scheduled, not a timing (docs/notes/npu-census.md turns it into an estimate, labelled as one).

:func:`read` turns a planned module into a compact tree (in the compiler's worker thread, as the
gate's other readings); :func:`census` evaluates it for a configuration's sizes; :func:`problems`
holds the figures against the targets (:data:`TARGETS`). Nothing here imports triton.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

from megablocks_ascend.lowering.plan import PlanError

# --------------------------------------------------------------------------------------------
# Reading: the entry function as a tree of loops, branches and the ops that cost something, each
# op resolved to what it is (its memref operands' static sizes are known where they are defined).

_TYPE = r"memref<[^<>]*(?:<[^<>]*>[^<>]*)*>"  # a memref type, with its strided<...> and address_space<...>
_TYPE_RE = re.compile(_TYPE)
_MEMREF_RE = re.compile(r"memref<([^,<>]*)[^#]*?(?:#hivm\.address_space<(\w+)>)?>$")
_ELEMENT_BITS = {"i1": 1, "i8": 8, "i16": 16, "i32": 32, "i64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64}
_FLAG_RE = re.compile(r"hivm\.hir\.(set_flag|wait_flag)\[<PIPE_(\w+)>,\s*<PIPE_(\w+)>")
_BARRIER_RE = re.compile(r"hivm\.hir\.pipe_barrier\[<PIPE_(\w+)>\]")
_SCALAR_RE = re.compile(r"\bmemref\.(load|store)\b.*:\s*(" + _TYPE + ")")
_CALL_RE = re.compile(r"\bcall\s+@(\w+)\(([^)]*)\)")
_DMA_PREFIXES = ("load_gm_to_ubuf", "store_ubuf_to_gm", "copy_gm_to", "nd2nz", "fixpipe")
_VIEW_RE = re.compile(r"^(%[\w.#]+)\s*=\s*(?:memref\.cast|memref\.collapse_shape|memref\.expand_shape|"
                      r"memref\.subview|memref\.reinterpret_cast|hivm\.hir\.pointer_cast)\b")
_CONST_RE = re.compile(r"^(%[\w.]+)\s*=\s*arith\.constant\s+(-?\d+)\s*:\s*(i\d+|index)\b")
_BIN_RE = re.compile(r"^(%[\w.]+)\s*=\s*arith\.(addi|subi|muli|divsi|divui|ceildivsi|remsi|minsi|maxsi|"
                     r"floordivsi)\s+(%[\w.]+),\s*(%[\w.]+)")
_CAST_RE = re.compile(r"^(%[\w.]+)\s*=\s*arith\.(?:index_cast|index_castui|extsi|extui|trunci)\s+(%[\w.]+)")
_FOR_RE = re.compile(r"scf\.for\s+%[\w.]+\s*=\s*(%[\w.]+)\s+to\s+(%[\w.]+)\s+step\s+(%[\w.]+)")


def _shape(memref: str) -> tuple[int | None, int, str | None]:
    """(elements, or None when a dimension is dynamic; element bits; address space) of a memref type."""
    m = _MEMREF_RE.match(memref)
    if not m:
        return None, 0, None
    *dims, elem = m.group(1).split("x")
    n = 1
    for d in dims:
        if not d.strip().isdigit():
            return None, _ELEMENT_BITS.get(elem.strip(), 0), m.group(2)
        n *= int(d)
    return n, _ELEMENT_BITS.get(elem.strip(), 0), m.group(2)


def _entry(text: str) -> tuple[list[str], str]:
    """The body lines of the device entry function (``hacc.entry``) and its signature line."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("func.func @") and "hacc.entry" in line and line.rstrip().endswith("{"):
            depth, body = 1, []
            for inner in lines[i + 1:]:
                s = inner.strip()
                if s.startswith("}"):
                    depth -= 1
                    if depth == 0:
                        return body, line
                if s.endswith("{"):
                    depth += 1
                body.append(inner)
            raise PlanError("the kernel function does not end")
    raise PlanError("no device entry function (hacc.entry) in the planned module")


def kernel_arguments(signature: str) -> list[str]:
    """The SSA names of the kernel's own arguments, in order: the entry function's arguments without
    the ones the compiler adds in front (``hacc.arg_type``: the FFTS base, the sync lock, the workspace)."""
    args, depth, current = [], 0, []
    for ch in signature[signature.index("(") + 1:]:
        if ch in "<({[":
            depth += 1
        elif ch in ">)}]":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            args.append("".join(current))
            current = []
        else:
            current.append(ch)
    args.append("".join(current))
    return [a.split(":")[0].strip() for a in args if a.strip() and "hacc.arg_type" not in a]


def read(text: str) -> dict:
    """The planned module's entry function as a compact tree (JSON-able lists): regions
    ``["for"|"if"|"else"|"region", header, attrs, items]`` whose items are regions and ops:
    ``["def", line]`` (integer arithmetic, for trip counts), ``["flag", "set"|"wait", pair]``,
    ``["barrier", pipe]``, ``["scalar", space]``, ``["dma", store, bytes]``, ``["vec", name, n]``."""
    body, signature = _entry(text)
    types: dict[str, str] = {}
    root = ["region", "", "", []]
    stack = [root]
    for line in body:
        s = line.strip()
        if not s:
            continue
        if s.startswith("}"):
            closed = stack.pop() if len(stack) > 1 else None
            rest = s[1:].strip()
            if rest.startswith("else"):
                region = ["else", s, "", []]
                parent = stack[-1][3]
                (parent[-1][3] if parent and parent[-1][0] == "if" else parent).append(region)  # inside its if
                stack.append(region)
            elif closed is not None:
                closed[2] = rest
            continue
        if s.endswith("{"):
            kind = "for" if "scf.for " in s else "if" if "scf.if " in s else "region"
            region = [kind, s, "", []]
            stack[-1][3].append(region)
            stack.append(region)
            continue
        op = _op(s, types)
        if op is not None:
            stack[-1][3].append(op)
    return dict(args=kernel_arguments(signature), tree=root)


def _op(s: str, types: dict) -> list | None:
    if _CONST_RE.match(s) or _BIN_RE.match(s) or _CAST_RE.match(s):
        return ["def", s]
    m = _VIEW_RE.match(s)
    if m:
        # the result's type where it is static (a view, a buffer), else the source's (a cast to a
        # dynamic memref, as every library call's operand is)
        static = [t for t in _TYPE_RE.findall(s) if _shape(t)[0] is not None]
        if static:
            types[m.group(1)] = static[-1]
        return None
    m = _FLAG_RE.search(s)
    if m:
        return ["flag", m.group(1)[:-5], f"{m.group(2)}>{m.group(3)}"]
    m = _BARRIER_RE.search(s)
    if m:
        return ["barrier", m.group(1)]
    m = _SCALAR_RE.search(s)
    if m:
        return ["scalar", "gm" if _shape(m.group(2))[2] == "gm" else "ub"]
    m = _CALL_RE.search(s)
    if m:
        name = m.group(1)
        shapes = [_shape(types[o.strip()]) for o in m.group(2).split(",") if o.strip() in types]
        if name.startswith(_DMA_PREFIXES):
            sized = [x for x in shapes if x[2] == "ub" and x[0]] or [x for x in shapes if x[0]]
            size = sized[0][0] * sized[0][1] / 8 if sized else None
            return ["dma", name.startswith("store_ubuf_to_gm"), size]
        sizes = [x[0] for x in shapes if x[0]]  # (a 0-element operand is the compiler's scratch)
        return ["vec", name, max(sizes) if sizes else None]
    return None


# --------------------------------------------------------------------------------------------
# Evaluating it for a configuration.


def _binop(op: str, a: int, b: int) -> int | None:
    if op in ("addi", "subi", "muli"):
        return a + b if op == "addi" else a - b if op == "subi" else a * b
    if b == 0:
        return None
    if op in ("divsi", "divui"):
        return int(a / b)
    if op == "floordivsi":
        return a // b
    if op == "ceildivsi":
        return -(-a // b)
    if op == "remsi":
        return int(math.fmod(a, b))
    return min(a, b) if op == "minsi" else max(a, b)


_COUNTERS = ("flags", "sets", "barriers", "small")


@dataclasses.dataclass
class Counts:
    flags: Counter = dataclasses.field(default_factory=Counter)  # "S>V" -> set + wait ops
    sets: Counter = dataclasses.field(default_factory=Counter)  # "S>V" -> set ops
    barriers: Counter = dataclasses.field(default_factory=Counter)  # "MTE3" -> pipe_barrier ops
    small: Counter = dataclasses.field(default_factory=Counter)  # "vsel_... x16" -> ops under 64 elements
    scalar_ub: float = 0.0
    scalar_gm: float = 0.0
    vector_ops: float = 0.0
    vector_lt64: float = 0.0
    vector_1: float = 0.0
    vector_i64: float = 0.0
    dma: float = 0.0
    dma_bytes: float = 0.0
    row_stores: float = 0.0
    scalar_loop_iters: float = 0.0

    def add(self, other: "Counts", times: float = 1.0) -> None:
        for name in _COUNTERS:
            mine = getattr(self, name)
            for k, v in getattr(other, name).items():
                mine[k] += v * times
        for f in dataclasses.fields(self):
            if f.name not in _COUNTERS:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name) * times)

    def weight(self) -> float:
        return sum(self.flags.values()) + sum(self.barriers.values()) + self.vector_ops + self.scalar_ub


class _Evaluator:
    def __init__(self, known: dict[str, int]):
        self.values = dict(known)
        self.constants: set[str] = set()
        self.unknown_trips: list[str] = []
        self.scalar_loops = 0

    def define(self, line: str) -> None:
        m = _CONST_RE.match(line)
        if m:
            self.values[m.group(1)] = int(m.group(2))
            self.constants.add(m.group(1))
            return
        m = _BIN_RE.match(line)
        if m:
            a, b = self.values.get(m.group(3)), self.values.get(m.group(4))
            if a is not None and b is not None:
                r = _binop(m.group(2), a, b)
                if r is not None:
                    self.values[m.group(1)] = r
            return
        m = _CAST_RE.match(line)
        if m and m.group(2) in self.values:
            self.values[m.group(1)] = self.values[m.group(2)]

    def trips(self, header: str) -> int | None:
        m = _FOR_RE.search(header)
        if not m:
            return None
        lo, hi, step = (self.values.get(x) for x in m.groups())
        if lo is None or hi is None or not step:
            return None
        return max(0, -(-(hi - lo) // step))

    def hot(self, region: list) -> bool:
        """A top-level loop over sub-blocks: its bounds are not all constants."""
        m = _FOR_RE.search(region[1])
        return bool(m) and not all(x in self.constants for x in m.groups())

    def op(self, op: list, c: Counts, in_row_loop: bool) -> None:
        kind = op[0]
        if kind == "def":
            self.define(op[1])
        elif kind == "flag":
            c.flags[op[2]] += 1
            if op[1] == "set":
                c.sets[op[2]] += 1
        elif kind == "barrier":
            c.barriers[op[1]] += 1
        elif kind == "scalar":
            if op[1] == "gm":
                c.scalar_gm += 1
            else:
                c.scalar_ub += 1
        elif kind == "dma":
            c.dma += 1
            c.dma_bytes += op[2] or 0
            if op[1] and in_row_loop:
                c.row_stores += 1
        else:  # "vec"
            name, n = op[1], op[2]
            c.vector_ops += 1
            if n is not None and n < 64:
                c.vector_lt64 += 1
                c.small[f"{name} x{n}"] += 1
                if n == 1:
                    c.vector_1 += 1
            if "int64" in name and name.startswith(("v", "reduce")) and not name.startswith("vcast"):
                c.vector_i64 += 1  # (arithmetic: not a cast, how int64 ids come in, nor a broadcast or copy)

    def loop(self, region: list, in_row_loop: bool = False, hot: bool = False) -> tuple[Counts, int]:
        """One iteration of a loop (nested loops with their trip counts) and its trip count (1 where
        it depends on loaded data, noted; not asked of a hot loop)."""
        trips = 1 if hot else self.trips(region[1])
        inner = self.region(region, in_row_loop or "ExtractedLoadOrStore" in region[2])
        if trips is None:
            self.unknown_trips.append(region[1][:120])
            trips = 1
        nested = any(x[0] == "for" for x in region[3])
        if inner.dma == 0 and inner.vector_ops == 0 and inner.scalar_gm == 0 and inner.scalar_ub > 0 and not nested:
            self.scalar_loops += 1
            inner.scalar_loop_iters += 1
        return inner, trips

    def region(self, region: list, in_row_loop: bool = False) -> Counts:
        """One execution of a region's body."""
        c = Counts()
        for item in region[3]:
            if item[0] not in ("for", "if", "else", "region"):
                self.op(item, c, in_row_loop)
            elif item[0] == "for":
                inner, trips = self.loop(item, in_row_loop)
                c.add(inner, trips)
            elif item[0] == "if":
                if "hivm.unlikely_condition" in item[2]:
                    continue
                branches = [x for x in item[3] if x[0] == "else"]
                taken = self.region(["region", "", "", [x for x in item[3] if x[0] != "else"]], in_row_loop)
                if branches:
                    other = self.region(branches[0], in_row_loop)
                    taken = taken if taken.weight() >= other.weight() else other
                c.add(taken)
            else:
                c.add(self.region(item, in_row_loop))
        return c


ROW_METRICS = ("flags", "handshakes_sv", "barriers", "barriers_mte3", "scalar_ub", "scalar_gm", "vector_ops",
               "vector_lt64", "vector_1", "vector_i64", "dma", "dma_bytes", "row_stores", "scalar_loop_iters")


def _figures(c: Counts, rows: int) -> dict:
    per = 1.0 / rows

    def r(v: float) -> float:
        return round(v * per, 3)
    return dict(
        flags=r(sum(c.flags.values())), flags_by_pair={k: r(v) for k, v in sorted(c.flags.items())},
        handshakes_sv=r(c.sets.get("S>V", 0) + c.sets.get("V>S", 0)),
        barriers=r(sum(c.barriers.values())), barriers_by_pipe={k: r(v) for k, v in sorted(c.barriers.items())},
        barriers_mte3=r(c.barriers.get("MTE3", 0)), scalar_ub=r(c.scalar_ub), scalar_gm=r(c.scalar_gm),
        vector_ops=r(c.vector_ops), vector_lt64=r(c.vector_lt64), vector_1=r(c.vector_1), vector_i64=r(c.vector_i64),
        dma=r(c.dma), dma_bytes=round(c.dma_bytes * per, 1), row_stores=r(c.row_stores),
        scalar_loop_iters=r(c.scalar_loop_iters), small_ops={k: r(v) for k, v in c.small.most_common(6)})


def census(module: dict, scalars: dict, runtime_args: list, rows: int, programs: int = 40) -> dict:
    """The per-row census of a module :func:`read` made (see the module docstring).

    ``scalars``: the kernel's integer arguments by name; ``runtime_args``: its runtime argument names
    in order (pointers and scalars, as in its Python signature); ``rows``: the items per iteration of
    its hot loops (``BLOCK_M``); ``programs``: the grid (the vector cores of an A2)."""
    names = module["args"]
    known = {ssa: int(scalars[name]) for ssa, name in zip(names, runtime_args) if name in scalars}
    grid = names[len(runtime_args):]  # the launch's grid dimensions follow the kernel's arguments
    known.update({ssa: programs if i == 0 else 1 for i, ssa in enumerate(grid)})
    ev = _Evaluator(known)
    loops, outside = [], Counts()
    for item in _top(module["tree"]):
        if item[0] not in ("for", "if", "else", "region"):
            ev.op(item, outside, False)
        elif item[0] == "for" and ev.hot(item):
            loops.append(ev.loop(item, hot=True)[0])
        elif item[0] == "for":
            inner, trips = ev.loop(item)
            outside.add(inner, trips)
        else:
            outside.add(ev.region(item))
    per_loop = [_figures(c, rows) for c in loops]
    out = {k: max((p[k] for p in per_loop), default=0) for k in ROW_METRICS}
    for key in ("flags_by_pair", "barriers_by_pipe", "small_ops"):
        merged: dict = {}
        for p in per_loop:
            for k, v in p[key].items():
                merged[k] = max(merged.get(k, 0), v)
        out[key] = dict(sorted(merged.items()))
    out.update(scalar_loops=ev.scalar_loops, hot_loops=len(loops), unknown_trips=ev.unknown_trips,
               per_program={k: v for k, v in _figures(outside, 1).items() if v})
    return out


def _top(tree: list):
    """The function body's items, with top-level branches that hold loops opened (a loop in a
    compile-time branch is still a top-level loop)."""
    for item in tree[3]:
        if item[0] in ("if", "region") and any(x[0] == "for" for x in item[3]):
            yield from _top(item)
        else:
            yield item


# --------------------------------------------------------------------------------------------
# The targets: what the per-row census of a configuration the NPU's launchers can choose must meet.


@dataclasses.dataclass(frozen=True)
class Target:
    metric: str
    most: float  # the figure may not exceed this
    what: str
    chosen_only: bool = False  # only for configurations the NPU's launchers choose


TARGETS = (
    Target("vector_1", 0, "one-element vector ops per row in a hot loop"),
    Target("scalar_loops", 0, "per-element scalar loops in the kernel"),
    Target("handshakes_sv", 1, "scalar<->vector handshakes per row", chosen_only=True),
    Target("row_stores", 0, "stores issued row by row (to data-dependent rows) per row, beyond what the "
                            "kernel's result needs", chosen_only=True),
    # A loop of one small vector op per row of a tile (an elementwise op on a tile whose last axis is
    # shorter than a 32-byte block: the preparation's one-hot with its 4 items along the last axis at
    # 1024 experts made 516 per item) grows with the tile's other side; what is left are ops on the
    # sub-block's own BLOCK_M-wide vectors (at most 18.5 per row at 4 items a block).
    Target("vector_lt64", 32, "vector ops over fewer than 64 elements per row", chosen_only=True),
)


def problems(figures: dict, *, chosen: bool, inherent_row_stores: int = 0, int64: bool = False) -> list[str]:
    """Where ``figures`` miss a target. ``chosen``: the NPU's launchers can choose this configuration
    (else only the targets every kernel meets apply); ``inherent_row_stores``: the stores to computed
    positions the result itself needs per row (a sort's); ``int64``: an int64-offset configuration
    (else any int64 vector op in the hot loop misses)."""
    out = []
    for t in TARGETS:
        if t.chosen_only and not chosen:
            continue
        most = t.most + (inherent_row_stores if t.metric == "row_stores" else 0)
        if figures[t.metric] > most:
            out.append(f"census: {figures[t.metric]:g} {t.what} (target <= {most:g})")
    if not int64 and figures["vector_i64"] > 0:
        out.append(f"census: {figures['vector_i64']:g} int64 vector ops per row in a hot loop (target 0)")
    return out
