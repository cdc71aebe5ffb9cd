"""Driving triton-ascend 3.2.0 on CPU: its front end (``ttir``, ``ttadapter``) on one configuration,
and its ``npubin`` stage's flags and metadata stripping for the back end.

triton-ascend replaces the ``triton`` package, so it lives in its own virtualenv
(``tools/ascend_lowering_env.sh``): :func:`require_triton_ascend` says so before anything imports
triton, and :class:`Lowerer` makes sure ``triton.jit`` compiles rather than interprets. A
configuration's arguments are handed to triton-ascend as the launcher's real call would be: the
table's pointers (16-byte aligned) and scalars, its constexprs.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path

from megablocks_ascend.lowering import bishengir
from megablocks_ascend.lowering.configs import Config
from megablocks_ascend.lowering.table import DTYPES, KernelSpec, kernel_params

TARGET_ARCH = "Ascend910B4"  # an A2-class (910B) device
VENV_HINT = (
    "triton-ascend is not installed in this Python environment ({python}). The Ascend compile gate "
    "needs its own virtualenv, because triton-ascend replaces the `triton` package: create it and run "
    "the gate with\n\n    tools/ascend_lowering_env.sh\n\n(it makes .venv-ascend in the repository root "
    "with torch==2.13.0, triton-ascend==3.2.0, pybind11 and numpy, then runs "
    "`PYTHONPATH=. .venv-ascend/bin/python -m megablocks_ascend lower`)."
)


class TritonAscendMissing(RuntimeError):
    pass


class InterpreterOn(RuntimeError):
    pass


def have_triton_ascend() -> bool:
    """Whether the installed ``triton`` is triton-ascend, without importing triton if it is not yet."""
    try:
        if "triton" in sys.modules:
            return importlib.util.find_spec("triton.backends.ascend") is not None
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(p) / "backends" / "ascend" / "compiler.py").is_file()
               for p in spec.submodule_search_locations)


def require_triton_ascend() -> None:
    if not have_triton_ascend():
        raise TritonAscendMissing(VENV_HINT.format(python=sys.executable))


def _prepare_triton() -> None:
    """Make sure ``triton.jit`` compiles rather than interprets in this process."""
    if "triton" not in sys.modules:
        # megablocks_ascend/__init__ switches the interpreter on when nothing imported triton yet;
        # the lowering gate never wants it ("0" also stops __init__ from setting it).
        os.environ["TRITON_INTERPRET"] = "0"
        return
    from megablocks_ascend import compat  # noqa: PLC0415
    if compat.interpreter_active():
        raise InterpreterOn(
            "triton was imported with TRITON_INTERPRET=1 before the lowering gate ran, so its kernels "
            "are interpreted and cannot be lowered; run it as `TRITON_INTERPRET=0 python -m "
            "megablocks_ascend lower`")


class _Ptr:
    """Stands in for a tensor argument: 16-byte aligned, as torch allocations are."""

    def data_ptr(self) -> int:
        return 1 << 20


def _signature(spec: KernelSpec, cfg: Config, runtime: list[str]) -> tuple[dict, dict]:
    sig, values = {}, {}
    ptr_types = dict(spec.ptr_types)
    for name in runtime:
        if name in cfg.scalars:
            sig[name] = "i32"
            values[name] = cfg.scalars[name]
        elif name in spec.data_ptrs:
            elem = DTYPES[cfg.axes["dtype"]][0] if "dtype" in cfg.axes else cfg.axes["index"]
            sig[name] = "*" + elem
            values[name] = _Ptr()
        else:
            sig[name] = ptr_types.get(name, "*i32")
            values[name] = _Ptr()
    return sig, values


class Lowerer:
    def __init__(self, arch: str = TARGET_ARCH):
        require_triton_ascend()  # does not import triton
        _prepare_triton()  # before anything imports triton
        from triton.backends.ascend.compiler import AscendBackend  # noqa: PLC0415
        from triton.backends.compiler import GPUTarget  # noqa: PLC0415
        self.target = GPUTarget("npu", arch, 0)
        self.backend = AscendBackend(self.target)

    def lower(self, spec: KernelSpec, cfg: Config) -> tuple[str, str]:
        """(TTIR, Ascend linalg/HIVM IR) of one configuration."""
        from triton._C.libtriton import ir  # noqa: PLC0415
        from triton.compiler.compiler import ASTSource  # noqa: PLC0415

        kern = spec.kernel()
        jit = kern.jit
        runtime, constexpr = kernel_params(kern.fn)
        sig, values = _signature(spec, cfg, runtime)
        for name in constexpr:
            sig[name] = "constexpr"
        attrs = self.backend.get_attrs_descriptor(
            jit.params, [values[p.name] if p.name in values else cfg.constexprs[p.name] for p in jit.params])
        constants = dict(cfg.constexprs)
        for num in attrs.get_constants():  # scalar arguments equal to 1 become constants
            if jit.params[num].name in values:
                constants[jit.params[num].name] = values[jit.params[num].name]
        src = ASTSource(jit, sig, constants, attrs)
        options = self.backend.parse_options({})
        metadata = {"hash": f"gate-{spec.name}", "target": self.target, **options.__dict__}
        stages: dict = {}
        self.backend.add_stages(stages, options)
        context = ir.context()
        ir.load_dialects(context)
        self.backend.load_dialects(context)
        module = src.make_ir(options, self.backend.get_codegen_implementation(),
                             self.backend.get_module_map(), context)
        module = stages["ttir"](module, metadata)
        ttir = str(module)
        return ttir, stages["ttadapter"](module, metadata)


TOOL_CRASH_RETRIES = 2


def _tool_crash(exc: BaseException) -> bool:
    """A pass tool of the backend killed by a signal (not a compile error: those exit normally)."""
    import subprocess  # noqa: PLC0415
    return isinstance(exc, subprocess.CalledProcessError) and exc.returncode is not None and exc.returncode < 0


def lower_retrying_tool_crashes(lowerer, spec, cfg):
    """``lowerer.lower`` with up to :data:`TOOL_CRASH_RETRIES` more tries when ``triton-adapter-opt``
    dies of a signal: triton-ascend 3.2.0's adapter aborts now and then on the same input
    ("Malformed type storage object", ~1-2% of runs for some int64 ``_dsd`` configurations, with
    or without MLIR threading; docs/notes/blocksparse-kernels.md). A crash that repeats fails the
    configuration; one that does not is reported in the row (``tool_crashes``) and after the tables."""
    for attempt in range(TOOL_CRASH_RETRIES + 1):
        try:
            ttir, linalg = lowerer.lower(spec, cfg)
            return ttir, linalg, attempt
        except Exception as exc:  # noqa: BLE001
            if not _tool_crash(exc) or attempt == TOOL_CRASH_RETRIES:
                raise


def error_text(exc: BaseException) -> str:
    """An exception as a row's error: its type, message and the tool's stderr."""
    stderr = getattr(exc, "stderr", None)
    if isinstance(stderr, bytes):
        stderr = stderr.decode("utf-8", "replace")
    text = f"{type(exc).__name__}: {exc}"
    if stderr:
        text += "\n" + stderr
    return text.strip()


def make_backend(lowerer: Lowerer, targets, jobs: int | None, readings: dict):
    """The back-end stage: bishengir-compile from the ascendnpu-ir wheel with triton-ascend 3.2.0's
    npubin flags (checked against its source) and its own way of removing the adapter's metadata;
    ``readings``: what to read of each planned module (:data:`.gate.READINGS`)."""
    from triton.backends.ascend import compiler as ascend  # noqa: PLC0415

    stage, strip = (getattr(ascend, n, None) for n in ("linalg_to_bin_enable_npu_compile_A2_A3", "_parse_linalg_metadata"))
    if stage is None or strip is None:
        raise bishengir.StageMismatch(
            "this triton-ascend has no linalg_to_bin_enable_npu_compile_A2_A3 / _parse_linalg_metadata "
            "(the gate is written against triton-ascend 3.2.0's npubin stage)")
    problems = bishengir.check_npubin_source(inspect.getsource(stage))
    if problems:
        raise bishengir.StageMismatch(
            "triton-ascend's npubin stage differs from the flags the gate passes (megablocks_ascend/cli/"
            "lowering/bishengir.py, OPTION_FLAGS): " + "; ".join(problems))
    return bishengir.Stage(bishengir.find_compiler("a2a3"), tuple(targets), lowerer.backend.parse_options({}),
                           lambda linalg: strip(linalg, {}), readings, jobs=jobs)
