"""The compile gate's back-end stage: Huawei's ``bishengir-compile`` on each kernel's Ascend IR.

triton-ascend 3.2.0 compiles a kernel for an A2/A3 NPU in three stages: ``ttir``, ``ttadapter``
(its bundled ``triton-adapter-opt``: Ascend linalg/HIVM IR) and ``npubin``, where
``bishengir-compile`` runs the HIVM pipeline (on-chip memory planning ``hivm-plan-memory``, sync
insertion, multi-buffering) and then hands the planned module to CANN's ``hivmc``, which makes the
binary. ``bishengir-compile`` is on PyPI (``ascendnpu-ir``, pinned in
``tools/ascend_lowering_env.sh``); ``hivmc`` is not. This module runs the ``npubin`` stage up to
that handoff, on CPU, with the flags triton-ascend passes, keeps the planned module that
``--save-temps`` writes (``module.hivm.opt.mlir``) and reads it with the gate's readings, in the
worker thread that ran the compiler (:data:`.gate.READINGS`: the memory plan, :mod:`.plan`).

What fails a configuration (:func:`classify`): any compiler error other than the absent ``hivmc``
(a buffer that does not fit at all is an error: ``ub overflow, requires N bits while M bits
available``, ``cc overflow``), a handoff without the planned module or with one a reading
cannot read, and the note ``[NOTE] Ub overflow detected; automatically set
enable-auto-multi-buffer to false`` (or ``Cbuf``): the compiler then succeeds silently without the
double-buffering the kernel was sized for.

Nothing here imports triton; the functions that read triton-ascend's source take it as text.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from megablocks_ascend.lowering.plan import PlanError

# --------------------------------------------------------------------------------------------
# The compiler.

WHEEL = "ascendnpu-ir"  # the PyPI distribution that ships bishengir-compile
WHEEL_PACKAGE = "ascendnpuir"  # its import name; the binaries are in <package>/bin/
WHEEL_PIN = "1.2.0"  # tools/ascend_lowering_env.sh installs this version
BUILDS = {"a2a3": "bishengir-compile", "a5": "bishengir-compile-a5"}  # the wheel's two builds

# Targets the gate compiles for (--target). The A2 family (Atlas 800T A2, 910B) and the A3 family
# (Atlas A3, 910_93xx) are what triton-ascend 3.2.0 compiles for with its A2/A3 npubin stage;
# 910_95xx (A5) is compiled by its other stage (compile_on_910_95) and is not gated.
GATED_TARGETS = ("Ascend910B4", "Ascend910_9382")
HIVMC_MISSING = "Cannot find hivmc under $PATH"
HANDOFF = "External hivmc run fails"
PLANNED_MODULE = "module.hivm.opt.mlir"


class CompilerMissing(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Compiler:
    path: str
    build: str  # "a2a3" or "a5"
    source: str  # "wheel ascendnpu-ir X.Y.Z" or "PATH"
    version: str  # its --version, one line
    reg_based: bool = False  # its --help mentions reg-based: triton-ascend then passes --reg-based=true

    def describe(self) -> str:
        return f"{self.version} [{self.source}]"


def _wheel_bin() -> Path | None:
    try:
        spec = importlib.util.find_spec(WHEEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "bin"


def _wheel_version() -> str | None:
    import importlib.metadata  # noqa: PLC0415
    try:
        return importlib.metadata.version(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_line(path: str) -> str:
    """``bishengir-compile --version`` in one line: release, commit, date and LLVM, without the
    build machine's directory."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    text = (out.stdout + out.stderr).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if out.returncode != 0 or not lines:
        raise CompilerMissing(f"{path} --version failed (exit {out.returncode}): {text[:400]}")
    m = re.match(r"(\S+)\s+(\S+)\s*\((?:\S+\s+)?([0-9a-f]{7,})\s+([\d-]+)\)", lines[0])
    first = f"{m.group(1)} {m.group(2)} ({m.group(3)} {m.group(4)})" if m else lines[0]
    llvm = next((line for line in lines[1:] if line.lower().startswith("llvm")), None)
    return first + (f", {llvm}" if llvm else "")


def find_compiler(build: str = "a2a3") -> Compiler:
    """The ``bishengir-compile`` of ``build``: the one in the installed ``ascendnpu-ir`` wheel (it
    does not put it on PATH), else one on PATH (a CANN install). Raises :class:`CompilerMissing`
    saying how to install it."""
    if build not in BUILDS:
        raise ValueError(f"unknown bishengir-compile build {build!r}: expected one of {sorted(BUILDS)}")
    name = BUILDS[build]
    wheel = _wheel_bin()
    if wheel is not None and (wheel / name).is_file():
        path, source = str(wheel / name), f"wheel {WHEEL} {_wheel_version()}"
    elif shutil.which(name):
        path, source = shutil.which(name), "PATH"
    else:
        raise CompilerMissing(
            f"{name} not found: neither the {WHEEL} wheel nor PATH has it. The compile gate's back-end "
            f"stage needs it: `pip install {WHEEL}=={WHEEL_PIN}` in the lowering venv (tools/"
            f"ascend_lowering_env.sh does), or run `lower --front-end-only`.")
    help_text = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60).stdout
    return Compiler(path, build, source, version_line(path), reg_based="reg-based" in help_text)


# --------------------------------------------------------------------------------------------
# The flags of triton-ascend 3.2.0's npubin stage.

# ``linalg_to_bin_enable_npu_compile_A2_A3`` (triton/backends/ascend/compiler.py) builds
# ``[compiler, kernel.ttadapter.mlir] + options + ["-o", kernel]`` from the kernel's metadata (the
# NPU options) as follows; :func:`check_npubin_source` holds this transcription to its source.
# (option field, flag) for the options that add a flag when they are not None:
OPTION_FLAGS = (
    ("multibuffer", "--enable-auto-multi-buffer"),
    ("enable_auto_bind_sub_block", "--enable-auto-bind-sub-block"),
    ("enable_hivm_auto_cv_balance", "--enable-hivm-auto-cv-balance"),
    ("sync_solver", "--enable-hivm-graph-sync-solver"),
    ("unit_flag", "--enable-hivm-unit-flag-sync"),
    ("inject_barrier_all", "--enable-hivm-inject-barrier-all-sync"),
    ("inject_block_all", "--enable-hivm-inject-block-all-sync"),
    ("limit_auto_multi_buffer_only_for_local_buffer", "--limit-auto-multi-buffer-only-for-local-buffer"),
    ("set_workspace_multibuffer", "--set-workspace-multibuffer"),
    ("tile_mix_vector_loop", "--tile-mix-vector-loop"),
    ("tile_mix_cube_loop", "--tile-mix-cube-loop"),
    ("limit_auto_multi_buffer_of_local_buffer", "--limit-auto-multi-buffer-of-local-buffer"),
    ("disable_auto_inject_block_sync", "--disable-auto-inject-block-sync"),
)
# Added last when the compiler is bishengir-compile (``--reg-based=true`` instead of the HIVM flag
# when its --help mentions reg-based; 1.2.0's does not).
TAIL_FLAGS = ("--enable-hfusion-compile=true", "--enable-hivm-compile=true", "--enable-triton-kernel-compile=true")
# Flags the stage adds only when an environment variable asks (sanitizer, debug line info, UB
# size print, blockify): the gate compiles with triton-ascend's defaults, none of them.
ENV_FLAGS = ("--enable-sanitizer=true", "--enable-debug-info=true", "--enable-print-memory-allocated-size",
             "--enable-auto-blockify-loop")


def npubin_flags(arch: str, options, reg_based: bool = False) -> list[str]:
    """The options triton-ascend 3.2.0 passes to bishengir-compile for an A2/A3 target ``arch``,
    from the kernel's NPU options (``AscendBackend.parse_options({})``: the defaults)."""
    flags = [f"--target={arch}"]
    for field, flag in OPTION_FLAGS:
        value = getattr(options, field)
        if value is not None:
            flags.append(f"{flag}={value}")
    tail = list(TAIL_FLAGS)
    if reg_based:
        tail[tail.index("--enable-hivm-compile=true")] = "--reg-based=true"
    return flags + tail


def check_npubin_source(source: str) -> list[str]:
    """What in triton-ascend's ``linalg_to_bin_enable_npu_compile_A2_A3`` source (``source``)
    disagrees with :func:`npubin_flags` (empty: the transcription holds)."""
    problems = []
    for field, flag in OPTION_FLAGS:
        if f'metadata["{field}"]' not in source or flag + "=" not in source:
            problems.append(f"{field} -> {flag}")
    for flag in TAIL_FLAGS + ENV_FLAGS + ("--target=",):
        key = flag.split("=")[0] if flag != "--enable-hivm-compile=true" else flag
        if key not in source:
            problems.append(f"{flag} not in the stage's source")
    if '"--reg-based=true"' not in source:
        problems.append("--reg-based=true (for a reg-based compiler) not in the stage's source")
    if "_parse_linalg_metadata(linalg, metadata)" not in source:
        problems.append("the stage no longer strips the adapter's metadata with _parse_linalg_metadata")
    return problems


# --------------------------------------------------------------------------------------------
# Running it.


# What to read of a planned module: name -> function of its text, which raises PlanError when the
# module is not as it expects. Each reading lands under its name in a target's result.
Readings = dict[str, Callable[[str], object]]


@dataclasses.dataclass
class BackendResult:
    status: str  # "ok" (the hivmc handoff, or a binary where hivmc exists) or "FAIL"
    problems: list
    readings: dict  # name -> the reading of the planned module (None each when none was written)
    seconds: float
    log: str  # the compiler's output, without the expected hivmc lines


_NOTE_RE = re.compile(r"\[NOTE\]\s*(\w+) overflow detected[^\n]*enable-auto-multi-buffer to false", re.I)
_LOC_RE = re.compile(r'loc\("[^"]*":(\d+:\d+)\)')  # the compiler's input path (a temporary) out of messages
_EXPECTED = (HIVMC_MISSING, "Failed to run `hivmc --version`", "Failed to detect hivmc version", HANDOFF,
             "Failed to run BiShengIR pipeline")


def classify(returncode: int, output: str, planned: str | None) -> tuple[str, list[str], str]:
    """(status, problems, log without the hivmc lines) of one compiler run (see the module
    docstring). ``planned`` is the planned module's text, None when none was written."""
    lines = [_LOC_RE.sub(r"kernel:\1", line) for line in output.splitlines()]
    output = "\n".join(lines)
    handoff = any(HANDOFF in line for line in lines) and any(HIVMC_MISSING in line for line in lines)
    log = "\n".join(line for line in lines if not any(e in line for e in _EXPECTED)).strip()
    problems = []
    for m in _NOTE_RE.finditer(output):
        problems.append(f"{m.group(1)} overflow: the compiler turned multi-buffering off "
                        f"(double-buffering lost)")
    if returncode != 0 and not handoff:
        errors = [line.strip() for line in lines if re.search(r"error|\[ERROR\]", line, re.I)
                  and not any(e in line for e in _EXPECTED)]
        problems.append("; ".join(errors[:3]) or f"bishengir-compile exited {returncode}: {log[-300:]}")
    elif returncode != 0:
        # the handoff was reached; any other error line still fails
        errors = [line.strip() for line in lines if re.search(r"\berror\b|\[ERROR\]", line, re.I)
                  and not any(e in line for e in _EXPECTED)]
        problems.extend(errors[:3])
    if planned is None and not problems:
        problems.append(f"no planned module ({PLANNED_MODULE}) after the run")
    return ("FAIL" if problems else "ok"), problems, log


def run(compiler: Compiler, linalg: str, flags: list[str], readings: Readings, *, keep: str | None = None,
        timeout: float = 300.0) -> BackendResult:
    """Compile one configuration's Ascend IR (the ttadapter output with ``mix_mode`` already
    removed, as triton-ascend does) and read its planned module with each of ``readings``.
    ``keep``: a directory to keep the input, the compiler's temporaries and its output in."""
    import time  # noqa: PLC0415
    with tempfile.TemporaryDirectory(prefix="bishengir-") as tmp:
        work = Path(keep) if keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        src = work / "kernel.ttadapter.mlir"
        src.write_text(linalg)
        temps = work / "temps"
        cmd = [compiler.path, str(src), *flags, f"--save-temps={temps}", "-o", str(work / "kernel")]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=work,
                                  env=_env_without_hivmc())
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = -1, f"bishengir-compile timed out after {timeout:.0f} s\n{exc.stdout or ''}"
        seconds = time.perf_counter() - t0
        planned_path = temps / PLANNED_MODULE
        planned = planned_path.read_text() if planned_path.is_file() else None
        if keep:
            (work / "bishengir.log").write_text(output)
        status, problems, log = classify(rc, output, planned)
        read = dict.fromkeys(readings)
        if planned is not None:
            for name, reader in readings.items():
                try:
                    read[name] = reader(planned)
                except PlanError as exc:
                    status, problems = "FAIL", problems + [f"cannot read the {name}: {exc}"]
        return BackendResult(status, problems, read, round(seconds, 3), log)


def _env_without_hivmc() -> dict:
    """The environment, unchanged: ``hivmc`` is looked up on PATH by the compiler. Where a CANN
    install puts one there, the run goes on to a binary, which the gate accepts too."""
    return dict(os.environ)


# --------------------------------------------------------------------------------------------
# The stage as the gate runs it.


class StageMismatch(RuntimeError):
    pass


class Stage:
    """bishengir-compile for every gated target, as triton-ascend 3.2.0's npubin stage would call it.

    ``options``: the kernel's NPU options (``AscendBackend.parse_options({})``); ``strip``:
    triton-ascend's own ``_parse_linalg_metadata`` (``linalg -> (linalg without mix_mode,
    metadata)``); ``readings``: what to read of each planned module; ``jobs``: compiler runs at
    once (default: the cores this process may use)."""

    def __init__(self, compiler: Compiler, targets: tuple, options, strip, readings: Readings,
                 jobs: int | None = None):
        if not targets:
            raise ValueError("no bishengir-compile targets to gate")
        self.compiler, self.targets, self.options, self.strip = compiler, tuple(targets), options, strip
        self.readings = dict(readings)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.jobs = max(1, jobs or cores)

    def flags(self, target: str) -> list[str]:
        return npubin_flags(target, self.options, self.compiler.reg_based)

    def describe(self) -> list[str]:
        return [f"back end: {self.compiler.describe()}, to the hivmc handoff",
                f"  targets: {', '.join(self.targets)}; {self.jobs} jobs",
                f"  flags: {' '.join(self.flags(self.targets[0])[1:])}"]

    def compile(self, linalg: str, target: str, keep: str | None = None) -> dict:
        text, meta = self.strip(linalg)
        res = run(self.compiler, text, self.flags(target), self.readings, keep=keep)
        return dict(target=target, status=res.status, problems=res.problems, **res.readings,
                    seconds=res.seconds, mix_mode=meta.get("mix_mode"), log=res.log[-2000:])
