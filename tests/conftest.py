"""Shared test set-up.

Tests run on CPU: our Triton kernels and upstream MegaBlocks' Triton kernels both run in the
Triton interpreter, which must be on before ``triton`` is imported.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import megablocks_ascend  # noqa: E402,F401  (installs the patches)
from megablocks_ascend import backends  # noqa: E402


@pytest.fixture(scope="session")
def upstream_kernels():
    """Upstream MegaBlocks' own kernel functions (``megablocks.backend.kernels`` as shipped).

    Their Triton kernels are autotuned over five configs, which the interpreter cannot
    benchmark; each is narrowed to its first config here (the config changes speed, not results).
    """
    import megablocks.backend.kernels as k  # noqa: PLC0415
    for autotuned in (k._padded_copy, k._padded_copy_wgrad, k._binned_copy, k._binned_copy_wgrad):
        autotuned.configs = autotuned.configs[:1]
    return {name: backends._upstream(name) for name in backends.SPECS}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
