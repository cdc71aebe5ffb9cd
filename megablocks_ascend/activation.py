"""How megablocks-ascend is switched on in a process, and the record of it (``doctor`` prints it).

Two routes lead to ``megablocks_ascend/__init__``, which calls :func:`prepare` and then
:func:`install_patches`:

* the autoload (the default once the package is installed): torch's ``torch.backends`` entry
  point puts an import hook in place at ``import torch`` (``_megablocks_ascend_autoload``, outside
  this package so that torch can load it without activating anything), and the hook imports
  ``megablocks_ascend`` just before the first module of MegaBlocks or stk executes;
* ``import megablocks_ascend`` (the only route with ``MEGABLOCKS_ASCEND_AUTOLOAD=0``, or with
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, or with the package on ``PYTHONPATH`` but not installed).

When the hook fires, MegaBlocks (or stk) is part-way through its own import: ``import megablocks``
was the program's first line, say, and torch was imported by stk, which MegaBlocks was importing.
The patches to MegaBlocks' layers cannot be applied to modules that have not finished executing,
so :func:`install_patches` applies at once only the patches MegaBlocks and stk need while they
import (the stand-ins for ``megablocks_ops`` and ``grouped_gemm``, the Triton fixes:
``patching.install_before_import``), and the rest when the outermost of them has finished
importing. If that fails, every patch is taken back and the import of MegaBlocks fails with the
reason, each time it is tried: the plugin never leaves MegaBlocks half-patched.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

try:
    import _megablocks_ascend_autoload as hook
except ModuleNotFoundError as e:  # an editable install made before the hook module existed
    raise ImportError("megablocks_ascend needs its import hook module _megablocks_ascend_autoload, which "
                      "this installation does not provide: reinstall the package (tools/bootstrap.sh, or "
                      "pip install --no-deps --no-build-isolation -e .)") from e

record = hook.record
events = hook.events

_prepared = False


def prepare() -> None:
    """What must happen before megablocks-ascend, MegaBlocks or stk import ``triton``:

    1. import ``torch_npu`` when it is installed: it registers the ``npu`` device with torch (an
       installed but broken torch_npu raises here rather than leaving MegaBlocks on the CPU);
    2. switch the Triton interpreter on (``TRITON_INTERPRET=1``) when this machine has neither CUDA
       nor torch_npu and ``triton`` has not been imported yet: there it is the only way Triton
       kernels run. Only programs that import megablocks-ascend, MegaBlocks or stk get here: the
       autoload hook never sets it for a program that merely imports torch (or triton), where
       Triton's compiler may be in use without a device (ahead-of-time compilation, the lowering
       gate) and the interpreter would change what every ``triton.jit`` means.
    """
    global _prepared
    if _prepared:
        return
    if not any(e.startswith("activated by") for e in hook.events()):
        record("activated by `import megablocks_ascend`")
    has_npu = importlib.util.find_spec("torch_npu") is not None
    if has_npu:
        import torch_npu  # noqa: F401,PLC0415  (registers torch.npu and the "npu" device)
        record("torch_npu imported (the npu device is registered)")
    if "TRITON_INTERPRET" in os.environ:
        record(f"Triton interpreter left as found: TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} was set")
    elif "triton" in sys.modules:
        record("Triton interpreter left as found: triton was imported before megablocks-ascend")
    elif has_npu or _cuda_available():
        record("Triton compiles (a CUDA device or torch_npu is present)")
    else:
        os.environ["TRITON_INTERPRET"] = "1"
        record("TRITON_INTERPRET=1 set: no CUDA device and no torch_npu, so Triton runs kernels in its interpreter")
    _prepared = True


def _cuda_available() -> bool:
    import torch  # noqa: PLC0415
    return torch.cuda.is_available()


def install_patches() -> None:
    """Install every patch now, or, while MegaBlocks or stk is part-way through its import, the
    patches they need while importing now and the rest once they have finished (module docstring)."""
    from megablocks_ascend import patching  # noqa: PLC0415

    if importlib.util.find_spec("megablocks") is None:
        record("MegaBlocks is not installed: nothing patched")
        _done()
        return
    busy = _importing()
    if not busy:  # (a top-level package about to execute counts as importing: see _importing)
        patching.install()
        record("patches installed")
        _done()
        return
    patching.install_before_import()
    record(f"patches MegaBlocks and stk need while importing installed; the rest deferred until "
           f"{' and '.join(busy)} finished importing")
    for spec in busy.values():
        hook.watch(spec, on_end=_finished)
    # Stay on sys.meta_path until then: should the import fail and be tried again, the new
    # attempt's modules get the same treatment.
    hook.FINDER.before = _before_import
    hook.FINDER.after = _finished
    if hook.FINDER not in sys.meta_path:
        sys.meta_path.insert(0, hook.FINDER)


def _importing() -> dict:
    """The specs of ``megablocks`` and ``stk`` while they import, by name: executing now, or about
    to (the hook activates the plugin just before a module executes, which may be ``megablocks``
    itself: applying every patch then would import MegaBlocks a second time, inside its own import)."""
    busy = {name: sys.modules[name].__spec__ for name in hook.WATCHED if hook.executing(name)}
    spec = hook.starting()
    if spec is not None and spec.name in hook.WATCHED:
        busy[spec.name] = spec
    return busy


def _before_import(name: str) -> None:
    from megablocks_ascend import patching  # noqa: PLC0415
    patching.install_before_import()  # a no-op unless a failed attempt took the patches back


def _finished(name: str, succeeded: bool) -> None:
    from megablocks_ascend import patching  # noqa: PLC0415
    if _importing():
        return  # an outer import (MegaBlocks around stk) is still running
    if not succeeded:
        record(f"{name} failed to import; the remaining patches wait for the next attempt")
        return
    hook.FINDER.before = hook.FINDER.after = None  # install() imports MegaBlocks: not again from here
    try:
        patching.install()
    except BaseException as exc:
        # install() took every patch back. The next attempt to import `name` gets the same
        # treatment, and fails the same way, rather than finding it half-patched in sys.modules.
        sys.modules.pop(name, None)
        hook.FINDER.before, hook.FINDER.after = _before_import, _finished
        record(f"patches could not be installed after {name} imported ({type(exc).__name__}); "
               f"every patch taken back and the import of {name} failed")
        raise ImportError(
            f"megablocks-ascend could not patch {name} ({type(exc).__name__}: {exc}); nothing is patched and "
            f"`import {name}` fails until this is fixed. To use {name} without megablocks-ascend, set "
            f"{hook.AUTOLOAD_VAR}=0.", name=name) from exc
    record(f"remaining patches installed once {name} finished importing")
    _done()


def _done() -> None:
    hook.FINDER.before = hook.FINDER.after = None
    hook.FINDER.retire_if_idle()
    _warn_about_clients_that_missed_megablocks()


def _warn_about_clients_that_missed_megablocks() -> None:
    """A client that imported MegaBlocks before the plugin could supply its CUDA extension, and
    swallowed the ImportError, stays without it: say so, and what to do."""
    ffn = sys.modules.get("llmfoundry.models.layers.ffn")
    if ffn is not None and getattr(ffn, "is_megablocks_imported", True) is False:
        msg = ("llmfoundry was imported before megablocks-ascend was active, so its import of MegaBlocks "
               "failed and LLM Foundry did not register the ffn types 'mb_moe' and 'mb_dmoe' (building "
               "such a model fails with catalogue.RegistryError). Importing megablocks-ascend now cannot "
               "change that: keep the autoload on (unset "
               f"{hook.AUTOLOAD_VAR} and TORCH_DEVICE_BACKEND_AUTOLOAD), or `import megablocks_ascend` "
               "before llmfoundry.")
        record("warned: " + msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
