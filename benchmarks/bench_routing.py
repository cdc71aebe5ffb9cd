"""Routing-kernel benchmark: our Triton kernels vs upstream MegaBlocks' vs plain PyTorch.

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
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import megablocks_ascend  # noqa: E402,F401  (before megablocks and triton: stand-ins, interpreter on CPU)
import torch  # noqa: E402
import triton  # noqa: E402

from megablocks_ascend import backends, devices, reference  # noqa: E402
from megablocks_ascend.kernels import routing  # noqa: E402

SHAPES = {
    "mixtral": dict(T=8192, H=4096, E=8, k=2, cf=1.0),
    "fine": dict(T=16384, H=2048, E=64, k=6, cf=1.25),
    "small": dict(T=4096, H=1024, E=16, k=1, cf=1.0),
}
QUICK_SHAPES = {
    "quick": dict(T=24, H=48, E=4, k=2, cf=1.0),
}
LARGE_SHAPES = ("mixtral", "fine")  # where the 90%-of-ceiling target applies
PAD_BLOCK = 128  # MegaBlocks' dMoE blocking (padded_bins rounds each expert up to it)

FAMILIES = {
    "binned": ("binned_gather", "binned_scatter", "binned_scatter_wgrad"),
    "dropless": ("gather", "scatter", "scatter_wgrad"),
    "padded": ("padded_gather", "padded_scatter", "padded_scatter_wgrad"),
}
OPS = [op for ops in FAMILIES.values() for op in ops]
IMPLS = ("ours", "upstream", "torch")


def op_kind(op: str) -> str:
    if op.endswith("wgrad"):
        return "wgrad"
    return "gather" if op.endswith("gather") else "scatter"


def op_family(op: str) -> str:
    return next(f for f, ops in FAMILIES.items() if op in ops)


# ------------------------------------------------------------------------------------------
# Data


class Data:
    """One routing problem: random logits -> softmax top-k -> stable sort, as MegaBlocks does."""

    def __init__(self, T, H, E, k, cf, device, dtype=torch.bfloat16, seed=0, lazy=False):
        self.T, self.H, self.E, self.k, self.cf = T, H, E, k, cf
        self.device, self.dtype = device, dtype
        self.N = T * k
        self.cap = int(cf * T * k / E)
        g = torch.Generator(device=device).manual_seed(seed)
        self.g = g
        logits = torch.randn(T, E, device=device, generator=g)
        w, top = torch.topk(torch.softmax(logits, dim=-1), k)
        top = top.flatten().int()
        self.w = w.flatten().to(dtype)
        bin_ids, order = torch.sort(top, stable=True)
        self.bin_ids = bin_ids.int()
        self.indices = order.int()
        counts = torch.bincount(top.long(), minlength=E).int()
        self.bins = torch.cumsum(counts, 0).int()
        self.padded_bins = torch.cumsum((counts + PAD_BLOCK - 1) // PAD_BLOCK * PAD_BLOCK, 0).int()
        self.P = int(self.padded_bins[-1].item())
        kept = torch.minimum(counts, torch.tensor(self.cap, device=device, dtype=torch.int32))
        self.K_binned = int(kept.sum().item())
        # Tokens with at least one kept assignment under the capacity.
        pos = torch.arange(self.N, device=device)
        start = torch.cat([torch.zeros(1, dtype=torch.long, device=device), self.bins[:-1].long()])
        keep_pos = (pos - start[self.bin_ids.long()]) < self.cap
        token_kept = torch.zeros(T, dtype=torch.bool, device=device)
        token_kept[(self.indices.long()[keep_pos]) // k] = True
        self.U_binned = int(token_kept.sum().item())
        self._cache = {}
        if not lazy:
            for name in ("x", "y_bin", "y_drop", "y_pad", "grad"):
                getattr(self, name)

    def _rand(self, name, shape):
        if name not in self._cache:
            self._cache[name] = torch.randn(shape, device=self.device, generator=self.g).to(self.dtype) \
                if self.device.type == "cpu" else \
                torch.randn(shape, device=self.device, dtype=self.dtype, generator=self.g)
        return self._cache[name]

    def drop(self, name):
        self._cache.pop(name, None)

    x = property(lambda s: s._rand("x", (s.T, s.H)))
    y_bin = property(lambda s: s._rand("y_bin", (s.E, s.cap, s.H)))
    y_drop = property(lambda s: s._rand("y_drop", (s.N, s.H)))
    y_pad = property(lambda s: s._rand("y_pad", (s.P, s.H)))
    grad = property(lambda s: s._rand("grad", (s.T, s.H)))


def call(op, fn, d: Data, **launch):
    """Call ``fn`` (ours, upstream's or the reference's ``op``) with MegaBlocks' arguments."""
    if op == "binned_gather":
        return fn(d.x, d.indices, None, d.bins, d.cap, d.k, **launch)
    if op == "binned_scatter":
        return fn(d.y_bin, d.indices, d.w, d.bins, d.k, **launch)
    if op == "binned_scatter_wgrad":
        return fn(d.y_bin, d.grad, d.indices, d.bins, d.k, **launch)
    if op == "gather":
        return fn(d.x, d.indices, d.bin_ids, None, d.bins, d.k, **launch)
    if op == "scatter":
        return fn(d.y_drop, d.indices, d.bin_ids, d.w, d.bins, d.k, **launch)
    if op == "scatter_wgrad":
        return fn(d.y_drop, d.grad, d.indices, d.bin_ids, d.bins, d.k, **launch)
    if op == "padded_gather":
        return fn(d.x, d.indices, d.bin_ids, None, d.bins, d.padded_bins, d.k, **launch)
    if op == "padded_scatter":
        return fn(d.y_pad, d.indices, d.bin_ids, d.w, d.bins, d.padded_bins, d.k, **launch)
    if op == "padded_scatter_wgrad":
        return fn(d.y_pad, d.grad, d.indices, d.bin_ids, d.bins, d.padded_bins, d.k, **launch)
    raise KeyError(op)


def min_bytes(op, d: Data) -> int:
    """Each distinct input byte read once, each output byte written once (see the module doc)."""
    b = torch.empty((), dtype=d.dtype).element_size()
    fam, kind = op_family(op), op_kind(op)
    K = d.K_binned if fam == "binned" else d.N
    U = d.U_binned if fam == "binned" else d.T
    meta = d.N * 4 + d.E * 4 + (d.E * 4 if fam == "padded" else 0)
    if kind == "gather":
        rows = {"binned": d.E * d.cap, "dropless": d.N, "padded": d.P}[fam]
        return U * d.H * b + meta + rows * d.H * b
    if kind == "scatter":
        return K * d.H * b + K * b + meta + d.T * d.H * b
    return K * d.H * b + U * d.H * b + meta + d.N * b


def _token_major(op):
    """Our gathers through the token-major kernel (``routing.gather_tokens_rows``)."""
    def binned_gather(x, indices, weights, bins, expert_capacity, top_k, **launch):
        out = routing.gather_tokens_rows(x, indices, bins, None, weights, layout=routing.BINNED, top_k=top_k,
                                         num_rows=bins.shape[0] * expert_capacity, capacity=expert_capacity,
                                         **launch)
        return out.view(bins.shape[0], expert_capacity, x.shape[1])

    def gather(x, indices, bin_ids, weights, bins, top_k, **launch):
        return routing.gather_tokens_rows(x, indices, bins, None, weights, layout=routing.DROPLESS, top_k=top_k,
                                          num_rows=indices.shape[0], **launch)

    def padded_gather(x, indices, bin_ids, weights, bins, padded_bins, top_k, **launch):
        return routing.gather_tokens_rows(x, indices, bins, padded_bins, weights, layout=routing.PADDED,
                                          top_k=top_k, num_rows=int(padded_bins[-1].item()), **launch)
    return locals()[op]


def _uncached(fn):
    """``fn`` with the route-map cache emptied first: a single op is timed with its whole cost (a
    layer step computes the map once and reuses it; see the layer benchmark)."""
    def run(*args, **kwargs):
        routing.clear_route_maps()
        return fn(*args, **kwargs)
    return run


def implementation(op, impl):
    if impl == "ours":
        if op.endswith("+tok"):
            return _uncached(_token_major(op[:-4]))
        return _uncached(getattr(routing, op))
    if impl == "upstream":
        return backends._upstream(op)
    if impl == "torch":
        return getattr(reference, op)
    raise KeyError(impl)


# ------------------------------------------------------------------------------------------
# Timing and checking


def bench(fn, device, grad_to_none=None, repeats=3) -> float:
    """Median milliseconds of ``fn``: the median of ``repeats`` back-to-back do_bench medians.

    On the benchmark machine the first do_bench of an op after other work sometimes ran up to
    2x slower than the same call measured again right after (docs/notes/h200-speed.md, v10);
    the median of three takes that out, equally for every implementation."""
    if device.type == "cuda":
        runs = sorted(float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                                    return_mode="median")) for _ in range(repeats))
        return runs[len(runs) // 2]
    # CPU (Triton interpreter, --quick): a smoke test, not a measurement; one timed call after the check.
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


_FLUSH = {}


def bench_graph(fn, device, n=20, replays=7):
    """Median device milliseconds of ``fn`` from CUDA-graph replays, without host launch cost.

    One graph holds ``n`` x (L2 flush, ``fn``), another ``n`` x (L2 flush); the difference over
    ``n`` is ``fn``'s device time. The flush reads 256 MiB (a read leaves no dirty lines behind
    to be written back during ``fn``). None where ``fn`` cannot be captured (a host sync).
    """
    if device.type != "cuda":
        return None
    if device not in _FLUSH:
        _FLUSH[device] = torch.ones(256 << 20, dtype=torch.int8, device=device)
    buf = _FLUSH[device]

    def flush():
        buf.max()

    def replay_ms(graph):
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    try:
        fn()
        flush()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream, as capture requires
            fn()
            flush()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g, g0 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush()
                fn()
        with torch.cuda.graph(g0):
            for _ in range(n):
                flush()
        ms = (replay_ms(g) - replay_ms(g0)) / n
        del g, g0
        return ms
    except Exception as e:  # noqa: BLE001
        print(f"    (no graph timing: {type(e).__name__}: {str(e)[:120]})", flush=True)
        torch.cuda.synchronize()
        return None


GRAPH_UNSAFE = ("padded_gather",)  # a .item() inside (ours and upstream): no capture


def host_us(fn, device, iters=200):
    """Host microseconds per call (device work kept small so the host is the bottleneck)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    sync(device)
    return (t1 - t0) / iters * 1e6


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def num_sms(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def poisoned(fn, like_numel, dtype, device):
    """Run ``fn`` right after the allocator has held a NaN-filled block of the output's size."""
    p = torch.full((like_numel,), float("nan"), dtype=dtype, device=device)
    del p
    return fn()


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


TOL = {"scatter": 1e-2, "wgrad": 1e-2}


def expected(op, d: Data):
    return call(op, implementation(op, "upstream"), d), call(op, implementation(op, "torch"), d)


def check(op, d: Data, fn=None, want=None, **launch):
    """Ours (poisoned output) against upstream and the reference. Returns a dict of findings."""
    up, ref = want if want is not None else expected(op, d)
    fn = fn or implementation(op, "ours")
    ours = poisoned(lambda: call(op, fn, d, **launch), up.numel(), d.dtype, d.device)
    kind = op_kind(op)
    out = {"op": op}
    if ours.shape != up.shape:
        out.update(ok=False, why=f"shape {tuple(ours.shape)} != upstream {tuple(up.shape)}")
        return out
    if kind == "gather":
        eq_up = bool(torch.equal(ours, up))
        eq_ref = bool(torch.equal(ours, ref))
        out.update(ok=eq_up and eq_ref, exact_vs_upstream=eq_up, exact_vs_torch=eq_ref)
    else:
        e_up, e_ref, e_upref = rel_err(ours, up), rel_err(ours, ref), rel_err(up, ref)
        out.update(ok=e_up <= TOL[kind] and e_ref <= TOL[kind], rel_err_vs_upstream=e_up,
                   rel_err_vs_torch=e_ref, upstream_rel_err_vs_torch=e_upref)
    return out


# ------------------------------------------------------------------------------------------
# Sections


def copy_ceiling(device, quick):
    n = (1 << 20) if quick else (1 << 30)  # bf16 elements: 2 GiB each way on a GPU
    src = torch.randn(n, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    nbytes = 2 * src.numel() * src.element_size()
    res = {"bytes": nbytes, "ms": ms, "GBps": nbytes / ms / 1e6}
    if not quick:
        # The same copy at the size of one routing op, for what the L2 flush and launch cost at that size.
        small = src[: 96 << 20]
        dsts = dst[: 96 << 20]
        ms2 = bench(lambda: dsts.copy_(small), device)
        res["op_sized"] = {"bytes": 2 * small.numel() * 2, "ms": ms2, "GBps": 2 * small.numel() * 2 / ms2 / 1e6}
        # One-way rates: the gathers write k bytes per byte read, the scatters the reverse.
        nb = src.numel() * src.element_size()
        ms_w = bench(lambda: dst.fill_(1.0), device)
        ms_r = bench(lambda: src.max(), device)
        res["write_only"] = {"bytes": nb, "ms": ms_w, "GBps": nb / ms_w / 1e6}
        res["read_only"] = {"bytes": nb, "ms": ms_r, "GBps": nb / ms_r / 1e6}
    del src, dst
    return res


def routing_table(shapes, device, ceiling, log):
    results, checks = [], []
    for sname, s in shapes.items():
        d = Data(**s, device=device)
        log(f"[shape {sname}] T={d.T} H={d.H} E={d.E} k={d.k} cf={d.cf}: capacity={d.cap} "
            f"kept(binned)={d.K_binned}/{d.N} tokens kept={d.U_binned}/{d.T} padded rows={d.P}")
        for op in OPS:
            c = check(op, d)
            c["shape"] = sname
            checks.append(c)
            log(f"  check {op:22s} {'ok' if c['ok'] else 'FAIL'} "
                + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in c.items() if k not in ("op", "shape", "ok")))
            nb = min_bytes(op, d)
            times, gtimes = {}, {}
            for impl in IMPLS:
                fn = implementation(op, impl)
                times[impl] = bench(lambda: call(op, fn, d), device)
                gtimes[impl] = None if impl == "torch" or op in GRAPH_UNSAFE else \
                    bench_graph(lambda: call(op, fn, d), device)
            # Ours as a layer step calls it: the route map of this routing already cached (a
            # step computes it once for its gather, scatter and their backwards), so top_k > 1
            # ops issue one launch here instead of two. do_bench only: host launch cost is the point.
            fn = getattr(routing, op) if device.type == "cuda" else None
            cached_ms = bench(lambda: call(op, fn, d), device) if fn is not None else None
            for impl in IMPLS:
                ms, gms = times[impl], gtimes[impl]
                gbps = nb / ms / 1e6
                row = dict(op=op, family=op_family(op), kind=op_kind(op), shape=sname, impl=impl,
                           ms=ms, min_bytes=nb, GBps=gbps, frac_ceiling=gbps / ceiling,
                           speedup_vs_upstream=times["upstream"] / ms, check_ok=c["ok"],
                           graph_ms=gms, graph_frac_ceiling=None, graph_speedup_vs_upstream=None,
                           map_cached_ms=cached_ms if impl == "ours" else None)
                if gms:
                    row["graph_frac_ceiling"] = nb / gms / 1e6 / ceiling
                    if gtimes["upstream"]:
                        row["graph_speedup_vs_upstream"] = gtimes["upstream"] / gms
                results.append(row)
        del d
        free(device)
    return results, checks


# Tile / grid candidates for the CUDA branch of devices.tile: (block_m, block_x, num_warps,
# programs per SM; 0 = one program per sub-block, no grid-stride loop).
SWEEP = [
    (4, 1024, 4, 16), (1, 1024, 4, 16), (2, 1024, 4, 16), (1, 2048, 8, 8), (2, 512, 2, 32),
    (1, 512, 2, 32), (4, 1024, 4, 8), (1, 1024, 4, 0), (8, 512, 4, 16), (4, 512, 4, 16),
]
SWEEP_OPS = ("gather", "binned_gather", "scatter", "scatter_wgrad", "binned_scatter", "binned_scatter_wgrad")


def sweep(device, ceiling, log, shapes=LARGE_SHAPES, configs=SWEEP, ops=SWEEP_OPS):
    sms = num_sms(device)
    rows = []
    for sname in shapes:
        d = Data(**SHAPES[sname], device=device)
        for op in ops:
            base = op.split("+")[0]
            nb = min_bytes(base, d)
            fn = implementation(op, "ours")
            want = expected(base, d)
            for bm, bx, nw, pps in configs:
                launch = dict(tile=devices.Tile(bm, bx, nw), num_programs=sms * pps if pps else 1 << 30)
                c = check(base, d, fn=fn, want=want, **launch)
                ms = bench(lambda: call(base, fn, d, **launch), device)
                gms = bench_graph(lambda: call(base, fn, d, **launch), device)
                gbps = nb / ms / 1e6
                ggbps = nb / gms / 1e6 if gms else float("nan")
                rows.append(dict(shape=sname, op=op, block_m=bm, block_x=bx, num_warps=nw, programs_per_sm=pps,
                                 ms=ms, GBps=gbps, frac_ceiling=gbps / ceiling, graph_ms=gms,
                                 graph_frac_ceiling=ggbps / ceiling, check_ok=c["ok"]))
                log(f"  sweep {sname:8s} {op:20s} bm={bm:2d} bx={bx:4d} w={nw} pps={pps:2d} "
                    f"do_bench {ms:8.4f} ms {gbps / ceiling:6.1%}  graph {gms or float('nan'):8.4f} ms "
                    f"{ggbps / ceiling:6.1%} {'ok' if c['ok'] else 'FAIL'}")
            del want
        del d
        free(device)
    return rows


def host_overhead(device, log):
    """Host cost per call at the small shape (device work of a few microseconds)."""
    d = Data(**SHAPES["small"], device=device)
    s2r = routing.route_map(d.indices, d.bins, None, layout=routing.DROPLESS)
    t = devices.tile("scatter", d.dtype, d.H, devices.target(device))
    n = devices.num_programs(device, 10**9)
    cases = {
        "ours scatter (k=1: _scatter_one, one launch)": lambda: routing.scatter(d.y_drop, d.indices, d.bin_ids, d.w,
                                                                                d.bins, 1),
        "ours scatter_wgrad (k=1: _wgrad_one, one launch)": lambda: routing.scatter_wgrad(d.y_drop, d.x, d.indices, d.bin_ids,
                                                                              d.bins, 1),
        "ours route_map alone": lambda: _uncached(routing.route_map)(d.indices, d.bins, None, layout=routing.DROPLESS),
        "ours scatter_rows alone": lambda: routing.scatter_rows(d.y_drop, s2r, d.w, num_tokens=d.T, top_k=1),
        "ours scatter_rows, tile+grid given": lambda: routing.scatter_rows(d.y_drop, s2r, d.w, num_tokens=d.T,
                                                                           top_k=1, tile=t, num_programs=n),
        "ours gather (_gather)": lambda: routing.gather(d.x, d.indices, d.bin_ids, None, d.bins, 1),
        "upstream scatter": lambda: backends._upstream("scatter")(d.y_drop, d.indices, d.bin_ids, d.w, d.bins, 1),
        "upstream gather": lambda: backends._upstream("gather")(d.x, d.indices, d.bin_ids, None, d.bins, 1),
        "torch.empty": lambda: torch.empty(d.T, d.H, dtype=d.dtype, device=device),
        "256 MiB memset (do_bench's L2 flush)": None,
    }
    out = {}
    for name, fn in cases.items():
        if fn is None:
            buf = torch.empty(256 << 20, dtype=torch.int8, device=device)
            out[name + ", device us"] = bench_graph(lambda: buf.zero_(), device) * 1e3 \
                if device.type == "cuda" else None
            continue
        out[name] = host_us(fn, device)
    for k, v in out.items():
        log(f"  host {k:45s} {v if v is None else round(v, 1)} us")
    return out


# --- The routing preparation -------------------------------------------------------------------

# Router shapes (T tokens, E experts, top_k) of the step benchmarks (bench_steps.py's configs) and two more.
PREP_SHAPES = {
    "mixtral": dict(T=8192, E=8, k=2),
    "ds64": dict(T=8192, E=64, k=6),
    "qw128": dict(T=8192, E=128, k=8),
    "fine": dict(T=16384, E=64, k=6),
    "e256": dict(T=8192, E=256, k=8),
}
QUICK_PREP_SHAPES = {"quick": dict(T=24, E=4, k=2)}
# What each layer prepares: (block for padded_bins, route-map layout): MoE's binned map (capacity
# factor 1), the grouped dMoE's dropless one, the sparse dMoE's padded bins and map.
PREP_VARIANTS = {"binned": (0, "BINNED"), "dropless": (0, "DROPLESS"), "padded": (PAD_BLOCK, "PADDED")}


def kernels_per_call(fn, device):
    """Device kernels (and memsets / copies) one call of ``fn`` launches, from torch.profiler; None
    off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def prep_table(shapes, device, log):
    """The routing preparation, ours against upstream's sequence (see the module docstring)."""
    from megablocks_ascend.kernels import preparation  # noqa: PLC0415
    # Upstream's sequence runs MegaBlocks' ops over the megablocks_ops module that is installed: on
    # a GPU without MegaBlocks' extension, the plugin's stand-in, whose PyTorch code serves the
    # `cuda` backend (torch.sort, a scatter-add); on a CPU (--quick) the same code under `torch`.
    upstream_backend = "cuda" if device.type == "cuda" else "torch"
    rows = []
    for sname, s in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(s["T"], s["E"], device=device, generator=g)
        ids = torch.topk(torch.softmax(logits, dim=-1), s["k"]).indices  # int64 [T, k], as the router's
        capacity = int(s["T"] * s["k"] / s["E"])
        for variant, (block, layout) in PREP_VARIANTS.items():
            route = getattr(routing, layout)

            def ours():
                return preparation.prepare_routing(ids, s["E"], block, route, capacity)

            def upstream():
                with backends.use_backend(upstream_backend):
                    return backends.upstream_preparation(ids, s["E"], block)

            got, want = ours(), upstream()
            ok = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                     for a, b in zip(got, want))
            row = dict(shape=sname, variant=variant, T=s["T"], E=s["E"], k=s["k"], block=block, ok=ok)
            for name, fn in (("ours", ours), ("upstream", upstream)):
                row[f"{name}_ms"] = bench(fn, device)
                row[f"{name}_graph_ms"] = bench_graph(fn, device)
                row[f"{name}_host_us"] = host_us(fn, device, iters=3 if device.type == "cpu" else 200)
                row[f"{name}_kernels"] = kernels_per_call(fn, device)
            rows.append(row)
            log(f"  prep {sname:8s} {variant:8s} {'ok' if ok else 'MISMATCH'}  "
                + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                            if k.startswith(("ours", "upstream"))))
        del ids, logits
        free(device)
    return rows


def prep_report(rows):
    head = (f"{'shape':8s} {'variant':8s} {'ok':3s} | {'ours ms':>8s} {'up ms':>8s} {'x':>5s} | {'ours gr':>8s} "
            f"{'up gr':>8s} | {'ours us':>8s} {'up us':>8s} | {'kernels':>7s}")
    lines = [head]
    for r in rows:
        def f(key, fmt):
            v = r.get(key)
            return format(v, fmt) if v is not None else "-"
        lines.append(f"{r['shape']:8s} {r['variant']:8s} {'ok' if r['ok'] else 'NO':3s} | {f('ours_ms', '8.4f')} "
                     f"{f('upstream_ms', '8.4f')} {r['upstream_ms'] / r['ours_ms']:5.2f} | "
                     f"{f('ours_graph_ms', '8.4f'):>8s} {f('upstream_graph_ms', '8.4f'):>8s} | "
                     f"{f('ours_host_us', '8.1f')} {f('upstream_host_us', '8.1f')} | "
                     f"{f('ours_kernels', 'd'):>3s}/{f('upstream_kernels', 'd'):>3s}")
    return "\n".join(lines)


# --- Large tensors (tokens x hidden >= 2**31) -------------------------------------------------

LARGE = dict(T=(1 << 19) + 4096, H=4096, E=16, k=1, cf=1.0)
LARGE_OPS = ("gather", "scatter", "scatter_wgrad", "binned_gather", "binned_scatter",
             "binned_scatter_wgrad", "padded_gather", "padded_scatter")


def _compare_large(op, out, ref):
    """Wrong rows (gathers and scatters: not bit-equal; wgrad: off by more than rounding)."""
    if out.shape != ref.shape:
        return dict(ok=False, why=f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    o = out.reshape(-1, out.shape[-1]) if out.ndim > 1 else out.reshape(-1, 1)
    r = ref.reshape(-1, ref.shape[-1]) if ref.ndim > 1 else ref.reshape(-1, 1)
    if op_kind(op) == "gather":
        bad = o != r  # bit-exact; NaN != NaN, so unwritten poisoned elements count
    else:
        # Scatters and dot products: rounding differs between implementations (the Triton
        # interpreter even truncates float32 -> bfloat16); a wrong row is far off.
        o32, r32 = o.float(), r.float()
        bad = ((o32 - r32).abs() > 0.02 * r32.abs() + 0.05) | ~torch.isfinite(o32)
    bad_rows = bad.any(dim=1)
    n_bad = int(bad_rows.sum().item())
    first = int(bad_rows.nonzero()[0].item()) if n_bad else None
    return dict(ok=n_bad == 0, wrong_rows=n_bad, rows=int(r.shape[0]), first_wrong_row=first)


def large_run(impl, ops, device, log, shape=None):
    d = Data(**(shape or LARGE), device=device, lazy=True)
    log(f"[large/{impl}] T={d.T} H={d.H} (T*H={d.T * d.H}, 2**31={2**31}) E={d.E} k={d.k} capacity={d.cap}")
    out = []
    needs = {"gather": ("x",), "binned_gather": ("x",), "padded_gather": ("x",),
             "scatter": ("y_drop",), "scatter_wgrad": ("y_drop", "grad"),
             "binned_scatter": ("y_bin",), "binned_scatter_wgrad": ("y_bin", "grad"),
             "padded_scatter": ("y_pad",), "padded_scatter_wgrad": ("y_pad", "grad")}
    for op in ops:
        for name in ("x", "y_drop", "y_bin", "y_pad", "grad"):
            if name not in needs[op]:
                d.drop(name)
        free(device)
        ref = call(op, implementation(op, "torch"), d)
        sync(device)
        t0 = time.perf_counter()
        got = poisoned(lambda: call(op, implementation(op, impl), d), ref.numel(), d.dtype, device)
        sync(device)
        r = dict(op=op, impl=impl, seconds=time.perf_counter() - t0, **_compare_large(op, got, ref))
        del ref, got
        log(f"  large {impl:8s} {op:22s} {'ok' if r['ok'] else 'WRONG'} "
            + " ".join(f"{k}={v}" for k, v in r.items() if k not in ("op", "impl", "ok", "seconds")))
        out.append(r)
    return out


def large(device, log, out_dir, shape=None):
    shape = shape or LARGE
    res = {"shape": dict(shape), "ours": large_run("ours", LARGE_OPS, device, log, shape), "upstream": []}
    free(device)
    # Upstream in child processes: an illegal address kills the CUDA context of its process.
    remaining = list(LARGE_OPS)
    partial = Path(out_dir) / "large_upstream.jsonl"
    while remaining:
        partial.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--large-child", ",".join(remaining), "--large-out", str(partial),
               "--large-shape", json.dumps(shape)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        except subprocess.TimeoutExpired as e:
            p = subprocess.CompletedProcess(cmd, -9, "", f"timed out after {e.timeout} s")
        done = [json.loads(line) for line in partial.read_text().splitlines()] if partial.exists() else []
        res["upstream"].extend(done)
        for r in done:
            log(f"  large upstream {r['op']:22s} {'ok' if r['ok'] else 'WRONG'} "
                + " ".join(f"{k}={v}" for k, v in r.items() if k not in ("op", "impl", "ok", "seconds")))
        remaining = remaining[len(done):]
        if remaining and p.returncode != 0:
            tail = (p.stderr or "").strip().splitlines()[-3:]
            r = dict(op=remaining[0], impl="upstream", ok=False, crashed=True, error=" | ".join(tail)[-400:])
            res["upstream"].append(r)
            log(f"  large upstream {remaining[0]:22s} CRASHED: {r['error']}")
            remaining = remaining[1:]
        elif remaining:
            break
    partial.unlink(missing_ok=True)
    return res


def large_child(ops, out_file, shape):
    device = setup()
    with open(out_file, "a") as f:
        for op in ops:
            r = large_run("upstream", [op], device, lambda s: print(s, flush=True), shape)[0]
            f.write(json.dumps(r) + "\n")
            f.flush()


# --- MegaBlocks layers ------------------------------------------------------------------------


def layers(device, log, ffn_sizes=(14336, 1792), shape=None, pair=("ascend", "cuda")):
    from megablocks.layers import moe as moe_mod  # noqa: PLC0415
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE  # noqa: PLC0415
    from megablocks_ascend.native import grouped_gemm as gg  # noqa: PLC0415

    s = shape or SHAPES["mixtral"]
    out = []
    for ffn in ffn_sizes:
        for cls in (MoE, dMoE):
            torch.manual_seed(0)
            args = Arguments(hidden_size=s["H"], ffn_hidden_size=ffn, moe_num_experts=s["E"], moe_top_k=s["k"],
                             moe_capacity_factor=s["cf"], mlp_impl="grouped", bf16=True, fp16=False,
                             return_bias=False,
                             device=torch.cuda.current_device() if device.type == "cuda" else device)
            layer = cls(args)
            x = torch.randn(s["T"], 1, s["H"], device=device, dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn(s["T"], 1, s["H"], device=device, dtype=torch.bfloat16)
            params = [x] + list(layer.parameters())

            def step():
                y = layer(x)
                y.backward(g)
                moe_mod.clear_load_balancing_loss()
                return y

            row = dict(layer=cls.__name__, ffn_hidden_size=ffn, T=s["T"], H=s["H"], E=s["E"], k=s["k"],
                       cf=s["cf"])
            outs = {}
            for backend in pair:
                old = os.environ.get("MEGABLOCKS_BACKEND")
                # Backward runs on autograd's device threads: record who served each call with
                # use_backend alone (it was thread-local before ea7ba47), then time with the env var too.
                with backends.trace() as calls, backends.use_backend(backend):
                    for p in params:
                        p.grad = None
                    step()
                row[f"{backend}_served_by_use_backend_only"] = sorted({f"{c.op}:{c.backend}" for c in calls})
                os.environ["MEGABLOCKS_BACKEND"] = backend
                try:
                    with backends.use_backend(backend):
                        with backends.trace() as calls:
                            for p in params:
                                p.grad = None
                            y = step()
                        outs[backend] = (y.detach().clone(), x.grad.detach().clone())
                        row[f"{backend}_served"] = sorted({c.backend for c in calls})
                        row[f"{backend}_ms"] = bench(step, device, grad_to_none=params)
                finally:
                    if old is None:
                        os.environ.pop("MEGABLOCKS_BACKEND", None)
                    else:
                        os.environ["MEGABLOCKS_BACKEND"] = old
            row["gmm_impl"] = gg.gmm_impl_name(torch.empty(1, 1, device=device, dtype=torch.bfloat16))
            a, b = pair
            row["out_rel_err"] = rel_err(outs[a][0], outs[b][0])
            row["xgrad_rel_err"] = rel_err(outs[a][1], outs[b][1])
            row["speedup"] = row[f"{b}_ms"] / row[f"{a}_ms"]
            log(f"  layer {cls.__name__:5s} ffn={ffn:5d} {a} {row[f'{a}_ms']:8.3f} ms  {b} {row[f'{b}_ms']:8.3f} ms "
                f" speedup {row['speedup']:.3f}x  out err {row['out_rel_err']:.1e} dx err {row['xgrad_rel_err']:.1e} "
                f" served {row[f'{a}_served']}/{row[f'{b}_served']}; use_backend alone: "
                f"{row[f'{a}_served_by_use_backend_only']}")
            out.append(row)
            del layer, x, g, params, outs
            free(device)
    return out


# ------------------------------------------------------------------------------------------
# Report


def table(results):
    def g(r, key, fmt):
        v = r.get(key)
        return format(v, fmt) if v is not None else "-"
    lines = [f"{'op':22s} {'shape':8s} {'impl':9s} {'ms':>8s} {'GB/s':>6s} {'ceil':>6s} {'vs up':>6s} |"
             f" {'graph ms':>8s} {'ceil':>6s} {'vs up':>6s} | {'cached ms':>9s}  ok"]
    for r in results:
        lines.append(f"{r['op']:22s} {r['shape']:8s} {r['impl']:9s} {r['ms']:8.4f} {r['GBps']:6.0f} "
                     f"{r['frac_ceiling']:6.1%} {r['speedup_vs_upstream']:5.2f}x | {g(r, 'graph_ms', '8.4f'):>8s} "
                     f"{g(r, 'graph_frac_ceiling', '6.1%'):>6s} {g(r, 'graph_speedup_vs_upstream', '5.2f'):>5s}x"
                     f" | {g(r, 'map_cached_ms', '9.4f'):>9s}  {'ok' if r['check_ok'] else 'FAIL'}")
    return "\n".join(lines)


def targets(results, layer_rows, large_shapes):
    ours = [r for r in results if r["impl"] == "ours"]
    t = {}
    miss = [f"{r['op']}@{r['shape']} {r['frac_ceiling']:.1%}" for r in ours
            if r["shape"] in large_shapes and r["frac_ceiling"] < 0.9]
    t["ceiling_90pct_large_shapes"] = dict(met=not miss, misses=miss)
    miss = [f"{r['op']}@{r['shape']} {r['speedup_vs_upstream']:.2f}x" for r in ours
            if r["op"] in ("binned_scatter", "scatter") and r["speedup_vs_upstream"] < 3]
    t["scatter_3x_upstream"] = dict(met=not miss, misses=miss)
    miss = [f"{r['op']}@{r['shape']} {r['speedup_vs_upstream']:.2f}x" for r in ours if r["speedup_vs_upstream"] < 1]
    t["never_slower_than_upstream"] = dict(met=not miss, misses=miss)
    t["all_checks_pass"] = dict(met=all(r["check_ok"] for r in ours))
    # The same bandwidth and speed-up targets on device time (CUDA-graph replay: no host launch cost).
    g = [r for r in ours if r.get("graph_ms")]
    if g:
        miss = [f"{r['op']}@{r['shape']} {r['graph_frac_ceiling']:.1%}" for r in g
                if r["shape"] in large_shapes and r["graph_frac_ceiling"] < 0.9]
        t["graph_ceiling_90pct_large_shapes"] = dict(met=not miss, misses=miss)
        miss = [f"{r['op']}@{r['shape']} {r['graph_speedup_vs_upstream']:.2f}x" for r in g
                if r["op"] in ("binned_scatter", "scatter") and (r["graph_speedup_vs_upstream"] or 0) < 3]
        t["graph_scatter_3x_upstream"] = dict(met=not miss, misses=miss)
        miss = [f"{r['op']}@{r['shape']} {r['graph_speedup_vs_upstream']:.2f}x" for r in g
                if r["graph_speedup_vs_upstream"] is not None and r["graph_speedup_vs_upstream"] < 1]
        t["graph_never_slower_than_upstream"] = dict(met=not miss, misses=miss)
    if layer_rows:
        miss = [f"{r['layer']} ffn={r['ffn_hidden_size']} {r['speedup']:.3f}x" for r in layer_rows if r["speedup"] < 1.1]
        t["layers_1.1x"] = dict(met=not miss, misses=miss)
    return t


def plot(results, ceiling, path):
    """Fraction of the copy ceiling per op: do_bench (left) and CUDA-graph device time (right)."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    shapes = list(dict.fromkeys(r["shape"] for r in results))
    fig, axes = plt.subplots(len(shapes), 2, figsize=(18, 3.8 * len(shapes)), squeeze=False)
    colors = {"ours": "#1f77b4", "upstream": "#ff7f0e", "torch": "#7f7f7f"}
    for row, sname in enumerate(shapes):
        rows = [r for r in results if r["shape"] == sname]
        ops = list(dict.fromkeys(r["op"] for r in rows))
        for col, (key, label) in enumerate((("frac_ceiling", "do_bench (host launch + device)"),
                                            ("graph_frac_ceiling", "device time (CUDA-graph replay)"))):
            ax = axes[row, col]
            width = 0.27
            for i, impl in enumerate(IMPLS):
                vals = [next((r.get(key) or 0 for r in rows if r["op"] == op and r["impl"] == impl), 0)
                        for op in ops]
                xs = [j + (i - 1) * width for j in range(len(ops))]
                ax.bar(xs, vals, width, label=impl, color=colors[impl])
                if impl == "ours":
                    for x_, v in zip(xs, vals):
                        if v:
                            ax.text(x_, v + 0.01, f"{v:.0%}", ha="center", va="bottom", fontsize=7)
            ax.axhline(0.9, color="k", ls="--", lw=0.8)
            ax.set_xticks(range(len(ops)))
            ax.set_xticklabels([o.replace("_scatter_wgrad", "_wgrad") for o in ops], rotation=20, fontsize=8)
            ax.set_ylim(0, 1.1)
            ax.set_ylabel("fraction of copy ceiling")
            shape = SHAPES.get(sname, QUICK_SHAPES.get(sname))
            ax.set_title(f"{sname} {shape}: {label}; ceiling {ceiling:.0f} GB/s, minimal bytes", fontsize=9)
            ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def environment(device):
    env = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join([Path(sys.executable).name] + sys.argv))
    try:
        import megablocks  # noqa: PLC0415
        env["megablocks"] = getattr(megablocks, "__version__", "0.10.0")
    except Exception as e:  # noqa: BLE001
        env["megablocks"] = f"unavailable ({e})"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda,
                   memory_gib=round(p.total_memory / 2**30, 1),
                   l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:  # noqa: BLE001
            env["driver"] = "?"
    else:
        env.update(device=f"cpu ({platform.processor() or platform.machine()}), Triton interpreter")
    return env


def logger():
    """``(log, lines)``: ``log(s)`` prints ``s`` at once and keeps it in ``lines`` for the log file."""
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)
    return log, lines


def setup():
    """The device to run on; on CPU, upstream's autotuned kernels narrowed to one config (the
    interpreter cannot autotune)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        import megablocks.backend.kernels as k  # noqa: PLC0415
        for autotuned in (k._padded_copy, k._padded_copy_wgrad, k._binned_copy, k._binned_copy_wgrad):
            autotuned.configs = autotuned.configs[:1]
    return device


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
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
        large_child(args.large_child.split(","), args.large_out, json.loads(args.large_shape))
        return 0

    device = setup()
    if device.type == "cpu" and not args.quick:
        ap.error("without a GPU only --quick runs (Triton interpreter)")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log, lines = logger()

    env = environment(device)
    log(f"environment: {json.dumps(env)}")
    torch.manual_seed(0)
    ceil = copy_ceiling(device, args.quick)
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

    def save():
        report["targets"] = targets(results, report.get("layers"), LARGE_SHAPES) if results else {}
        json_path.write_text(json.dumps(report, indent=1))
        (out_dir / f"{args.name}.log").write_text("\n".join(lines) + "\n")

    results, checks = [], []
    if not args.no_table:
        results, checks = routing_table(shapes, device, ceil["GBps"], log)
    report.update(results=results, checks=checks)
    save()
    if args.host and device.type == "cuda":
        report["host_overhead_us"] = host_overhead(device, log)
        save()
    if args.prep:
        prep_shapes = QUICK_PREP_SHAPES if args.quick else PREP_SHAPES
        if args.shapes and not args.quick:
            prep_shapes = {k: v for k, v in prep_shapes.items() if k in args.shapes.split(",")}
        report["prep"] = prep_table(prep_shapes, device, log)
        save()
    if args.layers and device.type == "cuda":
        report["layers"] = layers(device, log)
        save()
    if args.large and device.type == "cuda":
        report["large"] = large(device, log, out_dir)
        save()
    if args.sweep and device.type == "cuda":
        report["sweep"] = sweep(device, ceil["GBps"], log)
        save()
    if results and not args.no_plot:
        try:
            plot(results, ceil["GBps"], out_dir / f"{args.name}.png")
        except Exception as e:  # noqa: BLE001  (the numbers are in the JSON either way)
            log(f"(no plot: {type(e).__name__}: {e})")
    if results:
        log("")
        log(f"copy ceiling {ceil['GBps']:.0f} GB/s; ms = median of do_bench (host launch + device); graph ms = "
            "device time from CUDA-graph replay; ceil = (minimal bytes / ms) / ceiling; vs up = upstream ms / ms; "
            "cached ms = ours under do_bench with the route map cached, as in a layer step")
        log(table(results))
        for name, t in report["targets"].items():
            log(f"target {name}: {'MET' if t['met'] else 'MISSED'} {t.get('misses', '')}")
    if report.get("prep"):
        log("")
        log("routing preparation: ms = median of do_bench (host launch + device); gr = device ms from CUDA-graph "
            "replay; us = host microseconds to enqueue one call; kernels = device kernels per call, ours/upstream; "
            "x = upstream ms / ours ms")
        log(prep_report(report["prep"]))
    log(f"wrote {json_path}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
