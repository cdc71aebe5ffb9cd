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
    why="MegaBlocks 0.10.0's `megablocks/layers/gelu.py` decorates `_gelu_backward_inplace` with "
        "`@torch.jit.script`. From torch 2.10 on, `torch.jit.script` warns on every call: `FutureWarning: "
        "torch.jit.script is deprecated. Please switch to torch.compile or torch.export.` So every program "
        "that imports MegaBlocks printed it, `python -m megablocks_ascend --help` and "
        "`examples/train_moe.py --help` included, and with `PYTHONWARNINGS=error` (or `-W error`) `import "
        "megablocks` (and so `import megablocks_ascend`) failed on it. The user can do nothing about it: "
        "the call is MegaBlocks'.",
    how="While MegaBlocks and stk import, `torch.jit.script` is a wrapper that looks at who calls it: a "
        "call from a module of MegaBlocks or stk runs torch's own `torch.jit.script` inside "
        "`warnings.catch_warnings()` with a filter that ignores exactly that message (`FutureWarning`, "
        'starting "`torch.jit.script` is deprecated"); every other caller goes straight through to '
        "torch's. Nothing else is filtered, and no filter outlives the call. The patch is applied with the "
        "patches MegaBlocks needs while it imports (`install_before_import`, `needs_megablocks=False`) and "
        "is one of the registry's `import_only` patches: `install()` takes it back at its end, once every "
        "other patch has imported what it patches, so after `import megablocks` `torch.jit.script` is "
        "torch's again (`doctor` lists it as applied while MegaBlocks imported). It refuses to install if "
        "`torch.jit.script`'s parameters are not `(obj, optimize, _frames_up, _rcb, example_inputs)`, and "
        "is not applied where torch's function does not warn. The wrapper passes `_frames_up + 1`, so "
        "torch's resolution of names from the caller's frame sees MegaBlocks' module, as before.",
    upstream_fix="MegaBlocks replaces `@torch.jit.script` in `layers/gelu.py` (three elementwise lines: "
                 "plain eager code, or `torch.compile`).",
    apply=apply,
    needs_megablocks=False,
    import_only=True,
)
