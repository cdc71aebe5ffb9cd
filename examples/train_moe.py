"""Train a small language model whose feed-forward layers are MegaBlocks' unchanged MoE / dMoE.

A MegaBlocks user changes nothing: installed, megablocks-ascend activates itself when MegaBlocks is
imported (``import megablocks_ascend`` first does the same explicitly, as here).
Routing then goes through our Ascend-shaped Triton kernels (``MEGABLOCKS_BACKEND=ascend``, the
default of this script): on an NPU compiled by triton-ascend, on a CUDA GPU by Triton, and on
a CPU run by the Triton interpreter, which is what the README's quick start does.

The data is a synthetic language (a sparse random bigram model), so the script needs no
download; a model that learns the bigram table drives the loss from log(vocab) towards the
table's entropy.

    python examples/train_moe.py                  # MoE (capacity-limited, binned routing)
    python examples/train_moe.py --layer dmoe     # dMoE (dropless, grouped GEMM)
    python examples/train_moe.py --layer dmoe --mlp-impl sparse   # dMoE on stk's block-sparse matmuls
    python examples/train_moe.py --amp bf16       # float32 parameters, forward under torch.autocast
    python examples/train_moe.py --amp fp16       # the same in fp16, with a GradScaler
    MEGABLOCKS_BACKEND=torch python examples/train_moe.py   # the pure-PyTorch reference path
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("MEGABLOCKS_BACKEND", "ascend")

import megablocks_ascend  # noqa: E402  (installed, the plugin also activates itself; with MEGABLOCKS_ASCEND_AUTOLOAD=0 this import must come first)
import torch  # noqa: E402
from megablocks.layers.arguments import Arguments  # noqa: E402
from megablocks.layers.dmoe import dMoE  # noqa: E402
from megablocks.layers.moe import MoE, batched_load_balancing_loss, clear_load_balancing_loss  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, args: Arguments, layer_cls, heads: int):
        super().__init__()
        d = args.hidden_size
        self.norm1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads)
        self.norm2 = torch.nn.LayerNorm(d)
        self.moe = layer_cls(args)

    def forward(self, x, mask):  # x: [seq, batch, hidden], MegaBlocks' layout
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out, bias = self.moe(self.norm2(x))
        return x + out + bias


class TinyMoELM(torch.nn.Module):
    def __init__(self, args: Arguments, layer_cls, vocab: int, seq: int, heads: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, args.hidden_size)
        self.pos = torch.nn.Parameter(torch.randn(seq, 1, args.hidden_size) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(args, layer_cls, heads) for _ in range(args.num_layers))
        self.norm = torch.nn.LayerNorm(args.hidden_size)
        self.head = torch.nn.Linear(args.hidden_size, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, tokens):  # tokens: [seq, batch]
        x = self.embed(tokens) + self.pos[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x, self.mask[: tokens.shape[0], : tokens.shape[0]])
        return self.head(self.norm(x))


def bigram_language(vocab: int, successors: int, generator: torch.Generator) -> torch.Tensor:
    """A random bigram table where each token has a few likely successors."""
    table = torch.full((vocab, vocab), -1e9)
    for t in range(vocab):
        nxt = torch.randperm(vocab, generator=generator)[:successors]
        table[t, nxt] = torch.randn(successors, generator=generator)
    return table.softmax(dim=-1)


def sample(table: torch.Tensor, seq: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    tokens = torch.empty(seq + 1, batch, dtype=torch.long)
    tokens[0] = torch.randint(0, table.shape[0], (batch,), generator=generator)
    for i in range(seq):
        tokens[i + 1] = torch.multinomial(table[tokens[i]], 1, generator=generator).squeeze(1)
    return tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", choices=("moe", "dmoe"), default="moe")
    p.add_argument("--mlp-type", choices=("mlp", "glu"), default="mlp", help="dMoE expert type")
    p.add_argument("--mlp-impl", choices=("grouped", "sparse"), default="grouped",
                   help="dMoE expert computation: grouped GEMM, or block-sparse matmuls (stk; needs "
                        "2 * hidden to be a multiple of 128, MegaBlocks' block size)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: npu if present, else cuda, else cpu")
    p.add_argument("--amp", choices=("bf16", "fp16"), default=None,
                   help="mixed precision: float32 parameters, forward under torch.autocast in this "
                        "dtype (fp16 with torch.amp.GradScaler); default: float32 throughout")
    a = p.parse_args()

    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    default = megablocks_ascend.patching.default_device()  # what Arguments would pick
    try:  # (an NPU without torch_npu: an error naming torch_npu, CANN and doctor, before anything runs)
        device = megablocks_ascend.devices.requested(a.device) if a.device else (
            torch.device("cuda", default) if isinstance(default, int) else default)
    except megablocks_ascend.devices.DeviceUnavailable as e:
        p.error(str(e))
    args = Arguments(
        hidden_size=a.hidden, ffn_hidden_size=2 * a.hidden, num_layers=a.layers,
        moe_num_experts=a.experts, moe_top_k=a.top_k, moe_capacity_factor=1,
        moe_loss_weight=0.01, mlp_impl=a.mlp_impl, mlp_type=a.mlp_type,
        fp16=False, bf16=False, device=device,
    )
    layer_cls = MoE if a.layer == "moe" else dMoE
    model = TinyMoELM(args, layer_cls, a.vocab, a.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)
    table = bigram_language(a.vocab, successors=3, generator=gen)
    entropy = float(-(table * table.clamp_min(1e-30).log()).sum(-1).mean())

    print(f"{layer_cls.__name__} ({a.mlp_type if a.layer == 'dmoe' else 'mlp'}), {a.experts} experts, top_k={a.top_k}, "
          f"device={device}, MEGABLOCKS_BACKEND={megablocks_ascend.requested()}, "
          f"{'autocast ' + a.amp if amp else 'float32'}")
    print(f"loss starts near log(vocab) = {math.log(a.vocab):.2f}; the data's entropy is {entropy:.2f}")
    start = time.time()
    served = set()
    first = last = None
    for step in range(1, a.steps + 1):
        tokens = sample(table, a.seq, a.batch, gen).to(device)
        with megablocks_ascend.trace() as calls:
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                logits = model(tokens[:-1])
                lm_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), tokens[1:].reshape(-1))
                loss = lm_loss + batched_load_balancing_loss(args)
            clear_load_balancing_loss()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
        scaler.step(opt)  # a plain opt.step() unless fp16
        scaler.update()
        served |= {(c.op, c.backend) for c in calls}
        first = lm_loss.item() if first is None else first
        last = lm_loss.item()
        if step == 1 or step % 10 == 0 or step == a.steps:
            print(f"step {step:4d}  lm loss {lm_loss.item():.3f}  ({time.time() - start:.1f}s)", flush=True)
    print("routing ops served: " + ", ".join(f"{op} by {be}" for op, be in sorted(served)))
    backends = {be for _, be in served}
    if megablocks_ascend.requested() == "ascend" and backends != {"ascend"}:
        raise SystemExit(f"expected every routing op to be served by our Ascend kernels, got {backends}")
    if a.layer == "dmoe" and a.mlp_impl == "sparse" and not {"sdd", "dsd"} <= {op for op, _ in served}:
        raise SystemExit("--mlp-impl sparse ran no block-sparse matmul (sdd, dsd)")
    if not last < first:
        raise SystemExit(f"loss did not fall: {first:.3f} -> {last:.3f}")
    print(f"loss fell from {first:.3f} to {last:.3f} in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
