"""Device-generic timing: synchronisation, device events, graph capture, the L2 flush.

One set of functions for a CUDA GPU, an Ascend NPU and the CPU, so that every benchmark times
the same way on each:

========  =====================================  ===============================================
device    :func:`do_bench` (host launch + device)  :func:`graph_ms` (device time)
========  =====================================  ===============================================
cuda      ``triton.testing.do_bench``, median      ``torch.cuda.CUDAGraph`` replays
npu       device events around each call after     ``torch.npu.NPUGraph`` replays where torch_npu
          an L2 flush (``triton.testing`` needs    has it; otherwise "not available" and no
          its driver's benchmarker), median        device-time column
cpu       wall time of one call (the Triton        not available
          interpreter: a smoke test, not a
          measurement)
========  =====================================  ===============================================

Synchronisation and events go through ``torch.accelerator`` / ``torch.Event`` where the installed
torch has them (2.6 and later) and the device is the current accelerator, and through the device's
own module (``torch.cuda``, ``torch.npu``) otherwise. A device that cannot be timed (an ``npu``
whose ``torch.npu`` lacks events or synchronisation, as a stand-in module in a test does) is
reported by :func:`timer` with the reason, and nothing on it is timed: :func:`do_bench` raises
:class:`NotTimed`, which callers turn into a "not timed" row.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import Callable

import torch

FLUSH_BYTES = 256 << 20  # what do_bench reads/writes between calls to empty a GPU's L2 (H200: 60 MiB)


class NotTimed(RuntimeError):
    """The device cannot be timed here (the message says why)."""


def module(device: torch.device):
    """``torch.cuda`` / ``torch.npu`` for an accelerator, None for the CPU."""
    return None if device.type == "cpu" else getattr(torch, device.type, None)


def _accelerator(device: torch.device):
    """``torch.accelerator`` when it exists and ``device`` is its current accelerator, else None."""
    acc = getattr(torch, "accelerator", None)
    current = getattr(acc, "current_accelerator", None)
    if current is None or not hasattr(acc, "synchronize"):
        return None
    try:
        kind = current()
    except Exception:  # noqa: BLE001 - no accelerator, or an old torch
        return None
    return acc if kind is not None and kind.type == device.type else None


@dataclasses.dataclass(frozen=True)
class Timer:
    """How a device is timed: ``kind`` is ``"events"`` (device events), ``"wall"`` (the CPU's clock)
    or ``"none"`` (cannot be timed; ``how`` says why)."""
    kind: str
    how: str

    @property
    def timed(self) -> bool:
        return self.kind != "none"


def timer(device: torch.device) -> Timer:
    """How :func:`do_bench` times ``device``, or why it cannot."""
    if device.type == "cpu":
        return Timer("wall", "wall clock of one call (time.perf_counter); the Triton interpreter on a CPU is a "
                             "smoke test, not a measurement")
    mod = module(device)
    if mod is None:
        return Timer("none", f"torch has no torch.{device.type} module")
    missing = [name for name in ("synchronize", "Event") if not callable(getattr(mod, name, None))]
    available = getattr(mod, "is_available", None)
    if not callable(available) or not available():
        return Timer("none", f"torch.{device.type}.is_available() is not true")
    if missing:
        return Timer("none", f"torch.{device.type} has no {' / '.join(missing)}: this {device.type} cannot be "
                             "timed (a stand-in device, or a torch_npu without device events)")
    if device.type == "cuda":
        return Timer("events", "triton.testing.do_bench (CUDA events, 256 MiB L2 flush before each call), median")
    return Timer("events", f"torch.{device.type}.Event around each call after a 256 MiB L2 flush, median")


def synchronize(device: torch.device) -> None:
    if device.type == "cpu":
        return
    acc = _accelerator(device)
    if acc is not None:
        acc.synchronize(device)
    else:
        module(device).synchronize(device)


def empty_cache(device: torch.device) -> None:
    if device.type == "cpu":
        return
    acc = _accelerator(device)
    if acc is not None and hasattr(acc, "empty_cache"):
        acc.empty_cache()
    elif hasattr(module(device), "empty_cache"):
        module(device).empty_cache()


def memory_allocated(device: torch.device) -> int | None:
    """Bytes the caching allocator has handed out on ``device`` now (None on the CPU, or where the
    device module cannot say)."""
    fn = getattr(module(device), "memory_allocated", None)
    return None if device.type == "cpu" or fn is None else int(fn(device))


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now, to the driver (``mem_get_info``; memory the caching allocator
    holds counts as used), or None on the CPU or where the device module cannot say."""
    fn = getattr(module(device), "mem_get_info", None)
    return None if device.type == "cpu" or fn is None else int(fn(device)[0])


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for :func:`peak_memory_allocated` on ``device`` (nothing on the CPU)."""
    fn = getattr(module(device), "reset_peak_memory_stats", None)
    if device.type != "cpu" and fn is not None:
        fn(device)


def peak_memory_allocated(device: torch.device) -> int | None:
    """The most bytes allocated on ``device`` since :func:`reset_peak_memory` (None on the CPU)."""
    fn = getattr(module(device), "max_memory_allocated", None)
    return None if device.type == "cpu" or fn is None else int(fn(device))


def event(device: torch.device):
    """A timing event on ``device``: ``torch.Event`` where the installed torch has it, else the
    device module's ``Event``."""
    if hasattr(torch, "Event") and _accelerator(device) is not None:
        try:
            return torch.Event(device=device.type, enable_timing=True)
        except Exception:  # noqa: BLE001 - an older torch.Event signature: the module's own
            pass
    return module(device).Event(enable_timing=True)


def _require(device: torch.device) -> Timer:
    t = timer(device)
    if not t.timed:
        raise NotTimed(t.how)
    return t


_FLUSH: dict = {}


def flush_buffer(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _FLUSH:
        _FLUSH[key] = torch.ones(FLUSH_BYTES, dtype=torch.int8, device=device)
    return _FLUSH[key]


def _event_bench(fn: Callable, device: torch.device, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median ms of ``fn`` between device events, an L2 flush (a 256 MiB memset) before each call:
    what ``triton.testing.do_bench`` does, with the device's own events."""
    buf = flush_buffer(device)
    fn()
    synchronize(device)
    start, end = event(device), event(device)
    start.record()
    for _ in range(5):
        buf.zero_()
        fn()
    end.record()
    synchronize(device)
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    times = []
    for _ in range(max(1, int(rep_ms / estimate))):
        start, end = event(device), event(device)
        buf.zero_()
        start.record()
        fn()
        end.record()
        synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def do_bench(fn: Callable, device: torch.device, grad_to_none=None, repeats: int = 3) -> float:
    """Median milliseconds of ``fn`` (host launch + device): the median of ``repeats`` back-to-back
    medians.

    On the H200 the first do_bench of an op after other work sometimes ran up to 2x slower than the
    same call measured again right after (docs/notes/h200-speed.md, v10); the median of three takes
    that out, equally for every implementation. On the CPU (the Triton interpreter): one timed call,
    a smoke test, not a measurement."""
    t = _require(device)
    if t.kind == "wall":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if device.type == "cuda":
        import triton  # noqa: PLC0415
        runs = sorted(float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                                    return_mode="median")) for _ in range(repeats))
    else:
        runs = []
        for _ in range(repeats):
            if grad_to_none is not None:
                for p in grad_to_none:
                    p.grad = None
            runs.append(_event_bench(fn, device))
        runs.sort()
    return runs[len(runs) // 2]


@dataclasses.dataclass(frozen=True)
class GraphAPI:
    """A device's graph capture: ``Graph()``, ``with capture(g):``, ``Stream()``, ``with stream(s):``,
    ``current_stream()``."""
    name: str
    Graph: Callable
    capture: Callable
    Stream: Callable
    stream: Callable
    current_stream: Callable


def graph_api(device: torch.device) -> tuple[GraphAPI | None, str]:
    """``(api, what)``: the device's graph capture and its name, or ``(None, why not)``. CUDA has
    CUDA graphs; an NPU has ``torch.npu.NPUGraph`` / ``torch.npu.graph`` where its torch_npu provides
    them; the CPU has none."""
    if device.type == "cpu":
        return None, "not available: no graph capture on the CPU"
    mod = module(device)
    if device.type == "cuda":
        return GraphAPI("CUDA graphs (torch.cuda.CUDAGraph)", mod.CUDAGraph, mod.graph, mod.Stream, mod.stream,
                        mod.current_stream), "CUDA graphs (torch.cuda.CUDAGraph)"
    names = ("NPUGraph", "graph", "Stream", "stream", "current_stream")
    missing = [n for n in names if not callable(getattr(mod, n, None))] if mod is not None else list(names)
    if missing:
        return None, f"not available: torch.{device.type} has no {', '.join(missing)}"
    if not timer(device).timed:
        return None, f"not available: {timer(device).how}"
    return GraphAPI("torch.npu.NPUGraph", mod.NPUGraph, mod.graph, mod.Stream, mod.stream,
                    mod.current_stream), "torch.npu.NPUGraph"


def graph_ms(fn: Callable, device: torch.device, n: int = 20, replays: int = 7, log=print) -> float | None:
    """Median device milliseconds of ``fn`` from graph replays, without host launch cost.

    One graph holds ``n`` x (L2 flush, ``fn``), another ``n`` x (L2 flush); the difference over ``n``
    is ``fn``'s device time. The flush reads 256 MiB (a read leaves no dirty lines behind to be
    written back during ``fn``). None where the device has no graph capture or ``fn`` cannot be
    captured (a host sync inside)."""
    api, _ = graph_api(device)
    if api is None:
        return None
    buf = flush_buffer(device)

    def flush():
        buf.max()

    def replay_ms(graph):
        times = []
        for _ in range(replays):
            a, b = event(device), event(device)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    try:
        fn()
        flush()
        synchronize(device)
        side = api.Stream()
        side.wait_stream(api.current_stream())
        with api.stream(side):  # warm up on a side stream, as capture requires
            fn()
            flush()
        api.current_stream().wait_stream(side)
        synchronize(device)
        g, g0 = api.Graph(), api.Graph()
        with api.capture(g):
            for _ in range(n):
                flush()
                fn()
        with api.capture(g0):
            for _ in range(n):
                flush()
        ms = (replay_ms(g) - replay_ms(g0)) / n
        del g, g0
        return ms
    except Exception as e:  # noqa: BLE001
        log(f"    (no graph timing: {type(e).__name__}: {str(e)[:120]})")
        synchronize(device)
        return None


def host_us(fn: Callable, device: torch.device, iters: int = 200) -> float:
    """Host microseconds per call (device work kept small so that the host is the bottleneck)."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    synchronize(device)
    return (t1 - t0) / iters * 1e6


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the tile sweeps' grid unit); 4 elsewhere."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


# ------------------------------------------------------------------------------------------
# A training step, timed (the step harnesses: ``steps``, ``expert_parallel_steps``)

# Matrix-multiply kernels, by name (CUDA): cuBLAS (gemm, xmma, nvjet), CUTLASS (torch._grouped_mm),
# our block-sparse matmuls (kernels/blocksparse.py).
GEMM_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|\b_sdd|\b_dsd|\b_dds", re.IGNORECASE)


def time_steps(run, device, steps):
    """``(wall ms, host ms)`` per step, medians over ``steps`` consecutive steps."""
    host = []
    if timer(device).kind == "events":
        events = [event(device) for _ in range(steps + 1)]
        for i in range(steps):
            events[i].record()
            t0 = time.perf_counter()
            run()
            host.append((time.perf_counter() - t0) * 1e3)
        events[steps].record()
        synchronize(device)
        wall = [events[i].elapsed_time(events[i + 1]) for i in range(steps)]
        return statistics.median(wall), statistics.median(host)
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(host), statistics.median(host)


def enqueue_time(run, device, steps):
    """Host ms to enqueue one step onto an idle device (synchronized before and after each step),
    the median over ``steps``: the host cost of the step itself. ``host ms`` (consecutive steps)
    also holds the waits for the device once it is the bottleneck (a full launch queue, an
    allocator call that synchronizes), so where wall ~ host it cannot tell a host-bound step from
    a device-bound one; this can. A step with a sync inside still waits for the device up to it."""
    if timer(device).kind != "events":
        return None
    host = []
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e3)
    synchronize(device)
    return statistics.median(host)


def kernel_times(run, device, steps):
    """GPU time per step by kernel name (ms): the kernels (and memcpy/memset) torch.profiler records
    over ``steps`` steps, divided by them; ``{}`` off CUDA."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t, n = per.get(e.name, (0.0, 0))
            per[e.name] = (t + (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)), n + 1)
    return {name: (t / steps / 1e3, n / steps) for name, (t, n) in per.items()}


def breakdown(times, top=8):
    """kernel ms, gemm ms, other ms and the largest other kernels of a step, from kernel_times."""
    if not times:
        return {}
    gemm = sum(t for name, (t, _) in times.items() if GEMM_KERNEL.search(name))
    total = sum(t for t, _ in times.values())
    others = sorted(((t, n, name) for name, (t, n) in times.items() if not GEMM_KERNEL.search(name)), reverse=True)
    return dict(kernel_ms=total, gemm_ms=gemm, other_ms=total - gemm,
                top_other=[dict(name=name[:300], ms=t, calls=n) for t, n, name in others[:top]])


def wall_ms(fn: Callable, device: torch.device, repeat: int, warmup: int = 3) -> float:
    """Median wall milliseconds of one call of ``fn`` and a synchronization of ``device`` (what a
    caller that waits for the result pays, host and device together), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3
