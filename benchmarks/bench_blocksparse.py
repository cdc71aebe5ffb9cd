"""Block-sparse matmul benchmark: our kernels vs stk's own vs a dense matmul of the same FLOPs.

The command line of :mod:`megablocks_ascend.bench.blocksparse`, which documents the calls, the
checks, the comparisons and the targets: every kernel call the sparse dMoE's expert MLP makes, on
MegaBlocks' own topology, checked, timed and compared; the config sweep; stk's own kernels in
child processes; the int64 case (CUDA).

    python benchmarks/bench_blocksparse.py --out DIR        # H200: ~3 minutes
    python benchmarks/bench_blocksparse.py --quick --out DIR  # CPU smoke test (interpreter)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks and triton: stand-ins, interpreter on CPU)
import torch

from megablocks_ascend.bench import blocksparse, report, routing_ops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny shape on CPU (Triton interpreter): smoke test")
    ap.add_argument("--device", default=None, help=routing_ops.DEVICE_HELP)
    ap.add_argument("--out", default=report.default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default="bench_blocksparse")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(blocksparse.SHAPES))
    ap.add_argument("--dtype", default=None, help="bfloat16 (default), float16 (default with --quick)")
    ap.add_argument("--no-stk", action="store_true", help="skip stk's kernels")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the config sweep")
    ap.add_argument("--no-int64", action="store_true", help="skip the >2**31-element case")
    args = ap.parse_args(argv)
    # The interpreter's tl.dot is wrong on bfloat16 (compat.dot_needs_float32); stk's kernels run
    # there too in --quick, so the smoke test uses float16.
    dtype = getattr(torch, args.dtype or ("float16" if args.quick else "bfloat16"))
    device = routing_ops.setup(args.device)
    if device.type == "cpu" and not args.quick:
        ap.error("on the CPU only --quick runs (Triton interpreter)")
    shapes = blocksparse.QUICK_SHAPES if args.quick else blocksparse.SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log, lines = report.logger()
    results = blocksparse.run(shapes, device, dtype, quick=args.quick, sweep=args.sweep, stk=not args.no_stk,
                              int64=not args.no_int64, log=log, out_dir=out_dir)
    json_path = out_dir / f"{args.name}.json"
    report.write_json(json_path, results)
    (out_dir / f"{args.name}.log").write_text("\n".join(lines) + "\n")
    log(f"wrote {json_path} ({results['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
