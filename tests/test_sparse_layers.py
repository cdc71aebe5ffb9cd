"""MegaBlocks' unchanged sparse dMoE (``mlp_impl="sparse"``, the default) through the plugin.

Against ``tests/test_layers.py``'s per-token float64 reference (route each token with a float64
copy of the router, run each of its top_k experts as a dense MLP, sum the weighted results):
output and every gradient, for ``mlp`` and ``glu`` experts, ``memory_optimized_mlp`` on and off,
top_k 1 to 8. Against the grouped dMoE on the same weights (the two MLPs have the same parameters
with the same layout: ``w1``, ``v1``, ``w2`` of shape ``[experts * ffn, hidden]``, which the test
asserts before copying them over), in float32 and in bf16. A trace shows which backend served
every routing and block-sparse call.

Runs on CPU by default (``ascend``: our kernels in the Triton interpreter); with
``MEGABLOCKS_ASCEND_TEST_DEVICE=cuda TRITON_INTERPRET=0`` on a GPU, where ``cuda`` (stk's own
kernels, at sizes where they are correct) is compared too.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import megablocks_ascend
from megablocks.layers.arguments import Arguments
from megablocks.layers.dmoe import dMoE
from megablocks.layers.moe import clear_load_balancing_loss
from test_layers import dense_reference, rel

_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
SPARSE_OPS = {"prepare_routing", "padded_gather", "padded_scatter", "padded_scatter_wgrad", "topology", "sdd",
              "dsd"}


def sparse_ops(backend):
    """The calls a sparse dMoE step makes: with ``cuda`` the topology is upstream's sequence, which
    also calls stk's ``row_indices`` (ours builds it in the same launch as the rest)."""
    return SPARSE_OPS | ({"row_indices"} if backend == "cuda" else set())


def _backends(device):
    return ["ascend", "torch"] + (["cuda"] if device.type == "cuda" else [])


def _tol(backend, dtype, tol):
    """stk's own kernels (``cuda``) compute float32 products in TF32 (``tl.dot``'s default input
    precision; ours follow ``torch.backends.cuda.matmul.allow_tf32``, off by default), so in
    float32 they are held to TF32's precision (10-bit mantissa: ~5e-4 per product)."""
    return 3e-3 if backend == "cuda" and dtype == torch.float32 else tol


def make_sparse(device, *, experts=4, top_k=2, hidden=None, ffn=128, mlp_type="mlp", memory_optimized=False,
                dtype=torch.float32, **extra):
    """An unchanged ``Arguments`` (``mlp_impl`` left at its default, ``"sparse"``) and its dMoE.
    ``hidden`` defaults to 32, and to 128 on CUDA, where stk's own kernels (which need multiples of
    128) are compared too."""
    hidden = hidden or (128 if device.type == "cuda" else 32)
    # Built while our kernels serve stk, as a user does (MEGABLOCKS_BACKEND=ascend): under auto on a
    # CUDA device MegaBlocks' refusal stays. Which backend then runs the layer is each test's choice.
    with megablocks_ascend.use_backend("ascend"):
        args = Arguments(hidden_size=hidden, ffn_hidden_size=ffn, moe_num_experts=experts, moe_top_k=top_k,
                         mlp_type=mlp_type, memory_optimized_mlp=memory_optimized, fp16=dtype == torch.float16,
                         bf16=dtype == torch.bfloat16, moe_loss_weight=0.0, device=device, **extra)
    assert args.mlp_impl == "sparse"
    layer = dMoE(args)
    torch.nn.init.normal_(layer.experts.bias, std=0.1)
    return layer, args


def run(layer, x, grad_out, backend):
    layer.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_()
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        out, bias = layer(xr)
        out = out + bias
        out.backward(grad_out)
    clear_load_balancing_loss()
    return out.detach(), xr.grad.detach(), {n: p.grad.detach().clone() for n, p in layer.named_parameters()}, calls


def reference(layer, args, x, grad_out):
    """The per-token float64 reference, on the CPU."""
    cpu = copy.deepcopy(layer).to("cpu")
    ref_out, xd, params, _, _ = dense_reference(cpu, args, x.detach().cpu(), dropless=True)
    ref_out.backward(grad_out.detach().cpu().double())
    return ref_out, xd.grad, {n: p.grad for n, p in params.items()}


def _check(got, ref, tol, what):
    out, xgrad, grads = got
    ref_out, ref_xgrad, ref_grads = ref
    assert rel(out.cpu(), ref_out) < tol, (what, "output", rel(out.cpu(), ref_out))
    assert rel(xgrad.cpu(), ref_xgrad) < tol, (what, "input gradient", rel(xgrad.cpu(), ref_xgrad))
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel(g.cpu(), ref_grads[name]) < tol, (what, name, rel(g.cpu(), ref_grads[name]))


CASES = [
    # (mlp_type, memory_optimized_mlp, experts, top_k, seq, batch)
    pytest.param("mlp", False, 4, 1, 8, 2, id="mlp-top1"),
    pytest.param("mlp", False, 6, 2, 8, 3, id="mlp-top2"),
    pytest.param("mlp", True, 4, 2, 5, 3, id="mlp-memopt-top2"),
    pytest.param("glu", False, 4, 2, 5, 3, id="glu-top2"),
    pytest.param("mlp", True, 8, 8, 3, 2, id="mlp-memopt-top8"),
    pytest.param("glu", False, 8, 5, 3, 2, id="glu-top5"),
]


@pytest.mark.parametrize("mlp_type,memory_optimized,experts,top_k,seq,batch", CASES)
def test_sparse_dmoe_matches_per_token_reference(mlp_type, memory_optimized, experts, top_k, seq, batch, device):
    layer, args = make_sparse(device, experts=experts, top_k=top_k, mlp_type=mlp_type,
                              memory_optimized=memory_optimized)
    x = torch.randn(seq, batch, args.hidden_size).to(device)
    grad_out = torch.randn(seq, batch, args.hidden_size).to(device)
    ref = reference(layer, args, x, grad_out)
    results = {}
    for backend in _backends(device):
        out, xgrad, grads, calls = run(layer, x, grad_out, backend)
        assert {c.backend for c in calls} == {backend}
        assert {c.op for c in calls} == sparse_ops(backend)
        _check((out, xgrad, grads), ref, _tol(backend, torch.float32, 1e-5), backend)
        results[backend] = out
    assert rel(results["ascend"], results["torch"]) < 1e-6


@pytest.mark.parametrize("top_k", range(1, 9))
def test_every_top_k_from_1_to_8(top_k, device):
    """The torch backend at every top_k (ascend runs a subset above: the interpreter is slow)."""
    layer, args = make_sparse(device, experts=8, top_k=top_k, memory_optimized=top_k % 2 == 0)
    x = torch.randn(4, 2, args.hidden_size).to(device)
    grad_out = torch.randn(4, 2, args.hidden_size).to(device)
    got = run(layer, x, grad_out, "torch")
    _check(got[:3], reference(layer, args, x, grad_out), 1e-5, f"top_k={top_k}")


def test_sparse_glu_with_memory_optimized_mlp_is_refused_by_megablocks_itself(device):
    layer, args = make_sparse(device, mlp_type="glu", memory_optimized=True)
    with megablocks_ascend.use_backend("torch"), pytest.raises(NotImplementedError, match="GLU with sparse"):
        layer(torch.randn(4, 2, args.hidden_size).to(device))
    clear_load_balancing_loss()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
def test_sparse_matches_grouped_on_the_same_weights(mlp_type, dtype, tol, device):
    """The same layer with mlp_impl="grouped": the same numbers (float32), within bf16 rounding (bf16)."""
    sparse, args = make_sparse(device, experts=4, top_k=2, mlp_type=mlp_type, dtype=dtype)
    grouped_args = dataclasses.replace(args, mlp_impl="grouped")  # (no sparse check: any backend)
    grouped = dMoE(grouped_args)
    shapes = {n: (p.shape, p.dtype) for n, p in sparse.named_parameters()}
    assert shapes == {n: (p.shape, p.dtype) for n, p in grouped.named_parameters()}
    assert shapes["experts.mlp.w1"][0] == (args.moe_num_experts * args.ffn_hidden_size, args.hidden_size)
    grouped.load_state_dict(sparse.state_dict())
    x = torch.randn(6, 3, args.hidden_size).to(dtype).to(device)
    grad_out = torch.randn(6, 3, args.hidden_size).to(dtype).to(device)
    for backend in _backends(device):
        s_out, s_x, s_grads, s_calls = run(sparse, x, grad_out, backend)
        g_out, g_x, g_grads, g_calls = run(grouped, x, grad_out, backend)
        assert {"sdd", "dsd"} <= {c.op for c in s_calls} and not {"sdd", "dsd"} & {c.op for c in g_calls}
        t = _tol(backend, dtype, tol)
        assert rel(s_out, g_out) < t and rel(s_x, g_x) < t, backend
        for name, g in s_grads.items():
            assert rel(g, g_grads[name]) < t, (backend, name, rel(g, g_grads[name]))


def _x_without_router_ties(layer, args, shape, dtype, device, gap=0.05):
    """Inputs whose top_k-th and next router logits differ by ``gap`` for every token, so rounding
    in the layer's dtype cannot route a token differently from the float64 reference."""
    w = layer.router.layer.weight.detach().double().cpu()
    gen = torch.Generator().manual_seed(11)
    for _ in range(100):
        x = torch.randn(*shape, generator=gen).to(dtype)
        logits = (x.double().reshape(-1, args.hidden_size) @ w.T).sort(dim=-1, descending=True).values
        if bool((logits[:, args.moe_top_k - 1] - logits[:, args.moe_top_k] > gap).all()):
            return x.to(device)
    raise AssertionError("no input without router ties found")


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_low_precision_parameters_against_the_reference(dtype, tol, device):
    """bf16 parameters (``Arguments(bf16=True)``), and MegaBlocks' default fp16=True. Over ten
    seeds the worst relative error (output or any gradient) was 9.6e-3 (bf16) and 1.3e-3 (fp16)
    with the torch backend; the tolerances leave a factor 3-4."""
    layer, args = make_sparse(device, experts=4, top_k=2, dtype=dtype)
    assert layer.experts.mlp.w1.dtype == dtype
    with torch.no_grad():
        layer.router.layer.weight.normal_(std=0.5)  # logits far apart compared with bf16 rounding
    x = _x_without_router_ties(layer, args, (6, 3, args.hidden_size), dtype, device)
    grad_out = torch.randn(6, 3, args.hidden_size).to(dtype).to(device)
    ref = reference(layer, args, x, grad_out)
    for backend in _backends(device):
        out, xgrad, grads, calls = run(layer, x, grad_out, backend)
        assert {c.backend for c in calls} == {backend}
        _check((out, xgrad, grads), ref, tol, f"{backend} {dtype}")


def test_the_default_arguments_build_a_working_sparse_dmoe(device):
    """``Arguments()`` with only sizes and the device given: mlp_impl="sparse", fp16 parameters."""
    with megablocks_ascend.use_backend("ascend"):
        args = Arguments(hidden_size=32, ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2, device=device)
    assert (args.mlp_impl, args.fp16) == ("sparse", True)
    layer = dMoE(args)
    x = torch.randn(4, 2, 32, device=device).half().requires_grad_()
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        out, bias = layer(x)
        (out + bias).float().square().sum().backward()
    clear_load_balancing_loss()
    assert {c.op for c in calls} == sparse_ops("ascend") and {c.backend for c in calls} == {"ascend"}
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_an_empty_batch(device):
    layer, args = make_sparse(device)
    x = torch.randn(0, 2, args.hidden_size, device=device, requires_grad=True)
    for backend in ("ascend", "torch"):
        with megablocks_ascend.use_backend(backend):
            out, bias = layer(x)
            out.sum().backward()
        clear_load_balancing_loss()
        assert out.shape == (0, 2, args.hidden_size)


def test_sparse_dmoe_trains_on_ascend_kernels(device):
    layer, args = make_sparse(device, experts=4, top_k=2, hidden=16, memory_optimized=True)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    # (MegaBlocks' memory-optimized MLP wants its input to need grad, as it does inside a model)
    x = torch.randn(8, 4, 16, device=device, requires_grad=True)
    target = torch.randn(8, 4, 16, device=device)
    losses = []
    with megablocks_ascend.use_backend("ascend"):
        for _ in range(6):
            out, bias = layer(x)
            loss = torch.nn.functional.mse_loss(out + bias, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            clear_load_balancing_loss()
            losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


def test_a_layer_built_under_ours_and_run_under_cuda_is_guarded_on_every_call(monkeypatch, upstream_kernels,
                                                                              device):
    """Arguments decides once; the dispatcher decides per call. Built while ``ascend`` serves
    stk, run with ``cuda`` (stk's own kernels; on CPU interpreted, by pretending the device
    resolves to cuda): it runs where they are correct and raises where they are not (the limit is
    lowered here so that a small layer crosses it)."""
    from megablocks_ascend import backends
    layer, args = make_sparse(device, hidden=128, experts=2, top_k=1)
    x = torch.randn(16, 2, 128, device=device)
    if device.type == "cpu":
        monkeypatch.setattr(backends, "resolve", lambda d: "cuda")
    with megablocks_ascend.use_backend("cuda"), megablocks_ascend.trace() as calls:
        out, bias = layer(x)
    clear_load_balancing_loss()
    assert {c.backend for c in calls} == {"cuda"} and {"sdd", "dsd"} <= {c.op for c in calls}
    monkeypatch.undo()
    with megablocks_ascend.use_backend("torch"):
        expected, _ = layer(x)
    clear_load_balancing_loss()
    # stk's float32 tl.dot runs in TF32 on CUDA (10 mantissa bits per product), exact elsewhere
    assert rel(out, expected) < (5e-3 if device.type == "cuda" else 1e-5)
    if device.type == "cpu":
        monkeypatch.setattr(backends, "resolve", lambda d: "cuda")
    monkeypatch.setattr(backends, "_INT16_LIMIT", 128)  # now 256 rows already "wrap"
    with megablocks_ascend.use_backend("cuda"), pytest.raises(megablocks_ascend.BackendUnavailable,
                                                               match="stk's own sdd kernel"):
        layer(x)
    clear_load_balancing_loss()


def _compile_step(module, x):
    x = x.clone().requires_grad_()
    out, bias = module(x)
    (out + bias).square().sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    clear_load_balancing_loss()
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("sizes", ["static", "exact"])
@pytest.mark.parametrize("backend", ["ascend", "torch"])
@pytest.mark.parametrize("mlp_type,memory_optimized", [("mlp", False), ("glu", False), ("mlp", True)])
def test_sparse_dmoe_compiles(mlp_type, memory_optimized, backend, sizes, device, monkeypatch):
    """``torch.compile(fullgraph=True)`` of the sparse dMoE, forward and backward, equals eager.
    With static sizes (the default) every shape is known when tracing; with
    ``MEGABLOCKS_ASCEND_SPARSE_SIZES=exact`` padded_gather's row count is data-dependent (an
    unbacked size) and everything after it traces too (see docs/notes/sparse-dmoe.md). The
    memory-optimized MLP cannot be one graph: MegaBlocks' MemoryOptimizedMLP.backward sets
    ``requires_grad`` on a saved tensor, which Dynamo refuses (the grouped one does the same); it
    compiles with a graph break there."""
    if sizes == "exact" and not memory_optimized and _TORCH[:2] == (2, 7):
        pytest.skip("torch 2.7's Dynamo cannot trace the exact-size sparse dMoE as one graph: it refuses "
                    "padded_gather's data-dependent output size (unless capture_dynamic_output_shape_ops "
                    "is set), and then guards on whether an unbacked size is 0; torch 2.13 traces both "
                    "(docs/notes/sparse-dmoe.md)")
    monkeypatch.setenv("MEGABLOCKS_ASCEND_SPARSE_SIZES", sizes)
    layer, args = make_sparse(device, mlp_type=mlp_type, memory_optimized=memory_optimized)
    x = torch.randn(4, 2, args.hidden_size, device=device)
    compiled = torch.compile(layer, fullgraph=not memory_optimized, backend="aot_eager")
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        got = _compile_step(compiled, x)
        want = _compile_step(layer, x)
    assert {c.backend for c in calls} == {backend} and {"sdd", "dsd", "topology"} <= {c.op for c in calls}
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mlp_type,memory_optimized", [("mlp", False), ("glu", False), ("mlp", True)])
def test_sparse_dmoe_under_autocast(mlp_type, memory_optimized, device):
    """float32 parameters under ``torch.autocast(bf16)``: the output within bf16 rounding of the
    float32 layer's, float32 gradients. Needs the stk-autocast-device patch (stk's autograd
    functions would hand ``sdd`` bf16 activations with float32 weights) and custom_fwd's
    ``ctx._dtype`` (the memory-optimized MLP reads it)."""
    layer, args = make_sparse(device, mlp_type=mlp_type, memory_optimized=memory_optimized)
    x = torch.randn(6, 3, args.hidden_size, device=device)
    grad_out = torch.randn(6, 3, args.hidden_size, device=device)
    want = run(layer, x, grad_out, "ascend")
    layer.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    with megablocks_ascend.use_backend("ascend"):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out, bias = layer(xr)
            out = out + bias
        out.float().backward(grad_out)
    clear_load_balancing_loss()
    assert rel(out.float(), want[0]) < 3e-2
    for name, p in layer.named_parameters():
        assert p.grad.dtype == torch.float32 and rel(p.grad, want[2][name]) < 5e-2, name
