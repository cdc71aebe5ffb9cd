"""The gate itself: every configuration through both stages, judged, one row each.

:func:`run` lowers each configuration with triton-ascend's front end (:mod:`.driver`), counts its
IR (:mod:`.ir`) and checks the counts against the table's entry (:func:`front_end`), while a pool of
threads compiles each lowered module with ``bishengir-compile`` for every gated target
(:mod:`.bishengir`) and reads its planned module with each of :data:`READINGS`; :func:`back_end`
then folds each reading into the row with the gate's checks on it. A row is ``ok`` when nothing
failed; its ``error`` says what did.

Another reading of the planned module (the memory plan is :mod:`.plan`) is one entry of
:data:`READINGS`: its name (its key in each target's result), its reader (the planned module's
text to a dict, run in the compiler's worker thread) and its fold (the row, the table entry, the
configuration and the results by target to the row's new fields and problems).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from megablocks_ascend.lowering import census, ir, plan
from megablocks_ascend.lowering.configs import Config, configs
from megablocks_ascend.lowering.driver import Lowerer, error_text, lower_retrying_tool_crashes
from megablocks_ascend.lowering.table import KERNELS, KernelSpec, kernel_params


def run(kernels: Iterable[KernelSpec] = KERNELS, *, dump: str | None = None,
        lowerer: Lowerer | None = None, only: str | None = None, backend=None,
        cfgs: list[Config] | None = None) -> list[dict]:
    """Lower every configuration; one result dict per configuration.

    ``backend`` (a :class:`.bishengir.Stage`) compiles each lowered module with bishengir-compile
    for every gated target, in a pool of threads (the compiler is a subprocess) while the front end
    goes on with the next configurations; None: the front end only.
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
            row, linalg = front_end(lowerer, spec, cfg, dump)
            results.append(row)
            if pool is not None and linalg is not None:
                keep = Path(dump) / _stem(cfg) if dump else None
                futures = {t: pool.submit(backend.compile, linalg, t, keep=keep and str(keep) + f".{t}")
                           for t in backend.targets}
                pending.append((row, spec, cfg, futures))
        for row, spec, cfg, futures in pending:
            back_end(row, spec, cfg, {t: f.result() for t, f in futures.items()})
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return results


def _stem(cfg: Config) -> str:
    return f"{cfg.kernel}__" + re.sub(r"[^\w=.-]+", "_", cfg.label)


def front_end(lowerer, spec: KernelSpec, cfg: Config, dump: str | None) -> tuple[dict, str | None]:
    """triton-ascend's ttir and ttadapter stages and the IR's counts: (row, Ascend IR or None)."""
    from megablocks_ascend import devices  # noqa: PLC0415

    row = dict(kernel=cfg.kernel, config=cfg.label, axes=cfg.axes, constexprs=cfg.constexprs,
               ub_bytes=cfg.ub_bytes, row_copy=spec.row_copy, cube=spec.cube, cube_bytes=cfg.cube_bytes,
               experts=cfg.experts, overridden=list(cfg.overridden))
    t0 = time.perf_counter()
    linalg = None
    try:
        ttir, linalg, retries = lower_retrying_tool_crashes(lowerer, spec, cfg)
    except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
        row.update(status="FAIL", error=error_text(exc))
    else:
        if retries:
            row["tool_crashes"] = retries
        if spec.cube:
            counts = ir.analyze_cube_ir(linalg)
            row.update(counts)
            problems = ir.cube_problems(counts)
            over = {k: v for k, v in cfg.cube_bytes.items() if v > devices.CUBE_LIMITS[k]}
            if over:
                problems.append(f"cube tile over the A2 budget: {over}")
        else:
            counts = ir.analyze_ir(linalg, cfg.constexprs.get(spec.hot_step))
            row.update(counts)
            row["mix_mode"] = ir.mix_mode(linalg)
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


def back_end(row: dict, spec: KernelSpec, cfg: Config, by_target: dict) -> None:
    """Fold the back end's results (one per target) into the row, with the gate's checks on them:
    the compile itself on every target, then each of :data:`READINGS` in turn."""
    problems = []
    row["backend"] = by_target
    for target, res in by_target.items():
        tag = f"{target}: " if len(by_target) > 1 else ""
        problems += [tag + p for p in res["problems"]]
    for reading in READINGS:
        problems += reading.fold(row, spec, cfg, by_target)
    if problems:
        row["status"] = "FAIL"
        row["error"] = "; ".join(([row["error"]] if row.get("error") else []) + problems)


# What an A2/A3 launch needs of each kind of kernel (docs/notes/ascend-lowering.md, "Launch
# metadata"): triton-ascend 3.2.0 registers an "aiv" binary as a vector-core ELF and launches one
# block per vector core; any other mix_mode as an AI-core ELF, one block per AI core. bishengir's
# plan says what the kernel is: its module core type and the task type the launcher reads back.
LAUNCH = {False: dict(mix_modes=("aiv",), core_type="AIV", task_type=10),
          True: dict(mix_modes=("aic", "mix"), core_type="AIC", task_type=20)}


def _fold_plan(row: dict, spec: KernelSpec, cfg: Config, by_target: dict) -> list[str]:
    """The first target's memory plan in the row (peaks, buffers, sync), checked: the launch
    metadata, the memory model against the plan; targets whose planned peaks differ are noted."""
    first = next(iter(by_target.values()))
    planned = first.get("plan")
    if planned is None:
        return []
    problems = []
    peak = planned["peak"]
    row.update(plan=planned, core_type=planned["core_type"], task_type=planned["task_type"],
               ub_plan=peak["ub"], l1_plan=peak["cbuf"], l0c_plan=peak["cc"],
               buffers=sum(planned["buffers"].values()),
               sync="{set_flag}/{wait_flag}/{pipe_barrier}".format(**planned["sync"]))
    want = LAUNCH[spec.cube]
    mode = first.get("mix_mode")
    if mode not in want["mix_modes"] or planned["core_type"] != want["core_type"] \
            or planned["task_type"] != want["task_type"]:
        problems.append(f"launch metadata: adapter mix_mode {mode!r}, planned core type "
                        f"{planned['core_type']}, task type {planned['task_type']}; a "
                        f"{'cube' if spec.cube else 'vector'} kernel needs {want}")
    problems += model_problems(cfg, planned)
    for target, res in list(by_target.items())[1:]:
        other = res.get("plan")
        if other is not None and other["peak"] != peak:
            row.setdefault("plan_differs", {})[target] = other["peak"]
    return problems


def model_problems(cfg: Config, planned: dict) -> list[str]:
    """Where ``devices``' memory model is not an upper bound of the planned peaks."""
    peak, out = planned["peak"], []
    if cfg.ub_bytes is not None and peak["ub"] > cfg.ub_bytes:
        out.append(f"memory model short: UB planned {peak['ub']} > devices.ub_bytes {cfg.ub_bytes}")
    if cfg.cube_bytes is not None:
        for space, key in (("cbuf", "l1"), ("cc", "l0c")):
            if peak[space] > cfg.cube_bytes[key]:
                out.append(f"memory model short: {key.upper()} planned {peak[space]} > "
                           f"devices.cube_bytes {cfg.cube_bytes[key]}")
    return out


def census_rows(spec: KernelSpec, cfg: Config) -> int:
    """The items one iteration of the kernel's hot loop handles (its sub-block): ``BLOCK_M``, else
    the constexpr stepping its hot loop (``BLOCK`` of the row indices and the zero fill)."""
    return int(cfg.constexprs.get("BLOCK_M") or cfg.constexprs.get(spec.hot_step) or 1)


def _fold_census(row: dict, spec: KernelSpec, cfg: Config, by_target: dict) -> list[str]:
    """Each target's census (per row of the hot loop) in its result, the first target's in the row,
    held against :data:`census.TARGETS`; targets whose census differs from the first are noted."""
    runtime, _ = kernel_params(spec.kernel().fn)
    figures = {}
    for target, res in by_target.items():
        module = res.get("census")
        if module is None:
            continue
        cores = (res.get("plan") or {}).get("cores") or {}
        programs = cores.get("aic" if spec.cube else "aiv") or 40
        res["census"] = figures[target] = census.census(module, cfg.scalars, runtime, census_rows(spec, cfg),
                                                        programs=programs)
    if not figures:
        return []
    first = next(iter(figures.values()))
    row["census"] = first
    row["npu_chosen"] = spec.npu_chosen
    row["inherent_row_stores"] = spec.inherent_row_stores(cfg.axes)
    for target, other in list(figures.items())[1:]:
        if {k: other[k] for k in census.ROW_METRICS} != {k: first[k] for k in census.ROW_METRICS}:
            row.setdefault("census_differs", []).append(target)
    return census.problems(first, chosen=spec.npu_chosen, inherent_row_stores=row["inherent_row_stores"],
                           int64=bool(cfg.axes.get("INT64")))


class Reading(NamedTuple):
    """One reading of the planned module, from the compiler's worker thread to the row."""
    name: str  # its key in each target's result (and in the JSON's "backend" entries)
    read: Callable[[str], dict]  # the planned module's text -> the reading; raises plan.PlanError
    fold: Callable[[dict, KernelSpec, Config, dict], list[str]]  # (row, spec, cfg, by target) -> problems


READINGS = (
    Reading("plan", plan.read_plan, _fold_plan),
    Reading("census", census.read, _fold_census),
)


def readers() -> dict:
    """The readings as the back-end stage takes them (``bishengir.Stage(..., readings)``)."""
    return {r.name: r.read for r in READINGS}
