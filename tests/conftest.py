"""Shared test set-up.

Tests run on CPU: our Triton kernels and upstream MegaBlocks' Triton kernels both run in the
Triton interpreter, which must be on before ``triton`` is imported.

Tests that take the ``device`` fixture can also run on an accelerator:
``MEGABLOCKS_ASCEND_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest tests/test_x.py`` runs
them on CUDA tensors, with compiled Triton instead of the interpreter; the tests that do not take
the fixture need the interpreter and are deselected there (and counted in the summary). The default
is ``cpu``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
TEST_DEVICE_VAR = "MEGABLOCKS_ASCEND_TEST_DEVICE"

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


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Each test plans its launches anew: a plan is derived from the device tables, which tests may
    monkeypatch (``kernels.routing.clear_plans``)."""
    from megablocks_ascend.kernels import routing  # noqa: PLC0415
    routing.clear_plans()


def pytest_collection_modifyitems(config, items):
    """On an accelerator (``MEGABLOCKS_ASCEND_TEST_DEVICE`` not cpu) keep only the tests that take
    the ``device`` fixture: the others run CPU tensors through the interpreter, which is off there."""
    if (os.environ.get(TEST_DEVICE_VAR, "cpu").strip() or "cpu") == "cpu":
        return
    keep = [item for item in items if "device" in getattr(item, "fixturenames", ())]
    dropped = [item for item in items if "device" not in getattr(item, "fixturenames", ())]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the device-generic tests run on (``MEGABLOCKS_ASCEND_TEST_DEVICE``, default cpu)."""
    name = os.environ.get(TEST_DEVICE_VAR, "cpu").strip() or "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.exit(f"{TEST_DEVICE_VAR}={name}, but torch sees no CUDA device", returncode=2)
    if dev.type == "npu" and not (hasattr(torch, "npu") and torch.npu.is_available()):
        pytest.exit(f"{TEST_DEVICE_VAR}={name}, but torch sees no NPU", returncode=2)
    return dev


POISON = -123456789  # fits int32; never a valid index, id or count in these tests


class _PoisonedTorch:
    """``torch`` as a launcher module sees it, except that ``empty`` returns poisoned memory: NaN
    for floating dtypes, ``POISON`` for integers (-999 for int16), so an element a kernel forgets
    to write shows up instead of reading as a plausible zero."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(-999 if t.dtype == torch.int16 else POISON)


@pytest.fixture
def poison_empty(monkeypatch):
    """``poison_empty(module)``: ``module``'s ``torch.empty`` returns poisoned memory for this test."""
    return lambda module: monkeypatch.setattr(module, "torch", _PoisonedTorch())
