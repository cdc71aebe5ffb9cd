"""Mixed precision: MegaBlocks' layers, our routing ops, the grouped GEMM and stk under torch.autocast.

Every test takes the ``device`` fixture, so ``MEGABLOCKS_ASCEND_TEST_DEVICE=cuda TRITON_INTERPRET=0``
runs this file on CUDA tensors (with the ``cuda`` backend added to the backends compared), except
the few that say why they are CPU-only. The autocast device type is always the tensors' own.

Tolerances. A layer run under autocast is compared with the same layer (same weights, same
tokens) run in float32, on the output and on every gradient, as norm-relative errors. Each value on
the way passes through at most six roundings to the autocast dtype (the cast of the input, of each
weight, each GEMM's output, the activation, the routing scatter), each off by at most ``u`` relative
(``u`` = 2^-8 for bf16, 2^-11 for fp16; the Triton interpreter truncates instead of rounding, up to
2u), so the tolerance is ``6u``: 0.023 for bf16, 0.0029 for fp16. On CPU the largest error seen is
2.3u (the input gradient of the GLU dMoE, bf16, ``ascend``); a missing cast or a wrong gradient is
off by O(1). Tokens are drawn so that no token's top-k choice is within 0.05 of a tie in float32 (a tie
could flip under rounding and route the token elsewhere, which is not an error of precision).
"""

import json
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megablocks
import megablocks_ascend
from megablocks.layers.arguments import Arguments
from megablocks.layers.dmoe import dMoE
from megablocks.layers.moe import MoE, clear_load_balancing_loss
from megablocks_ascend import autocast, backends, patching
from megablocks_ascend.native import grouped_gemm as gg
from megablocks_ascend.patching.autocast_device import AUTOCAST_FUNCTIONS
from megablocks_ascend.patching.stk_autocast_device import STK_AUTOCAST_FUNCTIONS

ROOT = Path(__file__).resolve().parents[1]
AMP = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
TOL = {dtype: 6 * u for dtype, u in UNIT_ROUNDOFF.items()}


def _backends(device):
    return ("ascend", "torch", "cuda") if device.type == "cuda" else ("ascend", "torch")


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# The decorators keep torch.amp.custom_fwd / custom_bwd's contract, for the tensors' device type.


def _recording_function(fwd_decorator, bwd_decorator):
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        @fwd_decorator
        def forward(ctx, x, w, scale):
            dev = x.device.type
            seen["forward"] = dict(x=x.dtype, w=w.dtype, enabled=torch.is_autocast_enabled(dev),
                                   ctx_dtype=ctx._dtype, used=ctx._fwd_used_autocast)
            ctx.save_for_backward(x, w)
            return torch.mm(x, w) * scale

        @staticmethod
        @bwd_decorator
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            dev = grad.device.type
            seen["backward"] = dict(grad=grad.dtype, enabled=torch.is_autocast_enabled(dev),
                                    dtype=torch.get_autocast_dtype(dev))
            return torch.mm(grad, w.t()), torch.mm(x.t(), grad), None

    return Probe, seen


@pytest.mark.parametrize("cast_inputs", ["none", "dtype", "autocast-dtype"])
@pytest.mark.parametrize("amp", [pytest.param(None, id="no-autocast")] + AMP)
def test_custom_fwd_and_custom_bwd_keep_torch_amps_contract(device, cast_inputs, amp):
    """What ``ctx`` holds, what the forward sees and runs under, what the backward runs under, and
    the results: identical to ``torch.amp.custom_fwd(device_type=<the tensors' device type>)``."""
    dt = device.type
    target = {"none": None, "dtype": torch.float16, "autocast-dtype": amp or torch.bfloat16}[cast_inputs]
    ours_cast = True if cast_inputs == "autocast-dtype" else target
    x0 = torch.randn(4, 8, device=device)
    w0 = torch.randn(8, 3, device=device)
    runs = {}
    for name, fwd, bwd in (
            ("torch", torch.amp.custom_fwd(device_type=dt, cast_inputs=target), torch.amp.custom_bwd(device_type=dt)),
            ("ours", autocast.custom_fwd(cast_inputs=ours_cast), autocast.custom_bwd)):
        fn, seen = _recording_function(fwd, bwd)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast(dt, dtype=amp or torch.bfloat16, enabled=amp is not None):
            out = fn.apply(x, w, 2.0)
        out.float().sum().backward()
        runs[name] = (seen, out.dtype, out.detach(), x.grad.dtype, x.grad, w.grad.dtype, w.grad)
    (seen_t, *res_t), (seen_o, *res_o) = runs["torch"], runs["ours"]
    assert seen_o == seen_t
    assert [r.dtype if isinstance(r, torch.Tensor) else r for r in res_o] == \
        [r.dtype if isinstance(r, torch.Tensor) else r for r in res_t]
    for mine, theirs in zip(res_o, res_t):
        if isinstance(mine, torch.Tensor):
            assert torch.equal(mine, theirs)
    if amp is not None and cast_inputs != "none":
        assert seen_o["forward"]["x"] == target and not seen_o["forward"]["enabled"]


def test_custom_fwd_says_so_when_it_has_no_tensor_to_take_the_device_from():
    @autocast.custom_fwd
    def forward(ctx, n):
        return n

    with pytest.raises(TypeError, match="device type"):
        forward(type("Ctx", (), {})(), 3)
    with pytest.raises(TypeError, match="cast_inputs"):
        autocast.custom_fwd(cast_inputs="bf16")


_FAKE_NPU = r"""
import json, sys, types
import torch

# What torch_npu does at import, minus the device: name PrivateUse1 "npu", register its device
# module, and let autocast's dispatch key through (torch_npu registers the casting policy there;
# the decorators only need the autocast state).
torch.utils.rename_privateuse1_backend("npu")
device_module = types.ModuleType("fake_npu")
device_module.is_initialized = lambda: True
device_module.is_available = lambda: False
device_module.current_device = lambda: 0
device_module.device_count = lambda: 1
device_module.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
torch._register_device_module("npu", device_module)
lib = torch.library.Library("_", "IMPL")
lib.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")

import megablocks_ascend
from megablocks.layers import common
from megablocks_ascend import autocast
from megablocks_ascend.native import grouped_gemm as gg
from torch._subclasses.fake_tensor import FakeTensorMode

with FakeTensorMode(allow_non_fake_inputs=True):  # NPU tensors without an NPU: shapes, dtypes and devices only
    x = torch.empty(6, 8, device="npu")
    w = torch.empty(2, 5, 8, device="npu")
    c = torch.empty(6, 5, device="npu", dtype=torch.bfloat16)
sizes = torch.tensor([2, 4])
out = {}

def probe(cast_inputs):
    seen = {}
    def forward(ctx, a, b):
        seen.update(a=str(a.dtype), b=str(b.dtype), npu=torch.is_autocast_enabled("npu"),
                    cpu=torch.is_autocast_enabled("cpu"), ctx=[ctx._autocast_device_type, str(ctx._dtype),
                                                              ctx._fwd_used_autocast])
        return a
    def backward(ctx):
        seen["backward"] = [torch.is_autocast_enabled("npu"), str(torch.get_autocast_dtype("npu")),
                            torch.is_autocast_enabled("cpu")]
    ctx = types.SimpleNamespace()
    # CPU autocast on as well, in another dtype: the decorators must follow the tensors' device.
    with torch.autocast("cpu", dtype=torch.float16), torch.autocast("npu", dtype=torch.bfloat16):
        autocast.custom_fwd(cast_inputs=cast_inputs)(forward)(ctx, x, w)
    autocast.custom_bwd(backward)(ctx)
    return seen

out["cast"] = probe(True)
out["replay"] = probe(None)
with torch.autocast("npu", dtype=torch.bfloat16):
    out["cast_if_autocast_enabled"] = str(common.cast_if_autocast_enabled(x).dtype)
    out["operands"] = [str(t.dtype) for t in gg.entry._autocast_operands(x, w)]
    # What reaches the implementation from ops.gmm (the fake tensors cannot be computed with).
    eager = gg.entry._gmm_eager
    gg.entry._gmm_eager = lambda a, b, *rest: out.setdefault("ops_gmm", [str(a.dtype), str(b.dtype)]) and c
    gg.ops.gmm(x, w, sizes, trans_b=True)
    gg.entry._gmm_eager = eager
    sys.modules["torch_npu"] = types.SimpleNamespace(npu_grouped_matmul=None)
    gg.impls._gmm_npu = lambda a, b, *rest: out.setdefault("npu_branch", [str(a.dtype), str(b.dtype)]) and rest[-1]
    gg.gmm(x, w, sizes, trans_b=True, c=c)
print("RESULT " + json.dumps(out))
"""


def test_npu_device_type_logic_without_an_npu():
    """The decorators, ``cast_if_autocast_enabled`` and the grouped GEMM follow NPU autocast for NPU
    tensors (fake ones: a PrivateUse1 backend named "npu" as torch_npu sets it up, and fake tensors
    on it), not CPU autocast. What this does not show: torch_npu's casting policy, or anything
    computed on an NPU (nothing here has run on one)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _FAKE_NPU], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    cast = out["cast"]
    # cast to NPU autocast's bf16, not CPU autocast's fp16; NPU autocast off inside, CPU's untouched
    # (as torch.amp.custom_fwd(device_type="npu") does)
    assert (cast["a"], cast["b"], cast["npu"], cast["cpu"]) == ("torch.bfloat16", "torch.bfloat16", False, True)
    assert cast["ctx"] == ["npu", "torch.bfloat16", False] and cast["backward"] == [False, "torch.bfloat16", False]
    replay = out["replay"]
    assert (replay["a"], replay["npu"], replay["cpu"]) == ("torch.float32", True, True)
    assert replay["ctx"] == ["npu", "torch.bfloat16", True] and replay["backward"] == [True, "torch.bfloat16", False]
    assert out["cast_if_autocast_enabled"] == "torch.bfloat16"
    assert out["operands"] == ["torch.bfloat16", "torch.bfloat16"]
    assert out["ops_gmm"] == ["torch.bfloat16", "torch.bfloat16"]
    assert out["npu_branch"] == ["torch.bfloat16", "torch.bfloat16"]  # float32 would have gone to the loop


# ---------------------------------------------------------------------------------------------
# The patches.


def test_megablocks_and_stk_autograd_functions_carry_our_decorators():
    import importlib
    for cls_target in AUTOCAST_FUNCTIONS + STK_AUTOCAST_FUNCTIONS:
        module, name = cls_target.split(":")
        cls = getattr(importlib.import_module(module), name)
        fwd, bwd = cls.__dict__["forward"].__func__, cls.__dict__["backward"].__func__
        assert fwd.__code__ is autocast.custom_fwd(lambda: None).__code__, cls_target
        assert bwd.__code__ is autocast.custom_bwd(lambda: None).__code__, cls_target


@pytest.mark.parametrize("patch_name,cls_target", [
    ("autocast-device", "megablocks.layers.mlp:MemoryOptimizedGroupedMLP"),
    ("stk-autocast-device", "stk.backend.sputnik:DSD"),
])
def test_autocast_patches_refuse_a_function_upstream_no_longer_decorates(monkeypatch, patch_name, cls_target):
    import importlib
    module, name = cls_target.split(":")
    cls = getattr(importlib.import_module(module), name)
    patching.uninstall()
    try:
        plain = staticmethod(cls.__dict__["forward"].__func__.__wrapped__)
        monkeypatch.setattr(cls, "forward", plain)
        with pytest.raises(patching.PatchError, match=f"{cls_target}.forward"):
            patching.install()
        assert not patching.installed() and cls.__dict__["forward"] is plain
        # nothing is left half-patched, including the functions the same patch had already redone
        upstream_code = {"autocast-device": torch.amp.custom_fwd(device_type="cuda"),
                         "stk-autocast-device": __import__("stk.backend.autocast").backend.autocast.custom_fwd}
        for other in AUTOCAST_FUNCTIONS + STK_AUTOCAST_FUNCTIONS:
            m, n = other.split(":")
            other_cls = getattr(importlib.import_module(m), n)
            if other_cls is not cls:
                kind = "stk-autocast-device" if other.startswith("stk.") else "autocast-device"
                assert other_cls.__dict__["forward"].__func__.__code__ is \
                    upstream_code[kind](lambda: None).__code__, other
    finally:
        monkeypatch.undo()
        patching.install()
    assert cls.__dict__["forward"].__func__.__code__ is autocast.custom_fwd(lambda: None).__code__


# ---------------------------------------------------------------------------------------------
# The grouped GEMM stand-in under autocast.


def _gmm_inputs(device, trans_a, trans_b, sizes=(3, 0, 5, 4), k=16, n=8):
    t, e = sum(sizes), len(sizes)
    a = torch.randn(t, k, device=device)
    b = torch.randn(t, n, device=device) if trans_a else torch.randn(e, *((n, k) if trans_b else (k, n)), device=device)
    return a, b, torch.tensor(sizes)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("amp", AMP)
def test_backend_gmm_under_autocast_casts_both_operands_like_matmul(device, amp, trans_a, trans_b):
    a, b, sizes = _gmm_inputs(device, trans_a, trans_b)
    a_low = a.to(amp)  # bf16/fp16 activations meet float32 weights, as in dMoE under autocast
    expected = gg.gmm(a_low, b.to(amp), sizes, trans_a=trans_a, trans_b=trans_b)
    with torch.autocast(device.type, dtype=amp):
        out = gg.backend.gmm(a_low, b, sizes, trans_a=trans_a, trans_b=trans_b)
        c = torch.empty_like(expected)
        assert gg.backend.gmm(a, b, sizes, trans_a=trans_a, trans_b=trans_b, c=c) is c
    assert out.dtype == amp and torch.equal(out, expected) and torch.equal(c, expected)
    with pytest.raises(ValueError, match="'b' dtype torch.float32 does not match 'a' dtype"):
        gg.backend.gmm(a_low, b, sizes, trans_a=trans_a, trans_b=trans_b)  # outside autocast: refused


def test_backend_gmm_under_autocast_checks_c_and_leaves_float64_alone(device):
    a, b, sizes = _gmm_inputs(device, False, False)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="'c' dtype torch.float32 does not match 'a' dtype torch.bfloat16"):
            gg.backend.gmm(a, b, sizes, c=torch.empty(a.shape[0], b.shape[2], device=device))
        out = gg.backend.gmm(a.double(), b.double(), sizes)  # float64 is not cast (autocast's rule)
        assert out.dtype == torch.float64


@pytest.mark.parametrize("impl", [gg.IMPL_LOOP, gg.IMPL_GROUPED_MM, gg.IMPL_NPU])
def test_every_implementation_gets_the_cast_operands(monkeypatch, impl):
    """The cast happens before the implementation is chosen, so ``torch._grouped_mm`` and
    ``npu_grouped_matmul`` (neither registered with autocast) see bf16 operands. CPU tensors with
    the choice forced and each implementation replaced by a recorder that runs the loop; the real
    ``torch._grouped_mm`` and NPU branches are tested in test_grouped_gemm.py. (With ``c`` given,
    ``gmm`` runs eagerly, as it does outside torch.compile; only compiled code goes through the
    ``megablocks_ascend::gmm`` custom op.)"""
    seen = []
    loop = gg.impls._gmm_loop

    def recorder(a, b, batch_sizes, sizes, trans_a, trans_b, c):
        seen.append((a.dtype, b.dtype))
        if sizes is None:  # device sizes (CPU operands, CPU sizes): the kernel paths get the tensor
            sizes = [int(n) for n in batch_sizes]
        return loop(a, b, sizes, trans_a, trans_b, c)

    monkeypatch.setattr(gg.choice, "_select_impl", lambda *args, **kwargs: impl)
    monkeypatch.setattr(gg.impls, "_gmm_grouped_mm", recorder)
    monkeypatch.setattr(gg.impls, "_gmm_npu", recorder)
    monkeypatch.setattr(gg.impls, "_gmm_loop", lambda a, b, sizes, trans_a, trans_b, c: recorder(a, b, None, sizes, trans_a,
                                                                                       trans_b, c))
    a, b, sizes = _gmm_inputs(torch.device("cpu"), False, True)
    c = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gg.backend.gmm(a, b, sizes, trans_b=True, c=c)
    assert out is c and seen == [(torch.bfloat16, torch.bfloat16)]
    assert torch.equal(c, loop(a.to(torch.bfloat16), b.to(torch.bfloat16), [int(n) for n in sizes], False, True,
                               torch.empty_like(c)))


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("amp", AMP)
def test_ops_gmm_under_autocast_gives_float32_gradients_and_replays_autocast(device, monkeypatch, amp, trans_b):
    a, b, sizes = _gmm_inputs(device, False, trans_b)
    a32, b32 = a.clone().requires_grad_(), b.clone().requires_grad_()
    grad = torch.randn(a.shape[0], 8, device=device).to(amp)

    # The reference: the same casts written out, outside autocast.
    a_ref, b_ref = a.clone().requires_grad_(), b.clone().requires_grad_()
    expected = gg.ops.gmm(a_ref.to(amp), b_ref.to(amp), sizes, trans_b=trans_b)
    expected.backward(grad)

    states = []
    real = gg.gmm

    def recording_gmm(*args, **kwargs):
        states.append((torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)))
        return real(*args, **kwargs)

    monkeypatch.setattr(gg.entry, "gmm", recording_gmm)  # what GroupedGemm calls
    with torch.autocast(device.type, dtype=amp):
        out = gg.ops.gmm(a32, b32, sizes, trans_b=trans_b)
    forward_states, states[:] = list(states), []
    out.backward(grad)  # outside autocast: the backward must replay the forward's state
    assert out.dtype == amp and torch.equal(out, expected)
    assert a32.grad.dtype == b32.grad.dtype == torch.float32
    assert torch.equal(a32.grad, a_ref.grad) and torch.equal(b32.grad, b_ref.grad)
    assert forward_states == [(True, amp)] and states == [(True, amp)] * 2


# ---------------------------------------------------------------------------------------------
# The routing ops with mixed dtypes, under autocast and without.


def _routing(device, tokens=8, experts=3, top_k=2, hidden=16, capacity=6):
    top = torch.randint(0, experts, (tokens * top_k,), dtype=torch.int32, device=device)
    bin_ids, indices = torch.sort(top, stable=True)
    counts = torch.bincount(top, minlength=experts)
    bins = torch.cumsum(counts, 0).int()
    padded_bins = torch.cumsum((counts + 3) // 4 * 4, 0).int()
    return dict(indices=indices.int(), bin_ids=bin_ids.int(), bins=bins, padded_bins=padded_bins,
                top_k=top_k, capacity=capacity, tokens=tokens, hidden=hidden, experts=experts)


def _x_for(op, r, device):
    n, h = r["tokens"] * r["top_k"], r["hidden"]
    rows = {"binned_scatter": (r["experts"], r["capacity"], h), "scatter": (n, h),
            "padded_scatter": (int(r["padded_bins"][-1]), h)}
    return torch.randn(*rows.get(op, (r["tokens"], h)), device=device)


def _call(op, x, weights, r):
    i, b, bins, pb, k = r["indices"], r["bin_ids"], r["bins"], r["padded_bins"], r["top_k"]
    return {
        "binned_gather": lambda: megablocks.ops.binned_gather(x, i, bins, r["capacity"], k),
        "binned_scatter": lambda: megablocks.ops.binned_scatter(x, i, weights, bins, k),
        "gather": lambda: megablocks.ops.gather(x, i, b, bins, k),
        "scatter": lambda: megablocks.ops.scatter(x, i, b, weights, bins, k),
        "padded_gather": lambda: megablocks.ops.padded_gather(x, i, b, bins, pb, k),
        "padded_scatter": lambda: megablocks.ops.padded_scatter(x, i, b, weights, bins, pb, k),
    }[op]()


ROUTING_OPS = ["binned_gather", "binned_scatter", "gather", "scatter", "padded_gather", "padded_scatter"]
WEIGHTED = {"binned_scatter", "scatter", "padded_scatter"}


def _run_op(op, backend, x, weights, r, grad=None, amp=None):
    x = x.detach().clone().requires_grad_()
    w = weights.detach().clone().requires_grad_() if op in WEIGHTED else None
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        with torch.autocast(x.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            out = _call(op, x, w, r)
        grad = torch.randn_like(out) if grad is None else grad
        out.backward(grad)
    assert calls and {c.backend for c in calls} == {backend}
    return out.detach(), x.grad, (w.grad if w is not None else None), grad


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("op", ROUTING_OPS)
def test_routing_op_under_autocast_is_the_op_on_inputs_cast_to_the_autocast_dtype(device, op, amp, top_k):
    """Under autocast: x and the router weights are cast to the autocast dtype, the kernels run on
    that (upstream MegaBlocks' rule on CUDA, via stk's custom_fwd), and the gradients come back in
    the inputs' own dtypes. Bit for bit the op called on explicitly cast inputs."""
    r = _routing(device, top_k=top_k)
    x, weights = _x_for(op, r, device), torch.rand(r["tokens"] * r["top_k"], device=device)
    for backend in _backends(device):
        out, xg, wg, grad = _run_op(op, backend, x, weights, r, amp=amp)
        ref_out, ref_xg, ref_wg, _ = _run_op(op, backend, x.to(amp), weights.to(amp), r, grad=grad)
        assert out.dtype == amp and torch.equal(out, ref_out), backend
        assert xg.dtype == torch.float32 and torch.equal(xg, ref_xg.float()), backend
        if op in WEIGHTED:
            assert wg.dtype == torch.float32 and torch.equal(wg, ref_wg.float()), backend


_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def _ulp(t, dtype):
    """One unit in the last place of each element of ``t`` in ``dtype``."""
    exponent = torch.floor(torch.log2(t.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - _MANTISSA_BITS[dtype])


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("op", sorted(WEIGHTED))
def test_weighted_routing_op_with_bf16_activations_and_float32_weights(device, op, top_k):
    """Without autocast, the dtypes are not unified: the output and x's gradient have x's dtype,
    the float32 weights are used as they are (products and the top_k sum in float32, rounded once
    to x's dtype), and the weights' gradient, computed in float32 and stored in x's dtype like
    upstream's kernels do, reaches the float32 weights as float32."""
    r = _routing(device, top_k=top_k)
    x = _x_for(op, r, device).to(torch.bfloat16)
    weights = torch.rand(r["tokens"] * r["top_k"], device=device)
    for backend in _backends(device):
        out, xg, wg, grad = _run_op(op, backend, x, weights, r)
        assert out.dtype == xg.dtype == torch.bfloat16 and wg.dtype == torch.float32, backend
        ref, slots = _float64_weighted(op, x, weights, r)
        err = (out.double().cpu() - ref).abs()
        # Ours and the torch backend: one rounding (CUDA, torch) or one truncation (the interpreter)
        # to bf16, plus float32 sums. Upstream's kernels (cuda) also round each slot's weighted row
        # to bf16 before the top_k sum: half a unit of each slot's value more.
        bound = _ulp(ref, torch.bfloat16) + 1e-6 * ref.abs().max()
        if backend == "cuda":
            bound = bound + sum(_ulp(v, torch.bfloat16) / 2 for v in slots)
        assert bool((err <= bound).all()), backend
        pre_rounded, *_ = _run_op(op, backend, x, weights.to(torch.bfloat16), r, grad=grad)
        assert not torch.equal(out, pre_rounded), f"{backend}: the weights were rounded to bf16"


def _float64_weighted(op, x, weights, r):
    """The weighted scatter in float64, from its definition, one sorted position at a time: the
    assignment slot at position p of expert e sits on row (start of e's segment) + (p - bins[e-1])
    of x, unless that is past the segment (binned: the capacity), and token t's output is the sum
    of weights[slot] * row over its top_k slots. Also each slot's term, slot by slot."""
    indices, bins = r["indices"].tolist(), r["bins"].tolist()
    padded, k, cap = r["padded_bins"].tolist(), r["top_k"], r["capacity"]
    y = x.double().cpu().reshape(-1, x.shape[-1])
    w = weights.double().cpu()
    terms = torch.zeros(k, r["tokens"], x.shape[-1], dtype=torch.float64)
    for p, slot in enumerate(indices):
        e = next(j for j, end in enumerate(bins) if p < end)
        offset = p - (bins[e - 1] if e else 0)
        if op == "binned_scatter":
            if offset >= cap:
                continue  # dropped
            row = e * cap + offset
        elif op == "padded_scatter":
            row = (padded[e - 1] if e else 0) + offset
        else:
            row = p
        terms[slot % k, slot // k] = w[slot] * y[row]
    return terms.sum(dim=0), list(terms)


# ---------------------------------------------------------------------------------------------
# stk's block-sparse matmuls (the sparse dMoE's) under autocast.


def _dense_blocks(shape, data, row_indices, column_indices):
    block = data.shape[-1]
    dense = torch.zeros(shape, dtype=data.dtype, device=data.device)
    for d, r, c in zip(data, row_indices.tolist(), column_indices.tolist()):
        dense[r * block:(r + 1) * block, c * block:(c + 1) * block] = d
    return dense


def _same_dtype(*tensors):
    assert len({t.dtype for t in tensors}) == 1, f"stk kernel given mixed dtypes {[t.dtype for t in tensors]}"


class _DenseStkKernels:
    """stk.backend.triton_kernels' sdd/dsd/dds emulated densely (float32 accumulation, the
    output's dtype), refusing mixed operand dtypes as the real kernels cannot handle them."""

    @staticmethod
    def sdd(lhs, rhs, shape, out, offsets, row_indices, column_indices):
        _same_dtype(lhs, rhs, out)
        full = (lhs.float() @ rhs.float()).to(out.dtype)
        block = out.shape[-1]
        for i, (r, c) in enumerate(zip(row_indices.tolist(), column_indices.tolist())):
            out[i] = full[r * block:(r + 1) * block, c * block:(c + 1) * block]

    @staticmethod
    def dsd(shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t,
            block_offsets_t, transpose_a, rhs, out):
        _same_dtype(data, rhs, out)
        a = _dense_blocks(shape if not transpose_a else (shape[1], shape[0]), data, row_indices, column_indices)
        out.copy_(((a.t() if transpose_a else a).float() @ rhs.float()).to(out.dtype))

    @staticmethod
    def dds(lhs, shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t,
            block_offsets_t, transpose_b, out):
        _same_dtype(lhs, data, out)
        b = _dense_blocks(shape if not transpose_b else (shape[1], shape[0]), data, row_indices, column_indices)
        out.copy_((lhs.float() @ (b.t() if transpose_b else b).float()).to(out.dtype))


@pytest.mark.parametrize("amp", AMP)
def test_stk_block_sparse_matmuls_under_autocast(device, monkeypatch, amp):
    """sdd, dsd and dds on a 2x2-block topology, with float32 operands cast as MegaBlocks' sparse
    MLP does (activations cast before, weights by stk's decorators): outputs in the autocast
    dtype, float32 gradients, within 6u of float64. stk's own Triton kernels do the arithmetic,
    except for bf16 in the Triton interpreter, whose ``tl.dot`` multiplies bf16 bit patterns
    (triton-lang/triton#11584): there a dense emulation of them, which also refuses mixed dtypes."""
    import stk
    import stk.backend.triton_kernels
    import stk.ops

    if amp is torch.bfloat16 and device.type == "cpu":
        for name in ("sdd", "dsd", "dds"):
            monkeypatch.setattr(stk.backend.triton_kernels, name, getattr(_DenseStkKernels, name))
    block = 128  # stk's only block size
    keep = torch.tensor([[1, 0], [1, 1]], device=device)
    mask = keep.repeat_interleave(block, 0).repeat_interleave(block, 1).double()
    topo = stk.ops.to_sparse(torch.ones(2 * block, 2 * block, device=device) * mask.float(), block)
    leaves = {"x": (2 * block, block), "w": (2 * block, block), "v": (2 * block, block), "u": (block, 2 * block)}
    leaves = {k: torch.randn(*shape, device=device).requires_grad_() for k, shape in leaves.items()}
    gy, gz = torch.randn(2 * block, block, device=device), torch.randn(block, 2 * block, device=device)
    x, w, v, u = leaves.values()

    with torch.autocast(device.type, dtype=amp):
        s = stk.ops.sdd(x.to(amp), w.t(), topo)  # (x @ w.T) on the topology, w transposed as MegaBlocks'
        y = stk.ops.dsd(s, v)                    # sparse @ dense
        z = stk.ops.dds(u, s)                    # dense @ sparse
    assert (s.data.dtype, y.dtype, z.dtype) == (amp, amp, amp)
    ((y.float() * gy).sum() + (z.float() * gz).sum()).backward()

    ref = {k: t.detach().double().requires_grad_() for k, t in leaves.items()}
    s64 = (ref["x"] @ ref["w"].t()) * mask
    y64, z64 = s64 @ ref["v"], ref["u"] @ s64
    ((y64 * gy.double()).sum() + (z64 * gz.double()).sum()).backward()
    assert _rel(stk.ops.to_dense(s), s64) < TOL[amp]
    assert _rel(y, y64) < TOL[amp] and _rel(z, z64) < TOL[amp]
    for name, leaf in leaves.items():
        assert leaf.grad.dtype == torch.float32, name
        assert _rel(leaf.grad, ref[name].grad) < TOL[amp], name


# ---------------------------------------------------------------------------------------------
# MegaBlocks' layers under autocast against the same layers in float32.


H, FFN, EXPERTS, TOP_K = 32, 64, 4, 2
PATHS = {
    "moe": (MoE, "mlp", False),
    "dmoe-mlp": (dMoE, "mlp", False),
    "dmoe-mlp-memopt": (dMoE, "mlp", True),
    "dmoe-glu": (dMoE, "glu", False),
    "dmoe-glu-memopt": (dMoE, "glu", True),
}


def _layer(path, device, dtype=None):
    cls, mlp_type, memory_optimized = PATHS[path]
    # Weights scaled so that every activation is O(1) (MegaBlocks' std 0.02 would leave the
    # expert outputs far below the bias and the comparison blind).
    args = Arguments(hidden_size=H, ffn_hidden_size=FFN, moe_num_experts=EXPERTS, moe_top_k=TOP_K,
                     moe_capacity_factor=EXPERTS, mlp_impl="grouped", mlp_type=mlp_type,
                     memory_optimized_mlp=memory_optimized, fp16=dtype is torch.float16,
                     bf16=dtype is torch.bfloat16, moe_loss_weight=0.0, device=device,
                     init_method=partial(torch.nn.init.normal_, mean=0.0, std=H ** -0.5),
                     output_layer_init_method=partial(torch.nn.init.normal_, mean=0.0, std=FFN ** -0.5))
    return cls(args)


def _clear_tokens(layer, n, margin=0.05):
    """``n`` tokens whose top-k experts (and their order) are at least ``margin`` from a tie."""
    w = layer.router.layer.weight.detach().float().cpu()
    kept = []
    while len(kept) < n:
        x = torch.randn(4 * n, H)
        s = (x @ w.t()).sort(dim=-1, descending=True).values
        gaps = (s[:, :TOP_K] - s[:, 1:TOP_K + 1]).min(dim=-1).values
        kept.extend(x[gaps > margin])
    return torch.stack(kept[:n]).view(n // 2, 2, H)


class _MatmulDtypes(TorchDispatchMode):
    """The floating-point operand dtypes of every matmul that runs (grouped ones included)."""

    NAMES = {"mm", "bmm", "addmm", "baddbmm", "_grouped_mm", "gmm"}

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.NAMES:
            flat = torch.utils._pytree.tree_leaves((args, kwargs))
            self.seen |= {t.dtype for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()}
        return func(*args, **(kwargs or {}))


def _run_layer(layer, x, grad, backend, monkeypatch, amp=None, scaler=None):
    """One forward (under autocast when ``amp``) and backward; what ran in which dtype."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    routed = {"forward": set(), "backward": set()}
    phase = ["forward"]
    real = backends._implementation

    def recording(name, backend_name):
        fn = real(name, backend_name)

        def call(*args):  # (the dispatchers pass MegaBlocks' arguments in order: x first)
            routed[phase[0]].add(args[0].dtype)
            return fn(*args)
        return call

    monkeypatch.setattr(backends, "_implementation", recording)
    fwd, bwd = _MatmulDtypes(), _MatmulDtypes()
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        with torch.autocast(x.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None), fwd:
            out, bias = layer(x)
            loss = ((out + bias).float() * grad).sum()
        phase[0] = "backward"
        with bwd:
            (scaler.scale(loss) if scaler else loss).backward()
    monkeypatch.undo()
    clear_load_balancing_loss()
    assert calls and {c.backend for c in calls} == {backend}
    unscale = float(scaler.get_scale()) if scaler else 1.0
    grads = {"x": x.grad / unscale} | {n: p.grad / unscale for n, p in layer.named_parameters()}
    return out.detach(), grads, dict(matmul_forward=fwd.seen, matmul_backward=bwd.seen,
                                     routed_forward=routed["forward"], routed_backward=routed["backward"])


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("path", list(PATHS))
def test_layer_under_autocast_matches_float32(device, monkeypatch, path, amp):
    """Float32 layer, forward under autocast (fp16 with a GradScaler's loss scale): the output and
    every gradient within 6u of the float32 run, the gradients float32, and every matmul and
    routing kernel ran in the autocast dtype, backward included (MegaBlocks casts the tokens at
    the layer's entry, before routing)."""
    torch.manual_seed(0)
    layer = _layer(path, device)
    x = _clear_tokens(layer, 16).to(device)
    grad = torch.randn(x.shape, device=device)
    for backend in _backends(device):
        ref_out, ref_grads, ref_ran = _run_layer(layer, x, grad, backend, monkeypatch)
        assert ref_ran["matmul_forward"] == {torch.float32}  # the reference really is float32
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10) if amp is torch.float16 else None
        out, grads, ran = _run_layer(layer, x, grad, backend, monkeypatch, amp=amp, scaler=scaler)
        assert out.dtype == amp
        assert ran == dict(matmul_forward={amp}, matmul_backward={amp}, routed_forward={amp},
                           routed_backward={amp}), backend
        assert _rel(out, ref_out) < TOL[amp], backend
        for name, g in grads.items():
            assert g.dtype == torch.float32, (backend, name)
            assert torch.isfinite(g).all(), (backend, name)
            assert _rel(g, ref_grads[name]) < TOL[amp], (backend, name, _rel(g, ref_grads[name]))


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("path", list(PATHS))
def test_training_steps_under_autocast(device, path, amp):
    """A few optimizer steps, float32 parameters, forward under autocast; fp16 with
    torch.amp.GradScaler: the loss falls, nothing becomes inf or NaN, the parameters stay float32.
    Our kernels (and upstream's on CUDA); the torch backend is compared step by step above."""
    for backend in [b for b in _backends(device) if b != "torch"]:
        torch.manual_seed(0)
        layer = _layer(path, device)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)
        # MegaBlocks' memory-optimized MLPs insist that their input needs a gradient, as it does
        # anywhere but in the first layer.
        x = torch.randn(8, 2, H, device=device, requires_grad=True)
        target = torch.randn(8, 2, H, device=device)
        losses, skipped = [], 0
        with megablocks_ascend.use_backend(backend):
            for _ in range(6):
                with torch.autocast(device.type, dtype=amp):
                    out, bias = layer(x)
                    loss = ((out + bias).float() - target).square().mean()
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scale = scaler.get_scale() if scaler.is_enabled() else 1.0
                scaler.step(opt)
                scaler.update()
                skipped += scaler.is_enabled() and scaler.get_scale() < scale
                losses.append(loss.item())
                clear_load_balancing_loss()
        assert all(torch.isfinite(torch.tensor(losses))), (backend, losses)
        assert losses[-1] < losses[0], (backend, losses)
        assert skipped <= 1, (backend, skipped)  # the loss scale settles at once
        for name, p in layer.named_parameters():
            assert p.dtype == torch.float32 and torch.isfinite(p).all(), (backend, name)


@pytest.mark.parametrize("path", ["moe", "dmoe-mlp", "dmoe-glu"])
def test_layer_under_autocast_compiles_as_one_graph(device, path):
    """``torch.compile(fullgraph=True)`` of the layer, forward under autocast and backward, matches
    eager under autocast. (The memory-optimized MLPs do not compile with fullgraph=True, autocast or
    not: their backward sets ``requires_grad`` on a tensor, which Dynamo refuses.)"""
    torch.manual_seed(0)
    layer = _layer(path, device)
    x = _clear_tokens(layer, 8).to(device)

    def step(module):
        inp = x.clone().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out, bias = module(inp)
        (out + bias).float().square().sum().backward()
        grads = [p.grad.clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return out.detach(), inp.grad, grads

    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        compiled = step(torch.compile(layer, fullgraph=True, backend="aot_eager"))
        eager = step(layer)
    clear_load_balancing_loss()
    assert {c.backend for c in calls} == {"ascend"}
    assert compiled[0].dtype == torch.bfloat16 and {g.dtype for g in compiled[2]} == {torch.float32}
    torch.testing.assert_close(compiled, eager)
