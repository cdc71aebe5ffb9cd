"""What one training step of MegaBlocks' MoE / grouped dMoE / sparse dMoE launches, line by line.

For each layer and routing backend, one training step (``megablocks_ascend.bench.launches.layer_step``:
forward, load-balancing loss, backward) is counted by ``LaunchCounter``: every aten
op that launches a device kernel and every Triton launch, each with the source line that caused
it (MegaBlocks, stk, megablocks_ascend, torch autograd's backward of a forward line, the step).
On CUDA the step's real kernels (and memcpy/memset) are also counted with ``torch.profiler``, by
kernel name: one aten op can be several kernels (``torch.sort``'s CUB radix sort, a cumsum).

Backends: ``ascend`` (ours), ``upstream`` (MegaBlocks' and stk's own kernels: the ``cuda``
backend on a GPU; on the CPU the patches that route them through us are lifted for the step and
their Triton kernels run in the interpreter), ``torch`` (the plain-PyTorch reference: a sanity
column, it is not meant to be lean).

    python benchmarks/launches_per_step.py                         # CPU (interpreter): the table
    python benchmarks/launches_per_step.py --out DIR --name NAME   # a GPU: + profiler kernel counts

Writes ``NAME.json`` (every launch with its line; the profiler's kernel names on CUDA) and
``NAME.md`` (the tables of docs/notes/launches-per-step.md) to ``--out``.
``--amp``: float32 parameters and the forward under ``torch.autocast(bfloat16)``.
The default shape (E=16, top_k=4, 64 tokens, hidden 128, ffn 128, float32 on CPU and bf16 on a device) is
the regression test's with hidden 128, which stk's own kernels need (the count does not depend on it).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks and triton)
import torch

from megablocks_ascend.bench import report, routing_ops, timing
from megablocks_ascend.bench.launches import LAYERS, count_step, layer_step

BACKENDS = ("ascend", "upstream", "torch")


def origin(where: str) -> str:
    """Who caused a launch: ``MegaBlocks``, ``stk``, ``ours`` (megablocks_ascend), ``autograd``
    (torch's backward of a forward line), ``step`` (the training step itself) or ``other``."""
    if where.startswith("autograd "):
        return "autograd"
    for prefix, name in (("megablocks_ascend/bench/launches.py", "step"), ("megablocks_ascend/", "ours"),
                         ("megablocks/", "MegaBlocks"), ("stk/", "stk")):
        if where.startswith(prefix):
            return name
    return "other"


def count(layer, backend, device, args):
    dtype = torch.float32 if args.amp or device.type == "cpu" else torch.bfloat16
    step = layer_step(layer, backend=backend, device=device, experts=args.experts, top_k=args.top_k,
                      tokens=args.tokens, hidden=args.hidden, ffn=args.ffn, dtype=dtype,
                      amp=torch.bfloat16 if args.amp else None)
    counted = count_step(step, device=device.type if device.type != "cpu" else None, where=True)
    row = dict(layer=layer, backend=backend, total=counted.total, aten=counted.aten, triton=counted.triton,
               launches=[dict(name=e.name, where=e.where, origin=origin(e.where)) for e in counted.events])
    if device.type == "cuda":
        timing.synchronize(device)
        per_step = timing.kernel_times(step, device, steps=3)  # {name: (ms, launches)} per step
        kernels = {name: n for name, (_, n) in sorted(per_step.items(), key=lambda kv: -kv[1][1])}
        row["cuda_kernels"] = sum(kernels.values())
        row["cuda_kernel_names"] = kernels
    return row


def tables(rows, backends) -> str:
    """Markdown: per layer, launches by (origin, source line, op) for every backend but torch;
    then totals per layer and backend, by origin."""
    out = []
    by = {(r["layer"], r["backend"]): r for r in rows if "error" not in r}
    shown = [b for b in backends if b != "torch"]
    for layer in dict.fromkeys(r["layer"] for r in rows):
        out.append(f"\n#### {layer}\n")
        out.append("| origin | line | op | " + " | ".join(shown) + " |")
        out.append("| --- | --- | --- | " + " | ".join("---:" for _ in shown) + " |")
        keys, counts = [], {}
        for b in shown:
            r = by.get((layer, b))
            for e in r["launches"] if r else ():
                key = (e["origin"], e["where"], e["name"])
                if key not in counts:
                    keys.append(key)
                    counts[key] = collections.Counter()
                counts[key][b] += 1
        for key in keys:
            o, where, name = key
            out.append(f"| {o} | `{where}` | `{name}` | " + " | ".join(str(counts[key][b] or "") for b in shown) + " |")
    out.append("\n#### Totals\n")
    out.append("| layer | backend | launches | aten ops | Triton | " + " | ".join(
        ("MegaBlocks", "stk", "ours", "autograd", "step", "other")) + " | CUDA kernels |")
    out.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            out.append(f"| {r['layer']} | {r['backend']} | error: {r['error'][:120]} |")
            continue
        o = collections.Counter(e["origin"] for e in r["launches"])
        out.append(f"| {r['layer']} | {r['backend']} | {r['total']} | {r['aten']} | {r['triton']} | "
                   + " | ".join(str(o[k]) for k in ("MegaBlocks", "stk", "ours", "autograd", "step", "other"))
                   + f" | {r.get('cuda_kernels', '-')} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--amp", action="store_true",
                    help="float32 parameters, the forward under torch.autocast(bfloat16)")
    ap.add_argument("--out", default=None, help="directory for NAME.json and NAME.md (default: print only)")
    ap.add_argument("--name", default="launches_per_step")
    ap.add_argument("--device", default=None, help=routing_ops.DEVICE_HELP)
    args = ap.parse_args(argv)
    device = routing_ops.setup(args.device)
    layers = args.layers.split(",")
    backends = args.backends.split(",")
    for value, known in ((layers, LAYERS), (backends, BACKENDS)):
        bad = [v for v in value if v not in known]
        if bad:
            ap.error(f"unknown {bad}; known: {', '.join(known)}")
    rows = []
    for layer in layers:
        for backend in backends:
            try:
                row = count(layer, backend, device, args)
            except Exception as e:  # noqa: BLE001 - an error row, and the run goes on
                row = dict(layer=layer, backend=backend, error=f"{type(e).__name__}: {e}")
            rows.append(row)
            print(f"{layer:13s} {backend:9s} " + (f"ERROR {row['error'][:200]}" if "error" in row else
                  f"{row['total']:4d} launches ({row['aten']} aten ops, {row['triton']} Triton)"
                  + (f", {row['cuda_kernels']:.0f} CUDA kernels" if "cuda_kernels" in row else "")), flush=True)
    text = tables(rows, backends)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        env = report.environment(device)
        env.update(experts=args.experts, top_k=args.top_k, tokens=args.tokens, hidden=args.hidden, ffn=args.ffn,
                   precision="amp-bf16" if args.amp else ("float32" if device.type == "cpu" else "bf16"))
        (out / f"{args.name}.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
        (out / f"{args.name}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
