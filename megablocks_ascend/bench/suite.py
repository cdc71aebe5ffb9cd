"""``python -m megablocks_ascend bench``: ours against every alternative this device has.

One idea: the command (its plan, one function per section that turns the measuring modules' results
into rows, the table and the files it writes); what each section measures lives in its own module.

On whatever device the machine has (``--device``; default the NPU, else CUDA, else the CPU):

``ops``    every routing op (gather, weighted scatter, router-weight gradient in the binned,
           dropless and padded layouts) at named shapes, ours (our Triton kernels) against the
           ``torch`` backend everywhere and upstream MegaBlocks' kernels on CUDA;
``prep``   the routing preparation (router ids -> indices, bins, ...), ours against the ``torch``
           backend and, on CUDA, MegaBlocks' own sort / histogram / cumsum sequence;
``fused``  on an NPU, torch_npu's fused ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` /
           ``npu_moe_init_routing_v2`` where their documented semantics match ours (the argument
           mapping and where they do not apply: :mod:`~megablocks_ascend.bench.fused_npu`);
``sparse`` the sparse dMoE's block-sparse products and its whole step, ours against the same as
           grouped GEMMs plus the layout copy (:mod:`~megablocks_ascend.bench.sparse_forms`): by
           default on an NPU only, elsewhere when ``--sections`` names it;
``steps``  a MegaBlocks ``dMoE`` and ``MoE`` training step (forward + backward) at named configs,
           ours against upstream's kernels on CUDA and the ``torch`` backend elsewhere; eager, and
           captured in a graph where the device has graph capture; with each step's peak memory.

Every row is timed with :mod:`~megablocks_ascend.bench.timing` (host launch + device time, and device
time from graph replay where the device has graph capture) unless the device cannot be timed, in
which case the row says so and holds no time. Every output and gradient gets the precision verdict
of :mod:`~megablocks_ascend.bench.precision` (the three ratios against a CPU golden and a CPU
simulation in the device dtype), on a problem of the same shape with at most ``--precision-tokens``
tokens; a training step's verdict on a layer of the same family (the same experts and top_k) with
its hidden and ffn sizes cut (:func:`~megablocks_ascend.bench.precision.precision_config`: a DeepSeek-V3
layer's CPU golden alone would take 30 GB and minutes), or on the config's own layer with
``--precision-full``. The step rows carry each step's peak memory above resident, ours against
upstream's. Written to ``--out``: ``NAME.json`` (every row, the verdicts, the environment),
``NAME.log`` (the tables) and ``NAME.png`` (ours against the alternatives, per op and per step).
The exit status is 1 when a check or a verdict fails. Progress lines say what runs and how long each
section, config and row took; the default run is sized to finish within 5 minutes on an H200 host.

The routing ops and every verdict are in ``--dtype`` (bfloat16; float16 on the CPU, where the
Triton interpreter converts float32 to bfloat16 by truncation where devices round to nearest: one
truncation has twice the RMSE of one rounding, so bfloat16 verdicts there sit on the RMSE limit for
reasons of the interpreter, not of the kernels); the timed steps are bfloat16 everywhere.

Shapes: ``--quick`` the tiny ``quick`` problem and the ``tiny`` / ``tiny16`` step configs (the CPU
smoke test of CI); otherwise the routing benchmark's ``mixtral``, ``fine``, ``small`` and the step
harness's ``ds64``, ``qw128``, ``mixtral``, ``small``, ``dsv3`` (DeepSeek-V3), ``qw3`` (Qwen3-235B) and
``e256``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from megablocks_ascend import backends
from megablocks_ascend.bench import (fused_npu, plot, precision, report, routing_ops, routing_table, sparse_forms,
                                     steps, timing)

IMPL_OF_BACKEND = {"ascend": "ours", "cuda": "upstream", "torch": "torch"}
SECTIONS = ("ops", "prep", "fused", "sparse", "steps")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_device() -> torch.device:
    from megablocks_ascend.cli.selftest import default_device as dd  # noqa: PLC0415
    return dd()


@dataclasses.dataclass
class Plan:
    """What to run: the device (``timing_device`` times, ``tensor_device`` holds the tensors: the same
    device except in tests, where an NPU that cannot be timed stands over CPU tensors)."""
    timing_device: torch.device
    tensor_device: torch.device
    shapes: dict
    configs: dict
    tokens: int
    precision_tokens: int
    step_tokens_precision: int
    quick: bool = False
    repeats: int = 3
    steps: int = 20
    dtype: torch.dtype = torch.bfloat16
    precision_configs: tuple | None = None  # the step configs judged (None: every one)
    sections: tuple = ("ops", "prep", "fused", "steps")  # by default; "sparse" too on an NPU (plan_for)
    warmup: int = 2  # untimed steps before a step row's first checked one
    profile_steps: int = 1  # steps profiled for a step row's kernel count (CUDA)
    precision_full: bool = False  # the step verdicts on the configs' own layers, not reduced ones
    precision_reduce: dict = dataclasses.field(default_factory=dict)  # precision.precision_config's limits

    @property
    def kind(self) -> str:
        return self.timing_device.type


def plan_for(device: torch.device, quick: bool, shapes=None, configs=None, sections=None) -> Plan:
    shape_table = routing_ops.QUICK_SHAPES if quick else routing_ops.SHAPES
    config_table = steps.QUICK_CONFIGS if quick else steps.CONFIGS
    pick = (lambda table, names: {n: table[n] for n in names} if names else dict(table))  # noqa: E731
    for names, table, what in ((shapes, shape_table, "--shapes"), (configs, config_table, "--configs")):
        bad = [n for n in names or () if n not in table]
        if bad:
            raise SystemExit(f"bench: unknown {what} {bad}; known: {', '.join(table)}")
    return Plan(device, device, pick(shape_table, shapes), pick(config_table, configs),
                tokens=steps.QUICK_TOKENS if quick else steps.TOKENS,
                precision_tokens=64 if quick else 2048, step_tokens_precision=32 if quick else 256, quick=quick,
                repeats=1 if quick else 3, steps=3 if quick else 10, warmup=1 if quick else 2, profile_steps=1,
                sections=tuple(sections) if sections else Plan.sections + (("sparse",) if device.type == "npu" else ()),
                dtype=torch.float16 if device.type == "cpu" else torch.bfloat16,
                # the quick configs' verdicts go through the reduced layers too (the path large ones take)
                precision_reduce=dict(max_params=1 << 15, hidden=32, ffn=32) if quick else {})


def alternatives(kind: str) -> tuple[str, ...]:
    """The implementations compared with ours on a device kind."""
    return ("torch", "upstream") if kind == "cuda" else ("torch",)


# ------------------------------------------------------------------------------------------
# Timing rows


def _time(fn, plan: Plan, graph: bool = True, log=print) -> dict:
    """``{ms, graph_ms}``, or ``{why}`` where the device cannot be timed."""
    t = timing.timer(plan.timing_device)
    if not t.timed:
        return {"ms": None, "graph_ms": None, "why": f"not timed: {t.how}"}
    ms = timing.do_bench(fn, plan.timing_device, repeats=plan.repeats)
    gms = timing.graph_ms(fn, plan.timing_device, log=log) if graph else None
    return {"ms": ms, "graph_ms": gms}


def _rates(row: dict, nbytes: int | None, ceiling: float | None) -> None:
    if nbytes is None or not ceiling:
        return
    row["min_bytes"] = nbytes
    if row.get("ms"):
        row["GBps"] = nbytes / row["ms"] / 1e6
        row["frac_ceiling"] = row["GBps"] / ceiling
    if row.get("graph_ms"):
        row["graph_frac_ceiling"] = nbytes / row["graph_ms"] / 1e6 / ceiling


def _ratios(rows: list[dict]) -> None:
    """``x``: each alternative's time over ours (> 1: ours is faster), on device time where both
    have it, else on host-launch + device time."""
    groups = {}
    for r in rows:
        groups.setdefault((r["section"], r["case"], r["item"]), []).append(r)
    for group in groups.values():
        ours = next((r for r in group if r["impl"] == "ours"), None)
        for r in group:
            if ours is None or r is ours or not r.get("ms") or not ours.get("ms"):
                continue
            both_graph = r.get("graph_ms") and ours.get("graph_ms")
            r["x"] = (r["graph_ms"] / ours["graph_ms"]) if both_graph else (r["ms"] / ours["ms"])
            r["x_on"] = "device (graph)" if both_graph else "host launch + device"


# ------------------------------------------------------------------------------------------
# Sections


def _impl_fn(op, impl):
    return routing_ops.implementation(op, impl)


def ops_section(plan: Plan, ceiling: float | None, log) -> list[dict]:
    """Every routing op at every shape: ours against :func:`alternatives`, each with its verdict."""
    rows = []
    impls = ("ours",) + alternatives(plan.kind)
    for sname, s in plan.shapes.items():
        d = routing_ops.Data(**s, device=plan.tensor_device, dtype=plan.dtype)
        small = dict(s, T=min(s["T"], plan.precision_tokens))
        dp = d if small["T"] == s["T"] else routing_ops.Data(**small, device=plan.tensor_device, dtype=plan.dtype,
                                                               seed=1)
        log(f"[ops {sname}] T={d.T} H={d.H} E={d.E} k={d.k} cf={d.cf}: capacity={d.cap} padded rows={d.P}"
            + ("" if dp is d else f" (precision at T={dp.T})"))
        for op in routing_ops.OPS:
            args = routing_ops.arguments(op, dp)
            sim, gold = precision.cpu_references(getattr(routing_ops.reference, op), args, dp.dtype)
            nb = routing_ops.min_bytes(op, d)
            for impl in impls:
                fn = _impl_fn(op, impl)
                row = dict(section="ops", case=sname, item=op, impl=impl, family=routing_ops.op_family(op))
                try:
                    out = routing_ops.poisoned(lambda: fn(*args), gold.numel(), dp.dtype, plan.tensor_device)
                    v = precision.judge("out", out, sim, gold, dp.dtype)
                    row.update(precision=[v.as_dict()], precision_ok=v.ok)
                    graph = impl != "torch" and op not in routing_ops.GRAPH_UNSAFE
                    row.update(_time(lambda: routing_ops.call(op, fn, d), plan, graph, log))
                    _rates(row, nb, ceiling)
                except Exception as e:  # noqa: BLE001 - an error row; the run goes on
                    row.update(error=f"{type(e).__name__}: {str(e)[:300]}", precision_ok=False)
                rows.append(row)
        del d, dp
        timing.empty_cache(plan.tensor_device)
    return rows


PREP_VARIANTS = {"binned": (0, "BINNED"), "dropless": (0, "DROPLESS"), "padded": (routing_ops.PAD_BLOCK, "PADDED")}


def prep_section(plan: Plan, log) -> list[dict]:
    """The routing preparation of each layout: ours against the ``torch`` backend (and MegaBlocks'
    sequence on CUDA), their outputs required equal (integers: no precision verdict, equality)."""
    from megablocks_ascend.kernels import routing  # noqa: PLC0415
    rows = []
    others = {"torch": "torch", **({"upstream": "cuda"} if plan.kind == "cuda" else {})}
    for sname, s in plan.shapes.items():
        gen = torch.Generator(device=plan.tensor_device).manual_seed(0)
        logits = torch.randn(s["T"], s["E"], device=plan.tensor_device, generator=gen)
        ids = torch.topk(torch.softmax(logits, dim=-1), s["k"]).indices
        capacity = int(s["cf"] * s["T"] * s["k"] / s["E"])
        for variant in PREP_VARIANTS:
            block, layout = PREP_VARIANTS[variant]
            route = getattr(routing, layout)
            cap = capacity if variant == "binned" else 0

            def run(backend):
                with backends.use_backend(backend):
                    return backends.prepare_routing(ids, s["E"], block, route, cap)
            want = run("torch")
            for impl, backend in (("ours", "ascend"), *others.items()):
                row = dict(section="prep", case=sname, item=f"prepare_routing[{variant}]", impl=impl)
                try:
                    got = run(backend)
                    row["check_ok"] = all((a is None and b is None) or (a is not None and b is not None
                                                                         and torch.equal(a, b))
                                          for a, b in zip(got, want))
                    row.update(_time(lambda backend=backend: run(backend), plan, True, log))
                except Exception as e:  # noqa: BLE001
                    row.update(error=f"{type(e).__name__}: {str(e)[:300]}", check_ok=False)
                rows.append(row)
        timing.empty_cache(plan.tensor_device)
    return rows


def fused_section(plan: Plan, log, tnpu=None) -> tuple[list[dict], dict]:
    """torch_npu's fused ops against ours (an NPU only): ``(rows, info)``, ``info`` holding the
    mapping of each item and where the fused ops do not apply. ``tnpu``: torch_npu (default: import
    it), or a stand-in."""
    info = {"not_applicable": fused_npu.NOT_APPLICABLE, "mapping": {}}
    if tnpu is None:
        tnpu, missing = fused_npu.torch_npu_ops()
        if tnpu is None or missing:
            info["unavailable"] = "; ".join(missing)
            log(f"[fused] torch_npu's fused MoE ops unavailable: {info['unavailable']}")
            return [], info
    rows = []
    for sname, s in plan.shapes.items():
        small = dict(s, T=min(s["T"], plan.precision_tokens))
        dp = routing_ops.Data(**small, device=plan.tensor_device, dtype=plan.dtype, seed=1)
        d = routing_ops.Data(**s, device=plan.tensor_device, dtype=plan.dtype)
        checked = {c.item: c for c in fused_npu.comparisons(dp, tnpu)}
        for c in fused_npu.comparisons(d, tnpu):
            info["mapping"][c.item] = c.mapping
            result = None
            try:
                result = fused_npu.compare(checked[c.item], d.dtype)
            except Exception as e:  # noqa: BLE001
                result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            for impl, fn in (("ours", c.ours), (c.alternative.split()[0], c.theirs)):
                row = dict(section="fused", case=sname, item=c.item, impl=impl, alternative=c.alternative,
                           compare=result, check_ok=bool(result.get("ok")), notes=dict(checked[c.item].notes))
                try:
                    row.update(_time(fn, plan, "backward" not in c.item, log))
                except Exception as e:  # noqa: BLE001
                    row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
                rows.append(row)
        del d, dp
        timing.empty_cache(plan.tensor_device)
    return rows, info


def sparse_section(plan: Plan, log) -> list[dict]:
    """The sparse dMoE's products and step, ours against the grouped-GEMM form, at every step config
    whose ffn is whole 128-wide blocks (:mod:`~megablocks_ascend.bench.sparse_forms`)."""
    names = list(sparse_forms.configs(plan.configs))
    rows = []
    for n in names:
        rows += sparse_forms.product_rows(n, plan.configs[n], plan.tokens, plan.tensor_device,
                                          lambda fn: _time(fn, plan, True, log), log)
    settings = steps.Settings(configs=plan.configs, tokens=plan.tokens, steps=plan.steps, warmup=plan.warmup,
                              profile_steps=plan.profile_steps, enqueue=False)
    return rows + sparse_forms.step_rows(
        names, plan.tensor_device, "cuda" if plan.kind == "cuda" else "torch",
        timed=timing.timer(plan.timing_device).timed, graph=timing.graph_api(plan.timing_device)[0] is not None,
        settings=settings, log=log)


def step_backends(kind: str) -> tuple[str, ...]:
    """The backends whose steps are judged on a device kind: ours and each alternative's."""
    return ("ascend",) + tuple(b for impl, b in (("torch", "torch"), ("upstream", "cuda")) if impl in alternatives(kind))


def step_variants(plan: Plan, graph: bool) -> list:
    """The step rows timed (:data:`STEP_LAYERS`): ours and each alternative, eager and (``graph``) captured, except the
    ``torch`` backend where upstream's kernels are there (CUDA): its whole step is what the precision
    verdicts compare with, and timing it at DeepSeek-V3's size would take a fifth of the run; it is
    not captured anywhere (its boolean indexing syncs)."""
    names = step_backends(plan.kind)
    timed = tuple(b for b in names if not (b == "torch" and "cuda" in names))
    modes = ("eager", "graph") if graph else ("eager",)
    return [steps.Variant(c, layer, b, mode, "bf16", impl, "mlp", "empty")
            for c in plan.configs for layer, impl in STEP_LAYERS for b in timed for mode in modes
            if not (mode == "graph" and b == "torch")
            and not (impl == "sparse" and (b == "cuda" or plan.configs[c]["ffn"] % 128))]


# The layers of the steps section: the grouped dMoE, the sparse one (MegaBlocks' default mlp_impl;
# ours only: upstream refuses it with Triton >= 3.2; its ffn must be a multiple of its 128-wide
# blocks) and MoE.
STEP_LAYERS = (("dMoE", "grouped"), ("dMoE", "sparse"), ("MoE", "grouped"))


def steps_section(plan: Plan, ceiling: float | None, log) -> list[dict]:
    """A ``dMoE`` and a ``MoE`` training step per config, timed: ours against upstream's kernels on
    CUDA, against the ``torch`` backend elsewhere, eager and, where the device has graph capture,
    captured; each backend's step (the ``torch`` backend's too) judged by
    :func:`~megablocks_ascend.bench.precision.precision_verdicts`."""
    kind = plan.kind
    names = step_backends(kind)
    graph_api, _ = timing.graph_api(plan.timing_device)
    variants = step_variants(plan, graph=graph_api is not None)
    settings = steps.Settings(configs=plan.configs, tokens=plan.tokens, steps=plan.steps, warmup=plan.warmup,
                              profile_steps=plan.profile_steps, ceiling_gbps=ceiling, enqueue=False)
    reference = "cuda" if kind == "cuda" else "torch"
    t0 = time.perf_counter()
    if not timing.timer(plan.timing_device).timed:
        raw = []
        for v in variants:
            raw.append(dict(dataclasses.asdict(v), ok=True, not_timed=timing.timer(plan.timing_device).how))
    else:
        log(f"[steps] {len(variants)} step rows over {len(plan.configs)} configs ({', '.join(plan.configs)}), "
            f"{plan.tokens} tokens, {plan.steps} timed steps each")
        raw = steps.run(variants, plan.tensor_device, settings, reference, log)
        log(f"[steps] timed in {time.perf_counter() - t0:.1f} s")
    verdicts, judged_on = {}, {}
    t1 = time.perf_counter()
    tokens = min(plan.tokens, plan.step_tokens_precision)
    for c in plan.configs if plan.precision_configs is None else [c for c in plan.configs
                                                                  if c in plan.precision_configs]:
        for layer, impl in STEP_LAYERS:
            if impl == "sparse" and plan.configs[c]["ffn"] % 128:
                continue
            # (the sparse MLP's reduced layer keeps its ffn a whole number of 128-wide blocks)
            reduce = dict(plan.precision_reduce, ffn_multiple=128) if impl == "sparse" else plan.precision_reduce
            on = precision.precision_config(plan.configs[c], full=plan.precision_full, **reduce)
            judged_on[(c, impl)] = dict(on, T=tokens, reduced=on != plan.configs[c])
            tv = time.perf_counter()
            try:
                verdicts[(c, layer, impl)] = precision.precision_verdicts(
                    c, layer, plan.tensor_device, tokens, plan.configs,
                    tuple(b for b in names if impl == "grouped" or b != "cuda"), plan.dtype, impl,
                    full=plan.precision_full, reduce=reduce)
            except Exception as e:  # noqa: BLE001
                verdicts[(c, layer, impl)] = e
            what = ("a reduced layer of its family" if judged_on[(c, impl)]["reduced"] else "its own layer")
            log(f"[steps] precision {c} {layer}{'-sparse' if impl == 'sparse' else ''}: {what}, H={on['H']} "
                f"ffn={on['ffn']} E={on['E']} top_k={on['k']}, {tokens} tokens ({time.perf_counter() - tv:.1f} s)")
    if verdicts:
        log(f"[steps] precision verdicts in {time.perf_counter() - t1:.1f} s")
    rows = []
    for r in raw:
        if r.get("reference_only") and r["backend"] not in names:
            continue
        layer = r["layer"] + ("-sparse" if r["mlp_impl"] == "sparse" else "")
        row = dict(section="steps", case=r["config"], item=f"{layer} {r['mode']}",
                   impl=IMPL_OF_BACKEND[r["backend"]], ms=r.get("wall_ms"), graph_ms=None,
                   host_ms=r.get("host_ms"), kernels=r.get("kernels"), launches=r.get("launches"),
                   peak_mib=r.get("peak_mib"), mem_vs_upstream=r.get("mem_vs_up"), syncs=r.get("syncs"),
                   vs_grouped=r.get("vs_grouped"),
                   check_ok=r.get("ok", False) and "error" not in r, err_vs_reference=r.get("err"))
        if "error" in r:
            row["error"] = r["error"]
        if "not_timed" in r:
            row["why"] = f"not timed: {r['not_timed']}"
        v = verdicts.get((r["config"], r["layer"], r["mlp_impl"]))
        if isinstance(v, Exception):
            row.update(precision_ok=False, precision_error=f"{type(v).__name__}: {str(v)[:300]}")
        elif v is not None and r["mode"] == "eager":
            row["precision"] = [x.as_dict() for x in v[r["backend"]]]
            row["precision_ok"] = precision.all_ok(v[r["backend"]])
            row["precision_layer"] = judged_on[(r["config"], r["mlp_impl"])]
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------
# Tables


def table(rows: list[dict]) -> str:
    f = report.fmt
    head = (f"{'section':7s} {'case':8s} {'item':28s} {'impl':24s} {'ms':>9s} {'GB/s':>6s} {'ceil':>6s} "
            f"{'graph ms':>9s} {'ceil':>6s} {'x':>7s} {'peak MiB':>9s} {'mem':>6s}  check precision")
    out = [head]
    for r in rows:
        lead = f"{r['section']:7s} {r['case'][:8]:8s} {r['item'][:28]:28s} {r['impl'][:24]:24s} "
        if "error" in r:
            out.append(lead + "ERROR " + r["error"].splitlines()[0][:120])
            continue
        check = r.get("check_ok")
        verdict = r.get("precision_ok")
        out.append(lead + f(r.get("ms"), ".4f", 9) + " " + f(r.get("GBps"), ".0f", 6) + " "
                   + f(r.get("frac_ceiling"), ".1%", 6) + " " + f(r.get("graph_ms"), ".4f", 9) + " "
                   + f(r.get("graph_frac_ceiling"), ".1%", 6) + " " + f(r.get("x"), ".2f", 6) + "x "
                   + f(r.get("peak_mib"), ".1f", 9) + " " + f(r.get("mem_vs_upstream"), ".3f", 6) + "  "
                   + ("-    " if check is None else "ok   " if check else "FAIL ")
                   + ("-" if verdict is None else "ok" if verdict else "FAIL")
                   + (f"  ({r['why']})" if r.get("why") else ""))
    return "\n".join(out)


def precision_rows(rows: list[dict]) -> list:
    """``[(label, Verdict)]`` of every verdict in the rows (the fused rows' ours and theirs)."""
    out = []
    for r in rows:
        label = f"{r['section']} {r['case']} {r['item']} {r['impl']}"
        for v in r.get("precision") or ():
            out.append((label, precision.Verdict(**v)))
        if r["section"] == "fused" and r["impl"] == "ours":
            for name, res in (r.get("compare") or {}).get("outputs", {}).items():
                for who in ("ours", "theirs"):
                    if who in res:
                        out.append((f"fused {r['case']} {r['item']} {who if who == 'ours' else r['alternative']}",
                                    precision.Verdict(**res[who])))
    return out


def summary(rows: list[dict]) -> dict:
    failed_checks = [f"{r['section']} {r['case']} {r['item']} {r['impl']}" for r in rows
                     if r.get("check_ok") is False or "error" in r]
    failed_precision = [f"{r['section']} {r['case']} {r['item']} {r['impl']}" for r in rows
                        if r.get("precision_ok") is False and r["impl"] == "ours"]
    timed = sum(r.get("ms") is not None for r in rows)
    return dict(rows=len(rows), timed=timed, failed_checks=failed_checks, failed_precision_ours=failed_precision,
                ok=not failed_checks and not failed_precision)


# ------------------------------------------------------------------------------------------
# The command


def run(plan: Plan, out_dir: Path, name: str, plot_png: bool = True, log=None, lines=None, tnpu=None) -> dict:
    if log is None:
        log, lines = report.logger()
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    t = timing.timer(plan.timing_device)
    _, graph_what = timing.graph_api(plan.timing_device)
    env = report.environment(plan.timing_device) if plan.timing_device == plan.tensor_device else \
        dict(report.environment(plan.tensor_device), device=f"{plan.timing_device} over {plan.tensor_device} tensors")
    results = {
        "environment": env,
        "device": {"type": plan.kind, "timer": t.kind, "timing": t.how, "graph_capture": graph_what,
                   "alternatives": list(alternatives(plan.kind)) + (["torch_npu fused ops"] if plan.kind == "npu" else [])},
        "precision": {"thresholds": precision.THRESHOLDS,
                      "floors": {str(k).replace("torch.", ""): v for k, v in precision.FLOORS.items()},
                      "golden": "CPU, float32 (float64 for float32 results)", "simulation": "CPU, device dtype",
                      "relative_to": "|golden| + floor", "dtype": str(plan.dtype).replace("torch.", ""), "tokens_ops": plan.precision_tokens,
                      "tokens_steps": plan.step_tokens_precision},
        "shapes": plan.shapes, "configs": {k: dict(v, T=plan.tokens) for k, v in plan.configs.items()},
    }
    log(f"environment: {json.dumps(env)}")
    log(f"device: {plan.timing_device}; timing: {t.how}; graph capture: {graph_what}; routing ops and precision "
        f"verdicts in {str(plan.dtype).replace('torch.', '')}, timed steps in bfloat16")
    ceiling = None
    if t.timed:
        ceil = routing_table.copy_ceiling(plan.timing_device, quick=plan.quick)
        results["copy_ceiling"] = ceil
        ceiling = ceil["GBps"]
        log(f"copy ceiling: {ceiling:.0f} GB/s ({ceil['bytes'] / 1e9:.2f} GB read+written in {ceil['ms']:.3f} ms)")
    else:
        results["copy_ceiling"] = {"why": f"not measured: {t.how}"}
        log(f"copy ceiling: not measured ({t.how})")
    rows = []
    save = lambda: report.write_json(out_dir / f"{name}.json", results)  # noqa: E731
    results["section_seconds"] = took = {}

    def section(label, what):
        log(f"[{label}] {what} ... (at {time.perf_counter() - t0:.0f} s)")
        return time.perf_counter()

    def done(label, since):
        took[label] = time.perf_counter() - since
        log(f"[{label}] done in {took[label]:.1f} s (at {time.perf_counter() - t0:.0f} s)")

    if "ops" in plan.sections:
        ts = section("ops", f"{len(routing_ops.OPS)} routing ops x {len(plan.shapes)} shapes ({', '.join(plan.shapes)})")
        rows += ops_section(plan, ceiling, log)
        results["rows"] = rows
        done("ops", ts)
        save()
    if "prep" in plan.sections:
        ts = section("prep", f"the routing preparation x {len(plan.shapes)} shapes")
        rows += prep_section(plan, log)
        done("prep", ts)
        save()
    if "fused" in plan.sections and plan.kind == "npu":
        ts = section("fused", "torch_npu's fused MoE ops")
        fused_rows, results["fused"] = fused_section(plan, log, tnpu)
        rows += fused_rows
        done("fused", ts)
        save()
    else:
        results["fused"] = {"not_run": f"torch_npu's fused MoE ops are compared on an NPU only (this is {plan.kind})",
                            "not_applicable": fused_npu.NOT_APPLICABLE}
    if "sparse" in plan.sections:
        names = ", ".join(sparse_forms.configs(plan.configs))
        ts = section("sparse", f"the sparse dMoE's products and step, ours and as grouped GEMMs x configs ({names})")
        rows += sparse_section(plan, log)
        done("sparse", ts)
        save()
    if "steps" in plan.sections:
        ts = section("steps", f"MoE and dMoE training steps x {len(plan.configs)} configs ({', '.join(plan.configs)})")
        rows += steps_section(plan, ceiling, log)
        done("steps", ts)
    _ratios(rows)
    results["rows"] = rows
    results["summary"] = summary(rows)
    results["seconds"] = time.perf_counter() - t0
    save()
    log("")
    log("ms = host launch + device (median); graph ms = device time from graph replay; ceil = (minimal bytes / "
        "time) / copy ceiling; x = the alternative's time / ours (> 1: ours faster; device time where both have it)")
    log(table(rows))
    log("")
    log("precision: device error / max(CPU simulation error, floor) against the CPU golden, per tensor")
    log(precision.table(precision_rows(rows)))
    if isinstance(results.get("fused"), dict) and results["fused"].get("mapping"):
        log("")
        log("torch_npu fused ops, argument mapping:")
        for item, mapping in results["fused"]["mapping"].items():
            log(f"  {item}: {mapping}")
    log("")
    log("not applicable (torch_npu fused ops):")
    for na in fused_npu.NOT_APPLICABLE:
        log(f"  {na['ops']} vs {na['alternatives']}: {na['why']}")
    s = results["summary"]
    log("")
    log(f"bench: {s['rows']} rows, {s['timed']} timed, checks {'ok' if not s['failed_checks'] else 'FAILED: '}"
        f"{', '.join(s['failed_checks'][:10])}; precision of ours "
        f"{'ok' if not s['failed_precision_ours'] else 'FAILED: '}{', '.join(s['failed_precision_ours'][:10])}; "
        f"{results['seconds']:.1f} s")
    if plot_png:
        try:
            plot.ours_vs_alternatives(rows, out_dir / f"{name}.png", title=str(plan.timing_device))
            log(f"wrote {out_dir / f'{name}.png'}")
        except Exception as e:  # noqa: BLE001 - the numbers are in the JSON either way
            log(f"(no plot: {type(e).__name__}: {e})")
    save()
    if lines is not None:
        (out_dir / f"{name}.log").write_text("\n".join(lines) + "\n")
    log(f"wrote {out_dir / f'{name}.json'}")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="default: the NPU, else CUDA, else CPU")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="of the routing ops and the precision verdicts (default bfloat16; float16 on the CPU, "
                             "where the Triton interpreter truncates float32 to bfloat16 instead of rounding)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the CPU smoke test)")
    parser.add_argument("--shapes", default=None, help="comma-separated routing shapes (default: all)")
    parser.add_argument("--configs", default=None, help="comma-separated step configs (default: all)")
    parser.add_argument("--sections", default=None, help=f"comma-separated subset of {','.join(SECTIONS)} (default: "
                        "all but sparse; sparse too on an NPU)")
    parser.add_argument("--repeats", type=int, default=None, help="do_bench medians per time (default 3; 1 quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per step row (default 10; 3 quick)")
    parser.add_argument("--precision-tokens", type=int, default=None,
                        help="tokens of the routing-op precision problems (default 2048; 64 quick)")
    parser.add_argument("--precision-configs", default=None,
                        help="comma-separated step configs whose step gets the precision verdict (default: all; "
                             "each costs a float32 and a low-precision step of the layer on the CPU)")
    parser.add_argument("--precision-full", action="store_true",
                        help="judge each step config's own layer (default: large configs are judged on a layer of "
                             "the same experts and top_k with hidden and ffn cut to "
                             f"{precision.PRECISION_HIDDEN} and {precision.PRECISION_FFN}; a DeepSeek-V3 layer's CPU "
                             "golden alone takes about 30 GB)")
    parser.add_argument("--out", default=report.default_out(), help="directory for NAME.json, NAME.log, NAME.png "
                        "(default: $OUT if set, else ./bench-results, which git ignores)")
    parser.add_argument("--name", default="bench")
    parser.add_argument("--no-plot", action="store_true")


def main(args: argparse.Namespace) -> int:
    from megablocks_ascend import devices  # noqa: PLC0415
    try:
        device = devices.requested(args.device) if args.device else default_device()
    except devices.DeviceUnavailable as e:
        raise SystemExit(f"bench: {e}") from None
    if device.type == "cpu":
        routing_ops.narrow_upstream_autotuning()
    split = (lambda v: v.split(",") if v else None)  # noqa: E731
    sections = split(args.sections)
    bad = [s for s in sections or () if s not in SECTIONS]
    if bad:
        raise SystemExit(f"bench: unknown --sections {bad}; known: {', '.join(SECTIONS)}")
    plan = plan_for(device, args.quick, split(args.shapes), split(args.configs), sections)
    if args.repeats:
        plan.repeats = args.repeats
    if args.steps:
        plan.steps = args.steps
    if args.dtype:
        plan.dtype = DTYPES[args.dtype]
    if args.precision_configs is not None:
        plan.precision_configs = tuple(split(args.precision_configs) or ())
    if args.precision_tokens:
        plan.precision_tokens = args.precision_tokens
    plan.precision_full = bool(getattr(args, "precision_full", False))
    if device.type == "cpu" and not args.quick:
        print("bench: on the CPU the Triton interpreter runs every kernel; without --quick this takes long")
    results = run(plan, Path(args.out), args.name, plot_png=not args.no_plot)
    return 0 if results["summary"]["ok"] else 1
