"""Expert parallelism: MegaBlocks' MoE / dMoE on N ranks against one process, and a step timed per backend.

The command line of :mod:`megablocks_ascend.bench.expert_parallel_steps`, which documents the
checks and columns. One process per device, launched by ``torchrun``:

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_expert_parallel.py --out DIR   # 2 GPUs, NCCL
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_expert_parallel.py --out DIR   # 4 GPUs
    python benchmarks/bench_expert_parallel.py --out DIR          # N = 1: the single-rank baselines
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_expert_parallel.py --quick --device cpu
                                                                  # gloo on the CPU (interpreter)

Rank 0 writes ``NAME.json`` and ``NAME.log`` (``NAME`` defaults to ``ep<N>``) under ``--out``; the
exit status is 1 when a parity check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

import megablocks_ascend  # noqa: F401  (before megablocks and triton: the stand-ins, the interpreter on a CPU)
from megablocks_ascend.bench.report import default_out  # noqa: E402
from megablocks_ascend.bench import expert_parallel, report, routing_ops, steps, suite
from megablocks_ascend.bench import expert_parallel_steps as eps



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=tuple(eps.PG_BACKENDS), default=None,
                    help="default: the NPU, else CUDA, else the CPU")
    ap.add_argument("--quick", action="store_true", help="the tiny config, few steps (CPU smoke test)")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated step configs (default {','.join(eps.CONFIGS_DEFAULT)}; "
                         f"known: {', '.join(steps.CONFIGS)}, and with --quick {', '.join(steps.QUICK_CONFIGS)})")
    ap.add_argument("--layers", default=",".join(expert_parallel.LAYERS), help="comma-separated, of "
                    + ", ".join(expert_parallel.LAYERS))
    ap.add_argument("--backends", default=None,
                    help="comma-separated (default: ascend,cuda on CUDA, else ascend,torch)")
    ap.add_argument("--precision", choices=tuple(expert_parallel.PRECISIONS), default=None,
                    help="default: bf16 on a device, fp32 on the CPU")
    ap.add_argument("--tokens", type=int, default=None, help=f"tokens per rank (default {steps.TOKENS}; "
                                                             f"--quick {steps.QUICK_TOKENS})")
    ap.add_argument("--capacity-factor", type=float, default=1.0, help="MoE's (expert-parallel) capacity factor")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row (default 20; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-timing", action="store_true", help="parity checks only")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait before failing")
    ap.add_argument("--out", default=default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default=None, help="file names (default ep<N>)")
    a = ap.parse_args(argv)

    if a.device and a.device != "cpu":  # (an NPU without torch_npu: named, with what to do, before any rank starts)
        from megablocks_ascend import devices
        try:
            devices.requested(a.device)
        except devices.DeviceUnavailable as e:
            ap.error(str(e))
    device_type = a.device or suite.default_device().type
    if device_type == "cpu":
        routing_ops.setup("cpu")  # upstream's autotuned kernels narrowed to one config (the interpreter)
    table = steps.QUICK_CONFIGS if a.quick else steps.CONFIGS
    names = a.configs.split(",") if a.configs else (["tiny"] if a.quick else list(eps.CONFIGS_DEFAULT))
    layers = tuple(a.layers.split(","))
    backends = tuple(a.backends.split(",")) if a.backends else \
        (("ascend", "cuda") if device_type == "cuda" else ("ascend", "torch"))
    bad = [n for n in names if n not in table] + [x for x in layers if x not in expert_parallel.LAYERS] \
        + [b for b in backends if b not in ("ascend", "cuda", "torch")]
    if bad:
        ap.error(f"unknown config, layer or backend: {bad}")
    if device_type == "cpu" and not a.quick:
        ap.error("on the CPU only --quick runs (Triton interpreter)")
    s = eps.Settings(configs={n: table[n] for n in names},
                     tokens=a.tokens or (steps.QUICK_TOKENS if a.quick else steps.TOKENS), layers=layers,
                     backends=backends,
                     precision=a.precision or ("fp32" if device_type == "cpu" else "bf16"),
                     capacity_factor=a.capacity_factor, steps=a.steps or (2 if a.quick else 20),
                     warmup=a.warmup if a.warmup is not None else (1 if a.quick else 3),
                     profile_steps=0 if a.quick else 3, a2a_steps=1 if a.quick else 3, timed=not a.no_timing)

    ranks = eps.init(device_type, a.timeout)
    log, lines = report.logger()
    if ranks.rank != 0:
        def log(_=""):
            pass
    out_dir = Path(a.out)
    name = a.name or f"ep{ranks.world}"
    results = {"environment": dict(report.environment(ranks.device), world=ranks.world, pg_backend=ranks.pg_backend,
                                   nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE")),
               "settings": {k: v for k, v in vars(s).items()}, "rows": []}
    if ranks.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    log(f"environment: {json.dumps(results['environment'])}")
    log(f"expert parallelism on {ranks.world} rank(s), {ranks.pg_backend}, {s.tokens} tokens per rank, "
        f"{s.precision}, backends {', '.join(s.backends)}, reference: one process, torch backend, on rank 0")
    log(eps.HEAD)
    t0 = time.perf_counter()

    def save(rows):
        if ranks.rank == 0:
            results["rows"] = rows
            results["seconds"] = time.perf_counter() - t0
            report.write_json(out_dir / f"{name}.json", results)
            (out_dir / f"{name}.log").write_text("\n".join(lines) + "\n")

    try:
        rows = eps.run(s, ranks, log, save)
        failed = [r for r in rows if r.get("ok") is False]
        log("")
        log(eps.HEAD)
        for r in rows:
            log(eps.line(r))
        log("")
        for text in eps.per_rank_lines(rows):
            log(text)
        log(f"expert parallel: {ranks.world} rank(s), {sum(r.get('ok') is True for r in rows)} rows passed parity, "
            f"{len(failed)} failed, {sum('refused' in r for r in rows)} refused, "
            f"{sum('skipped' in r for r in rows)} skipped ({time.perf_counter() - t0:.0f} s)")
        save(rows)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    # Every result is written and the process group destroyed by now. Leave without finalizing the
    # interpreter: gloo's worker threads can still hold finished work (and its tensors) then, whose
    # destruction during finalization aborts the rank ("terminate called without an active
    # exception", SIGABRT) and fails the run after it passed (3 times in CI's 2-rank runs on 2 cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
