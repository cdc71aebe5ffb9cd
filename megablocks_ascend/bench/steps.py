"""The layer-step harness: one MegaBlocks MoE / dMoE training step (forward + backward), per variant.

``benchmarks/bench_steps.py`` is its command line, and ``python -m megablocks_ascend bench`` runs its
steps rows with it. This module holds the variants, their run and their table; a row's figures come
from the harness's measuring modules: the times from :mod:`~megablocks_ascend.bench.timing`
(``time_steps``, ``enqueue_time``, ``kernel_times``), the launches and host syncs from
:mod:`~megablocks_ascend.bench.instruments`, the errors against the reference and the precision
verdicts from :mod:`~megablocks_ascend.bench.precision`, the layers from
:mod:`~megablocks_ascend.bench.layers`.

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
mlp_impl    ``grouped``, ``sparse`` (dMoE only); ``sparse-gmm``  grouped, sparse
            the sparse dMoE, its products as grouped GEMMs
            + copy (``bench/sparse_grouped.py``; ours only)
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
``syncs``      host syncs per eager step, on any device: the events of
               :class:`~megablocks_ascend.bench.instruments.HostSyncs` (what the host-sync tests
               use): every read of device values into Python, cross-device copy and
               data-dependent-size op in MegaBlocks' code and ours (a read the detector sees at
               both its layers, as ``.item()``, is two events; on the CPU its tensors count as a
               device's; 0: nothing in the step waits for the device, as graph capture needs);
               on CUDA the JSON also has ``cuda_syncs``, the synchronizing CUDA calls torch's
               sync debug mode reports (``torch.cuda.set_sync_debug_mode``), as a cross-check;
``launches``   per eager step, the aten ops that launch a device kernel plus the Triton launches
               (:class:`~megablocks_ascend.bench.instruments.LaunchCounter`: what the CPU regression
               test counts, on this device); ``--launches-by-line`` keeps each row's launches by
               source line in the JSON;
``kernels``    per step, the GPU kernels (and memcpy/memset) ``torch.profiler`` records, the
               same ones ``kernel ms`` sums (one aten op can be several: a radix sort is ~10);
``vs up``      the wall time of upstream's eager step (``cuda`` backend, ``eager``, same config,
               layer, precision and mlp_impl; for ``sparse`` rows upstream's grouped step, as
               upstream refuses the sparse MLP with Triton >= 3.2) divided by this row's: > 1 is faster;
``vs grp``     sparse rows: the grouped step's wall time (same backend, mode, config) divided by
               this row's: > 1 is faster;
``peak MiB``   the most memory allocated on the device while the variant was built and ran its first
               steps (a graph's capture included), above what was allocated before it with no
               gradients alive: one step's activations, gradients and workspaces, alike for every row; ``mem`` = this row's peak over upstream's
               (``cuda`` backend, the same mode where it ran, else eager; for ``sparse`` rows
               upstream's grouped step): < 1 takes less;
``err``        largest relative (L2) error of the step's output and every gradient against
               upstream's eager step (sparse rows: upstream's grouped step on the same parameters),
               and ``self`` against this backend's eager step; a row whose error is above ``TOL`` is
               marked FAIL and not timed. Computed in float64 a chunk at a time
               (``precision.rel_err``); the results compared with later rows are kept on the device,
               or on the host where they take more than a third of its free memory (or
               ``Settings.host_snapshot_bytes``): a DeepSeek-V3 layer's gradients are 15 GB in bf16. On a device with graph capture, a graph row whose backend's eager
               step syncs is an error row, not captured (a failed capture can break every later
               step of the process).

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
import time
import traceback

import torch

from megablocks_ascend.bench import instruments, sparse_grouped, timing
from megablocks_ascend.bench.layers import backend_env, build_layer
from megablocks_ascend.bench.precision import rel_err

TOKENS = 8192
CONFIGS = {
    "ds64": dict(H=2048, ffn=1408, E=64, k=6),
    "qw128": dict(H=2048, ffn=768, E=128, k=8),
    "mixtral": dict(H=4096, ffn=14336, E=8, k=2),
    "small": dict(H=4096, ffn=1792, E=8, k=2),
    # Today's fine-grained MoE layers: DeepSeek-V3, Qwen3-235B, and 256 experts at a
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
    "mlp_impl": ("grouped", "sparse", "sparse-gmm"),
    "mlp_type": ("mlp", "glu"),
    "wgrad_fill": ("empty", "full"),
}
DEFAULT = {"config": tuple(CONFIGS), "layer": ("dMoE", "MoE"), "backend": ("ascend", "cuda"),
           "mode": ("eager", "graph"), "precision": ("bf16",), "mlp_impl": ("grouped", "sparse"),
           "mlp_type": ("mlp",), "wgrad_fill": ("empty",)}
TOL = 2e-2  # relative L2 error of bf16 steps (different routing kernels round differently)


def is_sparse(mlp_impl: str) -> bool:
    """Whether a variant's dMoE is MegaBlocks' sparse one (``sparse``, or ``sparse-gmm``: the same
    layer with its products as grouped GEMMs)."""
    return mlp_impl.startswith("sparse")


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
        if v.mlp_impl == "sparse-gmm" and v.backend != "ascend":
            continue  # the grouped-GEMM form stands in for our block-sparse kernels, in our backend only
        if is_sparse(v.mlp_impl) and (v.layer == "MoE" or (QUICK_CONFIGS if quick else CONFIGS)[v.config]["ffn"] % 128):
            continue  # the sparse MLP is dMoE's, in blocks of 128 columns of ffn (MegaBlocks' topology)
        if v.wgrad_fill != chosen["wgrad_fill"][0] and (v.layer, v.mlp_impl) != ("dMoE", "grouped"):
            continue  # only the grouped dMoE computes weight gradients with the grouped GEMM
        out.append(v)
    return out


# ------------------------------------------------------------------------------------------
# One layer, one step




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
        with backend_env("ascend") if is_sparse(mlp_impl) else contextlib.nullcontext():
            self.layer = build_layer(c, layer, self.dtype, device, "sparse" if is_sparse(mlp_impl) else mlp_impl,
                                     mlp_type)
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




def on_host(tensors, limit: int | None = None) -> bool:
    """Whether :func:`snapshot` keeps ``tensors`` on the host: past ``limit`` bytes, by default (None)
    past a third of their device's free memory (never on the CPU, which has no figure). A
    DeepSeek-V3 layer's two kept results (15 GB each) fit beside its ~55 GB step on an H200; on the
    host each comparison moves 15 GB over the bus."""
    kept = [t for t in tensors if t is not None]
    total = sum(t.numel() * t.element_size() for t in kept)
    if limit is None:
        free = timing.free_memory(kept[0].device) if kept else None
        return free is not None and total > free // 3
    return total > limit


def snapshot(tensors, limit: int | None = None) -> list:
    """Copies of a step's results, kept to compare later rows with: on their device, or on the host
    where :func:`on_host` says."""
    host = on_host(tensors, limit)
    return [None if t is None else (t.detach().to("cpu", copy=True) if host else t.detach().clone())
            for t in tensors]


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
    forms = sparse_grouped.products() if v.mlp_impl == "sparse-gmm" else contextlib.nullcontext()
    with backend_env(v.backend), wgrad_fill(v.wgrad_fill), forms:
        case.zero_grad()  # the peak counts this row's gradients whether or not an earlier row left some
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
        row["wall_ms"], row["host_ms"] = timing.time_steps(run, device, args.steps)
        times = timing.kernel_times(run, device, args.profile_steps)
        row.update(timing.breakdown(times))
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
                row["enqueue_ms"] = timing.enqueue_time(run, device, args.steps)
            row["syncs"] = instruments.count_syncs(run, device)
            cuda_syncs = instruments.count_cuda_syncs(run, device)
            if cuda_syncs is not None:
                row["cuda_syncs"] = cuda_syncs
            row["launches"], lines = instruments.count_launches(run, device, args.launches_by_line)
            if lines is not None:
                row["launches_by_line"] = lines
    return row, kept


def _lead(r):
    return (f"{r['config']:8s} {r['layer']:5s} {r['backend']:7s} {r['mode']:10s} {r['precision']:8s} "
            f"{r['mlp_impl']:10s} {r['mlp_type']:4s} {r['wgrad_fill']:5s} ")


def table(rows):
    def f(r, key, fmt, width):
        v = r.get(key)
        return format(v, fmt).rjust(width) if v is not None else "-".rjust(width)
    head = (f"{'config':8s} {'layer':5s} {'backend':7s} {'mode':10s} {'prec':8s} {'impl':10s} {'type':4s} "
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
    host_snapshot_bytes: int | None = None  # kept results larger than this live on the host (None: snapshot's rule)
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
        sparse = is_sparse(family[3])
        for stale in [k for k in grouped_refs if k != (family[:3], family[4])]:
            del grouped_refs[stale]  # (its sparse families, right after it, are done)
        if not sparse and any(is_sparse(f[3]) and (f[:3], f[4]) == (family[:3], family[4]) for f in families):
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
        reference, eager = (grouped_refs.get((family[:3], family[4])) if sparse else None), {}
        syncs = {}  # backend -> host syncs of its eager step (where the device has graph capture)
        capture = timing.graph_api(device)[0] is not None
        for v in order:
            tv = time.perf_counter()
            keep = v == ref_v or (v.mode == "eager" and v.wgrad_fill == default_fill and v.backend in self_checked)
            try:
                if v.mode in ("graph", "compile-ro") and syncs.get(v.backend):
                    # A capture of a step that reads the device on the host fails and can leave the
                    # process unable to run later steps (on CUDA the RNG stays in capture state): refuse.
                    raise RuntimeError(f"not captured: the eager step syncs the host {syncs[v.backend]} times "
                                       "(instruments.HostSyncs, and on CUDA torch.cuda.set_sync_debug_mode), "
                                       "which a graph capture cannot hold")
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
                if capture:
                    syncs[v.backend] = max(row.get("syncs") or 0, row.get("cuda_syncs") or 0)
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
        base = upstream.get(key(r, "grouped" if is_sparse(r["mlp_impl"]) else None))  # upstream has no sparse step
        if base and r.get("wall_ms"):
            r["vs_up"] = base / r["wall_ms"]
        same = grouped.get(key(r, "grouped") + (r["backend"], r["mode"]))
        if is_sparse(r["mlp_impl"]) and same and r.get("wall_ms"):
            r["vs_grouped"] = same / r["wall_ms"]  # > 1: the sparse step is faster than the grouped one
        up = key(r, "grouped" if is_sparse(r["mlp_impl"]) else None)
        mem = peaks.get(up + (r["mode"],)) or peaks.get(up + ("eager",))
        if mem and r.get("peak_mib") is not None:
            r["mem_vs_up"] = r["peak_mib"] / mem
    return rows
