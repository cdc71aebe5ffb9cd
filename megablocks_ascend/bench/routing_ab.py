"""A/B probe for the routing kernels, on one GPU, in one run (``benchmarks/ab_routing.py`` is its command line).

``bench_routing.py`` measures the kernels as they are; this script answers "did a change help"
and "what bounds this op", side by side in the same process:

``--baseline REV``   every routing op, ours as at git revision ``REV`` (its ``kernels/routing.py``
                     and ``routing_kernels.py``; or a ``routing.py`` file, with the
                     ``routing_kernels.py`` beside it where it imports one) against ours as
                     in the working tree and upstream MegaBlocks, device time from CUDA-graph
                     replay, each checked against upstream first; plus the route map alone per
                     layout.
``--patterns``       the memory patterns that bound the gathers: a 1:1 copy, a 1:k broadcast copy
                     (each row read once, written k times: what a token-major gather does, without
                     the routing) in PyTorch, our gather under an identity routing (sequential
                     writes), and a probe copy of the token-major gather under cache hints.
``--k1``             tile and grid sweep of the top_k = 1 kernels that walk the experts
                     (``_scatter_one``, ``_wgrad_one``) at three top_k = 1 shapes.
``--host``           host time per call (ours with the route map cached and cold, upstream) and
                     three single do_bench runs back to back, with cudaMalloc counts.

Usage::

    python benchmarks/ab_routing.py --baseline HEAD~1 --patterns --k1 --out results/ --name ab

Needs a CUDA GPU. Bytes and ceiling as in ``bench_routing.py`` (the harness in ``megablocks_ascend.bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks and triton: the stand-ins, the interpreter on a CPU)
from megablocks_ascend.bench.report import default_out  # noqa: E402
import torch
import triton
import triton.language as tl

from megablocks_ascend.bench import routing_ops, routing_table, timing
from megablocks_ascend.bench.report import CPU_MEASURES_NOTHING, environment, logger
from megablocks_ascend import kernels
from megablocks_ascend.kernels import routing


ROUTE_MAP_BLOCKS = (32, 64, 128, 256, 512)
# top_k = 1 at 64 experts (Switch-like): the one-launch kernels' expert walk at many experts.
AB_EXTRA = {"k1-fine": dict(T=16384, H=2048, E=64, k=1, cf=1.25)}
K1_SHAPES = {
    "small": routing_ops.SHAPES["small"],
    "k1-large": dict(T=32768, H=4096, E=16, k=1, cf=1.0),
    **AB_EXTRA,
}
# The top_k = 1 kernels that walk the experts' positions (the k = 1 gathers use _gather).
K1_OPS = ("scatter", "binned_scatter", "padded_scatter", "scatter_wgrad", "binned_scatter_wgrad",
          "padded_scatter_wgrad")
# (block_m, block_x, num_warps, programs per SM; 0 = one program per sub-block)
K1_CONFIGS = [
    (1, 1024, 4, 16), (4, 1024, 4, 16), (2, 512, 4, 16), (4, 256, 4, 16), (8, 256, 4, 16),
    (4, 512, 4, 16), (8, 128, 4, 16), (4, 256, 2, 32), (1, 1024, 4, 0), (4, 256, 4, 0),
]


def load_routing(baseline: str):
    """The routing module of ``baseline``: a git revision of this repository (its
    ``kernels/routing.py`` and, since the split, ``kernels/routing_kernels.py``), or a ``routing.py``
    file (with the ``routing_kernels.py`` beside it where it imports one). The baseline's host code
    runs on the baseline's kernels, never on the working tree's."""
    where = Path(tempfile.mkdtemp(prefix="routing-baseline-"))
    if Path(baseline).is_file():
        sources = {"routing": Path(baseline).read_text()}
        beside = Path(baseline).with_name("routing_kernels.py")
        if beside.is_file():
            sources["routing_kernels"] = beside.read_text()
    else:
        root = Path(__file__).resolve().parents[2]  # (the checkout this package runs from)
        sources = {}
        for name in ("routing", "routing_kernels"):
            shown = subprocess.run(["git", "show", f"{baseline}:megablocks_ascend/kernels/{name}.py"], cwd=root,
                                   capture_output=True, text=True)
            if shown.returncode == 0:
                sources[name] = shown.stdout
            elif name == "routing":
                raise SystemExit(f"ab_routing: --baseline {baseline!r} is neither a file nor a revision with "
                                 f"megablocks_ascend/kernels/routing.py: {shown.stderr.strip()}")
    if "import routing_kernels" in sources["routing"] and "routing_kernels" not in sources:
        raise SystemExit(f"ab_routing: the baseline routing.py imports routing_kernels, and no routing_kernels.py "
                         f"was found beside {baseline}: its kernels would be the working tree's")

    def load(name):
        path = where / f"{name}_baseline.py"
        path.write_text(sources[name])  # (Triton reads a kernel's source from its file)
        spec = importlib.util.spec_from_file_location(f"{name}_baseline", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    with contextlib.ExitStack() as stack:
        if "routing_kernels" in sources:
            baseline_kernels = load("routing_kernels")
            # the baseline's `from megablocks_ascend.kernels import routing_kernels` finds these
            stack.enter_context(_swapped(sys.modules, "megablocks_ascend.kernels.routing_kernels", baseline_kernels))
            stack.enter_context(_swapped(vars(kernels), "routing_kernels", baseline_kernels))
        return load("routing")


@contextlib.contextmanager
def _swapped(table: dict, key: str, value):
    """``table[key] = value`` for the duration of the block, then as it was."""
    missing = object()
    old = table.get(key, missing)
    table[key] = value
    try:
        yield
    finally:
        if old is missing:
            table.pop(key, None)
        else:
            table[key] = old


def uncached(mod, name):
    fn = getattr(mod, name)
    # clear_route_maps() since the maps moved onto their tensors; older routing.py versions (a
    # baseline) kept them in a _ROUTE_MAPS table.
    clear = getattr(mod, "clear_route_maps", None) or mod._ROUTE_MAPS.clear

    def run(*args, **kwargs):
        clear()
        return fn(*args, **kwargs)
    return run


# On a CPU (--quick: the Triton interpreter) nothing is timed: the interpreter's times say nothing
# about a device. The run checks the script and every result; times are None, printed "-".
TIMED = [True]
NOT_TIMED = f"not timed: {CPU_MEASURES_NOTHING}; this run checks the script and every result only"


def graph_ms(fn, device):
    """Device ms of ``fn`` from CUDA-graph replay; None where nothing is timed (or no graph API)."""
    return timing.graph_ms(fn, device) if TIMED[0] else None


def bench_ms(fn, device, **kw):
    """do_bench ms of ``fn``; None where nothing is timed."""
    return timing.do_bench(fn, device, **kw) if TIMED[0] else None


def _ms(v, spec=".4f"):
    return "-" if v is None else format(v, spec)


def _ratio(a, b, spec=".2f"):
    return "-" if a is None or b is None else format(a / b, spec)


def _frac(nb, ms, ceiling):
    return None if ms is None else nb / ms / 1e6 / ceiling


# --- A/B against a baseline routing.py --------------------------------------------------------


def ab(base, device, ceiling, log, shapes=routing_ops.SHAPES):
    rows = []
    impls = {"base": base, "new": routing}
    for sname, s in shapes.items():
        d = routing_ops.Data(**s, device=device)
        log(f"[ab {sname}] T={d.T} H={d.H} E={d.E} k={d.k}")
        for op in routing_ops.OPS:
            nb = routing_ops.min_bytes(op, d)
            want = routing_ops.expected(op, d)
            up = routing_ops.implementation(op, "upstream")
            t = {"upstream": graph_ms(lambda: routing_ops.call(op, up, d), device)} if op not in routing_ops.GRAPH_UNSAFE else {}
            ok = {}
            for name, mod in impls.items():
                fn = uncached(mod, op)
                ok[name] = routing_ops.check(op, d, fn=fn, want=want)["ok"]
                if op in routing_ops.GRAPH_UNSAFE:
                    t[name] = bench_ms(lambda: routing_ops.call(op, fn, d), device)  # do_bench (host sync inside)
                else:
                    t[name] = graph_ms(lambda: routing_ops.call(op, fn, d), device)
            frac = {k: _frac(nb, v, ceiling) for k, v in t.items()}
            row = dict(shape=sname, op=op, min_bytes=nb, ok=ok, ms=t, frac_ceiling=frac,
                       timer="do_bench" if op in routing_ops.GRAPH_UNSAFE else "graph")
            rows.append(row)
            log(f"  {op:22s} base {_ms(t['base'])} ms {_ms(frac['base'], '6.1%')}  "
                f"new {_ms(t['new'])} ms {_ms(frac['new'], '6.1%')}  "
                + (f"upstream {_ms(t['upstream'])} ms  new/up {_ratio(t['upstream'], t['new'])}x  "
                   if "upstream" in t else "")
                + f"new/base {_ratio(t['base'], t['new'], '.3f')}x  checks {ok}")
        if d.k > 1:
            for layout, pb in ((routing.DROPLESS, None), (routing.PADDED, d.padded_bins), (routing.BINNED, None)):
                cap = d.cap if layout == routing.BINNED else 0
                t, maps = {}, {}
                for name, mod in impls.items():
                    fn = uncached(mod, "route_map")
                    maps[name] = fn(d.indices, d.bins, pb, layout=layout, capacity=cap)
                    t[name] = graph_ms(lambda: fn(d.indices, d.bins, pb, layout=layout, capacity=cap), device)
                fn = uncached(routing, "route_map")
                for bm in ROUTE_MAP_BLOCKS:
                    maps[f"new block_m={bm}"] = fn(d.indices, d.bins, pb, layout=layout, capacity=cap, block_m=bm)
                    t[f"new block_m={bm}"] = graph_ms(
                        lambda: fn(d.indices, d.bins, pb, layout=layout, capacity=cap, block_m=bm), device)
                same = all(torch.equal(m, maps["base"]) for m in maps.values())
                rows.append(dict(shape=sname, op=f"route_map[{layout}]", ms=t, timer="graph", same_maps=same))
                log(f"  route_map layout={layout}  " + "  ".join(f"{k} {_ms(v)} ms" for k, v in t.items())
                    + f"  maps equal: {same}")
        del d
        timing.empty_cache(device)
    return rows


# --- Patterns that bound the gathers ----------------------------------------------------------


@triton.jit
def _gather_tokens_probe(x, out, slot_to_row, num_tokens, hidden,
                         TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr,
                         LOAD_POLICY: tl.constexpr, STORE_CACHE: tl.constexpr, STORE_POLICY: tl.constexpr):
    # The dropless token-major gather (routing._gather_tokens, hidden a multiple of BLOCK_X), with
    # cache hints as parameters. A probe only: CUDA hints, not part of the shipped kernels.
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_X)
    for blk in range(pid, tl.cdiv(num_tokens, BLOCK_M), npg):
        tokens = blk * BLOCK_M + m
        in_tokens = tokens < num_tokens
        src = tl.where(in_tokens, tokens, 0) * hidden
        for x0 in range(0, hidden, BLOCK_X):
            tile = tl.load(x + src[:, None] + x0 + cols[None, :], eviction_policy=LOAD_POLICY)
            for k in tl.static_range(TOP_K):
                row = tl.load(slot_to_row + tokens * TOP_K + k, mask=in_tokens, other=0)
                tl.store(out + (row * hidden)[:, None] + x0 + cols[None, :], tile,
                         mask=in_tokens[:, None], cache_modifier=STORE_CACHE, eviction_policy=STORE_POLICY)


PROBE_VARIANTS = {
    # name: (block_m, block_x, num_warps, programs per SM, load policy, store cache, store policy)
    "as shipped (4x1024, 4 warps)": (4, 1024, 4, 16, "", "", ""),
    "load evict_first": (4, 1024, 4, 16, "evict_first", "", ""),
    "store .cs (streaming)": (4, 1024, 4, 16, "", ".cs", ""),
    "store evict_first": (4, 1024, 4, 16, "", "", "evict_first"),
    "load evict_first + store .cs": (4, 1024, 4, 16, "evict_first", ".cs", ""),
    "1 row x 1024, 4 warps": (1, 1024, 4, 16, "", "", ""),
    "8 rows x 1024, 8 warps": (8, 1024, 8, 8, "", "", ""),
    "1 row x 2048, 8 warps": (1, 2048, 8, 8, "", "", ""),
}


def patterns(device, ceiling, log, shapes):
    out = {}
    sms = timing.num_sms(device)
    for sname, s in shapes.items():
        T, H, k = s["T"], s["H"], s["k"]
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        dst = torch.empty(T * k, H, device=device, dtype=torch.bfloat16)
        one = torch.empty(T, H, device=device, dtype=torch.bfloat16)
        res = {}
        nb1 = 2 * T * H * 2
        nbk = (1 + k) * T * H * 2
        res["copy 1:1"] = (nb1, graph_ms(lambda: one.copy_(x), device))
        res[f"broadcast 1:{k} (torch expand copy)"] = (
            nbk, graph_ms(lambda: dst.view(T, k, H).copy_(x[:, None, :].expand(T, k, H)), device))
        res[f"write-only {k} rows (fill)"] = (T * k * H * 2, graph_ms(lambda: dst.fill_(1.0), device))
        # Our gather under an identity routing (sequential writes) and under the benchmark's routing.
        idx = torch.arange(T * k, device=device, dtype=torch.int32)
        per = T * k // s["E"]
        bins = torch.arange(1, s["E"] + 1, device=device, dtype=torch.int32) * per
        bins[-1] = T * k
        res["ours gather, identity routing"] = (
            nbk, graph_ms(lambda: routing_ops.uncached(routing.gather)(x, idx, None, None, bins, k), device))
        d = routing_ops.Data(**s, device=device, lazy=True)
        d._cache["x"] = x
        res["ours gather, benchmark routing"] = (
            nbk, graph_ms(lambda: routing_ops.uncached(routing.gather)(x, d.indices, d.bin_ids, None, d.bins, k), device))
        s2r = routing.route_map(d.indices, d.bins, None, layout=routing.DROPLESS)
        want = routing.gather(x, d.indices, d.bin_ids, None, d.bins, k)
        for name, (bm, bx, nw, pps, lp, sc, sp) in PROBE_VARIANTS.items():
            if H % bx:
                bx = H & -H  # (--quick: tiny hidden; a power of two dividing it)
            grid = (min(sms * pps, triton.cdiv(T, bm)),)

            def run(bm=bm, bx=bx, nw=nw, lp=lp, sc=sc, sp=sp, grid=grid):
                _gather_tokens_probe[grid](x, dst, s2r, T, H, TOP_K=k, BLOCK_M=bm, BLOCK_X=bx, LOAD_POLICY=lp,
                                           STORE_CACHE=sc, STORE_POLICY=sp, num_warps=nw)
            dst.fill_(float("nan"))
            run()
            ok = bool(torch.equal(dst, want))
            res[f"probe kernel (map given): {name}" + ("" if ok else " WRONG")] = (nbk, graph_ms(run, device))
        for name, (nb, ms) in res.items():
            log(f"  [patterns {sname}] {name:52s} {_ms(ms)} ms {_ms(None if ms is None else nb / ms / 1e6, '7.0f')} "
                f"GB/s {_ms(_frac(nb, ms, ceiling), '6.1%')} of the copy ceiling")
        out[sname] = {name: dict(bytes=nb, ms=ms, GBps=None if ms is None else nb / ms / 1e6,
                                 frac_ceiling=_frac(nb, ms, ceiling)) for name, (nb, ms) in res.items()}
        del x, dst, one, d, want, s2r
        timing.empty_cache(device)
    return out


# --- Host time and do_bench repeatability ----------------------------------------------------

HOST_OPS = ("gather", "scatter", "binned_gather", "binned_scatter_wgrad", "padded_scatter_wgrad")


def host_and_repeats(device, log, shape="mixtral"):
    """Host microseconds per call (ours with the route map cached and cold, upstream), and three
    single do_bench runs back to back per implementation, with the caching allocator's device
    allocation count across them: is a do_bench figure far above device time the host, the
    allocator, or the first run?"""
    d = routing_ops.Data(**{**routing_ops.SHAPES, **routing_ops.QUICK_SHAPES}[shape], device=device)
    out = []
    iters = 200 if device.type == "cuda" else 2

    def allocs():
        return torch.cuda.memory_stats(device).get("num_device_alloc", 0) if device.type == "cuda" else 0

    for op in HOST_OPS:
        impls = {"ours cached": getattr(routing, op), "ours cold": routing_ops.uncached(getattr(routing, op)),
                 "upstream": routing_ops.implementation(op, "upstream")}
        for name, fn in impls.items():
            routing_ops.call(op, fn, d)  # (runs once either way)
            host = timing.host_us(lambda: routing_ops.call(op, fn, d), device, iters=iters) if TIMED[0] else None
            before = allocs()
            runs = [bench_ms(lambda: routing_ops.call(op, fn, d), device, repeats=1) for _ in range(3)]
            row = dict(shape=shape, op=op, impl=name, host_us=host, do_bench_runs_ms=runs,
                       device_allocs_during=allocs() - before)
            out.append(row)
            log(f"  [host {shape}] {op:22s} {name:12s} host {_ms(host, '6.1f')} us  do_bench x3 "
                + " ".join(_ms(r) for r in runs) + f" ms  cudaMalloc +{row['device_allocs_during']}")
    del d
    timing.empty_cache(device)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None,
                    help="a git revision (or a routing.py file) whose routing kernels to compare against")
    ap.add_argument("--patterns", action="store_true")
    ap.add_argument("--k1", action="store_true")
    ap.add_argument("--host", action="store_true", help="host time per call and do_bench repeatability")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of the shapes for --baseline")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on CPU: a smoke test of this script")
    ap.add_argument("--device", default=None, help=routing_ops.DEVICE_HELP)
    ap.add_argument("--out", default=default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default="ab_routing")
    args = ap.parse_args(argv)
    device = routing_ops.setup(args.device)
    if device.type != "cuda" and not args.quick:
        ap.error("needs a CUDA GPU (or --quick)")
    TIMED[0] = device.type != "cpu"
    big = routing_ops.QUICK_SHAPES if args.quick else routing_ops.SHAPES
    k1_shapes = {"quick-k1": dict(T=24, H=48, E=4, k=1, cf=1.0)} if args.quick else K1_SHAPES
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log, lines = logger()

    report = {"environment": environment(device)}
    log(f"environment: {json.dumps(report['environment'])}")
    ceil = routing_table.copy_ceiling(device, quick=args.quick)
    report["copy_ceiling"] = ceil
    report["timed"] = TIMED[0]
    log(f"copy ceiling: {ceil['GBps']:.0f} GB/s" if TIMED[0] else NOT_TIMED)

    def save():
        (out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1))
        (out_dir / f"{args.name}.log").write_text("\n".join(lines) + "\n")

    if args.baseline:
        every = {**big, **({} if args.quick else AB_EXTRA)}
        shapes = every if not args.shapes else {k: every[k] for k in args.shapes.split(",")}
        report["ab"] = ab(load_routing(args.baseline), device, ceil["GBps"], log, shapes)
        save()
    if args.patterns:
        shapes = big if args.quick else {k: big[k] for k in ("mixtral", "fine")}
        report["patterns"] = patterns(device, ceil["GBps"], log, shapes)
        save()
    if args.host:
        report["host"] = host_and_repeats(device, log, shape="quick" if args.quick else "mixtral")
        save()
    if args.k1:
        routing_ops.SHAPES.update(k1_shapes)
        configs = [(bm, 64, nw, pps) for bm, _, nw, pps in K1_CONFIGS[:3]] if args.quick else K1_CONFIGS
        report["k1_sweep"] = routing_table.sweep(device, ceil["GBps"], log, shapes=tuple(k1_shapes), configs=configs,
                                      ops=K1_OPS)
        save()
    if not TIMED[0]:
        log(NOT_TIMED)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
