"""Expert parallelism under ``torchrun``: parity with one process, and a training step timed per backend.

``benchmarks/bench_expert_parallel.py`` is its command line. Launched on N processes (one device
each: ``torchrun --nproc-per-node N``; a plain ``python`` run is N = 1), every rank builds
MegaBlocks' unchanged ``MoE``, ``dMoE`` (grouped MLP) and sparse ``dMoE`` with
``moe_expert_model_parallelism=True`` over the world (:mod:`~megablocks_ascend.bench.expert_parallel`),
then for each backend:

``parity``  one step of the expert-parallel layer on every rank, its outputs and gradients
            compared on rank 0 with the same layer holding every expert in one process, run by rank
            0 on every rank's tokens with the ``torch`` backend (relative L2 per tensor, within
            ``expert_parallel.TOL`` of the precision); a row that fails is not timed;
``step``    per rank, the median wall ms of ``--steps`` consecutive training steps (device events
            at each step's start; on the CPU the host clock) and the host ms per step;
``a2a``     per rank and step, the ``torch.distributed.all_to_all_single`` calls, their bytes sent
            and their host ms (wrapped for a few steps: a synchronous call's duration, an
            asynchronous one's from the call until its ``wait()`` returns). Over gloo (CPU) that is
            the exchange itself; NCCL and HCCL run collectives on their own streams, so there it is
            the host's view, and on CUDA ``comm ms`` is the device time of the NCCL kernels
            (``torch.profiler``; it includes waiting for the slowest rank);
``kernels`` per rank and step, the CUDA kernels ``torch.profiler`` records (CUDA only), and
            ``launches``: the aten ops that launch a kernel, the Triton launches and the
            collectives (:class:`~megablocks_ascend.bench.instruments.LaunchCounter`, every device).

The backends: ours (``ascend``) against upstream's kernels (``cuda``) on CUDA, against the
``torch`` backend elsewhere (``--backends``), in the same process on the same weights. At N = 1 each
backend also runs the layer without expert parallelism (``ep`` false): the single-rank baseline.
MegaBlocks refuses to build the sparse dMoE for ``cuda`` (Triton >= 3.2); that row says so.

Devices: ``cuda`` (NCCL, NVLink multicast off unless ``NCCL_NVLS_ENABLE`` says otherwise), ``npu``
(HCCL through torch_npu), ``cpu`` (gloo; the Triton interpreter: a smoke test, not a measurement).
Rank 0 writes ``NAME.json`` (environment, settings, every row with every rank's figures) and
``NAME.log`` under ``--out`` after each row; the exit status is 1 when a parity check fails.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import tempfile
import time

import torch
import torch.distributed as dist

from megablocks_ascend.bench import expert_parallel as ep_check
from megablocks_ascend.bench import timing
from megablocks_ascend.bench.instruments import LaunchCounter
from megablocks_ascend.bench.layers import backend_env

PG_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
COMM_KERNEL = re.compile(r"nccl|hccl|alltoall|all_to_all|sendrecv", re.IGNORECASE)
CONFIGS_DEFAULT = ("qw128", "mixtral")


@dataclasses.dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    pg_backend: str


def init(device_type: str, timeout_s: float = 600) -> Ranks:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``), or make a group of one for a plain ``python`` run; each rank
    on its local device (``cuda:LOCAL_RANK``, ``npu:LOCAL_RANK``, the CPU)."""
    if device_type not in PG_BACKENDS:
        raise ValueError(f"device must be one of {', '.join(PG_BACKENDS)}, got {device_type!r}")
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, local)
    if device.type != "cpu":
        count = timing.module(device).device_count()
        if local >= count:
            raise RuntimeError(f"rank {rank}: local rank {local} but torch.{device.type} sees {count} device(s)")
        timing.module(device).set_device(local)
    if device.type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
    kwargs = dict(timeout=datetime.timedelta(seconds=timeout_s))
    if device.type == "cuda":
        kwargs["device_id"] = device  # NCCL's barrier and object collectives on this rank's GPU
    if not launched:  # a plain run: a group of one, meeting at a fresh file (no TCP port to race for)
        store = os.path.join(tempfile.mkdtemp(prefix="megablocks-ascend-ep-"), "store")
        kwargs.update(init_method=f"file://{store}", rank=0, world_size=1)
    dist.init_process_group(PG_BACKENDS[device.type], **kwargs)
    return Ranks(rank, world, local, device, PG_BACKENDS[device.type])


class _TimedWork:
    """An asynchronous collective's handle whose ``wait()`` completes the call's record."""

    def __init__(self, work, record, t0):
        self._work, self._record, self._t0 = work, record, t0

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if "ms" not in self._record:
            self._record["ms"] = (time.perf_counter() - self._t0) * 1e3
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


class AllToAllTimer:
    """``with AllToAllTimer() as a2a: ...``: every ``torch.distributed.all_to_all_single`` call of
    the block (MegaBlocks looks it up on the module at each call) with its bytes sent and its host
    ms: a synchronous call's duration, an asynchronous one's from the call until ``wait()`` returns."""

    def __init__(self):
        self.calls: list[dict] = []
        self._original = None

    def __enter__(self):
        self._original = original = dist.all_to_all_single
        calls = self.calls

        def all_to_all_single(output, input, *args, **kwargs):
            async_op = kwargs.get("async_op", args[3] if len(args) > 3 else False)
            record = {"bytes": input.numel() * input.element_size(), "async": bool(async_op)}
            calls.append(record)
            t0 = time.perf_counter()
            work = original(output, input, *args, **kwargs)
            if async_op:
                return _TimedWork(work, record, t0)
            record["ms"] = (time.perf_counter() - t0) * 1e3
            return work

        all_to_all_single.__wrapped__ = original
        dist.all_to_all_single = all_to_all_single
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._original

    def per_step(self, steps: int) -> dict:
        return dict(a2a_calls=len(self.calls) / steps, a2a_bytes=sum(c["bytes"] for c in self.calls) / steps,
                    a2a_ms=sum(c.get("ms", 0.0) for c in self.calls) / steps if self.calls else None,
                    a2a_unwaited=sum("ms" not in c for c in self.calls))


@dataclasses.dataclass
class Settings:
    """What runs and how (``benchmarks/bench_expert_parallel.py``'s options)."""
    configs: dict
    tokens: int  # per rank
    layers: tuple = ep_check.LAYERS
    backends: tuple = ("ascend", "cuda")
    precision: str = "bf16"
    capacity_factor: float = 1.0
    steps: int = 20
    warmup: int = 3
    profile_steps: int = 3
    a2a_steps: int = 3
    timed: bool = True


def measure(run, device: torch.device, s: Settings) -> dict:
    """One rank's figures for ``run`` (one training step), every rank running the same calls."""
    for _ in range(s.warmup):
        run()
    timing.synchronize(device)
    dist.barrier()
    out = {}
    out["wall_ms"], out["host_ms"] = timing.time_steps(run, device, s.steps)
    dist.barrier()
    times = timing.kernel_times(run, device, s.profile_steps) if s.profile_steps else {}
    if times:
        out["kernels"] = sum(n for _, n in times.values())
        out["kernel_ms"] = sum(t for t, _ in times.values())
        out["comm_kernels"] = sum(n for name, (_, n) in times.items() if COMM_KERNEL.search(name))
        out["comm_ms"] = sum(t for name, (t, _) in times.items() if COMM_KERNEL.search(name))
    dist.barrier()
    with AllToAllTimer() as a2a:
        for _ in range(s.a2a_steps):
            run()
        timing.synchronize(device)
    out.update(a2a.per_step(s.a2a_steps))
    dist.barrier()
    with LaunchCounter(device=None if device.type == "cpu" else device.type) as counted:
        run()
    timing.synchronize(device)
    out.update(launches=counted.total, aten=counted.aten, triton=counted.triton, collectives=counted.collectives)
    return out


def _gather_rows(ranks: Ranks, mine: dict) -> list:
    every = [None] * ranks.world
    dist.all_gather_object(every, dict(mine, rank=ranks.rank, device=str(ranks.device)))
    return every


SUMMARY = ("wall_ms", "host_ms", "a2a_ms", "comm_ms")


def summarize(row: dict) -> dict:
    """The slowest rank's figure of each of :data:`SUMMARY` (a step ends when every rank's does),
    and the counts of rank 0."""
    per = row.get("per_rank") or []
    for key in SUMMARY:
        values = [r[key] for r in per if r.get(key) is not None]
        if values:
            row[key] = max(values)
    for key in ("kernels", "launches", "collectives", "a2a_calls", "a2a_bytes"):
        if per and per[0].get(key) is not None:
            row[key] = per[0][key]
    return row


def rows_of(config: str, c: dict, layer: str, s: Settings, ranks: Ranks, log) -> list[dict]:
    """The rows of one (config, layer): each backend's parity and step, and at N = 1 each backend's
    step without expert parallelism."""
    base = dict(config=config, layer=layer, world=ranks.world, tokens_per_rank=s.tokens, precision=s.precision,
                H=c["H"], ffn=c["ffn"], E=c["E"], k=c["k"])
    why = ep_check.why_not(layer, c, ranks.world)
    if why:
        return [dict(base, backend=b, ep=True, skipped=why) for b in s.backends]
    pair = ep_check.build(layer, c, s.tokens, s.precision, ranks.device, ranks.rank, ranks.world,
                          capacity_factor=s.capacity_factor)
    rows = []
    variants = [(b, True) for b in s.backends] + ([(b, False) for b in s.backends] if ranks.world == 1 else [])
    for backend, ep in variants:
        row = dict(base, backend=backend, ep=ep)
        refused = ep_check.refusal(layer, c, s.precision, ranks.device, backend)
        if refused:
            rows.append(dict(row, refused=refused))
            log(f"  {config:8s} {layer:12s} {backend:6s} ep={ep!s:5s} refused: {refused[:150]}")
            continue
        verdict = ep_check.check(pair, backend) if ep else ep_check.check_single(pair, backend)
        row.update(parity=verdict, ok=verdict["ok"])
        if verdict["ok"] and s.timed:
            module = pair.ep if ep else pair.full
            x, g = ep_check.leaf(pair.xs[ranks.rank]), pair.gs[ranks.rank]
            with backend_env(backend):
                mine = measure(lambda: ep_check.step(module, x, g, pair), ranks.device, s)
            row["per_rank"] = _gather_rows(ranks, mine)
            summarize(row)
        rows.append(row)
        log(line(row))
        timing.synchronize(ranks.device)
    del pair
    timing.empty_cache(ranks.device)
    return rows


def compare(rows: list[dict], baseline: str) -> None:
    """``vs_baseline``: the wall ms of ``baseline``'s row (same config, layer and ep) over each row's."""
    walls = {(r["config"], r["layer"], r["ep"]): r["wall_ms"] for r in rows
             if r["backend"] == baseline and r.get("wall_ms")}
    for r in rows:
        base = walls.get((r["config"], r["layer"], r["ep"]))
        if base and r.get("wall_ms"):
            r["vs_baseline"] = base / r["wall_ms"]


def _f(value, spec, width):
    return ("-" if value is None else format(value, spec)).rjust(width)


HEAD = (f"  {'config':8s} {'layer':12s} {'backend':6s} {'ep':5s} {'parity':>8s} {'wall ms':>8s} {'host ms':>8s} "
        f"{'a2a ms':>7s} {'comm ms':>7s} {'a2a':>4s} {'a2a MiB':>7s} {'kernels':>7s} {'launch':>6s} {'vs base':>7s}")


def line(r: dict) -> str:
    lead = f"  {r['config']:8s} {r['layer']:12s} {r['backend']:6s} {r['ep']!s:5s} "
    if "skipped" in r:
        return lead + "skipped: " + r["skipped"]
    if "refused" in r:
        return lead + "refused: " + r["refused"][:120]
    p = r.get("parity", {})
    text = (lead + _f(p.get("worst"), ".1e", 8) + " " + _f(r.get("wall_ms"), ".3f", 8) + " "
            + _f(r.get("host_ms"), ".3f", 8) + " " + _f(r.get("a2a_ms"), ".3f", 7) + " "
            + _f(r.get("comm_ms"), ".3f", 7)
            + " " + _f(r.get("a2a_calls"), ".0f", 4) + " "
            + _f(None if r.get("a2a_bytes") is None else r["a2a_bytes"] / 2**20, ".2f", 7) + " "
            + _f(r.get("kernels"), ".0f", 7) + " " + _f(r.get("launches"), "d", 6) + " "
            + _f(r.get("vs_baseline"), ".2f", 6) + "x")
    return text + ("" if r.get("ok", True) else f"  FAIL: {p.get('why')}")


def per_rank_lines(rows: list[dict]) -> list[str]:
    out = ["per rank (wall ms, a2a ms, comm ms, kernels, launches = aten + Triton + collectives):"]
    for r in rows:
        for p in r.get("per_rank") or []:
            out.append(f"  {r['config']:8s} {r['layer']:12s} {r['backend']:6s} ep={r['ep']!s:5s} rank {p['rank']} "
                       f"{p['device']:7s} wall {_f(p.get('wall_ms'), '.3f', 8)}  a2a {_f(p.get('a2a_ms'), '.3f', 7)}"
                       f"  comm {_f(p.get('comm_ms'), '.3f', 7)}  kernels {_f(p.get('kernels'), '.0f', 5)}  "
                       f"launches {p['launches']} = {p['aten']} + {p['triton']} + {p['collectives']}")
    return out


def run(s: Settings, ranks: Ranks, log, save=None) -> list[dict]:
    """Every row, on every rank (rank 0's hold the verdicts and every rank's figures); ``save(rows)``
    after each (config, layer)."""
    rows = []
    for config, c in s.configs.items():
        for layer in s.layers:
            rows.extend(rows_of(config, c, layer, s, ranks, log))
            if save is not None:
                save(rows)
    compare(rows, "cuda" if "cuda" in s.backends else "torch")
    return rows
