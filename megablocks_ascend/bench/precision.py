"""The precision verdict in the form Ascend engineers use, for ``bench`` and ``selftest``.

For each output and gradient of a computation three results are compared:

* the **device** result: the computation as run on the device, in the device dtype;
* the **golden**: the same computation on the CPU in float32 from the same input values, and in
  float64 for a float32 computation (a float32 golden would be the computation itself, and a
  reduction's relative error near a zero result would be judged against nothing but the floor);
* the **simulation**: the same computation on the CPU in the device dtype: what rounding alone
  costs on a CPU.

Both the device result and the simulation are measured against the golden by three errors, over the
elements where the golden is finite (a non-finite device element there fails the tensor outright)::

    MARE = max  |a - g| / (|g| + floor)      maximum relative error
    MERE = mean |a - g| / (|g| + floor)      mean relative error
    RMSE = sqrt(mean (a - g)^2)              root-mean-square error

(an element whose golden is smaller than the floor is compared about absolutely: a reduction whose
result is near zero by cancellation has no relative error worth the name, and in float32 one such
element would otherwise decide a ratio of two maxima)
and the verdict is on their ratios, ``device error / max(simulation error, floor)``, the floor being
one unit of the dtype's precision, so that an exact simulation (a copy) does not make every rounding
of the device fail:

=============  ==========  =========  =========
dtype          floor       MARE <=    MERE, RMSE <=
=============  ==========  =========  =========
bfloat16       2**-8       10         2
float16        2**-11      10         2
float32        2**-14      10         2
=============  ==========  =========  =========

(:data:`FLOORS`, :data:`THRESHOLDS`; the thresholds 10 / 2 / 2 and the floors are public Ascend
practice.) A tensor passes when all three ratios are at or below their thresholds; the three ratios
are printed per tensor (:func:`table`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

THRESHOLDS = {"MARE": 10.0, "MERE": 2.0, "RMSE": 2.0}
FLOORS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-14}


def golden_dtype(dtype: torch.dtype) -> torch.dtype:
    """The golden's dtype for a computation in ``dtype`` (see the module doc)."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


REL_L2_CHUNK = 1 << 24  # elements per float64 chunk of rel_l2 (128 MiB of float64 per operand)


def rel_l2(a: torch.Tensor, b: torch.Tensor, chunk: int = REL_L2_CHUNK) -> float:
    """Relative L2 error ``|a - b| / |b|`` (inf if ``a`` has a non-finite element): the checks that
    run before a benchmark times anything. Computed in float64 over ``chunk`` elements at a time,
    on the device of ``a`` (or of ``b`` when ``a`` is on the CPU: a result kept on the host), so no
    whole-tensor float64 copy is made: a DeepSeek-V3 layer's weight gradient has 3.8e9 elements,
    28 GiB in float64. A chunk crosses between host and device in its own dtype and is widened
    where it lands (``Tensor.to(device, dtype)`` from the host widens on the host first: 4x the
    bytes over the bus from a bfloat16 snapshot, and the host's time to widen them)."""
    if a.numel() != b.numel():
        raise ValueError(f"rel_l2: sizes differ, {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    device = a.device if a.device.type != "cpu" else b.device
    num = torch.zeros((), dtype=torch.float64, device=device)
    den = torch.zeros((), dtype=torch.float64, device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    for i in range(0, a.numel(), chunk):
        x = a[i:i + chunk].to(device).to(torch.float64)
        y = b[i:i + chunk].to(device).to(torch.float64)
        finite &= torch.isfinite(x).all()
        num += (x - y).square().sum()
        den += y.square().sum()
    if not bool(finite):
        return float("inf")
    den_ = math.sqrt(den.item())
    return math.sqrt(num.item()) / (den_ if den_ > 0 else 1.0)


# Elements per chunk of :func:`errors`: at most torch's intra-op grain size (32768), so each op
# runs on one thread over float64 data that stays in a core's L2 cache. Larger chunks split every op
# over the thread pool; on a busy host that was 10-30x slower (2 cores, 3.4e7 elements: 0.3-0.4 s at
# 32768, 4-6 s at 65536 and above, 8-12 s for the whole tensor at once).
ERRORS_CHUNK = 1 << 15


def errors(actual: torch.Tensor, golden: torch.Tensor, floor: float) -> dict:
    """``{"MARE", "MERE", "RMSE", "nonfinite"}`` of ``actual`` against ``golden`` (same shape), over
    the elements where the golden is finite, relative errors over ``|golden| + floor``;
    ``nonfinite`` counts the elements of ``actual`` that are not finite there (their error is
    infinite). Computed in float64 on the CPU, :data:`ERRORS_CHUNK` elements at a time."""
    a, g = actual.detach().reshape(-1), golden.detach().reshape(-1)
    f64 = torch.float64
    worst, rel_sum, sq_sum = (torch.zeros((), dtype=f64) for _ in range(3))
    kept = bad = 0
    for i in range(0, a.numel(), ERRORS_CHUNK):
        x = a[i:i + ERRORS_CHUNK].to("cpu", f64, copy=True)  # (written in place below)
        y = g[i:i + ERRORS_CHUNK].to("cpu", f64, copy=True)
        keep = torch.isfinite(y)
        if not bool(keep.all()):
            x, y = x[keep], y[keep]
        kept += x.numel()
        finite = torch.isfinite(x)
        diff = x.sub_(y).abs_()
        if not bool(finite.all()):
            bad += int((~finite).sum())
            diff.masked_fill_(~finite, math.inf)
        if diff.numel():
            sq_sum += diff.square().sum()
            rel = diff.div_(y.abs_().add_(floor))
            worst = torch.maximum(worst, rel.max())
            rel_sum += rel.sum()
    if kept == 0:
        return dict(MARE=0.0, MERE=0.0, RMSE=0.0, nonfinite=bad)
    return dict(MARE=float(worst), MERE=float(rel_sum) / kept, RMSE=math.sqrt(float(sq_sum) / kept),
                nonfinite=bad)


@dataclasses.dataclass
class Verdict:
    """The verdict on one tensor: its errors on the device and in the simulation, the ratios, and
    whether every ratio is within its threshold."""
    tensor: str
    dtype: str
    device: dict
    simulation: dict
    floor: float
    ratios: dict
    ok: bool
    why: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def judge(tensor: str, actual: torch.Tensor, simulation: torch.Tensor, golden: torch.Tensor,
          dtype: torch.dtype | None = None) -> Verdict:
    """The verdict on ``actual`` (the device result, in ``dtype``: by default its own dtype)."""
    dtype = dtype or actual.dtype
    name = str(dtype).replace("torch.", "")
    if dtype not in FLOORS:
        raise ValueError(f"judge: no precision floor for {dtype} (known: {', '.join(map(str, FLOORS))})")
    floor = FLOORS[dtype]
    if tuple(actual.shape) != tuple(golden.shape) or tuple(simulation.shape) != tuple(golden.shape):
        return Verdict(tensor, name, {}, {}, floor, {m: math.inf for m in THRESHOLDS}, False,
                       f"shapes differ: device {tuple(actual.shape)}, simulation {tuple(simulation.shape)}, "
                       f"golden {tuple(golden.shape)}")
    dev, sim = errors(actual, golden, floor), errors(simulation, golden, floor)
    ratios = {m: dev[m] / max(sim[m], floor) for m in THRESHOLDS}
    why = []
    if dev["nonfinite"]:
        why.append(f"{dev['nonfinite']} non-finite elements where the golden is finite")
    why += [f"{m} ratio {ratios[m]:.3g} > {THRESHOLDS[m]:g}" for m in THRESHOLDS if not ratios[m] <= THRESHOLDS[m]]
    return Verdict(tensor, name, dev, sim, floor, ratios, not why, "; ".join(why))


def cast_inputs(args, dtype: torch.dtype, device="cpu"):
    """``args`` with every floating tensor cast to ``dtype`` on ``device`` and every other tensor
    moved there (lists and tuples followed; anything else as it is)."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return a.detach().to(device, dtype) if a.is_floating_point() else a.detach().to(device)
        if isinstance(a, (list, tuple)):
            return type(a)(one(x) for x in a)
        return a
    return one(args)


def cpu_references(fn, args, dtype: torch.dtype, backend: str | None = "torch"):
    """``(simulation, golden)``: ``fn(*args)`` on the CPU with its floating inputs in ``dtype`` and in
    :func:`golden_dtype` of it, under the MEGABLOCKS_BACKEND ``backend`` (plain PyTorch by default;
    None: the backend in force)."""
    from megablocks_ascend import backends  # noqa: PLC0415
    with backends.use_backend(backend) if backend else contextlib.nullcontext():
        simulation = fn(*cast_inputs(args, dtype))
        golden = fn(*cast_inputs(args, golden_dtype(dtype)))
    return simulation, golden


def all_ok(verdicts) -> bool:
    return all(v.ok for v in verdicts)


def table(rows) -> str:
    """One line per tensor: ``rows`` is ``[(label, Verdict)]``; the three ratios and the verdict."""
    head = (f"{'':44s} {'tensor':26s} {'dtype':8s} {'MARE ratio':>10s} {'MERE ratio':>10s} {'RMSE ratio':>10s}"
            f"  (<= {THRESHOLDS['MARE']:g} / {THRESHOLDS['MERE']:g} / {THRESHOLDS['RMSE']:g})")
    lines = [head]
    for label, v in rows:
        r = v.ratios
        lines.append(f"{label[:44]:44s} {v.tensor[:26]:26s} {v.dtype:8s} {r['MARE']:10.3g} {r['MERE']:10.3g} "
                     f"{r['RMSE']:10.3g}  {'ok' if v.ok else 'FAIL ' + v.why}")
    return "\n".join(lines)


def rel_err(got, want) -> float:
    """The largest relative L2 error of ``got``'s tensors against ``want``'s (chunked: no whole-tensor
    float64 or float32 copy; either side may be kept on the host, :func:`~megablocks_ascend.bench.steps.snapshot`)."""
    worst = 0.0
    for a, b in zip(got, want):
        if a is None or b is None:
            if (a is None) != (b is None):
                return float("inf")
            continue
        worst = max(worst, rel_l2(a, b))
    return worst


# ------------------------------------------------------------------------------------------
# The precision verdict of a training step


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
    backend, from the same parameters and inputs (:func:`judge`; the
    router made decisive by :func:`decisive_router`). The layer is :func:`precision_config`'s
    (``reduce``: its keyword arguments; ``full``: the config's own)."""
    from megablocks_ascend.bench.layers import backend_env, build_layer  # noqa: PLC0415
    c = precision_config(configs[config], full=full, **(reduce or {}))
    torch.manual_seed(0)
    with backend_env("ascend") if mlp_impl == "sparse" else contextlib.nullcontext():  # (see steps.Case)
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
    for label, dt in (("simulation", dtype), ("golden", golden_dtype(dtype))):
        with backend_env("torch"):
            cpu = build_layer(c, layer, dt, torch.device("cpu"), mlp_impl)
        cpu.load_state_dict({k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()})
        xc = x.detach().cpu().to(dt).requires_grad_()
        with backend_env("torch"):
            ref[label] = _one_step(cpu, xc, g.cpu().to(dt))
    out = {}
    for b, results in got.items():
        out[b] = [judge(name, t, ref["simulation"][name], ref["golden"][name], dtype)
                  for name, t in results.items() if t is not None]
    return out
