"""What the value checks behind ``MEGABLOCKS_ASCEND_CHECKS=1`` cost (``benchmarks/bench_checks.py``).

Each routing kernel function is called through the dispatcher (``backends.KERNELS``) at a
mixtral-like routing (``tokens`` tokens, ``experts`` experts, ``top_k``), with the checks off and
on, and timed by :func:`~megablocks_ascend.bench.timing.wall_ms` (each call followed by a
synchronization: the checks' device-to-host read makes the caller wait, so that is the cost
compared). The added time per call is the difference.
"""

from __future__ import annotations

import os

import torch

from megablocks_ascend import backends
from megablocks_ascend.bench import timing

OPS = ("binned_gather", "gather", "scatter")


def calls(device: torch.device, tokens: int, hidden: int, experts: int, top_k: int) -> dict:
    """``{op: call}``: each of :data:`OPS` on one routing of random expert choices (bfloat16 data on
    an accelerator, float32 on the CPU)."""
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    t, e, k, h = tokens, experts, top_k, hidden
    top = torch.randint(0, e, (t * k,), dtype=torch.int32, device=device)
    bin_ids, indices = torch.sort(top, stable=True)
    bins = torch.cumsum(torch.bincount(top, minlength=e), 0).int()
    x = torch.randn(t, h, device=device, dtype=dtype)
    rows = torch.randn(t * k, h, device=device, dtype=dtype)
    w = torch.rand(t * k, device=device, dtype=dtype)
    return {
        "binned_gather": lambda: backends.KERNELS["binned_gather"](x, indices.int(), w, bins, t * k // e, k),
        "gather": lambda: backends.KERNELS["gather"](x, indices.int(), bin_ids.int(), w, bins, k),
        "scatter": lambda: backends.KERNELS["scatter"](rows, indices.int(), bin_ids.int(), w, bins, k),
    }


def measure(device: torch.device, backend: str, *, tokens: int, hidden: int, experts: int, top_k: int,
            repeat: int) -> list[dict]:
    """One row per op: its median ms with the checks off and on, and the difference, under the
    ``MEGABLOCKS_BACKEND`` value ``backend``."""
    rows = []
    with backends.use_backend(backend):
        for name, fn in calls(device, tokens, hidden, experts, top_k).items():
            os.environ["MEGABLOCKS_ASCEND_CHECKS"] = "0"
            off = timing.wall_ms(fn, device, repeat)
            os.environ["MEGABLOCKS_ASCEND_CHECKS"] = "1"
            on = timing.wall_ms(fn, device, repeat)
            rows.append(dict(op=name, device=str(device), backend=backend, tokens=tokens, hidden=hidden,
                             experts=experts, top_k=top_k, ms_checks_off=off, ms_checks_on=on, added_ms=on - off))
    os.environ.pop("MEGABLOCKS_ASCEND_CHECKS", None)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'op':16} {'device':8} {'backend':8} {'checks off ms':>14} {'checks on ms':>13} {'added ms':>9}"]
    lines += [f"{r['op']:16} {r['device']:8} {r['backend']:8} {r['ms_checks_off']:14.3f} "
              f"{r['ms_checks_on']:13.3f} {r['added_ms']:9.3f}" for r in rows]
    return "\n".join(lines)
