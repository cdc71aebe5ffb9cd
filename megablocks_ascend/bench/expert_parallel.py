"""MegaBlocks' expert-model parallelism through the plugin, checked against one process.

Each of :data:`WORLD` ranks holds half of the experts (``moe_expert_model_parallelism=True``); tokens
travel between ranks with ``all_to_all`` and are routed with ``ops.gather`` / ``ops.scatter`` /
``ops.replicate`` and the binned, dropless or padded ops (the last with stk's block-sparse matmuls:
the sparse dMoE). Every rank checks its output and gradients against the same layer with all
experts in one process (weights copied), run by the ``torch`` backend:

* outputs and input gradients must match;
* router gradients must match (they only see the rank's own tokens);
* expert weight gradients must equal the sum over ranks of the single-process gradients for the
  rank's experts, times MegaBlocks' ``1 / world_size`` expert-parallel gradient scale.

MoE runs with a capacity factor large enough that no token is dropped, because the capacity is
computed over all ranks' tokens in expert-parallel mode and per process otherwise. The check runs
on CPUs with gloo (``tests/test_expert_parallel.py``, ``tests/test_autocast.py``) and on GPUs with
NCCL (``benchmarks/expert_parallel_check.py``); a failed check raises in its rank, so the spawn
fails.
"""

import os
import tempfile

import torch
import torch.distributed as dist

WORLD = 2


def rendezvous():
    """A fresh file for the ranks to meet at (no TCP port to race for with other runs)."""
    return os.path.join(tempfile.mkdtemp(prefix="megablocks-ascend-ep-"), "store")


def _check(ok, what="") -> None:
    """An assert that ``python -O`` keeps: a failed check fails the rank, and so the spawn."""
    if not ok:
        raise AssertionError(f"expert-parallel check failed: {what}")


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def worker(rank, store, layer_kind, backend, device_type="cpu", pg_backend="gloo", amp=None):
    """One rank (``torch.multiprocessing.spawn`` passes ``rank``). With ``amp`` (a dtype), both layers
    run under autocast to it, compared within 6 units of its roundoff instead of float32's 1e-5."""
    if device_type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type != "cpu" else torch.device("cpu")
    import megablocks_ascend  # noqa: PLC0415
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE, clear_load_balancing_loss  # noqa: PLC0415

    dist.init_process_group(pg_backend, rank=rank, world_size=WORLD, init_method=f"file://{store}")
    try:
        cls = MoE if layer_kind == "moe" else dMoE
        sparse = layer_kind == "dmoe-sparse"  # the block-sparse MLP needs ffn to be a multiple of 128
        experts, hidden, ffn, top_k = 4, 16, 128 if sparse else 64, 2  # dMoE needs ffn * experts >= 128
        common = dict(hidden_size=hidden, ffn_hidden_size=ffn, moe_num_experts=experts, moe_top_k=top_k,
                      moe_capacity_factor=experts, mlp_impl="sparse" if sparse else "grouped", fp16=False,
                      bf16=False, moe_loss_weight=0.0, device=device)
        torch.manual_seed(0)
        full = cls(Arguments(**common))
        ep = cls(Arguments(**common, moe_expert_model_parallelism=True,
                           expert_parallel_group=dist.group.WORLD))
        per_rank = experts // WORLD
        full_params = dict(full.named_parameters())
        with torch.no_grad():
            for name, p in ep.named_parameters():
                src = full_params[name]
                if name.startswith("experts.mlp."):
                    rows = src.shape[0] // experts * per_rank  # [E, ...] (MoE) or [E*ffn, hidden] (dMoE)
                    src = src[rank * rows:(rank + 1) * rows]
                p.copy_(src)

        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(6, 2, hidden, generator=gen).to(device)
        g = torch.randn(6, 2, hidden, generator=gen).to(device)

        autocast = torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None)
        tol = 1e-5 if amp is None else 6 * torch.finfo(amp).eps / 2
        x_ep = x.clone().requires_grad_()
        with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
            with autocast:
                out, bias = ep(x_ep)
            (out + bias).backward(g)
        clear_load_balancing_loss()
        _check(calls and {c.backend for c in calls} == {backend}, calls)

        x_ref = x.clone().requires_grad_()
        with megablocks_ascend.use_backend("torch"):  # the reference: plain PyTorch, one process
            with autocast:
                out_ref, bias_ref = full(x_ref)
            (out_ref + bias_ref).backward(g)
        clear_load_balancing_loss()

        _check(_rel(out + bias, out_ref + bias_ref) < tol, "output")
        _check(_rel(x_ep.grad, x_ref.grad) < tol, "input gradient")
        ep_params = dict(ep.named_parameters())
        _check(_rel(ep_params["router.layer.weight"].grad, full_params["router.layer.weight"].grad) < tol,
               "router gradient")
        for name, p in ep_params.items():
            _check(p.grad.dtype == p.dtype, name)
            if not name.startswith("experts.mlp."):
                continue
            total = full_params[name].grad.clone()
            dist.all_reduce(total)
            rows = total.shape[0] // experts * per_rank
            expected = total[rank * rows:(rank + 1) * rows] / WORLD
            _check(_rel(p.grad, expected) < tol, name)
        ops_seen = {c.op for c in calls}
        _check({"gather", "scatter"} <= ops_seen, ops_seen)
        _check(sparse == ({"padded_gather", "sdd", "dsd"} <= ops_seen), ops_seen)
        # Rank 0 hosts the rendezvous store: nobody leaves before everybody is done with it.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check passed. Leave without interpreter teardown: once, in a loaded clean-clone run,
    # a rank aborted with "terminate called without an active exception" while the other rank was
    # still running; the usual cause is a gloo thread still alive at process exit. Not reproduced
    # since in repeated runs; the barrier above and this exit rule out the exit-time variant.
    os._exit(0)
