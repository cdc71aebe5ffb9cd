"""The Ascend compile gate (the package megablocks_ascend.lowering) in the project venv (standard triton).

The IR fixtures below are pieces of real triton-ascend 3.2.0 ``ttadapter`` output for our kernels
(constants and unrelated ops trimmed). The one test that lowers needs triton-ascend and is skipped
elsewhere; ``tools/ascend_lowering_env.sh`` runs the whole gate in its own venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megablocks_ascend import compat, devices
from megablocks_ascend.lowering import command, driver, ir, report, table
from megablocks_ascend.lowering.configs import configs
from megablocks_ascend.kernels import blocksparse, grouped, preparation, routing, routing_kernels

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------
# The configuration table against the kernels and the launchers.


def _constexpr_names(spec):
    return {k for k in spec.axes if k not in table.SIZE_AXES} | set(spec.derived)


@pytest.mark.parametrize("module", [routing_kernels, preparation, blocksparse, grouped],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_kernel_has_a_table(module):
    kernels = {name for name, obj in vars(module).items() if isinstance(obj, type(routing_kernels._gather))}
    short = module.__name__.rsplit(".", 1)[-1]
    assert kernels == {s.name for s in table.KERNELS if s.module == short}
    assert all(s.cube == (short == "blocksparse" and s.name != "_row_indices") for s in table.KERNELS
               if s.module == short)


@pytest.mark.parametrize("spec", table.KERNELS, ids=lambda s: s.name)
def test_table_names_match_kernel_signature(spec):
    runtime, constexpr = table.kernel_params(spec.kernel().fn)
    assert set(constexpr) == _constexpr_names(spec)
    for name in spec.data_ptrs:
        assert name in runtime
    cfg = next(c for c in configs([spec]))
    assert set(cfg.constexprs) == set(constexpr)
    # every non-pointer runtime argument gets a representative value
    assert set(cfg.scalars) == {n for n in runtime if n in cfg.scalars}
    assert set(cfg.scalars) | set(spec.data_ptrs) | _index_ptrs(spec.name) == set(runtime)


@pytest.mark.parametrize("spec", table.ROUTING_KERNELS, ids=lambda s: s.name)
def test_table_knows_which_kernels_unroll_top_k(spec):
    """Their Unified Buffer plan grows with top_k, so their launchers pass it to devices.tile."""
    import inspect
    source = inspect.getsource(spec.kernel().fn)
    assert spec.unrolls_top_k == ("static_range(TOP_K)" in source)


def _index_ptrs(name):
    return {"_sdd": {"offsets", "row_indices", "column_indices"},
            "_dsd": {"offsets", "indices", "block_offsets"},
            "_dds": {"offsets", "indices", "block_offsets"},
            "_row_indices": {"offsets"},
            "_gather": {"indices", "row_pos"},
            "_gather_tokens": {"slot_to_row", "bins", "padded_bins"},
            "_route_map": {"indices", "bins", "padded_bins", "slot_to_row"},
            "_row_map": {"bins", "padded_bins", "row_pos"},
            "_scatter": {"slot_to_row"},
            "_scatter_one": {"indices", "bins", "padded_bins"},
            "_wgrad": {"slot_to_row"},
            "_wgrad_one": {"indices", "bins", "padded_bins"},
            "_count": {"counts"},
            "_place": {"counts", "indices", "bin_ids", "tokens_per_expert", "bins", "padded_bins",
                       "slot_to_row"},
            "_zero_empty_groups": {"ends"},
            "_topology": {"padded_bins", "row_indices", "column_indices", "offsets", "column_indices_t",
                          "offsets_t", "block_offsets_t"}}[name]


def test_table_axes_cover_every_value():
    by_name = {s.name: s for s in table.KERNELS}
    assert set(by_name["_gather"].axes["MAPPED"]) == {False, True}  # dropless; padded and binned
    assert set(by_name["_row_map"].axes["LAYOUT"]) == {routing.PADDED, routing.BINNED}
    for name in ("_route_map", "_scatter_one", "_wgrad_one", "_gather_tokens"):
        assert set(by_name[name].axes["LAYOUT"]) == {routing.DROPLESS, routing.PADDED, routing.BINNED}
    for spec in table.KERNELS:
        for flag in ("SCALE", "INT64"):
            if flag in spec.axes:
                assert set(spec.axes[flag]) == {False, True}
        if "TOP_K" in spec.axes:
            assert 1 in spec.axes["TOP_K"] and max(spec.axes["TOP_K"]) > 1
        if "dtype" in spec.axes:
            assert set(spec.axes["dtype"]) == {"fp32", "fp16", "bf16"}
        if "hidden" in spec.axes:
            hs = spec.axes["hidden"]
            assert any(h % 16 == 0 for h in hs) and any(h % 16 for h in hs)


def test_configs_are_the_full_product():
    """The product of each kernel's axes, less the points its launchers cannot produce (``when``: the
    rows loaded through index_select_simd only with int32 offsets and whole feature tiles)."""
    cfgs = configs(experts=table.EXPERTS)
    for spec in table.KERNELS:
        n = 1
        for values in spec.axes.values():
            n *= len(values)
        mine = [c for c in cfgs if c.kernel == spec.name]
        if spec.when is None:
            assert len(mine) == n
        else:
            assert 0 < len(mine) < n and all(spec.when({**c.axes, **c.constexprs}) for c in mine)
            assert {c.axes["SELECT"] for c in mine} == {False, True}
            assert all(not c.axes["SELECT"] for c in mine if c.axes["INT64"] or not c.constexprs["EVEN_X"])
        assert len({c.label for c in mine}) == len(mine)


def test_the_table_adds_configurations_at_many_experts():
    """The table is the full product at EXPERTS and, for the routing kernels an NPU runs, a few
    configurations at 64 and 256 experts (and at top_k 8) whose census tests/test_census.py compares
    with EXPERTS': each has its counterpart at EXPERTS, with the same axes."""
    table_cfgs = configs()
    base = {(c.kernel, c.label) for c in configs(experts=table.EXPERTS)}
    extra = [c for c in table_cfgs if (c.kernel, c.label) not in base]
    assert len({(c.kernel, c.label) for c in table_cfgs}) == len(table_cfgs)
    many = {s.name for s in table.KERNELS if s.many}
    assert many == {"_gather", "_route_map", "_row_map", "_scatter", "_wgrad", "_count", "_place"}
    assert {c.kernel for c in extra} == many
    assert {c.experts for c in extra} == {table.EXPERTS, *table.MANY_EXPERTS}
    at_base = {(c.kernel, tuple(sorted(c.axes.items()))) for c in table_cfgs if c.experts == table.EXPERTS}
    for c in extra:
        assert c.experts == table.EXPERTS or (c.kernel, tuple(sorted(c.axes.items()))) in at_base, c.label
        assert c.experts == table.EXPERTS or f"E={c.experts}" in c.label
    assert any(c.axes.get("TOP_K") == 8 for c in extra if c.kernel == "_scatter")


class _Recorder:
    """Stands in for a routing Kernel: records the constexprs a launcher passes."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def launch(self, grid, *args, **kwargs):
        self.calls.append((self.name, kwargs))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, *args, **kwargs)


def _launcher_calls(monkeypatch, int64):
    calls = []
    for name in [s.name for s in table.ROUTING_KERNELS]:
        monkeypatch.setattr(routing_kernels, name, _Recorder(name, calls))
    if int64:
        monkeypatch.setattr(routing, "_INT32_LIMIT", 0)  # every tensor counts as huge
    monkeypatch.setattr(devices, "target", lambda device: "npu")  # the launchers choose NPU tiles
    routing.clear_plans()  # (plans made before the limit or the target changed)
    tokens = 4
    # every row-gather launcher of the module (gather_rows, and gather_tokens_rows where it exists)
    gathers = [getattr(routing, n) for n in ("gather_rows", "gather_tokens_rows") if hasattr(routing, n)]
    for dname, (_, tname, _) in table.DTYPES.items():
        dtype = getattr(torch, tname)
        for hidden in table.HIDDEN_SIZES:
            for top_k in table.TOP_KS:
                n = tokens * top_k
                x = torch.zeros(tokens, hidden, dtype=dtype)
                indices = torch.arange(n, dtype=torch.int32)
                bins = torch.tensor([n // 2, n] * (table.EXPERTS // 2), dtype=torch.int32).sort().values
                w = torch.ones(n, dtype=dtype)
                y = torch.zeros(n, hidden, dtype=dtype)
                s2r = torch.arange(n, dtype=torch.int32)
                # each launcher picks its tile itself, as on an NPU (devices.target is "npu" here)
                for weights in (None, w):
                    for layout in table.LAYOUTS:
                        for launcher in gathers:
                            launcher(x, indices, bins, bins, weights, layout=layout, num_rows=n, top_k=top_k,
                                     capacity=n, num_programs=1)
                    routing.scatter_rows(y, s2r, weights, num_tokens=tokens, top_k=top_k, num_programs=1)
                    for layout in table.LAYOUTS:
                        if top_k == 1:
                            routing.scatter_one_rows(y, indices, bins, bins, weights, layout=layout, capacity=n,
                                                     num_programs=1)
                routing.wgrad_rows(y, x, s2r, top_k=top_k, num_programs=1)
                if top_k == 1:
                    for layout in table.LAYOUTS:
                        routing.wgrad_one_rows(y, x, indices, bins, bins, layout=layout, capacity=n, num_programs=1)
                yield dname, hidden, calls
                calls.clear()
    for layout in table.LAYOUTS:
        routing.route_map(torch.arange(8, dtype=torch.int32), torch.tensor([4, 8], dtype=torch.int32)
                          .repeat_interleave(table.EXPERTS // 2), None, layout=layout, capacity=4,
                          block_m=table.ROUTE_MAP_BLOCK_M, num_programs=1)
        yield None, None, calls
        calls.clear()


@pytest.mark.parametrize("int64", [False, True])
@pytest.mark.parametrize("loads", ["auto", "select"])
def test_table_covers_every_launch(monkeypatch, int64, loads):
    """Every constexpr combination the launchers produce (on an NPU's tiles) is in the table, with the
    gathered rows loaded as ``devices.ROW_LOADS`` chose and through index_select_simd."""
    monkeypatch.setenv("MEGABLOCKS_ASCEND_ROW_LOADS", loads)
    gated = {}
    for cfg in configs():
        key = (cfg.kernel, cfg.axes.get("dtype"), cfg.axes.get("hidden"))
        gated.setdefault(key, []).append(cfg.constexprs)
    seen = 0
    for dname, hidden, calls in _launcher_calls(monkeypatch, int64):
        for kernel, kwargs in calls:
            spec = next(s for s in table.KERNELS if s.name == kernel)
            names = _constexpr_names(spec)
            assert names <= set(kwargs), f"{kernel}: launcher passes {sorted(kwargs)}"
            launched = {k: kwargs[k] for k in names}
            if kernel in ("_route_map", "_row_map") and launched["BLOCK_M"] == 64:
                # route_map's and row_map's default for CPU tensors (a launcher called them without block_m);
                # on a device it is ROUTE_MAP_BLOCK_M
                launched["BLOCK_M"] = table.ROUTE_MAP_BLOCK_M
            if "BLOCK_E" in launched:
                assert launched["BLOCK_E"] == devices.block_e(table.EXPERTS)
            key = (kernel, dname if "dtype" in spec.axes else None, hidden if "hidden" in spec.axes else None)
            assert launched in gated[key], f"{kernel} {dname} H={hidden}: {launched} not in the table"
            seen += 1
    assert seen > 0


def test_preparation_table_covers_every_launch(monkeypatch):
    """Every constexpr combination the routing preparation's launchers pass on an NPU (its tiles
    and a grid of PREP_PROGRAMS) is in the table: the preparation of int32 and int64 ids with
    each route map, and the megablocks_ops stand-in's sort and histogram."""
    calls = []
    for spec in table.PREPARATION_KERNELS:
        monkeypatch.setattr(preparation, spec.name, _Recorder(spec.name, calls))
    monkeypatch.setattr(routing_kernels, "_row_map", _Recorder("_row_map", []))  # (the row map's launch: a routing kernel)
    experts = table.EXPERTS
    tile = devices.prep_tile(experts, "npu")
    n = table.PREP_PROGRAMS * tile.block_m * 3  # every program gets work
    launch = dict(tile=tile, num_programs=table.PREP_PROGRAMS)
    seen = []
    for dtype, index in ((torch.int32, "i32"), (torch.int64, "i64")):
        ids = torch.zeros(n, dtype=dtype)
        for route in table.ROUTES:
            preparation.prepare_routing(ids, experts, 128 if route == routing.PADDED else 0, route, 4, **launch)
            seen.append((index, list(calls)))
            calls.clear()
    for dtype, index in ((torch.int16, "i16"), (torch.int32, "i32")):
        x = torch.zeros(n, dtype=dtype)
        preparation.sort(x, 3, torch.empty_like(x), torch.empty_like(x), **launch)  # 2**3 = EXPERTS keys
        preparation.histogram(x, experts, **launch)
        seen.append((index, list(calls)))
        calls.clear()
    gated = {}
    for cfg in configs(table.PREPARATION_KERNELS):
        gated.setdefault((cfg.kernel, cfg.axes["index"]), []).append(cfg.constexprs)
    kernels = set()
    for index, launches in seen:
        for kernel, kwargs in launches:
            spec = next(s for s in table.PREPARATION_KERNELS if s.name == kernel)
            launched = {k: kwargs[k] for k in _constexpr_names(spec)}
            assert launched in gated[(kernel, index)], f"{kernel} {index}: {launched} not in the table"
            kernels.add(kernel)
    assert kernels == {"_count", "_place"}


def _blocksparse_launches(monkeypatch, int64):
    """Calls the block-sparse launchers the ways stk and MegaBlocks do (dense operands contiguous
    or transposed views, both transposes of the sparse operand), with an NPU's tiles; yields the
    constexprs each launch passes."""
    calls = []
    for spec in table.CUBE_KERNELS:
        monkeypatch.setattr(blocksparse, spec.name, _Recorder(spec.name, calls))
    monkeypatch.setattr(compat, "dot_needs_float32", lambda dtype, device: False)  # as on an NPU
    if int64:
        monkeypatch.setattr(blocksparse, "_OFFSET_LIMIT", 0)
    b = table.CUBE_BLOCK
    one = torch.ones(1, dtype=torch.int16)
    offsets = torch.tensor([0, 1], dtype=torch.int32)
    block_offsets = torch.zeros(1, dtype=torch.int32)
    meta = (offsets, torch.zeros(1, dtype=torch.int16), torch.zeros(1, dtype=torch.int16), offsets,
            torch.zeros(1, dtype=torch.int16), block_offsets)

    def dense(rows, cols, dtype, column_major):
        return torch.zeros(cols, rows, dtype=dtype).t() if column_major else torch.zeros(rows, cols, dtype=dtype)

    for dname, (_, tname, _) in table.DTYPES.items():
        dtype = getattr(torch, tname)
        for hidden in table.HIDDEN_SIZES:
            tiles = {k: devices.cube_tile(k, dtype, b, hidden, "npu") for k in devices.CUBE_KINDS}
            data = torch.zeros(1, b, b, dtype=dtype)
            for lhs_cm in (False, True):
                for rhs_cm in (False, True):
                    blocksparse.sdd(dense(b, hidden, dtype, lhs_cm), dense(hidden, b, dtype, rhs_cm), (b, b),
                                    torch.zeros(1, b, b, dtype=dtype), offsets, meta[1], meta[2],
                                    tile=tiles["sdd"], num_programs=1)
            for transpose in (False, True):
                for cm in (False, True):
                    blocksparse.dsd((b, b), data, *meta, transpose, dense(b, hidden, dtype, cm),
                                    torch.zeros(b, hidden, dtype=dtype), tile=tiles["dsd"], num_programs=1)
                    blocksparse.dds(dense(hidden, b, dtype, cm), (b, b), data, *meta, transpose,
                                    torch.zeros(hidden, b, dtype=dtype), tile=tiles["dds"], num_programs=1)
            yield dname, hidden, calls
            calls.clear()
    for index in (torch.int16, torch.int32):
        blocksparse.row_indices((b, b), None, offsets, one, torch.zeros(1, dtype=index), num_programs=1)
        yield None, None, calls
        calls.clear()


@pytest.mark.parametrize("int64", [False, True])
def test_cube_table_covers_every_launch(monkeypatch, int64):
    """Every constexpr combination the block-sparse launchers pass on an NPU is in the table."""
    gated = {}
    for cfg in configs(table.CUBE_KERNELS):
        gated.setdefault((cfg.kernel, cfg.axes.get("dtype"), cfg.axes.get("hidden")), []).append(cfg.constexprs)
    seen = set()
    for dname, hidden, calls in _blocksparse_launches(monkeypatch, int64):
        for kernel, kwargs in calls:
            spec = next(s for s in table.CUBE_KERNELS if s.name == kernel)
            names = _constexpr_names(spec)
            assert names <= set(kwargs), f"{kernel}: launcher passes {sorted(kwargs)}"
            launched = {k: kwargs[k] for k in names}
            assert launched["INT64"] is int64 if "INT64" in launched else True
            assert launched in gated[(kernel, dname, hidden)], f"{kernel} {dname} H={hidden}: {launched}"
            seen.add(kernel)
    assert seen == {s.name for s in table.CUBE_KERNELS}


# --------------------------------------------------------------------------------------------
# Reading the IR (fixtures: real triton-ascend 3.2.0 ttadapter output, trimmed).

# A dsd K loop (GATHER=0, bf16, 128 x 256 x 64): two whole-tile DMAs, one index read, one matmul.
CUBE_K_LOOP = """\
      %20 = scf.for %arg23 = %c0_i32 to %19 step %c1_i32 iter_args(%arg24 = %1) -> (tensor<128x256xf32>)  : i32 {
        %reinterpret_cast_2 = memref.reinterpret_cast %arg2 to offset: [%36], sizes: [128, 64], strides: [%34, 1] : memref<?xbf16> to memref<128x64xbf16, strided<[?, 1], offset: ?>>
        %alloc = memref.alloc() : memref<128x64xbf16>
        memref.copy %reinterpret_cast_2, %alloc : memref<128x64xbf16, strided<[?, 1], offset: ?>> to memref<128x64xbf16>
        %37 = bufferization.to_tensor %alloc restrict writable : memref<128x64xbf16>
        %reinterpret_cast_3 = memref.reinterpret_cast %arg6 to offset: [%38], sizes: [1], strides: [1] : memref<?xi16> to memref<1xi16, strided<[1], offset: ?>>
        %39 = memref.load %reinterpret_cast_3[%c0] : memref<1xi16, strided<[1], offset: ?>>
        %reinterpret_cast_4 = memref.reinterpret_cast %arg3 to offset: [%49], sizes: [64, 256], strides: [%46, 1] : memref<?xbf16> to memref<64x256xbf16, strided<[?, 1], offset: ?>>
        %alloc_5 = memref.alloc() : memref<64x256xbf16>
        memref.copy %reinterpret_cast_4, %alloc_5 : memref<64x256xbf16, strided<[?, 1], offset: ?>> to memref<64x256xbf16>
        %50 = bufferization.to_tensor %alloc_5 restrict writable : memref<64x256xbf16>
        %51 = linalg.matmul {input_precison = "ieee"} ins(%37, %50 : tensor<128x64xbf16>, tensor<64x256xbf16>) outs(%arg24 : tensor<128x256xf32>) -> tensor<128x256xf32>
        scf.yield %51 : tensor<128x256xf32>
      }
"""
CUBE_TILE_STORE = ("      bufferization.materialize_in_destination %22 in writable %reinterpret_cast_1 : "
                   "(tensor<128x256xbf16>, memref<128x256xbf16, strided<[?, 1], offset: ?>>) -> ()\n")
# A column-major tile loaded as it lies (no transpose on chip): a copy with inner stride != 1.
STRIDED_COPY = ("        memref.copy %reinterpret_cast_3, %alloc_4 : memref<128x128xbf16, strided<[1, ?], offset: ?>> "
                "to memref<128x128xbf16>\n")
# The masked K tail of sdd: a dynamic-size sub-tile copy, still one DMA.
MASKED_COPY = ("        memref.copy %subview, %subview_4 : memref<128x?xbf16, strided<[?, 1], offset: ?>> "
               "to memref<128x?xbf16, strided<[128, 1]>>\n")
SCALAR_DATA_LOAD = "        %99 = memref.load %reinterpret_cast_9[%c0] : memref<1xbf16, strided<[1], offset: ?>>\n"


def _cube_module(k_loop: str, store: str = CUBE_TILE_STORE) -> str:
    return ('module {\n  func.func @_dsd(%arg0: memref<?xi8>) attributes {mix_mode = "mix"} {\n'
            "    scf.for %arg22 = %arg19 to %5 step %arg16  : i32 {\n" + k_loop + store +
            "    }\n    return\n  }\n}\n")


def test_cube_k_loop_counts():
    res = ir.analyze_cube_ir(_cube_module(CUBE_K_LOOP))
    assert res == dict(mmad=1, tile_dma=2, strided_dma=0, transposes=0, scalar_k=1, scalar_data_k=0,
                       discrete_k=0, tile_stores=1, k_loops=1, mix_mode="mix")
    assert ir.cube_problems(res) == []


def test_cube_gate_rejects_strided_tiles_scalar_data_and_missing_matmul():
    def problems(module):
        return ir.cube_problems(ir.analyze_cube_ir(module))
    strided = CUBE_K_LOOP.replace("        %51 = linalg.matmul", STRIDED_COPY + "        %51 = linalg.matmul")
    assert any("non-unit inner stride" in p for p in problems(_cube_module(strided)))
    scalar = CUBE_K_LOOP.replace("        %51 = linalg.matmul", SCALAR_DATA_LOAD + "        %51 = linalg.matmul")
    assert any("scalar data accesses" in p for p in problems(_cube_module(scalar)))
    no_dot = CUBE_K_LOOP.replace("linalg.matmul", "linalg.generic")
    assert any("tl.dot did not lower" in p for p in problems(_cube_module(no_dot)))
    assert any("whole-tile store" in p for p in problems(_cube_module(CUBE_K_LOOP, store="")))
    masked = CUBE_K_LOOP.replace("        %51 = linalg.matmul", MASKED_COPY + "        %51 = linalg.matmul")
    assert ir.analyze_cube_ir(_cube_module(masked))["tile_dma"] == 3 and problems(_cube_module(masked)) == []


def test_format_table_has_a_cube_table():
    cube = dict(kernel="_dsd", config="bf16 H=1024", status="ok", cube=True, mix_mode="mix", mmad=1, tile_dma=2,
                transposes=0, scalar_k=1, scalar_data_k=0, tile_stores=1,
                cube_bytes=dict(l0a=32768, l0b=65536, l0c=131072, l1=98304))
    text = report.format_table([_result("_scatter", "ok"), cube])
    lines = text.splitlines()
    assert lines[-1] == "lowered: 2/2"
    head = next(line for line in lines if line.startswith("kernel") and "matmul" in line)
    assert "L0C model" in head and "L0C planned" in head and "tile DMA" in head
    assert any(line.startswith("_dsd") and "131072" in line and "98304" in line for line in lines)


ROW_COPY_LOOP = """\
      scf.for %arg20 = %c0_i32 to %arg11 step %c512_i32  : i32 {
        %38 = linalg.fill ins(%arg20 : i32) outs(%7 : tensor<512xi32>) -> tensor<512xi32>
        %39 = arith.addi %38, %8 : tensor<512xi32>
        %40 = arith.cmpi slt, %39, %13 : tensor<512xi32>
        %alloc_5 = memref.alloc() : memref<32x512xf16>
        scf.for %arg21 = %c0 to %c32 step %c1 {
          %extracted = tensor.extract %25[%arg21] {DiscreteMemAccess} : tensor<32xi32>
          %55 = arith.divsi %extracted, %c2_i32 : i32
          %56 = arith.muli %55, %arg11 : i32
          %57 = arith.index_cast %56 : i32 to index
          %58 = arith.index_cast %arg20 : i32 to index
          %59 = arith.addi %57, %58 : index
          %reinterpret_cast_8 = memref.reinterpret_cast %arg2 to offset: [%59], sizes: [1, 512], strides: [512, 1] : memref<?xf16> to memref<1x512xf16, strided<[512, 1], offset: ?>>
          %subview_9 = memref.subview %alloc_5[%arg21, 0] [1, 512] [1, 1] : memref<32x512xf16> to memref<1x512xf16, strided<[512, 1], offset: ?>>
          memref.copy %reinterpret_cast_8, %subview_9 : memref<1x512xf16, strided<[512, 1], offset: ?>> to memref<1x512xf16, strided<[512, 1], offset: ?>>
        } {ExtractedLoadOrStore, hivm.parallel_loop}
        %42 = bufferization.to_tensor %alloc_5 restrict writable : memref<32x512xf16>
      }
"""

SCALAR_GATHER_LOOP = """\
      %31 = scf.for %arg20 = %c0 to %c32 step %c1 iter_args(%arg21 = %2) -> (tensor<32xf16>) {
        %extracted = tensor.extract %25[%arg20] {DiscreteMemAccess} : tensor<32xi32>
        %38 = arith.index_cast %extracted : i32 to index
        %reinterpret_cast_4 = memref.reinterpret_cast %arg7 to offset: [%38], sizes: [1], strides: [1] : memref<?xf16> to memref<1xf16, strided<[1], offset: ?>>
        %39 = memref.load %reinterpret_cast_4[%c0] : memref<1xf16, strided<[1], offset: ?>>
        %inserted = tensor.insert %39 into %arg21[%arg20] : tensor<32xf16>
        scf.yield {DiscreteMemAccess} %inserted : tensor<32xf16>
      } {ExtractedLoadOrStore}
"""

SCALAR_STORE_LOOP = """\
      scf.for %arg16 = %c0 to %c128 step %c1 {
        %extracted = tensor.extract %18[%arg16] {DiscreteMemAccess} : tensor<128xi32>
        %20 = arith.index_cast %extracted : i32 to index
        %reinterpret_cast_1 = memref.reinterpret_cast %arg5 to offset: [%20], sizes: [1], strides: [1] : memref<?xi32> to memref<1xi32, strided<[1], offset: ?>>
        %extracted_2 = tensor.extract %19[%arg16] {DiscreteMemAccess} : tensor<128xi32>
        %27 = arith.cmpi slt, %extracted, %arg6 : i32
        scf.if %27 {
          %inserted = tensor.insert %extracted_2 into %0[%c0] : tensor<1xi32>
          bufferization.materialize_in_destination %inserted in writable %reinterpret_cast_1 : (tensor<1xi32>, memref<1xi32, strided<[1], offset: ?>>) -> ()
        }
      } {ExtractedLoadOrStore}
"""


# A row store whose row offsets are an index vector and whose mask is only the column bound.
ROW_STORE_LOOP = """\
    scf.for %arg13 = %c0 to %c16 step %c1 {
      %extracted = tensor.extract %0[%arg13] {DiscreteMemAccess} : tensor<16xi32>
      %3 = arith.muli %extracted, %arg6 : i32
      %4 = arith.index_cast %3 : i32 to index
      %reinterpret_cast_2 = memref.reinterpret_cast %arg3 to offset: [%4], sizes: [1, 512], strides: [512, 1] : memref<?xf16> to memref<1x512xf16, strided<[512, 1], offset: ?>>
      %extracted_slice = tensor.extract_slice %2[%arg13, 0] [1, 512] [1, 1] {DiscreteMemAccess} : tensor<16x512xf16> to tensor<1x512xf16>
      %5 = arith.maxsi %1, %c0 : index
      %6 = arith.minsi %5, %c512 : index
      %extracted_slice_3 = tensor.extract_slice %extracted_slice[0, 0] [1, %6] [1, 1] : tensor<1x512xf16> to tensor<1x?xf16>
      %subview = memref.subview %reinterpret_cast_2[0, 0] [1, %6] [1, 1] : memref<1x512xf16, strided<[512, 1], offset: ?>> to memref<1x?xf16, strided<[512, 1], offset: ?>>
      bufferization.materialize_in_destination %extracted_slice_3 in writable %subview : (tensor<1x?xf16>, memref<1x?xf16, strided<[512, 1], offset: ?>>) -> ()
    } {ExtractedLoadOrStore}
"""

# The same store with a mask that depends on the loaded row index: element-wise scalar stores.
MASKED_ROW_STORE_LOOP = """\
    scf.for %arg13 = %c0 to %c16 step %c1 {
      scf.for %arg14 = %c0 to %c512 step %c1 {
        %extracted = tensor.extract %0[%arg13] {DiscreteMemAccess} : tensor<16xi32>
        %3 = arith.muli %extracted, %arg6 : i32
        %8 = arith.index_cast %3 : i32 to index
        %reinterpret_cast_2 = memref.reinterpret_cast %arg3 to offset: [%8], sizes: [1], strides: [1] : memref<?xf16> to memref<1xf16, strided<[1], offset: ?>>
        %extracted_3 = tensor.extract %2[%arg13, %arg14] {DiscreteMemAccess} : tensor<16x512xf16>
        %9 = arith.cmpi sge, %extracted, %c0_i32 : i32
        scf.if %9 {
          %14 = tensor.empty() : tensor<1xf16>
          %inserted = tensor.insert %extracted_3 into %14[%c0] : tensor<1xf16>
          bufferization.materialize_in_destination %inserted in writable %reinterpret_cast_2 : (tensor<1xf16>, memref<1xf16, strided<[1], offset: ?>>) -> ()
        }
      } {ExtractedLoadOrStore}
    } {ExtractedLoadOrStore}
"""


def _in_feature_loop(body: str) -> str:
    return ("      scf.for %arg20 = %c0_i32 to %arg11 step %c512_i32  : i32 {\n" + body + "      }\n")


def test_row_store_is_row_dma():
    res = ir.analyze_ir(_module(_in_feature_loop(ROW_STORE_LOOP)), block_x=512)
    assert res["row_dma"] == 1 and res["row_dma_hot"] == 1 and res["scalar_hot"] == 0


def test_masked_row_store_is_scalar_and_counted_once():
    res = ir.analyze_ir(_module(_in_feature_loop(MASKED_ROW_STORE_LOOP)), block_x=512)
    assert res["row_dma"] == 0
    assert res["scalar_hot"] == 1  # one static scalar store op, in a loop nest over rows x columns
    assert res["discrete_loops"] == 1


def _module(body: str) -> str:
    return ("module {\n  func.func @k(%arg0: memref<?xi8>) {\n"
            "    %c512_i32 = arith.constant 512 : i32\n    %c32 = arith.constant 32 : index\n"
            "    scf.for %arg19 = %arg16 to %10 step %arg13  : i32 {\n" + body +
            "    }\n    return\n  }\n}\n")


def test_row_copy_is_counted_as_row_dma_not_scalar():
    res = ir.analyze_ir(_module(ROW_COPY_LOOP), block_x=512)
    assert res["row_dma"] == 1 and res["row_dma_hot"] == 1
    assert res["parallel_loops"] == 1 and res["feature_loops"] == 1
    assert res["scalar_hot"] == 0 and res["scalar_row"] == 0
    assert res["int_vec_hot"] == 1  # the i32 vector compare of the column mask


def test_scalar_gather_outside_feature_loop_is_per_row():
    res = ir.analyze_ir(_module(SCALAR_GATHER_LOOP + ROW_COPY_LOOP), block_x=512)
    assert res["scalar_row"] == 1 and res["scalar_hot"] == 0
    assert res["discrete_loops"] == 2 and res["parallel_loops"] == 1


def test_scalar_gather_inside_feature_loop_is_hot():
    hot = ROW_COPY_LOOP.replace("        %42 = bufferization", SCALAR_GATHER_LOOP + "        %42 = bufferization")
    res = ir.analyze_ir(_module(hot), block_x=512)
    assert res["scalar_hot"] == 1 and res["scalar_row"] == 0
    # without BLOCK_X nothing is a feature loop
    res = ir.analyze_ir(_module(hot), block_x=None)
    assert res["scalar_hot"] == 0 and res["scalar_row"] == 1


def test_scalar_store_is_counted():
    res = ir.analyze_ir(_module(SCALAR_STORE_LOOP), block_x=None)
    assert res["scalar_row"] == 1 and res["row_dma"] == 0


def test_unmarked_scalar_access_in_feature_loop_is_hot():
    module = _module(ROW_COPY_LOOP.replace(
        "        %42 = bufferization",
        "        %99 = memref.load %alloc_5[%c0, %c0] : memref<32x512xf16>\n        %42 = bufferization"))
    res = ir.analyze_ir(module, block_x=512)
    assert res["scalar_hot"] == 1 and res["scalar_unmarked"] == 1


def test_parse_loops_reads_closing_attributes():
    roots, consts = ir.parse_loops(_module(ROW_COPY_LOOP))
    assert consts["%c512_i32"] == 512 and consts["%c32"] == 32
    (outer,) = roots
    (feature,) = outer.children
    (rows,) = feature.children
    assert "hivm.parallel_loop" in rows.attrs and feature.attrs == ""


# --------------------------------------------------------------------------------------------
# The report and the command.


def _result(kernel, status, **kw):
    row = dict(kernel=kernel, config="fp16 H=1000", status=status, row_dma=1, scalar_hot=0, scalar_row=0,
               int_vec_hot=1, ub_bytes=98624, error="")
    row.update(kw)
    return row


def test_format_table_last_line_and_failures():
    text = report.format_table([_result("_scatter", "ok"),
                                  _result("_gather", "FAIL", error="NameError: DROPLESS", row_dma=None)])
    lines = text.splitlines()
    assert lines[-1] == "lowered: 1/2"
    assert lines[0].split()[:3] == ["kernel", "configuration", "status"]
    assert "UB model" in lines[0] and "row DMA" in lines[0] and "scalar/hot" in lines[0]
    assert any(line.startswith("  _gather [fp16 H=1000]: NameError: DROPLESS") for line in lines)
    assert any(line.split()[0] == "_scatter" and "98624" in line for line in lines[2:])


def test_missing_triton_ascend_error(monkeypatch):
    monkeypatch.setattr(driver, "have_triton_ascend", lambda: False)
    with pytest.raises(driver.TritonAscendMissing, match="tools/ascend_lowering_env.sh"):
        driver.Lowerer()
    args = argparse.Namespace(json=None, dump=None, only=None, arch=driver.TARGET_ARCH, argv=["lower"])
    assert command.main(args) == 2


@pytest.mark.skipif(driver.have_triton_ascend(), reason="triton-ascend is installed here")
def test_lower_command_without_triton_ascend_fails_clearly():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "megablocks_ascend", "lower"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "triton-ascend is not installed" in proc.stderr
    assert "tools/ascend_lowering_env.sh" in proc.stderr


def test_subcommand_table():
    from megablocks_ascend import __main__ as cli
    assert "lower" in cli.SUBCOMMANDS
    args = cli.build_parser().parse_args(["lower", "--json", "r.json", "--dump", "ir"])
    assert (args.command, args.json, args.dump) == ("lower", "r.json", "ir")


@pytest.mark.skipif(not driver.have_triton_ascend(), reason="needs triton-ascend (tools/ascend_lowering_env.sh)")
def test_lower_one_kernel(tmp_path):
    # In a fresh process: this one imported triton with the interpreter on (megablocks_ascend/__init__).
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "megablocks_ascend", "lower", "--only", "_scatter",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert results and all(r["status"] == "ok" and r["row_dma"] >= 1 for r in results)
    assert proc.stdout.splitlines()[-1] == f"lowered: {len(results)}/{len(results)}"


def test_block_e_is_a_power_of_two_covering_the_experts():
    for e, want in ((0, 2), (1, 2), (2, 2), (3, 4), (8, 8), (9, 16), (64, 64), (65, 128)):
        assert devices.block_e(e) == want


def test_tool_crashes_are_retried_and_reported_but_compile_errors_are_not():
    """A backend tool killed by a signal is tried again (and the retry reported); a normal compile
    error, or a crash that repeats, fails the configuration."""
    crash = subprocess.CalledProcessError(-6, ["triton-adapter-opt"])
    error = subprocess.CalledProcessError(1, ["triton-adapter-opt"])

    class Flaky:
        def __init__(self, failures):
            self.failures, self.calls = list(failures), 0

        def lower(self, spec, cfg):
            self.calls += 1
            if self.failures:
                raise self.failures.pop(0)
            return "ttir", "ir"

    spec, cfg = table.KERNELS[0], None
    flaky = Flaky([crash])
    assert driver.lower_retrying_tool_crashes(flaky, spec, cfg) == ("ttir", "ir", 1)
    with pytest.raises(subprocess.CalledProcessError):
        driver.lower_retrying_tool_crashes(Flaky([error]), spec, cfg)
    always = Flaky([crash] * (driver.TOOL_CRASH_RETRIES + 1))
    with pytest.raises(subprocess.CalledProcessError):
        driver.lower_retrying_tool_crashes(always, spec, cfg)
    assert always.calls == driver.TOOL_CRASH_RETRIES + 1
    text = report.format_table([_result("_scatter", "ok", tool_crashes=1)])
    assert "tool crashes retried" in text and text.splitlines()[-1] == "lowered: 1/1"


@pytest.mark.parametrize("int64", [False, True])
def test_fill_table_covers_every_launch(monkeypatch, int64):
    """The zero fill of empty groups: every constexpr combination its launcher passes with an NPU's
    tile, at the table's group sizes, is in the table."""
    gated = {(c.axes["dtype"], c.axes["hidden"]): c.constexprs for c in configs(table.GROUPED_KERNELS)
             if c.axes["INT64"] is int64}
    calls = []
    monkeypatch.setattr(grouped, "_zero_empty_groups", _Recorder("_zero_empty_groups", calls))
    if int64:
        monkeypatch.setattr(grouped, "_INT32_LIMIT", 1)
    for dname, (_, tname, _) in table.DTYPES.items():
        dtype = getattr(torch, tname)
        for hidden in table.HIDDEN_SIZES:
            out = torch.empty(2, table.FILL_ROWS, hidden, dtype=dtype)
            grouped.zero_empty_groups(out, torch.tensor([0, 5]), block=devices.fill_block(dtype, "npu"),
                                      num_programs=1)
            (_, kwargs), = calls
            calls.clear()
            assert kwargs == gated[(dname, hidden)], (dname, hidden)
