"""The patch registry: every change megablocks-ascend makes to MegaBlocks, stk, Triton and the
import system, one module per patch, and how to undo it.

Each module here is one patch, named after it (``grouped_gemm`` is the ``grouped-gemm`` patch), with
its page ``patches/<name>.md`` saying the same at length. A patch module holds the code it installs,
an ``apply(patch)`` function that checks the upstream symbols' shape and replaces them, and its
record ``PATCH`` (a :class:`~megablocks_ascend.patching.registry.Patch`: name, targets, why, how,
upstream fix; the last three are the first paragraphs of the page's sections of those names).
Two modules here are not patches: :mod:`~megablocks_ascend.patching.registry` holds what the
patches share (``Patch``, ``PatchError``, the shape checks, and the
:class:`~megablocks_ascend.patching.registry.Registry` that installs them), and
:mod:`~megablocks_ascend.patching.pages` writes and checks the pages' first paragraphs from the
records (a tool; nothing imports it). Patch modules import the registry and the runtime modules, never the reverse,
and import MegaBlocks, stk and Triton only inside ``apply`` (``import megablocks_ascend`` stays
light).

:func:`install` applies every patch in the order of :data:`ORDER` (a second call is a no-op; a
patch that fails half-way is rolled back with every patch before it); :func:`uninstall` puts
every original object back exactly (``is``-identical).

Adding a patch:

1. a module ``megablocks_ascend/patching/<name_with_underscores>.py`` with a docstring that points
   at its page, its ``apply(patch)`` and its ``PATCH = Patch(name="<name-with-hyphens>", ...)``;
2. one line in :data:`ORDER` below, where it must run relative to the others;
3. a page ``patches/<name-with-hyphens>.md`` (Target, ``## Why``, ``## How``, ``## Upstream fix``,
   ``## Tests``; ``python -m megablocks_ascend.patching.pages --write`` writes the record's text into
   the first three) and a row in ``patches/README.md``.

``tests/test_plugin.py`` checks that the three agree.
"""

from __future__ import annotations

import importlib

from megablocks_ascend.patching.registry import Patch, PatchError, Registry

# The patch modules, in the order they are applied (and reverted in reverse). triton_driverless
# comes first: every later patch imports MegaBlocks, which imports stk, whose kernels are autotuned.
ORDER = (
    "triton_driverless",
    "jit_script_warning",
    "megablocks_ops_extension",
    "grouped_gemm",
    "arguments_device",
    "autocast_device",
    "stk_autocast_device",
    "routing_kernels",
    "routing_ops",
    "stk_kernels",
    "sparse_mlp_refusal",
    "triton_interpreter_index",
    "resolve_dtensor",
    "grouped_mlp_device_sizes",
    "shared_expert_bias",
    "llmfoundry_device_mesh",
    "routing_preparation",
    "sparse_static_sizes",
)

MODULES = tuple(importlib.import_module(f"{__name__}.{name}") for name in ORDER)
PATCHES: tuple[Patch, ...] = tuple(module.PATCH for module in MODULES)

REGISTRY = Registry(PATCHES)
install = REGISTRY.install
install_before_import = REGISTRY.install_before_import
uninstall = REGISTRY.uninstall
installed = REGISTRY.installed

# The patch modules' names that the rest of the package (and its users) call.
from megablocks_ascend.patching.arguments_device import default_device  # noqa: E402

__all__ = [
    "MODULES",
    "ORDER",
    "PATCHES",
    "Patch",
    "PatchError",
    "REGISTRY",
    "default_device",
    "install",
    "install_before_import",
    "installed",
    "uninstall",
]
