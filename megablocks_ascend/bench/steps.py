"""The layer-step harness: one MegaBlocks MoE / dMoE training step (forward + backward), per variant.

``benchmarks/bench_steps.py`` is its command line, and ``python -m megablocks_ascend bench`` runs its
steps rows with it.

A variant is one value of each field below; the default set is the product of the defaults, and
``--only FIELD=V1,V2`` (repeatable) picks other values (``--only mode=compile,compile-ro``,
``--only config=qw128 --only backend=ascend``; ``all`` takes every value of a field):

==========  ================================================  =====================
field       values                                            default
==========  ================================================  =====================
config      ``ds64`` H=2048 ffn=1408 E=64 top_k=6             all seven
            ``qw128`` H=2048 ffn=768 E=128 top_k=8
            ``mixtral`` H=4096 ffn=14336 E=8 top_k=2
            ``small`` H=4096 ffn=1792 E=8 top_k=2 (host-bound)
            ``dsv3`` H=7168 ffn=2048 E=256 top_k=8
            (DeepSeek-V3's layer: 15 GB of bf16
            expert weights)
            ``qw3`` H=4096 ffn=1536 E=128 top_k=8
            (Qwen3-235B's layer)
            ``e256`` H=2048 ffn=1024 E=256 top_k=8
            (T=8192 tokens each)
layer       ``dMoE`` (dropless), ``MoE`` (capacity factor 1)   both
backend     ``ascend`` (ours), ``cuda`` (upstream's kernels),  ascend, cuda
            ``torch`` (the plain-PyTorch reference)
mode        ``eager``; ``graph``: the whole step captured in   eager, graph
            one graph (``torch.cuda.graph``; on an NPU
            ``torch.npu.graph``) and replayed;
            ``compile``: ``torch.compile`` (inductor);
            ``compile-ro``: ``mode="reduce-overhead"``
precision   ``bf16`` (bf16 parameters and input);              bf16
            ``amp-bf16`` (fp32 parameters, step under
            ``torch.autocast(dtype=bfloat16)``)
mlp_impl    ``grouped``, ``sparse`` (dMoE only; passed to       grouped
            ``Arguments``)
mlp_type    ``mlp``, ``glu`` (dMoE only; passed to              mlp
            ``Arguments``)
wgrad_fill  how the grouped GEMM zeroes the weight gradients   empty
            of experts without tokens (dMoE grouped only):
            ``empty``: the blocks of those experts only (this
            version); ``full``: a masked fill over the whole
            gradient, as earlier versions did (before/after)
==========  ================================================  =====================

Every variant is one row; a variant that fails (an unsupported combination, a capture that does
not work) is an error row with the exception, and the run goes on. Per row:

``wall ms``    per step, the median over ``--steps`` consecutive steps of the time between device
               events recorded on the stream at each step's start: the stream's view of the
               step, idle gaps (host-bound stretches, syncs) included;
``host ms``    per step, the median host time of one ``step()`` call (enqueue; a sync inside
               the step makes it wait);
``enq ms``     eager only: host ms to enqueue one step onto an idle device (a sync before and
               after it), median: the step's own host cost, where ``host ms`` of consecutive steps
               also holds the waits for a device that is the bottleneck;
``kernel ms``  per step, the sum of the durations of the GPU kernels (and memcpy/memset) that
               ``torch.profiler`` records over ``--profile-steps`` steps, divided by them;
``gemm ms``    the part of kernel ms spent in matrix-multiply kernels (kernel names matching
               ``GEMM_KERNEL``: cuBLAS/CUTLASS GEMMs, torch._grouped_mm, our block-sparse
               ``_sdd``/``_dsd``/``_dds``); ``other ms`` = kernel ms - gemm ms; the JSON lists
               the largest other kernels per step (``top_other``);
``floor ms``   dMoE only: gemm ms + the step's routing bytes at the copy ceiling (``routing_ms``):
               the minimal bytes of its two gathers, two scatters and one router-weight
               gradient as ``routing_ops.min_bytes`` counts them (dropless: every assignment kept,
               no padding), divided by the copy rate ``routing_table.copy_ceiling`` measures
               at the start of the run; ``x floor`` = wall ms / floor ms;
``busy``       kernel ms / wall ms;
``syncs``      synchronizing CUDA calls per eager step (``torch.cuda.set_sync_debug_mode``);
``launches``   per eager step, the aten ops that launch a device kernel plus the Triton launches
               (:class:`~megablocks_ascend.bench.launches.LaunchCounter`: what the CPU regression test
               counts, on this device); ``--launches-by-line`` keeps each row's launches by
               source line in the JSON;
``kernels``    per step, the GPU kernels (and memcpy/memset) ``torch.profiler`` records, the
               same ones ``kernel ms`` sums (one aten op can be several: a radix sort is ~10);
``vs up``      the wall time of upstream's eager step (``cuda`` backend, ``eager``, same config,
               layer, precision and mlp_impl; for ``sparse`` rows upstream's grouped step, as
               upstream refuses the sparse MLP with Triton >= 3.2) divided by this row's: > 1 is faster;
``vs grp``     sparse rows: the grouped step's wall time (same backend, mode, config) divided by
               this row's: > 1 is faster;
``peak MiB``   the most memory allocated on the device while the variant was built and ran its first
               steps (a graph's capture included), above what was allocated before: one step's
               activations, gradients and workspaces; ``mem`` = this row's peak over upstream's
               (``cuda`` backend, the same mode where it ran, else eager; for ``sparse`` rows
               upstream's grouped step): < 1 takes less;
``err``        largest relative (L2) error of the step's output and every gradient against
               upstream's eager step (sparse rows: upstream's grouped step on the same parameters),
               and ``self`` against this backend's eager step; a row whose error is above ``TOL`` is
               marked FAIL and not timed. Computed in float64 a chunk at a time
               (``precision.rel_l2``); the results compared with later rows are kept on the host
               when they exceed ``Settings.host_snapshot_bytes`` (a DeepSeek-V3 layer's gradients
               are 15 GB in bf16). A graph row whose backend's eager step syncs is an error row, not
               captured (a failed capture can break every later step of the process).

The layers of one (config, layer, precision, mlp_impl) share their parameters across backends
and modes, so every row computes the same step from the same values. One layer lives at a time:
a family's layer, inputs and kept results are released before the next family's are built.

    python benchmarks/bench_steps.py                       # default set (H200: a few minutes)
    python benchmarks/bench_steps.py --only mode=compile,compile-ro --only config=qw128
    python benchmarks/bench_steps.py --quick               # CPU smoke test (interpreter)
    python benchmarks/bench_steps.py --only layer=dMoE --only mlp_type=mlp,glu --only wgrad_fill=empty,full

``--quick`` runs tiny configs on the CPU with ``torch`` as the reference backend (no CUDA there):
it checks that the harness works, and measures nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import os
import re
import statistics
import time
import traceback
import warnings

import torch

from megablocks_ascend import backends
from megablocks_ascend.bench import timing
from megablocks_ascend.bench.launches import LaunchCounter
from megablocks_ascend.bench.precision import rel_l2

TOKENS = 8192
CONFIGS = {
    "ds64": dict(H=2048, ffn=1408, E=64, k=6),
    "qw128": dict(H=2048, ffn=768, E=128, k=8),
    "mixtral": dict(H=4096, ffn=14336, E=8, k=2),
    "small": dict(H=4096, ffn=1792, E=8, k=2),
    # Today's fine-grained MoE layers (issue 33): DeepSeek-V3, Qwen3-235B, and 256 experts at a
    # smaller hidden size.
    "dsv3": dict(H=7168, ffn=2048, E=256, k=8),
    "qw3": dict(H=4096, ffn=1536, E=128, k=8),
    "e256": dict(H=2048, ffn=1024, E=256, k=8),
}
QUICK_TOKENS = 32
QUICK_CONFIGS = {"tiny": dict(H=64, ffn=128, E=4, k=2), "tiny16": dict(H=32, ffn=64, E=16, k=4)}

FIELDS = {
    "config": tuple(CONFIGS),
    "layer": ("dMoE", "MoE"),
    "backend": ("ascend", "cuda", "torch"),
    "mode": ("eager", "graph", "compile", "compile-ro"),
    "precision": ("bf16", "amp-bf16"),
    "mlp_impl": ("grouped", "sparse"),
    "mlp_type": ("mlp", "glu"),
    "wgrad_fill": ("empty", "full"),
}
DEFAULT = {"config": tuple(CONFIGS), "layer": ("dMoE", "MoE"), "backend": ("ascend", "cuda"),
           "mode": ("eager", "graph"), "precision": ("bf16",), "mlp_impl": ("grouped", "sparse"),
           "mlp_type": ("mlp",), "wgrad_fill": ("empty",)}
TOL = 2e-2  # relative L2 error of bf16 steps (different routing kernels round differently)
# Matrix-multiply kernels, by name (CUDA): cuBLAS (gemm, xmma, nvjet), CUTLASS (torch._grouped_mm),
# our block-sparse matmuls (kernels/blocksparse.py).
GEMM_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|\b_sdd|\b_dsd|\b_dds", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Variant:
    config: str
    layer: str
    backend: str
    mode: str
    precision: str
    mlp_impl: str
    mlp_type: str
    wgrad_fill: str

    @property
    def family(self):
        """The variants that share parameters (and a reference)."""
        return (self.config, self.layer, self.precision, self.mlp_impl, self.mlp_type)

    def name(self):
        return " ".join(f"{getattr(self, f)}" for f in FIELDS)


def select(only, quick):
    chosen = dict(DEFAULT)
    if quick:
        chosen.update(config=tuple(QUICK_CONFIGS), backend=("ascend", "torch"), mode=("eager",))
    fields = dict(FIELDS, config=tuple(QUICK_CONFIGS) if quick else tuple(CONFIGS))
    asked = set()
    for term in only:
        key, _, values = term.partition("=")
        if key not in fields or not values:
            raise SystemExit(f"--only {term!r}: expected FIELD=V1[,V2] with FIELD in {', '.join(fields)}")
        picked = fields[key] if values == "all" else tuple(values.split(","))
        bad = [v for v in picked if v not in fields[key]]
        if bad:
            raise SystemExit(f"--only {term!r}: unknown {key} {bad}; known: {', '.join(fields[key])}")
        chosen[key] = picked
        asked.add(key)
    out = []
    for values in itertools.product(*(chosen[f] for f in FIELDS)):
        v = Variant(*values)
        if v.layer == "MoE" and (v.mlp_impl, v.mlp_type) != (chosen["mlp_impl"][0], chosen["mlp_type"][0]):
            continue  # MoE's experts are a batched MLP: mlp_impl and mlp_type do not apply, one row
        if v.mlp_impl == "sparse" and v.backend == "cuda" and not {"backend", "mlp_impl"} <= asked:
            continue  # upstream refuses the sparse MLP with Triton >= 3.2 (stk's kernels overflow): ask for it
        if v.mlp_impl == "sparse" and (v.layer == "MoE" or (QUICK_CONFIGS if quick else CONFIGS)[v.config]["ffn"] % 128):
            continue  # the sparse MLP is dMoE's, in blocks of 128 columns of ffn (MegaBlocks' topology)
        if v.wgrad_fill != chosen["wgrad_fill"][0] and (v.layer, v.mlp_impl) != ("dMoE", "grouped"):
            continue  # only the grouped dMoE computes weight gradients with the grouped GEMM
        out.append(v)
    return out


# ------------------------------------------------------------------------------------------
# One layer, one step


def build_layer(c: dict, layer: str, dtype: torch.dtype, device: torch.device, mlp_impl: str = "grouped",
                mlp_type: str = "mlp"):
    """MegaBlocks' ``layer`` (``"dMoE"`` or ``"MoE"``, capacity factor 1, ``return_bias=False``) of the
    config ``c`` (H, ffn, E, k), parameters in ``dtype`` (bfloat16, float16 or float32) on ``device``."""
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE  # noqa: PLC0415
    args = Arguments(hidden_size=c["H"], ffn_hidden_size=c["ffn"], moe_num_experts=c["E"], moe_top_k=c["k"],
                     moe_capacity_factor=1, mlp_impl=mlp_impl, mlp_type=mlp_type, bf16=dtype == torch.bfloat16,
                     fp16=dtype == torch.float16, return_bias=False,
                     device=torch.cuda.current_device() if device.type == "cuda" else device)
    return {"dMoE": dMoE, "MoE": MoE}[layer](args)


class Case:
    """The layer (parameters shared by every variant of its family), input and output gradient."""

    def __init__(self, family, device, tokens, configs):
        config, layer, precision, mlp_impl, mlp_type = family
        c = configs[config]
        self.precision = precision
        self.device = device
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        torch.manual_seed(0)
        # MegaBlocks refuses mlp_impl="sparse" unless stk's matmuls are ours (patches/sparse-mlp-refusal.md):
        # built under ascend; each variant then runs under its own backend. Same parameters as the
        # grouped layer of the config (same initialisation, same layout), so they share a reference.
        with backend_env("ascend") if mlp_impl == "sparse" else contextlib.nullcontext():
            self.layer = build_layer(c, layer, self.dtype, device, mlp_impl, mlp_type)
        gen = torch.Generator(device=device).manual_seed(1)
        self.x = torch.randn(tokens, 1, c["H"], device=device, generator=gen).to(self.dtype).requires_grad_()
        self.g = torch.randn(tokens, 1, c["H"], device=device, generator=gen).to(self.dtype)
        self.params = [p for p in self.layer.parameters() if p.requires_grad]

    def autocast(self):
        if self.precision == "amp-bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def zero_grad(self):
        self.x.grad = None
        for p in self.params:
            p.grad = None

    def step_fn(self, module):
        from megablocks.layers.moe import clear_load_balancing_loss  # noqa: PLC0415

        def step():
            with self.autocast():
                y = module(self.x)
            y.backward(self.g)
            clear_load_balancing_loss()
            return y
        return step

    def results(self, y):
        return [y] + [t.grad for t in [self.x] + self.params]


def rel_err(got, want) -> float:
    """The largest relative L2 error of ``got``'s tensors against ``want``'s (chunked: no whole-tensor
    float64 or float32 copy; either side may be kept on the host, :func:`snapshot`)."""
    worst = 0.0
    for a, b in zip(got, want):
        if a is None or b is None:
            if (a is None) != (b is None):
                return float("inf")
            continue
        worst = max(worst, rel_l2(a, b))
    return worst


HOST_SNAPSHOT_BYTES = 8 << 30  # results kept for later comparison larger than this go to the host


def snapshot(tensors, limit: int = HOST_SNAPSHOT_BYTES) -> list:
    """Copies of a step's results, kept to compare later rows with: on their device, or on the host
    when together they take more than ``limit`` bytes (DeepSeek-V3's layer: 15 GB of weight gradients,
    which two device copies would add to a step's own 55 GB, its graph's pool included)."""
    total = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    host = total > limit
    return [None if t is None else (t.detach().to("cpu", copy=True) if host else t.detach().clone())
            for t in tensors]


@contextlib.contextmanager
def backend_env(name):
    """``MEGABLOCKS_BACKEND=name`` and ``use_backend(name)`` for the block."""
    old = os.environ.get("MEGABLOCKS_BACKEND")
    os.environ["MEGABLOCKS_BACKEND"] = name
    try:
        with backends.use_backend(name):
            yield
    finally:
        if old is None:
            os.environ.pop("MEGABLOCKS_BACKEND", None)
        else:
            os.environ["MEGABLOCKS_BACKEND"] = old


def build(v, case):
    """``(step, results)``: a callable running one step in the variant's mode, and a callable
    returning the tensors the last step produced (output and gradients)."""
    if v.mode == "eager":
        step = case.step_fn(case.layer)
        last = {}

        def run():
            case.zero_grad()
            last["y"] = step()
        return run, lambda: case.results(last["y"])
    if v.mode in ("compile", "compile-ro"):
        compiled = torch.compile(case.layer, mode="reduce-overhead" if v.mode == "compile-ro" else None)
        step = case.step_fn(compiled)
        last = {}

        def run():
            case.zero_grad()
            last["y"] = step()
        return run, lambda: case.results(last["y"])
    if v.mode == "graph":
        api, what = timing.graph_api(case.device)
        if api is None:
            raise RuntimeError(f"graph mode needs graph capture (CUDA graphs, torch.npu.NPUGraph): {what}")
        step = case.step_fn(case.layer)
        side = api.Stream()
        side.wait_stream(api.current_stream())
        with api.stream(side):
            for _ in range(3):
                case.zero_grad()
                step()
        api.current_stream().wait_stream(side)
        case.zero_grad()
        graph = api.Graph()
        with api.capture(graph):
            y = step()
        static = case.results(y)  # the graph writes these on every replay

        def replay():
            graph.replay()
        return replay, lambda: static
    raise ValueError(v.mode)


def time_steps(run, device, steps):
    """``(wall ms, host ms)`` per step, medians over ``steps`` consecutive steps."""
    host = []
    if timing.timer(device).kind == "events":
        events = [timing.event(device) for _ in range(steps + 1)]
        for i in range(steps):
            events[i].record()
            t0 = time.perf_counter()
            run()
            host.append((time.perf_counter() - t0) * 1e3)
        events[steps].record()
        timing.synchronize(device)
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
    if timing.timer(device).kind != "events":
        return None
    host = []
    for _ in range(steps):
        timing.synchronize(device)
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e3)
    timing.synchronize(device)
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


def routing_bytes(v, configs, tokens, dtype):
    """Minimal bytes of a dMoE step's routing (bench_routing.min_bytes, dropless): forward gather
    and weighted scatter, backward the scatter's weighted gather and router-weight gradient and the
    gather's unweighted scatter. None for MoE (what its capacity drops depends on the routing)."""
    if v.layer != "dMoE":
        return None
    c = configs[v.config]
    b = torch.empty((), dtype=dtype).element_size()
    n, h, meta = tokens * c["k"], c["H"], tokens * c["k"] * 4 + c["E"] * 4
    gather = tokens * h * b + meta + n * h * b
    scatter = n * h * b + meta + tokens * h * b
    weighted = scatter + n * b
    wgrad = n * h * b + tokens * h * b + meta + n * b
    return 2 * gather + weighted + scatter + wgrad


def count_launches(run, device, by_line):
    """``(launches, by line)`` of one eager step: aten ops that launch a kernel plus Triton launches
    (``LaunchCounter``; on the CPU every op counts, on a GPU the ops on it)."""
    with LaunchCounter(device=None if device.type == "cpu" else device.type, where=by_line) as counted:
        run()
    timing.synchronize(device)
    lines = None
    if by_line:
        lines = [dict(n=n, name=name, where=where) for (where, name), n in counted.by_where().items()]
    return counted.total, lines


def count_syncs(run, device):
    """Synchronizing CUDA calls in one step (torch's sync debug mode, as warnings)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@contextlib.contextmanager
def wgrad_fill(name):
    """The grouped GEMM's zero fill of empty weight-gradient groups for ``name`` (``full``: the
    masked fill over the whole gradient of earlier versions, for before/after rows)."""
    from megablocks_ascend.native import grouped_gemm  # noqa: PLC0415
    old = grouped_gemm._legacy_full_fill
    grouped_gemm._legacy_full_fill = name == "full"
    try:
        yield
    finally:
        grouped_gemm._legacy_full_fill = old


def run_variant(v, case, reference, eager_of_backend, args, device, keep=True):
    """``(row, kept)``: the variant's row, and (``keep``) a :func:`snapshot` of its first step's
    results for later rows to compare with (None otherwise)."""
    row = dataclasses.asdict(v)
    with backend_env(v.backend), wgrad_fill(v.wgrad_fill):
        timing.synchronize(device)
        resident = timing.memory_allocated(device)
        timing.reset_peak_memory(device)
        run, results = build(v, case)
        for _ in range(args.warmup):
            run()
        run()
        timing.synchronize(device)
        peak = timing.peak_memory_allocated(device)
        if resident is not None and peak is not None:
            row["peak_mib"] = (peak - resident) / 2**20
        got = results()
        if reference is not None:
            row["err"] = rel_err(got, reference)
        if eager_of_backend is not None and v.mode != "eager":
            row["err_self"] = row["err"] if eager_of_backend is reference else rel_err(got, eager_of_backend)
        row["ok"] = all(row.get(k, 0.0) <= TOL for k in ("err", "err_self"))
        kept = snapshot(got, args.host_snapshot_bytes) if keep else None
        del got
        if not row["ok"]:
            return row, kept
        row["wall_ms"], row["host_ms"] = time_steps(run, device, args.steps)
        times = kernel_times(run, device, args.profile_steps)
        row.update(breakdown(times))
        if times:
            row["kernels"] = sum(n for _, n in times.values())
        if row.get("kernel_ms"):
            row["busy"] = row["kernel_ms"] / row["wall_ms"]
        nbytes = routing_bytes(v, args.configs, args.tokens, case.dtype)  # amp-bf16: float32 activations
        if nbytes is not None and args.ceiling_gbps:
            row["routing_bytes"] = nbytes
            row["routing_ms"] = nbytes / args.ceiling_gbps / 1e6
            if row.get("gemm_ms") is not None:
                row["floor_ms"] = row["gemm_ms"] + row["routing_ms"]
                row["x_floor"] = row["wall_ms"] / row["floor_ms"]
        if v.mode == "eager":
            if args.enqueue:
                row["enqueue_ms"] = enqueue_time(run, device, args.steps)
            row["syncs"] = count_syncs(run, device)
            row["launches"], lines = count_launches(run, device, args.launches_by_line)
            if lines is not None:
                row["launches_by_line"] = lines
    return row, kept


def _lead(r):
    return (f"{r['config']:8s} {r['layer']:5s} {r['backend']:7s} {r['mode']:10s} {r['precision']:8s} "
            f"{r['mlp_impl']:7s} {r['mlp_type']:4s} {r['wgrad_fill']:5s} ")


def table(rows):
    def f(r, key, fmt, width):
        v = r.get(key)
        return format(v, fmt).rjust(width) if v is not None else "-".rjust(width)
    head = (f"{'config':8s} {'layer':5s} {'backend':7s} {'mode':10s} {'prec':8s} {'impl':7s} {'type':4s} "
            f"{'fill':5s} {'wall ms':>8s} {'host ms':>8s} {'enq ms':>7s} {'kern ms':>8s} {'gemm ms':>8s} {'other ms':>8s} "
            f"{'floor ms':>8s} {'x floor':>7s} {'busy':>5s} {'syncs':>5s} {'launch':>6s} {'kernels':>7s} {'vs up':>6s} "
            f"{'vs grp':>6s} {'peak MiB':>9s} {'mem':>6s} {'err':>8s} {'self':>8s}")
    out = [head]
    for r in rows:
        if "error" in r:
            out.append(_lead(r) + "ERROR " + r["error"].splitlines()[0][:100])
            continue
        out.append(_lead(r) + f(r, "wall_ms", ".3f", 8) + " " + f(r, "host_ms", ".3f", 8) + " "
                   + f(r, "enqueue_ms", ".3f", 7) + " " + f(r, "kernel_ms", ".3f", 8) + " " + f(r, "gemm_ms", ".3f", 8) + " " + f(r, "other_ms", ".3f", 8)
                   + " " + f(r, "floor_ms", ".3f", 8) + " " + f(r, "x_floor", ".2f", 6) + "x"
                   + " " + f(r, "busy", ".0%", 5) + " " + f(r, "syncs", "d", 5)
                   + " " + f(r, "launches", "d", 6) + " " + f(r, "kernels", ".0f", 7)
                   + " " + f(r, "vs_up", ".2f", 5) + "x " + f(r, "vs_grouped", ".2f", 5) + "x "
                   + f(r, "peak_mib", ".1f", 9) + " " + f(r, "mem_vs_up", ".3f", 6)
                   + " " + f(r, "err", ".1e", 8) + " " + f(r, "err_self", ".1e", 8)
                   + ("" if r.get("ok", True) else "  FAIL"))
    return "\n".join(out)


def top_table(rows, per_row=5):
    """The largest non-GEMM kernels of each profiled row (ms per step, launches per step)."""
    out = ["largest non-GEMM kernels per step (ms, launches):"]
    for r in rows:
        if not r.get("top_other"):
            continue
        out.append(_lead(r).rstrip())
        for k in r["top_other"][:per_row]:
            out.append(f"    {k['ms']:7.3f} ms {k['calls']:5.1f}x  {k['name'][:110]}")
    return "\n".join(out)


@dataclasses.dataclass
class Settings:
    """How the steps are run and timed (``benchmarks/bench_steps.py``'s options)."""
    configs: dict
    tokens: int
    steps: int = 20
    warmup: int = 3
    profile_steps: int = 3
    launches_by_line: bool = False
    ceiling_gbps: float | None = None
    host_snapshot_bytes: int = HOST_SNAPSHOT_BYTES  # kept results larger than this live on the host
    enqueue: bool = True  # eager rows: also the host time to enqueue a step onto an idle device


def run(variants, device, settings: Settings, reference_backend: str, log, save=None) -> list[dict]:
    """Every variant's row. The variants of one family share one :class:`Case`; the reference
    (``reference_backend``'s eager step) runs first, then each backend's eager step (run for the
    ``self`` check even where not asked for: those rows say ``reference_only``), then the rest. A
    variant that fails is an error row, and the run goes on. One family's layer lives at a time: its
    case and kept results are released before the next is built. ``save(rows)`` is called after
    each family; ``vs_up`` (the reference's eager wall over each row's) and ``mem_vs_up`` (each row's
    peak memory over the reference backend's in the same mode) are filled in at the end. Each family
    and row logs a progress line with the seconds it took."""
    rows = []
    default_fill = variants[0].wgrad_fill if variants else "empty"
    families = {}
    # Each sparse family right after its grouped one, whose reference it shares (kept no longer than that).
    for v in sorted(variants, key=lambda v: (v.config, v.layer, v.precision, v.mlp_type, v.mlp_impl != "grouped")):
        families.setdefault(v.family, []).append(v)
    grouped_refs = {}  # (config, layer, precision, mlp_type) -> the grouped family's reference results
    for family, members in families.items():
        sparse = family[3] == "sparse"
        if not sparse and any(f[3] == "sparse" and (f[:3], f[4]) == (family[:3], family[4]) for f in families):
            keep_ref = (family[:3], family[4])
        else:
            keep_ref = None
        t0 = time.perf_counter()
        c = settings.configs[family[0]]
        log(f"  [{family[0]} {family[1]}] building the layer: H={c['H']} ffn={c['ffn']} E={c['E']} top_k={c['k']}, "
            f"{settings.tokens} tokens ...")
        try:
            case = Case(family, device, settings.tokens, settings.configs)
        except Exception as e:  # noqa: BLE001
            for v in members:
                rows.append(dict(dataclasses.asdict(v), error=f"{type(e).__name__}: {e}"))
                log(f"  {v.name():55s} ERROR {type(e).__name__}: {str(e)[:160]}")
            timing.empty_cache(device)
            continue
        log(f"  [{family[0]} {family[1]}] {sum(p.numel() for p in case.params):,} parameters "
            f"({sum(p.numel() * p.element_size() for p in case.params) / 2**30:.2f} GiB), built in "
            f"{time.perf_counter() - t0:.1f} s")

        def eager_of(backend):
            return Variant(family[0], family[1], backend, "eager", family[2], family[3], family[4], default_fill)
        # The sparse MLP has no upstream step to compare with (MegaBlocks refuses it with Triton >= 3.2):
        # its reference is the grouped family's (upstream's grouped step on the same parameters).
        ref_v = None if sparse else eager_of(reference_backend)
        needed = set(members) | ({ref_v} if ref_v else set()) | {eager_of(v.backend) for v in members}
        order = sorted(needed, key=lambda v: (v != ref_v, v.mode != "eager", v.backend, v.mode))
        self_checked = {v.backend for v in needed if v.mode != "eager"}  # whose eager results later rows need
        reference, eager = (grouped_refs.pop((family[:3], family[4]), None) if sparse else None), {}
        syncs = {}  # backend -> host syncs of its eager step
        for v in order:
            tv = time.perf_counter()
            keep = v == ref_v or (v.mode == "eager" and v.wgrad_fill == default_fill and v.backend in self_checked)
            try:
                if v.mode in ("graph", "compile-ro") and syncs.get(v.backend):
                    # A capture of a step that reads the device on the host fails and can leave the
                    # process unable to run later steps (on CUDA the RNG stays in capture state): refuse.
                    raise RuntimeError(f"not captured: the eager step syncs the host {syncs[v.backend]} times "
                                       "(torch.cuda.set_sync_debug_mode), which a graph capture cannot hold")
                row, got = run_variant(v, case, reference, eager.get(v.backend), settings, device, keep=keep)
            except Exception as e:  # noqa: BLE001
                row = dict(dataclasses.asdict(v), error=f"{type(e).__name__}: {str(e)[:500]}",
                           trace=traceback.format_exc(limit=4)[-1500:])
                got = None
            if v == ref_v:
                reference = got
                if keep_ref is not None and got is not None:
                    grouped_refs[keep_ref] = got
            if v not in members:
                row["reference_only"] = True
            if v.mode == "eager" and v.wgrad_fill == default_fill and got is not None:
                eager[v.backend] = got
                syncs[v.backend] = row.get("syncs")
            rows.append(row)
            peak = f"  peak {row['peak_mib']:9.1f} MiB" if row.get("peak_mib") is not None else ""
            log(f"  {v.name():55s} " + (f"ERROR {row['error'][:160]}" if "error" in row else
                                        f"wall {row.get('wall_ms', float('nan')):8.3f} ms  err {row.get('err', 0):.1e}"
                                        + peak + ("" if row["ok"] else "  FAIL"))
                + f"  ({time.perf_counter() - tv:.1f} s)")
            timing.synchronize(device)
        del case, reference, eager, got
        gc.collect()
        timing.empty_cache(device)
        log(f"  [{family[0]} {family[1]}] done in {time.perf_counter() - t0:.1f} s")
        if save is not None:
            save(rows)

    def key(r, impl=None):
        return r["config"], r["layer"], r["precision"], impl or r["mlp_impl"], r["mlp_type"]
    upstream = {key(r): r["wall_ms"] for r in rows if r["backend"] == reference_backend
                and r["mode"] == "eager" and r["wgrad_fill"] == default_fill and r.get("wall_ms")}
    grouped = {key(r) + (r["backend"], r["mode"]): r["wall_ms"] for r in rows if r["mlp_impl"] == "grouped"
               and r["wgrad_fill"] == default_fill and r.get("wall_ms")}
    peaks = {key(r) + (r["mode"],): r["peak_mib"] for r in rows if r["backend"] == reference_backend
             and r["wgrad_fill"] == default_fill and r.get("peak_mib")}
    for r in rows:
        base = upstream.get(key(r, "grouped" if r["mlp_impl"] == "sparse" else None))  # upstream has no sparse step
        if base and r.get("wall_ms"):
            r["vs_up"] = base / r["wall_ms"]
        same = grouped.get(key(r, "grouped") + (r["backend"], r["mode"]))
        if r["mlp_impl"] == "sparse" and same and r.get("wall_ms"):
            r["vs_grouped"] = same / r["wall_ms"]  # > 1: the sparse step is faster than the grouped one
        up = key(r, "grouped" if r["mlp_impl"] == "sparse" else None)
        mem = peaks.get(up + (r["mode"],)) or peaks.get(up + ("eager",))
        if mem and r.get("peak_mib") is not None:
            r["mem_vs_up"] = r["peak_mib"] / mem
    return rows


# ------------------------------------------------------------------------------------------
# The precision verdict of a step


def decisive_router(layer, x: torch.Tensor, num_experts: int) -> None:
    """Make the router's choice the same in every precision: its weight becomes the identity on the
    first ``num_experts`` features of the input, and those features of each token a random
    permutation of the levels 0, 0.5, 1, ... (exact in bfloat16 and in every product and sum of the
    router's matmul), so that no two logits of a token are close and float32, bfloat16 and the
    device pick the same experts (a near tie resolved differently would send a token to another
    expert, an error no precision verdict could read). What is left to compare is what follows the
    choice: the router's weights, the routing, the experts, the gradients."""
    if x.shape[-1] < num_experts:
        raise ValueError(f"decisive_router: hidden size {x.shape[-1]} < {num_experts} experts")
    w = layer.router.layer.weight
    gen = torch.Generator().manual_seed(3)
    levels = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(x.shape[0] * x.shape[1])])
    with torch.no_grad():
        w.zero_()
        w[:, :num_experts].copy_(torch.eye(num_experts, dtype=w.dtype, device=w.device))
        x.view(-1, x.shape[-1])[:, :num_experts].copy_((levels * 0.5).to(x.dtype))


def named_results(layer, x, y) -> dict:
    """The output and every gradient of a step, by name."""
    out = {"output": y.detach(), "x.grad": x.grad}
    out.update({f"{n}.grad": p.grad for n, p in layer.named_parameters() if p.requires_grad})
    return out


def _one_step(layer, x, g):
    from megablocks.layers.moe import clear_load_balancing_loss  # noqa: PLC0415
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    y = layer(x)
    y.backward(g)
    clear_load_balancing_loss()
    return named_results(layer, x, y)


# The layer a step's precision verdict runs on (the golden and the simulation are the same step on
# the CPU, in float32 and in the device dtype): the config's own layer where its expert weights are at
# most PRECISION_FULL_PARAMS, else one of the same family, with the same experts and top_k and hidden
# and ffn cut to PRECISION_HIDDEN and PRECISION_FFN (a DeepSeek-V3 layer would take 30 GB and minutes
# per CPU step). ``bench --precision-full`` asks for the configs' own layers.
PRECISION_FULL_PARAMS = 1 << 24
PRECISION_HIDDEN = 512
PRECISION_FFN = 256


def precision_config(c: dict, *, full: bool = False, max_params: int = PRECISION_FULL_PARAMS,
                     hidden: int = PRECISION_HIDDEN, ffn: int = PRECISION_FFN, ffn_multiple: int = 1) -> dict:
    """The layer (H, ffn, E, k) the precision verdict of config ``c`` runs on (see above). The hidden
    size stays at least the expert count rounded up to 16 (the decisive router needs a feature per
    expert), the ffn a multiple of ``ffn_multiple`` (the sparse MLP's 128-wide blocks)."""
    if full or 2 * c["E"] * c["H"] * c["ffn"] <= max_params:
        return dict(c)
    cut = -(-min(c["ffn"], ffn) // ffn_multiple) * ffn_multiple
    return dict(c, H=max(min(c["H"], hidden), -(-c["E"] // 16) * 16), ffn=min(c["ffn"], cut))


def precision_verdicts(config: str, layer: str, device: torch.device, tokens: int, configs: dict,
                       backends_: tuple, dtype: torch.dtype = torch.bfloat16, mlp_impl: str = "grouped", *,
                       full: bool = False, reduce: dict | None = None) -> dict:
    """``{backend: [Verdict]}``: one ``dtype`` training step of ``layer`` at ``config`` with ``tokens``
    tokens run by each backend on ``device``, its output and every gradient judged against the same
    step on the CPU in float32 (golden) and in ``dtype`` (simulation), both through the ``torch``
    backend, from the same parameters and inputs (:mod:`~megablocks_ascend.bench.precision`; the
    router made decisive by :func:`decisive_router`). The layer is :func:`precision_config`'s
    (``reduce``: its keyword arguments; ``full``: the config's own)."""
    from megablocks_ascend.bench import precision  # noqa: PLC0415
    c = precision_config(configs[config], full=full, **(reduce or {}))
    torch.manual_seed(0)
    with backend_env("ascend") if mlp_impl == "sparse" else contextlib.nullcontext():  # (see Case)
        module = build_layer(c, layer, dtype, device, mlp_impl)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, 1, c["H"], device=device, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(tokens, 1, c["H"], device=device, generator=gen).to(dtype)
    decisive_router(module, x, c["E"])
    got = {}
    for b in backends_:
        with backend_env(b):
            got[b] = {k: (v.detach().clone() if v is not None else None) for k, v in _one_step(module, x, g).items()}
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    ref = {}
    for label, dt in (("simulation", dtype), ("golden", precision.golden_dtype(dtype))):
        with backend_env("torch"):
            cpu = build_layer(c, layer, dt, torch.device("cpu"), mlp_impl)
        cpu.load_state_dict({k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()})
        xc = x.detach().cpu().to(dt).requires_grad_()
        with backend_env("torch"):
            ref[label] = _one_step(cpu, xc, g.cpu().to(dt))
    out = {}
    for b, results in got.items():
        out[b] = [precision.judge(name, t, ref["simulation"][name], ref["golden"][name], dtype)
                  for name, t in results.items() if t is not None]
    return out
