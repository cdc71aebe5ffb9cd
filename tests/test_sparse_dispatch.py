"""stk's block-sparse matmuls through the dispatch: every way in, every backend value, the ``cuda``
refusal conditions, bad input, the custom ops, and MegaBlocks' sparse-MLP refusal (lifted or kept).
"""

from __future__ import annotations

import inspect
import types

import pytest
import stk
import stk.backend.sputnik
import stk.backend.triton_kernels as stk_kernels
import torch

import blocksparse_impl as bs
import megablocks_ascend
from megablocks.layers import mlp as mb_mlp
from megablocks.layers.arguments import Arguments
from megablocks_ascend import BackendUnavailable, BlockSparseArgumentError, backends, library, patching
from megablocks_ascend.patching import sparse_mlp_refusal

NAMES = ("sdd", "dsd", "dds", "row_indices")


def _matrix(top: bs.Topology, data: torch.Tensor) -> stk.Matrix:
    return stk.Matrix(top.shape, data, top.row_indices, top.column_indices, top.offsets,
                      top.column_indices_t, top.offsets_t, top.block_offsets_t)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _small_topology():
    return bs.topology((48, 64), 16, [(0, 0), (0, 3), (2, 1), (2, 2), (2, 3)])


# ---------------------------------------------------------------------------------------------
# Every way into stk's kernels reaches the dispatcher.


def test_the_four_functions_are_our_entry_points():
    for name in NAMES:
        fn = getattr(stk_kernels, name)
        assert fn is library.STK_ENTRY_POINTS[name] and fn.__megablocks_ascend__
        assert tuple(inspect.signature(fn).parameters) == backends.STK_SPECS[name][0]
    assert stk.backend.sputnik.backend is stk_kernels  # stk's autograd functions look them up there


@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_stk_ops_forward_and_backward_are_served(backend):
    top = _small_topology()
    x = torch.randn(48, 24, requires_grad=True)
    w = torch.randn(64, 24, requires_grad=True)
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        h = stk.ops.sdd(x, w.t(), _matrix(top, torch.empty(top.nnz, 16, 16, device="meta")))
        y = stk.ops.dsd(h, w)
        z = stk.ops.dds(y.t().contiguous(), h)  # [24, 48] @ [48, 64]
        z.sum().backward()
        r = stk.ops.row_indices(top.shape, h.data, top.offsets, top.column_indices)
    assert {c.backend for c in calls} == {backend}
    assert {c.op for c in calls} == set(NAMES)
    assert torch.equal(r, top.row_indices)
    # and the numbers are right: the same chain on dense float64 matrices
    mask = bs.dense(top, torch.ones(top.nnz, 16, 16))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    hd = (xd @ wd.T) * mask
    zd = (hd @ wd).T @ hd
    zd.sum().backward()
    for got, want in ((z, zd), (x.grad, xd.grad), (w.grad, wd.grad)):
        assert _rel(got, want) < 1e-5


def test_memory_optimized_mlp_direct_calls_are_served():
    """MegaBlocks' MemoryOptimizedMLP calls stk.backend.triton_kernels.sdd/dsd directly in its
    backward: those must reach the dispatcher too (all six calls of a step are recorded)."""
    block = 128
    top = bs.topology((256, 256), block, [(0, 0), (1, 1)])
    x = torch.randn(256, 32, requires_grad=True)
    w1 = torch.randn(256, 32, requires_grad=True)
    w2 = torch.randn(256, 32, requires_grad=True)
    with megablocks_ascend.use_backend("torch"), megablocks_ascend.trace() as calls:
        out = mb_mlp.memory_optimized_mlp(x, w1, w2, _matrix(top, torch.empty(2, block, block, device="meta")),
                                          mb_mlp.DEFAULT_ACTIVATION_FN)
        out.backward(torch.randn_like(out))
    assert [c.op for c in calls] == ["sdd", "dsd", "dsd", "sdd", "dsd", "dsd"]
    assert {c.backend for c in calls} == {"torch"}


# ---------------------------------------------------------------------------------------------
# Backend values.


def _sdd_args(device="cpu"):
    top = _small_topology().to(device)
    return dict(lhs=torch.randn(48, 8, device=device), rhs=torch.randn(8, 64, device=device), shape=top.shape,
                out=torch.full((top.nnz, 16, 16), 7.0, device=device), offsets=top.offsets,
                row_indices=top.row_indices, column_indices=top.column_indices)


def test_auto_serves_cpu_tensors_with_torch(monkeypatch):
    monkeypatch.delenv("MEGABLOCKS_BACKEND", raising=False)
    with megablocks_ascend.trace() as calls:
        stk_kernels.sdd(**_sdd_args())
    assert [(c.op, c.backend, c.device) for c in calls] == [("sdd", "torch", "cpu")]
    assert megablocks_ascend.last_backend("sdd") == "torch"


@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_env_var_selects_backend(monkeypatch, backend):
    monkeypatch.setenv("MEGABLOCKS_BACKEND", backend)
    with megablocks_ascend.trace() as calls:
        stk_kernels.sdd(**_sdd_args())
    assert [c.backend for c in calls] == [backend]


def test_cuda_on_cpu_tensors_is_a_clear_error_and_runs_nothing():
    a = _sdd_args()
    with megablocks_ascend.use_backend("cuda"), megablocks_ascend.trace() as calls:
        with pytest.raises(BackendUnavailable, match="MEGABLOCKS_BACKEND=ascend"):
            stk_kernels.sdd(**a)
    assert calls == [] and bool((a["out"] == 7.0).all())


# ---------------------------------------------------------------------------------------------
# The cuda backend (stk's own kernels): exactly the calls they get wrong are refused.


@pytest.fixture
def cuda_recorder(monkeypatch):
    """Pretend the tensors' device resolves to ``cuda`` and record what stk's own functions get."""
    got = []
    monkeypatch.setattr(backends, "resolve", lambda device: "cuda")
    for name in NAMES:
        monkeypatch.setitem(backends.UPSTREAM_STK, name, lambda *a, _n=name, **k: got.append(_n))
    return got


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _meta_topology(block_rows, block_cols, nnz, index_dtype=torch.int16):
    return dict(offsets=_meta(block_rows + 1, dtype=torch.int32), row_indices=_meta(nnz, dtype=index_dtype),
                column_indices=_meta(nnz, dtype=index_dtype), offsets_t=_meta(block_cols + 1, dtype=torch.int32),
                column_indices_t=_meta(nnz, dtype=index_dtype), block_offsets_t=_meta(nnz, dtype=torch.int32))


def _sdd_meta(m, n, k=128, block=128, nnz=4, index_dtype=torch.int16):
    t = _meta_topology(m // block, n // block, nnz, index_dtype)
    return dict(lhs=_meta(m, k), rhs=_meta(k, n), shape=(m, n), out=_meta(nnz, block, block),
                offsets=t["offsets"], row_indices=t["row_indices"], column_indices=t["column_indices"])


def _dsd_meta(m, k, n=128, rhs_t=False, transpose_a=False, nnz=4, index_dtype=torch.int16):
    stored = (k, m) if transpose_a else (m, k)
    rhs = _meta(n, k).t() if rhs_t else _meta(k, n)
    return dict(shape=(m, k), data=_meta(nnz, 128, 128), **_meta_topology(stored[0] // 128, stored[1] // 128, nnz,
                index_dtype), transpose_a=transpose_a, rhs=rhs, out=_meta(m, n))


def _dds_meta(k, n, m=128, lhs_t=False, transpose_b=False, nnz=4, index_dtype=torch.int16):
    stored = (n, k) if transpose_b else (k, n)
    lhs = _meta(k, m).t() if lhs_t else _meta(m, k)
    return dict(lhs=lhs, shape=(k, n), data=_meta(nnz, 128, 128), **_meta_topology(stored[0] // 128,
                stored[1] // 128, nnz, index_dtype), transpose_b=transpose_b, out=_meta(m, n))


EDGE = 32768 + 128  # the first size whose last 128-block starts at element 32768


REFUSALS = [
    # (id, op, arguments, refused: the text the error must contain, or None for served)
    ("sdd-rows-at-limit", "sdd", lambda: _sdd_meta(32768, 256), None),
    ("sdd-rows-past", "sdd", lambda: _sdd_meta(EDGE, 256), "row_indices * BLOCK_M"),
    ("sdd-cols-past", "sdd", lambda: _sdd_meta(256, EDGE), "column_indices * BLOCK_N"),
    ("sdd-int32-indices", "sdd", lambda: _sdd_meta(EDGE, EDGE, index_dtype=torch.int32), None),
    ("sdd-block-64", "sdd", lambda: _sdd_meta(256, 256, block=64), "128 x 128 blocks only"),
    ("sdd-k-not-32", "sdd", lambda: _sdd_meta(256, 256, k=48), "K of 32"),
    ("dsd-contiguous-rhs", "dsd", lambda: _dsd_meta(256, EDGE), None),
    ("dsd-rhs-t-at-limit", "dsd", lambda: _dsd_meta(256, 32768, rhs_t=True), None),
    # dsd and dds multiply their int16 indices by a local int32 value: no wrap (see the IR test below)
    ("dsd-rhs-t-past", "dsd", lambda: _dsd_meta(256, EDGE, rhs_t=True), None),
    ("dsd-transposed-rhs-t-past", "dsd", lambda: _dsd_meta(256, EDGE, rhs_t=True, transpose_a=True), None),
    ("dsd-n-not-128", "dsd", lambda: _dsd_meta(256, 256, n=96), "multiples of 128"),
    ("dds-contiguous-lhs-at-limit", "dds", lambda: _dds_meta(32768, 256), None),
    ("dds-contiguous-lhs-past", "dds", lambda: _dds_meta(EDGE, 256), None),
    ("dds-transposed-past", "dds", lambda: _dds_meta(EDGE, 256, transpose_b=True), None),
    ("dds-lhs-t-view", "dds", lambda: _dds_meta(EDGE, 256, lhs_t=True), None),
    ("dds-int32-indices", "dds", lambda: _dds_meta(EDGE, 256, index_dtype=torch.int32), None),
    # int32 offsets: 2**31 elements end at offset 2**31 - 1, one more block row does not fit
    ("sdd-lhs-2^31", "sdd", lambda: _sdd_meta(1 << 16, 256, k=1 << 15, index_dtype=torch.int32), None),
    ("sdd-lhs-past-2^31", "sdd", lambda: _sdd_meta((1 << 16) + 128, 256, k=1 << 15, index_dtype=torch.int32),
     "int32 offsets"),
    ("dsd-data-2^31", "dsd", lambda: _dsd_meta(1 << 16, 1 << 16, nnz=1 << 17, index_dtype=torch.int32), None),
    ("dsd-data-past-2^31", "dsd", lambda: _dsd_meta(1 << 16, 1 << 16, nnz=(1 << 17) + 1, index_dtype=torch.int32),
     "'data'"),
]


@pytest.mark.parametrize("op,make,refused", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_cuda_refuses_exactly_where_stks_kernels_overflow(op, make, refused, cuda_recorder):
    a = make()
    with megablocks_ascend.trace() as calls:
        if refused is None:
            getattr(stk_kernels, op)(**a)
        else:
            with pytest.raises(BackendUnavailable, match="MEGABLOCKS_BACKEND=ascend") as e:
                getattr(stk_kernels, op)(**a)
            assert refused in str(e.value)
    assert cuda_recorder == ([op] if refused is None else [])
    assert [c.backend for c in calls] == (["cuda"] if refused is None else [])


def test_cuda_runs_stks_own_kernel_when_it_is_correct(monkeypatch):
    """Through the dispatch, ``cuda`` runs stk's own function (here in the interpreter)."""
    monkeypatch.setattr(backends, "resolve", lambda device: "cuda")
    top = bs.topology((256, 256), 128, [(0, 1), (1, 0)])
    lhs, rhs = torch.randn(256, 64), torch.randn(64, 256)
    out = torch.full((2, 128, 128), float("nan"))
    with megablocks_ascend.trace() as calls:
        stk_kernels.sdd(lhs, rhs, top.shape, out, top.offsets, top.row_indices, top.column_indices)
    assert [c.backend for c in calls] == ["cuda"]
    torch.testing.assert_close(out.double(), bs.blocks_of(top, lhs.double() @ rhs.double()), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, before anything runs, tensors untouched.


def _valid(op):
    top = _small_topology()
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(top.nnz, 16, 16, generator=gen)
    if op == "sdd":
        return _sdd_args()
    if op == "dsd":
        return dict(shape=top.shape, data=data, **top.metadata(), transpose_a=False, rhs=torch.randn(64, 8),
                    out=torch.full((48, 8), 7.0))
    if op == "dds":
        return dict(lhs=torch.randn(8, 48), shape=top.shape, data=data, **top.metadata(), transpose_b=False,
                    out=torch.full((8, 64), 7.0))
    return dict(shape=top.shape, data=torch.empty(top.nnz, 16, 16, device="meta"), offsets=top.offsets,
                column_indices=top.column_indices, out=torch.full((top.nnz,), 7, dtype=torch.int16))


def _both_strides_gt_1(t):
    return torch.zeros(t.shape[0] * 2, t.shape[1] * 2, dtype=t.dtype)[::2, ::2]


BAD = [
    # (op, argument expected in the error, mutation of the valid arguments)
    ("sdd", "lhs", lambda a: a.update(lhs=a["lhs"].half())),
    ("sdd", "lhs", lambda a: a.update(lhs=a["lhs"][None])),
    ("sdd", "lhs", lambda a: a.update(lhs=a["lhs"][:32])),
    ("sdd", "rhs", lambda a: a.update(rhs=a["rhs"][:4])),
    ("sdd", "rhs", lambda a: a.update(rhs=_both_strides_gt_1(a["rhs"]))),
    ("sdd", "lhs", lambda a: a.update(lhs=_both_strides_gt_1(a["lhs"]))),
    ("sdd", "out", lambda a: a.update(out=a["out"].transpose(1, 2))),
    ("sdd", "out", lambda a: a.update(out=a["out"][:, :8])),
    ("sdd", "out", lambda a: a.update(out=a["out"].long())),
    ("sdd", "shape", lambda a: a.update(shape=(48, 60))),
    ("sdd", "shape", lambda a: a.update(shape=torch.tensor([48, 64]))),
    ("sdd", "shape", lambda a: a.update(shape=(48,))),
    ("sdd", "offsets", lambda a: a.update(offsets=a["offsets"][:-1])),
    ("sdd", "offsets", lambda a: a.update(offsets=a["offsets"].long())),
    ("sdd", "row_indices", lambda a: a.update(row_indices=a["row_indices"][:-1])),
    ("sdd", "column_indices", lambda a: a.update(column_indices=a["column_indices"].float())),
    ("sdd", "column_indices", lambda a: a.update(column_indices=a["column_indices"].to("meta"))),
    ("dsd", "transpose_a", lambda a: a.update(transpose_a=1)),
    ("dsd", "data", lambda a: a.update(data=a["data"].flatten(1))),
    ("dsd", "data", lambda a: a.update(data=a["data"][:, :, :8])),
    ("dsd", "rhs", lambda a: a.update(rhs=a["rhs"].double())),
    ("dsd", "rhs", lambda a: a.update(rhs=a["rhs"][:48])),
    ("dsd", "out", lambda a: a.update(out=a["out"][:, :4])),
    ("dsd", "out", lambda a: a.update(out=a["out"].half())),
    ("dsd", "offsets_t", lambda a: a.update(offsets_t=a["offsets_t"][:-1])),
    ("dsd", "block_offsets_t", lambda a: a.update(block_offsets_t=a["block_offsets_t"].short())),
    ("dsd", "column_indices_t", lambda a: a.update(column_indices_t=a["column_indices_t"][:2])),
    ("dsd", "offsets", lambda a: a.update(offsets=torch.zeros(5, dtype=torch.int32))),
    # transpose_a without the transposed shape: the stored matrix would be 64 x 48, with 5 offsets
    ("dsd", "offsets", lambda a: a.update(transpose_a=True)),
    ("dds", "lhs", lambda a: a.update(lhs=a["lhs"][:, :32])),
    ("dds", "out", lambda a: a.update(out=a["out"][:, :48])),
    ("dds", "transpose_b", lambda a: a.update(transpose_b=None)),
    ("row_indices", "out", lambda a: a.update(out=a["out"][:-1])),
    ("row_indices", "offsets", lambda a: a.update(offsets=a["offsets"][1:])),
    ("row_indices", "data", lambda a: a.update(data=a["data"].flatten(1))),
    ("row_indices", "out", lambda a: a.update(out=a["out"].float())),
]


@pytest.mark.parametrize("op,arg,mutate", BAD, ids=[f"{b[0]}-{b[1]}-{i}" for i, b in enumerate(BAD)])
@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_bad_input_names_the_argument_before_anything_runs(op, arg, mutate, backend):
    a = _valid(op)
    mutate(a)
    before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        with pytest.raises(BlockSparseArgumentError, match=f"^{op}: argument '{arg}'"):
            getattr(stk_kernels, op)(**a)
    assert calls == []
    for k, v in before.items():
        assert torch.equal(a[k], v), k


def test_int16_indices_that_cannot_address_the_matrix_are_refused():
    # 1 x 1 blocks (stk allows them): 32769 block columns need more than int16 can index
    a = dict(lhs=torch.randn(1, 1), rhs=torch.randn(1, 32769), shape=(1, 32769), out=torch.zeros(1, 1, 1),
             offsets=torch.tensor([0, 1], dtype=torch.int32), row_indices=torch.zeros(1, dtype=torch.int16),
             column_indices=torch.zeros(1, dtype=torch.int16))
    with pytest.raises(BlockSparseArgumentError, match="'column_indices' is int16, which cannot index 32769"):
        stk_kernels.sdd(**a)
    a["column_indices"] = a["column_indices"].int()
    a["row_indices"] = a["row_indices"].int()
    with megablocks_ascend.use_backend("torch"):
        stk_kernels.sdd(**a)
    torch.testing.assert_close(a["out"][0, 0, 0], a["lhs"][0, 0] * a["rhs"][0, 0])


VALUE_BAD = [
    # (argument, mutation of a valid dsd call's metadata)
    ("offsets", lambda a: a["offsets"].copy_(torch.tensor([0, 2, 1, 5], dtype=torch.int32))),
    # past the blocks (ending below them is a topology with spare blocks: kernels/topology.py)
    ("offsets", lambda a: a["offsets"].copy_(torch.tensor([0, 2, 3, 6], dtype=torch.int32))),
    ("row_indices", lambda a: a["row_indices"].copy_(torch.tensor([0, 0, 1, 2, 2], dtype=torch.int16))),
    ("column_indices", lambda a: a["column_indices"].copy_(torch.tensor([0, 3, 1, 2, 4], dtype=torch.int16))),
    ("offsets_t", lambda a: a["offsets_t"].copy_(torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32))),
    ("block_offsets_t", lambda a: a["block_offsets_t"].copy_(torch.tensor([0, 2, 3, 1, 1], dtype=torch.int32))),
    ("column_indices_t", lambda a: a["column_indices_t"].copy_(torch.tensor([0, 2, 2, 0, 0], dtype=torch.int16))),
    # a permutation with matching column_indices_t, but not in column order
    ("block_offsets_t", lambda a: (a["block_offsets_t"].copy_(torch.tensor([2, 0, 3, 1, 4], dtype=torch.int32)),
                                   a["column_indices_t"].copy_(torch.tensor([2, 0, 2, 0, 2], dtype=torch.int16)))),
]


@pytest.mark.parametrize("arg,mutate", VALUE_BAD, ids=[f"{v[0]}-{i}" for i, v in enumerate(VALUE_BAD)])
def test_value_checks_with_megablocks_ascend_checks(monkeypatch, arg, mutate):
    a = _valid("dsd")
    a.update({k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)})
    mutate(a)
    monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", "1")
    with megablocks_ascend.use_backend("torch"), megablocks_ascend.trace() as calls:
        with pytest.raises(BlockSparseArgumentError, match=f"^dsd: argument '{arg}'"):
            stk_kernels.dsd(**a)
    assert calls == []


def test_value_checks_pass_a_well_formed_topology(monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", "1")
    for op in NAMES:
        with megablocks_ascend.use_backend("torch"):
            getattr(stk_kernels, op)(**_valid(op))


# ---------------------------------------------------------------------------------------------
# The custom ops (what torch.compile sees).


def _op_samples(name):
    a = _valid(name)
    if name == "row_indices":
        return (list(a["shape"]), a["data"].shape[0], a["data"].shape[1], a["offsets"], a["column_indices"], a["out"])
    return tuple(list(v) if k == "shape" else v for k, v in a.items())


@pytest.mark.parametrize("name", NAMES)
def test_opcheck(name):
    with megablocks_ascend.use_backend("torch"):
        torch.library.opcheck(library.STK_OPS[name], _op_samples(name),
                              test_utils=["test_schema", "test_faketensor", "test_aot_dispatch_dynamic"])


def test_stk_ops_compile_fullgraph_forward_and_backward():
    top = _small_topology()
    topo = _matrix(top, torch.empty(top.nnz, 16, 16, device="meta"))
    x = torch.randn(48, 24, requires_grad=True)
    w = torch.randn(64, 24, requires_grad=True)

    def f(x, w):
        return stk.ops.dsd(stk.ops.sdd(x, w.t(), topo), w)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with megablocks_ascend.use_backend("torch"), megablocks_ascend.trace() as calls:
        out = compiled(x, w)
        out.square().sum().backward()
    assert {c.op for c in calls} == {"sdd", "dsd"}
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with megablocks_ascend.use_backend("torch"):
        ref = f(x, w)
        ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grads, (x.grad, w.grad))


# ---------------------------------------------------------------------------------------------
# MegaBlocks' refusal of mlp_impl="sparse".


@pytest.mark.parametrize("backend", ["ascend", "torch", "auto"])
def test_sparse_refusal_is_lifted_while_our_kernels_or_the_reference_serve(monkeypatch, backend):
    monkeypatch.setenv("MEGABLOCKS_BACKEND", backend)  # auto: CPU tensors -> torch
    args = Arguments(ffn_hidden_size=256)
    assert args.mlp_impl == "sparse" and args.shared_expert_hidden_size == 256
    assert Arguments(mlp_impl="sparse", hidden_size=8, ffn_hidden_size=128, fp16=False).mlp_impl == "sparse"


def test_sparse_refusal_stays_for_stks_own_kernels_and_says_what_to_set(monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="Sparse MLP is not supported with triton") as e:
        Arguments(mlp_impl="sparse", device=torch.device("cuda", 0))
    assert "the refusal stays" in str(e.value) and "MEGABLOCKS_BACKEND=ascend" in str(e.value)
    assert "stk's own Triton kernels" in str(e.value)
    monkeypatch.setenv("MEGABLOCKS_BACKEND", "auto")  # auto on a CUDA device is stk's own kernels too
    with pytest.raises(ValueError, match="the refusal stays: MEGABLOCKS_BACKEND=auto sends stk"):
        Arguments(mlp_impl="sparse", device=torch.device("cuda", 0))
    with megablocks_ascend.use_backend("ascend"):  # use_backend() counts as much as the variable
        assert Arguments(mlp_impl="sparse", device=torch.device("cuda", 0)).mlp_impl == "sparse"
    monkeypatch.setenv("MEGABLOCKS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="the refusal stays: MEGABLOCKS_BACKEND=cuda runs upstream"):
        Arguments()  # cuda cannot serve this machine's CPU tensors at all
    Arguments(mlp_impl="grouped")  # nothing changes for the grouped MLP


def test_sparse_refusal_patch_checks_what_it_wraps(monkeypatch):
    from megablocks.layers.arguments import Arguments as A
    patch = sparse_mlp_refusal.PATCH
    original = patch.originals["megablocks.layers.arguments:Arguments.__post_init__"]
    assert A.__dict__["__post_init__"].__wrapped__ is original
    probe = types.SimpleNamespace(originals={}, replace=lambda target, new: probe.originals.setdefault(target, new))

    def other_error(self):
        if self.mlp_impl == "sparse":
            raise ValueError("sparse is something else now")

    monkeypatch.setattr(A, "__post_init__", other_error)
    with pytest.raises(patching.PatchError, match="not the refusal this patch lifts"):
        sparse_mlp_refusal.apply(probe)

    def no_refusal(self):
        self.shared_expert_hidden_size = self.ffn_hidden_size

    monkeypatch.setattr(A, "__post_init__", no_refusal)
    sparse_mlp_refusal.apply(probe)
    assert probe.originals == {}  # nothing to lift, nothing replaced

    def strict(self):
        if self.mlp_impl not in ("sparse", "grouped"):
            raise ValueError(f"unknown mlp_impl {self.mlp_impl}")
        if self.mlp_impl == "sparse":
            raise ValueError("Sparse MLP is not supported with triton >=3.2.0.")

    monkeypatch.setattr(A, "__post_init__", strict)
    with pytest.raises(patching.PatchError, match="no longer accepts"):
        sparse_mlp_refusal.apply(probe)


def test_mlp_impl_is_restored_when_the_original_raises():
    """The placeholder value never outlives __post_init__, even when the original raises."""
    seen = []

    def failing(self):
        seen.append(self.mlp_impl)
        raise RuntimeError("boom")

    args = Arguments(fp16=False)
    with megablocks_ascend.use_backend("torch"), pytest.raises(RuntimeError, match="boom"):
        sparse_mlp_refusal.lift_sparse_refusal(failing)(args)
    assert seen == [sparse_mlp_refusal._SPARSE_LIFTED] and args.mlp_impl == "sparse"


_IR_SCRIPT = r"""
import json, os, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import megablocks_ascend  # after triton (so no interpreter): its patches, e.g. for a driverless Triton
import stk.backend.triton_kernels as k

def ttir(fn, sig, consts):
    try:
        src = ASTSource(fn, sig, constexprs=consts)
    except TypeError:  # older Triton
        src = ASTSource(fn, sig, constants=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttir"]

common = {"A": "*bf16", "B": "*bf16", "C": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
          "stride_ak": "constexpr", "stride_bk": "constexpr", "stride_bn": "i32", "stride_cm": "i32",
          "stride_cn": "constexpr", "row_indices": "*i16", "column_indices": "*i16"}
tiles = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "BLOCK_SIZE": 128, "GROUP_M": 128, "ACC_TYPE": tl.float32}
ones = {"stride_ak": 1, "stride_bk": 1, "stride_cn": 1}  # unit strides are compile-time constants
out = {}
for name in ("sdd", "dsd", "dds"):
    sig, consts = dict(common), {**ones, **tiles}
    if name != "sdd":
        sig.update(offsets="*i32", block_offsets_t="*i32", trans_A="constexpr", trans_B="constexpr")
        consts.update(trans_A=False, trans_B=False)
    sig.update({c: "constexpr" for c in tiles})
    text = ttir(getattr(k, f"_{name}_kernel").fn, sig, consts)
    out[name] = [line.split("=")[0].strip() for line in text.splitlines() if "arith.muli" in line and ": i16" in line]
print(json.dumps(out))
"""


def test_stks_int16_arithmetic_is_exactly_where_the_refusal_says():
    """The refusal's premise, read off the IR Triton makes of stk's kernels (compiled for sm_90
    here, to TTIR; no GPU needed): only ``_sdd_kernel`` multiplies in int16 (``rm``, ``rn``), even
    with every unit stride a compile-time constant; ``_dsd_kernel`` / ``_dds_kernel`` widen the
    loaded index to int32 first. A new Triton that changes this fails here."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    r = subprocess.run([sys.executable, "-c", _IR_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0 and "active drivers" in r.stderr:
        pytest.skip("this Triton cannot import stk without a driver (the driverless patch is not here): "
                    + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    muls = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(muls["sdd"]) == 2, muls  # rm and rn (Triton 3.9 names them; 3.3.1 numbers its values)
    assert muls["dsd"] == [] and muls["dds"] == [], muls
