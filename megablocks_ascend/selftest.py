"""``python -m megablocks_ascend selftest``: our kernels against the ``torch`` backend, on this device.

The check a user with an NPU runs first: every routing kernel function of every layout
(binned, dropless, padded), forward and weight-gradient, in fp32/fp16/bf16, on shapes that cross
expert boundaries inside sub-blocks, drop tokens and leave padding, compared with the pure-PyTorch
backend on the same device. Gathers must match exactly; scatters and weight gradients within a
tolerance derived from the dtype.
"""

from __future__ import annotations

import argparse
import time

import torch

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


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(device: torch.device, dtypes=(torch.float32, torch.float16, torch.bfloat16), verbose=True) -> int:
    from megablocks_ascend import backends  # noqa: PLC0415
    gen = torch.Generator().manual_seed(0)
    failures = 0
    rows = []
    for tokens, hidden, experts, top_k, cf in _SHAPES:
        indices, bin_ids, bins, padded, w = _routing(tokens, experts, top_k, device, gen)
        cap = max(int(cf * tokens * top_k / experts), 1)
        n = tokens * top_k
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
                failures += not ok
                rows.append((name, f"T={tokens} H={hidden} E={experts} k={top_k}", str(dtype)[6:], err,
                             "ok" if ok else "FAIL", elapsed))
    if verbose:
        print(f"{'kernel':22} {'shape':28} {'dtype':9} {'rel.err':>9}  status  seconds")
        for name, shape, dt, err, status, elapsed in rows:
            print(f"{name:22} {shape:28} {dt:9} {err:9.2e}  {status:6}  {elapsed:.3f}")
        print(f"selftest on {device}: {len(rows) - failures}/{len(rows)} passed")
    return 1 if failures else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="default: the NPU, else CUDA, else CPU")


def main(args: argparse.Namespace) -> int:
    return run(torch.device(args.device) if args.device else default_device())
