"""What the gate prints and writes: the report (a table per kind of kernel, the back end's summary,
the failures, ``lowered: N/M`` last), the JSON of the results and the recorded memory plans.

Pure functions of the gate's rows (:mod:`.gate`); nothing here runs a compiler.
"""

from __future__ import annotations

import json
from pathlib import Path


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

# The census (census.py), per row of the hot loop: a table of its own after the memory tables.
CENSUS_COLUMNS = (("kernel", "kernel"), ("config", "configuration"), ("npu", "NPU runs it"),
                  ("flags", "set/wait"), ("handshakes_sv", "S<>V"), ("barriers_mte3", "MTE3 bar."),
                  ("barriers", "barriers"), ("scalar_ub", "scalar UB"), ("scalar_gm", "scalar GM"),
                  ("vector_ops", "vector"), ("vector_lt64", "vec<64"), ("vector_1", "vec x1"),
                  ("dma", "DMA"), ("dma_bytes", "B/row"), ("row_stores", "row st."), ("scalar_loops", "scalar loops"))


def _table(results: list[dict], columns) -> list[str]:
    def cell(r, k):
        if k in _PLANNED:
            v = _pct(r, *_PLANNED[k])
        elif k == "npu":
            v = "yes" if r.get("npu_chosen") else "no"
        else:
            v = r.get(k, (r.get("cube_bytes") or {}).get(k))
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
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


def census_summary(results: list[dict]) -> list[str]:
    """The census in a few lines: the largest figure of each targeted metric over the configurations
    an NPU runs, and where; configurations whose census differs between targets."""
    counted = [r for r in results if r.get("census")]
    if not counted:
        return []
    chosen = [r for r in counted if r.get("npu_chosen")]
    lines = []
    for metric, what in (("flags", "set/wait flags"), ("handshakes_sv", "scalar<->vector handshakes"),
                         ("barriers_mte3", "MTE3 barriers"), ("vector_1", "one-element vector ops"),
                         ("vector_lt64", "vector ops over fewer than 64 elements"),
                         ("row_stores", "row-by-row stores"), ("scalar_loops", "per-element scalar loops (in the kernel)")):
        top = max(chosen or counted, key=lambda r: r["census"][metric])
        per = "" if metric == "scalar_loops" else " per row"
        lines.append(f"  most {what}{per}: {top['census'][metric]:g} ({top['kernel']} [{top['config']}])")
    differs = [r for r in counted if r.get("census_differs")]
    lines.append(f"  targets with a different census from the first: {len(differs)} configurations")
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
    counted = [dict(r, **r["census"]) for r in results if r.get("census")]
    if counted:
        lines += ["", "census per row of the hot loop (first target; docs/notes/npu-census.md):"]
        lines += _table(counted, CENSUS_COLUMNS)
    summary = plan_summary(results)
    if summary:
        lines += ["", "memory plans (bishengir-compile, first target):"] + summary
    summary = census_summary(results)
    if summary:
        lines += ["", "census (the configurations an NPU runs):"] + summary
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


TILE_CONSTEXPRS = ("BLOCK_M", "BLOCK_X", "BLOCK_K", "BLOCK_E", "CHUNK")  # a census entry's tile


def write_census(path: str, results: list[dict], backend, digests: dict) -> None:
    """Merge the census of ``results`` into the JSON file ``path`` (``tests/data/ascend_census.json``,
    which a CPU test holds against the targets): per kernel and configuration, the figures, what the
    targets need to know (NPU-chosen, inherent stores, int64), its tile and planned UB bytes, and the
    digest of the kernel's source (``digests``: kernel name -> ``table.source_digest``), one entry per
    line."""
    p = Path(path)
    data = json.loads(p.read_text()) if p.is_file() else {}
    entries = {(e["kernel"], e["config"]): e for e in data.get("census", [])}
    keep = ("flags", "handshakes_sv", "barriers", "barriers_mte3", "scalar_ub", "scalar_gm", "vector_ops",
            "vector_lt64", "vector_1", "vector_i64", "dma", "dma_bytes", "row_stores", "scalar_loops",
            "scalar_loop_iters")
    for r in results:
        if not r.get("census") or r.get("overridden"):  # (a tile set by hand is no launcher's)
            continue
        entries[(r["kernel"], r["config"])] = dict(
            kernel=r["kernel"], config=r["config"], axes=r["axes"], experts=r["experts"],
            npu_chosen=r["npu_chosen"], inherent_row_stores=r["inherent_row_stores"],
            figures={k: r["census"][k] for k in keep}, digest=digests[r["kernel"]], status=r["status"],
            tile={k: r["constexprs"][k] for k in TILE_CONSTEXPRS if k in r["constexprs"]}, ub_plan=r.get("ub_plan"))
    head = dict(compiler=backend.compiler.describe() if backend else data.get("compiler"),
                target=backend.targets[0] if backend else data.get("target"))
    lines = [json.dumps(e, sort_keys=True, separators=(",", ":"))
             for e in sorted(entries.values(), key=lambda e: (e["kernel"], e["config"]))]
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(head, sort_keys=True)[:-1] + ', "census": [\n' + ",\n".join(lines) + "\n]}\n")


def write_json(path: str, results: list[dict], backend, arch: str, seconds: float) -> None:
    """The results as JSON (``--json``): the front end's target, the back end's targets, compiler
    and flags (None without a back end), the wall time and one entry per configuration."""
    Path(path).write_text(json.dumps(dict(
        target=arch, targets=list(backend.targets) if backend else [],
        compiler=backend.compiler.describe() if backend else None,
        flags={t: backend.flags(t) for t in backend.targets} if backend else None,
        seconds=round(seconds, 1), results=results), indent=1, default=str))
