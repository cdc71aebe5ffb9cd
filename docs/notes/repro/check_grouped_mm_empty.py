"""Does ``torch._grouped_mm`` write zeros for empty groups of its K-grouped form? And what does the
stand-in's zero fill of empty groups cost?

MegaBlocks computes its expert weight gradients with the K-grouped GEMM (``out[g] = a_g.T @ b_g``,
``[E, M, N]``); an expert without tokens has an empty K range, whose block must be zero. Whether
torch's CUDA kernel (CUTLASS, SM90/SM100) writes that block is not established (pytorch/pytorch#172439:
garbage on B200, zeros reported on H800; NVIDIA/cutlass#2674), so the stand-in zeroes empty groups
itself on accelerators (``docs/notes/grouped-gemm.md``). This script settles it for the GPU it runs
on, calling ``torch._grouped_mm`` directly exactly as the stand-in does (``a.t()`` column-major,
``b`` row-major, int32 cumulative offsets on the device), bf16:

``check``  shapes of the four benchmark configurations' weight gradients (``[E, ffn, H]``) and two
           small ones (one on the kernel's small-tile path), each with empty groups first, last,
           in the middle, several, all but one, and none, and a call with no rows at all;
           ``eager`` with the output's memory poisoned first (a NaN-filled block of the output's
           size is freed just before the call, so the caching allocator hands it to the
           output: ``reused`` says whether it did), and ``graph``: the call captured in a CUDA
           graph after a NaN fill of the same block inside the graph pool, replayed with the
           empty groups moved around between replays (the offsets updated in place). Per case:
           the empty groups' blocks (non-zero and NaN element counts; ``zero`` when all are 0)
           and the relative error of the other groups against a float32 per-group ``mm``.
``time``   device time per call at the qw128 and ds64 weight-gradient shapes, 0 / 1 / 10% / 50%
           empty groups: ``torch._grouped_mm`` alone; the stand-in's ``gmm(..., trans_a=True)``
           with device sizes (its zero fill of the empty groups only); the same with the full
           masked fill of earlier versions (``_legacy_full_fill``).

Writes ``check_grouped_mm_empty.json`` (and ``.log``) under ``--out`` (default: ``$OUT`` if set,
else ``./bench-results``, which git ignores).

    python docs/notes/repro/check_grouped_mm_empty.py            # a GPU: about a minute
    python docs/notes/repro/check_grouped_mm_empty.py --quick    # CPU smoke test (torch's CPU kernel)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before triton: the interpreter on a CPU machine)
from megablocks_ascend.bench.report import default_out  # noqa: E402
import torch

from megablocks_ascend.bench import routing_ops, timing
from megablocks_ascend.bench.precision import rel_l2
from megablocks_ascend.bench.report import environment, logger
from megablocks_ascend.native import grouped_gemm as gg


# (name, E, M, N, rows): the weight gradients [E, ffn, H] of bench_steps.py's configurations at
# T = 8192 tokens (rows = T * top_k), and two small ones.
SHAPES = [
    ("qw128", 128, 768, 2048, 8192 * 8),
    ("ds64", 64, 1408, 2048, 8192 * 6),
    ("mixtral", 8, 14336, 4096, 8192 * 2),
    ("small", 8, 1792, 4096, 8192 * 2),
    ("tiny-smalltile", 16, 64, 256, 1000),   # M <= 128: the kernel's 64x128x128 tile
    ("odd", 6, 40, 24, 333),
]
QUICK_SHAPES = [("quick", 6, 16, 24, 100), ("quick-smalltile", 4, 8, 16, 37)]
PATTERNS = ("first", "last", "middle", "several", "all_but_one", "none")


def group_sizes(pattern: str, groups: int, rows: int, seed: int) -> list[int]:
    """``groups`` sizes summing to ``rows`` (random split), the groups of ``pattern`` empty."""
    g = torch.Generator().manual_seed(seed)
    empty = {"first": {0}, "last": {groups - 1}, "middle": {groups // 2},
             "several": set(range(1, groups, 3)), "all_but_one": set(range(groups)) - {groups // 3},
             "none": set()}[pattern]
    full = [i for i in range(groups) if i not in empty]
    cuts = sorted(torch.randint(0, rows + 1, (len(full) - 1,), generator=g).tolist())
    parts = [b - a for a, b in zip([0] + cuts, cuts + [rows])]
    sizes = [0] * groups
    for i, n in zip(full, parts):
        sizes[i] = n
    return sizes


def reference(a, b, sizes):
    out, r = [], 0
    for n in sizes:
        out.append(a[r:r + n].float().t() @ b[r:r + n].float())
        r += n
    return torch.stack(out)


def inspect(out, ref, sizes):
    """Findings of one result: per empty group, non-zero / NaN counts; error of the others."""
    empty = [g for g, n in enumerate(sizes) if n == 0]
    full = [g for g, n in enumerate(sizes) if n > 0]
    res = dict(empty_groups=len(empty))
    if empty:
        blocks = out[empty].float()
        res.update(empty_nonzero=int(torch.count_nonzero(blocks)), empty_nan=int(torch.isnan(blocks).sum()),
                   empty_max_abs=float(torch.nan_to_num(blocks, nan=float("inf")).abs().max()))
        res["zero"] = res["empty_nonzero"] == 0
    if full:
        res["rel_err"] = rel_l2(out[full].float(), ref[full])
    return res


def out_bytes(groups, m, n):
    """Bytes torch._grouped_mm allocates for a bf16 [groups, m, n] result (last dim padded to 16 bytes)."""
    return groups * m * (-(-n // 8) * 8) * 2


def eager_case(a, b, sizes, device):
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    nbytes = out_bytes(len(sizes), a.shape[1], b.shape[1])
    poison = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xFF)  # bf16 0xFFFF: NaN
    ptr = poison.data_ptr()
    del poison
    out = torch._grouped_mm(a.t(), b, offs=offs)
    res = inspect(out, reference(a, b, sizes), sizes)
    res["reused"] = out.data_ptr() == ptr
    return res


def graph_cases(a, b, patterns, device):
    """One captured call, replayed for each group-size list in ``patterns`` (same row total)."""
    groups, m, n = len(patterns[0]), a.shape[1], b.shape[1]
    offs = torch.tensor(patterns[0], device=device).cumsum(0).to(torch.int32)
    nbytes = out_bytes(groups, m, n)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch._grouped_mm(a.t(), b, offs=offs)          # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        poison = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xFF)
        ptr = poison.data_ptr()
        del poison
        out = torch._grouped_mm(a.t(), b, offs=offs)
    reused = out.data_ptr() == ptr
    results = []
    for sizes in patterns:
        offs.copy_(torch.tensor(sizes, device=device).cumsum(0).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        res = inspect(out, reference(a, b, sizes), sizes)
        res["reused"] = reused
        results.append(res)
    return results


def standin_case(a, b, sizes, device):
    """The stand-in's own call (device sizes), which zeroes empty groups where it must."""
    bs = torch.tensor(sizes, device=device)
    out = routing_ops.poisoned(lambda: gg.backend.gmm(a, b, bs, trans_a=True), len(sizes) * a.shape[1] * b.shape[1],
                      a.dtype, device)
    return inspect(out, reference(a, b, sizes), sizes)


def run_checks(shapes, device, log):
    rows = []
    for name, groups, m, n, total in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(total, m, device=device, generator=gen).to(torch.bfloat16)
        b = torch.randn(total, n, device=device, generator=gen).to(torch.bfloat16)
        per_pattern = [group_sizes(p, groups, total, seed=i) for i, p in enumerate(PATTERNS)]
        for pattern, sizes in zip(PATTERNS, per_pattern):
            for mode, fn in (("eager", eager_case), ("stand-in", standin_case)):
                try:
                    res = fn(a, b, sizes, device)
                except Exception as e:  # noqa: BLE001
                    res = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                rows.append(dict(shape=name, groups=groups, M=m, N=n, rows=total, pattern=pattern, mode=mode, **res))
                log(_line(rows[-1]))
        if device.type == "cuda":
            try:
                results = graph_cases(a, b, per_pattern[::-1], device)   # captured with "none", then moved
            except Exception as e:  # noqa: BLE001
                results = [dict(error=f"{type(e).__name__}: {str(e)[:300]}")] * len(PATTERNS)
            for pattern, res in zip(PATTERNS[::-1], results):
                rows.append(dict(shape=name, groups=groups, M=m, N=n, rows=total, pattern=pattern, mode="graph", **res))
                log(_line(rows[-1]))
        # No rows at all (every group empty): what torch does with a zero-length K.
        try:
            out = torch._grouped_mm(a[:0].t(), b[:0], offs=torch.zeros(groups, dtype=torch.int32, device=device))
            res = dict(zero=bool(torch.count_nonzero(out) == 0), empty_nonzero=int(torch.count_nonzero(out)))
        except Exception as e:  # noqa: BLE001
            res = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(dict(shape=name, groups=groups, M=m, N=n, rows=0, pattern="no_rows", mode="eager", **res))
        log(_line(rows[-1]))
        del a, b
        timing.empty_cache(device)
    return rows


def _line(r):
    head = f"  {r['shape']:15s} {r['pattern']:12s} {r['mode']:9s}"
    if "error" in r:
        return head + f" ERROR {r['error'][:120]}"
    parts = []
    if "zero" in r:
        parts.append(("empty blocks zero" if r["zero"] else
                      f"EMPTY BLOCKS NOT ZERO: {r['empty_nonzero']} non-zero, {r['empty_nan']} NaN")
                     if "empty_nan" in r else f"zero={r['zero']}")
    if "rel_err" in r:
        parts.append(f"rel err {r['rel_err']:.1e}")
    if "reused" in r:
        parts.append("poisoned" if r["reused"] else "poison not reused")
    return head + " " + ", ".join(parts)


def time_fill(device, log, quick):
    """Device ms per weight-gradient GEMM: raw, the stand-in (fill of empty groups), legacy full fill."""
    if quick:
        shapes = [("quick", 6, 16, 24, 100)]
    else:
        shapes = [s for s in SHAPES if s[0] in ("qw128", "ds64")]
    rows = []
    for name, groups, m, n, total in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(total, m, device=device, generator=gen).to(torch.bfloat16)
        b = torch.randn(total, n, device=device, generator=gen).to(torch.bfloat16)
        for label, n_empty in (("0 empty", 0), ("1 empty", 1), ("10% empty", max(1, groups // 10)),
                               ("50% empty", groups // 2)):
            sizes = group_sizes("none", groups - n_empty, total, seed=1) + [0] * n_empty
            perm = torch.randperm(groups, generator=torch.Generator().manual_seed(2)).tolist()
            sizes = [sizes[i] for i in perm]
            bs = torch.tensor(sizes, device=device)
            offs = bs.cumsum(0).to(torch.int32)
            res = dict(shape=name, groups=groups, M=m, N=n, rows=total, empty=n_empty)
            res["raw_ms"] = timing.do_bench(lambda: torch._grouped_mm(a.t(), b, offs=offs), device)
            res["standin_ms"] = timing.do_bench(lambda: gg.backend.gmm(a, b, bs, trans_a=True), device)
            gg._legacy_full_fill = True
            try:
                res["legacy_ms"] = timing.do_bench(lambda: gg.backend.gmm(a, b, bs, trans_a=True), device)
            finally:
                gg._legacy_full_fill = False
            rows.append(res)
            log(f"  {name:8s} {label:10s} torch._grouped_mm {res['raw_ms']:.4f} ms | stand-in {res['standin_ms']:.4f} ms"
                f" (+{res['standin_ms'] - res['raw_ms']:.4f}) | with the full masked fill {res['legacy_ms']:.4f} ms"
                f" (+{res['legacy_ms'] - res['raw_ms']:.4f})")
        del a, b
        timing.empty_cache(device)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--out", default=default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default="check_grouped_mm_empty")
    ap.add_argument("--no-time", action="store_true", help="skip the timing section")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        ap.error("without a GPU only --quick runs")
    if not hasattr(torch, "_grouped_mm"):
        ap.error(f"torch {torch.__version__} has no torch._grouped_mm")
    log, lines = logger()
    env = environment(device)
    if device.type == "cuda":
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["fast_kernel"] = gg._cuda_fast_grouped_mm(device.index or 0)
    log(f"environment: {json.dumps(env)}")
    t0 = time.perf_counter()
    report = dict(environment=env, checks=run_checks(QUICK_SHAPES if args.quick else SHAPES, device, log))
    checked = [r for r in report["checks"] if r["mode"] != "stand-in" and "zero" in r and r["pattern"] != "no_rows"]
    poisoned = [r for r in checked if r.get("reused")]
    report["summary"] = dict(
        torch_grouped_mm_cases=len(checked), poisoned_cases=len(poisoned),
        torch_grouped_mm_empty_groups_always_zero=all(r["zero"] for r in checked),
        torch_grouped_mm_empty_groups_zero_when_poisoned=all(r["zero"] for r in poisoned) if poisoned else None,
        standin_always_zero=all(r.get("zero", True) and "error" not in r
                                for r in report["checks"] if r["mode"] == "stand-in"),
        errors=sum("error" in r for r in report["checks"]))
    log(f"summary: {json.dumps(report['summary'])}")
    if not args.no_time:
        report["timing"] = time_fill(device, log, args.quick)
    report["seconds"] = time.perf_counter() - t0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    (out_dir / f"{args.name}.log").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
