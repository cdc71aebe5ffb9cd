"""megablocks_ascend.grouped_mlp: MegaBlocks' memory-optimized grouped MLP and GLU without the copies
of the grouped GEMM's results into reused buffers.

Against upstream's own functions run through the same ``grouped_gemm`` stand-in: the same outputs
and gradients bit for bit (the same GEMMs on the same values, in the same order), with and without
experts that receive no tokens, a custom activation, and under autocast; and the two copies into
``c`` that upstream's backward costs with the stand-in are gone.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megablocks_ascend  # noqa: F401  (the stand-ins and patches)
from megablocks.layers import glu, mlp
from megablocks.layers.arguments import DEFAULT_ACTIVATION_FN
from megablocks_ascend import grouped_mlp
from megablocks_ascend.patching.registry import source_fingerprint

E, H, FFN = 4, 32, 48


def _inputs(sizes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    x = torch.randn(rows, H, generator=g)
    w = [torch.randn(E, FFN, H, generator=g) * 0.2 for _ in range(3)]
    grad = torch.randn(rows, H, generator=g)
    return x.to(dtype), [t.to(dtype) for t in w], grad.to(dtype), torch.tensor(sizes)


def _run(fn, x, weights, grad, sizes, activation, autocast=None):
    x = x.clone().requires_grad_()
    weights = [w.clone().requires_grad_() for w in weights]
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        out = fn(x, *weights, sizes, activation)
    out.backward(grad.to(out.dtype))
    return [out.detach(), x.grad] + [w.grad for w in weights]


CASES = [("mlp", [5, 0, 7, 3]), ("mlp", [0, 0, 9, 0]), ("glu", [5, 0, 7, 3]), ("glu", [4, 4, 4, 4])]


def _plain_mlp(x, w1, w2, batch_sizes, activation):
    """What GroupedMLP computes without memory_optimized_mlp (autograd through ops.gmm)."""
    from megablocks import grouped_gemm_util as gg
    return gg.ops.gmm(activation(gg.ops.gmm(x, w1, batch_sizes, trans_b=True)), w2, batch_sizes)


@pytest.mark.parametrize("activation", ["default", "relu"])
@pytest.mark.parametrize("kind,sizes", CASES)
def test_same_results_as_upstream(kind, sizes, activation):
    act = DEFAULT_ACTIVATION_FN if activation == "default" else torch.nn.functional.relu
    x, (w1, v1, w2), grad, bs = _inputs(sizes)
    if kind == "mlp":
        ours = _run(grouped_mlp.memory_optimized_grouped_mlp, x, [w1, w2], grad, bs, act)
        if activation == "relu":
            # Upstream's backward overwrites the recomputed activation's output with its gradient,
            # which relu saved for its own backward: upstream fails, whatever grouped GEMM it uses.
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                _run(mlp.memory_optimized_grouped_mlp, x, [w1, w2], grad, bs, act)
            theirs = _run(_plain_mlp, x, [w1, w2], grad, bs, act)
        else:
            theirs = _run(mlp.memory_optimized_grouped_mlp, x, [w1, w2], grad, bs, act)
    else:
        ours = _run(grouped_mlp.memory_optimized_grouped_glu, x, [w1, v1, w2], grad, bs, act)
        theirs = _run(glu.memory_optimized_grouped_glu, x, [w1, v1, w2], grad, bs, act)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    for expert, n in enumerate(sizes):
        if n == 0:
            assert all(torch.count_nonzero(g[expert]) == 0 for g in ours[2:])


@pytest.mark.parametrize("kind", ["mlp", "glu"])
def test_same_results_as_upstream_under_autocast(kind):
    """float32 weights, bf16 autocast: the forward's casts (upstream's, through the autocast-device
    decorators) and the backward's autocast state are upstream's."""
    x, (w1, v1, w2), grad, bs = _inputs([5, 0, 8, 3])
    pairs = {"mlp": (grouped_mlp.memory_optimized_grouped_mlp, mlp.memory_optimized_grouped_mlp, [w1, w2]),
             "glu": (grouped_mlp.memory_optimized_grouped_glu, glu.memory_optimized_grouped_glu, [w1, v1, w2])}
    ours_fn, theirs_fn, weights = pairs[kind]
    ours = _run(ours_fn, x, weights, grad, bs, DEFAULT_ACTIVATION_FN, autocast=torch.bfloat16)
    theirs = _run(theirs_fn, x, weights, grad, bs, DEFAULT_ACTIVATION_FN, autocast=torch.bfloat16)
    assert ours[0].dtype == torch.bfloat16 and ours[2].dtype == torch.float32
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


class _Copies(TorchDispatchMode):
    """Counts ``copy_`` ops into tensors of the given sizes."""

    def __init__(self, numels):
        super().__init__()
        self.numels, self.count = set(numels), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.copy_ and args[0].numel() in self.numels:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl", ["torch._grouped_mm", "loop"])
@pytest.mark.parametrize("kind", ["mlp", "glu"])
def test_no_copy_of_results_into_reused_buffers(monkeypatch, kind, impl):
    from megablocks_ascend.native import grouped_gemm as gg
    if impl != "loop" and not gg.choice._cpu_supports_grouped_mm():
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for torch._grouped_mm")
    monkeypatch.setattr(gg.choice, "_select_impl", lambda *a, **k: impl)
    sizes = [5, 0, 7, 3]
    x, (w1, v1, w2), grad, bs = _inputs(sizes)
    rows = sum(sizes)
    fns = {"mlp": (grouped_mlp.memory_optimized_grouped_mlp, mlp.memory_optimized_grouped_mlp, [w1, w2]),
           "glu": (grouped_mlp.memory_optimized_grouped_glu, glu.memory_optimized_grouped_glu, [w1, v1, w2])}
    ours_fn, theirs_fn, weights = fns[kind]
    counts, kept = {}, {}
    for name, fn in (("ours", ours_fn), ("upstream", theirs_fn)):
        g = grad.clone()
        with _Copies({rows * FFN, rows * H}) as copies:
            _run(fn, x, weights, g, bs, DEFAULT_ACTIVATION_FN)
        counts[name], kept[name] = copies.count, torch.equal(g, grad)
    # Upstream through the stand-in: the two copies into c where the implementation computes out of
    # place (the loop writes into c), and autograd's copy of dx into x.grad (upstream's dx is the
    # output gradient the caller passed to backward, overwritten, which autograd cannot keep).
    assert counts == {"ours": 0, "upstream": 1 if impl == "loop" else 3}
    assert kept == {"ours": True, "upstream": False}


def test_upstream_code_is_the_code_followed():
    """The forwards called and the backwards re-expressed are MegaBlocks 0.10.0's (the patch that
    uses these functions refuses another body)."""
    for target, fingerprint in grouped_mlp.UPSTREAM.items():
        owner, _, method = target.partition(":")
        cls_name, _, attr = method.partition(".")
        module = __import__(owner, fromlist=[cls_name])
        fn = grouped_mlp._inner(getattr(getattr(module, cls_name), attr))
        assert source_fingerprint(fn) == fingerprint, target


@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
@pytest.mark.parametrize("activation", ["default", "relu"])
def test_dmoe_memory_optimized_matches_plain(mlp_type, activation):
    """MegaBlocks' dMoE with memory_optimized_mlp (through the patch's forwards, so through these
    functions) against the same layer without it: same output and gradients; relu included, which
    upstream's memory-optimized MLP cannot take."""
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE
    act = DEFAULT_ACTIVATION_FN if activation == "default" else torch.nn.functional.relu
    results = []
    for memory_optimized in (False, True):
        torch.manual_seed(0)
        args = Arguments(hidden_size=H, ffn_hidden_size=FFN, moe_num_experts=E, moe_top_k=2, mlp_impl="grouped",
                         mlp_type=mlp_type, memory_optimized_mlp=memory_optimized, activation_fn=act,
                         fp16=False, bf16=False, moe_loss_weight=0.0)
        layer = dMoE(args)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(6, 2, H, generator=g).requires_grad_()
        out, bias = layer(x)
        (out + bias).backward(torch.randn(6, 2, H, generator=g))
        results.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
