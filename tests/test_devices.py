"""Device facts (grid size, tile sizes, the Unified Buffer budget) and the Triton compat layer."""

import types

import pytest
import torch

from megablocks_ascend import compat, devices


@pytest.mark.parametrize("kind", sorted(devices.UB_MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [1, 7, 16, 1000, 1024, 4096, 7168])
@pytest.mark.parametrize("top_k, experts", [(1, 1), (2, 8), (8, 256)])
def test_npu_tiles_fit_the_unified_buffer_and_are_aligned(kind, dtype, hidden, top_k, experts):
    t = devices.tile(kind, dtype, hidden, "npu", top_k=top_k, num_experts=experts)
    es = torch.empty((), dtype=dtype).element_size()

    def model(block_m):
        return devices.ub_bytes(kind, block_m, t.block_x, es, even=hidden % t.block_x == 0, top_k=top_k,
                                block_e=devices.block_e(experts))
    # The model of the plan fits the UB minus the reserve (or the tile is down to one row of 128) ...
    assert model(t.block_m) <= devices.UB_BYTES - devices.UB_RESERVE or t.block_m == 1
    # ... one row only where a narrower feature tile would not buy a second one ...
    assert t.block_m > 1 or t.block_x <= 128 or t.block_x == max(devices._next_pow2(hidden), 16)
    # ... and the sub-block is as large as the budget allows (doubling it would not fit), up to 64.
    assert t.block_m == 64 or model(2 * t.block_m) > devices.UB_BYTES - devices.UB_RESERVE
    # Tiles are powers of two of whole 32-byte UB blocks.
    assert t.block_x & (t.block_x - 1) == 0 and t.block_m & (t.block_m - 1) == 0
    assert (t.block_x * es) % devices.UB_BLOCK_BYTES == 0


def test_ub_bytes_is_the_documented_formula():
    m = devices.UB_MODELS["scatter"]
    bm, bx, es, k, be = 8, 512, 2, 4, 16
    per_element = es * m.dtype_copies + 4 * m.f32_copies + m.masks + (k - 1) * (es * m.dtype_copies_k + 4 * m.f32_copies_k)
    live = bm * bx * per_element + bm * (m.per_row + 4 * be * m.per_row_expert) + bx * 4 * k * m.per_column
    want = 2 * live + m.fixed
    got = devices.ub_bytes("scatter", bm, bx, es, even=False, top_k=k, block_e=be)
    assert want <= got < want + devices.UB_BLOCK_BYTES + 1 and got % devices.UB_BLOCK_BYTES == 0
    # more of anything never takes less
    for kind in devices.UB_MODELS:
        base = devices.ub_bytes(kind, 4, 128, 2)
        assert devices.ub_bytes(kind, 8, 128, 2) > base and devices.ub_bytes(kind, 4, 256, 2) > base
        assert devices.ub_bytes(kind, 4, 128, 4) >= base and devices.ub_bytes(kind, 4, 128, 2, even=False) >= base
        assert devices.ub_bytes(kind, 4, 128, 2, top_k=8) >= base
        assert devices.ub_bytes(kind, 4, 128, 2, block_e=256) >= base


def test_npu_tiles_shrink_where_the_plan_grows():
    """What the compiler's plans showed (docs/notes/ascend-backend.md): the scatter's UB grows with
    top_k (its slots are unrolled); the gather's does not grow with the experts since it reads each
    row's position from the row map (docs/notes/many-experts.md: it took 16 rows at 8 experts and 4
    at 256 with its former [BLOCK_M, BLOCK_E] search)."""
    scatter = [devices.tile("scatter", torch.float32, 4096, "npu", top_k=k).block_m for k in (1, 2, 4, 8)]
    assert scatter == sorted(scatter, reverse=True) and scatter[-1] < scatter[0]
    for dtype in (torch.bfloat16, torch.float32):
        gather = {devices.tile("gather", dtype, h, "npu", top_k=2, num_experts=e) for e in (8, 64, 256, 1024)
                  for h in (4096,)}
        assert len(gather) == 1
    assert devices.tile("gather", torch.bfloat16, 4096, "npu").block_m == 16


def test_npu_tiles_narrow_rather_than_take_one_row():
    """A one-row sub-block pays the sub-block's index loads and handshakes on every row: the flat
    scatter at top_k 8 in float32, hidden 1000, takes two rows of 256 features, not one of 512."""
    t = devices.tile("scatter", torch.float32, 1000, "npu", top_k=8)
    assert t == devices.Tile(2, 256)
    assert devices.ub_bytes("scatter", 2, 512, 4, even=False, top_k=8) > devices.UB_BYTES - devices.UB_RESERVE


def test_other_targets_tiles():
    cuda = devices.tile("scatter", torch.bfloat16, 4096, "cuda")
    assert cuda.block_x == 1024 and cuda.num_warps == 4
    # An expert walk's weight gradient amortises its per-sub-block lookup over 4 narrower rows on
    # CUDA; on an NPU the tile is the UB's, as for the plain weight gradient.
    assert devices.tile("wgrad_walk", torch.bfloat16, 4096, "cuda") == devices.Tile(4, 256, 4)
    assert devices.tile("wgrad_walk", torch.bfloat16, 4096, "npu") == devices.tile("wgrad", torch.bfloat16, 4096, "npu")
    assert devices.tile("gather", torch.float32, 3, "interpreter").block_x == 8  # one 32-byte block
    with pytest.raises(ValueError, match="unknown target"):
        devices.tile("gather", torch.float32, 8, "tpu")
    with pytest.raises(ValueError, match="unknown kernel kind"):
        devices.tile("copy", torch.float32, 8, "npu")


def test_num_programs_comes_from_the_device_and_the_override(monkeypatch):
    monkeypatch.delenv("MEGABLOCKS_ASCEND_NUM_PROGRAMS", raising=False)
    cpu = torch.device("cpu")
    assert devices.num_programs(cpu, 1000) == devices.INTERPRETER_PROGRAMS
    assert devices.num_programs(cpu, 2) == 2  # never more programs than work
    assert devices.num_programs(cpu, 0) == 1
    monkeypatch.setattr(devices, "_core_count", lambda kind, index: {"cuda": 132, "npu": 48}[kind])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert devices.num_programs(torch.device("cuda", 0), 10**6) == 132 * devices.CUDA_PROGRAMS_PER_SM
    npu = types.SimpleNamespace(type="npu", index=0)
    assert devices.num_programs(npu, 10**6) == 48  # one program per vector core
    monkeypatch.setenv("MEGABLOCKS_ASCEND_NUM_PROGRAMS", "3")
    assert devices.num_programs(npu, 10**6) == 3
    monkeypatch.setenv("MEGABLOCKS_ASCEND_NUM_PROGRAMS", "0")
    with pytest.raises(ValueError, match="positive integer"):
        devices.num_programs(cpu, 10)


def test_npu_core_count_reads_num_vectorcore(monkeypatch):
    import triton
    fake = types.SimpleNamespace(utils=types.SimpleNamespace(
        get_device_properties=lambda index: {"num_vectorcore": 40, "num_aicore": 20}))
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=fake))
    devices._core_count.cache_clear()
    try:
        assert devices._core_count("npu", 0) == 40
    finally:
        devices._core_count.cache_clear()


def test_slice_ops_resolved_across_api_generations():
    names = compat.SLICE_OP_NAMES
    fn = {n: (lambda *a, n=n: n) for n in names}
    in_tl = types.SimpleNamespace(__name__="triton.language", **fn)  # triton-ascend 3.2.x
    ops = compat.slice_ops(in_tl)
    assert ops.source == "triton.language" and ops.insert_slice() == "insert_slice"
    bare = types.SimpleNamespace(__name__="triton.language")  # standard Triton / newer triton-ascend
    assert compat.slice_ops(bare, extension_module="megablocks_ascend_no_such_module") is None
    ext = compat.slice_ops(bare, extension_module="tests.support._fake_cann_extension")
    assert ext is not None and ext.source == "tests.support._fake_cann_extension" and ext.get_element() == "get_element"
    assert compat.slice_ops(bare, extension_module="tests") is None  # a module without the ops
    # What this machine has: standard Triton, neither location.
    if not compat.is_triton_ascend():
        assert compat.slice_ops() is None


def test_interpreter_is_active_in_the_test_session_and_kernels_know_it():
    assert compat.interpreter_active()
    k = compat.kernel(lambda: None)
    assert repr(k).startswith("Kernel(")


# --------------------------------------------------------------------------------------------
# Cube kernels (the block-sparse matmuls): the A2 budget, the tile choice, the cube-core grid.


@pytest.mark.parametrize("kind", devices.CUBE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("dense", [1, 48, 4096])
def test_npu_cube_tiles_fit_the_budget_and_are_the_largest(kind, dtype, block, dense):
    es = dtype.itemsize
    t = devices.cube_tile(kind, dtype, block, dense, "npu")
    assert devices.cube_fits(t, es)
    sides = (t.block_m, t.block_n, t.block_k)
    assert all(s >= devices.CUBE_FRACTAL and s & (s - 1) == 0 for s in sides)
    inside = {"sdd": (t.block_m, t.block_n), "dsd": (t.block_m, t.block_k), "dds": (t.block_n, t.block_k)}[kind]
    assert all(s <= block for s in inside)
    assert t.group == devices.CUBE_GROUP
    # No other tile within the caps fits with more work per element brought in (or as much and a deeper K).
    cap = devices._limits(kind, block, dense, 256)
    score = lambda x: (x.block_m * x.block_n / (x.block_m + x.block_n), x.block_k)  # noqa: E731
    for m in devices._sides(cap[0]):
        for n in devices._sides(cap[1]):
            for k in devices._sides(cap[2]):
                other = devices.CubeTile(m, n, k)
                if devices.cube_fits(other, es):
                    assert score(other) <= score(t), (other, t)


def test_cube_bytes_counts_double_buffered_slices_and_the_accumulator():
    b = devices.cube_bytes(devices.CubeTile(128, 256, 64), 2)
    assert b == dict(l0a=2 * 128 * 64 * 2, l0b=2 * 64 * 256 * 2, l0c=128 * 256 * 4, l1=2 * (128 + 256) * 64 * 2)
    assert devices.cube_fits(devices.CubeTile(128, 256, 64), 2)
    assert not devices.cube_fits(devices.CubeTile(256, 256, 64), 2)  # L0C: 256 KiB of float32
    assert not devices.cube_fits(devices.CubeTile(128, 256, 128), 2)  # L0B: 128 KiB


def test_cube_tiles_on_the_other_targets():
    cuda = devices.cube_tile("dsd", torch.bfloat16, 128, 4096, "cuda")
    assert (cuda.block_m, cuda.block_n, cuda.block_k) == (128, 256, 64) and cuda.num_warps == 8
    small = devices.cube_tile("dsd", torch.bfloat16, 32, 4096, "cuda")  # sides inside a block clip to it
    assert (small.block_m, small.block_k) == (32, 32)
    assert devices.cube_tile("sdd", torch.float32, 128, 4096, "cuda").block_k == 32  # fp32: half the K
    assert devices.cube_tile("dds", torch.float16, 64, 20, "interpreter") == devices.CubeTile(32, 64, 64)
    with pytest.raises(ValueError, match="unknown cube kernel kind"):
        devices.cube_tile("ddd", torch.float16, 64, 20, "npu")
    with pytest.raises(ValueError, match="unknown target"):
        devices.cube_tile("sdd", torch.float16, 64, 20, "tpu")


def test_cube_kernels_get_one_program_per_ai_core(monkeypatch):
    monkeypatch.delenv("MEGABLOCKS_ASCEND_NUM_PROGRAMS", raising=False)
    monkeypatch.setattr(devices, "_core_count", lambda kind, index: {"cuda": 132, "npu": 48}[kind])
    monkeypatch.setattr(devices, "_aicore_count", lambda index: 24)
    npu = types.SimpleNamespace(type="npu", index=0)
    assert devices.num_programs(npu, 10**6, unit="cube") == 24
    assert devices.num_programs(npu, 10**6) == 48  # the vector kernels: one per vector core
    assert devices.num_programs(npu, 5, unit="cube") == 5
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert devices.num_programs(torch.device("cuda", 0), 10**6, unit="cube", programs_per_sm=2) == 264
    with pytest.raises(ValueError, match="unknown core unit"):
        devices.num_programs(npu, 10, unit="tensor")


def test_npu_aicore_count_reads_num_aicore(monkeypatch):
    import triton
    fake = types.SimpleNamespace(utils=types.SimpleNamespace(
        get_device_properties=lambda index: {"num_vectorcore": 40, "num_aicore": 20}))
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=fake))
    devices._aicore_count.cache_clear()
    try:
        assert devices._aicore_count(0) == 20
    finally:
        devices._aicore_count.cache_clear()
