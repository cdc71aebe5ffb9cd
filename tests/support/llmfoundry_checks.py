"""Checks of LLM Foundry's MPT through the plugin, run by tests/test_llmfoundry.py in fresh processes.

    python tests/support/llmfoundry_checks.py backends FFN_TYPE      # ascend against torch, a few steps
    python tests/support/llmfoundry_checks.py expert-parallel         # 2 gloo ranks against one process

Each prints one line ``RESULT <json>``. The model is built by examples/train_llmfoundry_mpt.py's
``build_model`` (LLM Foundry's ``ComposerMPTCausalLM``), imported the way the example runs:
LLM Foundry first, the plugin activated by its entry point.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import pathlib
import socket
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train_llmfoundry_mpt", ROOT / "examples" / "train_llmfoundry_mpt.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)  # sets TRITON_INTERPRET on a CPU machine, imports llmfoundry

import torch  # noqa: E402

import megablocks_ascend  # noqa: E402  (active already: imported here for use_backend and trace)


def small(ffn_type="mb_dmoe", **overrides):
    a = example.parse(["--ffn-type", ffn_type, "--d-model", "32", "--layers", "1", "--seq", "8",
                       "--batch", "2", "--vocab", "32", "--experts", "4", "--top-k", "2"])
    for k, v in overrides.items():
        setattr(a, k, v)
    return a


def backends(ffn_type: str) -> dict:
    """Two steps from the same initial model with MEGABLOCKS_BACKEND=ascend and =torch."""
    a = small(ffn_type)
    torch.manual_seed(0)
    base = example.build_model(a)
    batches = example.bigram_batches(a)
    data = [next(batches) for _ in range(2)]
    result = {}
    for backend in ("ascend", "torch"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
            losses = [example.train_step(model, batch, opt)["total"].item() for batch in data]
        result[backend] = {"losses": losses, "served": sorted({c.backend for c in calls}),
                           "ops": sorted({c.op for c in calls})}
        result[backend]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    diffs = {n: float((result["ascend"]["params"][n] - p).abs().max()) for n, p in result["torch"]["params"].items()}
    for backend in ("ascend", "torch"):
        del result[backend]["params"]
    result["max_param_diff"] = max(diffs.values())
    return result


def _shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return full.chunk(world, dim=0)[rank]


def _ep_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed._tensor import DTensor  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    a = small("mb_dmoe")
    torch.manual_seed(0)
    single = example.build_model(a, moe_world_size=1)
    ep = example.build_model(a, moe_world_size=world)  # LLM Foundry's config_moe_args builds the mesh
    mesh_types = sorted({p.device_mesh.device_type for p in ep.parameters() if isinstance(p, DTensor)})
    example.copy_weights(single, ep, rank, world)  # each rank's expert shard: its rows of the full ones
    batches = [next(example.bigram_batches(a, rank=r)) for r in range(world)]

    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        total = ep.loss(ep(batches[rank]), batches[rank])["total"]
        total.backward()
    ep_grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in ep.named_parameters()}

    # The single process: rank r's batch alone for the loss and the non-expert gradients; both
    # ranks' batches for the experts, which see every rank's tokens under expert parallelism
    # (MegaBlocks' MLP.gradient_scale then divides their gradients by the number of ranks).
    per_batch = []
    for b in batches:
        single.zero_grad(set_to_none=True)
        with megablocks_ascend.use_backend("torch"):
            loss = single.loss(single(b), b)["total"]
            loss.backward()
        per_batch.append((loss.item(), {n: p.grad.clone() for n, p in single.named_parameters()}))
    report = {"rank": rank, "mesh_device_types": mesh_types, "served": sorted({c.backend for c in calls}),
              "ops": sorted({c.op for c in calls}), "loss_ep": total.item(), "loss_single": per_batch[rank][0],
              "grad_diffs": {}}
    for name, p in ep.named_parameters():
        if isinstance(p, DTensor):  # MegaBlocks scales expert gradients by 1 / world under expert parallelism
            expected = _shard(sum(g[name] for _, g in per_batch), rank, world) / world
        else:
            expected = per_batch[rank][1][name]
        report["grad_diffs"][name] = float((ep_grads[name] - expected).abs().max())
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


def expert_parallel(world: int = 2) -> dict:
    import tempfile  # noqa: PLC0415
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(_ep_worker, args=(world, port, out), nprocs=world)
        return {f"rank{r}": json.loads(pathlib.Path(out, f"rank{r}.json").read_text()) for r in range(world)}


if __name__ == "__main__":
    what = sys.argv[1]
    result = backends(sys.argv[2]) if what == "backends" else expert_parallel()
    print("RESULT " + json.dumps(result))
