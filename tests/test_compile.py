"""The routing ops as torch.library custom ops: opcheck, and torch.compile without graph breaks at them."""

import pytest
import torch

import megablocks
import megablocks_ascend
from megablocks_ascend import backends, library


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: dynamo remembers frames it gave up on, and the recompile
    limit counts compilations across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _routing(tokens=8, experts=3, top_k=2):
    top = torch.randint(0, experts, (tokens * top_k,), dtype=torch.int32)
    bin_ids, indices = torch.sort(top, stable=True)
    counts = torch.bincount(top, minlength=experts)
    return (indices.int(), bin_ids.int(), torch.cumsum(counts, 0).int(),
            torch.cumsum((counts + 3) // 4 * 4, 0).int(), torch.rand(tokens * top_k))


def _samples(name, tokens=8, experts=3, top_k=2, hidden=16, capacity=5):
    indices, bin_ids, bins, padded_bins, weights = _routing(tokens, experts, top_k)
    n = tokens * top_k
    x = {"binned_scatter": torch.randn(experts, capacity, hidden),
         "binned_scatter_wgrad": torch.randn(experts, capacity, hidden),
         "scatter": torch.randn(n, hidden), "scatter_wgrad": torch.randn(n, hidden),
         "padded_scatter": torch.randn(int(padded_bins[-1]), hidden),
         "padded_scatter_wgrad": torch.randn(int(padded_bins[-1]), hidden)}.get(name, torch.randn(tokens, hidden))
    values = dict(x=x, grad=torch.randn(tokens, hidden), indices=indices, bin_ids=bin_ids, bins=bins,
                  padded_bins=padded_bins, weights=weights, expert_capacity=capacity, top_k=top_k)
    return tuple(values[p] for p in backends.SPECS[name][0])


@pytest.mark.parametrize("name", list(backends.SPECS))
def test_opcheck(name):
    tests = ["test_schema", "test_faketensor", "test_aot_dispatch_static"]
    if name == "padded_gather":  # its row count is data-dependent, which static AOT dispatch refuses
        tests.remove("test_aot_dispatch_static")
    with megablocks_ascend.use_backend("ascend"):
        torch.library.opcheck(library.OPS[name], _samples(name), test_utils=tests)


@pytest.mark.parametrize("layout", ["binned", "dropless"])
def test_ops_compile_fullgraph_forward_and_backward(layout):
    indices, bin_ids, bins, _, weights = _routing()
    x = torch.randn(8, 16, requires_grad=True)
    w = weights.clone().requires_grad_()

    def f(x, w):
        if layout == "binned":
            y = megablocks.ops.binned_gather(x, indices, bins, 6, 2)
            return megablocks.ops.binned_scatter(y * 2.0, indices, w, bins, 2)
        y = megablocks.ops.gather(x, indices, bin_ids, bins, 2)
        return megablocks.ops.scatter(y * 2.0, indices, bin_ids, w, bins, 2)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        out = compiled(x, w)
        out.sum().backward()
    assert {c.backend for c in calls} == {"ascend"} and calls
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with megablocks_ascend.use_backend("ascend"):
        ref = f(x, w)
        ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grads, (x.grad, w.grad))


# The layer setups compiled below: an id, the layer class and what differs from BASE_ARGS. To cover
# a new setup (dMoE with mlp_impl="sparse" once it runs off CUDA, say), add a line.
BASE_ARGS = dict(hidden_size=16, ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2, mlp_impl="grouped",
                 fp16=False, bf16=False, moe_loss_weight=0.0)
LAYER_CONFIGS = {
    "MoE": ("MoE", {}),
    "MoE-top1": ("MoE", dict(moe_top_k=1)),
    "dMoE-grouped-mlp": ("dMoE", dict(mlp_type="mlp")),
    "dMoE-grouped-glu": ("dMoE", dict(mlp_type="glu")),
    "dMoE-grouped-glu-bf16": ("dMoE", dict(mlp_type="glu", bf16=True)),
}
# Every setup with our kernels; the torch backend on one setup per layer (the routing ops reach the
# graph through the same custom ops whichever backend serves them).
CASES = [pytest.param(name, "ascend", id=f"{name}-ascend") for name in LAYER_CONFIGS] + [
    pytest.param(name, "torch", id=f"{name}-torch") for name in ("MoE", "dMoE-grouped-glu")]
# memory_optimized_mlp=True compiles, but not as one graph: upstream's MemoryOptimizedGroupedMLP /
# GroupedGLU backward recomputes the activation by setting requires_grad on a saved tensor and
# running autograd inside backward, which dynamo refuses ("setattr() on Tensor.requires_grad").
MEMORY_OPTIMIZED = {
    "dMoE-grouped-mlp-memory-optimized": ("dMoE", dict(mlp_type="mlp", memory_optimized_mlp=True)),
    "dMoE-grouped-glu-memory-optimized": ("dMoE", dict(mlp_type="glu", memory_optimized_mlp=True)),
}


def _layer(name):
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE
    from megablocks.layers.moe import MoE

    cls, overrides = {**LAYER_CONFIGS, **MEMORY_OPTIMIZED}[name]
    args = Arguments(**{**BASE_ARGS, **overrides})
    return {"MoE": MoE, "dMoE": dMoE}[cls](args), args


def _step(module, inp):
    inp = inp.clone().requires_grad_()
    out, bias = module(inp)
    loss = out.float().square().sum() + (bias.float().square().sum() if bias is not None else 0)
    loss.backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return out.detach(), inp.grad, grads


@pytest.mark.parametrize("config, backend", CASES)
def test_unchanged_layer_compiles_as_one_graph_forward_and_backward(config, backend):
    """MegaBlocks' own layers, with our routing ops, megablocks_ops and grouped_gemm stand-ins,
    compile with fullgraph=True (no graph break anywhere) and match eager, gradients included,
    on every torch CI runs (torch 2.7 needs the resolve-dtensor patch)."""
    from megablocks.layers.moe import clear_load_balancing_loss

    layer, args = _layer(config)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    x = torch.randn(4, 2, 16, dtype=dtype)
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        compiled = _step(torch.compile(layer, fullgraph=True, backend="aot_eager"), x)
        eager = _step(layer, x)
    clear_load_balancing_loss()
    assert calls and {c.backend for c in calls} == {backend}
    assert compiled[0].dtype == dtype and all(g.dtype == dtype for g in compiled[2])
    torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("config", list(MEMORY_OPTIMIZED))
def test_memory_optimized_mlp_compiles_with_a_graph_break_in_upstreams_backward(config):
    from megablocks.layers.moe import clear_load_balancing_loss

    layer, _ = _layer(config)
    x = torch.randn(4, 2, 16)
    with megablocks_ascend.use_backend("ascend"):
        with pytest.raises(torch._dynamo.exc.Unsupported, match="requires_grad"):
            _step(torch.compile(layer, fullgraph=True, backend="aot_eager"), x)
        torch._dynamo.reset()
        compiled = _step(torch.compile(layer, backend="aot_eager"), x)
        eager = _step(layer, x)
    clear_load_balancing_loss()
    torch.testing.assert_close(compiled, eager)


def test_dmoe_compiles_with_inductor_forward_and_backward():
    """The default torch.compile backend, once (a C++ build on CPU takes most of a minute): inductor
    generates code around our routing ops, which it sees as opaque custom ops."""
    from megablocks.layers.moe import clear_load_balancing_loss

    layer, _ = _layer("dMoE-grouped-glu")
    x = torch.randn(4, 2, 16)
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        compiled = _step(torch.compile(layer, fullgraph=True), x)
        eager = _step(layer, x)
    clear_load_balancing_loss()
    assert calls and {c.backend for c in calls} == {"ascend"}
    torch.testing.assert_close(compiled, eager)
