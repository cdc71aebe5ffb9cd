"""Where the host time of an eager MegaBlocks training step goes, per routing backend (cProfile).

A host-bound step (many small experts) is paced by the Python that enqueues it. This profiles
``--steps`` eager forward+backward steps of one layer under ``cProfile`` for each backend and
prints, per backend, the host time per step and the functions with the most own time, so two
backends' host paths can be compared call by call. The step is the same as ``bench_steps.py``'s
(``config``: one of its configs).

    python benchmarks/profile_host.py --config qw128 --out DIR      # a GPU
    python benchmarks/profile_host.py --quick --out DIR             # CPU smoke test (tiny layer)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks and triton)
from megablocks_ascend.bench.report import default_out  # noqa: E402
import torch


CONFIGS = {  # as in bench_steps.py
    "ds64": dict(hidden=2048, ffn=1408, experts=64, top_k=6),
    "qw128": dict(hidden=2048, ffn=768, experts=128, top_k=8),
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2),
    "small": dict(hidden=4096, ffn=1792, experts=8, top_k=2),
    "tiny": dict(hidden=32, ffn=64, experts=4, top_k=2),
}


def build(config, layer_name, device, dtype):
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE  # noqa: PLC0415
    c = CONFIGS[config]
    args = Arguments(hidden_size=c["hidden"], ffn_hidden_size=c["ffn"], moe_num_experts=c["experts"],
                     moe_top_k=c["top_k"], mlp_impl="grouped", bf16=dtype == torch.bfloat16, fp16=False,
                     device=device, moe_loss_weight=0.0)
    return (dMoE if layer_name == "dMoE" else MoE)(args)


def profile(layer, x, steps, device, top):
    from megablocks.layers.moe import clear_load_balancing_loss  # noqa: PLC0415

    def step():
        out, bias = layer(x)
        (out.float().square().mean() + bias.float().sum()).backward()
        layer.zero_grad(set_to_none=True)
        clear_load_balancing_loss()

    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    host = (time.perf_counter() - t0) / steps * 1e3
    sync()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(top)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append(dict(function=f"{Path(file).name}:{line}:{fn}", calls_per_step=nc / steps,
                         own_us_per_step=tt / steps * 1e6, cum_us_per_step=ct / steps * 1e6))
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return host, rows[:top], s.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qw128", choices=sorted(CONFIGS))
    ap.add_argument("--layer", default="dMoE", choices=("dMoE", "MoE"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--quick", action="store_true", help="tiny layer on the CPU (smoke test)")
    ap.add_argument("--out", default=default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default="profile_host")
    a = ap.parse_args()
    if a.quick:
        a.config, a.tokens, a.steps, a.top = "tiny", 16, 2, 10
    device = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = ("cuda", "ascend") if device.type == "cuda" else ("torch", "ascend")
    torch.manual_seed(0)
    layer = build(a.config, a.layer, device, dtype)
    x = torch.randn(a.tokens, 1, CONFIGS[a.config]["hidden"], device=device, dtype=dtype)
    report = dict(environment=dict(torch=torch.__version__, device=str(device), config=a.config, layer=a.layer,
                                   tokens=a.tokens, steps=a.steps), results={})
    lines = []
    for backend in backends:
        with megablocks_ascend.use_backend(backend):
            host, rows, text = profile(layer, x, a.steps, device, a.top)
        report["results"][backend] = dict(host_ms_per_step=host, top=rows)
        lines.append(f"== {backend}: {host:.3f} ms of host time per step (under cProfile)")
        lines.append(f"{'own us/step':>12} {'cum us/step':>12} {'calls/step':>10}  function")
        lines += [f"{r['own_us_per_step']:12.1f} {r['cum_us_per_step']:12.1f} {r['calls_per_step']:10.1f}  "
                  f"{r['function']}" for r in rows]
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{a.name}.json").write_text(json.dumps(report, indent=1))
    (out_dir / f"{a.name}.log").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
