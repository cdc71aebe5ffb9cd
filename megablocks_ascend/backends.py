"""Which implementation serves each routing and block-sparse call, and a record of who served it.

``MEGABLOCKS_BACKEND`` (see :mod:`megablocks_ascend.envs`) or the :func:`use_backend`
context manager picks one of:

``ascend``  our Triton kernels (:mod:`megablocks_ascend.kernels`): triton-ascend on NPU tensors,
            standard Triton on CUDA tensors, the Triton interpreter on CPU tensors.
``cuda``    upstream's kernels (``megablocks.backend.kernels``, ``stk.backend.triton_kernels`` as
            shipped), CUDA only; stk's are refused where they compute wrong results.
``torch``   plain PyTorch (:mod:`megablocks_ascend.reference`), any device.
``auto``    by device: NPU -> ``ascend``, CUDA -> ``cuda``, CPU -> ``torch``.

Each backend is one :class:`Backend` record in :data:`RECORDS` (what it serves, on which devices,
where its functions come from, why it refuses what it cannot serve); the dispatchers below ask the
record and name no backend. There is no fallback: a backend that cannot run on the given tensors raises
:class:`BackendUnavailable` saying what to change. :func:`trace` records every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import threading
from typing import Any, Callable, Iterator

import torch

from megablocks_ascend import compat, devices, envs, keeping, reference, validation
from megablocks_ascend.kernels import blocksparse, preparation, routing
from megablocks_ascend.kernels import topology as topology_kernels

BACKENDS = envs.BACKENDS


class BackendUnavailable(RuntimeError):
    """The requested backend cannot serve tensors on this device."""


class CaptureError(RuntimeError):
    """A call that must read a device value on the host was made while a graph is being captured
    (raised before the read, so the capture is not left broken)."""


# ------------------------------------------------------------------------------------------
# The backends, declared.


def _ready(device) -> str | None:
    return None


def _refuses_nothing(name: str, call: dict, block: int) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend: a value of ``MEGABLOCKS_BACKEND``, and everything the dispatchers need to know
    about it. Adding a backend is adding one of these to :data:`RECORDS` (and its name to
    ``envs.BACKENDS``, the variable's vocabulary; a test checks that the two agree)."""

    name: str
    devices: tuple[str, ...] | None  # device types it serves; None: any
    elsewhere: str  # the error for tensors on another device type ({kind}, {device})
    # Where its functions come from, looked up at each call (so that replacing one takes effect):
    routing: Callable[[str], Callable]  # a megablocks.backend.kernels name -> the function serving it
    preparation: Callable[[], Callable]  # -> prepare_routing(top_experts, num_experts, block, route, capacity)
    blocksparse: Callable[[str], Callable]  # an stk.backend.triton_kernels name -> the function serving it
    auto: tuple[str, ...] = ()  # device types MEGABLOCKS_BACKEND=auto gives it
    unready: Callable[[Any], str | None] = _ready  # why it cannot serve a device it serves, on this machine
    refuse_blocksparse: Callable[[str, dict, int], str | None] = _refuses_nothing  # why not (name, args, block)
    contiguous: bool = False  # its routing functions take contiguous tensors
    upstream: bool = False  # MegaBlocks' and stk's own functions (_make_dispatcher, patches/sparse-mlp-refusal)
    # Its counting sort ("sort"/"histogram" -> kernel) serves the megablocks_ops stand-in's sort and
    # histogram for up to sort_keys keys; its routing preparation refuses more experts.
    counting_sort: Callable[[str], Callable] | None = None
    sort_keys: int = 0
    # -> topology(padded_bins, block_size, block_rows, blocks_per_row): the sparse dMoE's topology
    topology: Callable[[], Callable] | None = None
    # The sparse dMoE may size its padded buffers and topology statically (ops.padded_rows) with it:
    # its padded_gather takes num_rows and its topology any block_rows. Upstream's take neither.
    static_sizes: bool = True


def _ascend_unready(device) -> str | None:
    if device.type == "cpu" and not compat.interpreter_active():
        return "MEGABLOCKS_BACKEND=ascend: " + compat.INTERPRETER_HINT
    if device.type == "npu" and not compat.is_triton_ascend():
        return ("MEGABLOCKS_BACKEND=ascend on NPU tensors needs triton-ascend "
                "(pip install 'megablocks-ascend[npu]'), but the installed triton is not triton-ascend")
    return None


def _ascend_blocksparse_refusal(name: str, call: dict, block: int) -> str | None:
    if block in blocksparse.BLOCK_SIZES:
        return None
    return (f"MEGABLOCKS_BACKEND=ascend: our block-sparse kernels take blocks of "
            f"{', '.join(map(str, blocksparse.BLOCK_SIZES))}, not {block}; use MEGABLOCKS_BACKEND=torch")


def _stk_refusal(name: str, call: dict, block: int) -> str | None:
    why = stk_kernels_refusal(name, call)
    if why is None:
        return None
    return (f"MEGABLOCKS_BACKEND={requested()} would run stk's own {name} kernel, which cannot compute this call "
            f"correctly: {why}. Use MEGABLOCKS_BACKEND=ascend (our Triton kernels) or torch (plain PyTorch)")


def _as_shipped(recorded: dict, module: str, name: str, what: str) -> Callable:
    """``<module>.<name>`` as shipped: recorded by the patch registry before it replaced it, else
    looked up now (and refused if it is already ours)."""
    if name not in recorded:
        fn = getattr(importlib.import_module(module), name)
        if getattr(fn, "__megablocks_ascend__", False):
            raise BackendUnavailable(f"{what}{module}.{name} was not recorded before patching")
        recorded[name] = fn
    return recorded[name]


def _upstream(name: str) -> Callable:
    """``megablocks.backend.kernels.<name>`` as shipped."""
    return _as_shipped(UPSTREAM, "megablocks.backend.kernels", name, "upstream ")


def _upstream_stk(name: str) -> Callable:
    """``stk.backend.triton_kernels.<name>`` as shipped."""
    return _as_shipped(UPSTREAM_STK, "stk.backend.triton_kernels", name, "")


# Upstream's functions, for the ``cuda`` backend. Filled by the patch registry before it replaces
# them (megablocks_ascend.patching); looked up lazily otherwise.
UPSTREAM: dict[str, Callable] = {}
UPSTREAM_STK: dict[str, Callable] = {}


def end_bit(num_experts: int) -> int:
    """The bits MegaBlocks' radix sort looks at for ``num_experts`` ids (``ParallelMLP.sort_end_bit``:
    ``max(ceil(log2(num_experts)), 1)``)."""
    return max((num_experts - 1).bit_length(), 1)


def upstream_preparation(top_experts, num_experts, block=0, route=-1, capacity=0):
    """MegaBlocks' own sequence (``ParallelMLP.indices_and_bins``, ``ParallelDroplessMLP.
    indices_and_padded_bins``): ``ops.sort``, ``ops.histogram``, ``ops.inclusive_cumsum`` (and
    ``ops.round_up`` with a second cumsum for ``padded_bins``), through whichever
    ``megablocks_ops`` is installed (the CUDA extension, or the plugin's stand-in)."""
    del route, capacity  # upstream's kernels need no route map
    import megablocks.ops as mops  # noqa: PLC0415
    top = top_experts.reshape(-1).int()
    bin_ids, indices = mops.sort(top, end_bit(num_experts))
    tokens_per_expert = mops.histogram(top, num_experts)
    bins = mops.inclusive_cumsum(tokens_per_expert, 0)
    bins = bins.view(1) if not bins.dim() else bins
    padded_bins = None
    if block:
        padded_bins = mops.inclusive_cumsum(mops.round_up(tokens_per_expert, block), 0)
        padded_bins = padded_bins.view(1) if not padded_bins.dim() else padded_bins
    return indices, bin_ids, bins, tokens_per_expert, padded_bins


def upstream_topology(padded_bins, block_size, block_rows, blocks_per_row):
    """MegaBlocks' own topology (``ParallelDroplessMLP.topology`` and ``sparse_transpose`` of
    MegaBlocks 0.10.0): ``ops.topology``, ``stk.ops.row_indices``, then the transpose from
    ``ops.sort`` / ``ops.histogram`` / ``ops.inclusive_cumsum``, through whichever
    ``megablocks_ops`` and stk kernels are installed. ``block_rows`` must be
    ``padded_bins[-1] / block_size`` (upstream has no spare block rows: it leaves their column
    indices unwritten)."""
    import megablocks.ops as mops  # noqa: PLC0415
    import stk.ops  # noqa: PLC0415
    device = padded_bins.device
    columns = padded_bins.shape[0] * blocks_per_row
    offsets = torch.arange(0, block_rows * blocks_per_row + 1, blocks_per_row, dtype=torch.int32, device=device)
    column_indices = mops.topology(padded_bins, block_size, block_rows, blocks_per_row)
    data = torch.empty(column_indices.numel(), block_size, block_size, dtype=torch.float16, device="meta")
    shape = (block_rows * block_size, columns * block_size)
    row_indices = stk.ops.row_indices(shape, data, offsets, column_indices)
    _, gather_indices = mops.sort(column_indices.int(), max((columns - 1).bit_length(), 1))
    column_indices_t = row_indices.gather(0, gather_indices.long())
    counts = mops.inclusive_cumsum(mops.histogram(column_indices, columns), 0)
    counts = counts.unsqueeze(0) if counts.dim() == 0 else counts
    offsets_t = torch.cat([torch.zeros((1,), dtype=torch.int32, device=device), counts])
    return row_indices, column_indices, offsets, column_indices_t, offsets_t, gather_indices.int()


RECORDS: dict[str, Backend] = {b.name: b for b in (
    Backend(
        name="ascend",  # our Triton kernels
        devices=("npu", "cuda", "cpu"), auto=("npu",),
        elsewhere="MEGABLOCKS_BACKEND=ascend cannot run on {kind} tensors",
        unready=_ascend_unready,
        routing=functools.partial(getattr, routing),
        preparation=functools.partial(getattr, preparation, "prepare_routing"),
        blocksparse=functools.partial(getattr, blocksparse),
        refuse_blocksparse=_ascend_blocksparse_refusal,
        contiguous=True,  # our launchers take contiguous tensors (the preparation's are)
        counting_sort=functools.partial(getattr, preparation), sort_keys=devices.MAX_PREP_KEYS,
        topology=functools.partial(getattr, topology_kernels, "topology"),
    ),
    Backend(
        name="cuda",  # upstream MegaBlocks' and stk's own kernels
        devices=("cuda",), auto=("cuda",),
        elsewhere="MEGABLOCKS_BACKEND=cuda runs upstream MegaBlocks' CUDA kernels, but the tensors are on {device}; "
                  "use MEGABLOCKS_BACKEND=ascend (our Triton kernels) or torch (plain PyTorch)",
        routing=_upstream,
        preparation=lambda: upstream_preparation,
        blocksparse=_upstream_stk,
        refuse_blocksparse=_stk_refusal,
        upstream=True,
        topology=lambda: upstream_topology,
        static_sizes=False,
    ),
    Backend(
        name="torch",  # plain PyTorch, the reference the others are tested against
        devices=None, auto=("cpu",),
        elsewhere="",
        routing=functools.partial(getattr, reference),
        preparation=functools.partial(getattr, reference, "prepare_routing"),
        blocksparse=functools.partial(getattr, reference.blocksparse),
        topology=functools.partial(getattr, reference.blocksparse, "topology"),
    ),
)}
_AUTO = {kind: b.name for b in RECORDS.values() for kind in b.auto}


# ------------------------------------------------------------------------------------------
# Which backend serves a call.

# use_backend() overrides are process-wide, not per thread or context: on CUDA and NPU the
# autograd engine runs backward passes on its own device threads, and a backward started inside a
# use_backend() block must be served by the same backend as its forward.
_overrides: list[str] = []
_overrides_lock = threading.Lock()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Serve routing calls made while this block runs with backend ``name``, overriding
    ``MEGABLOCKS_BACKEND``. Process-wide (backward passes run by the autograd engine's threads
    included), so do not run different backends from several threads at once."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid values are: {', '.join(BACKENDS)}")
    with _overrides_lock:
        _overrides.append(name)
        depth = len(_overrides)
    try:
        yield
    finally:
        with _overrides_lock:
            del _overrides[depth - 1:]


def requested() -> str:
    """The backend asked for: the innermost :func:`use_backend`, else ``MEGABLOCKS_BACKEND``."""
    return _overrides[-1] if _overrides else envs.backend()


_resolved: dict = {}  # (requested name, torch.device) -> backend: the answers that were not errors


def resolve(device: torch.device) -> str:
    """The backend that serves tensors on ``device``, or :class:`BackendUnavailable`.

    A successful answer depends only on the name asked for, the device and what is installed (the
    Triton interpreter, once on, stays on), so it is remembered: every routing call asks."""
    name = requested()
    try:
        return _resolved[(name, device)]
    except (KeyError, TypeError):  # (TypeError: an unhashable stand-in for a device, in tests)
        pass
    backend = _resolve(name, device)
    if isinstance(device, torch.device):
        _resolved[(name, device)] = backend
    return backend


def _resolve(name: str, device: torch.device) -> str:
    kind = device.type
    if name == "auto":
        if kind not in _AUTO:
            raise BackendUnavailable(
                f"MEGABLOCKS_BACKEND=auto has no backend for {kind} tensors; "
                "set MEGABLOCKS_BACKEND=torch to use plain PyTorch")
        name = _AUTO[kind]
    backend = RECORDS[name]
    if backend.devices is not None and kind not in backend.devices:
        raise BackendUnavailable(backend.elsewhere.format(kind=kind, device=device))
    why = backend.unready(device)
    if why is not None:
        raise BackendUnavailable(why)
    return name


# ------------------------------------------------------------------------------------------
# Trace: who served what.


@dataclasses.dataclass(frozen=True)
class Call:
    op: str
    backend: str
    device: str


_traces: list[list[Call]] = []
_last: dict[str, str] = {}


@contextlib.contextmanager
def trace() -> Iterator[list[Call]]:
    """Collect a :class:`Call` for every routing kernel call made in this block."""
    calls: list[Call] = []
    _traces.append(calls)
    try:
        yield calls
    finally:
        _traces.remove(calls)


def last_backend(op: str) -> str | None:
    """The backend that served the most recent call of ``op`` (e.g. ``"binned_gather"``)."""
    return _last.get(op)


def _record(op: str, backend: str, device: torch.device) -> None:
    _last[op] = backend
    if _traces:  # a Call is made only for a trace() that is listening
        call = Call(op, backend, str(device))
        for calls in _traces:
            calls.append(call)


# ------------------------------------------------------------------------------------------
# The kernel entry points MegaBlocks calls (megablocks.backend.kernels), dispatched.

# name -> (parameters, ndim of x, whether x's rows are the tokens / the assignments)
SPECS: dict[str, tuple[tuple[str, ...], int, str | None]] = {
    "binned_gather": (("x", "indices", "weights", "bins", "expert_capacity", "top_k"), 2, "tokens"),
    "binned_scatter": (("x", "indices", "weights", "bins", "top_k"), 3, None),
    "binned_scatter_wgrad": (("x", "grad", "indices", "bins", "top_k"), 3, None),
    "gather": (("x", "indices", "bin_ids", "weights", "bins", "top_k"), 2, "tokens"),
    "scatter": (("x", "indices", "bin_ids", "weights", "bins", "top_k"), 2, "assignments"),
    "scatter_wgrad": (("x", "grad", "indices", "bin_ids", "bins", "top_k"), 2, "assignments"),
    "padded_gather": (("x", "indices", "bin_ids", "weights", "bins", "padded_bins", "top_k"), 2, "tokens"),
    "padded_scatter": (("x", "indices", "bin_ids", "weights", "bins", "padded_bins", "top_k"), 2, None),
    "padded_scatter_wgrad": (("x", "grad", "indices", "bin_ids", "bins", "padded_bins", "top_k"), 2, None),
}

_TENSOR_ARGS = ("x", "grad", "indices", "bin_ids", "weights", "bins", "padded_bins")
# Parameters of ours that upstream's functions do not have, after theirs: optional (None:
# upstream's behaviour). padded_gather's num_rows: the output's row count, known to the host (the
# sparse dMoE's static size), instead of padded_bins[-1] read on the host.
EXTRA_PARAMS: dict[str, tuple[str, ...]] = {"padded_gather": ("num_rows",)}


def _implementation(name: str, backend: str) -> Callable:
    return RECORDS[backend].routing(name)


class _Depth(threading.local):
    depth = 0


_dispatching = _Depth()


def _make_dispatcher(name: str) -> Callable:
    upstream_params, x_ndim, x_rows = SPECS[name]
    upstream_arity = len(upstream_params)
    params = upstream_params + EXTRA_PARAMS.get(name, ())
    tensor_positions = tuple(i for i, p in enumerate(params) if p in _TENSOR_ARGS)
    data_positions = tuple(i for i, p in enumerate(params) if p in ("x", "grad", "weights"))
    at = {p: params.index(p) for p in params}
    i_grad, i_bin_ids, i_weights, i_padded, i_capacity = (at.get(p) for p in (
        "grad", "bin_ids", "weights", "padded_bins", "expert_capacity"))
    i_indices, i_bins, i_top_k = at["indices"], at["bins"], at["top_k"]
    i_num_rows = at.get("num_rows")
    signature = inspect.Signature([
        inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          default=None if i >= upstream_arity else inspect.Parameter.empty)
        for i, p in enumerate(params)])

    def dispatcher(*args, **kwargs):
        if kwargs or len(args) != len(params):
            bound = signature.bind(*args, **kwargs)  # (every parameter but the optional ones is required)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        if _dispatching.depth:
            # Upstream's functions call their siblings by module-global name (scatter calls
            # padded_scatter), which now finds this dispatcher: hand those straight to upstream.
            return _upstream(name)(*args[:upstream_arity])
        x = args[0]
        if i_num_rows is not None:
            validation.check_num_rows(name, args[i_num_rows], args[i_padded])
            if args[i_num_rows] is None and isinstance(x, torch.Tensor) and keeping.capturing_on(x):
                raise CaptureError(
                    f"{name}: its output's row count is padded_bins[-1], read on the host (a device-to-host "
                    f"sync), which a graph capture cannot hold; {envs.SPARSE_SIZES_VAR}=exact asks the sparse "
                    "dMoE for these exact sizes: leave it unset (static sizes) to capture a sparse dMoE step, or "
                    "pass num_rows (megablocks_ascend.ops.padded_rows) when calling padded_gather yourself")
        prepared = validation.check_routing_args(
            name, x, x_ndim, args[i_indices], args[i_bins], args[i_top_k],
            None if i_bin_ids is None else args[i_bin_ids], None if i_weights is None else args[i_weights],
            None if i_padded is None else args[i_padded], None if i_capacity is None else args[i_capacity],
            None if i_grad is None else args[i_grad], x_rows)
        device = x.device
        backend = resolve(device)
        _record(name, backend, device)
        record = RECORDS[backend]
        if record.contiguous:  # (the preparation's tensors are contiguous)
            args = list(args)
            for i in data_positions if prepared else tensor_positions:
                if args[i] is not None:
                    args[i] = args[i].contiguous()
        elif record.upstream:
            _dispatching.depth += 1  # (only upstream's functions call back into the dispatchers)
            try:
                out = _implementation(name, backend)(*args[:upstream_arity])
            finally:
                _dispatching.depth -= 1
            if i_num_rows is not None and args[i_num_rows] is not None and out.shape[0] != args[i_num_rows]:
                raise BackendUnavailable(
                    f"MEGABLOCKS_BACKEND={requested()}: upstream's {name} sizes its output from padded_bins[-1] "
                    f"({out.shape[0]} rows), not from num_rows={args[i_num_rows]}; a static row count needs "
                    "MEGABLOCKS_BACKEND=ascend or torch")
            return out
        return _implementation(name, backend)(*args)

    dispatcher.__name__ = dispatcher.__qualname__ = name
    dispatcher.__signature__ = signature
    dispatcher.__doc__ = f"megablocks.backend.kernels.{name}, served by the backend MEGABLOCKS_BACKEND selects."
    dispatcher.__megablocks_ascend__ = True
    return dispatcher


KERNELS: dict[str, Callable] = {name: _make_dispatcher(name) for name in SPECS}
globals().update(KERNELS)


# ------------------------------------------------------------------------------------------
# The routing preparation: the router's expert ids -> indices, bin_ids, bins, tokens_per_expert
# (and padded_bins), as MegaBlocks' layers compute them before their routing calls.


def prepare_routing(top_experts, num_experts, block=0, route=-1, capacity=0):
    """``(indices, bin_ids, bins, tokens_per_expert, padded_bins)`` of the router's expert ids
    (``padded_bins`` None when ``block`` is 0), served by the backend ``MEGABLOCKS_BACKEND`` selects:
    our two-launch counting sort (``ascend``, which also writes the route map of layout ``route``
    for the step's routing calls), the plain-PyTorch reference (``torch``) or MegaBlocks' own
    sort / histogram / cumsum sequence (``cuda``). See :func:`validation.check_preparation`."""
    validation.check_preparation("prepare_routing", top_experts=top_experts, num_experts=num_experts, block=block,
                                 route=route, capacity=capacity)
    device = top_experts.device
    backend = resolve(device)
    record = RECORDS[backend]
    if record.counting_sort is not None and num_experts > record.sort_keys:
        raise BackendUnavailable(
            f"MEGABLOCKS_BACKEND={backend}: our routing preparation sorts up to {record.sort_keys} experts, not "
            f"{num_experts}; use MEGABLOCKS_BACKEND=torch")
    _record("prepare_routing", backend, device)
    out = record.preparation()(top_experts, num_experts, block, route, capacity)
    indices, bin_ids, bins, _, padded_bins = out
    # Well-formed by construction: the step's routing calls need not check it again (validation).
    validation.mark_prepared(indices, bins, bin_ids, padded_bins, values_checked=envs.checks_enabled())
    return out


def topology(padded_bins, block_size, block_rows, blocks_per_row):
    """The sparse dMoE's topology (:func:`megablocks_ascend.ops.topology`), served by the backend
    ``MEGABLOCKS_BACKEND`` selects; see :func:`validation.check_topology`."""
    validation.check_topology("topology", padded_bins=padded_bins, block_size=block_size, block_rows=block_rows,
                              blocks_per_row=blocks_per_row)
    device = padded_bins.device
    backend = resolve(device)
    _record("topology", backend, device)
    return RECORDS[backend].topology()(padded_bins, block_size, block_rows, blocks_per_row)


def static_sizes(device: torch.device) -> bool:
    """Whether the sparse dMoE on ``device`` may size its padded buffers and topology statically: the
    backend serving it takes ``num_rows`` and spare block rows (``Backend.static_sizes``)."""
    return RECORDS[resolve(device)].static_sizes


def counting_sort(op: str, x: torch.Tensor, num_keys: int) -> Callable | None:
    """The counting-sort kernel that serves the ``megablocks_ops`` stand-in's ``op`` (``sort`` or
    ``histogram``) for ``x``, or None: where the backend for its device has one (``ascend``: the
    routing preparation's, ``kernels/preparation.py``) and the keys are at most its ``sort_keys``
    (recorded in :func:`trace` then). Elsewhere the stand-in's PyTorch code serves it, as it always
    did: the stand-in is what MegaBlocks' own ``ops.sort`` and ``ops.histogram`` call (under
    ``cuda`` too, where the CUDA extension is not built)."""
    backend = resolve(x.device)
    record = RECORDS[backend]
    if record.counting_sort is None or num_keys > record.sort_keys:
        return None
    _record(op, backend, x.device)
    return record.counting_sort(op)


# ------------------------------------------------------------------------------------------
# stk's block-sparse matmuls (stk.backend.triton_kernels), dispatched the same way.

# name -> (parameters, the argument whose device stk itself takes as the call's device)
STK_SPECS: dict[str, tuple[tuple[str, ...], str]] = {
    "sdd": (("lhs", "rhs", "shape", "out", "offsets", "row_indices", "column_indices"), "out"),
    "dsd": (("shape", "data", "offsets", "row_indices", "column_indices", "offsets_t", "column_indices_t",
             "block_offsets_t", "transpose_a", "rhs", "out"), "rhs"),
    "dds": (("lhs", "shape", "data", "offsets", "row_indices", "column_indices", "offsets_t",
             "column_indices_t", "block_offsets_t", "transpose_b", "out"), "lhs"),
    "row_indices": (("shape", "data", "offsets", "column_indices", "out"), "out"),
}

STK_BLOCK_SIZE = 128  # stk's TritonConfig: its kernels compute 128 x 128 blocks and nothing else
_INT16_LIMIT = 1 << 15  # an int16 value wraps at 32768
_INT32_LIMIT = 1 << 31


def _max_offset(t: torch.Tensor) -> int:
    """The largest element offset a kernel computes when it addresses all of ``t`` by its strides."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def stk_kernels_refusal(name: str, a: dict) -> str | None:
    """Why stk 0.7.1's own Triton kernels cannot compute this (validated) call correctly, or None.

    The conditions come from reading stk's kernels and the IR Triton makes of them (the
    derivation is in ``patches/stk-kernels.md``): its kernels are compiled for 128 x 128 blocks
    and unmasked tiles; ``_sdd_kernel`` multiplies its int16 block indices by the ``BLOCK_M`` /
    ``BLOCK_N`` constants, which with Triton >= 3.2 stays int16 and wraps at 32768 (``dsd`` and
    ``dds`` multiply by a local variable, which Triton makes an int32 value); every other offset
    is int32.
    """
    if name == "row_indices":
        return None  # one store per block of a row number that validation checked fits the dtype
    block = a["out"].shape[1] if name == "sdd" else a["data"].shape[1]
    if block != STK_BLOCK_SIZE:
        return (f"stk's kernels compute {STK_BLOCK_SIZE} x {STK_BLOCK_SIZE} blocks only; this matrix has "
                f"{block} x {block}")
    if name == "sdd":
        (m, k), n = a["lhs"].shape, a["rhs"].shape[1]
    elif name == "dsd":
        (m, k), n = a["shape"], a["rhs"].shape[1]
    else:
        (m, k), n = a["lhs"].shape, a["shape"][1]
    if m % 128 or n % 128 or k % 32:
        return (f"stk's kernels need M and N multiples of 128 and K of 32 (no masked tiles); this call "
                f"multiplies [{m}, {k}] by [{k}, {n}]")
    if name == "sdd":  # pid_m * BLOCK_M and pid_n * BLOCK_N, with pid_m/pid_n loaded from the indices
        for what, index, dim in (("row_indices * BLOCK_M", a["row_indices"], m),
                                 ("column_indices * BLOCK_N", a["column_indices"], n)):
            if index.dtype == torch.int16 and dim - block >= _INT16_LIMIT:
                return (f"stk's sdd kernel computes {what} in int16 (Triton >= 3.2), which wraps for a block "
                        f"whose element offset is {_INT16_LIMIT} or more: this matrix dimension has {dim} "
                        f"elements (last block at {dim - block})")
    tensors = {"sdd": ("lhs", "rhs", "out"), "dsd": ("data", "rhs", "out"), "dds": ("lhs", "data", "out")}[name]
    for t in tensors:
        if _max_offset(a[t]) >= _INT32_LIMIT:
            return f"stk's kernels address '{t}' with int32 offsets, and it spans {_max_offset(a[t]) + 1} elements"
    return None


def _stk_implementation(name: str, backend: str) -> Callable:
    return RECORDS[backend].blocksparse(name)


def _make_stk_dispatcher(name: str) -> Callable:
    params, device_arg = STK_SPECS[name]
    signature = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params])

    def dispatcher(*args, **kwargs):
        if not kwargs and len(args) == len(params):
            a = dict(zip(params, args))
        else:
            a = signature.bind(*args, **kwargs).arguments
        block = validation.check_blocksparse(name, a)
        device = a[device_arg].device
        backend = resolve(device)
        why = RECORDS[backend].refuse_blocksparse(name, a, block)
        if why is not None:
            raise BackendUnavailable(why)
        _record(name, backend, device)
        _stk_implementation(name, backend)(**a)

    dispatcher.__name__ = dispatcher.__qualname__ = name
    dispatcher.__signature__ = signature
    dispatcher.__doc__ = f"stk.backend.triton_kernels.{name}, served by the backend MEGABLOCKS_BACKEND selects."
    dispatcher.__megablocks_ascend__ = True
    return dispatcher


STK_KERNELS: dict[str, Callable] = {name: _make_stk_dispatcher(name) for name in STK_SPECS}
