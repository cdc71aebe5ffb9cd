"""MegaBlocks' expert-model parallelism through the plugin, checked against one process.

The expert-parallel layer (``moe_expert_model_parallelism=True``, ``expert_parallel_group`` the
world) holds ``experts / world`` experts on each rank; tokens travel between ranks with
``all_to_all_single`` and are routed with ``ops.gather`` / ``ops.scatter`` / ``ops.replicate`` and
the binned (``MoE``), dropless (``dMoE-grouped``) or padded ops with stk's block-sparse matmuls
(``dMoE-sparse``). :func:`build` makes it and the same layer with every expert in one process
(``full``), with the same weights: each rank's experts are its rows of the full layer's.

:func:`check` runs one training step of the expert-parallel layer on every rank's own tokens with
a backend, and compares on rank 0, against the full layer run by rank 0 on every rank's tokens at
once with the ``torch`` backend (plain PyTorch):

* the outputs and input gradients, gathered from every rank;
* the expert weight gradients, gathered from every rank, against the full layer's times
  MegaBlocks' ``1 / world`` expert-parallel gradient scale (``MLP.gradient_scale``);
* the gradients of the weights every rank holds whole (router, output bias), summed over ranks.

Both runs take the same decisions: the router is made decisive (``precision.decisive_router``: no two
logits of a token close, in any precision), and the full ``MoE`` gets the capacity factor that gives
it the expert-parallel layer's capacity per expert (MegaBlocks computes the latter from the
assignments over all ranks, ``top_k`` times the tokens), so both drop the same assignments: the
received tokens of an expert are in rank order, as in the full layer's batch, which is every rank's
tokens one after the other. The check also asserts that the backend served every routing call
(``trace()``) and that the expert-parallel path ran (``gather`` / ``scatter``; the padded ops and
``sdd`` / ``dsd`` for the sparse dMoE).

:mod:`~megablocks_ascend.bench.expert_parallel_steps` runs it under ``torchrun`` and times the step
(``benchmarks/bench_expert_parallel.py``); ``tests/test_expert_parallel.py`` runs that on 2 gloo ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from megablocks_ascend import backends
from megablocks_ascend.bench.layers import backend_env
from megablocks_ascend.bench.precision import decisive_router, rel_l2

LAYERS = ("MoE", "dMoE-grouped", "dMoE-sparse")
# precision -> (parameter and input dtype, autocast dtype or None)
PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
              "amp-bf16": (torch.float32, torch.bfloat16)}
# Relative L2 error allowed against the full layer: float32 differs by summation order only; bf16
# (parameters, or autocast's matmuls) by the rounding of kernels that tile differently at different
# token counts, and ours by the order in which a token's top_k rows are summed: 6 units of bf16.
TOL = {"fp32": 1e-5, "bf16": 6 * 2.0**-8, "amp-bf16": 6 * 2.0**-8}
REFERENCE = "torch"
SPARSE_BLOCK = 128  # MegaBlocks' block size: the sparse dMoE needs ffn to be a multiple of it


def _check(ok, what="") -> None:
    """An assert that ``python -O`` keeps."""
    if not ok:
        raise ValueError(what)


def layer_arguments(layer: str, c: dict, precision: str, device: torch.device, under: str = REFERENCE, **extra):
    """MegaBlocks' ``Arguments`` of ``layer`` at config ``c`` (H, ffn, E, k), ``return_bias=False``
    (the output bias added inside the layer), built under the backend ``under`` (the reference
    backend by default, which lifts MegaBlocks' refusal of ``mlp_impl="sparse"``; the backends
    that run the layer decide per call)."""
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    dtype = PRECISIONS[precision][0]
    with backends.use_backend(under):
        return Arguments(hidden_size=c["H"], ffn_hidden_size=c["ffn"], moe_num_experts=c["E"], moe_top_k=c["k"],
                         mlp_impl="sparse" if layer == "dMoE-sparse" else "grouped", bf16=dtype == torch.bfloat16,
                         fp16=False, return_bias=False,
                         device=torch.cuda.current_device() if device.type == "cuda" else device, **extra)


def why_not(layer: str, c: dict, world: int) -> str | None:
    """Why ``layer`` at config ``c`` cannot run on ``world`` ranks, or None."""
    if c["E"] % world:
        return f"{c['E']} experts do not split over {world} ranks"
    if layer == "dMoE-sparse" and c["ffn"] % SPARSE_BLOCK:
        return f"the sparse dMoE needs ffn a multiple of {SPARSE_BLOCK} (got {c['ffn']})"
    return None


def refusal(layer: str, c: dict, precision: str, device: torch.device, backend: str) -> str | None:
    """MegaBlocks' own refusal to build ``layer`` for ``backend``, or None: under ``cuda`` (stk's own
    block-sparse kernels) MegaBlocks 0.10.0 refuses ``mlp_impl="sparse"`` with Triton 3.2 or later
    (patches/sparse-mlp-refusal.md), so upstream has no sparse dMoE to time. Asked on every rank
    alike, before any collective."""
    if layer != "dMoE-sparse" or backend == REFERENCE:
        return None
    try:
        layer_arguments(layer, c, precision, device, under=backend)
    except (ValueError, backends.BackendUnavailable) as e:
        return f"{type(e).__name__}: {e}"
    return None


@dataclasses.dataclass
class Pair:
    """The expert-parallel layer, the full layer (on rank 0; None elsewhere), and every rank's
    tokens and output gradient (``xs[r]``, ``gs[r]``: ``[tokens, 1, H]``)."""
    layer: str
    precision: str
    rank: int
    world: int
    experts: int
    ep: torch.nn.Module
    full: torch.nn.Module | None
    xs: list
    gs: list
    reference: dict | None = None  # rank 0: the full layer's step, computed once

    @property
    def amp(self):
        return PRECISIONS[self.precision][1]

    def autocast(self, device_type):
        return torch.autocast(device_type, dtype=self.amp) if self.amp else contextlib.nullcontext()


def expert_rows(name: str, full_shape, experts: int, world: int) -> int | None:
    """Rows of the expert weight ``name`` each rank holds (its experts' rows of the full weight:
    ``[E, ...]`` in the MoE, ``[E * ffn, H]`` in the dMoE), or None for a weight every rank holds
    whole."""
    if not name.startswith("experts.mlp."):
        return None
    return full_shape[0] // experts * (experts // world)


def build(layer: str, c: dict, tokens: int, precision: str, device: torch.device, rank: int, world: int,
          capacity_factor: float = 1.0, seed: int = 0) -> Pair:
    """The pair of layers and the inputs; the same on every rank (same seeds), each rank keeping
    its experts (and rank 0 the full layer)."""
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE  # noqa: PLC0415
    why = why_not(layer, c, world)
    if why:
        raise ValueError(why)
    cls = MoE if layer == "MoE" else dMoE
    dtype = PRECISIONS[precision][0]
    torch.manual_seed(seed)
    # The full MoE's capacity: capacity_factor * k * (world * tokens) / E; the expert-parallel one's
    # is computed from the k * tokens assignments of a rank: capacity_factor * k * (k * tokens) * world / E.
    full = cls(layer_arguments(layer, c, precision, device, moe_capacity_factor=capacity_factor * c["k"]))
    ep = cls(layer_arguments(layer, c, precision, device, moe_capacity_factor=capacity_factor,
                             moe_expert_model_parallelism=True, expert_parallel_group=dist.group.WORLD))
    if layer == "MoE":
        got, want = ep.experts.expert_capacity(tokens * c["k"]), full.experts.expert_capacity(tokens * world)
        _check(got == want, f"MoE capacity per expert: expert-parallel {got}, full layer {want}")
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(world * tokens, 1, c["H"], device=device, generator=gen).to(dtype)
    g = torch.randn(world * tokens, 1, c["H"], device=device, generator=gen).to(dtype)
    decisive_router(full, x, c["E"])
    full_params = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in ep.named_parameters():
            src = full_params[name]
            rows = expert_rows(name, src.shape, c["E"], world)
            if rows is not None:
                src = src[rank * rows:(rank + 1) * rows]
            _check(src.shape == p.shape, f"{name}: expert-parallel shape {tuple(p.shape)}, shard {tuple(src.shape)}")
            p.copy_(src)
    return Pair(layer, precision, rank, world, c["E"], ep, full if rank == 0 else None,
                list(x.chunk(world)), list(g.chunk(world)))


def leaf(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that takes a gradient."""
    return x.detach().clone().requires_grad_()


def step(module, x, g, pair: Pair):
    """One training step of ``module`` on the leaf ``x``, gradients set to None first: forward
    (under autocast for ``amp-bf16``), backward of ``g``, the load-balancing loss list cleared.
    Returns ``(output, input gradient, {parameter name: gradient})``."""
    from megablocks.layers.moe import clear_load_balancing_loss  # noqa: PLC0415
    module.zero_grad(set_to_none=True)
    x.grad = None
    with pair.autocast(x.device.type):
        y = module(x)
    y.backward(g.to(y.dtype))
    clear_load_balancing_loss()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters() if p.requires_grad}


def _gather(t: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def reference(pair: Pair) -> dict:
    """Rank 0: the full layer's step on every rank's tokens at once (the ``torch`` backend), by name."""
    if pair.reference is None:
        with backend_env(REFERENCE):
            y, xg, grads = step(pair.full, leaf(torch.cat(pair.xs)), torch.cat(pair.gs), pair)
        pair.reference = {"output": y, "x.grad": xg, **{f"{n}.grad": t for n, t in grads.items()}}
    return pair.reference


def check(pair: Pair, backend: str) -> dict:
    """One expert-parallel step with ``backend`` on every rank, compared on rank 0 with the full
    layer; the verdict (the same dict on every rank): ``errors`` (relative L2, by tensor),
    ``worst``, ``tol``, ``served`` (the backends that served the routing calls, per rank), ``ops``
    (the routing ops called, rank 0), ``ok`` and, where not ok, ``why``."""
    rank, world = pair.rank, pair.world
    with backend_env(backend), backends.trace() as calls:
        y, xg, grads = step(pair.ep, leaf(pair.xs[rank]), pair.gs[rank], pair)
    served = [None] * world
    dist.all_gather_object(served, sorted({c.backend for c in calls}))
    ops = sorted({c.op for c in calls})
    got = {"output": _gather(y, world), "x.grad": _gather(xg, world)}
    for name, t in grads.items():
        if name.startswith("experts.mlp."):
            got[f"{name}.grad"] = _gather(t, world)
        else:
            total = t.detach().clone()
            dist.all_reduce(total)
            got[f"{name}.grad"] = total
    verdict = [None]
    if rank == 0:
        want = reference(pair)
        errors = {}
        for name, t in got.items():
            expected = want[name]
            if name.startswith("experts.mlp."):
                expected = expected / world  # MegaBlocks' expert-parallel gradient scale
            errors[name] = rel_l2(t.float(), expected.float()) if t.shape == expected.shape else float("inf")
        tol = TOL[pair.precision]
        why = []
        if any(s != [backend] for s in served):
            why.append(f"routing calls served by {served}, not {backend} alone")
        need = {"gather", "scatter"} | ({"padded_gather", "sdd", "dsd"} if pair.layer == "dMoE-sparse" else set())
        if not need <= set(ops):
            why.append(f"routing ops {ops} lack {sorted(need - set(ops))}: not the expert-parallel path")
        bad = {n: e for n, e in errors.items() if not e <= tol}
        if bad:
            why.append("above tolerance: " + ", ".join(f"{n} {e:.2e}" for n, e in bad.items()))
        verdict = [dict(errors=errors, worst=max(errors.values()), tol=tol, served=served, ops=ops, ok=not why,
                        why="; ".join(why) or None, experts_per_rank=pair.experts // world)]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def check_single(pair: Pair, backend: str) -> dict:
    """World 1: the full layer (no expert parallelism) with ``backend`` against the reference."""
    with backend_env(backend):
        y, xg, grads = step(pair.full, leaf(pair.xs[0]), pair.gs[0], pair)
    got = {"output": y, "x.grad": xg, **{f"{n}.grad": t for n, t in grads.items()}}
    want = reference(pair)
    errors = {n: rel_l2(t.float(), want[n].float()) for n, t in got.items()}
    worst = max(errors.values())
    tol = TOL[pair.precision]
    return dict(errors=errors, worst=worst, tol=tol, ok=worst <= tol,
                why=None if worst <= tol else f"worst error {worst:.2e} above {tol:.1e}")
