"""Host time per routing call: ours against upstream MegaBlocks', at each level of the call
(``benchmarks/bench_dispatch.py`` is its command line).

A fine-grained MoE step is short, and every routing call costs host time before the device sees
its kernel: the autograd Function, our dispatcher (validation, backend choice, trace record), the
launcher (tile and grid choice, the route-map lookup) and Triton's own launcher. This measures
that cost per call, level by level, for ours and upstream's:

``ours op``          ``megablocks.ops.<op>`` as the layers call it (our autograd Function)
``ours dispatch``    ``megablocks.backend.kernels.<op>``: our dispatcher, backend ``ascend``
``ours launcher``    ``megablocks_ascend.kernels.routing.<op>``: the launcher alone
``upstream op``      upstream's ``megablocks.ops.<op>`` with upstream's kernels (the plugin's
                     routing patches taken out for the measurement)
``upstream kernel``  upstream's ``megablocks.backend.kernels.<op>``

and, for ours, the parts of the dispatcher (``check_routing``, ``resolve``) timed alone.

The routing preparation (``prepare_routing``: the router's ids -> indices, bins, ...) is a row of
its own: ``ours op`` is ``megablocks_ascend.ops.prepare_routing`` (what the patched
``ParallelMLP.indices_and_bins`` calls; two launches), ``upstream op`` MegaBlocks' own sequence
(``ops.sort``, ``ops.histogram``, ``ops.inclusive_cumsum``: ``backends.upstream_preparation``),
whose torch ops are not stubbed (they run, at these tiny sizes).

The routing tensors are the routing preparation's, as in a layer step.

``--stub`` (the default without a GPU) replaces the kernel launch itself with a no-op (Triton's
``JITFunction.run`` / the interpreter's ``InterpretedFunction.run``), so the figures are the Python
above Triton's launcher, with no device; that runs anywhere. On a GPU without ``--stub`` the
launches are real and the figure is the host time to enqueue a call (shapes are small so the
device keeps up). Ours runs with its route map cached, as in a layer step (one of five calls
computes it).

    python benchmarks/bench_dispatch.py                 # GPU: real launches; CPU: stubbed
    python benchmarks/bench_dispatch.py --stub          # the Python above the launcher only
    python benchmarks/bench_dispatch.py --quick         # fewer calls (CI smoke test)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks and triton)
from megablocks_ascend.bench.report import default_out  # noqa: E402
import torch

from megablocks_ascend import backends, ops, patching, validation
from megablocks_ascend.bench import routing_ops, timing
from megablocks_ascend.bench.report import environment, logger
from megablocks_ascend.kernels import routing


# Small device work, so that a GPU keeps up with the host; smaller still with --stub, where the
# torch ops around the kernels (upstream's scatter sums over top_k, for one) run on the CPU.
SHAPES = {
    "fine128": dict(T=256, H=256, E=128, k=8, cf=1.0),
    "mixtral": dict(T=256, H=256, E=8, k=2, cf=1.0),
}
STUB_SHAPES = {
    "fine128": dict(T=32, H=64, E=128, k=8, cf=1.0),
    "mixtral": dict(T=32, H=64, E=8, k=2, cf=1.0),
}
OPS = ("gather", "scatter", "scatter_wgrad", "binned_gather", "binned_scatter", "binned_scatter_wgrad",
       "padded_gather", "padded_scatter", "padded_scatter_wgrad")
AUTOGRAD_OPS = ("gather", "scatter", "binned_gather", "binned_scatter", "padded_gather", "padded_scatter")
ROUTING_PATCHES = ("routing-kernels", "routing-ops")


def op_call(op, fn, d):
    """``megablocks.ops.<op>`` with MegaBlocks' arguments (autograd level)."""
    if op == "gather":
        return fn(d.x, d.indices, d.bin_ids, d.bins, d.k)
    if op == "scatter":
        return fn(d.y_drop, d.indices, d.bin_ids, d.w, d.bins, d.k)
    if op == "binned_gather":
        return fn(d.x, d.indices, d.bins, d.cap, d.k)
    if op == "binned_scatter":
        return fn(d.y_bin, d.indices, d.w, d.bins, d.k)
    if op == "padded_gather":
        return fn(d.x, d.indices, d.bin_ids, d.bins, d.padded_bins, d.k)
    if op == "padded_scatter":
        return fn(d.y_pad, d.indices, d.bin_ids, d.w, d.bins, d.padded_bins, d.k)
    raise KeyError(op)


class Stub:
    """Replace the kernel launch with a no-op (interpreter and compiled Triton alike)."""

    def __init__(self):
        self.saved = []

    def __enter__(self):
        import triton.runtime.jit as jit  # noqa: PLC0415
        targets = [(jit.JITFunction, "run")]
        try:
            from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
            targets.append((InterpretedFunction, "run"))
        except ImportError:
            pass
        for owner, name in targets:
            # (the method may be inherited, as in Triton 3.3: then the stub shadows it and goes)
            self.saved.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, lambda *a, **k: None)
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self.saved):
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)


def per_call_us(fn, device, calls, repeats, clock):
    """Host microseconds per call: the fastest of ``repeats`` runs of ``calls`` back-to-back calls
    (the least disturbed run). ``clock``: ``time.process_time`` with the launch stubbed (the CPU
    time this process spends, which a busy neighbour on a shared machine does not inflate), else
    ``time.perf_counter`` (wall time to enqueue the calls)."""
    fn()
    timing.synchronize(device)
    runs = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            fn()
        runs.append((clock() - t0) / calls * 1e6)
        timing.synchronize(device)
    return min(runs)


def upstream_ops():
    """Upstream's megablocks.ops and kernel functions as shipped (the plugin's routing patches
    reverted while they are looked up and called): ``(ops, kernels, restore)``."""
    import megablocks.backend.kernels as kernels  # noqa: PLC0415
    import megablocks.ops as mops  # noqa: PLC0415
    patches = [p for p in patching.PATCHES if p.name in ROUTING_PATCHES]
    for p in reversed(patches):
        p.revert()

    def restore():
        for p in patches:
            p.apply(p)
            p.applied = True
    return ({op: getattr(mops, op) for op in AUTOGRAD_OPS}, {op: getattr(kernels, op) for op in OPS}, restore)


def prepared(d):
    """``d``'s routing tensors replaced by the routing preparation's (the same values: what a layer
    step hands its routing calls; ours then need not check them again, see validation)."""
    top = torch.empty_like(d.indices)
    top[d.indices.long()] = d.bin_ids
    with backends.use_backend("torch"):
        indices, bin_ids, bins, _, padded_bins = ops.prepare_routing(top, d.E, routing_ops.PAD_BLOCK)
    assert torch.equal(indices, d.indices) and torch.equal(bins, d.bins) and torch.equal(padded_bins, d.padded_bins)
    d.indices, d.bin_ids, d.bins, d.padded_bins = indices, bin_ids, bins, padded_bins
    return d


def measure(shapes, device, stub, calls, repeats, log):
    import megablocks.backend.kernels as kernels  # noqa: PLC0415
    import megablocks.ops as mops  # noqa: PLC0415
    clock = time.process_time if stub else time.perf_counter
    rows = []
    for sname, s in shapes.items():
        d = prepared(routing_ops.Data(**s, device=device))
        timings = {}
        with backends.use_backend("ascend"):
            for op in OPS:
                params, x_ndim, x_rows = backends.SPECS[op]
                kw = dict(zip(params, routing_ops.call(op, lambda *a: a, d)))
                fns = {"ours dispatch": lambda op=op: routing_ops.call(op, getattr(kernels, op), d),
                       "ours launcher": lambda op=op: routing_ops.call(op, getattr(routing, op), d),
                       "ours check_routing": lambda op=op, kw=kw: validation.check_routing(
                           op, x=kw["x"], x_ndim=x_ndim, indices=kw["indices"], bins=kw["bins"],
                           top_k=kw["top_k"], bin_ids=kw.get("bin_ids"), weights=kw.get("weights"),
                           padded_bins=kw.get("padded_bins"), expert_capacity=kw.get("expert_capacity"),
                           grad=kw.get("grad"), x_rows=x_rows),
                       "ours resolve": lambda: backends.resolve(d.x.device)}
                if op in AUTOGRAD_OPS:
                    fns["ours op"] = lambda op=op: op_call(op, getattr(mops, op), d)
                with Stub() if stub else _null():
                    for name, fn in fns.items():
                        timings[(op, name)] = per_call_us(fn, device, calls, repeats, clock)
        ids = torch.randint(0, s["E"], (s["T"], s["k"]), device=device)
        with backends.use_backend("ascend"), Stub() if stub else _null():
            timings[("prepare_routing", "ours op")] = per_call_us(
                lambda: ops.prepare_routing(ids, s["E"], 0, routing.DROPLESS), device, calls, repeats, clock)
        with backends.use_backend("cuda" if device.type == "cuda" else "torch"):  # (the stand-in's own code)
            timings[("prepare_routing", "upstream op")] = per_call_us(
                lambda: backends.upstream_preparation(ids, s["E"]), device, calls, repeats, clock)
        if device.type == "cuda":
            # The plugin serving upstream's kernels (MEGABLOCKS_BACKEND=cuda): our dispatcher's cost
            # on top of upstream's kernel functions.
            with backends.use_backend("cuda"):
                for op in OPS:
                    fns = {"cuda dispatch": lambda op=op: routing_ops.call(op, getattr(kernels, op), d)}
                    if op in AUTOGRAD_OPS:
                        fns["cuda op"] = lambda op=op: op_call(op, getattr(mops, op), d)
                    for name, fn in fns.items():
                        fn()
                        with Stub() if stub else _null():
                            timings[(op, name)] = per_call_us(fn, device, calls, repeats, clock)
        up_ops, up_kernels, restore = upstream_ops()
        try:
            for op in OPS:
                fns = {"upstream kernel": lambda op=op: routing_ops.call(op, up_kernels[op], d)}
                if op in AUTOGRAD_OPS:
                    fns["upstream op"] = lambda op=op: op_call(op, up_ops[op], d)
                for name, fn in fns.items():
                    fn()  # autotune / compile before the launch is stubbed
                    with Stub() if stub else _null():
                        timings[(op, name)] = per_call_us(fn, device, calls, repeats, clock)
        finally:
            restore()
        for op in OPS + ("prepare_routing",):
            row = dict(shape=sname, op=op, **{name: round(us, 2) for (o, name), us in timings.items() if o == op})
            rows.append(row)
            log(f"  [{sname}] {op:22s} " + "  ".join(f"{k} {v:6.1f}" for k, v in row.items()
                                                      if isinstance(v, float)))
    return rows


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


COLUMNS = ("ours op", "upstream op", "cuda op", "ours dispatch", "upstream kernel", "cuda dispatch",
           "ours launcher", "ours check_routing", "ours resolve")


def table(rows, log, title):
    columns = [c for c in COLUMNS if any(c in r for r in rows)]
    log("")
    log(f"{title} (host us per call)")
    log(f"{'op':22s} {'shape':8s} " + " ".join(f"{c:>15s}" for c in columns))
    for r in rows:
        log(f"{r['op']:22s} {r['shape']:8s} " + " ".join(
            f"{r[c]:15.1f}" if c in r else f"{'-':>15s}" for c in columns))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few calls (CPU smoke test)")
    ap.add_argument("--device", default=None, help=routing_ops.DEVICE_HELP)
    ap.add_argument("--stub", action="store_true", help="launches replaced by a no-op (default without a GPU)")
    ap.add_argument("--calls", type=int, default=None, help="calls per timed run")
    ap.add_argument("--out", default=default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default="bench_dispatch")
    args = ap.parse_args(argv)
    device = routing_ops.setup(args.device)
    # Without a GPU the launch can only be stubbed; on a GPU both: real launches (what a step
    # pays) and stubbed (the Python above Triton's launcher, comparable with a CPU run).
    modes = ["stub"] if args.stub or device.type == "cpu" else ["launch", "stub"]
    repeats = 3 if args.quick else 7
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log, lines = logger()
    env = environment(device)
    env.update(repeats=repeats, clock={"stub": "process_time", "launch": "perf_counter"})
    log(f"environment: {json.dumps(env)}")
    report = {"environment": env, "results": {}}
    tables = []
    for mode in modes:
        stub = mode == "stub"
        calls = args.calls or (20 if args.quick else 1000 if stub else 300)
        shapes = {"quick": dict(T=24, H=48, E=4, k=2, cf=1.0)} if args.quick else STUB_SHAPES if stub else SHAPES
        log(f"[{mode}] {calls} calls per run, shapes {shapes}")
        rows = measure(shapes, device, stub, calls, repeats, log)
        report["results"][mode] = dict(calls=calls, shapes=shapes, rows=rows)
        tables.append((rows, "launch stubbed (CPU time)" if stub else "real launches (wall time to enqueue)"))
        (out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    for rows, title in tables:
        table(rows, log, title)
    (out_dir / f"{args.name}.log").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
