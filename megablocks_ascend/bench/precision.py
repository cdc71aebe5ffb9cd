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
