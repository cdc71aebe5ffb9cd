"""``python -m megablocks_ascend doctor``: what this machine will run, and how to fix what is missing."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys

# The pairs CI and the H200 run (README.md, "Supported versions"; tools/bootstrap.sh's points).
TESTED = [
    ("torch 2.14.0 + Triton 3.8.0", "CI, CPU: the whole suite (current point); torch_npu 2.14.0's torch"),
    ("torch 2.7.1 + Triton 3.3.1", "CI, CPU: the whole suite (torch27 point); torch_npu 2.7.1's torch, "
                                   "which triton-ascend 3.2.0 is documented with"),
    ("torch 2.15.0 + Triton 3.9.0", "CI, CPU: part of the suite (newest point, .ci/run says which)"),
    ("torch 2.13.0 + Triton 3.9.0 + LLM Foundry 0.22.0", "CI, CPU: LLM Foundry's tests"),
    ("torch 2.13.0 + triton-ascend 3.2.0 + ascendnpu-ir 1.2.0", "CI, CPU: doctor and the compile gate (no NPU)"),
    ("torch 2.11 + Triton 3.6.0", "NVIDIA H200: benchmarks and device tests"),
    ("torch_npu 2.14.0 or 2.7.1 + triton-ascend 3.2.0 on an NPU", "not run (no NPU)"),
]
NO_CANN = ("torch_npu installed where CANN's environment is not set up (or on a machine without an NPU): "
           "`import torch` fails in torch_npu's own autoload (libhccl.so not found) unless "
           "TORCH_DEVICE_BACKEND_AUTOLOAD=0; megablocks-ascend's activation then fails naming torch_npu. "
           "Source CANN's set_env.sh, or without an NPU uninstall torch-npu.")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions() -> list[str]:
    lines = ["versions:"]
    for dist in ("megablocks-ascend", "torch", "torch_npu", "triton", "triton-ascend", "megablocks",
                 "stanford-stk", "grouped_gemm"):
        lines.append(f"  {dist:18} {_version(dist) or '-'}")
    lines.append(f"  {'python':18} {sys.version.split()[0]}")
    lines += ["tested pairs:"] + [f"  {pair:58} {where}" for pair, where in TESTED]
    return lines


def _not_activated(failures: list[str]) -> list[str]:
    """The report when megablocks-ascend could not be activated in this process (e.g. torch_npu
    fails to import): what is known without torch, and what to fix."""
    lines = _versions() + [""] + activation_report()
    from megablocks_ascend import envs  # noqa: PLC0415  (the standard library and the hook module only)
    lines += ["", "megablocks-ascend is not active in this process, so nothing else can be checked.", "",
              "to fix:"] + [f"  - {f}" for f in [*failures, *envs.invalid()]]
    if _version("torch_npu"):
        lines.append(f"  - ({NO_CANN})")
    return lines


def report() -> list[str]:
    import _megablocks_ascend_autoload as hook  # noqa: PLC0415
    import megablocks_ascend  # noqa: PLC0415

    if not hasattr(megablocks_ascend, "installed"):  # its activation failed (doctor_invocation)
        return _not_activated(hook.failures())
    import torch  # noqa: PLC0415

    from megablocks_ascend import backends, compat, envs, patching  # noqa: PLC0415

    lines = _versions()

    flavour = "triton-ascend" if compat.is_triton_ascend() else "standard triton"
    interp = compat.interpreter_active()
    drivers = compat.active_drivers()
    lines += ["", f"triton: {flavour}; interpreter {'on' if interp else 'off'}; "
                  f"active driver: {', '.join(drivers) if drivers else 'none'}"]
    if any(p.name == "triton-driverless" and p.originals for p in patching.PATCHES):
        lines.append("  no driver: autotuners with one config run, those that must time several "
                     "raise NoTritonDriver (patch triton-driverless)")

    npu = getattr(torch, "npu", None)
    devices = {"cpu": True, "cuda": torch.cuda.is_available(), "npu": bool(npu and npu.is_available())}
    fixes = [f"megablocks-ascend: {f}" for f in hook.failures()]
    invalid = envs.invalid()  # every switch whose value is invalid: each is a fix, none stops the report
    fixes += invalid
    backend_ok = not any(m.startswith(envs.BACKEND_VAR) for m in invalid)
    checks = _read_or(envs.checks_enabled, None)
    shown = backends.requested() if backend_ok else f"{os.environ.get(envs.BACKEND_VAR)!r} (invalid)"
    state = "invalid" if checks is None else "on" if checks else "off"
    lines += ["", f"{envs.BACKEND_VAR}={shown} (valid: {', '.join(envs.BACKENDS)}); "
                  f"sync checks {state} ({envs.CHECKS_VAR})",
              "routing backend per device type:"]
    for dev, present in devices.items():
        if not backend_ok:
            lines.append(f"  {dev:5} {'present' if present else 'absent ':8} -> not decided until "
                         f"{envs.BACKEND_VAR} is valid")
            continue
        try:
            chosen = backends.resolve(torch.device(dev) if dev != "npu" else _NpuDevice())
            why = ""
        except backends.BackendUnavailable as e:
            chosen, why = "unavailable", str(e)
            if present:
                fixes.append(why)
        except ValueError as e:  # another switch the choice reads is invalid (listed under "to fix")
            chosen, why = "not decided", str(e)
        lines.append(f"  {dev:5} {'present' if present else 'absent ':8} -> {chosen}{'  (' + why + ')' if why else ''}")

    lines += [""] + activation_report()
    lines += ["", f"patches installed: {patching.installed()}"]
    for patch in patching.PATCHES:
        lines.append(f"  {patch.name:26} {patch_status(patch)}")
    ops = sys.modules.get("megablocks_ops")
    lines.append("megablocks_ops: " + ("megablocks-ascend stand-in (PyTorch)" if ops is not None and
                 ops.__name__.startswith("megablocks_ascend") else "native CUDA extension" if ops else "not loaded"))
    gg = sys.modules.get("grouped_gemm")
    lines.append("grouped_gemm: " + ("megablocks-ascend stand-in" if getattr(gg, "__megablocks_ascend_standin__", False)
                                     else "installed package" if gg else "not loaded"))
    if importlib.util.find_spec("megablocks") is None:
        fixes.append("MegaBlocks is not installed: run tools/bootstrap.sh, or "
                     "pip install --no-build-isolation --no-deps megablocks==0.10.0 stanford-stk==0.7.1")
    if devices["npu"] and not compat.is_triton_ascend():
        fixes.append("An NPU is present but triton is not triton-ascend: pip install triton-ascend==3.2.0")
    lines += [""] + backend_compiler(fixes if compat.is_triton_ascend() else None)
    lines += ["", "to fix:" if fixes else "nothing to fix"] + [f"  - {f}" for f in fixes]
    del megablocks_ascend
    return lines


def patch_status(patch) -> str:
    """One patch's state, in words: what it replaced, or why nothing (yet)."""
    if patch.originals:
        return f"{len(patch.originals)} target(s) replaced"
    if patch.waiting_for:
        return (f"waits for `{patch.waiting_for}` to be imported, and applies then (megablocks-ascend never "
                f"imports it; nothing is wrong)")
    if patch.import_only:
        return "in place only while MegaBlocks and stk import; taken back since"
    if not patch.applied:
        return "not applied"
    return "0 targets: not needed here"


def _read_or(read, fallback):
    try:
        return read()
    except ValueError:
        return fallback


def backend_compiler(fixes: list | None) -> list[str]:
    """Whether Huawei's back-end compiler (``bishengir-compile``) is here, which build, and where:
    triton-ascend's npubin stage runs it from PATH (CANN puts it there); the compile gate also finds
    the one in the ``ascendnpu-ir`` wheel. ``fixes``: where to add a fix when it is missing."""
    import shutil  # noqa: PLC0415

    from megablocks_ascend.lowering import bishengir  # noqa: PLC0415
    try:
        found = bishengir.find_compiler("a2a3")
    except bishengir.CompilerMissing:
        if fixes is not None:
            fixes.append(f"bishengir-compile is missing: triton-ascend needs it (CANN) to compile for an NPU; "
                         f"the compile gate's back end needs pip install {bishengir.WHEEL}=={bishengir.WHEEL_PIN}")
        return ["back-end compiler (bishengir-compile): not found"]
    on_path = shutil.which("bishengir-compile")
    where = "on PATH" if on_path else "not on PATH: triton-ascend's npubin stage will not find it; the compile gate does"
    lines = [f"back-end compiler: {found.describe()} ({where})"]
    lines.append("  hivmc (CANN, makes the binary): " + ("on PATH" if shutil.which("hivmc") else
                                                         "not found: the gate stops at the hivmc handoff"))
    return lines


def activation_report() -> list[str]:
    """How the plugin was switched on in this process, and what decides it (README, "Activation")."""
    import _megablocks_ascend_autoload as hook  # noqa: PLC0415
    ours = [ep for ep in importlib.metadata.entry_points(group="torch.backends") if ep.name == "megablocks_ascend"]
    torch_autoload = os.environ.get(hook.TORCH_AUTOLOAD_VAR, "1") == "1"
    try:
        hook.parse_flag(os.environ.get(hook.AUTOLOAD_VAR))
        invalid = ""
    except ValueError:
        invalid = " -- not a valid value: taken as the default, on"
    lines = ["activation:",
             f"  torch.backends entry point: {ours[0].value if ours else 'not registered (the package is on the path but not installed: pip install -e .)'}",
             f"  torch's autoload: {'on' if torch_autoload else 'off'} ({hook.TORCH_AUTOLOAD_VAR}="
             f"{os.environ.get(hook.TORCH_AUTOLOAD_VAR, 'unset')}); "
             f"megablocks-ascend's: {'on' if hook.enabled() else 'off'} ({hook.AUTOLOAD_VAR}="
             f"{os.environ.get(hook.AUTOLOAD_VAR, 'unset')}{invalid})"]
    lines += [f"  - {event}" for event in hook.events()]
    return lines


class _NpuDevice:
    """Stands in for torch.device('npu') where torch_npu is not installed (resolve reads .type)."""
    type = "npu"
    index = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def main(args: argparse.Namespace) -> int:
    del args
    print("\n".join(report()))
    return 0
