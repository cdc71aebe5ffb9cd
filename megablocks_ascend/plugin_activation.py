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

import importlib.metadata
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
        _import_torch_npu()
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


def _import_torch_npu() -> None:
    """Import torch_npu (it registers ``torch.npu`` and the ``npu`` device), or raise an
    :class:`ActivationError` that says which torch_npu failed, why, and what to do."""
    try:
        import torch_npu  # noqa: F401,PLC0415
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001  (re-raised with what to do)
        raise hook.ActivationError(torch_npu_advice(exc)) from exc
    record("torch_npu imported (the npu device is registered)")


def torch_npu_advice(exc: BaseException) -> str:
    """What to tell the user when ``import torch_npu`` raised ``exc`` (also ``doctor``'s fix)."""
    try:
        version = importlib.metadata.version("torch-npu")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    chain, seen = [], exc
    while seen is not None and len(chain) < 5:  # torch wraps its entry points' errors: say the root cause too
        chain.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    cause = " <- ".join(dict.fromkeys(chain))
    if ".so" in cause and ("cannot open shared object" in cause or "libhccl" in cause or "libascend" in cause):
        cause += (" -- a library of CANN is not found: CANN's environment is not set up in this shell "
                  "(source CANN's set_env.sh, e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)")
    return (f"megablocks-ascend: torch_npu {version} is installed but fails to import ({cause}). On an "
            f"Ascend machine, set up CANN's environment before starting Python. On a machine without an "
            f"NPU, uninstall torch-npu (pip uninstall torch-npu): megablocks-ascend then runs on the CPU or "
            f"CUDA; until then `import torch` itself fails in torch_npu's own autoload unless "
            f"TORCH_DEVICE_BACKEND_AUTOLOAD=0, and {hook.AUTOLOAD_VAR}=0 keeps MegaBlocks from activating "
            f"megablocks-ascend.")


def doctor_invocation() -> bool:
    """Whether this process is ``python -m megablocks_ascend doctor``: there a failure to activate
    is recorded for the report (``hook.failures()``) instead of raised, since the package must be
    imported before its ``__main__`` runs. Read from ``sys.orig_argv``, the interpreter's own
    command line."""
    argv = list(getattr(sys, "orig_argv", ()))
    for i, arg in enumerate(argv[:-2]):
        if arg == "-m" and argv[i + 1] == __package__ and argv[i + 2] == "doctor":
            return True
    return False


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
    # The window in which MegaBlocks and stk are first imported (with the autoload off too:
    # MegaBlocks' own race between threads); _done() closes it.
    hook.install_import_order("megablocks-ascend is activating")
    busy = _importing()
    if not busy:  # (a top-level package about to execute counts as importing: see _importing)
        patching.install()
        record("patches installed")
        _done()
        return
    patching.install_before_import()
    with hook.LOCK:
        record(f"patches MegaBlocks and stk need while importing installed; the rest deferred until "
               f"{' and '.join(busy)} finished importing")
        for spec in busy.values():
            if spec is not None:  # (None: another thread's, which the finder calls back for)
                hook.watch(spec, on_end=_finished)
        # Stay on sys.meta_path until then: should the import fail and be tried again, the new
        # attempt's modules get the same treatment.
        hook.FINDER.before = _before_import
        hook.FINDER.after = _finished
        hook.after_import = _finished  # (an import through the import-order wrapper: once it returned)
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
    # Another thread holds the import lock of MegaBlocks or stk and waits for this import of
    # megablocks_ascend to end (the thread whose import opened the window): importing them here
    # would close a cycle. Its module finishes through the finder's `after` callback.
    elsewhere = hook.first_sight_elsewhere()
    if elsewhere is not False:
        top = elsewhere.name.partition(".")[0] if elsewhere is not None else "megablocks"
        busy.setdefault(top, None)
    return busy


def _before_import(name: str) -> None:
    from megablocks_ascend import patching  # noqa: PLC0415
    if all(patch.applied for patch in patching.PATCHES if not patch.needs_megablocks):
        return  # the usual case; without the lock, which a thread finishing the patches may hold
    with hook.LOCK:  # (imports triton and the stand-ins, nothing of MegaBlocks or stk)
        patching.install_before_import()  # after a failed attempt took the patches back


def _finished(name: str, succeeded: bool) -> None:
    # Called when `name` (megablocks or stk) has finished importing: by the import-order wrapper
    # once the import returned, or, for an import that did not go through it (it began before
    # `import torch` installed the wrapper), at the end of the module's execution, still inside its
    # import lock. The first is the one that is safe with several threads: skip the second then.
    if hook.importing_in_order(name) and hook.after_import is _finished:
        return  # the module's execution ended; the wrapper calls again once the import returned
    # Under the hook's lock: with several threads importing, two of them may finish the last of
    # MegaBlocks and stk at once. install() imports MegaBlocks' and stk's modules, which have all
    # finished executing by then (no import lock to wait for), and no other thread asks for the
    # lock while holding one of theirs: the finder's callbacks are off from here on.
    with hook.LOCK:
        _finish(name, succeeded)


def _finish(name: str, succeeded: bool) -> None:
    from megablocks_ascend import patching  # noqa: PLC0415
    if hook.FINDER.after is not _finished:
        return  # another thread has installed the patches
    if _importing():
        return  # an outer import (MegaBlocks around stk), or another thread's, is still running
    if not succeeded:
        record(f"{name} failed to import; the remaining patches wait for the next attempt")
        hook.remove_import_order(f"{name} failed to import; the next attempt opens it again")
        return
    hook.FINDER.before = hook.FINDER.after = None  # install() imports MegaBlocks: not again from here
    try:
        patching.install()
    except BaseException as exc:
        # install() took every patch back. The next attempt to import `name` gets the same
        # treatment, and fails the same way, rather than finding it half-patched in sys.modules.
        sys.modules.pop(name, None)
        hook.FINDER.before, hook.FINDER.after, hook.after_import = _before_import, _finished, _finished
        hook.remove_import_order(f"{name} could not be patched; the next attempt opens it again")
        hook.fail(f"patching {name} once it had imported", exc)
        record(f"patches could not be installed after {name} imported ({type(exc).__name__}); "
               f"every patch taken back and the import of {name} failed")
        raise hook.ActivationError(
            f"megablocks-ascend could not patch {name} ({type(exc).__name__}: {exc}); nothing is patched and "
            f"`import {name}` fails until this is fixed. To use {name} without megablocks-ascend, set "
            f"{hook.AUTOLOAD_VAR}=0.", name=name) from exc
    record(f"remaining patches installed once {name} finished importing")
    _done()


def _done() -> None:
    with hook.LOCK:
        hook.FINDER.before = hook.FINDER.after = hook.after_import = None
        hook.FINDER.retire_if_idle()
    hook.remove_import_order("MegaBlocks and stk have been imported and patched")
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
