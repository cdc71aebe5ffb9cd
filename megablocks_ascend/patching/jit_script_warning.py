"""The ``jit-script-warning`` patch (page: ``patches/jit-script-warning.md``): MegaBlocks' own
``@torch.jit.script`` (``megablocks/layers/gelu.py``) no longer prints torch's deprecation
``FutureWarning`` each time MegaBlocks is imported; applied only while MegaBlocks and stk import.
"""

from __future__ import annotations

import inspect
import sys
import warnings

import _megablocks_ascend_autoload as hook
from megablocks_ascend.patching.registry import Patch, expect_params

TARGET = "torch.jit.script"
PARAMS = ("obj", "optimize", "_frames_up", "_rcb", "example_inputs")
# The message of torch 2.10 and later (under Python < 3.14); a regular expression, matched at its start.
MESSAGE = r"`torch\.jit\.script` is deprecated"


def _warns(original) -> bool:
    """Whether this torch's ``torch.jit.script`` raises the deprecation warning (torch 2.7 does not)."""
    try:
        return "is deprecated" in inspect.getsource(original)
    except (OSError, TypeError):
        return True  # cannot tell: patch (the wrapper only ever hides that one message)


def _caller_is_watched(depth: int = 2) -> bool:
    """Whether the code calling ``torch.jit.script`` is a module of MegaBlocks or stk."""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name.partition(".")[0] in hook.WATCHED


def apply(p: Patch) -> None:
    import torch.jit  # noqa: PLC0415

    original = torch.jit.script
    if getattr(original, "__megablocks_ascend__", False) or not _warns(original):
        return
    expect_params(TARGET, original, PARAMS)

    def script(obj, optimize=None, _frames_up=0, _rcb=None, example_inputs=None):
        if not _caller_is_watched():
            return original(obj, optimize, _frames_up + 1, _rcb, example_inputs)
        # A call from MegaBlocks' (or stk's) own code, made while it imports: that one deprecation
        # message is not shown, every other warning is; the filter is gone when the call returns.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=MESSAGE, category=FutureWarning)
            return original(obj, optimize, _frames_up + 1, _rcb, example_inputs)

    script.__wrapped__ = original
    script.__megablocks_ascend__ = True
    script.__signature__ = inspect.signature(original)
    p.replace(TARGET, script)


PATCH = Patch(
    name="jit-script-warning",
    targets=(TARGET,),
    why="MegaBlocks' layers/gelu.py decorates a function with @torch.jit.script, which from torch "
        "2.10 on warns 'torch.jit.script is deprecated' (FutureWarning) each time MegaBlocks is imported: "
        "every command prints it (--help included), and with PYTHONWARNINGS=error `import megablocks` "
        "fails on it.",
    how="While MegaBlocks and stk import (only then: the patch is taken back once they have), "
        "torch.jit.script is wrapped: a call from a module of MegaBlocks or stk runs the original with "
        "that one message ignored inside warnings.catch_warnings(); any other caller goes straight "
        "through. No filter outlives the call.",
    upstream_fix="MegaBlocks would replace @torch.jit.script in layers/gelu.py (by torch.compile, or "
                 "plain eager code: the function is three elementwise lines).",
    apply=apply,
    needs_megablocks=False,
    import_only=True,
)
