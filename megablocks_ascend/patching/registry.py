"""What a patch is, the checks every patch makes before it replaces anything, and the registry
that installs and uninstalls an ordered list of them.

A :class:`Patch` names its targets, why it exists, how it works and the upstream change that would
make it unnecessary, and records every original object it replaces, so that :meth:`Patch.revert`
puts each one back exactly (``is``-identical). Before replacing anything a patch checks that the
upstream symbol still has the shape it was written against (:func:`expect_params`,
:func:`expect_source`, :func:`redecorate`, :func:`replace_dispatched`) and raises
:class:`PatchError` if not, rather than patching something it does not understand.

:class:`Registry` applies its patches in order (a second :meth:`~Registry.install` is a no-op; a
patch that fails half-way is rolled back with every patch applied before it) and
:meth:`~Registry.uninstall` reverts them in reverse order. The patches themselves, one module
each, and the registry of all of them are in :mod:`megablocks_ascend.patching`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import io
import sys
import textwrap
import tokenize
from typing import Any, Callable, Iterable


class PatchError(RuntimeError):
    """An upstream symbol a patch relies on is missing or has changed shape."""


_MISSING = object()


@dataclasses.dataclass
class Patch:
    """One change to another library. ``targets`` are the page's (``patches/<name>.md``); ``why``,
    ``how`` and ``upstream_fix`` (Markdown) are the first paragraph of its sections of those names
    (:mod:`megablocks_ascend.patching.pages`); ``apply(patch)`` makes the change through
    :meth:`replace` and :meth:`set_module`, which record the originals. ``needs_megablocks`` is
    False for the patches that make MegaBlocks importable in the first place (stand-ins for its
    native dependencies, Triton fixes), which apply without it. ``import_only`` patches are in
    place only while MegaBlocks and stk import: :meth:`Registry.install` takes them back at its
    end, once every patch has imported what it patches."""

    name: str
    targets: tuple[str, ...]
    why: str
    how: str
    upstream_fix: str
    apply: Callable[["Patch"], None]
    needs_megablocks: bool = True
    import_only: bool = False
    waiting_for: str | None = None  # the module whose import the patch waits for, if any (doctor)
    originals: dict[str, Any] = dataclasses.field(default_factory=dict)
    applied: bool = False

    def replace(self, target: str, new: Any) -> None:
        """Set ``target`` (``package.module.attr`` or ``package.module:Class.attr``) to ``new``."""
        where, attr = owner(target)
        if target not in self.originals:
            self.originals[target] = where.__dict__.get(attr, _MISSING) if isinstance(where, type) \
                else getattr(where, attr, _MISSING)
        setattr(where, attr, new)

    def set_module(self, name: str, module: Any) -> None:
        """Register ``module`` as ``sys.modules[name]``."""
        key = f"sys.modules[{name!r}]"
        if key not in self.originals:
            self.originals[key] = sys.modules.get(name, _MISSING)
        sys.modules[name] = module

    def revert(self) -> None:
        """Put back every original this patch replaced, in reverse order."""
        for target, original in reversed(list(self.originals.items())):
            if target.startswith("sys.modules["):
                name = target[len("sys.modules['"):-2]
                if original is _MISSING:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = original
                continue
            where, attr = owner(target)
            if original is _MISSING:
                delattr(where, attr)
            else:
                setattr(where, attr, original)
        self.originals.clear()
        self.applied = False
        self.waiting_for = None


class Registry:
    """An ordered list of patches, installed and uninstalled together."""

    def __init__(self, patches: Iterable[Patch]):
        self.patches: tuple[Patch, ...] = tuple(patches)
        names = [p.name for p in self.patches]
        if len(set(names)) != len(names):
            raise ValueError(f"patch names must be unique, got {names}")
        self._installed = False

    def install(self) -> None:
        """Apply every patch, in order. Idempotent: a second call changes nothing; patches applied
        already (:meth:`install_before_import`) are kept. If a patch fails, half-way or not, every
        patch is taken back."""
        if self._installed:
            return
        self._apply(self.patches)
        self._installed = True
        for patch in self.patches:  # MegaBlocks and stk have been imported by now
            if patch.import_only:
                patch.revert()

    def install_before_import(self) -> None:
        """Apply only the patches that need no MegaBlocks (``needs_megablocks=False``: stand-ins
        for its native dependencies, Triton fixes), which MegaBlocks and stk need while they import;
        :meth:`install` applies the rest. The autoload calls this when it finds MegaBlocks part-way
        through its import (:mod:`megablocks_ascend.plugin_activation`)."""
        self._apply(tuple(p for p in self.patches if not p.needs_megablocks))

    def _apply(self, patches: tuple[Patch, ...]) -> None:
        try:
            for patch in patches:
                if patch.applied:
                    continue
                if patch.needs_megablocks and importlib.util.find_spec("megablocks") is None:
                    raise PatchError("MegaBlocks is not installed (pip install --no-deps megablocks==0.10.0; "
                                     "see the README)")
                patch.apply(patch)
                patch.applied = True
        except BaseException:
            self.uninstall()  # every patch, the one that failed half-way included
            raise

    def uninstall(self) -> None:
        """Undo every patch, in reverse order, restoring each original object exactly."""
        for patch in reversed(self.patches):
            patch.revert()
        self._installed = False

    def installed(self) -> bool:
        """Whether :meth:`install` ran (and :meth:`uninstall` did not since)."""
        return self._installed


# ------------------------------------------------------------------------------------------
# Helpers for the patches: find a target, check that it has the expected shape.


def owner(target: str) -> tuple[Any, str]:
    """The object holding ``target`` (``package.module.attr`` or ``package.module:Class.attr``;
    the module is imported) and the attribute's name."""
    if ":" in target:
        module_name, path = target.split(":")
        where = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for p in parents:
            where = getattr(where, p)
        return where, attr
    module_name, attr = target.rsplit(".", 1)
    return importlib.import_module(module_name), attr


def expect_params(target: str, fn: Any, params: tuple[str, ...]) -> None:
    """Raise :class:`PatchError` unless ``fn`` takes exactly the parameters ``params``."""
    try:
        found = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        raise PatchError(f"{target}: cannot read its signature ({e})") from e
    if found != params:
        raise PatchError(
            f"{target} has parameters {found}, but megablocks-ascend was written against {params}; "
            "this MegaBlocks version is not supported by this megablocks-ascend version")


def module_absent(module: str) -> bool:
    """Whether ``module`` is neither imported nor importable."""
    if module in sys.modules:
        return False
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def source_fingerprint(fn: Callable) -> str:
    """A digest of ``fn``'s code that ignores comments and layout (its tokens, joined): a patch
    that replaces a function's body checks it, so that a changed upstream body is refused rather
    than silently replaced by a copy of the old one."""
    return _fingerprint(inspect.getsource(fn))


_FSTRING_START = getattr(tokenize, "FSTRING_START", None)  # Python >= 3.12 (PEP 701)
_FSTRING_END = getattr(tokenize, "FSTRING_END", None)


def _fingerprint(source: str) -> str:
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    text = textwrap.dedent(source)
    lines = text.splitlines(keepends=True)
    tokens, depth, start = [], 0, None
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        # From Python 3.12 an f-string is several tokens; earlier it is one STRING token. Joined back
        # into its source text, so that a fingerprint does not depend on the Python version.
        if t.type == _FSTRING_START:
            depth += 1
            start = t.start if depth == 1 else start
            continue
        if depth:
            if t.type == _FSTRING_END:
                depth -= 1
                if depth == 0:
                    tokens.append(_span(lines, start, t.end))
            continue
        if t.type not in skip:
            tokens.append(t.string)
    return hashlib.sha256(" ".join(tokens).encode()).hexdigest()[:16]


def _span(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    """The source text from ``start`` to ``end`` (tokenize's 1-based rows, 0-based columns)."""
    (r0, c0), (r1, c1) = start, end
    if r0 == r1:
        return lines[r0 - 1][c0:c1]
    return lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + lines[r1 - 1][:c1]


def expect_source(target: str, fn: Any, fingerprint: str) -> None:
    """Raise :class:`PatchError` unless ``fn``'s :func:`source_fingerprint` is ``fingerprint``."""
    try:
        found = source_fingerprint(fn)
    except (OSError, TypeError, tokenize.TokenError) as e:
        raise PatchError(f"{target}: cannot read its source ({e})") from e
    if found != fingerprint:
        raise PatchError(
            f"{target} is not the code megablocks-ascend was written against (source fingerprint "
            f"{found}, expected {fingerprint}); this MegaBlocks version is not supported by this "
            "megablocks-ascend version")


def replace_followed(p: Patch, target: str, replacement: Callable, fingerprint: str,
                     params: tuple[str, ...]) -> None:
    """Replace the function ``target`` (``module:Class.attr``) by ``replacement``, a function that
    follows its code, only where upstream's still takes ``params`` and its body still has
    ``fingerprint`` (a changed body is refused, not silently replaced by a copy of the old one).
    The original is kept as ``replacement.__wrapped__``."""
    cls, attr = owner(target)
    original = cls.__dict__.get(attr)
    if original is None:
        raise PatchError(f"{target} is missing")
    expect_params(target, original, params)
    expect_source(target, original, fingerprint)
    replacement.__wrapped__ = original
    p.replace(target, replacement)


def redecorate(p: Patch, cls_target: str, upstream: tuple[Callable, Callable], ours: tuple[Callable, Callable],
               what: str) -> None:
    """Re-decorate ``cls_target``'s ``forward``/``backward``: their undecorated functions (found
    through ``__wrapped__``) wrapped by ``ours`` instead of the ``upstream`` decorators (``what``)."""
    module_name, cls_name = cls_target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    for method, decorate, wrap in zip(("forward", "backward"), upstream, ours):
        sm = cls.__dict__.get(method)
        wrapper = getattr(sm, "__func__", None)
        inner = getattr(wrapper, "__wrapped__", None)
        # Every function a decorator returns shares the code object of its inner wrapper.
        expected_code = decorate(lambda *args: None).__code__
        if not isinstance(sm, staticmethod) or inner is None \
                or getattr(wrapper, "__code__", None) is not expected_code:
            raise PatchError(f"{cls_target}.{method} is no longer a staticmethod wrapped by {what}")
        p.replace(f"{cls_target}.{method}", staticmethod(wrap(inner)))


def replace_dispatched(p: Patch, module, replacements: dict, specs: dict, upstream: dict) -> None:
    """Replace each ``module.<name>`` by ``replacements[name]`` after checking that upstream's
    function still takes ``specs[name][0]``, and record upstream's function in ``upstream`` (the
    ``cuda`` backend calls it). A function that is already ours (a second install) is not recorded."""
    for name, replacement in replacements.items():
        target = f"{module.__name__}.{name}"
        current = getattr(module, name, None)
        if current is None:
            raise PatchError(f"{target} is missing")
        if not getattr(current, "__megablocks_ascend__", False):
            expect_params(target, current, specs[name][0])
            upstream[name] = current
        p.replace(target, replacement)
