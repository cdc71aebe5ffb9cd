"""The hook that activates megablocks-ascend whatever a program imports first.

torch (>= 2.5) ends ``import torch`` by calling the entry points that installed distributions
declare in the ``torch.backends`` group; megablocks-ascend declares :func:`autoload`
(pyproject.toml). torch_npu is loaded the same way. So every program in an environment where
megablocks-ascend is installed runs :func:`autoload` once, whether it uses MegaBlocks or not, and
this module is written for that: it imports nothing but the standard library, and all it does is
put :class:`Finder` at the front of ``sys.meta_path`` (a finder that finds nothing itself: it is
asked about each module the process imports and answers "not mine" for all but MegaBlocks' and
stk's, and it leaves ``sys.meta_path`` once the plugin is active).

The finder acts only when a module of ``megablocks`` or ``stk`` is about to execute: then it
imports ``megablocks_ascend``, whose ``__init__`` does what it always did (imports torch_npu, picks
the Triton interpreter on a machine without devices, installs the patches: see
:mod:`megablocks_ascend.plugin_activation`), and steps aside. Programs that never import MegaBlocks or stk
never import megablocks-ascend, Triton or torch_npu because of it, and their ``TRITON_INTERPRET``
is left alone.

Why ``import torch`` and not ``import megablocks``: MegaBlocks and stk import torch first thing,
so the hook is in place before their first module that needs the plugin (``megablocks.ops``, which
imports the CUDA extension ``megablocks_ops``, or stk's autotuned kernels) executes, even when the
program's very first line is ``import megablocks`` or ``import stk``, or a client such as
LLM Foundry imports MegaBlocks inside ``try``/``except ImportError``.

Why this module is outside the package: importing any ``megablocks_ascend.<module>`` runs
``megablocks_ascend/__init__``, which activates the plugin. torch needs a function it can call
without that.

``MEGABLOCKS_ASCEND_AUTOLOAD=0`` turns the hook off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns off
all of torch's entry points, torch_npu's included); then ``import megablocks_ascend`` before
MegaBlocks activates the plugin, as it always did. :func:`events` records how the plugin was
activated; ``python -m megablocks_ascend doctor`` prints it.

The third, :func:`install_import_order`, is for threads: it makes a thread import a module's parent
package before it takes the module's own import lock, where CPython takes them the other way round,
for the modules of MegaBlocks and stk (see that function). It is a wrapper of CPython's private
``importlib._bootstrap._find_and_load``, and it is in place only for the *window* in which MegaBlocks
and stk are first imported: the finder opens it when it first sees a module of theirs (or
``megablocks_ascend`` does, when it imports MegaBlocks itself), and
:func:`remove_import_order` closes it once the plugin has finished with them. ``import torch``
alone changes nothing of CPython's import functions; so a program that never imports MegaBlocks
runs with them untouched, and a warning or traceback of another package never passes through a
frame of ours.

The second mechanism here, :func:`watch`, tells when a module starts and when it finishes
executing. CPython's import system (``importlib._bootstrap._load_unlocked``, the same in
Python 3.11, 3.12 and 3.13) sets ``spec._initializing = True`` on a module's spec just before it
executes the module and ``spec._initializing = False`` once that ended, well or not; ``watch``
turns ``_initializing`` into a property of that one spec object (its class becomes
:class:`_WatchedSpec`, a subclass of ``ModuleSpec`` with no other change) to be called back at
those two moments, and gives the spec its plain class back afterwards. It needs no loader wrapper,
so a module's ``__loader__`` stays what its finder made, and it works for a module that is already
executing, which a loader wrapper cannot (``import megablocks`` first: MegaBlocks' own package is
still executing when ``import torch`` runs this hook).
"""

from __future__ import annotations

import importlib._bootstrap  # the import system's own functions (install_import_order)
import importlib.machinery
import os
import sys
import threading
import time
from typing import Callable

AUTOLOAD_VAR = "MEGABLOCKS_ASCEND_AUTOLOAD"
TORCH_AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"  # torch's own switch for every entry point
PACKAGE = "megablocks_ascend"
WATCHED = ("megablocks", "stk")  # the libraries the plugin patches

_events: list[str] = []


def record(event: str) -> None:
    """Note one step of the plugin's activation (``events()``, printed by ``doctor``)."""
    _events.append(event)


def events() -> list[str]:
    """How the plugin was activated in this process, in order."""
    return list(_events)


def parse_flag(raw: str | None) -> bool:
    """``MEGABLOCKS_ASCEND_AUTOLOAD``'s value: unset, empty or 1/true/yes/on -> True,
    0/false/no/off -> False; anything else raises."""
    value = (raw or "1").strip().lower() or "1"
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{AUTOLOAD_VAR}={raw!r}: expected 0 or 1 (0 turns megablocks-ascend's autoload off)")


DEFAULT = True  # what an invalid MEGABLOCKS_ASCEND_AUTOLOAD means: the documented default, on


def enabled() -> bool:
    """Whether ``MEGABLOCKS_ASCEND_AUTOLOAD`` lets the hook activate the plugin (default: yes).
    An invalid value is the default, and warns (once per value)."""
    raw = os.environ.get(AUTOLOAD_VAR)
    try:
        return parse_flag(raw)
    except ValueError as exc:
        _warn_once(f"{exc}; taken as the default, 1 (on)", key=("invalid switch", raw))
        return DEFAULT


# ------------------------------------------------------------------------------------------
# What went wrong, kept for ``doctor`` and said once.


class ActivationError(ImportError):
    """megablocks-ascend could not be activated (its message names the cause and the switch).

    An ``ImportError`` so that a client that imports MegaBlocks inside ``try``/``except ImportError``
    treats it as MegaBlocks being unavailable, as it would without the plugin."""


_failures: list[str] = []  # what failed, in order: "where: ExceptionType: message"
_warned: set = set()


def failures() -> list[str]:
    """What failed while megablocks-ascend was being loaded or activated in this process."""
    return list(_failures)


def fail(where: str, exc: BaseException) -> None:
    """Record a failure (``failures()``, ``doctor``)."""
    _failures.append(f"{where}: {type(exc).__name__}: {exc}")
    record(f"FAILED {where}: {type(exc).__name__}: {exc}")


def _warn_once(message: str, key=None) -> None:
    key = message if key is None else key
    if key in _warned:
        return
    _warned.add(key)
    record("warned: " + message)
    import warnings  # noqa: PLC0415  (standard library; only when there is something to say)
    warnings.warn(f"megablocks-ascend: {message}", RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------------------------------
# Knowing when a module starts and finishes executing.


class _WatchedSpec(importlib.machinery.ModuleSpec):
    """A ``ModuleSpec`` whose ``_initializing`` calls back (see the module docstring).

    Instances are never created: :func:`watch` switches a spec's class to this one and back.
    """

    @property
    def _initializing(self) -> bool:
        return self.__dict__.get("_initializing", False)

    @_initializing.setter
    def _initializing(self, value: bool) -> None:
        self.__dict__["_initializing"] = value
        on_start, on_end = self.__dict__.get("_megablocks_ascend_watch", (None, None))
        if value and on_start is not None:
            stack = _starting.__dict__.setdefault("specs", [])
            stack.append(self)
            try:
                on_start(self.name)
            finally:
                stack.pop()
        elif not value:
            self.__dict__.pop("_megablocks_ascend_watch", None)
            self.__class__ = importlib.machinery.ModuleSpec
            if on_end is not None:
                module = sys.modules.get(self.name)
                on_end(self.name, module is not None and getattr(module, "__spec__", None) is self)


_starting = threading.local()  # .specs: those whose on_start runs in this thread, innermost last


def starting():
    """The spec of the module about to execute whose ``on_start`` callback is running in this
    thread (that module is not in ``sys.modules`` yet), or None."""
    specs = getattr(_starting, "specs", None)
    return specs[-1] if specs else None


def watch(spec, on_start: Callable[[str], None] | None = None,
          on_end: Callable[[str, bool], None] | None = None) -> bool:
    """Call ``on_start(name)`` just before the import system executes the module of ``spec`` and
    ``on_end(name, succeeded)`` once its execution ended (``succeeded``: the module is in
    ``sys.modules``). For a spec whose module is executing now, only ``on_end`` can still come.
    A second watch of the same spec adds its callbacks after the first's.

    Returns False, and watches nothing, for a spec that is not a plain ``ModuleSpec`` (a finder
    with its own spec class; none of the libraries watched here has one)."""
    if type(spec) is importlib.machinery.ModuleSpec:
        spec.__class__ = _WatchedSpec
    elif type(spec) is not _WatchedSpec:
        return False
    before_start, before_end = spec.__dict__.get("_megablocks_ascend_watch", (None, None))
    spec.__dict__["_megablocks_ascend_watch"] = (_chain(before_start, on_start), _chain(before_end, on_end))
    return True


def _chain(first, second):
    if first is None or second is None:
        return first or second
    return lambda *args: (first(*args), second(*args))


def executing(name: str) -> bool:
    """Whether module ``name`` is in ``sys.modules`` but has not finished executing."""
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


# ------------------------------------------------------------------------------------------
# The import hook.


class Finder:
    """A ``sys.meta_path`` finder that finds nothing itself: for the modules it is interested in
    it asks the finders after it, as the import system would, and watches the spec they return.

    * Modules of ``megablocks`` and ``stk``: ``before(name)`` is called just before each executes
      (at first: activate the plugin); ``after(name, succeeded)``, when set, once ``megablocks`` or
      ``stk`` itself has finished (:mod:`megablocks_ascend.plugin_activation` sets both while it waits).
    * Modules named in :func:`when_imported`: their callbacks, once the module has been imported.

    Threads: :func:`install_import_order` (put in place by the finder when it first sees a module
    of MegaBlocks or stk, taken out once the plugin is done with them) keeps threads that import
    MegaBlocks and stk at once from taking their import locks in opposite orders. The activation
    adds no cycle of its own: it imports nothing of MegaBlocks or stk while it waits, and
    :data:`LOCK`, which guards the hook's state, is never held while a module of theirs imports
    in another thread that waits for it.

    It has no effect on ``importlib.util.find_spec``, which finds but does not execute, and leaves
    ``sys.meta_path`` (:meth:`retire_if_idle`) once it has nothing left to do."""

    def __init__(self):
        self.before: Callable[[str], None] | None = _activate
        self.after: Callable[[str, bool], None] | None = None
        self.waiting: dict[str, list[Callable]] = {}

    def find_spec(self, name, path=None, target=None):
        before = after = None
        top = name.partition(".")[0]
        claim = None
        if top in WATCHED:
            before = None if self.before is _activate and active() else self.before
            if "." not in name and (before is not None or self.after is not None):
                after = self._after_top  # (self.after as it is when the module has finished)
            if before is _activate and not importing_in_order(name):
                # This thread entered CPython's import of `name` before the window was open: it
                # holds the module's import lock (and those of the modules it is importing for),
                # and activates the plugin holding them. Threads that enter through the wrapper
                # wait for that activation instead of starting their own (first_sight).
                claim = _claim_first_sight()
                if claim is not None:
                    before = lambda module, claim=claim: _activate_first(claim, module)  # noqa: E731
            if before is not None or after is not None:
                # The window opens at the first sight of MegaBlocks or stk (this thread holds the
                # module's import lock already: the earliest moment a finder is asked), so that
                # imports of theirs that start from now on take their locks parent first.
                install_import_order(f"`{name}` is about to be imported")
        if name in self.waiting:
            after = _chain(after, self._deliver)
        if before is None and after is None:
            return None
        spec = None
        try:
            spec = self.find_elsewhere(name, path, target)
        finally:
            if claim is not None:
                claim.spec = spec
            if spec is None and top in WATCHED and "." not in name and not _found:
                remove_import_order(f"`{name}` is not installed")  # (nor has the other been found)
            elif spec is not None and "." not in name and top in WATCHED:
                _found.add(top)
            watched = spec is not None and spec.loader is not None and watch(spec, on_start=before, on_end=after)
            if claim is not None and not watched:
                _release_first_sight(claim)  # nothing will run the activation: no one waits for it
        return spec

    def _after_top(self, name: str, succeeded: bool) -> None:
        after = self.after
        if after is not None:
            after(name, succeeded)

    def find_elsewhere(self, name, path=None, target=None):
        """The spec the finders after this one find for ``name``, as the import system would ask them."""
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                return spec
        return None

    def _deliver(self, name: str, succeeded: bool) -> None:
        with LOCK:
            callbacks = self.waiting.pop(name, ()) if succeeded else ()
        for callback in callbacks:  # after a failed import the callbacks wait for the next attempt
            callback(sys.modules[name])
        self.retire_if_idle()

    def retire_if_idle(self) -> None:
        """Leave ``sys.meta_path`` if there is nothing left to watch for."""
        with LOCK:
            inert = self.before is None or (self.before is _activate and active())
            if inert and self.after is None and not self.waiting:
                while self in sys.meta_path:
                    sys.meta_path.remove(self)

    def __repr__(self) -> str:
        return f"<{__name__}.Finder: activates megablocks-ascend before {' or '.join(WATCHED)} execute>"


# Guards the hook's state (the finder's callbacks, sys.meta_path, what waits for which module) and
# megablocks_ascend.plugin_activation's. Never held while importing a module of MegaBlocks or stk: a thread
# that wants it may be holding such a module's import lock.
LOCK = threading.RLock()


def active() -> bool:
    """Whether megablocks_ascend has been imported (in full: not just started, in some thread)."""
    return PACKAGE in sys.modules and not executing(PACKAGE)


def _activate(module: str) -> None:
    """Import megablocks_ascend (which activates the plugin) before ``module`` executes.

    In another thread than the one importing megablocks_ascend this waits for that import (its
    module lock); in the same thread (megablocks_ascend importing MegaBlocks) it returns at once.
    A failure raises :class:`ActivationError`, which names the plugin, the cause and the switch."""
    if active():
        return
    if PACKAGE not in sys.modules:
        record(f"activated by the import hook, just before `{module}` executed")
    try:
        __import__(PACKAGE)
    except ActivationError as exc:
        fail(f"activation before `{module}` executed", exc)
        remove_import_order(f"the activation failed before `{module}` executed")
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001  (re-raised, with the plugin and the switch named)
        fail(f"activation before `{module}` executed", exc)
        remove_import_order(f"the activation failed before `{module}` executed")
        raise ActivationError(
            f"megablocks-ascend could not be activated before `{module}` executed ({type(exc).__name__}: {exc}). "
            f"`import {module}` fails until that is fixed; to import it without megablocks-ascend, set "
            f"{AUTOLOAD_VAR}=0 (`python -m megablocks_ascend doctor` says more).", name=module) from exc


FINDER = Finder()


# ------------------------------------------------------------------------------------------
# The first sight: the one thread that activates the plugin holding import locks.


class _FirstSight:
    """The thread whose import of MegaBlocks or stk opened the window, before its activation ends."""

    def __init__(self):
        self.thread = threading.current_thread()
        self.done = threading.Event()
        self.spec = None  # the spec of the module it is importing, once found


_first_sight: list = [None]  # the _FirstSight whose activation is pending, or None


def _claim_first_sight() -> _FirstSight | None:
    with _SWAP:
        if _first_sight[0] is not None:
            return None
        _first_sight[0] = claim = _FirstSight()
        return claim


def _release_first_sight(claim: _FirstSight) -> None:
    with _SWAP:
        if _first_sight[0] is claim:
            _first_sight[0] = None
    claim.done.set()


def _activate_first(claim: _FirstSight, module: str) -> None:
    try:
        _activate(module)
    finally:
        _release_first_sight(claim)


def first_sight_elsewhere():
    """The spec (None until found) of the module whose import, in another thread, opened the window
    and is activating the plugin now, holding that module's import lock; ``False`` when there is none.
    ``megablocks_ascend`` imported in this thread must not import MegaBlocks then (that thread waits
    for it): :mod:`megablocks_ascend.plugin_activation` defers the patches that need MegaBlocks instead."""
    claim = _first_sight[0]
    if claim is None or claim.thread is threading.current_thread():
        return False
    return claim.spec


def _await_first_sight() -> None:
    """In a thread entering the wrapper holding no import lock of MegaBlocks or stk: wait until the
    thread that opened the window has activated the plugin (or failed to, or is gone), rather
    than import megablocks_ascend in parallel with it."""
    claim = _first_sight[0]
    if claim is None or claim.thread is threading.current_thread():
        return
    while not claim.done.wait(0.1):
        if not claim.thread.is_alive():
            return


def when_imported(name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once module ``name`` has been imported: now if it has been
    already, else when its import (or, after a failed one, the next) has finished. The plugin's
    patches of optional clients (LLM Foundry) use it so as never to import them itself."""
    module = sys.modules.get(name)
    if module is not None and not executing(name):
        callback(module)
        return
    with LOCK:
        FINDER.waiting.setdefault(name, []).append(callback)
        if module is not None:  # executing now: the finder will not see it again
            watch(module.__spec__, on_end=FINDER._deliver)
        elif FINDER not in sys.meta_path:
            sys.meta_path.insert(0, FINDER)


def autoload() -> None:
    """The ``torch.backends`` entry point: runs at the end of ``import torch``. Puts the finder in
    place unless ``MEGABLOCKS_ASCEND_AUTOLOAD=0``; imports nothing.

    It never raises: torch turns any exception from an entry point into ``RuntimeError: Failed to
    load the backend extension`` and ``import torch`` fails, for every program in the environment.
    A failure here is recorded (``failures()``, ``doctor``) and said once in a warning; torch
    imports without the hook, and ``import megablocks_ascend`` still activates the plugin."""
    try:
        _autoload()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001  (see the docstring)
        fail("autoload at import torch", exc)
        _warn_once(f"its autoload failed at `import torch` ({type(exc).__name__}: {exc}); torch is imported "
                   f"without it, and MegaBlocks runs unpatched unless `import megablocks_ascend` comes first. "
                   f"Set {AUTOLOAD_VAR}=0 to turn the autoload off; `python -m megablocks_ascend doctor` "
                   f"shows what happened.", key="autoload")


def _autoload() -> None:
    with LOCK:
        _install_hook()


def _install_hook() -> None:
    if not enabled():
        record(f"autoload off ({AUTOLOAD_VAR}={os.environ.get(AUTOLOAD_VAR)}): the import hook was not installed")
        return
    if FINDER in sys.meta_path:
        return
    if PACKAGE in sys.modules:
        record("torch's entry point ran while megablocks_ascend was importing torch: no import hook needed")
        return
    sys.meta_path.insert(0, FINDER)
    busy = [name for name in WATCHED if executing(name)]
    record("import hook installed by torch's 'torch.backends' entry point (import torch)"
           + (f", while {' and '.join(busy)} {'was' if len(busy) == 1 else 'were'} importing" if busy else ""))


# ------------------------------------------------------------------------------------------
# Import order for several threads, while MegaBlocks and stk are first imported (the window).

_ORDERED = "_megablocks_ascend_import_order"  # marks the wrapper (a second install finds it)
_in_flight = threading.local()  # .names: MegaBlocks/stk modules this thread imports through the wrapper
_SWAP = threading.Lock()  # guards the swap of _find_and_load; held for nothing else (never while importing)
_unsupported: list[str] = []  # why the wrapper cannot be installed on this Python (said once)

#: Called by the wrapper as ``after_import(name, succeeded)`` once this thread's import of
#: ``megablocks`` or ``stk`` itself has returned or raised (the thread holds no import lock of that
#: module then); set by :mod:`megablocks_ascend.plugin_activation` while patches wait for those imports.
after_import: Callable[[str, bool], None] | None = None

#: The file name the wrapper's code carries. Like the name of CPython's own import frames
#: (``<frozen importlib._bootstrap>``) it contains ``importlib`` and ``_bootstrap``, which is what
#: ``warnings`` looks for to skip import-system frames: a module imported while the window is open
#: that warns with ``stacklevel=2`` names its importer, as without the plugin. Tracebacks show the
#: frame under this name, with its source lines (registered with ``linecache``).
WRAPPER_FILENAME = "<megablocks-ascend: import order around importlib._bootstrap._find_and_load>"


def import_order_installed() -> bool:
    """Whether the import-order wrapper is ``importlib._bootstrap._find_and_load`` now (the window
    is open)."""
    return bool(getattr(importlib._bootstrap._find_and_load, _ORDERED, False))


def install_import_order(reason: str = "") -> bool:
    """Open the window: make every thread import a module of MegaBlocks or stk only once its parent
    package has been imported, and has finished executing, holding no import lock of the module
    itself, until :func:`remove_import_order`.

    Why: CPython's ``importlib._bootstrap._find_and_load`` takes the lock of ``megablocks.ops``
    first and then imports ``megablocks``; ``megablocks/__init__`` imports ``megablocks.layers``,
    whose modules import ``megablocks.ops``. A thread importing ``megablocks.ops`` while another
    imports ``megablocks.layers.dmoe`` may each hold the lock the other needs, and CPython raises
    ``_DeadlockError`` in one of them (docs/notes/activation-safety.md). Parent first, and a parent
    that another thread is executing waited for, every thread takes the locks of one package's
    modules from the outside in, so those cycles cannot form.

    How: ``_find_and_load`` is the function that both ``import`` statements (from C, looked up on
    ``importlib._bootstrap`` at every call) and ``importlib.import_module`` call for a module that
    is not yet in ``sys.modules`` (or is still executing); it is replaced by a wrapper that, for
    modules of MegaBlocks and stk only, imports the parent first (a parent another thread is
    executing is waited for with CPython's own ``_lock_unlock_module``, which gives up, as CPython
    does, on a cycle it detects) and then calls the original. Other modules go straight through,
    at the cost of one string split per module loaded, while the window is open.

    When: the finder opens the window when it is first asked about a module of MegaBlocks or stk,
    ``megablocks_ascend`` when it imports MegaBlocks itself; :mod:`megablocks_ascend.plugin_activation`
    closes it once the plugin has finished with them (or their import failed). Threads that had
    already entered CPython's own ``_find_and_load`` for a module of theirs before the window
    opened keep CPython's order (docs/notes/activation-safety.md says when that can happen).

    The wrapper is installed only where ``_find_and_load`` has the signature ``(name, import_)``
    (CPython 3.11 to 3.13) and ``_lock_unlock_module`` exists; elsewhere nothing is changed, the
    reason is recorded once, and False returned (``doctor`` shows it). Idempotent; returns whether
    the wrapper is in place."""
    with _SWAP:
        current = importlib._bootstrap._find_and_load
        if getattr(current, _ORDERED, False):
            return True
        code = getattr(current, "__code__", None)
        signature = code.co_varnames[:code.co_argcount] if code is not None else None
        bootstrap = importlib._bootstrap
        wait = getattr(bootstrap, "_lock_unlock_module", None)
        missing = [n for n in _BOOTSTRAP_NAMES if not hasattr(bootstrap, n)]
        if signature != ("name", "import_") or missing:
            if not _unsupported:
                _unsupported.append(str(signature))
                record(f"import order for threads not installed: this Python's importlib._bootstrap._find_and_load "
                       f"has the signature {signature} (expected ('name', 'import_'))"
                       + (f" and no {', '.join(missing)}" if missing else "")
                       + "; import MegaBlocks before starting threads that import it")
            return False
        importlib._bootstrap._find_and_load = _ordered(current, wait, bootstrap._find_and_load_unlocked)
        record("import order for threads installed" + (f" ({reason})" if reason else "")
               + ": modules of megablocks and stk import their parent first")
        return True


def remove_import_order(reason: str = "") -> bool:
    """Close the window: put CPython's ``_find_and_load`` back (imports in flight in other threads
    finish through the wrapper they entered). Returns whether no wrapper of ours is left; where
    another library has wrapped ``_find_and_load`` over ours since, ours cannot be taken out from
    under it: it is left, passing every module straight through, and that is recorded."""
    with _SWAP:
        current = importlib._bootstrap._find_and_load
        if getattr(current, _ORDERED, False):
            importlib._bootstrap._find_and_load = current.__wrapped__
            record("import order for threads removed" + (f" ({reason})" if reason else "")
                   + ": importlib._bootstrap._find_and_load is CPython's again")
            return True
        below, seen = getattr(current, "__wrapped__", None), 0
        while below is not None and seen < 16:
            if getattr(below, _ORDERED, False):
                _passthrough.add(below)
                record("import order for threads could not be removed: another library wrapped "
                       "importlib._bootstrap._find_and_load over it; it stays beneath, passing every module through")
                return False
            below, seen = getattr(below, "__wrapped__", None), seen + 1
        return True


_passthrough: set = set()  # wrappers left beneath another library's (remove_import_order)


# What the wrapper uses of CPython's import system besides _find_and_load (3.11 to 3.13).
_BOOTSTRAP_NAMES = ("_lock_unlock_module", "_find_and_load_unlocked", "_module_locks", "_blocking_on")


def _lock_holder_state(name: str, me: int):
    """Who holds the import lock of ``name`` (not in ``sys.modules`` yet), seen from this thread:
    ``None`` (nobody, or this thread), ``"busy"`` (another thread, for now), ``"mine"`` (another
    thread that waits for the lock of one of ``name``'s ancestors, which this thread holds and is
    executing), ``"cycle"`` (another thread whose wait leads back to this thread otherwise)."""
    bootstrap = importlib._bootstrap
    ref = bootstrap._module_locks.get(name)
    owner = getattr(ref() if ref is not None else None, "owner", None)
    if owner is None or owner == me:
        return None
    thread, seen = owner, set()
    while thread not in seen:
        seen.add(thread)
        waiting = bootstrap._blocking_on.get(thread)
        locks = [lock for lock in (waiting if isinstance(waiting, list) else (waiting,)) if lock is not None]
        if not locks:  # (3.12+: a list per thread)
            return "busy"
        lock = locks[-1]
        if getattr(lock, "owner", None) == me:
            ancestor = getattr(lock, "name", "")
            if thread == owner and name.startswith(ancestor + ".") and executing(ancestor):
                return "mine"
            return "cycle"
        thread = getattr(lock, "owner", None)
    return "busy"


def _import_without_lock(name: str) -> bool:
    """Whether this thread, about to import ``name`` (a module of MegaBlocks or stk, not the package
    itself), should import it without taking its import lock; until that is clear, wait.

    A thread that entered CPython's own ``_find_and_load`` for ``name`` before the window opened
    holds ``name``'s lock while it imports ``name``'s parents, which CPython does child first. If
    it waits for an ancestor that this thread is executing (and whose execution needs ``name``),
    each waits for the other: CPython raises ``_DeadlockError`` in whichever of them blocks second.
    So while another thread holds the lock of ``name`` before executing it, this thread does not
    block on that lock (where CPython would count it in its deadlock detection) but looks again
    every millisecond: once that thread waits for the ancestor this one executes, it can do nothing
    before this one has finished the ancestor, and on waking it returns whatever ``sys.modules``
    holds for ``name`` (``_find_and_load_unlocked``: "Crazy side-effects!"), so this thread imports
    ``name`` itself, without the lock. A wait that leads back here any other way is left to CPython
    (which raises, as it would have); the lock freed or ``name`` started executing, CPython's own
    path goes on."""
    me = threading.get_ident()
    while name not in sys.modules:
        state = _lock_holder_state(name, me)
        if state == "mine":
            return True
        if state != "busy":
            return False
        time.sleep(0.001)
    return False


def _ordered(find_and_load, wait, find_and_load_unlocked):
    def _find_and_load(name, import_):
        top, dot, _ = name.partition(".")
        if top not in WATCHED or _find_and_load in _passthrough:
            return find_and_load(name, import_)
        if FINDER.before is _activate and FINDER in sys.meta_path and not active() and _installed(top):
            # Activate here, holding no import lock of MegaBlocks or stk: a thread importing
            # megablocks_ascend itself (which imports MegaBlocks) is then waited for without a cycle;
            # so is the thread that opened the window, which activates holding its locks.
            _await_first_sight()
            if not active():
                _activate(name)
        if dot:
            parent = name.rpartition(".")[0]
            module = sys.modules.get(parent, _ABSENT)
            if module is _ABSENT:
                import_(parent)
            elif getattr(getattr(module, "__spec__", None), "_initializing", False):
                wait(parent)  # another thread executes it: wait until it has finished (in this one: at once)
        names = _in_flight.__dict__.setdefault("names", [])
        names.append(name)
        succeeded = False
        try:
            if dot and _import_without_lock(name):
                record(f"`{name}` imported without its import lock, which a thread that entered before the "
                       f"import order was in place holds while it waits for this one")
                module = find_and_load_unlocked(name, import_)
            else:
                module = find_and_load(name, import_)
            succeeded = True
            return module
        finally:
            names.pop()
            if not dot and after_import is not None:
                after_import(name, succeeded)

    # The same code under WRAPPER_FILENAME (see there); its source stays readable in tracebacks.
    _find_and_load.__code__ = _find_and_load.__code__.replace(co_filename=WRAPPER_FILENAME)
    _register_source()
    setattr(_find_and_load, _ORDERED, True)
    _find_and_load.__wrapped__ = find_and_load
    return _find_and_load


def _register_source() -> None:
    import linecache  # noqa: PLC0415  (standard library, imported by traceback and warnings anyway)
    if WRAPPER_FILENAME in linecache.cache:
        return
    try:
        with open(__file__, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError:
        return
    linecache.cache[WRAPPER_FILENAME] = (sum(map(len, lines)), None, lines, WRAPPER_FILENAME)


_ABSENT = object()
_found: set = set()  # the watched packages found installed (a package found stays so)


def _installed(top: str) -> bool:
    """Whether package ``top`` can be imported (so that a failed ``import megablocks`` where it is
    not installed does not activate the plugin). Asks the finders after the hook's, as it does."""
    if top not in _found and FINDER.find_elsewhere(top) is not None:
        _found.add(top)
    return top in _found


def importing_in_order(name: str) -> bool:
    """Whether this thread is importing ``name`` through the import-order wrapper (which then calls
    :data:`after_import` once that import has returned)."""
    return name in getattr(_in_flight, "names", ())
