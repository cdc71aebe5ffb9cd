"""The weight gradients of the grouped GEMM (its K-grouped form, ``trans_a``), on every implementation.

An expert that received no tokens has a zero weight gradient. These tests check that it is exactly
zero on every implementation of the ``grouped_gemm`` stand-in (the per-group loop, torch's CPU
kernel for ``torch._grouped_mm``, that kernel with its empty groups poisoned as a GPU kernel may
leave them, and a fake ``npu_grouped_matmul``), with the group sizes on the host and on the device,
directly and through MegaBlocks' unchanged dMoE; and that no op other than the GEMM passes over a
whole weight gradient. The zero fill itself (``kernels/grouped.py``): tests/test_zero_fill.py.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from full_passes import FullPasses
from megablocks_ascend.native import grouped_gemm as gg
from test_grouped_gemm import TOL, _FakeTorchNpu, make_inputs, ref_gmm, rel_err

PATTERNS = {  # group sizes: which experts received no tokens
    "first": [0, 5, 3, 4],
    "last": [5, 3, 4, 0],
    "several": [0, 4, 0, 0, 6, 0, 2],
    "all": [0, 0, 0],
    "none": [3, 5, 2],
}
IMPLS = ("loop", "grouped_mm", "grouped_mm-guarded", "npu")

needs_grouped_mm = pytest.mark.skipif(
    not gg.choice._cpu_supports_grouped_mm(),
    reason=f"torch {torch.__version__} has no CPU kernel for torch._grouped_mm (needs torch >= 2.9)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# --------------------------------------------------------------------------------------------
# Every implementation of the stand-in: empty groups exactly zero.


class _QuietFakeNpu(_FakeTorchNpu):
    """The fake NPU kernel, its own torch ops hidden from dispatch modes (it stands in for a
    device kernel, whose internals are not ours to count)."""

    def npu_grouped_matmul(self, *args, **kwargs):
        with _disable_current_modes():
            return super().npu_grouped_matmul(*args, **kwargs)


def _route_to(monkeypatch, name):
    """Every call with non-empty operands goes to ``name`` (an empty operand goes to the loop, as
    the real selection sends it)."""
    def select(a, b=None, *args, **kwargs):
        return gg.IMPL_LOOP if a.numel() == 0 or (b is not None and b.numel() == 0) else name
    monkeypatch.setattr(gg.choice, "_select_impl", select)


def use_impl(monkeypatch, impl):
    """Route the stand-in's calls on CPU tensors to ``impl``."""
    if impl == "loop":
        _route_to(monkeypatch, gg.IMPL_LOOP)
    elif impl in ("grouped_mm", "grouped_mm-guarded"):
        if not gg.choice._cpu_supports_grouped_mm():
            pytest.skip(f"torch {torch.__version__} has no CPU kernel for torch._grouped_mm")
        _route_to(monkeypatch, gg.IMPL_GROUPED_MM)
        if impl == "grouped_mm-guarded":
            # As on a GPU whose kernel is not known to write empty K-groups: this one writes garbage.
            real = torch._grouped_mm
            monkeypatch.setattr(gg.empty_groups, "_grouped_mm_writes_empty_groups", lambda device: False)

            def poisoning(mat_a, mat_b, offs=None, **kw):
                out = real(mat_a, mat_b, offs=offs, **kw)
                if mat_a.dim() == 2 and mat_b.dim() == 2:
                    with _disable_current_modes():
                        starts = torch.cat([offs.new_zeros(1), offs[:-1]])
                        out[(offs - starts) == 0] = float("nan")
                return out
            monkeypatch.setattr(torch, "_grouped_mm", poisoning)
    elif impl == "npu":
        monkeypatch.setitem(sys.modules, "torch_npu", _QuietFakeNpu())
        _route_to(monkeypatch, gg.IMPL_NPU)
    else:
        raise ValueError(impl)


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("impl", IMPLS)
def test_weight_gradient_of_empty_groups_is_exactly_zero(monkeypatch, impl, pattern, where):
    """``ops.gmm`` forward and backward (as MegaBlocks' w1: trans_b) against float64 autograd;
    the weight gradient of every empty group is exactly zero."""
    use_impl(monkeypatch, impl)
    if where == "host":
        monkeypatch.setattr(gg.checks, "_device_sizes", lambda batch_sizes, a: False)
    sizes = PATTERNS[pattern]
    a, b, bs = make_inputs(sizes, False, True, k=16, n=24, seed=3)
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    grad = torch.randn(sum(sizes), 24, generator=torch.Generator().manual_seed(4))
    out = gg.ops.gmm(a1, b1, bs, trans_b=True)
    out.backward(grad)

    a2, b2 = a.double().requires_grad_(), b.double().requires_grad_()
    ref = ref_gmm(a2, b2, sizes, False, True)
    pieces, r = [], 0
    for g, n in enumerate(sizes):
        pieces.append(a2[r:r + n] @ b2[g].t())
        r += n
    torch.cat(pieces).backward(grad.double())
    assert rel_err(out, ref) < TOL[torch.float32]
    assert rel_err(a1.grad, a2.grad) < TOL[torch.float32] if sum(sizes) else a1.grad.numel() == 0
    for g, n in enumerate(sizes):
        if n == 0:
            assert torch.count_nonzero(b1.grad[g]) == 0, g
        else:
            assert rel_err(b1.grad[g], b2.grad[g]) < TOL[torch.float32], g


@needs_grouped_mm
def test_cpu_kernel_writes_empty_groups_itself():
    """Why the CPU needs no zero fill: torch's CPU kernel for torch._grouped_mm is
    ``_grouped_mm_fallback``, one ``at::mm_out`` per group, and ``mm_out`` with an empty inner
    dimension writes zeros over whatever its output held. Checked here on this torch: the
    primitive on a poisoned output, and the op itself with no zero fill of ours."""
    a, b = torch.randn(16, 5), torch.randn(5, 24)
    poisoned = torch.full((16, 24), float("nan"))
    torch.mm(a[:, :0], b[:0], out=poisoned)
    assert torch.count_nonzero(_bits(poisoned)) == 0
    assert not gg.empty_groups._grouped_mm_writes_empty_groups(torch.device("cuda"))
    sizes = [0, 8, 0, 8]
    x, y, bs = make_inputs(sizes, True, False, k=16, n=24)
    out = torch._grouped_mm(x.t(), y, offs=bs.cumsum(0).int())
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[2]) == 0


# --------------------------------------------------------------------------------------------
# MegaBlocks' dMoE with experts that receive no tokens.


def make_dmoe(*, mlp_type, memory_optimized, experts=4, top_k=2, hidden=32, ffn=48, dead=(0, 2)):
    """A float32 dMoE whose router never picks the experts in ``dead`` for positive inputs."""
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE
    args = Arguments(hidden_size=hidden, ffn_hidden_size=ffn, moe_num_experts=experts, moe_top_k=top_k,
                     mlp_impl="grouped", mlp_type=mlp_type, memory_optimized_mlp=memory_optimized,
                     fp16=False, bf16=False, bias=True, moe_loss_weight=0.0)
    layer = dMoE(args)
    with torch.no_grad():
        w = layer.router.layer.weight
        w.uniform_(0.1, 1.0, generator=torch.Generator().manual_seed(1))
        w[list(dead)] = -1.0      # x > 0: these experts' logits are the lowest
        torch.nn.init.normal_(layer.experts.bias, std=0.1)
    return layer, args


def _expert_weights(layer, args):
    mlp = layer.experts.mlp
    names = ("w1", "v1", "w2") if args.mlp_type == "glu" else ("w1", "w2")
    return {n: getattr(mlp, n) for n in names}


@pytest.mark.parametrize("memory_optimized", [False, True], ids=["plain", "memopt"])
@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
@pytest.mark.parametrize("impl", IMPLS)
def test_dmoe_experts_without_tokens_get_zero_weight_gradients(monkeypatch, impl, mlp_type, memory_optimized):
    """The unchanged dMoE, forward and backward, with two of four experts receiving no tokens:
    output and every gradient match the per-token float64 reference of test_layers, and the dead
    experts' weight gradients are exactly zero."""
    from test_layers import dense_reference, rel, run_layer
    use_impl(monkeypatch, impl)
    dead = (0, 2)
    layer, args = make_dmoe(mlp_type=mlp_type, memory_optimized=memory_optimized, dead=dead)
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(5, 2, args.hidden_size, generator=gen) + 0.1
    grad_out = torch.randn(5, 2, args.hidden_size, generator=gen)
    ref_out, xd, params, chosen, _ = dense_reference(layer, args, x, dropless=True)
    assert not set(chosen.flatten().tolist()) & set(dead)
    ref_out.backward(grad_out.double())

    out, xgrad, grads, _ = run_layer(layer, x, "torch", grad_out)
    assert rel(out, ref_out) < 1e-5 and rel(xgrad, xd.grad) < 1e-5
    for name, p in params.items():
        assert rel(grads[name], p.grad) < 1e-5, name
    e, h = args.moe_num_experts, args.hidden_size
    for name in _expert_weights(layer, args):
        g = grads[f"experts.mlp.{name}"].view(e, -1, h)
        for expert in range(e):
            if expert in dead:
                assert torch.count_nonzero(g[expert]) == 0, (name, expert)
            else:
                assert torch.count_nonzero(g[expert]) > 0, (name, expert)


# --------------------------------------------------------------------------------------------
# No pass over a whole weight gradient besides the GEMM.


@pytest.mark.parametrize("memory_optimized", [False, True], ids=["plain", "memopt"])
@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
@pytest.mark.parametrize("impl", IMPLS)
def test_dmoe_step_makes_no_full_pass_over_a_weight_gradient(monkeypatch, impl, mlp_type, memory_optimized):
    """A dMoE training step (forward and backward, one expert without tokens) issues no aten op
    over a tensor of the expert weights' size other than the GEMMs, views and allocations; in
    particular no elementwise pass that zeroes empty groups (kernels/grouped.py does that on the
    device, for the empty groups only, where the kernel does not). The earlier full-tensor masked
    fill is caught by the same check (the test can fail)."""
    use_impl(monkeypatch, impl)
    layer, args = make_dmoe(mlp_type=mlp_type, memory_optimized=memory_optimized, dead=(1,))
    numel = layer.experts.mlp.w1.numel()
    others = {args.hidden_size * n for n in (10, 20)} | {args.ffn_hidden_size * 20}
    assert numel not in others  # tokens x hidden, assignments x hidden, assignments x ffn
    gen = torch.Generator().manual_seed(2)
    x = (torch.rand(5, 2, args.hidden_size, generator=gen) + 0.1).requires_grad_()
    grad_out = torch.randn(5, 2, args.hidden_size, generator=gen)

    def step():
        out, bias = layer(x)
        (out + bias).backward(grad_out)

    with FullPasses(numel) as passes:
        step()
    assert passes.events == []
    assert layer.experts.mlp.w1.grad.view(args.moe_num_experts, -1, args.hidden_size)[1].abs().sum() == 0

    if impl in ("grouped_mm-guarded", "npu"):
        layer.zero_grad(set_to_none=True)
        monkeypatch.setattr(gg, "_legacy_full_fill", True)
        with FullPasses(numel) as passes:
            step()
        assert passes.events and all("masked_fill" in e for e in passes.events), passes.events
