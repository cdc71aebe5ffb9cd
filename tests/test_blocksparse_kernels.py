"""The block-sparse kernels (``kernels/blocksparse.py``) against float64 dense references.

Every sparse operand is built from a block mask with ``tests/support/blocksparse_impl.py`` (BCSR metadata
and the transpose metadata in plain Python, independently of the kernels, in the order MegaBlocks'
``sparse_transpose`` gives: column by column, rows ascending), its dense float64 form from the same
blocks; every output is poisoned with NaN first, so an element the kernel does not write fails the
check.

Inputs are drawn on the CPU and the kernels run on the ``device`` fixture's device (the CPU
interpreter by default; ``MEGABLOCKS_ASCEND_TEST_DEVICE=cuda TRITON_INTERPRET=0`` runs this file
on a GPU, compiled); references are float64 on the CPU.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import blocksparse_impl as ref
import megablocks_ascend
from blocksparse_impl import Topology, topology
from megablocks_ascend import backends, devices
from megablocks_ascend.backends import BackendUnavailable
from megablocks_ascend.kernels import blocksparse as bs
from megablocks_ascend.validation import BlockSparseArgumentError

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# max |out - ref| / max |ref|: float32 accumulates exactly enough in the interpreter; 16-bit outputs
# carry one rounding of the result (fp16: 2**-11, bf16: 2**-8 relative).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
PATTERNS = ("random", "holes", "one", "all", "megablocks")


def topology_from_mask(mask: torch.Tensor, block: int, index_dtype=torch.int16) -> Topology:
    """The BCSR topology (``blocksparse_impl.topology``) of the blocks a ``[rows, cols]`` mask sets."""
    rows, cols = mask.shape
    return topology((rows * block, cols * block), block, [tuple(rc) for rc in mask.nonzero().tolist()],
                    index_dtype)


def stk_metadata(topo: Topology):
    """The metadata in the order stk's dsd/dds take them: offsets, row_indices, column_indices,
    offsets_t, column_indices_t, block_offsets_t."""
    m = topo.metadata()
    return tuple(m[k] for k in ("offsets", "row_indices", "column_indices", "offsets_t", "column_indices_t",
                                "block_offsets_t"))


def block_mask(pattern: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    if pattern == "random":
        return torch.rand(rows, cols, generator=gen) < 0.4
    if pattern == "holes":  # random, with an empty block row and an empty block column
        mask = torch.rand(rows, cols, generator=gen) < 0.6
        mask[rows // 2] = False
        mask[:, cols // 2] = False
        return mask
    if pattern == "one":
        mask = torch.zeros(rows, cols, dtype=torch.bool)
        mask[rows - 1, cols // 2] = True
        return mask
    if pattern == "all":
        return torch.ones(rows, cols, dtype=torch.bool)
    if pattern == "empty":
        return torch.zeros(rows, cols, dtype=torch.bool)
    if pattern == "megablocks":
        # MegaBlocks' dMoE topology: each block row of tokens belongs to one expert (experts in
        # order, some with no rows) and holds that expert's blocks_per_row consecutive columns.
        experts = 3
        per_row = max(cols // experts, 1)
        expert_of_row = torch.sort(torch.randint(0, experts, (rows,), generator=gen)).values
        mask = torch.zeros(rows, cols, dtype=torch.bool)
        for r, e in enumerate(expert_of_row.tolist()):
            mask[r, e * per_row:(e + 1) * per_row] = True
        return mask
    raise KeyError(pattern)


def make_topology(pattern, rows, cols, block, gen, index_dtype=torch.int16) -> Topology:
    return topology_from_mask(block_mask(pattern, rows, cols, gen), block, index_dtype)


DEV = torch.device("cpu")  # where the kernels run: set from the device fixture


@pytest.fixture(autouse=True, scope="module")
def _kernels_on_the_test_device(device):
    global DEV
    DEV = device


def on(*tensors):
    """The tensors on the test device (``to`` keeps a transposed view's strides)."""
    moved = tuple(t.to(DEV) for t in tensors)
    return moved if len(moved) > 1 else moved[0]


def randn(*shape, dtype, gen, layout="row"):
    """A dense operand of ``shape``, row-major or as a column-major (transposed) view."""
    if layout == "row":
        return torch.randn(*shape, generator=gen).to(dtype)
    return torch.randn(*reversed(shape), generator=gen).to(dtype).t()


def poisoned(*shape, dtype, layout="row"):
    if layout == "row":
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.full(tuple(reversed(shape)), float("nan"), dtype=dtype).t()


def assert_close(out, ref, dtype, what=""):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    out = out.double()
    assert not torch.isnan(out).any(), f"{what}: {int(torch.isnan(out).sum())} elements not written"
    scale = max(ref.abs().max().item(), 1e-30)
    err = (out - ref).abs().max().item() / scale
    assert err <= TOL[dtype], f"{what}: max error {err:.2e} of the largest value, tolerance {TOL[dtype]:.1e}"


def sdd_ref(lhs, rhs, topo):
    prod = lhs.double() @ rhs.double()
    b = topo.block
    return torch.stack([prod[int(r) * b:(int(r) + 1) * b, int(c) * b:(int(c) + 1) * b]
                        for r, c in zip(topo.row_indices, topo.column_indices)]) if topo.nnz else \
        torch.zeros(0, b, b, dtype=torch.float64)


def run_sdd(topo, k, dtype, gen, lhs_layout="row", rhs_layout="row", **launch):
    m, n = topo.shape
    lhs = randn(m, k, dtype=dtype, gen=gen, layout=lhs_layout)
    rhs = randn(k, n, dtype=dtype, gen=gen, layout=rhs_layout)
    out = on(poisoned(topo.nnz, topo.block, topo.block, dtype=dtype))
    res = bs.sdd(on(lhs), on(rhs), topo.shape, out, *on(topo.offsets, topo.row_indices, topo.column_indices),
                 **launch)
    assert res is out
    return out.cpu(), sdd_ref(lhs, rhs, topo)


def run_dsd(topo, n, dtype, gen, transpose_a, rhs_layout="row", out_layout="row", **launch):
    b = topo.block
    data = torch.randn(topo.nnz, b, b, generator=gen).to(dtype)
    full = ref.dense(topo, data)
    a = full.t() if transpose_a else full
    m, k = a.shape
    rhs = randn(k, n, dtype=dtype, gen=gen, layout=rhs_layout)
    out = on(poisoned(m, n, dtype=dtype, layout=out_layout))
    bs.dsd((m, k), on(data), *on(*stk_metadata(topo)), transpose_a, on(rhs), out, **launch)
    return out.cpu(), a @ rhs.double()


def run_dds(topo, m, dtype, gen, transpose_b, lhs_layout="row", out_layout="row", **launch):
    b = topo.block
    data = torch.randn(topo.nnz, b, b, generator=gen).to(dtype)
    full = ref.dense(topo, data)
    s = full.t() if transpose_b else full
    k, n = s.shape
    lhs = randn(m, k, dtype=dtype, gen=gen, layout=lhs_layout)
    out = on(poisoned(m, n, dtype=dtype, layout=out_layout))
    bs.dds(on(lhs), (k, n), on(data), *on(*stk_metadata(topo)), transpose_b, out, **launch)
    return out.cpu(), lhs.double() @ s


LAYOUTS = ("row", "col")


def layouts(dtype, combos, megablocks):
    """Every operand layout in float32; in 16-bit dtypes the one MegaBlocks uses and one other
    (the interpreter is slow, and the layout does not depend on the dtype)."""
    if dtype == torch.float32:
        return combos
    return [megablocks] + [c for c in combos if c != megablocks][:1]


# --------------------------------------------------------------------------------------------
# Each kernel, each transpose and operand layout, each dtype, over block topologies.


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_sdd(pattern, dtype):
    gen = torch.Generator().manual_seed(1)
    topo = make_topology(pattern, 4, 5, 32, gen)
    for lhs_layout, rhs_layout in layouts(dtype, list(itertools.product(LAYOUTS, LAYOUTS)), ("row", "col")):
        out, ref = run_sdd(topo, 48, dtype, gen, lhs_layout, rhs_layout)
        assert_close(out, ref, dtype, f"sdd {pattern} lhs {lhs_layout} rhs {rhs_layout}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_dsd(pattern, transpose_a, dtype):
    gen = torch.Generator().manual_seed(2)
    topo = make_topology(pattern, 4, 5, 32, gen)
    for rhs_layout, out_layout in layouts(dtype, [("row", "row"), ("col", "row"), ("row", "col")], ("row", "row")):
        out, ref = run_dsd(topo, 40, dtype, gen, transpose_a, rhs_layout, out_layout)
        assert_close(out, ref, dtype, f"dsd {pattern} T={transpose_a} rhs {rhs_layout} out {out_layout}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_dds(pattern, transpose_b, dtype):
    gen = torch.Generator().manual_seed(3)
    topo = make_topology(pattern, 4, 5, 32, gen)
    for lhs_layout, out_layout in layouts(dtype, [("row", "row"), ("col", "row"), ("row", "col")], ("row", "row")):
        out, ref = run_dds(topo, 40, dtype, gen, transpose_b, lhs_layout, out_layout)
        assert_close(out, ref, dtype, f"dds {pattern} T={transpose_b} lhs {lhs_layout} out {out_layout}")


@pytest.mark.parametrize("block", bs.BLOCK_SIZES)
def test_every_block_size(block):
    gen = torch.Generator().manual_seed(4)
    topo = make_topology("holes", 3, 3, block, gen)
    dtype = torch.float32
    assert_close(*run_sdd(topo, 24, dtype, gen, "row", "col"), dtype, f"sdd B={block}")
    for transpose in (False, True):
        assert_close(*run_dsd(topo, 24, dtype, gen, transpose), dtype, f"dsd B={block} T={transpose}")
        assert_close(*run_dds(topo, 24, dtype, gen, transpose), dtype, f"dds B={block} T={transpose}")


SMALL_TILES = {  # tiles smaller than the block in every direction the kernel splits it
    "sdd": devices.CubeTile(16, 32, 16),
    "dsd": devices.CubeTile(16, 16, 16),
    "dds": devices.CubeTile(16, 16, 16),
}


@pytest.mark.parametrize("num_programs, group", [(1, 1), (3, 2), (7, 2)])
def test_tiles_inside_blocks_and_grids(num_programs, group):
    """Sub-block tiles (several per block, several K-steps per block), grouped tile orders and grids
    from one program to more programs than some kernels have tiles: the same results."""
    gen = torch.Generator().manual_seed(5)
    topo = make_topology("megablocks", 4, 6, 32, gen)
    dtype = torch.float32
    tiles = {k: dataclasses.replace(t, group=group) for k, t in SMALL_TILES.items()}
    launch = dict(num_programs=num_programs)
    assert_close(*run_sdd(topo, 40, dtype, gen, "row", "col", tile=tiles["sdd"], **launch), dtype, "sdd")
    for transpose in (False, True):
        assert_close(*run_dsd(topo, 24, dtype, gen, transpose, tile=tiles["dsd"], **launch), dtype, "dsd")
        assert_close(*run_dds(topo, 24, dtype, gen, transpose, tile=tiles["dds"], **launch), dtype, "dds")


# The CUDA forms (devices.CUDA_CUBE_TILES): sdd over pairs of blocks (one tile when the two share
# a row, each on its own otherwise), dsd with the addresses of a line that is one affine run computed
# (the other lines loaded as without it). Small tiles, so the interpreter runs them here.
PAIR_TILE = devices.CubeTile(16, 32, 16, group=2, pairs=True)
AFFINE_TILE = devices.CubeTile(16, 32, 16, group=2, affine=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuda_forms(pattern, dtype):
    """Random and holed patterns mix pairs across rows and lines that are no run; MegaBlocks'
    pattern is made of runs (odd blocks per row: some pairs straddle two rows)."""
    gen = torch.Generator().manual_seed(8)
    topo = make_topology(pattern, 5, 9, 32, gen)  # MegaBlocks': 3 blocks per row
    for num_programs in (1, 3):
        launch = dict(num_programs=num_programs)
        assert_close(*run_sdd(topo, 40, dtype, gen, "row", "col", tile=PAIR_TILE, **launch), dtype,
                     f"sdd pairs {pattern}")
        for transpose in (False, True):
            assert_close(*run_dsd(topo, 40, dtype, gen, transpose, tile=AFFINE_TILE, **launch), dtype,
                         f"dsd affine {pattern} T={transpose}")


def test_affine_runs_are_checked_entry_by_entry():
    """A line whose first and last entries look like a run but whose middle does not: loaded entry by
    entry, not computed (a wrong guess would read the wrong blocks)."""
    gen = torch.Generator().manual_seed(9)
    blocks = [(0, 0), (0, 1), (0, 3), (1, 0), (1, 2), (1, 3)]  # row 0: columns 0, 1, 3 (not a run)
    topo = topology((64, 128), 32, blocks)
    for transpose in (False, True):
        assert_close(*run_dsd(topo, 24, torch.float32, gen, transpose, tile=AFFINE_TILE), torch.float32,
                     f"dsd affine T={transpose}")


@pytest.mark.parametrize("dense", [1, 17, 100])
def test_dense_dimensions_of_any_size(dense):
    """The product's dense dimension (sdd's K, dsd's N, dds's M: the hidden size in a dMoE) need
    not be a multiple of anything: its last tile is masked."""
    gen = torch.Generator().manual_seed(6)
    topo = make_topology("random", 3, 4, 16, gen)
    dtype = torch.bfloat16
    assert_close(*run_sdd(topo, dense, dtype, gen, "col", "col"), dtype, f"sdd K={dense}")
    for transpose in (False, True):
        assert_close(*run_dsd(topo, dense, dtype, gen, transpose, "col"), dtype, f"dsd N={dense}")
        assert_close(*run_dds(topo, dense, dtype, gen, transpose, "col"), dtype, f"dds M={dense}")


def test_sdd_with_an_empty_inner_dimension_writes_zeros():
    gen = torch.Generator().manual_seed(7)
    topo = make_topology("random", 2, 3, 16, gen)
    out, ref = run_sdd(topo, 0, torch.float32, gen)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ref, torch.zeros_like(ref))


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
def test_empty_sparse_matrix(index_dtype):
    """No blocks at all: sdd and row_indices have nothing to write; dsd and dds write zeros."""
    gen = torch.Generator().manual_seed(8)
    topo = make_topology("empty", 3, 2, 16, gen, index_dtype)
    assert topo.nnz == 0
    out, _ = run_sdd(topo, 8, torch.float32, gen)
    assert out.shape == (0, 16, 16)
    for transpose in (False, True):
        out, ref = run_dsd(topo, 8, torch.float32, gen, transpose)
        assert torch.equal(out, torch.zeros_like(out)) and not ref.any()
        out, ref = run_dds(topo, 8, torch.float32, gen, transpose)
        assert torch.equal(out, torch.zeros_like(out)) and not ref.any()
    rows = on(torch.empty(0, dtype=index_dtype))
    assert bs.row_indices(topo.shape, torch.empty(0, 16, 16, device="meta"), *on(topo.offsets, topo.column_indices),
                          rows) is rows


# --------------------------------------------------------------------------------------------
# Offsets: int16 block indices whose element offsets pass 32767, and the int64 kernels.


def sparse_far_mask(rows, cols, gen, count=6):
    """A few blocks, most of them at block rows and columns past 32767 // 16 = 2047."""
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    r = torch.randint(0, rows, (count,), generator=gen)
    c = torch.randint(0, cols, (count,), generator=gen)
    mask[r, c] = True
    mask[rows - 1, cols - 1] = True
    mask[0, 0] = True
    return mask


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
def test_block_indices_past_int16_element_offsets(index_dtype):
    """Block size 16 and 2100 block rows or columns: element offsets of the last blocks
    (2099 * 16 = 33584) overflow int16 arithmetic, which stk's kernels do on Triton >= 3.2.
    Small in memory and in interpreter time: the other side of each operand is two blocks, and
    each product puts the long side where the kernel reaches it through loaded block indices."""
    gen = torch.Generator().manual_seed(9)
    far = 2100
    dtype = torch.float32
    wide = topology_from_mask(sparse_far_mask(2, far, gen), 16, index_dtype)  # 32 x 33600
    tall = topology_from_mask(sparse_far_mask(far, 2, gen), 16, index_dtype)  # 33600 x 32
    for topo in (wide, tall):
        assert max(int(topo.row_indices.max()), int(topo.column_indices.max())) * 16 > 32767
        # sdd's output blocks sit at those rows (tall) or columns (wide)
        assert_close(*run_sdd(topo, 16, dtype, gen, "row", "col"), dtype, f"sdd {topo.shape}")
    # dsd and dds reach far blocks along K: S's columns (wide S, or tall S transposed) ...
    assert_close(*run_dsd(wide, 16, dtype, gen, False), dtype, "dsd")
    assert_close(*run_dsd(tall, 16, dtype, gen, True), dtype, "dsd^T")
    # ... or S's rows
    assert_close(*run_dds(tall, 16, dtype, gen, False), dtype, "dds")
    assert_close(*run_dds(wide, 16, dtype, gen, True), dtype, "dds^T")
    rows = on(torch.full((tall.nnz,), -1, dtype=index_dtype))
    bs.row_indices(tall.shape, None, *on(tall.offsets, tall.column_indices), rows)
    assert torch.equal(rows.cpu(), tall.row_indices)


def test_int64_kernels_give_the_same_results(monkeypatch):
    """Every offset counts as past int32 here, so each launcher specialises its kernel with
    ``INT64=True``: bit-identical results to the int32 kernels."""
    gen = torch.Generator().manual_seed(10)
    topo = make_topology("holes", 3, 4, 16, gen)
    dtype = torch.bfloat16
    cases = []
    for name, fn in (("sdd", lambda: run_sdd(topo, 20, dtype, gen, "row", "col")),
                     ("dsd", lambda: run_dsd(topo, 20, dtype, gen, False)),
                     ("dsd^T", lambda: run_dsd(topo, 20, dtype, gen, True)),
                     ("dds", lambda: run_dds(topo, 20, dtype, gen, False)),
                     ("dds^T", lambda: run_dds(topo, 20, dtype, gen, True))):
        state = gen.get_state()
        cases.append((name, fn, state, fn()[0]))
    monkeypatch.setattr(bs, "_OFFSET_LIMIT", 0)
    for name, fn, state, int32 in cases:
        gen.set_state(state)
        assert torch.equal(fn()[0], int32), name


class _Recorder:
    """Stands in for a kernel: records the launch instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
        return launch


@pytest.mark.parametrize("big", [False, True])
def test_int64_is_chosen_from_shapes_and_strides(monkeypatch, big):
    """The launchers pick int64 offsets exactly when an operand's largest element offset (tiles
    padded to whole tiles) passes 2**31 - 1. Checked with meta tensors: no memory."""
    rec = {name: _Recorder() for name in ("_sdd", "_dsd", "_dds")}
    for name, r in rec.items():
        monkeypatch.setattr(bs, name, r)
    b = 128
    meta = dict(device="meta")
    # The dense operands are k x hidden: 2**33 elements (big) or 2**25.
    k = 2**17 if big else 2**13
    hidden = 2**16 if big else 2**12
    topo_rows, topo_cols = 2, k // b
    offsets = torch.zeros(topo_rows + 1, dtype=torch.int32, **meta)
    idx = torch.zeros(4, dtype=torch.int16, **meta)
    offsets_t = torch.zeros(topo_cols + 1, dtype=torch.int32, **meta)
    block_offsets_t = torch.zeros(4, dtype=torch.int32, **meta)
    data = torch.empty(4, b, b, dtype=torch.bfloat16, **meta)
    tile = devices.CubeTile(128, 128, 64)
    launch = dict(tile=tile, num_programs=2)
    # dsd: S (256 x k) @ rhs (k x hidden)
    rhs = torch.empty(k, hidden, dtype=torch.bfloat16, **meta)
    out = torch.empty(topo_rows * b, hidden, dtype=torch.bfloat16, **meta)
    bs.dsd((topo_rows * b, k), data, offsets, idx, idx, offsets_t, idx, block_offsets_t, False, rhs, out, **launch)
    # dds: lhs (hidden x 256) @ S (256 x k)
    lhs = torch.empty(hidden, topo_rows * b, dtype=torch.bfloat16, **meta)
    out2 = torch.empty(hidden, k, dtype=torch.bfloat16, **meta)
    bs.dds(lhs, (topo_rows * b, k), data, offsets, idx, idx, offsets_t, idx, block_offsets_t, False, out2,
           **launch)
    # sdd: lhs (256 x hidden) @ rhs (hidden x k), rhs a transposed view
    lhs3 = torch.empty(topo_rows * b, hidden, dtype=torch.bfloat16, **meta)
    rhs3 = torch.empty(k, hidden, dtype=torch.bfloat16, **meta).t()
    bs.sdd(lhs3, rhs3, (topo_rows * b, k), data, offsets, idx, idx, **launch)
    for name, r in rec.items():
        (grid, _, kwargs), = r.launches
        assert kwargs["INT64"] is big, name
        assert grid == (2,)
    assert rec["_sdd"].launches[0][2]["RHS_CM"] is True  # the transposed view is read column-major


def test_dimensions_past_int32_are_refused(monkeypatch):
    """Indices within a dimension and tile counts are int32 in the kernels: the launchers refuse
    more (checked here with the limit lowered, as no such tensor fits this machine)."""
    monkeypatch.setattr(bs, "_EXTENT_LIMIT", 40)
    monkeypatch.setattr(bs, "_sdd", _NoLaunch())
    gen = torch.Generator().manual_seed(14)
    topo = make_topology("all", 1, 1, 16, gen)
    with pytest.raises(ValueError, match="^lhs: has a dimension of 48 elements"):
        bs.sdd(torch.zeros(16, 48), torch.zeros(48, 16), topo.shape, torch.zeros(1, 16, 16), topo.offsets,
               topo.row_indices, topo.column_indices, tile=devices.CubeTile(16, 16, 16))
    with pytest.raises(ValueError, match="^shape: needs 41 output tiles"):
        bs._check_int32_extents(41, lhs=(16, 16))
    bs._check_int32_extents(40, lhs=(16, 16))


def test_max_offset_counts_padded_tiles():
    assert bs._max_offset((3, 5), (5, 1)) == 2 * 5 + 4
    assert bs._max_offset((0, 5), (5, 1)) == 0
    assert bs._max_offset((4, 2**20), (1, 4)) == 3 + (2**20 - 1) * 4
    assert not bs._needs_int64(2**31 - 1) and bs._needs_int64(2**31)


# --------------------------------------------------------------------------------------------
# row_indices.


@pytest.mark.parametrize("num_programs", [1, 4])
@pytest.mark.parametrize("out_dtype", [torch.int16, torch.int32])
@pytest.mark.parametrize("pattern", ["random", "holes", "all", "megablocks"])
def test_row_indices(pattern, out_dtype, num_programs):
    gen = torch.Generator().manual_seed(11)
    topo = make_topology(pattern, 6, 3, 16, gen)
    data = torch.empty(topo.nnz, 16, 16, device="meta")  # as MegaBlocks passes it: never read
    out = on(torch.full((topo.nnz,), -1, dtype=out_dtype))
    assert bs.row_indices(topo.shape, data, *on(topo.offsets, topo.column_indices), out,
                          num_programs=num_programs) is out
    assert out.tolist() == topo.row_indices.tolist()


def test_row_indices_of_rows_longer_than_one_store():
    mask = torch.zeros(3, 300, dtype=torch.bool)
    mask[0, :5] = True
    mask[2] = True  # 300 blocks: three stores of ROW_INDICES_BLOCK
    topo = topology_from_mask(mask, 16)
    out = on(torch.full((topo.nnz,), -1, dtype=torch.int16))
    bs.row_indices(topo.shape, None, *on(topo.offsets, topo.column_indices), out)
    assert out.tolist() == topo.row_indices.tolist()


# --------------------------------------------------------------------------------------------
# Against stk's own kernels, at a size where they are correct (block size 128, stk's only one).


def test_matches_stk_kernels_where_they_are_correct():
    import stk.backend.triton_kernels as stk_kernels  # noqa: PLC0415

    gen = torch.Generator().manual_seed(12)
    topo = make_topology("holes", 2, 3, 128, gen)
    dtype = torch.float16  # the interpreter's tl.dot is wrong on bfloat16, and stk does not widen
    m, n = topo.shape
    meta = on(*stk_metadata(topo))
    lhs, rhs = on(randn(m, 128, dtype=dtype, gen=gen), randn(128, n, dtype=dtype, gen=gen, layout="col"))
    ours, theirs = on(poisoned(topo.nnz, 128, 128, dtype=dtype), poisoned(topo.nnz, 128, 128, dtype=dtype))
    bs.sdd(lhs, rhs, topo.shape, ours, meta[0], meta[1], meta[2])
    stk_kernels.sdd(lhs, rhs, topo.shape, theirs, meta[0], meta[1], meta[2])
    assert_close(ours.cpu(), theirs.cpu().double(), dtype, "sdd vs stk")
    data = on(torch.randn(topo.nnz, 128, 128, generator=gen).to(dtype))
    for transpose in (False, True):
        mm, kk = (n, m) if transpose else (m, n)
        x = on(randn(kk, 128, dtype=dtype, gen=gen))
        ours, theirs = on(poisoned(mm, 128, dtype=dtype), poisoned(mm, 128, dtype=dtype))
        bs.dsd((mm, kk), data, *meta, transpose, x, ours)
        stk_kernels.dsd((mm, kk), data, *meta, transpose, x, theirs)
        assert_close(ours.cpu(), theirs.cpu().double(), dtype, f"dsd vs stk T={transpose}")
        y = on(randn(128, mm, dtype=dtype, gen=gen))
        ours, theirs = on(poisoned(128, kk, dtype=dtype), poisoned(128, kk, dtype=dtype))
        bs.dds(y, (mm, kk), data, *meta, transpose, ours)
        stk_kernels.dds(y, (mm, kk), data, *meta, transpose, theirs)
        assert_close(ours.cpu(), theirs.cpu().double(), dtype, f"dds vs stk T={transpose}")


# --------------------------------------------------------------------------------------------
# Bad input: refused before any launch, naming the argument, the caller's tensors untouched. Every
# argument is checked once, where stk's functions are called (the dispatcher: validation.
# check_blocksparse, whose messages tests/test_sparse_dispatch.py holds; the block size by the
# ascend backend's record), so the cases below go through it; the launchers check only a tile they
# are given.


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched for bad input")


def _valid(dtype=torch.float32):
    gen = torch.Generator().manual_seed(13)
    topo = make_topology("random", 2, 3, 16, gen)
    m, n = topo.shape
    base = dict(
        topo=topo,
        lhs=torch.randn(m, 24, generator=gen).to(dtype),
        rhs=torch.randn(24, n, generator=gen).to(dtype),
        blocks=torch.full((topo.nnz, 16, 16), 7.0, dtype=dtype),
        data=torch.randn(topo.nnz, 16, 16, generator=gen).to(dtype),
        x=torch.randn(n, 8, generator=gen).to(dtype),
        y=torch.randn(8, m, generator=gen).to(dtype),
        out_dsd=torch.full((m, 8), 7.0, dtype=dtype),
        out_dds=torch.full((8, n), 7.0, dtype=dtype),
        rows=torch.full((topo.nnz,), 7, dtype=torch.int16),
    )
    # On the test device: the refusals must come before any launch there too, and the valid base runs.
    return {k: v.to(DEV) for k, v in base.items()}


def _sdd(b, **kw):
    t = b["topo"]
    a = dict(lhs=b["lhs"], rhs=b["rhs"], shape=t.shape, out=b["blocks"], offsets=t.offsets,
             row_indices=t.row_indices, column_indices=t.column_indices)
    a.update(kw)
    return "sdd", a


def _dsd(b, **kw):
    t = b["topo"]
    a = dict(shape=t.shape, data=b["data"], offsets=t.offsets, row_indices=t.row_indices,
             column_indices=t.column_indices, offsets_t=t.offsets_t, column_indices_t=t.column_indices_t,
             block_offsets_t=t.block_offsets_t, transpose_a=False, rhs=b["x"], out=b["out_dsd"])
    a.update(kw)
    return "dsd", a


def _dds(b, **kw):
    t = b["topo"]
    a = dict(lhs=b["y"], shape=t.shape, data=b["data"], offsets=t.offsets, row_indices=t.row_indices,
             column_indices=t.column_indices, offsets_t=t.offsets_t, column_indices_t=t.column_indices_t,
             block_offsets_t=t.block_offsets_t, transpose_b=False, out=b["out_dds"])
    a.update(kw)
    return "dds", a


def _rows(b, **kw):
    t = b["topo"]
    a = dict(shape=t.shape, data=torch.empty(t.nnz, 16, 16, device="meta"), offsets=t.offsets,
             column_indices=t.column_indices, out=b["rows"])
    a.update(kw)
    return "row_indices", a


def _blocks_of(block, dense):
    """A valid sdd call and a valid dds call on a 2 x 2-block matrix of ``block`` x ``block`` blocks."""
    t = topology((2 * block, 2 * block), block, [(0, 0), (1, 1)]).to(DEV)
    side, on_dev = 2 * block, dict(device=DEV)
    sdd = dict(lhs=torch.zeros(side, dense, **on_dev), rhs=torch.zeros(dense, side, **on_dev), shape=t.shape,
               out=torch.full((t.nnz, block, block), 7.0, **on_dev), offsets=t.offsets,
               row_indices=t.row_indices, column_indices=t.column_indices)
    dds = dict(lhs=torch.zeros(dense, side, **on_dev), shape=t.shape,
               data=torch.zeros(t.nnz, block, block, **on_dev),
               **{k: v for k, v in t.metadata().items() if k != "shape"}, transpose_b=False,
               out=torch.full((dense, side), 7.0, **on_dev))
    return sdd, dds


BAD = {
    # (the call, the argument named, words of the message)
    # sdd
    "sdd lhs dtype": (lambda b: _sdd(b, lhs=b["lhs"].double()), "lhs", "dtype"),
    "sdd rhs dtype differs": (lambda b: _sdd(b, rhs=b["rhs"].half()), "rhs", "dtype float16"),
    "sdd rhs on another device": (lambda b: _sdd(b, rhs=b["rhs"].to("meta")), "rhs", "meta"),
    "sdd inner dims": (lambda b: _sdd(b, rhs=b["rhs"][:20]), "rhs", "shape"),
    "sdd shape": (lambda b: _sdd(b, shape=(32, 32)), "rhs", "shape"),
    "sdd shape not 2-D": (lambda b: _sdd(b, shape=(32,)), "shape", "two"),
    "sdd out not square": (lambda b: _sdd(b, out=torch.zeros(b["topo"].nnz, 16, 32)), "out", "square"),
    "sdd out not 3-D": (lambda b: _sdd(b, out=torch.zeros(b["topo"].nnz, 256)), "out", "3-D"),
    "sdd row_indices int64": (lambda b: _sdd(b, row_indices=b["topo"].row_indices.long()), "row_indices", "dtype"),
    "sdd column_indices length": (lambda b: _sdd(b, column_indices=b["topo"].column_indices[:-1]),
                                  "column_indices", "entries"),
    "sdd offsets length": (lambda b: _sdd(b, offsets=b["topo"].offsets[:-1]), "offsets", "entries"),
    "sdd offsets dtype": (lambda b: _sdd(b, offsets=b["topo"].offsets.long()), "offsets", "dtype"),
    # dsd
    "dsd data dtype": (lambda b: _dsd(b, data=b["data"].to(torch.int32)), "data", "dtype"),
    "dsd rhs dtype differs": (lambda b: _dsd(b, rhs=b["x"].half()), "rhs", "dtype float16"),
    "dsd rhs rows": (lambda b: _dsd(b, rhs=b["x"][:-16]), "rhs", "shape"),
    "dsd shape not a multiple": (lambda b: _dsd(b, shape=(40, 48)), "shape", "multiple"),
    "dsd out shape": (lambda b: _dsd(b, out=b["out_dsd"][:-1]), "out", "shape"),
    "dsd transpose_a not bool": (lambda b: _dsd(b, transpose_a=1), "transpose_a", "bool"),
    "dsd too many blocks": (lambda b: _dsd(b, data=torch.zeros(7, 16, 16)), "row_indices", "entries"),
    "dsd block_offsets_t dtype": (lambda b: _dsd(b, shape=b["topo"].shape[::-1], transpose_a=True,
                                                 rhs=b["y"].t().contiguous(), out=b["out_dds"].t().contiguous(),
                                                 block_offsets_t=b["topo"].block_offsets_t.short()),
                                  "block_offsets_t", "dtype"),
    "dsd offsets_t length": (lambda b: _dsd(b, shape=b["topo"].shape[::-1], transpose_a=True,
                                            rhs=b["y"].t().contiguous(), out=b["out_dds"].t().contiguous(),
                                            offsets_t=b["topo"].offsets), "offsets_t", "entries"),
    # dds
    "dds lhs cols": (lambda b: _dds(b, lhs=b["y"][:, :-1]), "lhs", "shape"),
    "dds out shape": (lambda b: _dds(b, out=b["out_dds"].t()), "out", "shape"),
    "dds transpose_b not bool": (lambda b: _dds(b, transpose_b=None), "transpose_b", "bool"),
    "dds column_indices_t dtype": (lambda b: _dds(b, column_indices_t=b["topo"].column_indices_t.float()),
                                   "column_indices_t", "dtype"),
    # row_indices
    "row_indices out length": (lambda b: _rows(b, out=b["rows"][:-1]), "out", "entries"),
    "row_indices out dtype": (lambda b: _rows(b, out=b["rows"].float()), "out", "dtype"),
    "row_indices offsets dtype": (lambda b: _rows(b, offsets=b["topo"].offsets.long()), "offsets", "dtype"),
    "row_indices int16 out, too many rows": (
        lambda b: _rows(b, shape=((2**15 + 1) * 16, 16), offsets=torch.zeros(2**15 + 2, dtype=torch.int32),
                        column_indices=torch.zeros(0, dtype=torch.int16), out=torch.zeros(0, dtype=torch.int16),
                        data=torch.empty(0, 16, 16, device="meta")), "out", "int16"),
}


def _no_launches(monkeypatch):
    for name in ("_sdd", "_dsd", "_dds", "_row_indices"):
        monkeypatch.setattr(bs, name, _NoLaunch())


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_refused_before_any_launch(monkeypatch, case):
    _no_launches(monkeypatch)
    make, arg, words = BAD[case]
    b = _valid()
    before = {k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)}
    op, a = make(b)
    with megablocks_ascend.use_backend("ascend"), pytest.raises(BlockSparseArgumentError) as info:
        backends.STK_KERNELS[op](**a)
    msg = str(info.value)
    assert msg.startswith(f"{op}: argument '{arg}'"), msg
    assert words in msg, msg
    for k, v in before.items():
        assert torch.equal(b[k], v), k


@pytest.mark.parametrize("block", [8, 256])
def test_block_sizes_the_kernels_do_not_take_are_refused_before_any_launch(monkeypatch, block):
    """A well-formed matrix of blocks the kernels were not written for: the ascend backend refuses
    it (the torch reference serves it)."""
    _no_launches(monkeypatch)
    for op, a in zip(("sdd", "dds"), _blocks_of(block, 16)):
        with megablocks_ascend.use_backend("ascend"), pytest.raises(BackendUnavailable) as info:
            backends.STK_KERNELS[op](**a)
        assert f"take blocks of {', '.join(map(str, bs.BLOCK_SIZES))}, not {block}" in str(info.value)
        assert bool((a["out"] == 7.0).all())
        with megablocks_ascend.use_backend("torch"):
            backends.STK_KERNELS[op](**a)
        assert not bool((a["out"] == 7.0).any())


def test_a_tile_that_does_not_fit_the_block_is_refused_before_any_launch(monkeypatch):
    """The launchers' own check: a ``tile`` they are given (tests, the gate, benchmarks)."""
    _no_launches(monkeypatch)
    op, a = _sdd(_valid())
    with pytest.raises(ValueError, match=r"^tile: sdd tile \(32, 16, 16\) does not fit block size 16"):
        bs.sdd(**a, tile=devices.CubeTile(32, 16, 16))


def test_the_bad_input_base_is_valid():
    b = _valid()
    for make in (_sdd, _dsd, _dds, _rows):
        op, a = make(b)
        with megablocks_ascend.use_backend("ascend"):
            backends.STK_KERNELS[op](**a)
    assert torch.equal(b["rows"], b["topo"].row_indices)


# --------------------------------------------------------------------------------------------
# Property: any topology, block size, dense size, layout, transpose and grid.

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 4), cols=st.integers(1, 4), block=st.sampled_from([16, 32]),
       density=st.floats(0.0, 1.0), dense=st.integers(1, 40), transpose=st.booleans(),
       layout=st.sampled_from(LAYOUTS), num_programs=st.integers(1, 5), seed=st.integers(0, 2**16),
       index_dtype=st.sampled_from([torch.int16, torch.int32]))
def test_any_topology(rows, cols, block, density, dense, transpose, layout, num_programs, seed, index_dtype):
    gen = torch.Generator().manual_seed(seed)
    topo = topology_from_mask(torch.rand(rows, cols, generator=gen) < density, block, index_dtype)
    dtype = torch.float32
    launch = dict(num_programs=num_programs)
    assert_close(*run_sdd(topo, dense, dtype, gen, layout, "col", **launch), dtype, "sdd")
    assert_close(*run_dsd(topo, dense, dtype, gen, transpose, layout, **launch), dtype, "dsd")
    assert_close(*run_dds(topo, dense, dtype, gen, transpose, layout, **launch), dtype, "dds")
