"""Cost of the value checks behind MEGABLOCKS_ASCEND_CHECKS=1 (one device-to-host sync per call).

Times each routing kernel function through the dispatcher with the checks off and on, at a
mixtral-like routing (T tokens, E experts, top_k), and prints the added time per call.

    python benchmarks/bench_checks.py [--device cuda] [--backend ascend] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import megablocks_ascend
from megablocks_ascend import backends


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, repeat):
    for _ in range(3):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="torch")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    try:
        device = megablocks_ascend.devices.requested(a.device)
    except megablocks_ascend.devices.DeviceUnavailable as e:
        p.error(str(e))
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    t, e, k, h = a.tokens, a.experts, a.top_k, a.hidden
    top = torch.randint(0, e, (t * k,), dtype=torch.int32, device=device)
    bin_ids, indices = torch.sort(top, stable=True)
    bins = torch.cumsum(torch.bincount(top, minlength=e), 0).int()
    x = torch.randn(t, h, device=device, dtype=dtype)
    rows = torch.randn(t * k, h, device=device, dtype=dtype)
    w = torch.rand(t * k, device=device, dtype=dtype)
    calls = {
        "binned_gather": lambda: backends.KERNELS["binned_gather"](x, indices.int(), w, bins, t * k // e, k),
        "gather": lambda: backends.KERNELS["gather"](x, indices.int(), bin_ids.int(), w, bins, k),
        "scatter": lambda: backends.KERNELS["scatter"](rows, indices.int(), bin_ids.int(), w, bins, k),
    }
    results = []
    with megablocks_ascend.use_backend(a.backend):
        for name, fn in calls.items():
            os.environ["MEGABLOCKS_ASCEND_CHECKS"] = "0"
            off = _time(fn, device, a.repeat)
            os.environ["MEGABLOCKS_ASCEND_CHECKS"] = "1"
            on = _time(fn, device, a.repeat)
            results.append(dict(op=name, device=str(device), backend=a.backend, tokens=t, hidden=h,
                                experts=e, top_k=k, ms_checks_off=off, ms_checks_on=on, added_ms=on - off))
    os.environ.pop("MEGABLOCKS_ASCEND_CHECKS", None)
    print(f"{'op':16} {'device':8} {'backend':8} {'checks off ms':>14} {'checks on ms':>13} {'added ms':>9}")
    for r in results:
        print(f"{r['op']:16} {r['device']:8} {r['backend']:8} {r['ms_checks_off']:14.3f} "
              f"{r['ms_checks_on']:13.3f} {r['added_ms']:9.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
