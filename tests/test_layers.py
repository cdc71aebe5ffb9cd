"""MegaBlocks' unchanged MoE and dMoE layers through the plugin, against a per-token dense reference.

The reference is written here from the layers' definitions, in float64, one token at a time:
route with a float64 copy of the router, keep the assignments MegaBlocks' capacity rule keeps
(MoE: an expert takes its first ``capacity`` assignments in slot order), run each kept
assignment through its expert's MLP, and sum the weighted results. Outputs and gradients of
the real layer (float32) under ``MEGABLOCKS_BACKEND=ascend`` and ``torch`` must both match it.
"""

import pytest
import torch

import megablocks_ascend
from megablocks.layers.arguments import Arguments
from megablocks.layers.dmoe import dMoE
from megablocks.layers.moe import MoE, clear_load_balancing_loss

GELU = torch.nn.functional.gelu


def make_layer(cls, *, experts, top_k, hidden=32, ffn=48, capacity_factor=1, mlp_type="mlp", bias=True):
    args = Arguments(hidden_size=hidden, ffn_hidden_size=ffn, moe_num_experts=experts, moe_top_k=top_k,
                     moe_capacity_factor=capacity_factor, mlp_impl="grouped", mlp_type=mlp_type,
                     fp16=False, bf16=False, bias=bias, moe_loss_weight=0.0)
    layer = cls(args)
    if bias:
        torch.nn.init.normal_(layer.experts.bias, std=0.1)
    return layer, args


def dense_reference(layer, args, x, *, dropless):
    """Per-token float64 reference for MoE (capacity-limited) and dMoE (dropless)."""
    params = {n: p.detach().double().clone().requires_grad_() for n, p in layer.named_parameters()}
    xd = x.detach().double().clone().requires_grad_()
    tokens = xd.reshape(-1, args.hidden_size)
    scores = (tokens @ params["router.layer.weight"].T).softmax(dim=-1)
    weights, experts = torch.topk(scores, args.moe_top_k, dim=-1)
    num_tokens, k, e_count = tokens.shape[0], args.moe_top_k, args.moe_num_experts

    kept = torch.ones(num_tokens, k, dtype=torch.bool)
    if not dropless:
        capacity = int(args.moe_capacity_factor * k * num_tokens / e_count)
        if capacity == 0:
            capacity = int(torch.bincount(experts.flatten(), minlength=e_count).max())
        seen = [0] * e_count
        for a, e in enumerate(experts.flatten().tolist()):  # slot order = MegaBlocks' stable sort
            kept[a // k, a % k] = seen[e] < capacity
            seen[e] += 1

    def expert_mlp(e, v):
        if not dropless:  # mlp.MLP: w1 [E, hidden, ffn], w2 [E, ffn, hidden]
            return GELU(v @ params["experts.mlp.w1"][e], approximate="tanh") @ params["experts.mlp.w2"][e]
        w1 = params["experts.mlp.w1"].view(e_count, -1, args.hidden_size)[e]
        w2 = params["experts.mlp.w2"].view(e_count, -1, args.hidden_size)[e]
        h = GELU(v @ w1.T, approximate="tanh")
        if args.mlp_type == "glu":
            h = h * (v @ params["experts.mlp.v1"].view(e_count, -1, args.hidden_size)[e].T)
        return h @ w2

    rows = []
    for t in range(num_tokens):
        acc = torch.zeros(args.hidden_size, dtype=torch.float64)
        for s in range(k):
            if kept[t, s]:
                acc = acc + weights[t, s] * expert_mlp(int(experts[t, s]), tokens[t])
        rows.append(acc)
    out = torch.stack(rows).view_as(xd)
    if "experts.bias" in params:
        out = out + params["experts.bias"]
    return out, xd, params, experts, kept


def run_layer(layer, x, backend, grad_out):
    layer.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_()
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        out, bias = layer(xr)
        out = out + bias
        out.backward(grad_out)
    clear_load_balancing_loss()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    return out.detach(), xr.grad.detach(), grads, calls


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30))


CASES = [
    # (layer, experts, top_k, capacity_factor, mlp_type, seq, batch)
    pytest.param(MoE, 4, 1, 1, "mlp", 8, 2, id="moe-top1"),
    pytest.param(MoE, 4, 2, 1, "mlp", 8, 3, id="moe-top2-drops"),
    pytest.param(MoE, 8, 4, 2, "mlp", 6, 2, id="moe-top4-roomy"),
    # 3 tokens over 8 experts: the computed expert capacity int(1 * 3 * 1 / 8) is 0, which MegaBlocks
    # replaces by the largest expert's token count (a host sync; nothing is dropped).
    pytest.param(MoE, 8, 1, 1, "mlp", 3, 1, id="moe-capacity-0"),
    pytest.param(dMoE, 4, 1, 1, "mlp", 8, 2, id="dmoe-top1"),
    pytest.param(dMoE, 6, 2, 1, "mlp", 8, 3, id="dmoe-top2"),
    pytest.param(dMoE, 4, 2, 1, "glu", 5, 3, id="dmoe-glu-top2"),
]


@pytest.mark.parametrize("cls,experts,top_k,cf,mlp_type,seq,batch", CASES)
def test_layer_matches_dense_reference(cls, experts, top_k, cf, mlp_type, seq, batch):
    layer, args = make_layer(cls, experts=experts, top_k=top_k, capacity_factor=cf, mlp_type=mlp_type)
    x = torch.randn(seq, batch, args.hidden_size)
    grad_out = torch.randn(seq, batch, args.hidden_size)
    dropless = cls is dMoE
    ref_out, xd, params, experts_chosen, kept = dense_reference(layer, args, x, dropless=dropless)
    ref_out.backward(grad_out.double())
    if cls is MoE and top_k == 2 and cf == 1:
        assert not bool(kept.all()), "this case is meant to exercise token dropping"

    results = {}
    for backend in ("ascend", "torch"):
        out, xgrad, grads, calls = run_layer(layer, x, backend, grad_out)
        assert {c.backend for c in calls} == {backend}
        expected_ops = {"prepare_routing"} | ({"binned_gather", "binned_scatter", "binned_scatter_wgrad"}
                                              if cls is MoE else {"gather", "scatter", "scatter_wgrad"})
        assert {c.op for c in calls} == expected_ops
        assert rel(out, ref_out) < 1e-5, backend
        assert rel(xgrad, xd.grad) < 1e-5, backend
        for name, g in grads.items():
            assert rel(g, params[name].grad) < 1e-5, (backend, name)
        results[backend] = (out, xgrad, grads)
    # ascend and torch agree with each other far more tightly than with the float64 reference.
    a, t = results["ascend"], results["torch"]
    assert rel(a[0], t[0]) < 1e-6 and rel(a[1], t[1]) < 1e-6


def test_moe_trains_on_ascend_kernels():
    """A few optimizer steps through the Ascend kernels lower a regression loss."""
    layer, args = make_layer(MoE, experts=4, top_k=2, hidden=16, ffn=32)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(8, 4, 16)
    target = torch.randn(8, 4, 16)
    losses = []
    with megablocks_ascend.use_backend("ascend"):
        for _ in range(15):
            out, bias = layer(x)
            loss = torch.nn.functional.mse_loss(out + bias, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            clear_load_balancing_loss()
            losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
