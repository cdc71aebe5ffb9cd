"""The compile gate's back-end stage (megablocks_ascend.lowering: bishengir, plan, gate) and the memory
model it holds.

The fixtures are pieces of real planned modules (``module.hivm.opt.mlir``) and compiler output of
``bishengir-compile`` 1.2.0 (ascendnpu-ir) for our kernels, trimmed. The model test reads the
planned peaks the gate recorded (``tests/data/ascend_memory_plans.json``); the tests that run the
compiler need the lowering venv (``ASCEND_LOWER_SKIP_RUN=1 tools/ascend_lowering_env.sh``, which CI
makes before the tests) and are skipped without it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import types

import pytest
import torch

from megablocks_ascend import devices

# The toolchain runs in its own venv (tools/ascend_lowering_env.sh) and the plans are recorded: the
# point's torch and Triton play no part (CI: the current point only).
pytestmark = pytest.mark.one_point
from megablocks_ascend.lowering import bishengir, census, command, driver, gate, plan, report, table
from megablocks_ascend.lowering.configs import Config, configs, model_ub, tile_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLANS = ROOT / "tests" / "data" / "ascend_memory_plans.json"

# A dsd (bf16, 128 x 256 x 64) planned for an Ascend910B4: the target spec, the task-type function,
# four L1 buffers (two operands, double-buffered), the L0C accumulator, and sync ops.
CUBE_PLAN = """\
module attributes {dlti.target_system_spec = #dlti.target_system_spec<"NPU" : #hacc.target_device_spec<#dlti.dl_entry<"AI_CORE_COUNT", 20 : i32>, #dlti.dl_entry<"CUBE_CORE_COUNT", 20 : i32>, #dlti.dl_entry<"VECTOR_CORE_COUNT", 40 : i32>, #dlti.dl_entry<"UB_SIZE", 1572864 : i32>, #dlti.dl_entry<"L1_SIZE", 4194304 : i32>, #dlti.dl_entry<"L0A_SIZE", 524288 : i32>, #dlti.dl_entry<"L0B_SIZE", 524288 : i32>, #dlti.dl_entry<"L0C_SIZE", 1048576 : i32>, #dlti.dl_entry<"UB_ALIGN_SIZE", 256 : i32>, #dlti.dl_entry<"L1_ALIGN_SIZE", 256 : i32>, #dlti.dl_entry<"L0C_ALIGN_SIZE", 4096 : i32>>>,   hivm.module_core_type = #hivm.module_core_type<AIC>} {
  func.func @_dsd_infer_task_type_function() -> i8 attributes {hacc.function_kind = #hacc.function_kind<HOST>, hacc.host_func_type = #hacc.host_func_type<infer_task_type_function>} {
    %c20_i8 = arith.constant 20 : i8
    return %c20_i8 : i8
  }
  func.func @_dsd(%arg0: i64 {hacc.arg_type = #hacc.arg_type<ffts_base_address>}) attributes {hacc.entry, hivm.func_core_type = #hivm.func_core_type<AIC>} {
    %c49152_i64 = arith.constant 49152 : i64
    %c0_i64 = arith.constant 0 : i64
    %c16384_i64 = arith.constant 16384 : i64
    %c65536_i64 = arith.constant 65536 : i64
    %0 = hivm.hir.pointer_cast(%c16384_i64) : memref<16x4x16x16xbf16, #hivm.address_space<cbuf>>
    %1 = hivm.hir.pointer_cast(%c65536_i64) : memref<16x4x16x16xbf16, #hivm.address_space<cbuf>>
    %2 = hivm.hir.pointer_cast(%c0_i64) : memref<4x8x16x16xbf16, #hivm.address_space<cbuf>>
    %3 = hivm.hir.pointer_cast(%c49152_i64) : memref<4x8x16x16xbf16, #hivm.address_space<cbuf>>
    hivm.hir.set_flag[<PIPE_MTE1>, <PIPE_MTE2>, <EVENT_ID0>]
    hivm.hir.set_flag[<PIPE_FIX>, <PIPE_M>, <EVENT_ID0>]
    %44 = hivm.hir.pointer_cast(%c0_i64) : memref<16x8x16x16xf32, #hivm.address_space<cc>>
    hivm.hir.wait_flag[<PIPE_FIX>, <PIPE_M>, <EVENT_ID0>]
    hivm.hir.pipe_barrier[<PIPE_ALL>]
    return
  }
}
"""

# A vector kernel's UB buffers: a mask over a wider buffer at the same offset, and the last buffer.
VECTOR_PLAN = CUBE_PLAN.replace("module_core_type<AIC>", "module_core_type<AIV>").replace(
    "%c20_i8 = arith.constant 20", "%c10_i8 = arith.constant 10").replace(
    "    %44 = hivm.hir.pointer_cast(%c0_i64) : memref<16x8x16x16xf32, #hivm.address_space<cc>>\n",
    "    %c118176_i64 = arith.constant 118176 : i64\n"
    "    %5 = hivm.hir.pointer_cast(%c118176_i64) : memref<8x512xf32, #hivm.address_space<ub>>\n"
    "    %6 = hivm.hir.pointer_cast(%c118176_i64) : memref<8x512xi1, #hivm.address_space<ub>>\n"
    "    %7 = hivm.hir.pointer_cast(%c0_i64) : memref<8x512xbf16, #hivm.address_space<ub>>\n").replace(
    "#hivm.address_space<cbuf>", "#hivm.address_space<ub>")

HANDOFF_LOG = """\
[ERROR] Cannot find hivmc under $PATH
[ERROR] Failed to run `hivmc --version`.
[WARNING] Failed to detect hivmc version for backward compatibility
[ERROR] Cannot find hivmc under $PATH
loc("kernel.ttadapter.mlir":2:1): error: External hivmc run fails, returning module before running external compiler
[ERROR] Failed to run BiShengIR pipeline
"""


def test_read_plan_cube():
    planned = plan.read_plan(CUBE_PLAN)
    assert planned["peak"] == dict(ub=0, cbuf=98304, cc=131072)  # 65536 + 16*4*16*16*2; 16*8*16*16*4
    assert planned["buffers"] == dict(ub=0, cbuf=4, cc=1)
    assert planned["capacity"] == dict(ub=192 * 1024, cbuf=512 * 1024, cc=128 * 1024)
    assert (planned["core_type"], planned["task_type"]) == ("AIC", 20)
    assert planned["sync"] == dict(set_flag=2, wait_flag=1, pipe_barrier=1)
    assert planned["cores"] == dict(aic=20, aiv=40)
    # it agrees with the model of that tile, exactly (L1 and L0C; devices.py docstring)
    model = devices.cube_bytes(devices.CubeTile(128, 256, 64), 2)
    assert (model["l1"], model["l0c"]) == (planned["peak"]["cbuf"], planned["peak"]["cc"])


def test_read_plan_vector_counts_every_buffer_at_its_offset():
    planned = plan.read_plan(VECTOR_PLAN)
    assert planned["peak"]["ub"] == 118176 + 8 * 512 * 4 and planned["peak"]["cbuf"] == 0
    assert planned["buffers"]["ub"] == 7
    assert (planned["core_type"], planned["task_type"]) == ("AIV", 10)
    assert plan.percent(planned, "ub") == pytest.approx(100 * 134560 / 196608)


def test_read_plan_counts_a_mask_by_bits():
    """A mask of its own (not over a wider buffer), as the routing preparation's ``_count`` at 1024
    experts plans one (there ``1024x256x1``): bit-packed (at a byte per element it would end past
    the UB, which the compiler that planned it did not report)."""
    planned = plan.read_plan(VECTOR_PLAN.replace(
        "    %7 = hivm.hir.pointer_cast(%c0_i64)",
        "    %c98752_i64 = arith.constant 98752 : i64\n"
        "    %8 = hivm.hir.pointer_cast(%c98752_i64) : memref<2048x256x1xi1, #hivm.address_space<ub>>\n"
        "    %7 = hivm.hir.pointer_cast(%c0_i64)"))
    assert planned["peak"]["ub"] == 98752 + 2048 * 256 // 8  # above the f32 buffer's 134,560


def test_read_plan_refuses_what_it_cannot_size():
    with pytest.raises(plan.PlanError, match="dynamic size"):
        plan.read_plan(VECTOR_PLAN.replace("memref<8x512xbf16, #hivm", "memref<?x512xbf16, #hivm"))
    with pytest.raises(plan.PlanError, match="non-constant offset"):
        plan.read_plan(VECTOR_PLAN.replace("pointer_cast(%c0_i64) : memref<8x512xbf16",
                                                "pointer_cast(%arg9) : memref<8x512xbf16"))
    with pytest.raises(plan.PlanError, match="UB_SIZE"):
        plan.read_plan(VECTOR_PLAN.replace('"UB_SIZE"', '"XB_SIZE"'))


def test_classify_accepts_the_hivmc_handoff_only():
    assert bishengir.classify(1, HANDOFF_LOG, VECTOR_PLAN)[:2] == ("ok", [])
    # a binary (hivmc present) is fine too
    assert bishengir.classify(0, "", VECTOR_PLAN)[:2] == ("ok", [])
    # the handoff without the planned module
    status, problems, _ = bishengir.classify(1, HANDOFF_LOG, None)
    assert status == "FAIL" and "no planned module" in problems[0]


def test_classify_fails_lost_double_buffering_and_overflow_errors():
    note = "[NOTE] Ub overflow detected; automatically set enable-auto-multi-buffer to false\n"
    status, problems, _ = bishengir.classify(1, note + HANDOFF_LOG, VECTOR_PLAN)
    assert status == "FAIL" and problems == ["Ub overflow: the compiler turned multi-buffering off "
                                             "(double-buffering lost)"]
    cbuf = note.replace("Ub overflow", "Cbuf overflow")
    assert "Cbuf overflow" in bishengir.classify(0, cbuf, CUBE_PLAN)[1][0]
    error = ('loc("kernel.ttadapter.mlir":12:3): error: ub overflow, requires 1703936 bits while '
             '1572864 bits available!\n[ERROR] Failed to run BiShengIR pipeline\n')
    status, problems, _ = bishengir.classify(1, error, None)
    assert status == "FAIL" and "ub overflow, requires 1703936 bits" in problems[0]
    # another error next to the handoff still fails
    status, problems, _ = bishengir.classify(1, 'loc("k":3:1): error: cc overflow\n' + HANDOFF_LOG, CUBE_PLAN)
    assert status == "FAIL" and "cc overflow" in problems[0]


def _npu_options(**kw):
    """triton-ascend 3.2.0's NPUOptions defaults for the fields the npubin stage reads."""
    fields = {f: None for f, _ in bishengir.OPTION_FLAGS}
    fields.update(multibuffer=True, enable_auto_bind_sub_block=True, **kw)
    return types.SimpleNamespace(**fields)


def test_npubin_flags_are_triton_ascends():
    # the command triton-ascend 3.2.0 builds for an A2 target with default options (its compiler.py,
    # linalg_to_bin_enable_npu_compile_A2_A3; TRITON_DISABLE_LINE_INFO defaults to true)
    assert bishengir.npubin_flags("Ascend910B4", _npu_options()) == [
        "--target=Ascend910B4", "--enable-auto-multi-buffer=True", "--enable-auto-bind-sub-block=True",
        "--enable-hfusion-compile=true", "--enable-hivm-compile=true", "--enable-triton-kernel-compile=true"]
    assert "--enable-hivm-graph-sync-solver=False" in bishengir.npubin_flags("Ascend910B4",
                                                                              _npu_options(sync_solver=False))
    # a compiler whose --help mentions reg-based gets --reg-based=true instead of the HIVM flag, as there
    reg = bishengir.npubin_flags("Ascend910B4", _npu_options(), reg_based=True)
    assert "--reg-based=true" in reg and "--enable-hivm-compile=true" not in reg


def test_source_check_names_what_changed():
    source = "\n".join([f'x = metadata["{f}"]\n  "{flag}={{x}}"' for f, flag in bishengir.OPTION_FLAGS] +
                       [f'"{flag}"' for flag in bishengir.TAIL_FLAGS + bishengir.ENV_FLAGS + ("--reg-based=true",)] +
                       ['f"--target={arch}"', "linalg, metadata = _parse_linalg_metadata(linalg, metadata)"])
    assert bishengir.check_npubin_source(source) == []
    assert bishengir.check_npubin_source(source.replace("--enable-hivm-graph-sync-solver", "--sync")) == [
        "sync_solver -> --enable-hivm-graph-sync-solver"]
    assert any("_parse_linalg_metadata" in p for p in
               bishengir.check_npubin_source(source.replace("_parse_linalg_metadata", "strip")))


def test_version_line_drops_the_build_directory(tmp_path):
    fake = tmp_path / "bishengir-compile"
    fake.write_text("#!/bin/sh\necho 'bishengir-compile 1.2.0 (/build/dir/bishengir 8796a8ac1508 2026-07-29) '\n"
                    "echo 'llvm 19.1.7 cd708029e0b2'\necho 'Release build'\n")
    fake.chmod(0o755)
    assert bishengir.version_line(str(fake)) == "bishengir-compile 1.2.0 (8796a8ac1508 2026-07-29), llvm 19.1.7 cd708029e0b2"


def test_missing_compiler_says_how_to_install(monkeypatch):
    monkeypatch.setattr(bishengir, "_wheel_bin", lambda: None)
    monkeypatch.setattr(bishengir.shutil, "which", lambda name: None)
    with pytest.raises(bishengir.CompilerMissing, match=r"pip install ascendnpu-ir==1\.2\.0"):
        bishengir.find_compiler()
    with pytest.raises(ValueError, match="build"):
        bishengir.find_compiler("a9")


def _fake_compiler(tmp_path, planned: str | None):
    """A stand-in for bishengir-compile that reaches the hivmc handoff, writing ``planned`` as
    its planned module (none when None)."""
    (tmp_path / "planned.mlir").write_text(planned or "")
    (tmp_path / "handoff.log").write_text(HANDOFF_LOG)
    fake = tmp_path / "bishengir-compile"
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in --save-temps=*) d=\"${a#--save-temps=}\";; esac; done\n"
                    + (f"mkdir -p \"$d\" && cat '{tmp_path}/planned.mlir' > \"$d/{bishengir.PLANNED_MODULE}\"\n"
                       if planned is not None else "")
                    + f"cat '{tmp_path}/handoff.log' >&2\nexit 1\n")
    fake.chmod(0o755)
    return bishengir.Compiler(str(fake), "a2a3", "PATH", "bishengir-compile (fake)")


def test_each_reading_of_the_planned_module_lands_under_its_name(tmp_path):
    """The back end reads the planned module with every reading it is given (the gate's:
    ``gate.readers()``); one that cannot read it fails the target, named; without a planned
    module every reading is None."""
    compiler = _fake_compiler(tmp_path, VECTOR_PLAN)

    def broken(text):
        raise plan.PlanError("no census here")

    readings = dict(gate.readers(), ops=lambda text: dict(lines=len(text.splitlines())))
    res = bishengir.run(compiler, "module {}", ["--target=Ascend910B4"], readings)
    assert (res.status, res.problems) == ("ok", [])
    assert res.readings == dict(plan=plan.read_plan(VECTOR_PLAN), census=census.read(VECTOR_PLAN),
                                ops=dict(lines=len(VECTOR_PLAN.splitlines())))
    res = bishengir.run(compiler, "module {}", ["--target=Ascend910B4"], dict(readings, census=broken))
    assert res.status == "FAIL" and res.problems == ["cannot read the census: no census here"]
    stage = bishengir.Stage(compiler, ("Ascend910B4",), _npu_options(), lambda text: (text, {"mix_mode": "aiv"}),
                            readings)
    out = stage.compile("module {}", "Ascend910B4")
    assert out["plan"] == res.readings["plan"] and out["ops"] == res.readings["ops"] and out["mix_mode"] == "aiv"
    res = bishengir.run(_fake_compiler(tmp_path, None), "module {}", ["--target=Ascend910B4"], readings)
    assert res.readings == dict(plan=None, census=None, ops=None) and res.status == "FAIL"
    assert res.problems == [f"no planned module ({bishengir.PLANNED_MODULE}) after the run"]


def test_back_end_folds_every_reading_into_the_row(monkeypatch):
    """A reading's fold adds its fields and problems to the row after the plan's."""
    def fold(row, spec, cfg, by_target):
        row["ops"] = by_target["Ascend910B4"]["ops"]
        return [f"{row['ops']} ops"] if row["ops"] > 2 else []

    monkeypatch.setattr(gate, "READINGS", gate.READINGS + (gate.Reading("ops", len, fold),))
    assert set(gate.readers()) == {"plan", "census", "ops"}
    spec = next(s for s in table.KERNELS if s.name == "_scatter")
    good = dict(target="Ascend910B4", status="ok", problems=[], plan=plan.read_plan(VECTOR_PLAN), ops=1,
                seconds=0.3, mix_mode="aiv")
    row = dict(status="ok", error="")
    gate.back_end(row, spec, _vector_cfg(ub=200_000), {"Ascend910B4": good})
    assert (row["status"], row["ops"], row["ub_plan"]) == ("ok", 1, 134560)
    row = dict(status="ok", error="")
    gate.back_end(row, spec, _vector_cfg(ub=134559), {"Ascend910B4": dict(good, ops=3)})
    assert row["status"] == "FAIL" and row["error"] == (
        "memory model short: UB planned 134560 > devices.ub_bytes 134559; 3 ops")


# --------------------------------------------------------------------------------------------
# The gate's checks on a back-end result.


def _vector_cfg(ub=100_000):
    return Config("_scatter", dict(dtype="bf16", hidden=1000, TOP_K=2, SCALE=True, INT64=False),
                           dict(BLOCK_M=8, BLOCK_X=512, EVEN_X=False), {}, ub)


def test_model_bound_and_launch_metadata_are_checked():
    spec = next(s for s in table.KERNELS if s.name == "_scatter")
    planned = plan.read_plan(VECTOR_PLAN)
    good = dict(target="Ascend910B4", status="ok", problems=[], plan=planned, seconds=0.3, mix_mode="aiv")
    row = dict(status="ok", error="")
    gate.back_end(row, spec, _vector_cfg(ub=134560), {"Ascend910B4": good})
    assert row["status"] == "ok" and row["ub_plan"] == 134560 and row["sync"] == "2/1/1"
    row = dict(status="ok", error="")
    gate.back_end(row, spec, _vector_cfg(ub=134559), {"Ascend910B4": good})
    assert row["status"] == "FAIL" and "memory model short: UB planned 134560 > devices.ub_bytes 134559" in row["error"]
    row = dict(status="ok", error="")
    gate.back_end(row, spec, _vector_cfg(ub=200_000), {"Ascend910B4": dict(good, mix_mode="mix")})
    assert row["status"] == "FAIL" and "launch metadata" in row["error"]
    # a second target's failure fails the row, named
    bad = dict(good, status="FAIL", problems=["Ub overflow: the compiler turned multi-buffering off"])
    row = dict(status="ok", error="")
    gate.back_end(row, spec, _vector_cfg(ub=200_000), {"Ascend910B4": good, "Ascend910_9382": bad})
    assert row["status"] == "FAIL" and row["error"].startswith("Ascend910_9382: Ub overflow")


def test_report_shows_planned_memory_against_capacity():
    spec = next(s for s in table.KERNELS if s.name == "_scatter")
    planned = plan.read_plan(VECTOR_PLAN)
    row = dict(kernel="_scatter", config="bf16 H=1000", status="ok", error="", ub_bytes=200_000, row_dma=2,
               scalar_hot=0, scalar_row=0, int_vec_hot=1)
    gate.back_end(row, spec, _vector_cfg(ub=200_000), {"Ascend910B4": dict(
        target="Ascend910B4", status="ok", problems=[], plan=planned, seconds=0.3, mix_mode="aiv")})
    text = report.format_table([row], footer=["time: 1 s"])
    head = text.splitlines()[0]
    assert "UB model" in head and "UB planned" in head and "sync s/w/b" in head
    assert "134560 68%" in text and "highest planned UB: 134560 68% of 196608" in text
    assert text.splitlines()[-2:] == ["time: 1 s", "lowered: 1/1"]


# --------------------------------------------------------------------------------------------
# The memory model against the recorded plans.


def _recorded():
    data = json.loads(PLANS.read_text())
    return data, data["plans"]


def test_recorded_plans_name_their_compiler_and_cover_every_kernel():
    data, plans = _recorded()
    assert data["compiler"].startswith("bishengir-compile 1.2.0") and data["target"] == "Ascend910B4"
    assert data["capacity"] == dict(ub=192 * 1024, cbuf=512 * 1024, cc=128 * 1024)
    assert all(p["peak"][s] <= data["capacity"][s] for p in plans for s in ("ub", "cbuf", "cc"))
    assert {p["kernel"] for p in plans} == {s.name for s in table.KERNELS}
    recorded = {(p["kernel"], p["config"]) for p in plans}
    assert {(c.kernel, c.label) for c in configs()} <= recorded  # the whole gate table
    # every tile a launcher chooses passed the gate when it was recorded (tiles set by hand may not:
    # some lost their double-buffering, which is what the gate is for)
    failed = [(p["kernel"], p["config"]) for p in plans if p["status"] != "ok" and "(set by hand)" not in p["config"]]
    assert not failed, failed[:5]


def _ub_model(entry):
    spec = next(s for s in table.KERNELS if s.name == entry["kernel"])
    return model_ub(spec, entry["axes"], entry["constexprs"], entry["experts"])


def test_memory_model_is_an_upper_bound_of_every_recorded_plan():
    """``devices.ub_bytes`` (vector kernels) and ``devices.cube_bytes`` (cube kernels) of each
    recorded configuration's tile are at least what bishengir-compile planned for it."""
    _, plans = _recorded()
    short = []
    for e in plans:
        spec = next(s for s in table.KERNELS if s.name == e["kernel"])
        if spec.cube:
            c = e["constexprs"]
            es = table.DTYPES[e["axes"]["dtype"]][2]
            model = devices.cube_bytes(devices.CubeTile(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]), es)
            if e["peak"]["cbuf"] > model["l1"] or e["peak"]["cc"] > model["l0c"]:
                short.append((e["kernel"], e["config"], e["peak"], model))
        elif spec.kind is not None:
            if e["peak"]["ub"] > _ub_model(e):
                short.append((e["kernel"], e["config"], e["peak"]["ub"], _ub_model(e)))
    assert not short, f"{len(short)} plans above the model, e.g. {short[:5]}"


def test_every_tile_the_launchers_choose_was_planned():
    """For every recorded (kernel, dtype, hidden, flags), the tile ``devices.tile`` picks today is
    the one the gate compiled: a change to the model or the tile choice needs the plans re-run
    (docs/notes/ascend-backend.md says how)."""
    _, plans = _recorded()
    stale = []
    for e in plans:
        spec = next(s for s in table.KERNELS if s.name == e["kernel"])
        if spec.kind is None or spec.cube or "(set by hand)" in e["config"]:
            continue
        dtype = getattr(torch, table.DTYPES[e["axes"]["dtype"]][1])
        t = devices.tile(spec.kind, dtype, e["axes"]["hidden"], "npu",
                         **tile_args(spec, e["axes"], e["experts"]))
        if (t.block_m, t.block_x) != (e["constexprs"]["BLOCK_M"], e["constexprs"]["BLOCK_X"]):
            stale.append((e["kernel"], e["config"], t))
    assert not stale, f"{len(stale)} recorded tiles are not what devices.tile picks now, e.g. {stale[:3]}"


# --------------------------------------------------------------------------------------------
# The gate catches what it claims (needs the lowering venv with ascendnpu-ir).


def _ascend_python() -> pathlib.Path:
    return pathlib.Path(os.environ.get("ASCEND_VENV", ROOT / ".venv-ascend")) / "bin" / "python"


needs_backend = pytest.mark.skipif(
    not _ascend_python().exists(),
    reason="no lowering venv (.venv-ascend): `ASCEND_LOWER_SKIP_RUN=1 bash tools/ascend_lowering_env.sh`")


def _lower(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([str(_ascend_python()), "-m", "megablocks_ascend", "lower", "--targets", "Ascend910B4",
                           *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@needs_backend
def test_gate_fails_an_oversized_vector_tile_by_the_compilers_error():
    """_scatter (fp32, top_k 2, weights) with 32 rows per sub-block: 4x the launchers' tile. The
    plan does not fit the 192 KiB Unified Buffer even single-buffered: bishengir-compile's error."""
    r = _lower("--only", "_scatter", "--axis", "dtype=fp32", "--axis", "hidden=1024", "--axis", "TOP_K=2",
               "--axis", "SCALE=true", "--axis", "INT64=false", "--axis", "LAYOUT=0", "--axis", "SELECT=false",
               "--set", "BLOCK_M=32")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "lowered: 0/2"
    scatter = next(line for line in lines if line.startswith("  _scatter [fp32 H=1024 TOP_K=2"))
    assert "error: ub overflow, requires" in scatter and "bits while 1572864 bits available" in scatter
    # _scatter_one at the same tile fits once the compiler drops the double-buffering: caught by its note
    one = next(line for line in lines if line.startswith("  _scatter_one [fp32"))
    assert "Ub overflow: the compiler turned multi-buffering off (double-buffering lost)" in one


@needs_backend
def test_gate_fails_an_oversized_cube_tile_by_the_lost_double_buffering():
    """sdd (bf16) with a K step of 1024: its two L1 operand tiles take 384 KiB, 768 KiB
    double-buffered (L1 is 512 KiB). bishengir-compile succeeds without the double-buffering, saying
    so only in a note: the gate fails it."""
    r = _lower("--only", "_sdd", "--axis", "dtype=bf16", "--axis", "hidden=1024", "--axis", "LHS_CM=false",
               "--axis", "RHS_CM=false", "--axis", "INT64=false", "--set", "BLOCK_N=64", "--set", "BLOCK_K=1024")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "lowered: 0/1"
    assert "Cbuf overflow: the compiler turned multi-buffering off (double-buffering lost)" in r.stdout
    assert "highest planned L1: 393216 75% of 524288" in r.stdout  # single-buffered: 2 x 192 KiB


def test_lower_refuses_an_axis_or_constexpr_no_kernel_has(capsys):
    import argparse
    args = argparse.Namespace(json=None, dump=None, only="_scatter", arch=driver.TARGET_ARCH, argv=None,
                              axis=["TOPK=8"], set=None, front_end_only=True, targets=None, jobs=None,
                              experts=None, plans=None)
    assert command.main(args) == 2  # before anything is lowered, with or without triton-ascend
    assert "--axis TOPK: no kernel matching --only _scatter has it" in capsys.readouterr().err
    args.axis, args.set = ["TOP_K=8"], ["BLOCK_N=64"]  # a cube tile side, not a _scatter constexpr
    assert command.main(args) == 2
    assert "--set BLOCK_N: no kernel matching --only _scatter has it" in capsys.readouterr().err


@needs_backend
def test_gate_fails_a_kernel_that_brings_back_the_per_row_chain():
    """The census in the gate: the token-major gather as it was before the census (its scaling in
    the expression feeding a store to data-dependent rows, tests/census_variants.py) fails on the
    one-element vector ops per row the compiler then emits; today's kernel passes the same
    configuration."""
    axes = ("--only", "_gather_tokens", "--axis", "dtype=bf16", "--axis", "hidden=1024", "--axis", "TOP_K=2",
            "--axis", "SCALE=true", "--axis", "INT64=false", "--axis", "LAYOUT=0")
    old = _lower(*axes, "--variant", "_gather_tokens=tests.census_variants")
    assert old.returncode == 1, old.stdout + old.stderr
    assert "variants (--variant): _gather_tokens from tests.census_variants" in old.stdout
    assert "census: 4 one-element vector ops per row in a hot loop (target <= 0)" in old.stdout
    assert "most scalar<->vector handshakes per row: 8.75" in old.stdout
    now = _lower(*axes)
    assert now.returncode == 0, now.stdout + now.stderr
    assert "most one-element vector ops per row: 0 " in now.stdout


@needs_backend
def test_gate_fails_the_scatter_that_loads_one_slot_at_a_time():
    """The token-major scatter loading each slot's row index and weight on its own (FLAT=0: CUDA's
    form, the NPU's at every top_k before the census) misses the handshake target at top_k 8; the
    flat form (a sub-block's slots as one tile) meets it in the same configuration."""
    axes = ("--only", "_scatter", "--axis", "dtype=fp32", "--axis", "hidden=1024", "--axis", "TOP_K=8",
            "--axis", "SCALE=true", "--axis", "INT64=false", "--axis", "LAYOUT=0")
    old = _lower(*axes, "--set", "FLAT=false")
    assert old.returncode == 1, old.stdout + old.stderr
    missed = re.search(r"census: ([0-9.]+) scalar<->vector handshakes per row \(target <= 1\)", old.stdout)
    assert missed and float(missed.group(1)) > 4, old.stdout
    now = _lower(*axes)
    assert now.returncode == 0, now.stdout + now.stderr


@needs_backend
def test_gate_fails_a_count_whose_one_hot_has_its_items_along_the_last_axis():
    """The preparation's count as it was at 1024 experts (its one-hot ``[BLOCK_E, BLOCK_M]``, 4 items
    along the last axis: CUDA's form, NPU_FORM=0 and its 4 items a block set by hand): the compiler
    loops over the tile's 1024 rows with one 4-element compare and one select each, 516 small vector
    ops per item, which the census fails; the NPU's form (the keys along the last axis, in chunks of
    8 keys over 512 items a block) meets the target."""
    axes = ("--only", "_count", "--experts", "1024", "--axis", "index=i32")
    old = _lower(*axes, "--set", "NPU_FORM=false", "--set", "BLOCK_M=4")
    assert old.returncode == 1, old.stdout + old.stderr
    missed = re.search(r"census: ([0-9.]+) vector ops over fewer than 64 elements per row \(target <= 32\)",
                       old.stdout)
    assert missed and float(missed.group(1)) > 256, old.stdout
    now = _lower(*axes)
    assert now.returncode == 0, now.stdout + now.stderr
    small = re.search(r"most vector ops over fewer than 64 elements per row: ([0-9.]+) ", now.stdout)
    assert small and float(small.group(1)) <= 8, now.stdout


@needs_backend
def test_gate_fails_a_scan_along_the_last_axis():
    """The preparation's placement ranking items with a scan along its one-hot tile's last axis
    (tests/census_variants.py): a per-element scalar loop, which the census counts and fails."""
    r = _lower("--only", "_place", "--axis", "index=i32", "--axis", "PLACE=1", "--axis", "ROUTE=0",
               "--axis", "PADDED=false", "--variant", "_place=tests.census_variants")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "census: 1 per-element scalar loops in the kernel (target <= 0)" in r.stdout
