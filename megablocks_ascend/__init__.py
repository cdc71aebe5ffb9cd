"""megablocks-ascend: MegaBlocks' MoE layers on Ascend NPUs, through Triton kernels.

``import megablocks_ascend`` before building a MegaBlocks layer. On import it:

1. imports ``torch_npu`` when it is installed (it registers the ``npu`` device with torch; an
   installed but broken torch_npu raises here rather than leaving MegaBlocks on the CPU);
   switches the Triton interpreter on when this machine has neither CUDA nor an NPU and
   ``triton`` has not been imported yet (on such a machine it is the only way Triton runs);
2. installs the patches in :mod:`megablocks_ascend.patching` (stand-ins for MegaBlocks' CUDA
   extension and for grouped_gemm, device-neutral defaults, the routing ops and stk's
   block-sparse matmuls dispatched by ``MEGABLOCKS_BACKEND``, and MegaBlocks' refusal of
   ``mlp_impl="sparse"`` lifted while those matmuls are ours), when MegaBlocks is installed.

See README.md for the backends, the environment variables and what runs where.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__version__ = "0.1.0"


_HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
if _HAS_TORCH_NPU:
    import torch_npu  # noqa: F401,E402  (registers torch.npu and the "npu" device)


def _no_accelerator() -> bool:
    import torch  # noqa: PLC0415
    return not _HAS_TORCH_NPU and not torch.cuda.is_available()


if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and _no_accelerator():
    os.environ["TRITON_INTERPRET"] = "1"

from megablocks_ascend.backends import (  # noqa: E402
    BACKENDS,
    BackendUnavailable,
    last_backend,
    requested,
    resolve,
    trace,
    use_backend,
)
from megablocks_ascend.patching import PatchError, install, installed, uninstall  # noqa: E402
from megablocks_ascend.validation import BlockSparseArgumentError, RoutingArgumentError  # noqa: E402

if importlib.util.find_spec("megablocks") is not None:
    install()

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "BlockSparseArgumentError",
    "PatchError",
    "RoutingArgumentError",
    "install",
    "installed",
    "last_backend",
    "requested",
    "resolve",
    "trace",
    "uninstall",
    "use_backend",
]
