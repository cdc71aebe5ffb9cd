"""The compile gate's per-row pipeline census (megablocks_ascend.lowering.census) and the census
the gate recorded for every configuration (tests/data/ascend_census.json), held against the targets
without the compiler.

The fixture is a planned module (``module.hivm.opt.mlir``) in the form bishengir-compile 1.2.0 writes,
cut down to what the census reads: the entry function's signature (three arguments the compiler adds,
then the kernel's), a loop over sub-blocks, a feature-tile loop bounded by the ``hidden`` argument, a
per-row store loop that carries a one-element cast through a one-element buffer, a scan of the experts'
vector by the scalar unit before the loops, and a masked tail's fill the compiler marks unlikely.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from megablocks_ascend.lowering import census, table
from megablocks_ascend.lowering.configs import configs

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "ascend_census.json"

# Recorded compiler output read by pure Python: the same at every point (CI: the current one only).
pytestmark = pytest.mark.one_point

UB = "#hivm.address_space<ub>"
GM = "#hivm.address_space<gm>"
DYN = f"memref<?xbf16, strided<[?], offset: ?>, {UB}>"
MODULE = f"""\
module {{
  func.func @k_infer_task_type_function() -> i8 {{
    %c10_i8 = arith.constant 10 : i8
    return %c10_i8 : i8
  }}
  func.func private @vcast_bfloat16_t_to_float_1d_with_mode({DYN}, {DYN}, i32) attributes {{hacc.always_inline}}
  func.func @k(%arg0: i64 {{hacc.arg_type = #hacc.arg_type<ffts_base_address>}}, %arg1: memref<?xi8, {GM}> {{hacc.arg_type = #hacc.arg_type<sync_block_lock>}}, %arg2: memref<?xi8, {GM}> {{hacc.arg_type = #hacc.arg_type<workspace>}}, %arg3: memref<?xbf16, {GM}> {{tt.divisibility = 16 : i32}}, %arg4: i32 {{tt.divisibility = 16 : i32}}, %arg5: i32, %arg6: i32, %arg7: i32, %arg8: i32) attributes {{hacc.entry, hivm.func_core_type = #hivm.func_core_type<AIV>}} {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %c8 = arith.constant 8 : index
    %c16 = arith.constant 16 : index
    %c0_i32 = arith.constant 0 : i32
    %c512_i32 = arith.constant 512 : i32
    %c0_i64 = arith.constant 0 : i64
    %c64_i64 = arith.constant 64 : i64
    %0 = hivm.hir.pointer_cast(%c0_i64) : memref<8xi32, {UB}>
    %1 = hivm.hir.pointer_cast(%c64_i64) : memref<1xbf16, {UB}>
    %2 = hivm.hir.pointer_cast(%c64_i64) : memref<16x512xbf16, {UB}>
    scf.for %arg9 = %c1 to %c8 step %c1 {{
      %3 = memref.load %0[%arg9] : memref<8xi32, {UB}>
      memref.store %3, %0[%arg9] : memref<8xi32, {UB}>
    }}
    scf.for %arg10 = %arg6 to %arg4 step %arg6  : i32 {{
      scf.if %true {{
        hivm.hir.set_flag[<PIPE_V>, <PIPE_MTE2>, <EVENT_ID0>]
        hivm.hir.wait_flag[<PIPE_V>, <PIPE_MTE2>, <EVENT_ID0>]
      }} {{hivm.unlikely_condition}}
      scf.for %arg11 = %c0_i32 to %arg5 step %c512_i32  : i32 {{
        scf.for %arg12 = %c0 to %c16 step %c1 {{
          %4 = memref.load %0[%c0] {{DiscreteMemAccess}} : memref<8xi32, {UB}>
          memref.store %5, %1[%c0] : memref<1xbf16, {UB}>
          hivm.hir.set_flag[<PIPE_S>, <PIPE_V>, <EVENT_ID0>]
          hivm.hir.wait_flag[<PIPE_S>, <PIPE_V>, <EVENT_ID0>]
          %cast_1 = memref.cast %1 : memref<1xbf16, {UB}> to {DYN}
          func.call @vcast_bfloat16_t_to_float_1d_with_mode(%cast_1, %cast_1, %c0_i32) : ({DYN}, {DYN}, i32) -> ()
          hivm.hir.set_flag[<PIPE_V>, <PIPE_MTE3>, <EVENT_ID0>]
          hivm.hir.wait_flag[<PIPE_V>, <PIPE_MTE3>, <EVENT_ID0>]
          hivm.hir.pipe_barrier[<PIPE_MTE3>]
          %subview = memref.subview %2[%arg12, 0] [1, 512] [1, 1] : memref<16x512xbf16, {UB}> to memref<1x512xbf16, strided<[512, 1], offset: ?>, {UB}>
          %cast_2 = memref.cast %subview : memref<1x512xbf16, strided<[512, 1], offset: ?>, {UB}> to {DYN}
          func.call @store_ubuf_to_gm_1d_bfloat16_t(%cast_2, %cast_9, %c0_i32) : ({DYN}, memref<?xbf16, {GM}>, i32) -> ()
        }} {{ExtractedLoadOrStore, pipeline.veconly}}
      }}
    }}
    hivm.hir.pipe_barrier[<PIPE_ALL>]
    return
  }}
}}
"""
# The kernel's own arguments, as its Python signature names them: a pointer, then four scalars
# (the sub-blocks, hidden, the first block, the grid's x dimension comes after them).
RUNTIME = ["x", "blocks", "hidden", "first", "unused"]


def test_census_counts_a_row_of_the_hot_loop():
    module = census.read(MODULE)
    assert module["args"] == ["%arg3", "%arg4", "%arg5", "%arg6", "%arg7", "%arg8"]
    got = census.census(module, dict(blocks=64, hidden=1024, first=0, unused=0), RUNTIME, rows=16)
    # per sub-block: 2 feature tiles x 16 rows x (4 flags, 1 S<>V set, 1 MTE3 barrier, 1 one-element
    # cast, 1 row store of 512 bf16, 1 + 1 scalar UB accesses); divided by the 16 rows
    assert got["flags"] == 8 and got["flags_by_pair"] == {"S>V": 4, "V>MTE3": 4}
    assert got["handshakes_sv"] == 2
    assert got["barriers_mte3"] == 2 and got["barriers"] == 2
    assert got["vector_1"] == 2 and got["vector_lt64"] == 2 and got["vector_ops"] == 2
    assert got["small_ops"] == {"vcast_bfloat16_t_to_float_1d_with_mode x1": 2}
    assert got["row_stores"] == 2 and got["dma"] == 2 and got["dma_bytes"] == 2048
    assert got["scalar_ub"] == 4 and got["scalar_gm"] == 0
    # the scan of the experts' vector before the loop: a per-element scalar loop, once per program
    assert got["scalar_loops"] == 1 and got["scalar_loop_iters"] == 0
    assert got["per_program"]["scalar_loop_iters"] == 7 and got["per_program"]["scalar_ub"] == 14
    assert got["hot_loops"] == 1 and got["unknown_trips"] == []
    # the feature-tile loop's trips come from the hidden argument
    wider = census.census(module, dict(blocks=64, hidden=4096, first=0, unused=0), RUNTIME, rows=16)
    assert wider["flags"] == 32 and wider["row_stores"] == 8


def test_a_trip_count_that_depends_on_data_is_named():
    module = census.read(MODULE)
    got = census.census(module, dict(blocks=64, first=0, unused=0), RUNTIME, rows=16)  # hidden unknown
    assert got["flags"] == 4 and len(got["unknown_trips"]) == 1  # counted once
    assert "%arg5" in got["unknown_trips"][0]


def test_a_module_without_a_kernel_is_refused():
    with pytest.raises(census.PlanError, match="no device entry function"):
        census.read("module {\n}\n")


def test_targets():
    good = dict(vector_1=0, scalar_loops=0, handshakes_sv=1, row_stores=0, vector_i64=0, vector_lt64=32)
    assert census.problems(good, chosen=True) == []
    assert census.problems(dict(good, vector_1=0.5), chosen=False) == [
        "census: 0.5 one-element vector ops per row in a hot loop (target <= 0)"]
    assert census.problems(dict(good, scalar_loops=1), chosen=False) == [
        "census: 1 per-element scalar loops in the kernel (target <= 0)"]
    # the store-form targets hold only where an NPU runs the kernel
    worse = dict(good, handshakes_sv=1.5, row_stores=2, vector_lt64=516)
    assert census.problems(worse, chosen=False) == []
    assert len(census.problems(worse, chosen=True)) == 3
    assert census.problems(dict(good, vector_lt64=516), chosen=True) == [
        "census: 516 vector ops over fewer than 64 elements per row (target <= 32)"]
    assert census.problems(dict(good, row_stores=2), chosen=True, inherent_row_stores=2) == []
    assert census.problems(dict(good, vector_i64=1), chosen=True, int64=True) == []
    assert census.problems(dict(good, vector_i64=1), chosen=True) == [
        "census: 1 int64 vector ops per row in a hot loop (target 0)"]


# ---------------------------------------------------------------------------------------------
# The recorded census: the gate's own figures for every configuration of the table.


def _record():
    return json.loads(RECORD.read_text())


def test_recorded_census_covers_every_configuration_of_the_table():
    recorded = {(e["kernel"], e["config"]) for e in _record()["census"]}
    wanted = {(c.kernel, c.label) for c in configs()}
    assert wanted <= recorded, f"not recorded: {sorted(wanted - recorded)[:5]} (tools/ascend_memory_plans.sh records it)"


def test_recorded_census_meets_every_target():
    specs = {s.name: s for s in table.KERNELS}
    missed = []
    for e in _record()["census"]:
        spec = specs[e["kernel"]]
        assert e["npu_chosen"] == spec.npu_chosen and e["inherent_row_stores"] == spec.inherent_row_stores(e["axes"])
        got = census.problems(e["figures"], chosen=spec.npu_chosen, inherent_row_stores=e["inherent_row_stores"],
                              int64=bool(e["axes"].get("INT64")))
        if got:
            missed.append((e["kernel"], e["config"], got))
    assert not missed, missed[:5]


def test_recorded_census_is_of_todays_kernels():
    """The record names the source of each kernel it was made from; a kernel changed since fails
    here until the census is recorded again (tools/ascend_memory_plans.sh records it)."""
    digests = {s.name: table.source_digest(s) for s in table.KERNELS}
    stale = sorted({e["kernel"] for e in _record()["census"] if e["digest"] != digests[e["kernel"]]})
    assert not stale, f"kernels changed since the census was recorded: {stale} (tools/ascend_memory_plans.sh records it)"


# ---------------------------------------------------------------------------------------------
# Many experts (issue 33): the routing kernels an NPU runs cost per row at 64 and 256 experts what
# they cost at EXPERTS, and keep their tiles.

MANY_EXPERTS_FLAGS = 1.25  # set/wait flags per row at many experts, at most this times EXPERTS'


def _tile_size(entry) -> int:
    """The elements of a configuration's work tile: rows x features for the row kernels, the one-hot
    of the preparation (items x keys: its count compares CHUNK keys at a time, its placement all of
    them, so the placement's items per block shrink as the keys grow while its tile does not), items
    for the walks of the maps."""
    t = entry["tile"]
    if "BLOCK_X" in t:
        return t["BLOCK_M"] * t["BLOCK_X"]
    if entry["kernel"] in ("_count", "_place"):
        return t["BLOCK_M"] * t.get("CHUNK", t["BLOCK_E"])
    return t["BLOCK_M"]


def test_recorded_census_at_many_experts_matches_eight_experts():
    """Every configuration the table holds at 64 and 256 experts (KernelSpec.many: _gather, _scatter,
    _wgrad, the route and row maps, the preparation's count and placement; top_k up to 8) has at most
    1.25x the set/wait flags per row of the same configuration at EXPERTS, and a tile no smaller."""
    specs = {s.name for s in table.KERNELS if s.many}
    entries = [e for e in _record()["census"] if e["kernel"] in specs]
    at_base = {(e["kernel"], json.dumps(e["axes"], sort_keys=True)): e for e in entries if e["experts"] == table.EXPERTS}
    compared, worse = set(), []
    for e in entries:
        if e["experts"] not in table.MANY_EXPERTS:  # (the record also has 128 and 1024 experts' preparation)
            continue
        base = at_base[(e["kernel"], json.dumps(e["axes"], sort_keys=True))]
        flags, flags8 = e["figures"]["flags"], base["figures"]["flags"]
        if flags > MANY_EXPERTS_FLAGS * flags8 or _tile_size(e) < _tile_size(base):
            worse.append((e["kernel"], e["config"], flags, flags8, e["tile"], base["tile"]))
        compared.add((e["kernel"], e["experts"]))
    assert not worse, worse[:5]
    assert compared == {(k, n) for k in specs for n in table.MANY_EXPERTS}
