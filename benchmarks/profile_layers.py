"""Where a MegaBlocks MoE / dMoE forward+backward step spends its time, per routing backend.

For each variant (upstream ``cuda``; ours ``ascend``; ours with the buffer-row-major gather forced
for every top_k, ``ascend-rowmajor``) it reports the wall time per step, the host time to enqueue
one step, and the device time of the step's kernels from ``torch.profiler`` (sum, and the largest
kernels). Wall >> device sum means the step is host-bound. GPU only.

    python benchmarks/profile_layers.py --ffn 1792
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import megablocks_ascend  # noqa: F401
from megablocks_ascend.bench.report import default_out  # noqa: E402
import torch

from megablocks_ascend import backends
from megablocks_ascend.kernels import routing


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ffn", type=int, default=1792)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    args = ap.parse_args()

    from megablocks.layers import moe as moe_mod  # noqa: PLC0415
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE  # noqa: PLC0415

    original = routing._gather_any

    def rowmajor(*a, **kw):
        return routing.gather_rows(*a, **kw)

    report = []
    for cls in (MoE, dMoE):
        for variant in ("cuda", "ascend", "ascend-rowmajor"):
            backend = "cuda" if variant == "cuda" else "ascend"
            os.environ["MEGABLOCKS_BACKEND"] = backend
            routing._gather_any = rowmajor if variant == "ascend-rowmajor" else original
            torch.manual_seed(0)
            a = Arguments(hidden_size=4096, ffn_hidden_size=args.ffn, moe_num_experts=8, moe_top_k=2,
                          moe_capacity_factor=1, mlp_impl="grouped", bf16=True, fp16=False, return_bias=False,
                          device=torch.cuda.current_device())
            layer = cls(a)
            x = torch.randn(args.tokens, 1, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn_like(x)
            params = [x] + list(layer.parameters())

            def step():
                for p in params:
                    p.grad = None
                layer(x).backward(g)
                moe_mod.clear_load_balancing_loss()

            with backends.use_backend(backend):
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                t_host = (time.perf_counter() - t0) / args.steps * 1e3
                torch.cuda.synchronize()
                t_wall = (time.perf_counter() - t0) / args.steps * 1e3
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        step()
                    torch.cuda.synchronize()
            kernels = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
                    kernels[e.name] = kernels.get(e.name, 0.0) + us / 3 / 1e3  # ms per step
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
            row = dict(layer=cls.__name__, variant=variant, ffn=args.ffn, wall_ms=t_wall, host_enqueue_ms=t_host,
                       device_ms=sum(kernels.values()), top=[(k[:70], round(v, 4)) for k, v in top])
            print(f"{cls.__name__:5s} {variant:16s} wall {t_wall:7.3f} ms  host-enqueue {t_host:7.3f} ms  "
                  f"device {row['device_ms']:7.3f} ms", flush=True)
            for k, v in row["top"]:
                print(f"      {v:8.4f} ms  {k}")
            report.append(row)
            del layer, x, g, params
            torch.cuda.empty_cache()
    routing._gather_any = original
    Path(args.out, "profile_layers.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
