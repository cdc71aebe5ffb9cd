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

``--fsdp`` trains with Composer's ``Trainer``, as LLM Foundry's ``train.py`` does, under
``torchrun`` (one process per GPU): with N > 1 processes the experts are split over all of them
(``moe_world_size`` N) and the model is wrapped by Composer's FSDP with LLM Foundry's own wrap
function (each MPT block, and the experts on the mesh LLM Foundry gives them); its losses, averaged
over the ranks, are written to ``--out``. Run once more on one process with ``--data-ranks N``
(the N ranks' batches as one) and ``--compare`` the first run's file: the same initial weights,
the same data, so the same losses (SGD and a load-balancing loss weight of 1e-6 make that exact up
to rounding: the load-balancing loss of a rank's tokens is not that of all tokens, and Adam's first
step turns a rounding difference of a near-zero gradient into a step of ``lr``; a weight of 0
makes MegaBlocks return the float ``0.0`` as the loss, which Composer 0.32.1's Trainer cannot
``detach()``):

    torchrun --standalone --nproc-per-node 2 examples/train_llmfoundry_mpt.py --fsdp --out DIR
    python examples/train_llmfoundry_mpt.py --fsdp --data-ranks 2 --out DIR --compare DIR/llmfoundry-fsdp-ep2.json

(``--fsdp`` sets ``--optimizer sgd --lr 0.5 --moe-loss-weight 1e-6`` unless given.) On a CPU, Composer
0.32.1's FSDP asks for a CUDA device (``torch.cuda.current_device()``): the run stops there and
says so; docs/notes/expert-parallel-and-checks.md has what was run where.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import time

import torch

if not torch.cuda.is_available() and not (hasattr(torch, "npu") and torch.npu.is_available()):
    # A CPU machine: our kernels run in the Triton interpreter, which must be on before anything
    # imports triton, and LLM Foundry's imports do (transformers -> torch._dynamo -> triton).
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MEGABLOCKS_BACKEND", "ascend")


def import_llmfoundry() -> None:
    """``import llmfoundry`` first, as LLM Foundry's train.py does (this also imports MegaBlocks, and
    the plugin activates itself then); called once the arguments have been checked."""
    import llmfoundry  # noqa: F401,PLC0415


def build_model(a, moe_world_size: int = 1):
    """LLM Foundry's MPT with MegaBlocks' layers, configured as its YAML files configure it."""
    from llmfoundry.models.mpt import ComposerMPTCausalLM  # noqa: PLC0415

    ffn_config = {
        "ffn_type": a.ffn_type,
        "moe_num_experts": a.experts,
        "moe_top_k": a.top_k,
        "moe_world_size": moe_world_size,
        "moe_loss_weight": a.moe_loss_weight,
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


def copy_weights(single, ep, rank: int, world: int) -> None:
    """The expert-parallel model ``ep`` gets ``single``'s weights: each expert weight (a DTensor
    sharded over the expert-parallel mesh) its rank's rows, every other weight whole."""
    from torch.distributed._tensor import DTensor  # noqa: PLC0415
    full = dict(single.named_parameters())
    with torch.no_grad():
        for name, p in ep.named_parameters():
            if isinstance(p, DTensor):
                p.to_local().copy_(full[name].chunk(world, dim=0)[rank])
            else:
                p.copy_(full[name])


def bigram_table(a) -> torch.Tensor:
    """The random bigram language: row t, the probabilities of the token after t (three likely ones)."""
    table_gen = torch.Generator().manual_seed(a.seed)  # the same language on every rank
    table = torch.full((a.vocab, a.vocab), -1e9)
    for t in range(a.vocab):
        table[t, torch.randperm(a.vocab, generator=table_gen)[:3]] = torch.randn(3, generator=table_gen)
    return table.softmax(-1)


def entropy_floor(table: torch.Tensor) -> float:
    """The language's entropy per predicted token (nats), the lowest loss a model can reach: each
    row's entropy, weighted by how often its token occurs (the chain's stationary distribution;
    sequences start at a uniform token, close enough to it after a few tokens)."""
    p = torch.full((table.shape[0],), 1.0 / table.shape[0], dtype=torch.float64)
    t = table.double()
    for _ in range(200):
        p = p @ t
    rows = -(t * t.clamp_min(1e-30).log()).sum(-1)
    return float(p @ rows)


def bigram_batches(a, rank: int = 0):
    """Batches of a random bigram language: each token has three likely successors."""
    table = bigram_table(a)
    gen = torch.Generator().manual_seed(a.seed + 1 + rank)  # each rank its own data
    while True:
        tokens = torch.empty(a.batch, a.seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, a.vocab, (a.batch,), generator=gen)
        for i in range(1, a.seq):
            tokens[:, i] = torch.multinomial(table[tokens[:, i - 1]], 1, generator=gen).squeeze(1)
        yield {"input_ids": tokens, "labels": tokens}


def make_optimizer(a, model):
    cls = torch.optim.SGD if a.optimizer == "sgd" else torch.optim.AdamW
    return cls(model.parameters(), lr=a.lr)


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
    opt = make_optimizer(a, model)
    batches = bigram_batches(a, rank)
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    say(f"LLM Foundry MPT, ffn_type={a.ffn_type} ({a.mlp_type}, {a.mlp_impl}), {a.experts} experts, "
        f"top_k={a.top_k}, {world_size} process(es), MEGABLOCKS_BACKEND={megablocks_ascend.requested()}")
    say("activation: " + "; ".join(hook.events()))
    # (An untrained MPT does not start at log(vocab), a uniform guess: its initial logits are not
    # flat, and its first loss is higher; measured here: 5.1-5.2 at the defaults.)
    say(f"lm loss: a uniform guess scores log(vocab) = {math.log(a.vocab):.2f}, the untrained model more; "
        f"the language's entropy, the floor, is {entropy_floor(bigram_table(a)):.2f}")
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
    import_llmfoundry()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        run(a, rank, world_size)
    finally:
        torch.distributed.destroy_process_group()


# What stops LLM Foundry's expert parallelism under FSDP on a CPU (LLM Foundry 0.22.0, Composer 0.32.1,
# torch 2.13; docs/notes/expert-parallel-and-checks.md).
CPU_FSDP = ("Composer's FSDP (version 1) passes device_id=torch.cuda.current_device(), and torch's FSDP1 refuses "
            "a CPU ('FSDP needs a non-CPU accelerator device'); with FSDP_VERSION=2, Composer calls fully_shard() "
            "with the experts' FSDP1 keyword device_mesh that LLM Foundry sets (TypeError). Run it on GPUs.")


def fsdp_run(a) -> int:
    """``--fsdp``: Composer's Trainer, LLM Foundry's model and FSDP wrapping, N processes of
    ``torchrun`` (experts over all of them) or one (no FSDP, ``--data-ranks`` ranks' batches)."""
    import megablocks_ascend  # noqa: PLC0415
    from composer import Trainer  # noqa: PLC0415
    from composer.core import Callback  # noqa: PLC0415
    from composer.utils import dist as cdist  # noqa: PLC0415
    from torch.distributed._tensor import DTensor  # noqa: PLC0415

    device = "gpu" if torch.cuda.is_available() else "cpu"
    cdist.initialize_dist(device, timeout=300)
    world, rank = cdist.get_world_size(), cdist.get_global_rank()
    data_ranks = world if world > 1 else a.data_ranks
    if world > 1 and a.data_ranks not in (1, world):
        raise SystemExit(f"--data-ranks {a.data_ranks} with {world} processes: each process takes its own batches")
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    torch.manual_seed(a.seed)
    model = build_model(a)  # the single-process model: the same initial weights in every run
    if world > 1:
        ep = build_model(a, moe_world_size=world)  # LLM Foundry's config_moe_args builds the mesh
        copy_weights(model, ep, rank, world)
        model = ep
    mesh_types = sorted({p.device_mesh.device_type for p in model.parameters() if isinstance(p, DTensor)})
    # One list of sequences; each step takes the next data_ranks * batch of them: all of them on one
    # process, every world-th on each rank (Composer's DistributedSampler), the same set either way.
    gen = bigram_batches(a)
    rows = torch.cat([next(gen)["input_ids"] for _ in range(a.steps * data_ranks)])
    dataset = [{"input_ids": t, "labels": t} for t in rows]
    if world > 1:
        loader = torch.utils.data.DataLoader(dataset, batch_size=a.batch,
                                             sampler=cdist.get_sampler(dataset, shuffle=False))
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=a.batch * data_ranks)
    opt = make_optimizer(a, model)

    class Losses(Callback):
        """Each step's losses, averaged over the ranks (each rank's is the mean over its tokens)."""

        def __init__(self):
            self.steps = []

        def after_train_batch(self, state, logger):
            loss = state.loss if isinstance(state.loss, dict) else {"total": state.loss, "loss": state.loss}
            t = torch.stack([loss["total"].detach().float(), loss["loss"].detach().float()])
            if world > 1:
                torch.distributed.all_reduce(t)
                t /= world
            self.steps.append([float(v) for v in t.cpu()])

    losses = Losses()
    fsdp = {"sharding_strategy": "FULL_SHARD", "mixed_precision": "FULL", "use_orig_params": True}
    say(f"LLM Foundry MPT, {a.ffn_type}, {a.experts} experts, top_k={a.top_k}, {world} process(es) "
        f"({'Composer FSDP, experts over all of them' if world > 1 else 'no FSDP'}), batches of {data_ranks} "
        f"rank(s) of {a.batch}, {a.optimizer} lr {a.lr}, moe_loss_weight {a.moe_loss_weight}, device {device}, "
        f"MEGABLOCKS_BACKEND={megablocks_ascend.requested()}, expert mesh on {mesh_types or '-'}")
    if world > 1 and device == "cpu":
        say(f"{world} processes on the CPU: LLM Foundry built the expert-parallel model (expert mesh on "
            f"{mesh_types}, every rank's batches drawn); stopping before Composer's FSDP, which cannot run here: "
            + CPU_FSDP)
        return 2
    trainer = Trainer(model=model, train_dataloader=loader,
                      max_duration=f"{a.steps}ba", optimizers=opt, device=device, precision="fp32",
                      parallelism_config={"fsdp": fsdp} if world > 1 else None, callbacks=[losses],
                      device_train_microbatch_size=a.batch * data_ranks if world == 1 else a.batch,
                      progress_bar=False, log_to_console=False, seed=a.seed)
    with megablocks_ascend.trace() as calls:
        trainer.fit()
    served = sorted({c.backend for c in calls})
    for i, (total, lm) in enumerate(losses.steps, 1):
        say(f"step {i:4d}  lm loss {lm:.6f}  total {total:.6f}")
    result = dict(world=world, data_ranks=data_ranks, device=device, fsdp=world > 1, expert_mesh=mesh_types,
                  served=served, ops=sorted({c.op for c in calls}), losses=losses.steps, settings=vars(a),
                  versions={m: __import__(m).__version__ for m in ("torch", "composer", "llmfoundry")})
    status = 0
    if megablocks_ascend.requested() == "ascend" and served != ["ascend"]:
        say(f"expected every routing op to be served by our kernels, got {served}")
        status = 1
    if a.compare:
        other = json.loads(pathlib.Path(a.compare).read_text())
        worst = max(abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(losses.steps, other["losses"]))
        same = len(other["losses"]) == len(losses.steps) and worst <= a.tol
        result["compared_with"] = dict(file=a.compare, world=other["world"], worst_rel_diff=worst, ok=same)
        say(f"lm loss against {a.compare} ({other['world']} process(es)): largest relative difference "
            f"{worst:.2e} -> {'same' if same else 'DIFFERENT'} (tolerance {a.tol:.0e})")
        status = status or (0 if same else 1)
    if rank == 0 and a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"llmfoundry-fsdp-ep{world}.json" if world > 1 else f"llmfoundry-single-x{data_ranks}.json"
        (out / name).write_text(json.dumps(result, indent=1))
        say(f"wrote {out / name}")
    return status


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
    p.add_argument("--lr", type=float, default=None, help="default 3e-3 (--fsdp: 0.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="train on N processes (gloo) with the experts split between them")
    p.add_argument("--moe-loss-weight", type=float, default=None, help="default 0.01 (--fsdp: 1e-6)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=None, help="default adamw (--fsdp: sgd)")
    p.add_argument("--fsdp", action="store_true",
                   help="Composer's Trainer and FSDP under torchrun, experts over every process (see above)")
    p.add_argument("--data-ranks", type=int, default=1, metavar="N",
                   help="--fsdp on one process: train on N ranks' batches at once")
    p.add_argument("--compare", default=None, metavar="JSON", help="--fsdp: compare the losses with another run's")
    p.add_argument("--tol", type=float, default=1e-4, help="--compare: relative difference allowed")
    p.add_argument("--out", default=None, help="--fsdp: directory of the losses' JSON")
    a = p.parse_args(argv)
    if a.compare is not None:  # checked now, not after training
        if not a.fsdp:
            p.error("--compare goes with --fsdp (it compares the losses of two --fsdp runs)")
        try:
            other = json.loads(pathlib.Path(a.compare).read_text())
        except OSError as e:
            p.error(f"--compare {a.compare}: cannot read it ({e.strerror or e}); it is the JSON a first --fsdp run "
                    f"wrote under its --out (llmfoundry-fsdp-epN.json)")
        except ValueError as e:
            p.error(f"--compare {a.compare}: not JSON ({e})")
        if not isinstance(other, dict) or not {"losses", "world"} <= set(other):
            p.error(f"--compare {a.compare}: not a result of this script (no 'losses' and 'world')")
    fsdp_defaults = {"moe_loss_weight": 1e-6, "optimizer": "sgd", "lr": 0.5} if a.fsdp else {}
    for key, default in {"moe_loss_weight": 0.01, "optimizer": "adamw", "lr": 3e-3, **fsdp_defaults}.items():
        if getattr(a, key) is None:
            setattr(a, key, default)
    return a


def main() -> None:
    a = parse()
    import_llmfoundry()
    if a.fsdp:
        raise SystemExit(fsdp_run(a))
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
