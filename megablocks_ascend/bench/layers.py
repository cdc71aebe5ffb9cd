"""MegaBlocks' layers as the harness builds them, and the backend that serves them.

:func:`build_layer` is the layer every step harness times and judges (the steps rows, their
precision verdicts, the expert-parallel steps); :func:`backend_env` runs a block under a
``MEGABLOCKS_BACKEND`` value, the variable and the backend switch together.
"""

from __future__ import annotations

import contextlib
import os

import torch

from megablocks_ascend import backends


def build_layer(c: dict, layer: str, dtype: torch.dtype, device: torch.device, mlp_impl: str = "grouped",
                mlp_type: str = "mlp"):
    """MegaBlocks' ``layer`` (``"dMoE"`` or ``"MoE"``, capacity factor 1, ``return_bias=False``) of the
    config ``c`` (H, ffn, E, k), parameters in ``dtype`` (bfloat16, float16 or float32) on ``device``."""
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE  # noqa: PLC0415
    args = Arguments(hidden_size=c["H"], ffn_hidden_size=c["ffn"], moe_num_experts=c["E"], moe_top_k=c["k"],
                     moe_capacity_factor=1, mlp_impl=mlp_impl, mlp_type=mlp_type, bf16=dtype == torch.bfloat16,
                     fp16=dtype == torch.float16, return_bias=False,
                     device=torch.cuda.current_device() if device.type == "cuda" else device)
    return {"dMoE": dMoE, "MoE": MoE}[layer](args)


@contextlib.contextmanager
def backend_env(name):
    """``MEGABLOCKS_BACKEND=name`` and ``use_backend(name)`` for the block."""
    old = os.environ.get("MEGABLOCKS_BACKEND")
    os.environ["MEGABLOCKS_BACKEND"] = name
    try:
        with backends.use_backend(name):
            yield
    finally:
        if old is None:
            os.environ.pop("MEGABLOCKS_BACKEND", None)
        else:
            os.environ["MEGABLOCKS_BACKEND"] = old
