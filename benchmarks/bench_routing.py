"""Routing-kernel benchmark: our Triton kernels vs upstream MegaBlocks' vs plain PyTorch.

The command line of :mod:`megablocks_ascend.bench.routing_table` (the sections) over
:mod:`megablocks_ascend.bench.routing_ops` (shapes, problem, minimal bytes, the check), timed by
:mod:`megablocks_ascend.bench.timing`.

Times every routing op of every family (binned, dropless, padded: gather, weighted scatter,
router-weight gradient) at three bf16 shapes, for three implementations:

``ours``      ``megablocks_ascend.kernels.routing.<op>``
``upstream``  MegaBlocks 0.10.0's own ``megablocks.backend.kernels.<op>`` (autotuned on CUDA)
``torch``     ``megablocks_ascend.reference.<op>`` (whole-tensor PyTorch indexing)

against a ceiling: a large device-to-device copy (``dst.copy_(src)``), counting bytes read plus
bytes written. Before an op is timed, ours is checked against upstream (gathers bit-exact;
scatters and weight gradients by relative error) with its output allocation poisoned (the
caching allocator is handed a NaN-filled block of the output's size just before the call, so an
element our kernel does not write shows up as NaN).

Minimal bytes per op (``b`` bytes per element, 4 per index; ``T`` tokens, ``H`` hidden, ``k`` top_k,
``E`` experts, ``N = T*k`` assignments, ``R`` output rows of a gather: ``N`` dropless,
``padded_bins[-1]`` padded, ``E*capacity`` binned; ``K`` kept assignments (``N`` unless binned drops
some); ``U`` distinct tokens with at least one kept assignment (``T`` unless binned drops all of a
token's)); each distinct input byte read once, each output byte written once:

    gather  (unweighted)  U*H*b  + N*4 + E*4 [+ E*4 padded_bins]   read,  R*H*b  written
    scatter (weighted)    K*H*b  + K*b + N*4 + E*4 [+ E*4]         read,  T*H*b  written
    wgrad                 K*H*b  + U*H*b + N*4 + E*4 [+ E*4]       read,  N*b    written

(``bin_ids`` is not counted: no implementation needs it.) Fraction of ceiling = (minimal bytes /
time) / (copy bytes / copy time). Timing: ``triton.testing.do_bench``, median, which clears the
L2 cache (a 256 MiB memset) before every repetition; the inputs exceed the L2 anyway at the two
large shapes.

Usage::

    python benchmarks/bench_routing.py                    # the table, JSON and PNG
    python benchmarks/bench_routing.py --sweep --large --layers
    python benchmarks/bench_routing.py --no-table --prep  # the routing preparation alone
    python benchmarks/bench_routing.py --quick [--prep]   # tiny shapes; runs on CPU (interpreter)

``--prep``   the routing preparation (router ids -> indices, bin_ids, bins, tokens_per_expert,
             padded_bins, and ours also the route map): ours (two launches) against MegaBlocks' own
             ops.sort / ops.histogram / ops.inclusive_cumsum (/ ops.round_up) sequence, checked
             equal first; do_bench (host + device), CUDA-graph replay (device) and host time to
             enqueue one call, and the kernels one call launches (torch.profiler);
``--large``  correctness where tokens x hidden >= 2**31 (ours; upstream in a child process, since
             an int32 offset overflow can kill the CUDA context);
``--layers`` MegaBlocks' unchanged MoE and dMoE (mlp_impl="grouped") forward+backward with
             ``use_backend('ascend')`` vs ``use_backend('cuda')``;
``--sweep``  our kernels under other tile sizes / grid sizes (for devices.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks and triton: the stand-ins, the interpreter on a CPU)
from megablocks_ascend.bench.report import default_out  # noqa: E402
import torch
from megablocks_ascend.bench import plot, routing_ops
from megablocks_ascend.bench import report as report_
from megablocks_ascend.bench import routing_table as rt



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--device", default=None, help=routing_ops.DEVICE_HELP)
    ap.add_argument("--out", default=default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default="bench_routing", help="basename of the JSON and PNG")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of the shapes")
    ap.add_argument("--no-table", action="store_true", help="skip the main table")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--layers", action="store_true")
    ap.add_argument("--host", action="store_true", help="host cost per call (launch overhead)")
    ap.add_argument("--prep", action="store_true", help="the routing preparation, ours vs upstream's sequence")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--large-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--large-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--large-shape", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.large_child:
        rt.large_child(args.large_child.split(","), args.large_out, json.loads(args.large_shape))
        return 0

    device = routing_ops.setup(args.device)
    if device.type == "cpu" and not args.quick:
        ap.error("on the CPU only --quick runs (Triton interpreter)")
    shapes = routing_ops.QUICK_SHAPES if args.quick else routing_ops.SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log, lines = report_.logger()

    env = report_.environment(device)
    log(f"environment: {json.dumps(env)}")
    torch.manual_seed(0)
    ceil = rt.copy_ceiling(device, args.quick)
    log(f"copy ceiling: {ceil['GBps']:.0f} GB/s ({ceil['bytes'] / 1e9:.2f} GB read+written in {ceil['ms']:.3f} ms)"
        + (f"; op-sized copy ({ceil['op_sized']['bytes'] / 1e6:.0f} MB): {ceil['op_sized']['GBps']:.0f} GB/s"
           if "op_sized" in ceil else "")
        + (f"; write-only (fill) {ceil['write_only']['GBps']:.0f} GB/s, read-only (max) "
           f"{ceil['read_only']['GBps']:.0f} GB/s" if "write_only" in ceil else ""))
    report = {"environment": env, "copy_ceiling": ceil, "shapes": shapes,
              "min_bytes_formulas": {
                  "gather": "U*H*b + N*4 + E*4 [+E*4] read, R*H*b written",
                  "scatter": "K*H*b + K*b + N*4 + E*4 [+E*4] read, T*H*b written",
                  "wgrad": "K*H*b + U*H*b + N*4 + E*4 [+E*4] read, N*b written"}}
    json_path = out_dir / f"{args.name}.json"

    judged = device.type != "cpu"  # (the Triton interpreter's times measure nothing about a device)
    report["targets_judged"] = judged

    def save():
        report["targets"] = rt.targets(results, report.get("layers"), routing_ops.LARGE_SHAPES) \
            if results and judged else {}
        report_.write_json(json_path, report)
        (out_dir / f"{args.name}.log").write_text("\n".join(lines) + "\n")

    results, checks = [], []
    if not args.no_table:
        results, checks = rt.routing_table(shapes, device, ceil["GBps"], log)
    report.update(results=results, checks=checks)
    save()
    if args.host and device.type == "cuda":
        report["host_overhead_us"] = rt.host_overhead(device, log)
        save()
    if args.prep:
        prep_shapes = rt.QUICK_PREP_SHAPES if args.quick else rt.PREP_SHAPES
        if args.shapes and not args.quick:
            prep_shapes = {k: v for k, v in prep_shapes.items() if k in args.shapes.split(",")}
        report["prep"] = rt.prep_table(prep_shapes, device, log)
        save()
    if args.layers and device.type == "cuda":
        report["layers"] = rt.layers(device, log)
        save()
    if args.large and device.type == "cuda":
        report["large"] = rt.large(device, log, out_dir)
        save()
    if args.sweep and device.type == "cuda":
        report["sweep"] = rt.sweep(device, ceil["GBps"], log)
        save()
    if results and not args.no_plot:
        try:
            plot.fraction_of_ceiling(results, ceil["GBps"], out_dir / f"{args.name}.png")
        except Exception as e:  # noqa: BLE001  (the numbers are in the JSON either way)
            log(f"(no plot: {type(e).__name__}: {e})")
    if results:
        log("")
        log(f"copy ceiling {ceil['GBps']:.0f} GB/s; ms = median of do_bench (host launch + device); graph ms = "
            "device time from CUDA-graph replay; ceil = (minimal bytes / ms) / ceiling; vs up = upstream ms / ms; "
            "cached ms = ours under do_bench with the route map cached, as in a layer step")
        if not judged:
            log(report_.CPU_MEASURES_NOTHING + ": the times below check that the table is made, nothing more")
        log(rt.table(results))
        for name, t in report["targets"].items():
            log(f"target {name}: {'MET' if t['met'] else 'MISSED'} {t.get('misses', '')}")
        if not judged:
            log(f"targets: not judged ({report_.CPU_MEASURES_NOTHING}); the checks above passed: "
                f"{all(c['ok'] for c in checks)}")
    if report.get("prep"):
        log("")
        log("routing preparation: ms = median of do_bench (host launch + device); gr = device ms from CUDA-graph "
            "replay; us = host microseconds to enqueue one call; kernels = device kernels per call, ours/upstream; "
            "x = upstream ms / ours ms")
        log(rt.prep_report(report["prep"]))
    log(f"wrote {json_path}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
