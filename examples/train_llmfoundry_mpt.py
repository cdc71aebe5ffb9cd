"""Train LLM Foundry's MPT with MegaBlocks' MoE layers (``ffn_type: mb_dmoe`` or ``mb_moe``), routed
by megablocks-ascend's kernels, without importing megablocks-ascend first.

LLM Foundry is imported first, as its own ``train.py`` does; the plugin activates itself when LLM
Foundry imports MegaBlocks (the ``torch.backends`` entry point: README.md, "Activation"). The model
is built by LLM Foundry (``ComposerMPTCausalLM``, the class its trainer builds from a YAML config)
and trained with LLM Foundry's own loss, the load-balancing loss included, on a synthetic bigram
language (no download). Install LLM Foundry as README.md, "Using with LLM Foundry", says.

    python examples/train_llmfoundry_mpt.py                       # mb_dmoe, grouped MLP
    python examples/train_llmfoundry_mpt.py --ffn-type mb_moe     # MegaBlocks' MoE (capacity)
    python examples/train_llmfoundry_mpt.py --mlp-impl sparse     # dMoE on block-sparse matmuls
    python examples/train_llmfoundry_mpt.py --expert-parallel 2   # 2 processes, experts split
                                                                  # between them (gloo on a CPU)

With ``--expert-parallel N`` it starts N processes; LLM Foundry's own ``config_moe_args`` builds
the expert-parallel mesh (patch ``llmfoundry-device-mesh``) and shards the expert weights as
DTensors; the other gradients are averaged across the processes, as data parallelism would.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

if not torch.cuda.is_available() and not (hasattr(torch, "npu") and torch.npu.is_available()):
    # A CPU machine: our kernels run in the Triton interpreter, which must be on before anything
    # imports triton, and LLM Foundry's imports do (transformers -> torch._dynamo -> triton).
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MEGABLOCKS_BACKEND", "ascend")

import llmfoundry  # noqa: E402,F401  (first, as LLM Foundry's train.py; this also imports MegaBlocks)
from llmfoundry.models.mpt import ComposerMPTCausalLM  # noqa: E402


def build_model(a, moe_world_size: int = 1) -> ComposerMPTCausalLM:
    """LLM Foundry's MPT with MegaBlocks' layers, configured as its YAML files configure it."""
    ffn_config = {
        "ffn_type": a.ffn_type,
        "moe_num_experts": a.experts,
        "moe_top_k": a.top_k,
        "moe_world_size": moe_world_size,
        "moe_loss_weight": 0.01,
        "moe_capacity_factor": 1,
        "mlp_type": a.mlp_type,
        "mlp_impl": a.mlp_impl,
        "fp16": False,
        "bf16": False,
    }
    return ComposerMPTCausalLM(
        d_model=a.d_model, n_heads=4, n_layers=a.layers, expansion_ratio=a.expansion, max_seq_len=a.seq,
        vocab_size=a.vocab, attn_config={"attn_impl": "torch"}, ffn_config=ffn_config,
        init_device="cpu", loss_fn="torch_crossentropy", use_train_metrics=False,
    )


def bigram_batches(a, rank: int = 0):
    """Batches of a random bigram language: each token has three likely successors."""
    table_gen = torch.Generator().manual_seed(a.seed)  # the same language on every rank
    table = torch.full((a.vocab, a.vocab), -1e9)
    for t in range(a.vocab):
        table[t, torch.randperm(a.vocab, generator=table_gen)[:3]] = torch.randn(3, generator=table_gen)
    table = table.softmax(-1)
    gen = torch.Generator().manual_seed(a.seed + 1 + rank)  # each rank its own data
    while True:
        tokens = torch.empty(a.batch, a.seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, a.vocab, (a.batch,), generator=gen)
        for i in range(1, a.seq):
            tokens[:, i] = torch.multinomial(table[tokens[:, i - 1]], 1, generator=gen).squeeze(1)
        yield {"input_ids": tokens, "labels": tokens}


def train_step(model, batch, opt, world_size: int = 1):
    """One step of LLM Foundry's own loss (language model + MegaBlocks' load balancing)."""
    from torch.distributed._tensor import DTensor  # noqa: PLC0415

    losses = model.loss(model(batch), batch)
    opt.zero_grad(set_to_none=True)
    losses["total"].backward()
    if world_size > 1:  # data parallelism for all but the experts, averaged over the ranks; each
        # expert shard already got every rank's tokens, and MegaBlocks scaled its gradient by 1 / ranks
        for p in model.parameters():
            if p.grad is not None and not isinstance(p.grad, DTensor):
                torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
    opt.step()
    return losses


def run(a, rank: int = 0, world_size: int = 1) -> float:
    import megablocks_ascend  # noqa: PLC0415  (active already; imported here for trace())
    import _megablocks_ascend_autoload as hook  # noqa: PLC0415

    torch.manual_seed(a.seed)
    model = build_model(a, moe_world_size=world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    batches = bigram_batches(a, rank)
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    say(f"LLM Foundry MPT, ffn_type={a.ffn_type} ({a.mlp_type}, {a.mlp_impl}), {a.experts} experts, "
        f"top_k={a.top_k}, {world_size} process(es), MEGABLOCKS_BACKEND={megablocks_ascend.requested()}")
    say("activation: " + "; ".join(hook.events()))
    say(f"loss starts near log(vocab) = {math.log(a.vocab):.2f}")
    start, served, first, last = time.time(), set(), None, None
    for step in range(1, a.steps + 1):
        with megablocks_ascend.trace() as calls:
            losses = train_step(model, next(batches), opt, world_size)
        served |= {(c.op, c.backend) for c in calls}
        last = losses["loss"].item()
        first = last if first is None else first
        if step == 1 or step % 10 == 0 or step == a.steps:
            say(f"step {step:4d}  lm loss {last:.3f}  lbl {losses['lbl'].item():.4f}  "
                f"({time.time() - start:.1f}s)", flush=True)
    say("routing ops served: " + ", ".join(f"{op} by {be}" for op, be in sorted(served)))
    if megablocks_ascend.requested() == "ascend" and {be for _, be in served} != {"ascend"}:
        raise SystemExit(f"expected every routing op to be served by our kernels, got {sorted(served)}")
    if a.steps >= 10 and not last < first:
        raise SystemExit(f"loss did not fall: {first:.3f} -> {last:.3f}")
    say(f"lm loss {first:.3f} -> {last:.3f} in {time.time() - start:.0f}s")
    return last


def _expert_parallel_worker(rank: int, world_size: int, a, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        run(a, rank, world_size)
    finally:
        torch.distributed.destroy_process_group()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ffn-type", choices=("mb_dmoe", "mb_moe"), default="mb_dmoe")
    p.add_argument("--mlp-type", choices=("mlp", "glu"), default="mlp")
    p.add_argument("--mlp-impl", choices=("grouped", "sparse"), default="grouped",
                   help="dMoE experts: grouped GEMM or block-sparse matmuls (d_model * expansion "
                        "must be a multiple of 128 for sparse)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--expansion", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="train on N processes (gloo) with the experts split between them")
    return p.parse_args(argv)


def main() -> None:
    a = parse()
    if a.expert_parallel > 1:
        import socket  # noqa: PLC0415
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_expert_parallel_worker, args=(a.expert_parallel, a, port),
                                    nprocs=a.expert_parallel)
    else:
        run(a)


if __name__ == "__main__":
    main()
