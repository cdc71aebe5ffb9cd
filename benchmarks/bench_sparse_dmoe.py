"""The sparse dMoE (MegaBlocks' ``mlp_impl="sparse"``) on our block-sparse kernels, against the
grouped dMoE on the same weights and against stk's own kernels: correctness and step time.

At each shape one bf16 dMoE is built with ``mlp_impl="sparse"``, and a memory-optimized sparse
and a grouped copy get the same weights (the three MLPs have the same parameters, same layout).
Variants (``layout/backend``; the backend serves the routing ops and stk's matmuls alike):

``grouped/cuda``          stock MegaBlocks' path: upstream routing kernels, grouped GEMM
                          (the ``grouped_gemm`` stand-in: ``torch._grouped_mm`` for bf16 on CUDA)
``grouped/ascend``        our routing kernels, grouped GEMM: the reference for the checks
``sparse/ascend``         our routing and block-sparse kernels
``sparse-memopt/ascend``  the same with ``memory_optimized_mlp=True``
``sparse/cuda``           stk's own kernels; the dispatcher refuses them (``BackendUnavailable``)
                          wherever they overflow, which is both large shapes; timed at ``medium``

Each variant runs one forward + backward first: output, input gradient and the ``w1``/``w2``
gradients are compared with ``grouped/ascend`` (relative Frobenius error, bf16: must be < 2e-2),
and the trace must show that the requested backend served every call. Then the step is timed
(``triton.testing.do_bench``, median of three medians, gradients reset each time).

``--stk-unguarded`` also runs stk's own kernels *with the refusal bypassed* at the two large
shapes, forward only, each in a child process (an illegal memory access ends the CUDA context):
the output's largest difference from the grouped dMoE, over the grouped output's largest value,
or the crash. This is what MegaBlocks' refusal of the sparse MLP is about.

Usage (H200, ~3 min)::

    PYTHONPATH=/tmp/site:$PWD python benchmarks/bench_sparse_dmoe.py --stk-unguarded --out OUT
    python benchmarks/bench_sparse_dmoe.py --quick --out OUT     # CPU smoke test (interpreter)

Target (issue 10): ``sparse/ascend`` at least 0.9x as fast as the grouped dMoE's step at the
mixtral-like shape, and correct at both large shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks, stk and triton)
from megablocks_ascend.bench.report import default_out  # noqa: E402
import torch
import triton
from megablocks.layers.arguments import Arguments
from megablocks.layers.dmoe import dMoE
from megablocks.layers.moe import clear_load_balancing_loss

from megablocks_ascend import BackendUnavailable, backends


SHAPES = {
    "mixtral": dict(T=8192, H=4096, ffn=14336, E=8, k=2),
    "fine": dict(T=16384, H=2048, ffn=1408, E=64, k=6),
    # every sparse dimension <= 32768 (stk's own kernels are correct): M <= 4096*2 + 8*128, N = 16384
    "medium": dict(T=4096, H=2048, ffn=2048, E=8, k=2),
}
QUICK_SHAPES = {"quick": dict(T=16, H=32, ffn=128, E=4, k=2)}
LARGE = ("mixtral", "fine")
VARIANTS = (("grouped", "cuda"), ("grouped", "ascend"), ("sparse", "ascend"), ("sparse-memopt", "ascend"),
            ("sparse", "cuda"))
QUICK_VARIANTS = (("grouped", "ascend"), ("sparse", "ascend"), ("sparse-memopt", "ascend"), ("sparse", "torch"))
REFERENCE = ("grouped", "ascend")
TOLERANCE = 2e-2


def build(shape, device):
    """The sparse dMoE (bf16) and its memory-optimized and grouped copies with the same weights."""
    torch.manual_seed(0)
    with megablocks_ascend.use_backend("ascend"):  # Arguments(mlp_impl="sparse") while ours serve stk
        args = Arguments(hidden_size=shape["H"], ffn_hidden_size=shape["ffn"], moe_num_experts=shape["E"],
                         moe_top_k=shape["k"], mlp_impl="sparse", bf16=True, fp16=False, return_bias=False,
                         moe_loss_weight=0.0, device=device)
        layers = {"sparse": dMoE(args)}
        for name, change in (("sparse-memopt", dict(memory_optimized_mlp=True)), ("grouped", dict(mlp_impl="grouped"))):
            layers[name] = dMoE(dataclasses.replace(args, **change))
            layers[name].load_state_dict(layers["sparse"].state_dict())
    return layers


def step_fn(layer, x, g):
    def step():
        y = layer(x)
        y.backward(g)
        clear_load_balancing_loss()
        return y
    return step


def bench(fn, device, grad_to_none, repeats=3) -> float:
    if device.type == "cuda":
        runs = sorted(float(triton.testing.do_bench(fn, warmup=10, rep=100, grad_to_none=grad_to_none,
                                                    return_mode="median")) for _ in range(repeats))
        return runs[len(runs) // 2]
    t0 = time.perf_counter()  # CPU (--quick): a smoke test, not a measurement
    fn()
    return (time.perf_counter() - t0) * 1e3


def rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_shape(name, shape, device, variants, log):
    layers = build(shape, device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(shape["T"], 1, shape["H"], device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(shape["T"], 1, shape["H"], device=device, generator=gen).to(torch.bfloat16)
    results, checked = [], {}
    for layout, backend in sorted(variants, key=lambda v: v != REFERENCE):  # the reference first
        layer = layers[layout]
        params = [x] + list(layer.parameters())
        row = dict(shape=name, **shape, variant=f"{layout}/{backend}")
        step = step_fn(layer, x, g)
        try:
            with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
                for p in params:
                    p.grad = None
                y = step()
            got = dict(out=y.detach().clone(), dx=x.grad.clone(), dw1=layer.experts.mlp.w1.grad.clone(),
                       dw2=layer.experts.mlp.w2.grad.clone())
            row["served"] = sorted({f"{c.op}:{c.backend}" for c in calls})
            row["served_ok"] = {c.backend for c in calls} == {backend}
            if (layout, backend) == REFERENCE:
                checked = got
            row["errors"] = {k: rel_err(v, checked[k]) for k, v in got.items()}
            row["correct"] = row["served_ok"] and all(e < TOLERANCE for e in row["errors"].values())
            with megablocks_ascend.use_backend(backend):
                row["ms"] = bench(step, device, params)
        except BackendUnavailable as e:
            row["refused"] = str(e)
            clear_load_balancing_loss()
        results.append(row)
        log(f"  {name:8s} {row['variant']:22s} " + (
            f"{row['ms']:9.3f} ms  errors " + " ".join(f"{k} {v:.1e}" for k, v in row["errors"].items())
            + ("" if row["correct"] else "  WRONG") if "ms" in row else f"refused: {row['refused'][:110]}"))
        if device.type == "cuda":
            torch.cuda.synchronize()
    ref_ms = next((r["ms"] for r in results if r["variant"] == "/".join(REFERENCE) and "ms" in r), None)
    grouped_best = min((r["ms"] for r in results if r["variant"].startswith("grouped/") and "ms" in r), default=None)
    for r in results:
        if "ms" in r and ref_ms:
            r["speed_vs_grouped_ascend"] = ref_ms / r["ms"]
            r["speed_vs_grouped_best"] = grouped_best / r["ms"]
    del layers, x, g
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


# --- stk's own kernels without the refusal (child processes) ----------------------------------


def unguarded_child(name, out_path):
    """Forward of the sparse dMoE with stk's own kernels and the refusal bypassed, vs grouped."""
    device = torch.device("cuda")
    layers = build(SHAPES[name], device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(SHAPES[name]["T"], 1, SHAPES[name]["H"], device=device, generator=gen).to(torch.bfloat16)
    with torch.no_grad(), megablocks_ascend.use_backend("ascend"):
        want = layers["grouped"](x).float()
    clear_load_balancing_loss()
    backends.stk_kernels_refusal = lambda *a, **k: None  # the experiment: no guard
    with torch.no_grad(), megablocks_ascend.use_backend("cuda"), megablocks_ascend.trace() as calls:
        got = layers["sparse"](x).float()
    torch.cuda.synchronize()
    clear_load_balancing_loss()
    Path(out_path).write_text(json.dumps(dict(
        shape=name, served=sorted({f"{c.op}:{c.backend}" for c in calls}),
        max_abs_diff_over_max_abs_ref=float((got - want).abs().max() / want.abs().max()),
        rel_err=rel_err(got, want), finite=bool(torch.isfinite(got).all()))))


def unguarded(out_dir, log):
    rows = []
    for name in LARGE:
        path = Path(out_dir) / f"stk_unguarded_{name}.json"
        path.unlink(missing_ok=True)
        p = subprocess.run([sys.executable, __file__, "--unguarded-child", name, "--unguarded-out", str(path)],
                           capture_output=True, text=True, timeout=300)
        if p.returncode == 0 and path.exists():
            row = json.loads(path.read_text())
        else:
            tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            row = dict(shape=name, crashed=True, returncode=p.returncode, error=tail[:300])
        rows.append(row)
        log(f"  stk's own kernels, no refusal, {name}: " + (
            f"crashed ({row['error']})" if row.get("crashed") else
            f"max|diff| / max|grouped| = {row['max_abs_diff_over_max_abs_ref']:.3g}, rel err {row['rel_err']:.3g}"))
    return rows


# ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape on CPU (interpreter smoke test)")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--stk-unguarded", action="store_true", help="stk's own kernels without the refusal (GPU)")
    ap.add_argument("--out", default=default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default="bench_sparse_dmoe")
    ap.add_argument("--unguarded-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--unguarded-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.unguarded_child:
        unguarded_child(a.unguarded_child, a.unguarded_out)
        return 0

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not a.quick:
        ap.error("without a GPU only --quick runs (Triton interpreter)")
    shapes = QUICK_SHAPES if a.quick else SHAPES
    if a.shapes:
        shapes = {k: v for k, v in shapes.items() if k in a.shapes.split(",")}
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    env = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
               command=" ".join([Path(sys.executable).name] + sys.argv))
    log(f"environment: {json.dumps(env)}")
    report = dict(environment=env, shapes=shapes, tolerance=TOLERANCE, results=[], stk_unguarded=[])
    for name, shape in shapes.items():
        report["results"] += run_shape(name, shape, device, QUICK_VARIANTS if a.quick else VARIANTS, log)
        (out_dir / f"{a.name}.json").write_text(json.dumps(report, indent=1))
    if a.stk_unguarded and device.type == "cuda":
        report["stk_unguarded"] = unguarded(out_dir, log)

    res = report["results"]
    ours = [r for r in res if r["variant"].startswith("sparse") and r["variant"].endswith("/ascend")]
    mixtral = [r for r in ours if r["shape"] == "mixtral" and r["variant"] == "sparse/ascend"]
    report["targets"] = dict(
        all_correct=all(r.get("correct") for r in res if "ms" in r),
        ours_never_refused=all("ms" in r for r in ours),
        stk_refused_at_large_shapes=all("refused" in r for r in res
                                        if r["variant"] == "sparse/cuda" and r["shape"] in LARGE),
        mixtral_sparse_0_9x_grouped=(mixtral[0].get("speed_vs_grouped_best", 0) >= 0.9) if mixtral else None)
    (out_dir / f"{a.name}.json").write_text(json.dumps(report, indent=1))

    log("")
    log(f"{'shape':8s} {'variant':22s} {'ms':>9s} {'vs grouped':>10s} {'out err':>8s} {'dx err':>8s} "
        f"{'dw1 err':>8s} {'dw2 err':>8s}  ok")
    for r in res:
        if "ms" not in r:
            log(f"{r['shape']:8s} {r['variant']:22s} {'refused (BackendUnavailable)':>37s}")
            continue
        e = r["errors"]
        log(f"{r['shape']:8s} {r['variant']:22s} {r['ms']:9.3f} {r.get('speed_vs_grouped_best', float('nan')):9.2f}x "
            f"{e['out']:8.1e} {e['dx']:8.1e} {e['dw1']:8.1e} {e['dw2']:8.1e}  {'yes' if r['correct'] else 'NO'}")
    log("targets: " + json.dumps(report["targets"]))
    (out_dir / f"{a.name}.log").write_text("\n".join(lines) + "\n")
    ok = report["targets"]["all_correct"] and report["targets"]["ours_never_refused"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
