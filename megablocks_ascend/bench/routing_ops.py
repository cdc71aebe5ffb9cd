"""The routing ops as benchmarks call them: named shapes, one routing problem, its minimal bytes,
the implementations compared, and the check that runs before anything is timed.

Every op of every family (binned, dropless, padded: gather, weighted scatter, router-weight
gradient) is called with MegaBlocks' arguments by :func:`call`, for three implementations:

``ours``      ``megablocks_ascend.kernels.routing.<op>``, with its route-map cache emptied before each
              call (a single op pays its whole cost; a layer step computes the map once)
``upstream``  MegaBlocks 0.10.0's own ``megablocks.backend.kernels.<op>`` (autotuned on CUDA)
``torch``     ``megablocks_ascend.reference.<op>`` (whole-tensor PyTorch indexing)

Minimal bytes per op (``b`` bytes per element, 4 per index; ``T`` tokens, ``H`` hidden, ``k`` top_k,
``E`` experts, ``N = T*k`` assignments, ``R`` output rows of a gather: ``N`` dropless,
``padded_bins[-1]`` padded, ``E*capacity`` binned; ``K`` kept assignments (``N`` unless binned drops
some); ``U`` distinct tokens with at least one kept assignment (``T`` unless binned drops all of a
token's)); each distinct input byte read once, each output byte written once::

    gather  (unweighted)  U*H*b  + N*4 + E*4 [+ E*4 padded_bins]   read,  R*H*b  written
    scatter (weighted)    K*H*b  + K*b + N*4 + E*4 [+ E*4]         read,  T*H*b  written
    wgrad                 K*H*b  + U*H*b + N*4 + E*4 [+ E*4]       read,  N*b    written

(``bin_ids`` is not counted: no implementation needs it.)
"""

from __future__ import annotations

import torch

from megablocks_ascend import backends, reference
from megablocks_ascend.bench.precision import rel_l2
from megablocks_ascend.kernels import routing

SHAPES = {
    "mixtral": dict(T=8192, H=4096, E=8, k=2, cf=1.0),
    "fine": dict(T=16384, H=2048, E=64, k=6, cf=1.25),
    "small": dict(T=4096, H=1024, E=16, k=1, cf=1.0),
}
QUICK_SHAPES = {
    "quick": dict(T=24, H=48, E=4, k=2, cf=1.0),
}
LARGE_SHAPES = ("mixtral", "fine")  # where the 90%-of-ceiling target applies
PAD_BLOCK = 128  # MegaBlocks' dMoE blocking (padded_bins rounds each expert up to it)

FAMILIES = {
    "binned": ("binned_gather", "binned_scatter", "binned_scatter_wgrad"),
    "dropless": ("gather", "scatter", "scatter_wgrad"),
    "padded": ("padded_gather", "padded_scatter", "padded_scatter_wgrad"),
}
OPS = [op for ops in FAMILIES.values() for op in ops]
IMPLS = ("ours", "upstream", "torch")
GRAPH_UNSAFE = ("padded_gather",)  # a .item() inside (ours and upstream): no capture
TOL = {"scatter": 1e-2, "wgrad": 1e-2}


def op_kind(op: str) -> str:
    if op.endswith("wgrad"):
        return "wgrad"
    return "gather" if op.endswith("gather") else "scatter"


def op_family(op: str) -> str:
    return next(f for f, ops in FAMILIES.items() if op in ops)


class Data:
    """One routing problem: random logits -> softmax top-k -> stable sort, as MegaBlocks does."""

    def __init__(self, T, H, E, k, cf, device, dtype=torch.bfloat16, seed=0, lazy=False):
        self.T, self.H, self.E, self.k, self.cf = T, H, E, k, cf
        self.device, self.dtype = device, dtype
        self.N = T * k
        self.cap = int(cf * T * k / E)
        g = torch.Generator(device=device).manual_seed(seed)
        self.g = g
        logits = torch.randn(T, E, device=device, generator=g)
        w, top = torch.topk(torch.softmax(logits, dim=-1), k)
        self.top = top.int()  # the router's expert ids [T, k]
        top = top.flatten().int()
        self.w = w.flatten().to(dtype)
        bin_ids, order = torch.sort(top, stable=True)
        self.bin_ids = bin_ids.int()
        self.indices = order.int()
        counts = torch.bincount(top.long(), minlength=E).int()
        self.tokens_per_expert = counts
        self.bins = torch.cumsum(counts, 0).int()
        self.padded_bins = torch.cumsum((counts + PAD_BLOCK - 1) // PAD_BLOCK * PAD_BLOCK, 0).int()
        self.P = int(self.padded_bins[-1].item())
        kept = torch.minimum(counts, torch.tensor(self.cap, device=device, dtype=torch.int32))
        self.K_binned = int(kept.sum().item())
        # Tokens with at least one kept assignment under the capacity.
        pos = torch.arange(self.N, device=device)
        start = torch.cat([torch.zeros(1, dtype=torch.long, device=device), self.bins[:-1].long()])
        keep_pos = (pos - start[self.bin_ids.long()]) < self.cap
        token_kept = torch.zeros(T, dtype=torch.bool, device=device)
        token_kept[(self.indices.long()[keep_pos]) // k] = True
        self.U_binned = int(token_kept.sum().item())
        self._cache = {}
        if not lazy:
            for name in ("x", "y_bin", "y_drop", "y_pad", "grad"):
                getattr(self, name)

    def _rand(self, name, shape):
        if name not in self._cache:
            self._cache[name] = torch.randn(shape, device=self.device, generator=self.g).to(self.dtype) \
                if self.device.type == "cpu" else \
                torch.randn(shape, device=self.device, dtype=self.dtype, generator=self.g)
        return self._cache[name]

    def drop(self, name):
        self._cache.pop(name, None)

    x = property(lambda s: s._rand("x", (s.T, s.H)))
    y_bin = property(lambda s: s._rand("y_bin", (s.E, s.cap, s.H)))
    y_drop = property(lambda s: s._rand("y_drop", (s.N, s.H)))
    y_pad = property(lambda s: s._rand("y_pad", (s.P, s.H)))
    grad = property(lambda s: s._rand("grad", (s.T, s.H)))


def arguments(op, d: Data) -> tuple:
    """MegaBlocks' positional arguments of ``op`` on the problem ``d``."""
    return {
        "binned_gather": lambda: (d.x, d.indices, None, d.bins, d.cap, d.k),
        "binned_scatter": lambda: (d.y_bin, d.indices, d.w, d.bins, d.k),
        "binned_scatter_wgrad": lambda: (d.y_bin, d.grad, d.indices, d.bins, d.k),
        "gather": lambda: (d.x, d.indices, d.bin_ids, None, d.bins, d.k),
        "scatter": lambda: (d.y_drop, d.indices, d.bin_ids, d.w, d.bins, d.k),
        "scatter_wgrad": lambda: (d.y_drop, d.grad, d.indices, d.bin_ids, d.bins, d.k),
        "padded_gather": lambda: (d.x, d.indices, d.bin_ids, None, d.bins, d.padded_bins, d.k),
        "padded_scatter": lambda: (d.y_pad, d.indices, d.bin_ids, d.w, d.bins, d.padded_bins, d.k),
        "padded_scatter_wgrad": lambda: (d.y_pad, d.grad, d.indices, d.bin_ids, d.bins, d.padded_bins, d.k),
    }[op]()


def call(op, fn, d: Data, **launch):
    """Call ``fn`` (ours, upstream's or the reference's ``op``) with MegaBlocks' arguments."""
    return fn(*arguments(op, d), **launch)


def min_bytes(op, d: Data) -> int:
    """Each distinct input byte read once, each output byte written once (see the module doc)."""
    b = torch.empty((), dtype=d.dtype).element_size()
    fam, kind = op_family(op), op_kind(op)
    K = d.K_binned if fam == "binned" else d.N
    U = d.U_binned if fam == "binned" else d.T
    meta = d.N * 4 + d.E * 4 + (d.E * 4 if fam == "padded" else 0)
    if kind == "gather":
        rows = {"binned": d.E * d.cap, "dropless": d.N, "padded": d.P}[fam]
        return U * d.H * b + meta + rows * d.H * b
    if kind == "scatter":
        return K * d.H * b + K * b + meta + d.T * d.H * b
    return K * d.H * b + U * d.H * b + meta + d.N * b


def _token_major(op):
    """Our gathers through the token-major kernel (``routing.gather_tokens_rows``), for the sweep."""
    def binned_gather(x, indices, weights, bins, expert_capacity, top_k, **launch):
        out = routing.gather_tokens_rows(x, indices, bins, None, weights, layout=routing.BINNED, top_k=top_k,
                                         num_rows=bins.shape[0] * expert_capacity, capacity=expert_capacity,
                                         **launch)
        return out.view(bins.shape[0], expert_capacity, x.shape[1])

    def gather(x, indices, bin_ids, weights, bins, top_k, **launch):
        return routing.gather_tokens_rows(x, indices, bins, None, weights, layout=routing.DROPLESS, top_k=top_k,
                                          num_rows=indices.shape[0], **launch)

    def padded_gather(x, indices, bin_ids, weights, bins, padded_bins, top_k, **launch):
        return routing.gather_tokens_rows(x, indices, bins, padded_bins, weights, layout=routing.PADDED,
                                          top_k=top_k, num_rows=int(padded_bins[-1].item()), **launch)
    return locals()[op]


def uncached(fn):
    """``fn`` with the route-map cache emptied first: a single op is timed with its whole cost (a
    layer step computes the map once and reuses it; see the layer benchmark)."""
    def run(*args, **kwargs):
        routing.clear_route_maps()
        return fn(*args, **kwargs)
    return run


def implementation(op, impl):
    if impl == "ours":
        if op.endswith("+tok"):
            return uncached(_token_major(op[:-4]))
        return uncached(getattr(routing, op))
    if impl == "upstream":
        return backends._upstream(op)
    if impl == "torch":
        return getattr(reference, op)
    raise KeyError(impl)


def poisoned(fn, like_numel, dtype, device):
    """Run ``fn`` right after the allocator has held a NaN-filled block of the output's size (an
    element the call does not write shows up as NaN)."""
    p = torch.full((like_numel,), float("nan"), dtype=dtype, device=device)
    del p
    return fn()


def expected(op, d: Data):
    return call(op, implementation(op, "upstream"), d), call(op, implementation(op, "torch"), d)


def check(op, d: Data, fn=None, want=None, **launch):
    """Ours (poisoned output) against upstream and the reference: gathers bit-exact, scatters and
    weight gradients by relative L2 error. Returns a dict of findings."""
    up, ref = want if want is not None else expected(op, d)
    fn = fn or implementation(op, "ours")
    ours = poisoned(lambda: call(op, fn, d, **launch), up.numel(), d.dtype, d.device)
    kind = op_kind(op)
    out = {"op": op}
    if ours.shape != up.shape:
        out.update(ok=False, why=f"shape {tuple(ours.shape)} != upstream {tuple(up.shape)}")
        return out
    if kind == "gather":
        eq_up = bool(torch.equal(ours, up))
        eq_ref = bool(torch.equal(ours, ref))
        out.update(ok=eq_up and eq_ref, exact_vs_upstream=eq_up, exact_vs_torch=eq_ref)
    else:
        e_up, e_ref, e_upref = rel_l2(ours, up), rel_l2(ours, ref), rel_l2(up, ref)
        out.update(ok=e_up <= TOL[kind] and e_ref <= TOL[kind], rel_err_vs_upstream=e_up,
                   rel_err_vs_torch=e_ref, upstream_rel_err_vs_torch=e_upref)
    return out


def narrow_upstream_autotuning() -> None:
    """Upstream's autotuned routing kernels narrowed to their first config: the Triton interpreter
    cannot autotune (the config changes speed, not results)."""
    import megablocks.backend.kernels as k  # noqa: PLC0415
    for autotuned in (k._padded_copy, k._padded_copy_wgrad, k._binned_copy, k._binned_copy_wgrad):
        autotuned.configs = autotuned.configs[:1]


DEVICE_HELP = "cpu, cuda[:N] or npu[:N] (default: the NPU, else CUDA, else the CPU)"


def setup(name: str | None = None) -> torch.device:
    """The device a benchmark runs on: ``name`` (a ``--device`` value, :data:`DEVICE_HELP`), else the
    NPU, else CUDA, else the CPU; a device this machine lacks ends the program with the reason. On
    the CPU, upstream's autotuned kernels are narrowed to one config."""
    from megablocks_ascend import devices  # noqa: PLC0415
    from megablocks_ascend.cli.selftest import default_device  # noqa: PLC0415
    try:
        device = devices.requested(name) if name else default_device()
    except devices.DeviceUnavailable as e:
        raise SystemExit(str(e)) from None
    if device.type == "cpu":
        narrow_upstream_autotuning()
    return device
