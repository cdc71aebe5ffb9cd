"""Reading the planned module: the on-chip memory plan ``bishengir-compile`` made for a kernel.

The compile gate's back end (:mod:`.bishengir`) keeps the module the compiler hands to ``hivmc``
(``module.hivm.opt.mlir``, from ``--save-temps``) and reads it here:

* every on-chip buffer is a ``hivm.hir.pointer_cast(%offset) : memref<SHAPE x T,
  #hivm.address_space<SPACE>>`` at a constant byte offset in ``ub`` (a vector core's Unified
  Buffer), ``cbuf`` (an AI core's L1) or ``cc`` (its L0C); the planned peak of a space is the
  largest ``offset + size``, an ``i1`` element counted as a bit, as the planner packs masks: the
  routing preparation at 1024 experts plans a ``1024x256x1xi1`` mask of its own at offset 98,752,
  where a byte per element would end 164 KiB past the Unified Buffer, and the compiler reported no
  overflow (elsewhere masks lie over buffers of wider types and never set a peak);
* the module carries the target's capacities (``UB_SIZE``, ``L1_SIZE``, ``L0C_SIZE`` ... in bits)
  and core counts, the kernel's core type (``hivm.module_core_type``: ``AIV`` vector, ``AIC``
  cube, ``MIX``) and the task type the launcher reads back (``<kernel>_infer_task_type_function``:
  10 vector, 20 cube, 3x/4x mixed);
* the synchronisation the solver inserted: ``hivm.hir.set_flag`` / ``wait_flag`` / ``pipe_barrier``.

A reading that finds the module other than it expects raises :class:`PlanError`; the back end
fails the configuration with it.
"""

from __future__ import annotations

import re


class PlanError(ValueError):
    pass


SPACES = ("ub", "cbuf", "cc")  # Unified Buffer, L1, L0C
# The module's capacity entries (bits) for each space, and the ones reported besides.
CAPACITY_KEYS = {"ub": "UB_SIZE", "cbuf": "L1_SIZE", "cc": "L0C_SIZE"}
_ELEMENT_BITS = {"i1": 1, "i8": 8, "i16": 16, "i32": 32, "i64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64}
_CONST_I64_RE = re.compile(r"(%c[\w]*)\s*=\s*arith\.constant\s+(-?\d+)\s*:\s*i64\b")
_POINTER_CAST_RE = re.compile(
    r"hivm\.hir\.pointer_cast\(([^)]*)\)[^:\n]*:\s*memref<([^,>]*)(?:,[^#>\n]*)?,\s*#hivm\.address_space<(\w+)>>")
_SPEC_RE = re.compile(r'#dlti\.dl_entry<"(\w+)",\s*(\d+)\s*:\s*i\d+>')
_CORE_RE = re.compile(r"hivm\.module_core_type\s*=\s*#hivm\.module_core_type<(\w+)>")
_TASK_RE = re.compile(r"func\.func\s+@\w+_infer_task_type_function\(\)[^\n]*\n\s*(%\S+)\s*=\s*arith\.constant\s+(\d+)")
_SYNC_OPS = ("set_flag", "wait_flag", "pipe_barrier")


def _bytes(shape: str) -> int:
    *dims, elem = shape.split("x")
    if elem not in _ELEMENT_BITS:
        raise PlanError(f"unknown element type in memref<{shape}>")
    n = 1
    for d in dims:
        if not d.isdigit():
            raise PlanError(f"a buffer of dynamic size: memref<{shape}>")
        n *= int(d)
    return (n * _ELEMENT_BITS[elem] + 7) // 8


def read_plan(text: str) -> dict:
    """The memory plan and synchronisation of a planned module (``module.hivm.opt.mlir``).

    Returns ``peak`` / ``buffers`` / ``capacity`` per space (bytes), ``core_type``, ``task_type``,
    ``sync`` (counts of each sync op) and ``cores`` (the target's AI and vector core counts)."""
    consts = {m.group(1): int(m.group(2)) for m in _CONST_I64_RE.finditer(text)}
    peak = dict.fromkeys(SPACES, 0)
    buffers = dict.fromkeys(SPACES, 0)
    for m in _POINTER_CAST_RE.finditer(text):
        space = m.group(3)
        if space not in peak:
            raise PlanError(f"a buffer in address space {space!r}")
        size = _bytes(m.group(2))
        for name in (o.strip() for o in m.group(1).split(",")):
            if name not in consts:
                raise PlanError(f"pointer_cast at a non-constant offset {name}")
            peak[space] = max(peak[space], consts[name] + size)
            buffers[space] += 1
    spec = {m.group(1): int(m.group(2)) for m in _SPEC_RE.finditer(text)}
    missing = [k for k in CAPACITY_KEYS.values() if k not in spec]
    if missing:
        raise PlanError(f"the module carries no {', '.join(missing)}")
    core = _CORE_RE.search(text)
    task = _TASK_RE.search(text)
    return dict(
        peak=peak, buffers=buffers,
        capacity={s: spec[k] // 8 for s, k in CAPACITY_KEYS.items()},
        core_type=core.group(1) if core else None,
        task_type=int(task.group(2)) if task else None,
        sync={op: len(re.findall(rf"\bhivm\.hir\.{op}\b", text)) for op in _SYNC_OPS},
        cores=dict(aic=spec.get("AI_CORE_COUNT"), aiv=spec.get("VECTOR_CORE_COUNT")),
    )


def percent(plan: dict, space: str) -> float:
    return 100.0 * plan["peak"][space] / plan["capacity"][space]
