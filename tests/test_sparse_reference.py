"""stk's four block-sparse kernel functions, served through the dispatch, against float64 and stk.

Every call goes in through ``stk.backend.triton_kernels.<name>`` (what stk's autograd functions
and MegaBlocks call) with ``use_backend(backend)``, for ``ascend`` (our Triton kernels, in the
interpreter here) and ``torch`` (``megablocks_ascend.reference.blocksparse``), and the trace must
show that backend served it. Results are compared with ``tests/support/blocksparse_impl.py`` (float64,
block by block) over topologies with empty block rows and columns, no block, one block and all
blocks; both transposes stk uses (``transpose_a``/``transpose_b``, and dense operands given as
``.t()`` views); fp32, fp16 and bf16; dense dimensions that are not multiples of anything; and
matrices past 32768 rows and columns, where int16 block-index arithmetic (stk's bug) would wrap.

Bound: the products are accumulated in float32 and rounded once to the output dtype, so
``|out - ref| <= u * |ref| + (K + 2) * eps32 * (|A| @ |B|)`` with ``u`` half an ulp of the dtype
(a full ulp for bf16 from the interpreter, whose float32 -> bf16 cast truncates; see
tests/test_routing_kernels.py). Outputs are filled with NaN first, so every element must be
written; inputs must come back unchanged.

stk's own kernels (run directly, in the interpreter: they are single-config autotuned) are a
second, independent oracle where they are valid (128 x 128 blocks, multiples of 128).
"""

from __future__ import annotations

import pytest
import stk.backend.triton_kernels as stk_kernels
import torch

import blocksparse_impl as bs
import megablocks_ascend
from megablocks_ascend import backends

BACKENDS = ["ascend", "torch"]
EPS32 = torch.finfo(torch.float32).eps
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _unit(dtype, backend, device):
    eps = torch.finfo(dtype).eps
    truncates = dtype == torch.bfloat16 and backend == "ascend" and device.type == "cpu"
    return eps if truncates else eps / 2


def _assert_close(out, ref, ref_abs, k_inner, dtype, backend, device, what, roundings=1):
    """``out`` within the float32-accumulation bound of ``ref``, plus ``roundings`` roundings to
    ``dtype`` (two when ``ref`` is itself a rounded result: the other kernel's)."""
    assert not torch.isnan(out).any(), f"{what}: an output element was not written"
    err = (bs.f64(out) - ref).abs()
    # stk's own kernels multiply float32 in TF32 on CUDA (tl.dot's default): 2**-10 per product
    products = 2.0**-10 if backend == "stk" and dtype == torch.float32 and device.type == "cuda" else 0.0
    bound = roundings * _unit(dtype, backend, device) * ref.abs() + ((k_inner + 2) * EPS32 + products) * ref_abs + 1e-30
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3g}x the bound"


def _call(name, backend, **kwargs):
    inputs = {k: v.clone() for k, v in kwargs.items()
              if isinstance(v, torch.Tensor) and k != "out" and v.device.type != "meta"}
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        getattr(stk_kernels, name)(**kwargs)
    assert [(c.op, c.backend) for c in calls] == [(name, backend)]
    for k, v in inputs.items():
        assert torch.equal(kwargs[k], v), f"{name} changed its input '{k}'"


def _dense_operand(rows, cols, dtype, transposed, device, gen):
    """A [rows, cols] operand: contiguous, or the .t() view of a contiguous [cols, rows] tensor."""
    if transposed:
        return torch.randn(cols, rows, generator=gen).to(dtype).to(device).t()
    return torch.randn(rows, cols, generator=gen).to(dtype).to(device)


TOPOLOGIES = {
    # name -> (block rows, block columns, block, how the blocks are chosen)
    "random": (4, 5, 16, "random"),
    "none": (3, 2, 16, "none"),
    "one": (3, 4, 32, "one"),
    "all": (2, 3, 16, "all"),
}


def _topology(kind, gen, index_dtype=torch.int16):
    rows, cols, block, how = TOPOLOGIES[kind]
    shape = (rows * block, cols * block)
    if how == "random":  # block row 1 and block column 3 empty
        return bs.random_topology(rows, cols, block, 0.6, gen, empty_rows=(1,), empty_cols=(3,),
                                  index_dtype=index_dtype)
    blocks = {"none": [], "one": [(rows - 1, 1)], "all": [(r, c) for r in range(rows) for c in range(cols)]}[how]
    return bs.topology(shape, block, blocks, index_dtype)


CASES = [
    # (topology, dtype, first operand transposed, second operand transposed)
    ("random", torch.float32, False, False),
    ("random", torch.float16, True, False),
    ("random", torch.bfloat16, False, True),
    ("random", torch.float32, True, True),
    ("none", torch.float32, False, False),
    ("one", torch.bfloat16, True, False),
    ("all", torch.float16, False, True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,dtype,lhs_t,rhs_t", CASES)
def test_sdd(backend, kind, dtype, lhs_t, rhs_t, device):
    gen = torch.Generator().manual_seed(1)
    top = _topology(kind, gen).to(device)
    m, n = top.shape
    k = 24  # not a multiple of the block size: the inner dimension's tail must be masked
    lhs = _dense_operand(m, k, dtype, lhs_t, device, gen)
    rhs = _dense_operand(k, n, dtype, rhs_t, device, gen)
    out = torch.full((top.nnz, top.block, top.block), float("nan"), dtype=dtype, device=device)
    _call("sdd", backend, lhs=lhs, rhs=rhs, shape=top.shape, out=out, offsets=top.offsets,
          row_indices=top.row_indices, column_indices=top.column_indices)
    ref = bs.blocks_of(top, bs.f64(lhs) @ bs.f64(rhs))
    ref_abs = bs.blocks_of(top, bs.f64(lhs).abs() @ bs.f64(rhs).abs())
    _assert_close(out, ref, ref_abs, k, dtype, backend, device, "sdd")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("kind,dtype,_,rhs_t", CASES)
def test_dsd(backend, transpose_a, kind, dtype, _, rhs_t, device):
    gen = torch.Generator().manual_seed(2)
    top = _topology(kind, gen).to(device)
    data = torch.randn(top.nnz, top.block, top.block, generator=gen).to(dtype).to(device)
    a = bs.dense(top, data)
    a = a.T if transpose_a else a
    n = 20  # the dense output's columns (the dMoE's hidden size): any number
    rhs = _dense_operand(a.shape[1], n, dtype, rhs_t, device, gen)
    out = torch.full((a.shape[0], n), float("nan"), dtype=dtype, device=device)
    _call("dsd", backend, shape=tuple(a.shape), data=data, **top.metadata(), transpose_a=transpose_a, rhs=rhs,
          out=out)
    _assert_close(out, a @ bs.f64(rhs), a.abs() @ bs.f64(rhs).abs(), a.shape[1], dtype, backend, device, "dsd")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("kind,dtype,lhs_t,_", CASES)
def test_dds(backend, transpose_b, kind, dtype, lhs_t, _, device):
    gen = torch.Generator().manual_seed(3)
    top = _topology(kind, gen).to(device)
    data = torch.randn(top.nnz, top.block, top.block, generator=gen).to(dtype).to(device)
    b = bs.dense(top, data)
    b = b.T if transpose_b else b
    m = 20  # the dense output's rows: any number
    lhs = _dense_operand(m, b.shape[0], dtype, lhs_t, device, gen)
    out = torch.full((m, b.shape[1]), float("nan"), dtype=dtype, device=device)
    _call("dds", backend, lhs=lhs, shape=tuple(b.shape), data=data, **top.metadata(), transpose_b=transpose_b,
          out=out)
    _assert_close(out, bs.f64(lhs) @ b, bs.f64(lhs).abs() @ b.abs(), b.shape[0], dtype, backend, device, "dds")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(TOPOLOGIES))
@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
def test_row_indices(backend, kind, index_dtype, device):
    top = _topology(kind, torch.Generator().manual_seed(4), index_dtype).to(device)
    out = torch.full((top.nnz,), -1, dtype=index_dtype, device=device)
    data = torch.empty(top.nnz, top.block, top.block, device="meta")  # as MegaBlocks' topology() passes it
    _call("row_indices", backend, shape=top.shape, data=data, offsets=top.offsets,
          column_indices=top.column_indices, out=out)
    assert torch.equal(out.cpu(), top.row_indices.cpu())


# Past int16: 2052 blocks of 16 elements (32832 > 32768 + 16), so the last block rows or columns
# start past element 32768. sdd uses a square matrix (it only visits its blocks); dsd and dds put
# the long dimension on the inner (K) side, so that their dense outputs stay small.
BIG = 2052
SDD_BLOCKS = [(0, 0), (0, BIG - 1), (1100, 7), (2048, 2048), (BIG - 1, 3), (BIG - 1, BIG - 1)]
WIDE_BLOCKS = [(0, 0), (0, BIG - 1), (1, 2048), (1, 3)]  # 2 block rows, BIG block columns


def _by_blocks(top, data, transpose):
    """The blocks of op(S) as (block row, block column, float64 block)."""
    for i, (r, c) in enumerate(top.blocks):
        blk = bs.f64(data[i])
        yield (c, r, blk.T) if transpose else (r, c, blk)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sdd", "dsd", "dsd_t", "dds", "dds_t"])
def test_block_offsets_past_int16(backend, op, device):
    gen = torch.Generator().manual_seed(5)
    block, inner, dtype = 16, 8, torch.float32
    if op == "sdd":
        top = bs.topology((BIG * block, BIG * block), block, SDD_BLOCKS).to(device)
        lhs = torch.randn(top.shape[0], inner, generator=gen).to(device)
        rhs = torch.randn(inner, top.shape[1], generator=gen).to(device)
        out = torch.full((top.nnz, block, block), float("nan"), device=device)
        _call("sdd", backend, lhs=lhs, rhs=rhs, shape=top.shape, out=out, offsets=top.offsets,
              row_indices=top.row_indices, column_indices=top.column_indices)
        # only the kept blocks' rows and columns of the product matter: compute those alone
        rows = [bs.f64(lhs[r * block:(r + 1) * block]) for r, _ in top.blocks]
        cols = [bs.f64(rhs[:, c * block:(c + 1) * block]) for _, c in top.blocks]
        ref = torch.stack([a @ b for a, b in zip(rows, cols)])
        ref_abs = torch.stack([a.abs() @ b.abs() for a, b in zip(rows, cols)])
        _assert_close(out, ref, ref_abs, inner, dtype, backend, device, op)
        return
    transpose = op.endswith("_t")
    wide = op.startswith("dsd") != transpose  # the stored matrix is 2 x BIG blocks (else BIG x 2)
    blocks = WIDE_BLOCKS if wide else [(c, r) for r, c in WIDE_BLOCKS]
    stored = (2 * block, BIG * block) if wide else (BIG * block, 2 * block)
    top = bs.topology(stored, block, blocks).to(device)
    data = torch.randn(top.nnz, block, block, generator=gen).to(device)
    seen = stored[::-1] if transpose else stored
    if op.startswith("dsd"):  # out [32, inner] = op(S) [32, 32832] @ rhs [32832, inner]
        rhs = torch.randn(seen[1], inner, generator=gen).to(device)
        out = torch.full((seen[0], inner), float("nan"), device=device)
        _call("dsd", backend, shape=seen, data=data, **top.metadata(), transpose_a=transpose, rhs=rhs, out=out)
        ref = torch.zeros(seen[0], inner, dtype=torch.float64)
        ref_abs = torch.zeros_like(ref)
        for r, c, blk in _by_blocks(top, data, transpose):
            ref[r * block:(r + 1) * block] += blk @ bs.f64(rhs[c * block:(c + 1) * block])
            ref_abs[r * block:(r + 1) * block] += blk.abs() @ bs.f64(rhs[c * block:(c + 1) * block]).abs()
    else:  # out [inner, 32] = lhs [inner, 32832] @ op(S) [32832, 32]
        lhs = torch.randn(inner, seen[0], generator=gen).to(device)
        out = torch.full((inner, seen[1]), float("nan"), device=device)
        _call("dds", backend, lhs=lhs, shape=seen, data=data, **top.metadata(), transpose_b=transpose, out=out)
        ref = torch.zeros(inner, seen[1], dtype=torch.float64)
        ref_abs = torch.zeros_like(ref)
        for r, c, blk in _by_blocks(top, data, transpose):
            ref[:, c * block:(c + 1) * block] += bs.f64(lhs[:, r * block:(r + 1) * block]) @ blk
            ref_abs[:, c * block:(c + 1) * block] += bs.f64(lhs[:, r * block:(r + 1) * block]).abs() @ blk.abs()
    _assert_close(out, ref, ref_abs, 2 * block, dtype, backend, device, op)


# ---------------------------------------------------------------------------------------------
# Against stk's own kernels, where they are valid.


@pytest.fixture(scope="module")
def stk_own():
    return {name: backends._upstream_stk(name) for name in backends.STK_SPECS}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_agrees_with_stks_own_kernels(backend, dtype, stk_own, device):
    """Both within the float64 bound, and within twice the bound of each other."""
    gen = torch.Generator().manual_seed(6)
    block = 128
    top = bs.topology((256, 384), block, [(0, 0), (0, 2), (1, 1), (1, 2)]).to(device)
    data = torch.randn(top.nnz, block, block, generator=gen).to(dtype).to(device)
    s = bs.dense(top, data)
    x = torch.randn(384, 128, generator=gen).to(dtype).to(device)
    y = torch.randn(128, 256, generator=gen).to(dtype).to(device)
    w = torch.randn(128, 384, generator=gen).to(dtype).to(device)
    cases = {  # name -> (function, arguments, output shape, float64 result, float64 |A| @ |B|, inner size)
        "sdd": ("sdd", dict(lhs=y.t(), rhs=w, shape=top.shape, offsets=top.offsets, row_indices=top.row_indices,
                            column_indices=top.column_indices), (top.nnz, block, block),
                bs.blocks_of(top, bs.f64(y.t()) @ bs.f64(w)), bs.blocks_of(top, bs.f64(y.t()).abs() @ bs.f64(w).abs()),
                128),
        "dsd": ("dsd", dict(shape=top.shape, data=data, **top.metadata(), transpose_a=False, rhs=x), (256, 128),
                s @ bs.f64(x), s.abs() @ bs.f64(x).abs(), 384),
        "dsd_t": ("dsd", dict(shape=top.shape[::-1], data=data, **top.metadata(), transpose_a=True,
                              rhs=y.t().contiguous()), (384, 128),
                  s.T @ bs.f64(y.t()), s.T.abs() @ bs.f64(y.t()).abs(), 256),
        "dds": ("dds", dict(lhs=y, shape=top.shape, data=data, **top.metadata(), transpose_b=False), (128, 384),
                bs.f64(y) @ s, bs.f64(y).abs() @ s.abs(), 256),
        "dds_t": ("dds", dict(lhs=x.t().contiguous(), shape=top.shape[::-1], data=data, **top.metadata(),
                              transpose_b=True), (128, 256),
                  bs.f64(x.t()) @ s.T, bs.f64(x.t()).abs() @ s.T.abs(), 384),
    }
    for what, (name, kwargs, out_shape, ref, ref_abs, inner) in cases.items():
        theirs = torch.full(out_shape, float("nan"), dtype=dtype, device=device)
        ours = torch.full(out_shape, float("nan"), dtype=dtype, device=device)
        stk_own[name](**kwargs, out=theirs)
        _call(name, backend, **kwargs, out=ours)
        _assert_close(theirs, ref, ref_abs, inner, dtype, "stk", device, f"stk's own {what}")
        _assert_close(ours, ref, ref_abs, inner, dtype, backend, device, what)
        _assert_close(ours, bs.f64(theirs), 2 * ref_abs, 2 * inner, dtype, "stk", device, f"{what} vs stk's",
                      roundings=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_enclosing_autocast_changes_nothing(backend, device):
    """MegaBlocks' memory-optimized backward calls dsd/sdd directly with autocast on: the kernel
    functions compute in their operands' dtype regardless (float32 here), bit for bit."""
    gen = torch.Generator().manual_seed(7)
    top = _topology("random", gen).to(device)
    data = torch.randn(top.nnz, top.block, top.block, generator=gen).to(device)
    rhs = torch.randn(top.shape[1], 20, generator=gen).to(device)
    outs = []
    for autocast in (False, True):
        out = torch.full((top.shape[0], 20), float("nan"), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _call("dsd", backend, shape=top.shape, data=data, **top.metadata(), transpose_a=False, rhs=rhs, out=out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["dsd", "dds"])
def test_an_output_view_is_written_through_its_strides(backend, op, device):
    """stk writes dsd/dds's ``out`` by its strides (MegaBlocks' memory-optimized backward hands it
    the incoming gradient): a strided view gets exactly its elements, the rest of its storage
    stays as it was."""
    gen = torch.Generator().manual_seed(8)
    top = _topology("random", gen).to(device)
    data = torch.randn(top.nnz, top.block, top.block, generator=gen).to(device)
    a = bs.dense(top, data)
    if op == "dsd":
        dense = torch.randn(a.shape[1], 20, generator=gen).to(device)
        shape_out, ref, ref_abs, inner = (a.shape[0], 20), a @ bs.f64(dense), a.abs() @ bs.f64(dense).abs(), a.shape[1]
        kwargs = dict(shape=top.shape, data=data, **top.metadata(), transpose_a=False, rhs=dense)
    else:
        dense = torch.randn(20, a.shape[0], generator=gen).to(device)
        shape_out, ref, ref_abs, inner = (20, a.shape[1]), bs.f64(dense) @ a, bs.f64(dense).abs() @ a.abs(), a.shape[0]
        kwargs = dict(lhs=dense, shape=top.shape, data=data, **top.metadata(), transpose_b=False)
    storage = torch.full((shape_out[0] * 2, shape_out[1] * 3), 7.0, device=device)
    out = storage[::2, ::3]  # both strides > 1
    _call(op, backend, **kwargs, out=out)
    _assert_close(out, ref, ref_abs, inner, torch.float32, backend, device, op)
    untouched = torch.ones_like(storage, dtype=torch.bool)
    untouched[::2, ::3] = False
    assert bool((storage[untouched] == 7.0).all())
