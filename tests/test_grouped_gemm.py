"""CPU tests for the grouped_gemm stand-in (the package megablocks_ascend/native/grouped_gemm/).

A test that replaces one of its functions does so on the module that defines it
(``gg.choice._select_impl``, ``gg.impls._gmm_npu``, ...), where every caller looks it up.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from megablocks_ascend.native import grouped_gemm as gg

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# Independent float64 reference: explicit per-group slices.
# --------------------------------------------------------------------------

def ref_gmm(a, b, sizes, trans_a=False, trans_b=False):
    a64, b64 = a.detach().double(), b.detach().double()
    sizes = [int(s) for s in sizes]
    if trans_a:
        out = torch.zeros(len(sizes), a.shape[1], b.shape[1], dtype=torch.float64)
        r = 0
        for g, n in enumerate(sizes):
            for i in range(r, r + n):                    # sum of outer products
                out[g] += torch.outer(a64[i], b64[i])
            r += n
        return out
    n_out = b.shape[1] if trans_b else b.shape[2]
    out = torch.zeros(a.shape[0], n_out, dtype=torch.float64)
    r = 0
    for g, n in enumerate(sizes):
        w = b64[g].t() if trans_b else b64[g]
        for i in range(r, r + n):
            out[i] = a64[i] @ w
        r += n
    return out


def rel_err(out, ref):
    out = out.detach().double()
    denom = ref.norm()
    if denom == 0:
        return out.norm().item()
    return ((out - ref).norm() / denom).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}

# (trans_a, trans_b) combinations MegaBlocks uses (mlp.py / glu.py):
#   (F, T) x @ w1.T, (F, F) act @ w2 and dx = dsdd @ w1, (T, F) weight grads.
COMBOS = [(False, False), (False, True), (True, False)]

SIZE_CASES = {
    'mixed': [3, 5, 2, 6],
    'zero_first': [0, 4, 3, 5],
    'zero_middle': [4, 0, 0, 5],
    'zero_last': [5, 4, 3, 0],
    'single_group': [7],
    'all_in_one': [0, 9, 0, 0],
}


def make_inputs(sizes, trans_a, trans_b, dtype=torch.float32, k=6, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(sizes)
    e = len(sizes)
    if trans_a:
        a = torch.randn(t, k, generator=g)
        b = torch.randn(t, n, generator=g)
    else:
        a = torch.randn(t, k, generator=g)
        b = torch.randn(e, n, k, generator=g) if trans_b else torch.randn(e, k, n, generator=g)
    bs = torch.tensor(sizes, dtype=torch.int64)
    return a.to(dtype), b.to(dtype), bs


# --------------------------------------------------------------------------
# backend.gmm correctness
# --------------------------------------------------------------------------

@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
@pytest.mark.parametrize('case', list(SIZE_CASES))
def test_backend_gmm_matches_reference(trans_a, trans_b, case):
    sizes = SIZE_CASES[case]
    a, b, bs = make_inputs(sizes, trans_a, trans_b)
    out = gg.backend.gmm(a, b, bs, trans_a=trans_a, trans_b=trans_b)
    ref = ref_gmm(a, b, sizes, trans_a, trans_b)
    assert out.shape == ref.shape
    assert out.dtype == a.dtype
    assert out.is_contiguous()
    assert rel_err(out, ref) < TOL[torch.float32]
    if trans_a:
        for g, n in enumerate(sizes):
            if n == 0:
                assert torch.count_nonzero(out[g]) == 0


@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_int32_batch_sizes_accepted(trans_a, trans_b):
    sizes = [2, 0, 3]
    a, b, bs = make_inputs(sizes, trans_a, trans_b)
    out = gg.backend.gmm(a, b, bs.to(torch.int32), trans_a=trans_a, trans_b=trans_b)
    assert rel_err(out, ref_gmm(a, b, sizes, trans_a, trans_b)) < 1e-5


@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_c_output_is_filled_and_returned(trans_a, trans_b):
    sizes = [3, 0, 4, 2]
    a, b, bs = make_inputs(sizes, trans_a, trans_b)
    ref = ref_gmm(a, b, sizes, trans_a, trans_b)
    c = torch.full(tuple(ref.shape), float('nan'))          # garbage must all be overwritten
    out = gg.backend.gmm(a, b, bs, trans_a=trans_a, trans_b=trans_b, c=c)
    assert out is c
    assert not torch.isnan(c).any()
    assert rel_err(c, ref) < 1e-5


def test_c_output_non_contiguous():
    sizes = [3, 2]
    a, b, bs = make_inputs(sizes, False, True)
    big = torch.full((5, 9), float('nan'))
    c = big[:, 2:7]                                         # strided view [5, 5]
    out = gg.backend.gmm(a, b, bs, trans_b=True, c=c)
    assert out is c
    assert rel_err(c, ref_gmm(a, b, sizes, False, True)) < 1e-5
    assert torch.isnan(big[:, :2]).all() and torch.isnan(big[:, 7:]).all()


def test_c_output_that_requires_grad_like_megablocks_backward():
    # MemoryOptimizedGroupedMLP.backward passes c=activation_fn_out, a non-leaf
    # that requires grad; the real backend writes it in place without autograd.
    sizes = [2, 3]
    a, b, bs = make_inputs(sizes, False, True)
    base = torch.randn(5, 5, requires_grad=True)
    c = base * 1.0
    out = gg.backend.gmm(a, b, bs, trans_b=True, c=c)
    assert out is c
    assert rel_err(c, ref_gmm(a, b, sizes, False, True)) < 1e-5


def test_backend_gmm_is_not_differentiable():
    a, b, bs = make_inputs([2, 3], False, False)
    a.requires_grad_()
    b.requires_grad_()
    out = gg.backend.gmm(a, b, bs)
    assert not out.requires_grad


def test_non_contiguous_inputs():
    sizes = [2, 0, 3]
    a, b, bs = make_inputs(sizes, False, False)
    a_nc = torch.stack([a, a], dim=-1)[..., 0]            # non-contiguous, same values
    b_nc = b.transpose(1, 2).contiguous().transpose(1, 2)  # column-major
    assert not a_nc.is_contiguous() and not b_nc.is_contiguous()
    assert torch.equal(a_nc, a) and torch.equal(b_nc, b)
    out = gg.backend.gmm(a_nc, b_nc, bs)
    assert rel_err(out, ref_gmm(a, b, sizes)) < 1e-5


def test_zero_tokens():
    sizes = [0, 0, 0]
    for trans_a, trans_b in COMBOS:
        a, b, bs = make_inputs(sizes, trans_a, trans_b)
        out = gg.backend.gmm(a, b, bs, trans_a=trans_a, trans_b=trans_b)
        ref = ref_gmm(a, b, sizes, trans_a, trans_b)
        assert out.shape == ref.shape
        assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_dtypes(dtype, trans_a, trans_b):
    sizes = [5, 0, 9, 2]
    a, b, bs = make_inputs(sizes, trans_a, trans_b, dtype=dtype, k=32, n=24, seed=3)
    out = gg.backend.gmm(a, b, bs, trans_a=trans_a, trans_b=trans_b)
    assert out.dtype == dtype
    # Reference from the same (already rounded) inputs, in float64.
    err = rel_err(out, ref_gmm(a, b, sizes, trans_a, trans_b))
    assert err < TOL[dtype], f'{dtype} rel err {err}'


# --------------------------------------------------------------------------
# ops.gmm (autograd)
# --------------------------------------------------------------------------

@pytest.mark.parametrize('trans_b', [False, True])
@pytest.mark.parametrize('sizes', [[2, 0, 3], [0, 4], [3]])
def test_ops_gmm_gradcheck(trans_b, sizes):
    a, b, bs = make_inputs(sizes, False, trans_b, dtype=torch.float64, k=3, n=2)
    a.requires_grad_()
    b.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, w: gg.ops.gmm(x, w, bs, trans_b=trans_b), (a, b))


@pytest.mark.parametrize('trans_b', [False, True])
def test_ops_gmm_float32_grads_match_reference(trans_b):
    sizes = [4, 0, 6, 3]
    a, b, bs = make_inputs(sizes, False, trans_b, k=8, n=7, seed=5)
    grad_out = torch.randn(sum(sizes), 7, generator=torch.Generator().manual_seed(9))

    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = gg.ops.gmm(a1, b1, bs, trans_b=trans_b)
    out.backward(grad_out)

    # Reference: float64 autograd through explicit per-group matmuls.
    a2 = a.double().requires_grad_()
    b2 = b.double().requires_grad_()
    pieces, r = [], 0
    for g, n in enumerate(sizes):
        w = b2[g].t() if trans_b else b2[g]
        pieces.append(a2[r:r + n] @ w)
        r += n
    torch.cat(pieces).backward(grad_out.double())

    assert rel_err(out, torch.cat(pieces).detach()) < 1e-5
    assert rel_err(a1.grad, a2.grad) < 1e-5
    assert rel_err(b1.grad, b2.grad) < 1e-5
    assert torch.count_nonzero(b1.grad[1]) == 0               # empty expert: zero grad


def test_ops_gmm_only_a_requires_grad():
    sizes = [2, 3]
    a, b, bs = make_inputs(sizes, False, True)
    a.requires_grad_()
    out = gg.ops.gmm(a, b, bs, trans_b=True)
    out.sum().backward()
    assert a.grad is not None and b.grad is None


# --------------------------------------------------------------------------
# Validation: one test per bad input; message names the argument; nothing changed
# --------------------------------------------------------------------------

def _good(trans_a=False, trans_b=False):
    a, b, bs = make_inputs([2, 1, 3], trans_a, trans_b)
    return dict(a=a, b=b, batch_sizes=bs, trans_a=trans_a, trans_b=trans_b)


def _same_bits(a, b):
    # Bit for bit: an unwritten torch.empty output may hold NaNs, which torch.equal calls unequal.
    bits = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _snapshot(kw):
    return {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}


BAD_CASES = {
    'a_not_tensor': (lambda kw: kw.update(a=[[1.0]]), "'a'"),
    'b_not_tensor': (lambda kw: kw.update(b=3), "'b'"),
    'batch_sizes_list': (lambda kw: kw.update(batch_sizes=[2, 1, 3]), "'batch_sizes'"),
    'both_transposes': (lambda kw: kw.update(trans_a=True, trans_b=True), "'trans_a'"),
    'a_ndim': (lambda kw: kw.update(a=kw['a'].unsqueeze(0)), "'a' must be 2-D"),
    'b_ndim': (lambda kw: kw.update(b=kw['b'][0]), "'b' must be 3-D"),
    'b_ndim_trans_a': (lambda kw: kw.update(trans_a=True), "'b' must be 2-D"),
    'a_dtype_int': (lambda kw: kw.update(a=kw['a'].long()), "'a' dtype"),
    'b_dtype_mismatch': (lambda kw: kw.update(b=kw['b'].double()), "'b' dtype"),
    'b_device_mismatch': (lambda kw: kw.update(b=kw['b'].to('meta')), "'b' is on meta"),
    'batch_sizes_device': (lambda kw: kw.update(batch_sizes=kw['batch_sizes'].to('meta')),
                           "'batch_sizes' is on meta; it must be a CPU tensor or on 'a''s device"),
    'batch_sizes_float': (lambda kw: kw.update(batch_sizes=kw['batch_sizes'].float()),
                          "'batch_sizes' dtype"),
    'batch_sizes_int16': (lambda kw: kw.update(batch_sizes=kw['batch_sizes'].short()),
                          "'batch_sizes' dtype"),
    'batch_sizes_2d': (lambda kw: kw.update(batch_sizes=kw['batch_sizes'].view(1, 3)),
                       "'batch_sizes' must be 1-D"),
    'batch_sizes_negative': (lambda kw: kw.update(batch_sizes=torch.tensor([4, -1, 3])),
                             "'batch_sizes' has negative"),
    'batch_sizes_sum': (lambda kw: kw.update(batch_sizes=torch.tensor([2, 1, 2])),
                        "'batch_sizes' sums to 5"),
    'group_count': (lambda kw: kw.update(batch_sizes=torch.tensor([2, 4])),
                    "'batch_sizes' has 2 groups but 'b' has 3"),
    'contraction': (lambda kw: kw.update(b=torch.randn(3, 7, 5)), 'contraction mismatch'),
    'c_shape': (lambda kw: kw.update(c=torch.empty(6, 4)), "'c' has shape"),
    'c_dtype': (lambda kw: kw.update(c=torch.empty(6, 5, dtype=torch.float64)), "'c' dtype"),
    'c_device': (lambda kw: kw.update(c=torch.empty(6, 5, device='meta')), "'c' is on meta"),
    'c_not_tensor': (lambda kw: kw.update(c=[0.0]), "'c' must be a torch.Tensor"),
}


@pytest.mark.parametrize('case', list(BAD_CASES))
def test_validation_errors(case):
    mutate, needle = BAD_CASES[case]
    kw = _good()
    mutate(kw)
    before = _snapshot({k: v for k, v in kw.items() if not (isinstance(v, torch.Tensor)
                                                           and v.device.type == 'meta')})
    with pytest.raises(ValueError) as info:
        gg.backend.gmm(**kw)
    assert needle in str(info.value), str(info.value)
    for k, v in before.items():
        assert _same_bits(kw[k], v), f'{k} was modified'


def test_validation_trans_a_row_mismatch():
    kw = _good(trans_a=True)
    kw['b'] = torch.randn(5, 5)
    before = _snapshot(kw)
    with pytest.raises(ValueError, match="'b' has 5 rows but 'a' has 6"):
        gg.backend.gmm(**kw)
    for k, v in before.items():
        assert torch.equal(kw[k], v)


def test_validation_leaves_c_untouched():
    kw = _good()
    c = torch.full((6, 5), 7.0)
    kw['batch_sizes'] = torch.tensor([2, 1, 2])            # bad sum, checked after c exists
    with pytest.raises(ValueError, match="'batch_sizes'"):
        gg.backend.gmm(c=c, **kw)
    assert torch.equal(c, torch.full((6, 5), 7.0))


def test_ops_gmm_validates_too():
    a, b, bs = make_inputs([2, 3], False, False)
    with pytest.raises(ValueError, match="'batch_sizes'"):
        gg.ops.gmm(a, b, bs.cuda() if torch.cuda.is_available() else bs.float())


# --------------------------------------------------------------------------
# Dispatch reporting
# --------------------------------------------------------------------------

@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_impl_name_on_cpu(dtype):
    """CPU tensors: torch._grouped_mm's CPU kernel (torch >= 2.9) for bf16/fp16/fp32 operands
    whose strides are multiples of 16 bytes, the loop otherwise."""
    a, b, bs = make_inputs([2, 3], False, False, dtype=dtype, k=16, n=16)
    kernel = gg.choice._cpu_supports_grouped_mm() and dtype != torch.float64
    assert gg.gmm_impl_name(a) == ('torch._grouped_mm' if kernel else 'loop')
    assert gg.gmm_impl_name(a, b, bs) == ('torch._grouped_mm' if kernel else 'loop')
    a, b, bs = make_inputs([2, 3], False, False, dtype=dtype, k=6, n=16)   # 6 elements: unaligned
    assert gg.gmm_impl_name(a, b, bs) == 'loop'


def test_impl_name_cuda_selection_logic(monkeypatch):
    """Selection logic for CUDA tensors, without a GPU.

    Uses stand-in objects that only carry ``device``/``dtype``, with the
    device-capability probe forced.  Proves the dtype gate and the capability
    gate are wired; says nothing about a real GPU.
    """
    cuda_a = lambda dt: types.SimpleNamespace(device=torch.device('cuda', 0), dtype=dt)
    monkeypatch.setattr(gg.choice, '_cuda_device_supports_grouped_mm', lambda idx: True)
    assert gg.gmm_impl_name(cuda_a(torch.bfloat16)) == 'torch._grouped_mm'
    assert gg.gmm_impl_name(cuda_a(torch.float16)) == 'loop'
    assert gg.gmm_impl_name(cuda_a(torch.float32)) == 'loop'
    monkeypatch.setattr(gg.choice, '_cuda_device_supports_grouped_mm', lambda idx: False)
    assert gg.gmm_impl_name(cuda_a(torch.bfloat16)) == 'loop'


def _fake_npu_product(monkeypatch, name):
    """Make megablocks_ascend.devices report NPU 0 as the product ``name`` (no NPU here)."""
    from megablocks_ascend import devices
    monkeypatch.setattr(devices, 'npu_product', lambda index: name)


def test_impl_name_npu_selection_logic(monkeypatch):
    """Selection logic for NPU tensors, without an NPU (fake torch_npu module): fp16/bf16 on
    every product, fp32 on Atlas A2 (Ascend 910B) only, as torch_npu's docs list it; fp64 never."""
    npu_a = lambda dt: types.SimpleNamespace(device=types.SimpleNamespace(type='npu', index=0),
                                             dtype=dt)
    monkeypatch.setitem(sys.modules, 'torch_npu', types.ModuleType('torch_npu'))
    assert gg.gmm_impl_name(npu_a(torch.bfloat16)) == 'loop'      # no npu_grouped_matmul
    sys.modules['torch_npu'].npu_grouped_matmul = lambda *a, **k: None
    _fake_npu_product(monkeypatch, 'Ascend910B4')
    assert gg.gmm_impl_name(npu_a(torch.bfloat16)) == 'npu_grouped_matmul'
    assert gg.gmm_impl_name(npu_a(torch.float16)) == 'npu_grouped_matmul'
    assert gg.gmm_impl_name(npu_a(torch.float32)) == 'npu_grouped_matmul'
    assert gg.gmm_impl_name(npu_a(torch.float64)) == 'loop'
    for other in ('Ascend910_9391', 'Ascend310P3'):                # A3, an inference card
        _fake_npu_product(monkeypatch, other)
        assert gg.gmm_impl_name(npu_a(torch.float32)) == 'loop', other
        assert gg.gmm_impl_name(npu_a(torch.bfloat16)) == 'npu_grouped_matmul', other


def test_grouped_mm_alignment_gate():
    """The stride/alignment mirror of torch's check_valid_strides (CPU tensors)."""
    bf = torch.bfloat16
    ok_a, ok_b = torch.randn(16, 32, dtype=bf), torch.randn(2, 32, 24, dtype=bf)
    for ta, tb, a, b in [(False, False, ok_a, ok_b),
                         (False, True, ok_a, ok_b.transpose(1, 2).contiguous()),
                         (True, False, torch.randn(16, 32, dtype=bf), torch.randn(16, 24, dtype=bf))]:
        ma, mb = gg.choice._grouped_mm_operands(a, b, ta, tb)
        assert gg.choice._grouped_mm_strides_ok(ma) and gg.choice._grouped_mm_strides_ok(mb)
    # K = 12 is not a multiple of 8 bf16 elements (16 bytes) -> rejected.
    assert not gg.choice._grouped_mm_strides_ok(torch.randn(16, 12, dtype=bf))
    # Neither of the last two strides is 1 -> rejected.
    assert not gg.choice._grouped_mm_strides_ok(torch.randn(16, 64, dtype=bf)[:, ::2])


# --------------------------------------------------------------------------
# CUDA / NPU branch logic without the hardware
# --------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(torch, '_grouped_mm'),
                    reason=f'torch {torch.__version__} has no torch._grouped_mm (added in torch 2.8); '
                           'the stand-in uses its loop there')
@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_grouped_mm_branch_with_recording_fake(monkeypatch, trans_a, trans_b):
    """Drive ``_gmm_grouped_mm`` on CPU tensors.

    ``torch._grouped_mm`` is replaced by a fake that records its arguments and
    then calls the real op (which torch 2.13 also implements on CPU) and, for
    trans_a, scribbles garbage into empty groups.

    Proves: offsets are cumulative int32 on the operands' device; the views
    passed encode trans_a/trans_b the way torch._grouped_mm's 2d-3d / 2d-2d
    forms expect (the result matches the float64 reference); empty K-groups are
    zeroed where the kernel is not known to write them (CUDA, simulated here);
    ``c`` is filled and returned.  Does not prove anything about the CUDA
    kernels, alignment on a real GPU, or performance.
    """
    monkeypatch.setattr(gg.empty_groups, '_grouped_mm_writes_empty_groups', lambda device: False)
    real = torch._grouped_mm
    calls = []

    def fake(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        calls.append(dict(mat_a=mat_a, mat_b=mat_b, offs=offs, bias=bias, out_dtype=out_dtype))
        out = real(mat_a, mat_b, offs=offs)
        if mat_a.dim() == 2 and mat_b.dim() == 2:
            out = out.clone()
            starts = torch.cat([offs.new_zeros(1), offs[:-1]])
            out[(offs - starts) == 0] = 123.0                  # garbage in empty groups
        return out

    monkeypatch.setattr(torch, '_grouped_mm', fake)
    sizes = [8, 0, 16, 8]
    a, b, bs = make_inputs(sizes, trans_a, trans_b, dtype=torch.bfloat16, k=16, n=24)
    ref = ref_gmm(a, b, sizes, trans_a, trans_b)
    c = torch.full(tuple(ref.shape), float('nan'), dtype=torch.bfloat16)
    out = gg.impls._gmm_grouped_mm(a, b, bs, sizes, trans_a, trans_b, c)

    assert out is c
    assert rel_err(c, ref) < TOL[torch.bfloat16]
    (call,) = calls
    assert call['offs'].dtype == torch.int32
    assert call['offs'].device == a.device
    assert call['offs'].tolist() == [8, 8, 24, 32]
    assert call['bias'] is None and call['out_dtype'] is None
    if trans_a:
        assert call['mat_a'].shape == (a.shape[1], a.shape[0]) and call['mat_a'].stride(0) == 1
        assert call['mat_b'] is b
        assert torch.count_nonzero(c[1]) == 0
    else:
        assert call['mat_a'] is a
        if trans_b:
            assert call['mat_b'].shape == (4, 16, 24) and call['mat_b'].stride(1) == 1
        else:
            assert call['mat_b'] is b


class _FakeTorchNpu(types.ModuleType):
    """Pure-torch model of npu_grouped_matmul, per my reading of the op-plugin docs.

    Enforces the documented layout rules for the forms we use
    (group_type 0: single x not transposed, single 3-D weight maybe transposed;
    group_type 2: x transposed view, weight not transposed) and the group_list
    rules (int64 tensor on x's device; type 0 = cumulative, 1 = counts).
    """

    def __init__(self):
        super().__init__('torch_npu')
        self.calls = []

    def npu_grouped_matmul(self, x, weight, *, bias=None, group_list=None, split_item=0,
                           group_type=None, group_list_type=0, **unused):
        assert not unused, unused
        self.calls.append(dict(x=x, weight=weight, bias=bias, group_list=group_list,
                               split_item=split_item, group_type=group_type,
                               group_list_type=group_list_type))
        assert isinstance(x, list) and isinstance(weight, list)
        assert len(x) == 1 and len(weight) == 1 and bias is None
        assert split_item in (2, 3)
        assert isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64
        assert group_list.ndim == 1 and group_list.device == x[0].device
        gl = group_list.tolist()
        sizes = gl if group_list_type == 1 else [e - s for s, e in zip([0] + gl[:-1], gl)]
        assert group_list_type in (0, 1) and min(sizes) >= 0
        assert group_list_type == 0 or len(gl) != 1          # "cannot have length 1" (counts)
        xx, ww = x[0], weight[0]
        # Non-quantized, single tensors: fp16, bf16, fp32 (A2), x and weight of one dtype; y the same.
        assert xx.dtype == ww.dtype and xx.dtype in (torch.float16, torch.bfloat16, torch.float32)
        if group_type == 0:
            assert xx.ndim == 2 and ww.ndim == 3 and xx.is_contiguous()
            assert ww.is_contiguous() or ww.transpose(1, 2).is_contiguous()
            assert sum(sizes) == xx.shape[0] and len(sizes) == ww.shape[0]
            out, r = [], 0
            for g, n in enumerate(sizes):
                out.append(xx[r:r + n] @ ww[g])
                r += n
            return [torch.cat(out)]
        if group_type == 2:
            assert xx.ndim == 2 and ww.ndim == 2
            assert xx.stride(0) == 1 and not xx.is_contiguous()   # "x must be transposed"
            assert ww.is_contiguous()                             # "weight not transposed"
            assert sum(sizes) == xx.shape[1] == ww.shape[0]
            out = torch.full((len(sizes), xx.shape[0], ww.shape[1]), 321.0, dtype=xx.dtype)
            r = 0
            for g, n in enumerate(sizes):
                if n:                                              # empty groups: left garbage
                    out[g] = xx[:, r:r + n] @ ww[r:r + n]
                r += n
            return [out]
        raise AssertionError(f'unexpected group_type {group_type}')


@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_npu_branch_with_fake_torch_npu(monkeypatch, trans_a, trans_b):
    """Drive ``_gmm_npu`` on CPU tensors against ``_FakeTorchNpu``.

    Proves: the call matches my reading of the npu_grouped_matmul docs --
    group_list is per-group counts (int64, on the operands' device) with
    group_list_type=1; group_type 0 with split_item 2 for the forward/dgrad
    forms, trans_b passed as a transposed weight view; group_type 2 with
    split_item 3 and a transposed x view for trans_a; empty K-groups zeroed;
    ``c`` filled and returned.  Does NOT prove that the real kernel behaves as
    the docs (and this fake) say, nor anything about accuracy or speed on an
    NPU.
    """
    fake = _FakeTorchNpu()
    monkeypatch.setitem(sys.modules, 'torch_npu', fake)
    sizes = [3, 0, 5, 2]
    a, b, bs = make_inputs(sizes, trans_a, trans_b, dtype=torch.bfloat16, k=8, n=6)
    ref = ref_gmm(a, b, sizes, trans_a, trans_b)
    c = torch.full(tuple(ref.shape), float('nan'), dtype=torch.bfloat16)
    out = gg.impls._gmm_npu(a, b, bs, sizes, trans_a, trans_b, c)

    assert out is c
    assert rel_err(c, ref) < TOL[torch.bfloat16]
    (call,) = fake.calls
    assert call['group_list_type'] == 1
    assert call['group_list'].tolist() == sizes
    if trans_a:
        assert call['group_type'] == 2 and call['split_item'] == 3
        assert torch.count_nonzero(c[1]) == 0
    else:
        assert call['group_type'] == 0 and call['split_item'] == 2
        w = call['weight'][0]
        assert w.shape == (4, 8, 6)
        assert (w.stride(1) == 1) == trans_b


@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_npu_branch_float32(monkeypatch, trans_a, trans_b):
    """float32 operands reach npu_grouped_matmul as they are (Atlas A2 documents them): one call,
    float32 result, as accurate as the float64 reference allows; device sizes, no host read."""
    fake = _FakeTorchNpu()
    monkeypatch.setitem(sys.modules, 'torch_npu', fake)
    monkeypatch.setattr(gg.choice, '_select_impl', lambda *args, **kw: 'npu_grouped_matmul')
    monkeypatch.setattr(gg.checks, '_host_sizes', lambda *a: pytest.fail('batch_sizes was read on the host'))
    sizes = [3, 0, 5, 2]
    a, b, bs = make_inputs(sizes, trans_a, trans_b, dtype=torch.float32, k=8, n=6)
    out = gg.backend.gmm(a, b, bs, trans_a=trans_a, trans_b=trans_b)
    (call,) = fake.calls
    assert call['x'][0].dtype == torch.float32 and out.dtype == torch.float32
    assert rel_err(out, ref_gmm(a, b, sizes, trans_a, trans_b)) < TOL[torch.float32]
    if trans_a:
        assert torch.count_nonzero(out[1]) == 0


def test_npu_single_group_goes_to_the_loop(monkeypatch):
    """One expert: npu_grouped_matmul's docs refuse a group_list of counts of length 1."""
    monkeypatch.setitem(sys.modules, 'torch_npu', types.ModuleType('torch_npu'))
    sys.modules['torch_npu'].npu_grouped_matmul = lambda *a, **k: None
    npu = types.SimpleNamespace(type='npu', index=0)
    a = types.SimpleNamespace(device=npu, dtype=torch.bfloat16, shape=(8, 16), numel=lambda: 128)
    one = types.SimpleNamespace(device=npu, dtype=torch.bfloat16, shape=(1, 16, 24), numel=lambda: 384)
    two = types.SimpleNamespace(device=npu, dtype=torch.bfloat16, shape=(2, 16, 24), numel=lambda: 768)
    assert gg.gmm_impl_name(a, one) == 'loop' and gg.gmm_impl_name(a, two) == 'npu_grouped_matmul'
    monkeypatch.setattr(gg.empty_groups, '_fill_kernel_runs', lambda device: True)
    assert not gg.takes_device_sizes(npu, torch.bfloat16, (2048, 768), 1)


def test_full_dispatch_reaches_npu_branch(monkeypatch):
    """gmm() routes to the NPU branch when the selector says so (CPU tensors, fake op)."""
    fake = _FakeTorchNpu()
    monkeypatch.setitem(sys.modules, 'torch_npu', fake)
    monkeypatch.setattr(gg.choice, '_select_impl', lambda *args, **kw: 'npu_grouped_matmul')
    sizes = [2, 4]
    a, b, bs = make_inputs(sizes, False, True, dtype=torch.bfloat16, k=8, n=6)
    out = gg.backend.gmm(a, b, bs, trans_b=True)
    assert len(fake.calls) == 1
    assert rel_err(out, ref_gmm(a, b, sizes, False, True)) < TOL[torch.bfloat16]


# --------------------------------------------------------------------------
# batch_sizes on the operands' device ("device sizes")
# --------------------------------------------------------------------------

needs_cpu_grouped_mm = pytest.mark.skipif(
    not gg.choice._cpu_supports_grouped_mm(),
    reason=f'torch {torch.__version__} has no CPU kernel for torch._grouped_mm (needs torch >= 2.9)')


def _no_host_reads(fn):
    """Run ``fn`` and fail on any read of tensor values into Python (``bench.instruments.HostSyncs``)."""
    from megablocks_ascend.bench.instruments import HostSyncs  # noqa: PLC0415
    with HostSyncs() as syncs:
        out = fn()
    assert not syncs.events, syncs.report()
    return out


@needs_cpu_grouped_mm
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
@pytest.mark.parametrize('case', list(SIZE_CASES))
def test_device_sizes_match_reference_without_reading_them(dtype, trans_a, trans_b, case):
    """CPU operands with CPU sizes are "device sizes": torch._grouped_mm gets offsets computed
    from the tensor, and no value of batch_sizes is read into Python."""
    sizes = SIZE_CASES[case]
    a, b, bs = make_inputs(sizes, trans_a, trans_b, dtype=dtype, k=16, n=24)
    assert gg.gmm_impl_name(a, b, bs, trans_a, trans_b) == 'torch._grouped_mm'
    out = _no_host_reads(lambda: gg.backend.gmm(a, b, bs, trans_a=trans_a, trans_b=trans_b))
    assert out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, ref_gmm(a, b, sizes, trans_a, trans_b)) < TOL[dtype]
    if trans_a:
        for g, n in enumerate(sizes):
            if n == 0:
                assert torch.count_nonzero(out[g]) == 0


@needs_cpu_grouped_mm
@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_device_sizes_fill_c(trans_a, trans_b):
    sizes = [8, 0, 16, 8]
    a, b, bs = make_inputs(sizes, trans_a, trans_b, k=16, n=24)
    ref = ref_gmm(a, b, sizes, trans_a, trans_b)
    c = torch.full(tuple(ref.shape), float('nan'))
    out = _no_host_reads(lambda: gg.backend.gmm(a, b, bs, trans_a=trans_a, trans_b=trans_b, c=c))
    assert out is c and not torch.isnan(c).any()
    assert rel_err(c, ref) < TOL[torch.float32]


@needs_cpu_grouped_mm
@pytest.mark.parametrize('trans_b', [False, True])
def test_ops_gmm_device_sizes_forward_and_backward(trans_b):
    """The autograd op (what GroupedMLP calls) with device sizes: results and gradients as the
    float64 reference, and neither pass reads the sizes."""
    sizes = [8, 0, 16, 8]
    a, b, bs = make_inputs(sizes, False, trans_b, k=16, n=24, seed=5)
    grad_out = torch.randn(sum(sizes), 24, generator=torch.Generator().manual_seed(9))
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()

    def step():
        out = gg.ops.gmm(a1, b1, bs, trans_b=trans_b)
        out.backward(grad_out)
        return out

    out = _no_host_reads(step)
    a2, b2 = a.double().requires_grad_(), b.double().requires_grad_()
    pieces, r = [], 0
    for g, n in enumerate(sizes):
        pieces.append(a2[r:r + n] @ (b2[g].t() if trans_b else b2[g]))
        r += n
    torch.cat(pieces).backward(grad_out.double())
    assert rel_err(out, torch.cat(pieces).detach()) < 1e-5
    assert rel_err(a1.grad, a2.grad) < 1e-5 and rel_err(b1.grad, b2.grad) < 1e-5
    assert torch.count_nonzero(b1.grad[1]) == 0


@needs_cpu_grouped_mm
def test_device_group_layout_is_computed_once_per_tensor_and_version(monkeypatch):
    """The GEMMs of one step share the offsets computed from one batch_sizes tensor; an in-place
    change of the tensor recomputes them; during a graph capture nothing is reused."""
    made = []
    real = gg.device_sizes._DeviceGroups.__init__
    monkeypatch.setattr(gg.device_sizes._DeviceGroups, '__init__',
                        lambda self, *args: made.append(args[0]) or real(self, *args))
    sizes = [8, 0, 16, 8]
    a, b, bs = make_inputs(sizes, False, True, k=16, n=24)
    a.requires_grad_()
    b.requires_grad_()
    gg.ops.gmm(a, b, bs, trans_b=True).sum().backward()         # 3 GEMMs
    assert len(made) == 1
    bs.copy_(torch.tensor([16, 0, 8, 8]))                        # in place: a new version
    out = gg.backend.gmm(a.detach(), b.detach(), bs, trans_b=True)
    assert len(made) == 2
    assert rel_err(out, ref_gmm(a, b, [16, 0, 8, 8], False, True)) < 1e-5
    from megablocks_ascend import keeping  # noqa: PLC0415  (what gg asks, loaded at its first use)
    monkeypatch.setattr(keeping, 'capturing', lambda device: True)
    for _ in range(2):
        gg.backend.gmm(a.detach(), b.detach(), bs, trans_b=True)
    assert len(made) == 4 and made[-1] is None                   # not kept, not reused


def test_device_group_ends_stay_inside_the_operands():
    """Whatever batch_sizes holds (negative, too large), the device offsets are non-decreasing
    and within [0, rows]; for valid sizes they are the plain cumulative sums."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        rows = int(torch.randint(0, 40, (1,), generator=g))
        sizes = torch.randint(-20, 30, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        ends = gg.device_sizes._DeviceGroups(None, sizes.int(), rows).ends
        assert ends.dtype == torch.int64
        assert bool((ends >= 0).all()) and bool((ends <= rows).all())
        assert bool((ends[1:] >= ends[:-1]).all())
        counts = gg.device_sizes._DeviceGroups(None, sizes, rows).counts
        assert bool((counts >= 0).all()) and int(counts.sum()) <= rows
    valid = torch.tensor([3, 0, 5, 2])
    groups = gg.device_sizes._DeviceGroups(None, valid, 10)
    assert groups.offsets.tolist() == [3, 3, 8, 10] and groups.offsets.dtype == torch.int32
    assert groups.counts.tolist() == [3, 0, 5, 2]
    assert groups.empty.flatten().tolist() == [False, True, False, False]


@needs_cpu_grouped_mm
@pytest.mark.parametrize('bad,needle', [([8, -4, 16, 12], "'batch_sizes' has negative entries"),
                                        ([8, 8, 16, 16], "'batch_sizes' sums to 48 but 'a' has 32 rows"),
                                        ([8, 0, 8, 8], "'batch_sizes' sums to 24 but 'a' has 32 rows")])
def test_device_sizes_value_checks_follow_megablocks_ascend_checks(monkeypatch, bad, needle):
    """Device sizes are not read by default (a malformed one gives an unspecified result inside
    the operands); MEGABLOCKS_ASCEND_CHECKS=1 reads them and raises, leaving c untouched."""
    a, b, _ = make_inputs([8, 0, 16, 8], False, True, k=16, n=24)
    bs = torch.tensor(bad)
    monkeypatch.delenv('MEGABLOCKS_ASCEND_CHECKS', raising=False)
    out = _no_host_reads(lambda: gg.backend.gmm(a, b, bs, trans_b=True))
    assert out.shape == (32, b.shape[1])
    monkeypatch.setenv('MEGABLOCKS_ASCEND_CHECKS', '1')
    c = torch.full((32, b.shape[1]), 7.0)
    with pytest.raises(ValueError, match=needle.replace('(', r'\(')):
        gg.backend.gmm(a, b, bs, trans_b=True, c=c)
    assert torch.equal(c, torch.full((32, b.shape[1]), 7.0))


def test_host_sizes_are_still_checked_by_default():
    """The loop reads the sizes anyway, so their value checks stay on (fp64: the loop)."""
    a, b, _ = make_inputs([2, 1, 3], False, False, dtype=torch.float64, k=16, n=16)
    with pytest.raises(ValueError, match="'batch_sizes' sums to 5"):
        gg.backend.gmm(a, b, torch.tensor([2, 1, 2]))


@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_device_sizes_with_no_rows_need_no_read(trans_a, trans_b):
    a, b, bs = make_inputs([0, 0, 0], trans_a, trans_b, dtype=torch.float64, k=16, n=16)
    out = _no_host_reads(lambda: gg.backend.gmm(a, b, bs, trans_a=trans_a, trans_b=trans_b))
    assert out.shape == ref_gmm(a, b, [0, 0, 0], trans_a, trans_b).shape
    assert torch.count_nonzero(out) == 0


@needs_cpu_grouped_mm
@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_grouped_mm_branch_device_sizes_with_recording_fake(monkeypatch, trans_a, trans_b):
    """``_gmm_grouped_mm`` with device sizes: the offsets handed to torch._grouped_mm are int32
    cumulative ends on the operands' device, computed without reading batch_sizes; empty groups
    of the trans_a form are zeroed (on the device: kernels/grouped.py, in the interpreter here) where
    the kernel is not known to write them (CUDA, simulated here) and leaves garbage there."""
    monkeypatch.setattr(gg.empty_groups, '_grouped_mm_writes_empty_groups', lambda device: False)
    real = torch._grouped_mm
    calls = []

    def fake(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        calls.append(offs)
        out = real(mat_a, mat_b, offs=offs)
        if mat_a.dim() == 2 and mat_b.dim() == 2:
            out = out.clone()
            out[1] = 123.0                                      # group 1 is empty below
        return out

    monkeypatch.setattr(torch, '_grouped_mm', fake)
    monkeypatch.setattr(gg.checks, '_host_sizes', lambda *a: pytest.fail('batch_sizes was read on the host'))
    sizes = [8, 0, 16, 8]
    a, b, bs = make_inputs(sizes, trans_a, trans_b, dtype=torch.bfloat16, k=16, n=24)
    out = gg.impls._gmm_grouped_mm(a, b, bs, None, trans_a, trans_b, None)
    assert rel_err(out, ref_gmm(a, b, sizes, trans_a, trans_b)) < TOL[torch.bfloat16]
    (offs,) = calls
    assert offs.dtype == torch.int32 and offs.device == a.device and offs.tolist() == [8, 8, 24, 32]
    if trans_a:
        assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize('trans_a,trans_b', COMBOS)
def test_npu_branch_device_sizes_with_fake_torch_npu(monkeypatch, trans_a, trans_b):
    """``_gmm_npu`` with device sizes: ``group_list`` is the int64 per-group counts derived on
    the operands' device, batch_sizes is never read on the host. (The fake stands in for the
    NPU kernel; NOT run on an NPU.)"""
    fake = _FakeTorchNpu()
    monkeypatch.setitem(sys.modules, 'torch_npu', fake)
    monkeypatch.setattr(gg.checks, '_host_sizes', lambda *a: pytest.fail('batch_sizes was read on the host'))
    sizes = [3, 0, 5, 2]
    a, b, bs = make_inputs(sizes, trans_a, trans_b, dtype=torch.bfloat16, k=8, n=6)
    out = gg.impls._gmm_npu(a, b, bs.int(), None, trans_a, trans_b, None)
    assert rel_err(out, ref_gmm(a, b, sizes, trans_a, trans_b)) < TOL[torch.bfloat16]
    (call,) = fake.calls
    assert call['group_list_type'] == 1 and call['group_list'].tolist() == sizes
    if trans_a:
        assert torch.count_nonzero(out[1]) == 0


def test_takes_device_sizes_per_device(monkeypatch):
    """Which (device, dtype, sizes) keep MegaBlocks' token counts on the device. CUDA and NPU
    with their capability probes forced (no GPU or NPU here)."""
    cpu, bf, fp16, fp32 = torch.device('cpu'), torch.bfloat16, torch.float16, torch.float32
    kernel = gg.choice._cpu_supports_grouped_mm()
    for dtype in (bf, fp16, fp32):
        assert gg.takes_device_sizes(cpu, dtype, (64, 128), 8) == kernel
    assert not gg.takes_device_sizes(cpu, torch.float64, (64, 128), 8)
    assert not gg.takes_device_sizes(cpu, fp32, (64, 126), 8)       # 126 * 4 bytes: not 16-aligned
    assert not gg.takes_device_sizes(cpu, fp32, (64, 0), 8)
    assert not gg.takes_device_sizes(torch.device('meta'), fp32, (64, 128), 8)

    cuda = torch.device('cuda', 0)
    monkeypatch.setattr(gg.choice, '_cuda_device_supports_grouped_mm', lambda index: True)
    for major, expected in ((8, False), (9, True), (10, True), (12, False)):
        monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda index, m=major: (m, 0))
        assert gg.takes_device_sizes(cuda, bf, (2048, 768), 128) == expected, major
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda index: (9, 0))
    assert not gg.takes_device_sizes(cuda, fp16, (2048, 768), 128)   # fp16: torch's fallback syncs
    assert not gg.takes_device_sizes(cuda, bf, (2048, 764), 128)     # 764 bf16: not 16-aligned
    monkeypatch.setattr(gg.choice, '_cuda_device_supports_grouped_mm', lambda index: False)
    assert not gg.takes_device_sizes(cuda, bf, (2048, 768), 128)

    monkeypatch.setattr(gg.choice, '_cuda_device_supports_grouped_mm', lambda index: True)
    assert gg.takes_device_sizes(cuda, bf, (2048, 768), 1023)
    assert not gg.takes_device_sizes(cuda, bf, (2048, 768), 1024)   # the CUTLASS kernel's limit

    npu = types.SimpleNamespace(type='npu', index=0)              # only its type is looked at
    monkeypatch.setitem(sys.modules, 'torch_npu', types.ModuleType('torch_npu'))
    _fake_npu_product(monkeypatch, 'Ascend910B4')
    assert not gg.takes_device_sizes(npu, bf, (2048, 768), 128)      # no npu_grouped_matmul
    sys.modules['torch_npu'].npu_grouped_matmul = lambda *a, **k: None
    # The empty-group fill of the weight gradients is a Triton kernel: no triton-ascend, no device sizes.
    assert not gg.empty_groups._fill_kernel_runs(npu)                             # standard triton here
    assert not gg.takes_device_sizes(npu, bf, (2048, 768), 128)
    monkeypatch.setattr(gg.empty_groups, '_fill_kernel_runs', lambda device: True)
    assert gg.takes_device_sizes(npu, bf, (2048, 768), 128)
    assert gg.takes_device_sizes(npu, fp16, (2048, 766), 128)        # no 16-byte rule documented
    assert gg.takes_device_sizes(npu, fp32, (2048, 768), 128)        # Atlas A2: documented
    _fake_npu_product(monkeypatch, 'Ascend910_9391')
    assert not gg.takes_device_sizes(npu, fp32, (2048, 768), 128)    # A3: not documented -> loop
    assert not gg.takes_device_sizes(npu, torch.float64, (2048, 768), 128)
    assert not gg.takes_device_sizes(npu, bf, (2048, 768), 2048)     # > 1024 groups
    assert not gg.takes_device_sizes(npu, bf, (65536, 768), 128)


# --------------------------------------------------------------------------
# sys.modules injection
# --------------------------------------------------------------------------

def test_make_modules_layout():
    mods = gg.make_modules()
    assert set(mods) == {'grouped_gemm', 'grouped_gemm.backend', 'grouped_gemm.ops'}
    pkg = mods['grouped_gemm']
    assert pkg.backend is mods['grouped_gemm.backend']
    assert pkg.ops is mods['grouped_gemm.ops']
    assert pkg.backend.gmm is gg.gmm is gg.backend.gmm
    assert pkg.ops.gmm is gg.ops.gmm
    for name, m in mods.items():
        assert isinstance(m, types.ModuleType) and m.__name__ == name
        assert not hasattr(m, '__file__')
        assert 'megablocks-ascend stand-in' in m.__doc__
        assert m.__megablocks_ascend_standin__ is True


def test_make_modules_satisfies_import_in_subprocess():
    script = textwrap.dedent(f'''
        import importlib.util, sys, warnings
        from megablocks_ascend.native import grouped_gemm as mod
        sys.modules.update(mod.make_modules())

        import grouped_gemm
        import grouped_gemm.ops
        from grouped_gemm import backend
        from grouped_gemm.ops import gmm as ops_gmm
        assert grouped_gemm.backend.gmm is mod.gmm
        assert grouped_gemm.ops.gmm is ops_gmm is mod.ops.gmm
        assert importlib.util.find_spec('grouped_gemm') is not None

        import torch
        a = torch.randn(5, 4); b = torch.randn(2, 3, 4)
        bs = torch.tensor([2, 3])
        out = grouped_gemm.ops.gmm(a, b, bs, trans_b=True)
        ref = torch.cat([a[:2] @ b[0].t(), a[2:] @ b[1].t()])
        assert torch.allclose(out, ref, atol=1e-5)

        # MegaBlocks' own shim (loaded from its file: importing the megablocks
        # package needs its CUDA extension) must now see grouped_gemm.
        mb = importlib.util.find_spec('megablocks')
        if mb is not None:
            path = mb.submodule_search_locations[0] + '/grouped_gemm_util.py'
            s2 = importlib.util.spec_from_file_location('_mb_gg_util', path)
            util = importlib.util.module_from_spec(s2)
            with warnings.catch_warnings():
                warnings.simplefilter('error')
                s2.loader.exec_module(util)
            assert util.grouped_gemm_is_available()
            assert util.backend.gmm is mod.gmm and util.ops.gmm is mod.ops.gmm
            print('megablocks-util-ok')
        print('ok')
    ''')
    env = dict(os.environ)
    env.pop('PYTHONPATH', None)
    proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                          cwd=str(REPO.parent), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith('ok')
    assert 'megablocks-util-ok' in proc.stdout
