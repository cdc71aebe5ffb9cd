"""The ``llmfoundry-device-mesh`` patch (page: ``patches/llmfoundry-device-mesh.md``): LLM Foundry's
expert parallelism builds its device mesh on the device MegaBlocks' layers use, not always on CUDA.

LLM Foundry is optional: the patch applies only where it is installed, and never imports it. If
its module is not imported yet, the patch waits for it (``_megablocks_ascend_autoload.when_imported``)
and replaces the function once LLM Foundry has imported it.
"""

from __future__ import annotations

import sys

import _megablocks_ascend_autoload as hook
from megablocks_ascend.patching.arguments_device import default_device
from megablocks_ascend.patching.registry import Patch, PatchError, expect_params, expect_source, module_absent

MODULE = "llmfoundry.models.utils.config_moe_args"
TARGET = f"{MODULE}.get_megablocks_device_mesh"
FINGERPRINT = "8121ecd9984bdfb7"  # LLM Foundry 0.22.0's body (registry.source_fingerprint)
PARAMS = ("device_mesh_cfg", "moe_world_size", "world_size")
SUPPORTED = "0.22.0"


def _version(dist: str) -> str:
    import importlib.metadata  # noqa: PLC0415
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

_armed: list = [None]  # the pending wait's token: a wait armed before an uninstall does nothing


def mesh_device_type() -> str:
    """The device type of the weights MegaBlocks' layers create by default (the
    ``arguments-device`` patch's choice): ``npu``, else ``cuda``, else ``cpu``."""
    device = default_device()
    return "cuda" if isinstance(device, int) else device.type


def get_megablocks_device_mesh(device_mesh_cfg, moe_world_size: int, world_size: int):
    """LLM Foundry's ``get_megablocks_device_mesh`` with the mesh on :func:`mesh_device_type`
    instead of ``'cuda'``; otherwise its code."""
    from torch.distributed._tensor.device_mesh import init_device_mesh  # noqa: PLC0415  (upstream's import)

    if device_mesh_cfg is None or len(device_mesh_cfg) == 1:
        if device_mesh_cfg is not None:
            world_size = device_mesh_cfg[0]
        sharding_group_dim = world_size // moe_world_size
        return init_device_mesh(
            mesh_device_type(),
            (sharding_group_dim, moe_world_size),
            mesh_dim_names=("weight_parallel", "expert_parallel"),
        )
    raise ValueError(f"{device_mesh_cfg=} must be length 1")


def _replace(p: Patch, module) -> None:
    upstream = module.get_megablocks_device_mesh
    try:
        expect_params(TARGET, upstream, PARAMS)
        expect_source(TARGET, upstream, FINGERPRINT)
    except PatchError as e:
        raise PatchError(f"{e} (this patch was written against LLM Foundry {SUPPORTED}; installed: "
                         f"{_version('llm-foundry')}). To use LLM Foundry without megablocks-ascend, set "
                         f"{hook.AUTOLOAD_VAR}=0.") from e
    get_megablocks_device_mesh.__wrapped__ = upstream
    p.replace(TARGET, get_megablocks_device_mesh)
    p.waiting_for = None


def apply(p: Patch) -> None:
    if module_absent("llmfoundry"):
        return  # LLM Foundry is not installed: nothing to patch
    module = sys.modules.get(MODULE)
    if module is not None and not hook.executing(MODULE):
        _replace(p, module)
        return
    token = _armed[0] = object()

    def when_imported(module) -> None:
        if p.applied and _armed[0] is token:  # still installed, and this is the current wait
            _replace(p, module)

    p.waiting_for = MODULE  # (doctor: "waits for ... to be imported")
    hook.when_imported(MODULE, when_imported)


PATCH = Patch(
    name="llmfoundry-device-mesh",
    targets=(TARGET,),
    why="LLM Foundry builds MegaBlocks' expert parallelism (`ffn_config.moe_world_size > 1` with "
        "`ffn_type: mb_moe | mb_dmoe`) on a device mesh from `get_megablocks_device_mesh`, which "
        "hard-codes `init_device_mesh('cuda', ...)`. On an NPU the mesh lands on the wrong device type; on "
        "a CPU with gloo it fails at once (`module 'torch._C' has no attribute '_cuda_setDevice'`). "
        "`config_moe_args` calls the function through its module's global name, so replacing it there is "
        "enough.",
    how="LLM Foundry is optional and heavy, so the plugin never imports it. At install, where `llmfoundry` "
        "is installed: if `llmfoundry.models.utils.config_moe_args` is imported already, the function is "
        "replaced at once; otherwise the plugin waits for that module with the import hook's "
        "`when_imported` (`_megablocks_ascend_autoload`), and replaces the function once LLM Foundry has "
        "imported it (a wait armed before an `uninstall()` does nothing). The replacement is LLM Foundry's "
        "own code with one change: the mesh's device type is that of the weights MegaBlocks' layers create "
        "by default (the `arguments-device` patch's `default_device()`: `npu`, else `cuda` as upstream, "
        "else `cpu`). The patch checks the function's parameters and the fingerprint of LLM Foundry "
        "0.22.0's body, and refuses another (the import of LLM Foundry then fails with the reason and says "
        "how to turn the plugin off).",
    upstream_fix="Take the device type from the caller (the model's init device, or the process group's "
                 "backend) instead of `'cuda'`.",
    apply=apply,
)
