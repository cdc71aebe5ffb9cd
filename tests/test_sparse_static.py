"""The sparse dMoE (``mlp_impl="sparse"``) at static sizes: no host sync, the same results as at
upstream's exact sizes, a bound that holds for any routing, and the switch back
(``MEGABLOCKS_ASCEND_SPARSE_SIZES=exact``) with its capture error.

The host-sync check is ``HostSyncs``' (``megablocks_ascend/bench/instruments.py``: every read of
device values into Python, every cross-device copy, every data-dependent-size op, in MegaBlocks'
code and ours; on CPU, CPU tensors count as device tensors). Graph capture itself needs CUDA: ``tests/test_host_sync.py`` captures the
sparse step there, and BENCHMARKS.md has the H200's runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import megablocks_ascend
from graph_capture import capture_step
from megablocks_ascend import backends, envs, keeping, ops
from megablocks_ascend.bench.instruments import HostSyncs
from megablocks_ascend.kernels import routing
from megablocks_ascend.patching import registry, sparse_static_sizes
from megablocks_ascend.validation import RoutingArgumentError

H, FFN, E, TOP_K = 16, 256, 4, 2
BLOCK = 128  # MegaBlocks' block size

LAYERS = {
    "mlp": dict(),
    "glu": dict(mlp_type="glu"),
    "mlp-memopt": dict(memory_optimized_mlp=True),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _layer(name, dtype, device, experts=E, top_k=TOP_K, **extra):
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE
    with megablocks_ascend.use_backend("ascend"):  # (under auto on CUDA, MegaBlocks' refusal stays)
        args = Arguments(hidden_size=H, ffn_hidden_size=FFN, moe_num_experts=experts, moe_top_k=top_k,
                         bf16=dtype == torch.bfloat16, fp16=False, device=device, **LAYERS[name], **extra)
    assert args.mlp_impl == "sparse"  # MegaBlocks' default
    torch.manual_seed(0)
    return dMoE(args), args


def _step(layer, args, x):
    from megablocks.layers.moe import batched_load_balancing_loss, clear_load_balancing_loss
    out, _ = layer(x)
    (out.float().pow(2).mean() + batched_load_balancing_loss(args)).backward()
    clear_load_balancing_loss()
    return out


def _results(layer, args, x_value, backend):
    layer.zero_grad(set_to_none=True)
    x = x_value.clone().requires_grad_()
    with megablocks_ascend.use_backend(backend):
        out = _step(layer, args, x)
    return [out.detach()] + [x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]


def _input(dtype, device, tokens=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 2, H, generator=g).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------
# No host sync


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", ["ascend", "torch"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_sparse_step_has_no_host_sync(name, backend, dtype, device):
    """Forward and backward of the sparse dMoE with MegaBlocks' load-balancing loss read nothing
    on the host: not ``padded_bins[-1]`` (the padded buffer and the topology are sized statically),
    not in the topology's transpose (built in one launch)."""
    dtype = DTYPES[dtype]
    layer, args = _layer(name, dtype, device)
    x = _input(dtype, device).requires_grad_()
    with megablocks_ascend.use_backend(backend):
        _step(layer, args, x)  # first call: lazy set-up (kernel compiles) is not a step's work
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with HostSyncs(cpu_is_device=device.type == "cpu") as syncs, megablocks_ascend.trace() as calls:
            _step(layer, args, x)
    assert not syncs.events, syncs.report()
    assert {"topology", "padded_gather", "sdd", "dsd"} <= {c.op for c in calls}


def test_exact_sizes_sync_where_upstream_does(device, monkeypatch):
    """``MEGABLOCKS_ASCEND_SPARSE_SIZES=exact``: the padded buffer is ``padded_bins[-1]`` rows, read
    on the host once per step, in the forward's padded_gather (the backward sizes the gradient from
    its input: no second read, where upstream reads it again)."""
    monkeypatch.setenv(envs.SPARSE_SIZES_VAR, "exact")
    layer, args = _layer("mlp", torch.float32, device)
    x = _input(torch.float32, device).requires_grad_()
    with megablocks_ascend.use_backend("ascend"):
        _step(layer, args, x)
        with HostSyncs(cpu_is_device=device.type == "cpu") as syncs:
            _step(layer, args, x)
    reads = [e for e in syncs.events if e.kind == "Tensor.item"]
    assert len(reads) == 1 and "in padded_gather" in reads[0].where, syncs.report()


# ------------------------------------------------------------------------------------------
# Results


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", ["ascend", "torch"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_static_sizes_give_exact_sizes_results(name, backend, dtype, device, monkeypatch):
    """Output and every gradient bit for bit equal at static and at exact sizes: the spare rows and
    blocks change no product (none is computed for them, and none of them is read)."""
    dtype = DTYPES[dtype]
    x = _input(dtype, device)
    runs = {}
    for sizes in ("static", "exact"):
        monkeypatch.setenv(envs.SPARSE_SIZES_VAR, sizes)
        layer, args = _layer(name, dtype, device)
        runs[sizes] = _results(layer, args, x, backend)
    for i, (a, b) in enumerate(zip(runs["static"], runs["exact"])):
        assert a.dtype == b.dtype, i
        if device.type == "cuda" and ("memopt" in name or backend == "torch"):
            # Not bit for bit on CUDA (seen on an H200): the memory-optimized backward's
            # torch.jit-scripted gelu_backward_ is fused per shape, and the torch backend's index_add_
            # accumulates with atomics; the block-sparse and routing kernels themselves are exact.
            err = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
            assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (i, err)
        else:
            assert torch.equal(a, b), (i, (a.double() - b.double()).abs().max())


@pytest.mark.parametrize("top_k,experts,tokens", [(1, 4, 8), (4, 8, 5), (8, 8, 3)])
def test_static_sizes_across_routings(top_k, experts, tokens, device, monkeypatch):
    """Few tokens and many experts (most experts empty, most rows spare), and top_k 1."""
    x = _input(torch.float32, device, tokens=tokens)
    runs = {}
    for sizes in ("static", "exact"):
        monkeypatch.setenv(envs.SPARSE_SIZES_VAR, sizes)
        layer, args = _layer("mlp", torch.float32, device, experts=experts, top_k=top_k)
        runs[sizes] = _results(layer, args, x, "ascend")
    for a, b in zip(runs["static"], runs["exact"]):
        assert torch.equal(a, b)


def test_buffer_rows_are_the_bound_and_the_spare_rows_zero(device, poison_empty):
    """The padded buffer has :func:`ops.padded_rows` rows, those past ``padded_bins[-1]`` zero (the
    kernel writes them: the allocation is poisoned), and its gradient has the same rows."""
    poison_empty(routing)
    layer, args = _layer("mlp", torch.float32, device)
    seen = {}
    real = ops.padded_gather

    def spy(x, indices, bin_ids, bins, padded_bins, top_k, num_rows=None):
        out = real(x, indices, bin_ids, bins, padded_bins, top_k, num_rows)
        out.register_hook(lambda g: seen.__setitem__("grad_rows", g.shape[0]))
        seen.update(out=out.detach().clone(), live=int(padded_bins[-1]), n=indices.shape[0])
        return out

    x = _input(torch.float32, device).requires_grad_()
    with megablocks_ascend.use_backend("ascend"):
        ops.padded_gather = spy
        try:
            _step(layer, args, x)
        finally:
            ops.padded_gather = real
    rows = ops.padded_rows(seen["n"], E, BLOCK)
    assert seen["out"].shape[0] == rows == seen["grad_rows"]
    assert rows - seen["live"] <= min(E, seen["n"]) * (BLOCK - 1)
    assert torch.equal(seen["out"][seen["live"]:], torch.zeros_like(seen["out"][seen["live"]:]))


# ------------------------------------------------------------------------------------------
# The bound


@pytest.mark.parametrize("block", [1, 2, 4, 128])
def test_padded_rows_holds_every_routing_and_is_reached(block):
    """Over every split of ``n`` assignments among ``experts`` (small cases, exhaustively), the
    padded layout's rows never exceed the bound, and some split reaches it."""
    for experts, n in itertools.product(range(1, 5), range(0, 9)):
        bound = ops.padded_rows(n, experts, block)
        most = 0
        for split in itertools.product(range(n + 1), repeat=experts):
            if sum(split) == n:
                most = max(most, sum(-(-c // block) * block for c in split))
        assert most == bound, (experts, n, block, most, bound)
    assert ops.padded_rows(8192 * 8, 128, 128) == 8192 * 8 + 128 * 127 // 128 * 128


@pytest.mark.parametrize("args,match", [((-1, 4, 128), "assignments"), ((8, 0, 128), "experts"),
                                        ((8, 4, 0), "block"), ((8.0, 4, 128), "assignments")])
def test_padded_rows_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=f"'{match}'"):
        ops.padded_rows(*args)


# ------------------------------------------------------------------------------------------
# padded_gather's num_rows, called directly


def _routing(device, tokens=6, experts=3, top_k=2, block=4):
    top = torch.randint(0, experts, (tokens * top_k,))
    with megablocks_ascend.use_backend("torch"):
        indices, bin_ids, bins, _, padded_bins = ops.prepare_routing(top.to(device), experts, block)
    return indices, bin_ids, bins, padded_bins


@pytest.mark.parametrize("stores", ["contiguous", "scattered"])
@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_padded_gather_num_rows(backend, stores, device, monkeypatch, poison_empty):
    """Both forms of the routing kernels (the scattered one's padding walk covers the rows past the
    last segment): the first ``padded_bins[-1]`` rows are upstream-sized output, the rest zero."""
    monkeypatch.setenv(envs.STORES_VAR, stores)
    poison_empty(routing)
    indices, bin_ids, bins, padded_bins = _routing(device)
    x = torch.randn(6, 8, device=device)
    live = int(padded_bins[-1])
    with megablocks_ascend.use_backend(backend):
        exact = ops.padded_gather(x, indices, bin_ids, bins, padded_bins, 2)
        out = ops.padded_gather(x, indices, bin_ids, bins, padded_bins, 2, live + 9)
    assert exact.shape[0] == live and out.shape[0] == live + 9
    assert torch.equal(out[:live], exact) and torch.equal(out[live:], torch.zeros_like(out[live:]))


@pytest.mark.parametrize("num_rows,match", [(-1, ">= 0"), (3.0, "Python int"), (True, "Python int")])
def test_padded_gather_refuses_a_bad_num_rows(num_rows, match, device):
    indices, bin_ids, bins, padded_bins = _routing(device)
    x = torch.randn(6, 8, device=device)
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        with pytest.raises(RoutingArgumentError, match=f"^padded_gather: argument 'num_rows' .*{match}"):
            ops.padded_gather(x, indices, bin_ids, bins, padded_bins, 2, num_rows)
    assert calls == []


def test_value_checks_refuse_num_rows_below_the_layout(device, monkeypatch):
    monkeypatch.setenv(envs.CHECKS_VAR, "1")
    indices, bin_ids, bins, padded_bins = _routing(device)
    x = torch.randn(6, 8, device=device)
    live = int(padded_bins[-1])
    with megablocks_ascend.use_backend("ascend"):
        with pytest.raises(RoutingArgumentError, match=f"'num_rows' is {live - 1}, fewer than"):
            ops.padded_gather(x, indices, bin_ids, bins, padded_bins, 2, live - 1)
        ops.padded_gather(x, indices, bin_ids, bins, padded_bins, 2, live)


def test_upstreams_kernels_take_no_static_size(device, monkeypatch):
    """``MEGABLOCKS_BACKEND=cuda`` runs upstream's kernels: the sparse dMoE keeps upstream's sizes
    there (``Backend.static_sizes``), and upstream's padded_gather refuses a static row count."""
    assert backends.RECORDS["cuda"].static_sizes is False
    assert backends.RECORDS["ascend"].static_sizes and backends.RECORDS["torch"].static_sizes
    layer, _ = _layer("mlp", torch.float32, device)
    x = torch.zeros(4, H, device=device)
    monkeypatch.setattr(backends, "static_sizes", lambda d: False)
    assert sparse_static_sizes.padded_rows(layer.experts, x, 8, E) is None
    if device.type == "cuda":
        monkeypatch.undo()
        indices, bin_ids, bins, padded_bins = _routing(device, block=128)
        with megablocks_ascend.use_backend("cuda"):
            with pytest.raises(backends.BackendUnavailable, match="num_rows"):
                ops.padded_gather(torch.randn(6, H, device=device), indices, bin_ids, bins, padded_bins, 2, 1024)


# ------------------------------------------------------------------------------------------
# Graph capture: the exact sizes refuse it before the read; the static ones do not read


def test_exact_sizes_refuse_a_capture_before_the_read(device, monkeypatch):
    """During a capture (simulated here; real on CUDA in ``tests/test_host_sync.py``) the exact-size
    step stops at padded_gather with an error naming the call and the switch, before anything reads
    ``padded_bins[-1]`` and before padded_gather launches anything."""
    monkeypatch.setenv(envs.SPARSE_SIZES_VAR, "exact")
    layer, args = _layer("mlp", torch.float32, device)
    x = _input(torch.float32, device).requires_grad_()
    monkeypatch.setattr(keeping, "capturing_on", lambda t: True)
    monkeypatch.setattr(keeping, "capturing", lambda d: True)
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        with HostSyncs(cpu_is_device=device.type == "cpu") as syncs:
            with pytest.raises(megablocks_ascend.CaptureError,
                               match=r"padded_gather: .*MEGABLOCKS_ASCEND_SPARSE_SIZES=exact"):
                layer(x)
    assert "padded_gather" not in {c.op for c in calls}
    assert not syncs.events, syncs.report()


def test_static_sizes_run_while_capturing(device, monkeypatch):
    """The same step at static sizes runs through (nothing kept across the capture boundary)."""
    layer, args = _layer("mlp", torch.float32, device)
    x = _input(torch.float32, device)
    want = _results(layer, args, x, "ascend")
    monkeypatch.setattr(keeping, "capturing_on", lambda t: True)
    monkeypatch.setattr(keeping, "capturing", lambda d: True)
    got = _results(layer, args, x, "ascend")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# The switch and the patch


def test_switch_values(monkeypatch):
    for raw, want in (("", "static"), ("STATIC", "static"), (" exact ", "exact")):
        monkeypatch.setenv(envs.SPARSE_SIZES_VAR, raw)
        assert envs.sparse_sizes() == want
    monkeypatch.setenv(envs.SPARSE_SIZES_VAR, "dynamic")
    with pytest.raises(ValueError, match="MEGABLOCKS_ASCEND_SPARSE_SIZES='dynamic': expected one of static, exact"):
        envs.sparse_sizes()


@pytest.fixture
def upstream_sparse_methods():
    patch = sparse_static_sizes.PATCH
    patch.revert()
    try:
        yield patch
    finally:
        patch.apply(patch)
        patch.applied = True


def test_patch_refuses_a_changed_upstream_body(upstream_sparse_methods, monkeypatch):
    from megablocks.layers.dmoe import ParallelDroplessMLP
    original = ParallelDroplessMLP.topology

    def topology(self, x, padded_bins):
        return None  # not MegaBlocks 0.10.0's body

    monkeypatch.setattr(ParallelDroplessMLP, "topology", topology)
    with pytest.raises(registry.PatchError, match="ParallelDroplessMLP.topology is not the code"):
        upstream_sparse_methods.apply(upstream_sparse_methods)
    upstream_sparse_methods.revert()
    assert ParallelDroplessMLP.topology is topology
    monkeypatch.setattr(ParallelDroplessMLP, "topology", original)


def test_patch_follows_megablocks_bodies():
    """Each replacement keeps the original as ``__wrapped__``, whose fingerprint is the recorded one."""
    for target, (replacement, fingerprint, _) in sparse_static_sizes.METHODS.items():
        cls, attr = registry.owner(target)
        assert cls.__dict__[attr] is replacement
        assert registry.source_fingerprint(replacement.__wrapped__) == fingerprint


# ------------------------------------------------------------------------------------------
# Real graph capture (CUDA: MEGABLOCKS_ASCEND_TEST_DEVICE=cuda TRITON_INTERPRET=0; skipped on CPU,
# where the tests above show the step reads nothing on the host)


def _needs_cuda(device):
    if device.type != "cuda":
        pytest.skip("graph capture needs CUDA tensors (MEGABLOCKS_ASCEND_TEST_DEVICE=cuda)")


def _capture(layer, args, x):
    """The graph of one training step (``graph_capture.capture_step``) and the tensors it writes on
    every replay (output, input and parameter gradients)."""
    def reset():
        layer.zero_grad(set_to_none=True)
        x.grad = None
    graph, out = capture_step(lambda: _step(layer, args, x), reset)
    return graph, [out, x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", list(LAYERS))
def test_cuda_graph_captures_and_replays_a_sparse_step(name, device):
    """The whole sparse step (bf16) captured once, replayed with new input values: eager's output
    and gradients, to the bit (the same kernels on the same data)."""
    _needs_cuda(device)
    layer, args = _layer(name, torch.bfloat16, device)
    x = _input(torch.bfloat16, device, tokens=64).requires_grad_()
    with megablocks_ascend.use_backend("ascend"):
        graph, static = _capture(layer, args, x)
        for seed in (2, 3):
            value = _input(torch.bfloat16, device, tokens=64, seed=seed)
            with torch.no_grad():
                x.copy_(value)
            graph.replay()
            got = [t.clone() for t in static]
            want = _results(layer, args, value, "ascend")
            for a, b in zip(got, want):
                assert torch.equal(a, b)


def test_exact_sizes_capture_fails_cleanly_and_the_process_goes_on(device, monkeypatch):
    """At exact sizes a real capture stops with CaptureError (not a CUDA error), and the process can
    still run eager steps and capture the static-size step afterwards (the capture was not left
    broken: no "operation not permitted when stream is capturing", no RNG left in capture state)."""
    _needs_cuda(device)
    monkeypatch.setenv(envs.SPARSE_SIZES_VAR, "exact")
    layer, args = _layer("mlp", torch.bfloat16, device)
    x = _input(torch.bfloat16, device, tokens=64).requires_grad_()
    with megablocks_ascend.use_backend("ascend"):
        with pytest.raises(megablocks_ascend.CaptureError, match="MEGABLOCKS_ASCEND_SPARSE_SIZES=exact"):
            _capture(layer, args, x)
        _results(layer, args, x.detach(), "ascend")  # eager still runs
        monkeypatch.setenv(envs.SPARSE_SIZES_VAR, "static")
        graph, _ = _capture(layer, args, x)
        graph.replay()
        torch.cuda.synchronize()


@pytest.mark.parametrize("name", ["mlp", "glu"])
def test_fp16_autocast_training_with_a_grad_scaler(name, device):
    """float32 parameters, forward under ``torch.autocast(float16)``, ``torch.amp.GradScaler``: a few
    optimizer steps of the static-size sparse dMoE; the loss falls, nothing becomes inf or NaN, the
    parameters stay float32, and no step reads the host (the scaler's own check excepted)."""
    layer, args = _layer(name, torch.float32, device)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
    x = _input(torch.float32, device).requires_grad_()
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(device)
    losses = []
    from megablocks.layers.moe import clear_load_balancing_loss
    with megablocks_ascend.use_backend("ascend"):
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            with HostSyncs(cpu_is_device=device.type == "cpu") as syncs:
                with torch.autocast(device.type, dtype=torch.float16):
                    out, _ = layer(x)
                    loss = (out.float() - target).square().mean()
                scaler.scale(loss).backward()
            assert not syncs.events, syncs.report()
            assert out.dtype == torch.float16
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            clear_load_balancing_loss()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in layer.parameters())
