"""Where the host time of an eager MegaBlocks training step goes, per routing backend (cProfile).

A host-bound step (many small experts) is paced by the Python that enqueues it.
:func:`profile_backends` profiles ``steps`` eager forward+backward steps of one layer under
``cProfile`` for each backend and returns, per backend, the host time per step and the functions
with the most own time, so two backends' host paths can be compared call by call
(``benchmarks/profile_host.py`` is its command line). The layer is one of the step harness's
configs (:data:`~megablocks_ascend.bench.steps.CONFIGS`, or ``tiny`` for a smoke test), built as
MegaBlocks' defaults have it (output bias returned, no load-balancing loss).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from megablocks_ascend import backends
from megablocks_ascend.bench import steps, timing

CONFIGS = dict(steps.CONFIGS, tiny=steps.QUICK_CONFIGS["tiny"])


def build(config: str, layer_name: str, device: torch.device, dtype: torch.dtype):
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE  # noqa: PLC0415
    c = CONFIGS[config]
    args = Arguments(hidden_size=c["H"], ffn_hidden_size=c["ffn"], moe_num_experts=c["E"], moe_top_k=c["k"],
                     mlp_impl="grouped", bf16=dtype == torch.bfloat16, fp16=False, device=device,
                     moe_loss_weight=0.0)
    return (dMoE if layer_name == "dMoE" else MoE)(args)


def profile(layer, x, n_steps: int, device: torch.device, top: int):
    """``(host ms per step, the ``top`` functions by own time, pstats' text)`` of ``n_steps`` eager
    steps under cProfile, after three unprofiled ones."""
    from megablocks.layers.moe import clear_load_balancing_loss  # noqa: PLC0415

    def step():
        out, bias = layer(x)
        (out.float().square().mean() + bias.float().sum()).backward()
        layer.zero_grad(set_to_none=True)
        clear_load_balancing_loss()

    for _ in range(3):
        step()
    timing.synchronize(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n_steps):
        step()
    prof.disable()
    host = (time.perf_counter() - t0) / n_steps * 1e3
    timing.synchronize(device)
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(top)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append(dict(function=f"{Path(file).name}:{line}:{fn}", calls_per_step=nc / n_steps,
                         own_us_per_step=tt / n_steps * 1e6, cum_us_per_step=ct / n_steps * 1e6))
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return host, rows[:top], s.getvalue()


def profile_backends(config: str, layer_name: str, device: torch.device, *, tokens: int, n_steps: int,
                     top: int) -> tuple[dict, list[str]]:
    """``(results, lines)``: per backend (upstream's kernels and ours on CUDA, the torch backend and
    ours elsewhere) the host ms per step and the top functions, and the tables as text lines."""
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    names = ("cuda", "ascend") if device.type == "cuda" else ("torch", "ascend")
    torch.manual_seed(0)
    layer = build(config, layer_name, device, dtype)
    x = torch.randn(tokens, 1, CONFIGS[config]["H"], device=device, dtype=dtype)
    results, lines = {}, []
    for backend in names:
        with backends.use_backend(backend):
            host, rows, _ = profile(layer, x, n_steps, device, top)
        results[backend] = dict(host_ms_per_step=host, top=rows)
        lines.append(f"== {backend}: {host:.3f} ms of host time per step (under cProfile)")
        lines.append(f"{'own us/step':>12} {'cum us/step':>12} {'calls/step':>10}  function")
        lines += [f"{r['own_us_per_step']:12.1f} {r['cum_us_per_step']:12.1f} {r['calls_per_step']:10.1f}  "
                  f"{r['function']}" for r in rows]
    return results, lines
