"""Try MegaBlocks 0.10.0's documented ``Arguments`` options one at a time on CPU, through the plugin.

For each option value and each layer (``MoE``; ``dMoE`` with ``mlp_impl`` grouped and sparse;
``mlp_type`` mlp and glu) it builds the layer, runs a forward and a backward (the output and, when
returned, the bias; the load-balancing loss when it is on) and reports what failed and how.
Results: docs/notes/arguments-survey.md.

    python docs/notes/repro/arguments_survey.py [--only SUBSTRING] [--uninstalled-fixes]

``--uninstalled-fixes`` takes back the patches that fix MegaBlocks' crashes (``FIXES``) before it
runs, to show what upstream does without them.
"""

from __future__ import annotations

import argparse
import functools
import traceback

import torch
import torch.nn.functional as F

import megablocks_ascend
from megablocks.layers.arguments import Arguments
from megablocks.layers.dmoe import dMoE
from megablocks.layers.moe import MoE, batched_load_balancing_loss, clear_load_balancing_loss
from megablocks_ascend import patching

BASE = dict(hidden_size=16, ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2, fp16=False, bf16=False)

# option -> values to try (documented in arguments.py's comments, or its type's natural values)
OPTIONS = {
    "bias": [False],
    "return_bias": [False],
    "activation_fn": [F.relu, F.silu, functools.partial(F.gelu, approximate="none")],
    "moe_top_k": [1, 4],
    "moe_num_experts+top_k": [1],  # moe_num_experts=1 with moe_top_k=1: Arguments' own defaults
    "moe_capacity_factor": [0, 2, 1.5],
    "moe_normalize_expert_weights": [1, 2, 1.0, float("inf")],
    "moe_loss_weight": [0.0],
    "moe_jitter_eps": [0.01],
    "moe_lbl_in_fp32": [True],
    "moe_zloss_weight": [1e-3],
    "moe_zloss_in_fp32": [True],
    "uniform_expert_assignment": [True],
    "memory_optimized_mlp": [True],
    "memory_optimized_mlp+activation_fn": [F.relu],
    "memory_optimized_mlp+bf16": [True],
    "fp16": [True],
    "bf16": [True],
    "init_method": [functools.partial(torch.nn.init.uniform_, a=-0.05, b=0.05)],
    "output_layer_init_method": [functools.partial(torch.nn.init.zeros_)],
    "num_layers": [2],
    "pipeline_model_parallel_size+num_layers": [2],  # 2 stages of 1 layer each
    "num_layers_per_virtual_pipeline_stage": [1],
    "shared_expert": [True],
    "shared_expert+weighted_sum": [True],
    "shared_expert+hidden_size": [8],
    "shared_expert+remat_act_fn": [False],
    "shared_expert+return_bias": [False],
    "shared_expert+bias": [False],
    "device": [torch.device("cpu")],
}

LAYERS = [("MoE", MoE, "sparse"), ("dMoE-grouped", dMoE, "grouped"), ("dMoE-sparse", dMoE, "sparse")]


def arguments_for(option, value, mlp_type, impl):
    kwargs = dict(BASE, mlp_type=mlp_type, mlp_impl=impl)
    if option.startswith("shared_expert+"):
        kwargs["shared_expert"] = True
        extra = option.split("+")[1]
        kwargs[{"weighted_sum": "shared_expert_weighted_sum", "hidden_size": "shared_expert_hidden_size",
                "remat_act_fn": "remat_act_fn", "return_bias": "return_bias", "bias": "bias"}[extra]] = value
    elif option == "moe_num_experts+top_k":
        kwargs["moe_num_experts"] = kwargs["moe_top_k"] = value
    elif option.startswith("memory_optimized_mlp+"):
        kwargs["memory_optimized_mlp"] = True
        extra = option.split("+")[1]
        kwargs[extra] = value
        if extra == "bf16":
            kwargs["fp16"] = False
    elif option == "pipeline_model_parallel_size+num_layers":
        kwargs["pipeline_model_parallel_size"] = kwargs["num_layers"] = value
    else:
        kwargs[option] = value
    if option == "fp16":
        kwargs["bf16"] = False
    if option == "bf16":
        kwargs["fp16"] = False
    return Arguments(**kwargs)


def step(layer_cls, args):
    clear_load_balancing_loss()
    layer = layer_cls(args)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    x = torch.randn(4, 3, args.hidden_size, dtype=dtype, requires_grad=True)
    out = layer(x)
    out, bias = out if isinstance(out, tuple) else (out, None)
    loss = out.float().square().sum() + (bias.float().sum() if bias is not None else 0)
    try:
        if args.moe_loss_weight > 0:
            loss = loss + batched_load_balancing_loss(args)
        loss.backward()
    finally:
        clear_load_balancing_loss()
    assert torch.isfinite(out).all(), "non-finite output"
    assert x.grad is not None and torch.isfinite(x.grad).all(), "no or non-finite input gradient"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only")
    parser.add_argument("--uninstalled-fixes", action="store_true")
    cli = parser.parse_args()
    if cli.uninstalled_fixes:
        for patch in patching.PATCHES:
            if patch.name in FIXES:
                patch.revert()
    failures = 0
    print(f"{'option':34} {'value':22} {'layer':13} {'mlp':4} result")
    for option, values in OPTIONS.items():
        if cli.only and cli.only not in option:
            continue
        for value in values:
            for name, layer_cls, impl in LAYERS:
                for mlp_type in ("mlp", "glu"):
                    torch.manual_seed(0)
                    try:
                        step(layer_cls, arguments_for(option, value, mlp_type, impl))
                        result = "ok"
                    except Exception as e:  # noqa: BLE001 - the survey reports every failure
                        failures += 1
                        where = traceback.extract_tb(e.__traceback__)[-1]
                        result = f"{type(e).__name__}: {str(e).splitlines()[0][:90]} " \
                                 f"[{where.filename.split('site-packages/')[-1]}:{where.lineno}]"
                    shown = getattr(value, "__name__", None) or repr(value)[:22]
                    print(f"{option:34} {shown:22} {name:13} {mlp_type:4} {result}", flush=True)
    print(f"\n{failures} failures (backend {megablocks_ascend.requested()}, torch {torch.__version__})")
    return 0


# The patches that fix a crash seen here: shared-expert-bias; grouped-mlp-device-sizes replaces the
# grouped dMoE's memory-optimized MLP by one that does not reuse the activation's buffer.
FIXES = ("shared-expert-bias", "grouped-mlp-device-sizes")

if __name__ == "__main__":
    raise SystemExit(main())
