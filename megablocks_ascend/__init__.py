"""megablocks-ascend: MegaBlocks' MoE layers on Ascend NPUs, through Triton kernels.

Installed, the plugin activates itself: torch's ``torch.backends`` entry point puts an import hook
in place at ``import torch``, and the hook imports this package just before the first module of
MegaBlocks or stk executes, whatever the program imported first (``MEGABLOCKS_ASCEND_AUTOLOAD=0``
turns that off; then ``import megablocks_ascend`` before MegaBlocks). Either way, on import it:

1. imports ``torch_npu`` when it is installed (it registers the ``npu`` device with torch; an
   installed but broken torch_npu raises here rather than leaving MegaBlocks on the CPU);
   switches the Triton interpreter on when this machine has neither CUDA nor an NPU and
   ``triton`` has not been imported yet (on such a machine it is the only way Triton runs);
2. installs the patches in :mod:`megablocks_ascend.patching` (stand-ins for MegaBlocks' CUDA
   extension and for grouped_gemm, device-neutral defaults, the routing ops and stk's
   block-sparse matmuls dispatched by ``MEGABLOCKS_BACKEND``, and MegaBlocks' refusal of
   ``mlp_impl="sparse"`` lifted while those matmuls are ours), when MegaBlocks is installed
   (those that need MegaBlocks itself once it has finished importing, when it is importing).

See README.md for the backends, the environment variables and what runs where, and
:mod:`megablocks_ascend.plugin_activation` for the activation.
"""

from __future__ import annotations

__version__ = "0.1.0"

from megablocks_ascend import plugin_activation  # noqa: E402

try:
    plugin_activation.prepare()

    from megablocks_ascend.backends import (  # noqa: E402
        BACKENDS,
        BackendUnavailable,
        CaptureError,
        last_backend,
        requested,
        resolve,
        trace,
        use_backend,
    )
    from megablocks_ascend.patching import PatchError, install, installed, uninstall  # noqa: E402
    from megablocks_ascend.validation import BlockSparseArgumentError, RoutingArgumentError  # noqa: E402

    plugin_activation.install_patches()
except Exception as _exc:
    if not plugin_activation.doctor_invocation():
        raise
    # `python -m megablocks_ascend doctor`: the package is imported before its __main__ runs;
    # doctor reports the failure (and what to do) instead of a traceback.
    plugin_activation.hook.fail("activation (python -m megablocks_ascend doctor)", _exc)
    del _exc

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "BlockSparseArgumentError",
    "CaptureError",
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
