"""Layer-step harness: one MegaBlocks MoE / dMoE training step (forward + backward), per variant.

The command line of :mod:`megablocks_ascend.bench.steps`, which holds the harness and documents the
fields and columns.

    python benchmarks/bench_steps.py                       # default set (H200: a few minutes)
    python benchmarks/bench_steps.py --only config=dsv3,qw3,e256   # today's fine-grained layers
    python benchmarks/bench_steps.py --only mode=compile,compile-ro --only config=qw128
    python benchmarks/bench_steps.py --quick               # CPU smoke test (interpreter)
    python benchmarks/bench_steps.py --device npu          # an NPU: ours against the torch backend
    python benchmarks/bench_steps.py --only layer=dMoE --only mlp_type=mlp,glu --only wgrad_fill=empty,full

A variant is one value of each field (config, layer, backend, mode, precision, mlp_impl, mlp_type,
wgrad_fill); ``--only FIELD=V1,V2`` (repeatable; ``all`` takes every value) picks other values than
the defaults. ``--quick`` runs tiny configs on the CPU with ``torch`` as the reference backend:
it checks that the harness works, and measures nothing. Off CUDA (an NPU) the reference is the
``torch`` backend and the default backends are ``ascend`` and ``torch`` (upstream's kernels need CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks and triton: the stand-ins, the interpreter on a CPU)
from megablocks_ascend.bench.report import default_out  # noqa: E402
from megablocks_ascend.bench import report, routing_ops, routing_table, steps



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny configs on the CPU (smoke test)")
    ap.add_argument("--device", default=None, help=routing_ops.DEVICE_HELP)
    ap.add_argument("--only", action="append", default=[], metavar="FIELD=V1,V2",
                    help="pick values of a field (repeatable); see the module doc")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--launches-by-line", action="store_true",
                    help="keep each eager row's launches by source line in the JSON (slower count)")
    ap.add_argument("--out", default=default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default="bench_steps")
    ap.add_argument("--host-snapshot-mib", type=float, default=None,
                    help="results kept to compare later rows with go to the host above this size (default: "
                         "above a third of the device's free memory; a DeepSeek-V3 layer's gradients are 15 GB)")
    args = ap.parse_args(argv)
    device = routing_ops.setup(args.device)
    if device.type == "cpu" and not args.quick:
        ap.error("on the CPU only --quick runs (Triton interpreter)")
    if device.type != "cuda" and not any(term.startswith("backend=") for term in args.only):
        args.only.append("backend=ascend,torch")  # upstream's kernels (the cuda backend) need CUDA
    variants = steps.select(args.only, args.quick)
    settings = steps.Settings(configs=steps.QUICK_CONFIGS if args.quick else steps.CONFIGS,
                              tokens=steps.QUICK_TOKENS if args.quick else steps.TOKENS,
                              steps=args.steps or (3 if args.quick else 20),
                              warmup=min(args.warmup, 1) if args.quick else args.warmup,
                              profile_steps=args.profile_steps, launches_by_line=args.launches_by_line,
                              host_snapshot_bytes=None if args.host_snapshot_mib is None
                              else int(args.host_snapshot_mib * 2**20))
    reference_backend = "cuda" if device.type == "cuda" else "torch"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log, lines = report.logger()
    env = report.environment(device)
    env.update(tokens=settings.tokens, steps=settings.steps, warmup=settings.warmup,
               profile_steps=settings.profile_steps, reference_backend=reference_backend,
               kernel_time="torch.profiler, CUDA kernels + memcpy/memset",
               launches="megablocks_ascend.bench.instruments LaunchCounter: aten ops that launch a kernel + Triton launches",
               syncs="megablocks_ascend.bench.instruments HostSyncs: host reads of device values per eager step",
               wall_time="device events at each step's start (median)")
    ceiling = routing_table.copy_ceiling(device, quick=args.quick)
    settings.ceiling_gbps = ceiling["GBps"]
    env["copy_ceiling_GBps"] = settings.ceiling_gbps
    log(f"environment: {json.dumps(env)}")
    log(f"{len(variants)} variants")
    results = {"environment": env, "copy_ceiling": ceiling,
               "configs": {k: dict(settings.configs[k], T=settings.tokens) for k in settings.configs}, "rows": []}
    t_start = time.perf_counter()

    def save(rows):
        results["rows"] = rows
        report.write_json(out_dir / f"{args.name}.json", results)

    results["rows"] = steps.run(variants, device, settings, reference_backend, log, save)
    results["seconds"] = time.perf_counter() - t_start
    report.write_json(out_dir / f"{args.name}.json", results)
    log("")
    log(steps.table(results["rows"]))
    log(f"({results['seconds']:.0f} s; vs up = upstream eager wall / this wall, {reference_backend} backend; "
        f"floor = gemm ms + routing bytes at the copy ceiling, {settings.ceiling_gbps:.0f} GB/s; peak = the most "
        f"memory allocated above resident (no gradients) while a row was built and ran its first steps, mem = its peak / "
        f"upstream's in the same mode)")
    log("")
    log(steps.top_table(results["rows"]))
    (out_dir / f"{args.name}.log").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
