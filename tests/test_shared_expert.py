"""MegaBlocks' shared expert on its defaults (patch shared-expert-bias).

Each layer is checked, output and gradients, against a per-token float64 reference built from the
layer's own weights: route each token to its top-k experts by the router's softmax, run each of
those experts' MLP on it, sum with the routing weights, add the experts' bias and combine with the
shared expert's MLP (plain sum, or MegaBlocks' weighted sum ``shared / (k+1) + experts * k/(k+1)``).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import megablocks_ascend
from megablocks.layers.arguments import Arguments
from megablocks.layers.dmoe import dMoE
from megablocks.layers.moe import MoE, clear_load_balancing_loss
from megablocks_ascend import patching

LAYERS = {"MoE": (MoE, "sparse"), "dMoE-grouped": (dMoE, "grouped"), "dMoE-sparse": (dMoE, "sparse")}
E, K, H, FFN, SHARED = 4, 2, 16, 128, 24  # the sparse dMoE needs FFN to be a multiple of 128


def make(layer, mlp_type, weighted, return_bias):
    cls, impl = LAYERS[layer]
    args = Arguments(hidden_size=H, ffn_hidden_size=FFN, moe_num_experts=E, moe_top_k=K,
                     mlp_impl=impl, mlp_type=mlp_type, fp16=False, bf16=False, moe_loss_weight=0.0,
                     moe_capacity_factor=E,  # MoE: room for every token, so none is dropped
                     shared_expert=True, shared_expert_hidden_size=SHARED,
                     shared_expert_weighted_sum=weighted, return_bias=return_bias)
    return cls(args)


def expert_fn(layer, params):
    """expert e's MLP on rows ``x``, in the layout of ``layer``'s expert weights."""
    mlp = layer.experts.mlp
    act = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731  (Arguments' default activation_fn)
    if isinstance(layer, MoE) and not isinstance(layer, dMoE):  # mlp.MLP: w1 [E, H, F], w2 [E, F, H]
        w1, w2 = params["experts.mlp.w1"], params["experts.mlp.w2"]
        return lambda e, x: act(x @ w1[e]) @ w2[e]
    rows = lambda name, e: params[name][e * FFN:(e + 1) * FFN]  # noqa: E731  ([E*F, H], expert-major)
    if hasattr(mlp, "v1"):  # GLU
        return lambda e, x: (act(x @ rows("experts.mlp.w1", e).T) * (x @ rows("experts.mlp.v1", e).T)) \
            @ rows("experts.mlp.w2", e)
    return lambda e, x: act(x @ rows("experts.mlp.w1", e).T) @ rows("experts.mlp.w2", e)


def reference(layer, x, params):
    """The layer's output for ``x`` (as return_bias=False gives it), token by token, in float64."""
    args = layer.experts.args
    tokens = x.reshape(-1, H)
    scores = (tokens @ params["router.layer.weight"].T).softmax(dim=-1)
    weights, experts = torch.topk(scores, K, dim=-1)
    expert = expert_fn(layer, params)
    routed = torch.stack([
        sum(weights[t, j] * expert(int(experts[t, j]), tokens[t:t + 1])[0] for j in range(K))
        for t in range(tokens.shape[0])])
    routed = routed + params["experts.bias"]
    sh = layer.shared_expert
    up = tokens @ params["shared_expert.up_proj.weight"].T + params["shared_expert.up_proj.bias"]
    act = F.gelu(up, approximate="tanh")
    if hasattr(sh, "gate_proj"):
        gate = tokens @ params["shared_expert.gate_proj.weight"].T + params["shared_expert.gate_proj.bias"]
        act = F.gelu(gate, approximate="tanh") * up
    shared = act @ params["shared_expert.down_proj.weight"].T + params["shared_expert.down_proj.bias"]
    if args.shared_expert_weighted_sum:
        out = shared / (K + 1) + routed * (K / (K + 1))
    else:
        out = shared + routed
    return out.reshape(x.shape)


@pytest.mark.parametrize("layer,mlp_type,weighted,return_bias", [
    (layer, mlp_type, weighted, return_bias)
    for layer, mlp_type, weighted, return_bias in itertools.product(LAYERS, ("mlp", "glu"), (False, True), (True, False))
    if not (layer == "MoE" and mlp_type == "glu")  # MoE's experts are MLPs whatever mlp_type says
])
def test_shared_expert_output_and_gradients_match_a_per_token_float64_reference(layer, mlp_type, weighted,
                                                                                  return_bias):
    torch.manual_seed(0)
    moe = make(layer, mlp_type, weighted, return_bias)
    x = torch.randn(5, 2, H, requires_grad=True)
    result = moe(x)
    clear_load_balancing_loss()
    if return_bias:
        assert isinstance(result, tuple) and len(result) == 2
        out, bias = result
        assert bias.shape == (H,)
        total = out + bias
    else:
        assert isinstance(result, torch.Tensor)
        total = result
    seed = torch.randn_like(total)
    (total * seed).sum().backward()

    params64 = {n: p.detach().double().requires_grad_() for n, p in moe.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    expected = reference(moe, x64, params64)
    (expected * seed.double()).sum().backward()

    torch.testing.assert_close(total.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    for name, p in moe.named_parameters():
        torch.testing.assert_close(p.grad.double(), params64[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_routed_through_our_kernels_too():
    """The patch is independent of who routes: the same check with the routing on our kernels."""
    torch.manual_seed(1)
    moe = make("dMoE-grouped", "glu", True, True)
    x = torch.randn(5, 2, H)
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        out, bias = moe(x)
    clear_load_balancing_loss()
    assert {c.backend for c in calls} == {"ascend"}
    params64 = {n: p.detach().double() for n, p in moe.named_parameters()}
    torch.testing.assert_close((out + bias).double(), reference(moe, x.double(), params64), rtol=1e-5, atol=1e-6)


def test_without_the_patch_upstream_crashes_on_its_defaults():
    """What the patch fixes (and a check that the test above would see it)."""
    patch = next(p for p in patching.PATCHES if p.name == "shared-expert-bias")
    moe = make("dMoE-grouped", "mlp", False, True)
    try:
        patch.revert()
        with pytest.raises(TypeError, match="unsupported operand type"):
            moe(torch.randn(3, 2, H))
    finally:
        clear_load_balancing_loss()
        patch.apply(patch)
        patch.applied = True


def test_the_patch_refuses_a_changed_upstream_body(monkeypatch):
    from megablocks.layers import mlp
    from megablocks_ascend.patching import shared_expert_bias

    patch = next(p for p in patching.PATCHES if p.name == "shared-expert-bias")
    patch.revert()
    try:
        def changed(self, shared_expert_out, expert_out):
            return shared_expert_out - expert_out
        monkeypatch.setattr(mlp.SharedMLP, "add_experts_sharedexpert", changed)
        with pytest.raises(patching.PatchError, match="add_experts_sharedexpert"):
            shared_expert_bias.apply(patch)
        assert mlp.SharedMLP.add_experts_sharedexpert is changed
    finally:
        monkeypatch.undo()
        patch.apply(patch)
        patch.applied = True
