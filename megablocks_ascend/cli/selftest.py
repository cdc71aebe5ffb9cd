"""``python -m megablocks_ascend selftest``: our kernels against the ``torch`` backend, on this device.

The check a user with an NPU runs first: every routing kernel function of every layout
(binned, dropless, padded), forward and weight-gradient, in fp32/fp16/bf16, on shapes that cross
expert boundaries inside sub-blocks, drop tokens and leave padding, compared with the pure-PyTorch
backend on the same device. Gathers must match exactly; scatters and weight gradients within a
tolerance derived from the dtype; the routing preparation (router ids -> indices, bins, padded
bins and each layout's route map) must equal the ``torch`` backend's and the route-map kernel's
exactly, and so must the ``megablocks_ops`` stand-in's sort and histogram on the same kernels.
Then stk's block-sparse matmuls as the sparse dMoE calls them
(``sdd``, ``dsd``, ``dsd`` transposed, ``dds``, ``row_indices``) on a MegaBlocks-shaped topology
with an expert that got no tokens, against the same backend.

Every floating output also gets the precision verdict in the Ascend form
(:mod:`megablocks_ascend.bench.precision`): its error against a CPU golden (float32; float64 for
float32 results) over the same computation's error in the device dtype on the CPU, as three ratios
(maximum relative error <= 10, mean relative error <= 2, RMSE <= 2, with a one-unit floor per
dtype), printed per tensor, and judged for the 16-bit dtypes training runs in. Printed and not
judged (``-`` in the verdict column): float32 results (the float32 floor, 2**-14, is far above
float32's rounding, so the ratios compare two accumulation orders, ours by tiles against the CPU's
BLAS blocking, and a single element near a cancellation moves the maximum relative error by more
than 10x: seen on the CPU for the block-sparse matmuls and a 1000-wide weight gradient), and
bfloat16 on the CPU (the Triton interpreter converts float32 to bfloat16 by truncation where
devices round to nearest, which doubles the RMSE of a single conversion).
"""

from __future__ import annotations

import argparse
import time

import torch

from megablocks_ascend.bench import precision

_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_SHAPES = (  # tokens, hidden, experts, top_k, capacity factor
    (64, 96, 4, 2, 1.0),
    (130, 1000, 16, 4, 0.5),
    (512, 1024, 8, 1, 1.25),
    (300, 256, 72, 2, 0.75),  # many experts: the expert walk's BLOCK_E = 128 and its cumsum
    (256, 128, 64, 1, 1.0),  # top_k = 1 at 64 experts: the one-launch walks
)


def default_device() -> torch.device:
    from megablocks_ascend.patching import default_device as dd  # noqa: PLC0415
    d = dd()
    return torch.device("cuda", d) if isinstance(d, int) else d


def _routing(tokens, experts, top_k, device, gen):
    logits = torch.randn(tokens, experts, generator=gen)
    weights, top = torch.topk(logits.softmax(-1), top_k, dim=-1)
    top = top.flatten().int()
    bin_ids, indices = torch.sort(top, stable=True)
    counts = torch.bincount(top, minlength=experts)
    bins = torch.cumsum(counts, 0).int()
    padded = torch.cumsum((counts + 7) // 8 * 8, 0).int()
    to = {"device": device}
    return (indices.int().to(**to), bin_ids.int().to(**to), bins.to(**to), padded.to(**to),
            weights.flatten().to(**to))


def _within_one_bf16_ulp(out, ref):
    """The Triton interpreter casts float32 to bfloat16 by truncation (CUDA and Ascend round to
    nearest even), so on CPU a scaled bfloat16 copy may differ from PyTorch's by one unit in the
    last place."""
    o, r = out.double(), ref.double()
    return bool(((o - r).abs() <= r.abs() * 2.0**-7).all())


def _verdict(name, fn, args, out, dtype, device):
    """The precision verdict of ``out`` (``fn(*args)`` on the device) against ``fn``, the plain-PyTorch
    reference, on the CPU; ``(verdict, judged)``, ``judged`` False where the verdict cannot count
    (float32, and bfloat16 on the CPU: see the module doc)."""
    sim, gold = precision.cpu_references(fn, args, dtype, backend=None)
    judged = dtype in (torch.float16, torch.bfloat16) and not (device.type == "cpu" and dtype == torch.bfloat16)
    return precision.judge(name, out, sim, gold, dtype), judged


def _out_of(fn, out_index):
    """``fn`` (which writes its result into argument ``out_index``) as a function returning it."""
    def call(*args):
        args = list(args)
        fn(*args)
        return args[out_index]
    return call


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _dmoe_topology(rows_per_expert, ffn, block, device):
    """The BCSR metadata MegaBlocks' ``ParallelDroplessMLP.topology`` builds: block row ``r`` of
    expert ``e`` holds block columns ``e * ffn/block ..`` (all of the expert's), int16 indices."""
    per_row = ffn // block
    experts = [e for e, rows in enumerate(rows_per_expert) for _ in range(rows // block)]
    cols = [e * per_row + j for e in experts for j in range(per_row)]
    rows = [r for r in range(len(experts)) for _ in range(per_row)]
    order = sorted(range(len(cols)), key=lambda i: (cols[i], rows[i]))
    counts = [0] * (len(rows_per_expert) * per_row)
    for c in cols:
        counts[c] += 1
    to = dict(device=device)
    i16, i32 = dict(dtype=torch.int16, **to), dict(dtype=torch.int32, **to)
    return dict(offsets=torch.arange(0, len(cols) + 1, per_row, **i32), row_indices=torch.tensor(rows, **i16),
                column_indices=torch.tensor(cols, **i16),
                offsets_t=torch.cumsum(torch.tensor([0] + counts), 0).to(**i32),
                column_indices_t=torch.tensor([rows[i] for i in order], **i16),
                block_offsets_t=torch.tensor(order, **i32))


def _blocksparse(device, dtype, gen):
    """(name, args, output) of stk's calls in a sparse dMoE step: 3 experts of ffn 256, one empty."""
    block, ffn, hidden = 128, 256, 96
    t = _dmoe_topology([256, 0, 128], ffn, block, device)
    m, n = 384, 3 * ffn
    nnz = t["row_indices"].numel()

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    x, w1, w2, dy, data = rand(m, hidden), rand(n, hidden), rand(n, hidden), rand(m, hidden), rand(nnz, block, block)
    out = lambda *shape: torch.empty(*shape, device=device, dtype=dtype)  # noqa: E731
    meta = (t["offsets"], t["row_indices"], t["column_indices"], t["offsets_t"], t["column_indices_t"],
            t["block_offsets_t"])
    return [
        ("sdd", (x, w1.t(), (m, n), out(nnz, block, block), *meta[:3]), 3),
        ("dsd", ((m, n), data, *meta, False, w2, out(m, hidden)), 10),
        ("dsd", ((n, m), data, *meta, True, dy, out(n, hidden)), 10),
        ("dds", (dy.t(), (m, n), data, *meta, False, out(hidden, n)), 10),
        ("row_indices", ((m, n), torch.empty(nnz, block, block, device="meta"), t["offsets"],
                         t["column_indices"], torch.empty(nnz, dtype=torch.int16, device=device)), 4),
    ]


def _preparation(tokens, experts, top_k, cap, device, gen):
    """(name, shape, ok) of the routing preparation and the stand-in's sort and histogram, ours
    (``ascend``) against the ``torch`` backend's and the route-map kernel's, exactly."""
    from megablocks_ascend import backends  # noqa: PLC0415
    from megablocks_ascend.kernels import preparation, routing  # noqa: PLC0415
    from megablocks_ascend.native import megablocks_ops  # noqa: PLC0415
    ids = torch.topk(torch.randn(tokens, experts, generator=gen), top_k).indices.to(device)
    shape = f"T={tokens} E={experts} k={top_k}"
    out = []
    for layout, block, capacity in ((routing.DROPLESS, 0, 0), (routing.PADDED, 8, 0), (routing.BINNED, 0, cap)):
        with backends.use_backend("torch"):
            ref = backends.prepare_routing(ids, experts, block, layout, capacity)
        got = preparation.prepare_routing(ids, experts, block, layout, capacity)
        ok = all((a is None and b is None) or (a is not None and torch.equal(a, b)) for a, b in zip(got, ref))
        indices, _, bins, _, padded = got
        pb = padded if layout == routing.PADDED else None
        kept = routing.route_map(indices, bins, pb, layout=layout, capacity=capacity)
        ok = ok and torch.equal(kept, routing._compute_route_map(indices, bins, pb, layout=layout, capacity=capacity,
                                                                 block_m=None, num_programs=None))
        out.append((f"prepare_routing[{('dropless', 'padded', 'binned')[layout]}]", shape, ok))
    keys = ids.reshape(-1).int()
    end_bit = backends.end_bit(experts)
    x_out, iota = torch.empty_like(keys), torch.empty_like(keys)
    with backends.use_backend("ascend"):
        megablocks_ops.sort(keys, end_bit, x_out, iota)
        counts = megablocks_ops.histogram(keys.short(), experts)
    want_x, want_iota = torch.sort(keys, stable=True)
    out.append(("megablocks_ops.sort", shape, torch.equal(x_out, want_x) and torch.equal(iota, want_iota.int())))
    out.append(("megablocks_ops.histogram", shape,
                torch.equal(counts, torch.bincount(keys.long(), minlength=experts).int())))
    return out


def run(device: torch.device, dtypes=(torch.float32, torch.float16, torch.bfloat16), verbose=True,
        families=("routing", "blocksparse")) -> int:
    from megablocks_ascend import backends  # noqa: PLC0415
    gen = torch.Generator().manual_seed(0)
    failures = 0
    rows = []
    for tokens, hidden, experts, top_k, cf in _SHAPES if "routing" in families else ():
        indices, bin_ids, bins, padded, w = _routing(tokens, experts, top_k, device, gen)
        cap = max(int(cf * tokens * top_k / experts), 1)
        n = tokens * top_k
        start = time.perf_counter()
        checked = _preparation(tokens, experts, top_k, cap, device, gen)
        each = (time.perf_counter() - start) / len(checked)
        for name, shape, ok in checked:
            failures += not ok
            rows.append((name, shape, "int", 0.0, "ok" if ok else "FAIL", each))
        for dtype in dtypes:
            x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
            grad = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
            wd = w.to(dtype)
            y_binned = torch.randn(experts, cap, hidden, generator=gen).to(device=device, dtype=dtype)
            y_rows = torch.randn(n, hidden, generator=gen).to(device=device, dtype=dtype)
            y_padded = torch.randn(int(padded[-1]), hidden, generator=gen).to(device=device, dtype=dtype)
            calls = {
                "binned_gather": ((x, indices, wd, bins, cap, top_k), True),
                "binned_scatter": ((y_binned, indices, wd, bins, top_k), False),
                "binned_scatter_wgrad": ((y_binned, grad, indices, bins, top_k), False),
                "gather": ((x, indices, bin_ids, wd, bins, top_k), True),
                "scatter": ((y_rows, indices, bin_ids, wd, bins, top_k), False),
                "scatter_wgrad": ((y_rows, grad, indices, bin_ids, bins, top_k), False),
                "padded_gather": ((x, indices, bin_ids, wd, bins, padded, top_k), True),
                "padded_scatter": ((y_padded, indices, bin_ids, wd, bins, padded, top_k), False),
                "padded_scatter_wgrad": ((y_padded, grad, indices, bin_ids, bins, padded, top_k), False),
            }
            for name, (args, exact) in calls.items():
                fn = backends.KERNELS[name]
                with backends.use_backend("torch"):
                    ref = fn(*args)
                start = time.perf_counter()
                with backends.use_backend("ascend"):
                    out = fn(*args)
                elapsed = time.perf_counter() - start
                err = _rel(out, ref)
                if not exact:
                    ok = err <= _TOL[dtype]
                elif device.type == "cpu" and dtype == torch.bfloat16:
                    ok = _within_one_bf16_ulp(out, ref)
                else:
                    ok = torch.equal(out, ref)
                ok = ok and out.shape == ref.shape
                verdict, judged = _verdict(name, backends._implementation(name, "torch"), args, out, dtype, device)
                ok = ok and (verdict.ok or not judged)
                failures += not ok
                rows.append((name, f"T={tokens} H={hidden} E={experts} k={top_k}", str(dtype)[6:], err,
                             "ok" if ok else "FAIL", elapsed, verdict, judged))
    for dtype in dtypes if "blocksparse" in families else ():
        for name, args, out_index in _blocksparse(device, dtype, gen):
            fn = backends.STK_KERNELS[name]
            ref_args = tuple(a.clone() if i == out_index else a for i, a in enumerate(args))
            with backends.use_backend("torch"):
                fn(*ref_args)
            start = time.perf_counter()
            with backends.use_backend("ascend"):
                fn(*args)
            elapsed = time.perf_counter() - start
            out, ref = args[out_index], ref_args[out_index]
            err = _rel(out, ref)
            ok = torch.equal(out, ref) if name == "row_indices" else err <= _TOL[dtype]
            verdict, judged = None, False
            if out.is_floating_point():
                fresh = tuple(a.clone() if i == out_index else a for i, a in enumerate(args))
                verdict, judged = _verdict(name, _out_of(backends._stk_implementation(name, "torch"), out_index), fresh,
                                           out, dtype, device)
                ok = ok and (verdict.ok or not judged)
            failures += not ok
            shape = tuple(args[{"sdd": 2, "dds": 1}.get(name, 0)])
            shape = f"{shape} B=128" + (" transposed" if name == "dsd" and args[8] else "")
            rows.append((name, shape, str(dtype)[6:], err, "ok" if ok else "FAIL", elapsed, verdict, judged))
    if verbose:
        limits = " / ".join(f"{precision.THRESHOLDS[m]:g}" for m in ("MARE", "MERE", "RMSE"))
        print(f"{'kernel':25} {'shape':28} {'dtype':9} {'rel.err':>9}  {'MARE':>7} {'MERE':>7} {'RMSE':>7} "
              f"verdict  status  seconds")
        for name, shape, dt, err, status, elapsed, *judgement in rows:
            verdict, judged = judgement if judgement else (None, False)
            ratios = " ".join(f"{verdict.ratios[m]:7.3g}" for m in ("MARE", "MERE", "RMSE")) if verdict else \
                f"{'-':>7} {'-':>7} {'-':>7}"
            said = "-" if verdict is None or not judged else "ok" if verdict.ok else "FAIL"
            print(f"{name:25} {shape:28} {dt:9} {err:9.2e}  {ratios} {said:7}  {status:6}  {elapsed:.3f}")
        print(f"selftest on {device}: {len(rows) - failures}/{len(rows)} passed (precision ratios: device error / "
              f"max(CPU error in the dtype, floor) against a CPU golden, limits MARE / MERE / RMSE {limits})")
    return 1 if failures else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="default: the NPU, else CUDA, else CPU")


def main(args: argparse.Namespace) -> int:
    from megablocks_ascend import devices  # noqa: PLC0415
    try:
        device = devices.requested(args.device) if args.device else default_device()
    except devices.DeviceUnavailable as e:
        raise SystemExit(f"selftest: {e}") from None
    return run(device)
