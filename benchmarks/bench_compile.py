"""torch.compile of MegaBlocks' unchanged layers: a compiled step vs an eager step, same run.

For each layer setup (``MoE``; ``dMoE`` with the grouped MLP and GLU) and routing backend
(``ascend``: our kernels; ``cuda``: upstream's), one bf16 training step (forward + backward)
eager, then the same layer under ``torch.compile(fullgraph=True)`` (inductor by default):

* compile: seconds of the first compiled step (tracing, inductor, autotuning of its own kernels);
* check: the compiled step's output and input gradient against the eager step's (relative error,
  bf16: ``ok`` below 2e-2), and which backend served every routing call;
* eager ms / compiled ms: ``triton.testing.do_bench`` medians (median of three runs), as in
  ``bench_routing.py --layers``.

A setup that does not compile is a row with its error, not a crash (the run goes on). Without the
resolve-dtensor patch (patches/resolve-dtensor.md) nothing compiles on torch 2.11.

Usage::

    python benchmarks/bench_compile.py            # the table and JSON (a GPU)
    python benchmarks/bench_compile.py --quick    # tiny shapes on CPU (interpreter, aot_eager): a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_routing as br  # noqa: E402  (imports megablocks_ascend first)
import torch  # noqa: E402

from megablocks_ascend import backends  # noqa: E402

# Token count, hidden size, experts, top_k as bench_routing's "mixtral" shape; two FFN sizes: one
# where the step is GEMM-bound and one where host time matters (BENCHMARKS.md, layer rows).
SHAPE = dict(T=8192, H=4096, E=8, k=2, cf=1.0)
QUICK_SHAPE = dict(T=16, H=32, E=4, k=2, cf=1.0)
SETUPS = {  # name -> (layer class, Arguments overrides)
    "MoE": ("MoE", {}),
    "dMoE-mlp": ("dMoE", dict(mlp_type="mlp")),
    "dMoE-glu": ("dMoE", dict(mlp_type="glu")),
}
RUNS = [  # (setup, ffn_hidden_size, backend)
    *((s, 1792, b) for s in SETUPS for b in ("ascend", "cuda")),
    *((s, 14336, "ascend") for s in ("MoE", "dMoE-glu")),
]
QUICK_RUNS = [(s, 64, "ascend") for s in SETUPS]
TOL = 2e-2  # bf16; inductor fuses and reorders float work, so not bit-equal


def make_layer(name, ffn, shape, device):
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE  # noqa: PLC0415

    cls, overrides = SETUPS[name]
    torch.manual_seed(0)
    args = Arguments(hidden_size=shape["H"], ffn_hidden_size=ffn, moe_num_experts=shape["E"],
                     moe_top_k=shape["k"], moe_capacity_factor=shape["cf"], mlp_impl="grouped", bf16=True,
                     fp16=False, return_bias=False, moe_loss_weight=0.0,
                     device=torch.cuda.current_device() if device.type == "cuda" else device, **overrides)
    return {"MoE": MoE, "dMoE": dMoE}[cls](args)


def run_one(name, ffn, backend, shape, device, compile_backend, log):
    from megablocks.layers import moe as moe_mod  # noqa: PLC0415

    row = dict(setup=name, ffn_hidden_size=ffn, backend=backend, compile_backend=compile_backend, **shape)
    layer = make_layer(name, ffn, shape, device)
    x = torch.randn(shape["T"], 1, shape["H"], device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(shape["T"], 1, shape["H"], device=device, dtype=torch.bfloat16)
    params = [x] + list(layer.parameters())

    def stepper(module):
        def step():
            for p in params:
                p.grad = None
            y = module(x)
            y.backward(g)
            moe_mod.clear_load_balancing_loss()
            return y
        return step

    torch._dynamo.reset()
    with backends.use_backend(backend):
        eager = stepper(layer)
        with backends.trace() as calls:
            y = eager()
        want = (y.detach().clone(), x.grad.detach().clone())
        row["eager_served"] = sorted({c.backend for c in calls})
        row["eager_ms"] = br.bench(eager, device, grad_to_none=params)
        compiled = stepper(torch.compile(layer, fullgraph=True, backend=compile_backend))
        t0 = time.perf_counter()
        try:
            with backends.trace() as calls:
                y = compiled()
            br.sync(device)
        except Exception as e:  # noqa: BLE001  (a setup that does not compile is a row of the report)
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                       traceback=traceback.format_exc()[-4000:])
            log(f"  {name:9s} ffn={ffn:5d} {backend:6s} eager {row['eager_ms']:8.3f} ms  COMPILE FAILED: {row['error']}")
            return row
        row["compile_s"] = time.perf_counter() - t0
        row["compiled_served"] = sorted({c.backend for c in calls})
        row["out_rel_err"] = br.rel_err(y.detach(), want[0])
        row["xgrad_rel_err"] = br.rel_err(x.grad.detach(), want[1])
        row["compiled_ms"] = br.bench(compiled, device, grad_to_none=params)
    row["speedup"] = row["eager_ms"] / row["compiled_ms"]
    row["ok"] = (row["out_rel_err"] < TOL and row["xgrad_rel_err"] < TOL
                 and row["eager_served"] == row["compiled_served"] == [backend])
    log(f"  {name:9s} ffn={ffn:5d} {backend:6s} eager {row['eager_ms']:8.3f} ms  compiled {row['compiled_ms']:8.3f} ms "
        f" {row['speedup']:.3f}x  compile {row['compile_s']:.1f} s  out err {row['out_rel_err']:.1e} "
        f"dx err {row['xgrad_rel_err']:.1e}  {'ok' if row['ok'] else 'WRONG'}")
    del layer, x, g, params
    br.free(device)
    return row


def table(rows):
    lines = [f"{'setup':9s} {'ffn':>5s} {'backend':7s} {'eager ms':>9s} {'compiled':>9s} {'speedup':>7s} "
             f"{'compile s':>9s} {'out err':>8s} {'dx err':>8s}  ok"]
    for r in rows:
        if "compiled_ms" not in r:
            lines.append(f"{r['setup']:9s} {r['ffn_hidden_size']:5d} {r['backend']:7s} {r['eager_ms']:9.3f} "
                         f"{'-':>9s} {'-':>7s} {'-':>9s} {'-':>8s} {'-':>8s}  FAILED: {r['error'][:80]}")
            continue
        lines.append(f"{r['setup']:9s} {r['ffn_hidden_size']:5d} {r['backend']:7s} {r['eager_ms']:9.3f} "
                     f"{r['compiled_ms']:9.3f} {r['speedup']:6.3f}x {r['compile_s']:9.1f} {r['out_rel_err']:8.1e} "
                     f"{r['xgrad_rel_err']:8.1e}  {'ok' if r['ok'] else 'WRONG'}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on CPU (interpreter, aot_eager)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--name", default="bench_compile", help="basename of the JSON and log")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor; "
                    "aot_eager with --quick)")
    args = ap.parse_args(argv)

    device = br.setup()
    if device.type == "cpu" and not args.quick:
        ap.error("without a GPU only --quick runs (Triton interpreter)")
    compile_backend = args.compile_backend or ("aot_eager" if args.quick else "inductor")
    shape, runs = (QUICK_SHAPE, QUICK_RUNS) if args.quick else (SHAPE, RUNS)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log, lines = br.logger()
    env = br.environment(device)
    log(f"environment: {json.dumps(env)}")
    report = {"environment": env, "shape": shape, "compile_backend": compile_backend, "tolerance": TOL, "rows": []}

    def save():
        (out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1))
        (out_dir / f"{args.name}.log").write_text("\n".join(lines) + "\n")

    for name, ffn, backend in runs:
        if backend == "cuda" and device.type != "cuda":
            continue
        report["rows"].append(run_one(name, ffn, backend, shape, device, compile_backend, log))
        save()
    log("")
    log(f"one bf16 step (forward + backward), T={shape['T']} H={shape['H']} E={shape['E']} k={shape['k']}; "
        f"ms = median of do_bench; compiled = torch.compile(fullgraph=True, backend={compile_backend!r}); "
        f"speedup = eager / compiled; err = relative error of compiled vs eager (ok < {TOL})")
    log(table(report["rows"]))
    save()
    failed = [r for r in report["rows"] if not r.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
