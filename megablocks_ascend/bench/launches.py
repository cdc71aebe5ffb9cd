"""A launch counter: what one block of PyTorch code would launch on a device, counted on any device.

``LaunchCounter`` records, while a block runs,

* every **aten op that would launch a device kernel** (a ``TorchDispatchMode``): each op that
  reaches the dispatcher, except views and other ops that only make or change tensor metadata
  (:func:`launches_kernel` says which), counted once even where its device implementation is
  several kernels (a CUB radix sort is ~10, a cumsum 1-3; ``torch.profiler`` on a GPU counts those:
  ``benchmarks/bench_steps.py``'s ``kernels`` column, ``benchmarks/launches_per_step.py``);
* every **Triton kernel launch**: the Triton launcher is hooked (``JITFunction.run`` compiled,
  ``GridExecutor.__call__`` in the interpreter; an autotuned or heuristics-wrapped kernel ends
  there too, so every Triton kernel is counted once per launch, ours, MegaBlocks' and stk's alike);
* every **collective** of ``torch.distributed`` (the ``c10d`` ops an expert-parallel layer's
  ``all_to_all_single`` reaches the dispatcher as), one launch each (NCCL runs one kernel per
  collective).

The Triton interpreter runs a kernel on CPU tensors by copying each argument into NumPy and the
results back (``Tensor.cpu``, ``copy_``...): device work that a compiled launch does not do. While
a Triton launch runs, the dispatch mode counts nothing, so those copies are not counted, and a
kernel costs one launch in the interpreter as it does on a device.

Where the tensors are on an accelerator (``device="cuda"``/``"npu"``), an op counts only when one
of its tensors is on that device (an op on host tensors launches nothing there); on the CPU, the
stand-in for a device, every op counts (``Tensor.cpu()`` of a CPU tensor does not reach the
dispatcher, so a device-to-host copy is not seen there: ``tests/host_syncs.py`` finds those).

With ``where=True`` each launch also records the source line that caused it: the innermost frame
outside torch and this module (MegaBlocks, stk, megablocks_ascend, the caller), and for the
backward of a torch op (an autograd node implemented in C++) the node's name and the line of the
forward that created it (recorded by anomaly mode with its NaN checks off, which adds no op).

    with LaunchCounter(where=True) as launches:
        step()
    launches.total, launches.by_name(), print(launches.report())

A ``torch.library`` custom op reaches the dispatch mode as one opaque op (and runs its Python
implementation with the mode off); the counter runs that implementation itself under the mode (as
``tests/host_syncs.py`` does), and fails on a custom op whose implementation it cannot find rather
than hide its launches.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch nothing: allocation without initialisation, and metadata-only ops whose schema
# does not mark their output as an alias (views that do are found from the schema).
NO_KERNEL = frozenset({
    "aten.empty.memory_format", "aten.empty.names", "aten.empty_like.default", "aten.empty_strided.default",
    "aten.new_empty.default", "aten.new_empty_strided.default", "aten.detach.default", "aten.alias.default",
    "aten._unsafe_view.default", "aten._reshape_alias.default", "aten.lift_fresh.default",
    "aten.set_.source_Storage_storage_offset", "aten.resize_.default", "aten._has_compatible_shallow_copy_type.default",
    "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default", "aten.sym_storage_offset.default",
    "aten.is_same_size.default", "aten.is_contiguous.default", "aten.is_contiguous.memory_format",
    "aten.dim.default", "aten.size.default", "aten.stride.default", "aten.numel.default",
})

_BUILTIN_NAMESPACES = ("aten", "prim", "prims")
_COLLECTIVE_NAMESPACE = "c10d"  # torch.distributed's collectives (c10d.alltoall_base_, ...)
_is_view_cache: dict = {}


def launches_kernel(func) -> bool:
    """Whether the aten op ``func`` would launch a device kernel: not a view (an output that
    aliases an input without writing it, read from the op's schema) and not in :data:`NO_KERNEL`."""
    hit = _is_view_cache.get(func)
    if hit is None:
        returns = func._schema.returns
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        hit = _is_view_cache[func] = not is_view and str(func) not in NO_KERNEL
    return hit


@dataclasses.dataclass(frozen=True)
class Launch:
    kind: str  # "aten", "triton" or "collective"
    name: str  # "aten.mm.default", "triton:_gather_tokens", "c10d.alltoall_base_.default"
    where: str = ""  # with where=True: the source line that caused it ("megablocks/layers/moe.py:170 in ...")

    def __str__(self):
        return f"{self.name} at {self.where}" if self.where else self.name


# -- where a launch comes from

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_AUTOGRAD_DIR = os.path.join(_TORCH_DIR, "autograd") + os.sep
try:
    import triton as _triton  # noqa: PLC0415
    _TRITON_DIR = os.path.dirname(_triton.__file__) + os.sep
except ImportError:
    _TRITON_DIR = _TORCH_DIR
_LAUNCH_WRAPPER = os.path.join("megablocks_ascend", "compat.py")  # compat.Kernel: launches triton.jit
_SITE = "site-packages" + os.sep
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_HERE))) + os.sep


def _short(path: str) -> str:
    if _SITE in path:
        return path.split(_SITE)[-1]
    if path.startswith(_REPO):
        return path[len(_REPO):]
    return os.path.basename(path)


_OWN = ("_where", "_add", "__torch_dispatch__", "launch", "_custom")  # the counter's frames (not layer_step's)


def _skipped(path: str, function: str = "") -> bool:
    return (path == _HERE and function in _OWN) or path.startswith((_TORCH_DIR, _TRITON_DIR)) \
        or path.endswith(("contextlib.py", "functools.py", _LAUNCH_WRAPPER))


def _frame_where(frame) -> str:
    return f"{_short(os.path.abspath(frame.f_code.co_filename))}:{frame.f_lineno} in {frame.f_code.co_name}"


def _forward_where(node) -> str:
    """The innermost frame outside torch of the forward that created autograd ``node`` (from the
    traceback anomaly mode stores on it), or ''."""
    tb = (node.metadata or {}).get("traceback_") if hasattr(node, "metadata") else None
    if not tb:
        return ""
    best = ""
    entries = tb if isinstance(tb, list) else [tb]
    for line in (ln for entry in entries for ln in str(entry).splitlines()):
        line = line.strip()
        if not line.startswith('File "'):
            continue
        path, _, rest = line[len('File "'):].partition('"')
        path = os.path.abspath(path)
        # rest: ", line N, in fn"
        parts = [p.strip() for p in rest.split(",")]
        lineno = next((p.split()[1] for p in parts if p.startswith("line ")), "?")
        fn = next((p[3:] for p in parts if p.startswith("in ")), "?")
        if _skipped(path, fn):
            continue
        best = f"{_short(path)}:{lineno} in {fn}"
    return best


def _where() -> str:
    frame = sys._getframe(2)
    crossed_engine = False  # passed through torch.autograd (the engine runs C++ backward nodes there)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not _skipped(path, frame.f_code.co_name):
            break
        if path.startswith(_AUTOGRAD_DIR) and frame.f_code.co_name in ("_engine_run_backward", "backward", "grad"):
            crossed_engine = True
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    if node is not None and (crossed_engine or frame is None):
        # A backward node implemented in C++: the Python stack ends at the caller's backward()
        # (or, on a GPU's autograd thread, at nothing).
        forward = _forward_where(node)
        return f"autograd {node.name()}" + (f" of {forward}" if forward else "")
    return _frame_where(frame) if frame is not None else "?"


# -- the Triton launcher hook


def _triton_launchers():
    """``(class, method)`` pairs that every Triton launch goes through once: ``JITFunction.run``
    for compiled kernels (an autotuner or heuristics wrapper ends there too), and the
    interpreter's ``GridExecutor.__call__`` (Triton 3.3 and 3.9 alike: 3.3's interpreted
    ``kernel[grid]`` returns one directly, its autotuner and 3.9's launches build one)."""
    found = []
    try:
        from triton.runtime.jit import JITFunction  # noqa: PLC0415
        found.append((JITFunction, "run"))
    except ImportError:
        pass
    try:
        from triton.runtime.interpreter import GridExecutor  # noqa: PLC0415
        found.append((GridExecutor, "__call__"))
    except ImportError:
        pass
    return found


def _kernel_name(launcher) -> str:
    fn = getattr(launcher, "fn", None)
    while fn is not None and not hasattr(fn, "__code__") and hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", None) or type(launcher).__name__


class _TritonHook:
    """Wraps the launchers while at least one counter listens (nested counters share it)."""

    listeners: list = []
    depth = 0  # > 0 while a Triton launch runs (its interpreter copies are not counted)
    originals: dict = {}

    @classmethod
    def add(cls, counter) -> None:
        if not cls.listeners:
            found = {(owner, method): owner.__dict__.get(method) for owner, method in _triton_launchers()}
            for (owner, method), original in found.items():
                if original is None:  # a Triton this counter was not written for: say so, undercount nothing
                    import triton  # noqa: PLC0415
                    raise RuntimeError(f"LaunchCounter: Triton {triton.__version__}'s {owner.__name__} has no "
                                       f"{method} of its own to hook, so its launches could not be counted")
            for (owner, method), original in found.items():
                cls.originals[(owner, method)] = original
                setattr(owner, method, cls._wrap(original))
        cls.listeners.append(counter)

    @classmethod
    def remove(cls, counter) -> None:
        cls.listeners.remove(counter)
        if not cls.listeners:
            for (owner, method), original in cls.originals.items():
                setattr(owner, method, original)
            cls.originals.clear()

    @classmethod
    def _wrap(cls, original):
        def launch(self, *args, **kwargs):
            if cls.depth == 0 and not kwargs.get("warmup", False):
                name = "triton:" + _kernel_name(self)
                for counter in cls.listeners:
                    counter._add("triton", name)
            cls.depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                cls.depth -= 1
        launch.__wrapped__ = original
        return launch


# -- the counter


class LaunchCounter:
    """``with LaunchCounter() as c: step()``; then ``c.total``, ``c.by_name()``, ``c.report()``.

    ``device``: the device type the step's tensors are on (``None``: the CPU stand-in, where every
    op counts); ``where``: record each launch's source line (slower: a stack walk per op, and
    anomaly mode's forward tracebacks).
    """

    def __init__(self, device: str | torch.device | None = None, where: bool = False):
        self.device = None if device is None else torch.device(device).type
        if self.device == "cpu":
            self.device = None
        self.where = where
        self.events: list[Launch] = []
        outer = self

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.namespace == _COLLECTIVE_NAMESPACE:
                    out = func(*args, **kwargs)
                    outer._add("collective", str(func))
                    return out
                if func.namespace not in _BUILTIN_NAMESPACES:
                    return outer._custom(func, args, kwargs)
                out = func(*args, **kwargs)
                if _TritonHook.depth == 0 and launches_kernel(func) and outer._on_device(args, kwargs, out):
                    outer._add("aten", str(func))
                return out

        self._mode = _Dispatch()
        self._stack = contextlib.ExitStack()

    def _on_device(self, args, kwargs, out) -> bool:
        if self.device is None:
            return True
        for tree in (args, kwargs, out):
            for t in torch.utils._pytree.tree_leaves(tree):
                if isinstance(t, torch.Tensor) and t.device.type == self.device:
                    return True
        return False

    def _custom(self, func, args, kwargs):
        opdef = torch._library.custom_ops.OPDEFS.get(f"{func.namespace}::{func._opname}")
        if opdef is None:
            raise RuntimeError(f"LaunchCounter: custom op {func} reached the dispatch mode, and its Python "
                               "implementation cannot be found to count what it launches")
        with self._mode:
            return opdef._init_fn(*args, **kwargs)

    def _add(self, kind: str, name: str) -> None:
        self.events.append(Launch(kind, name, _where() if self.where else ""))

    def __enter__(self) -> "LaunchCounter":
        _TritonHook.add(self)
        self._stack.callback(_TritonHook.remove, self)
        if self.where:
            self._stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
        self._stack.enter_context(self._mode)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()

    # -- results

    @property
    def total(self) -> int:
        return len(self.events)

    @property
    def aten(self) -> int:
        return sum(e.kind == "aten" for e in self.events)

    @property
    def triton(self) -> int:
        return sum(e.kind == "triton" for e in self.events)

    @property
    def collectives(self) -> int:
        return sum(e.kind == "collective" for e in self.events)

    def by_name(self) -> collections.Counter:
        return collections.Counter(e.name for e in self.events)

    def by_where(self) -> collections.Counter:
        return collections.Counter((e.where, e.name) for e in self.events)

    def report(self) -> str:
        """One line per op (count, name), and with ``where`` one line per (source line, op), in
        the order they first launched."""
        lines = [f"{self.total} launches: {self.aten} aten ops, {self.triton} Triton kernels"
                 + (f", {self.collectives} collectives" if self.collectives else "")]
        if self.where:
            counts = self.by_where()
            for (where, name), n in counts.items():
                lines.append(f"{n:4d}  {name:40s} {where}")
        else:
            for name, n in sorted(self.by_name().items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"{n:4d}  {name}")
        return "\n".join(lines)


# -- upstream's kernels on the CPU


UPSTREAM_PATCHES = ("routing-kernels", "routing-ops", "stk-kernels", "routing-preparation")


@contextlib.contextmanager
def upstream_kernels():
    """MegaBlocks' own routing preparation, routing ops and kernels, and stk's own block-sparse
    kernels, as shipped, for the block: the patches that route them through megablocks_ascend
    (``routing-kernels``, ``routing-ops``, ``stk-kernels``, ``routing-preparation``) are reverted,
    and applied again on exit. Upstream's autotuned
    routing kernels are narrowed to their first config (the interpreter cannot time configs; the
    config changes speed, not what launches). What a step launches on CPU tensors in the Triton
    interpreter is then what the same step launches on CUDA with the ``cuda`` backend, except that
    our wrappers (``megablocks_ascend.ops``) stand in for upstream's there: both launch the same
    kernels. The ``megablocks_ops`` stand-in and the grouped GEMM stand-in stay (there is no CUDA
    extension on either machine)."""
    from megablocks_ascend import patching  # noqa: PLC0415
    patches = [p for p in patching.PATCHES if p.name in UPSTREAM_PATCHES]
    if len(patches) != len(UPSTREAM_PATCHES):
        raise RuntimeError(f"patch registry lacks one of {UPSTREAM_PATCHES}: {[p.name for p in patching.PATCHES]}")
    import megablocks.backend.kernels as k  # noqa: PLC0415
    narrowed = []
    for p in reversed(patches):
        p.revert()
    try:
        for name in ("_padded_copy", "_padded_copy_wgrad", "_binned_copy", "_binned_copy_wgrad"):
            autotuned = getattr(k, name)
            narrowed.append((autotuned, autotuned.configs))
            autotuned.configs = autotuned.configs[:1]
        yield
    finally:
        for autotuned, configs in narrowed:
            autotuned.configs = configs
        for p in patches:
            p.apply(p)
            p.applied = True


# -- one training step of MegaBlocks' unchanged layers

LAYERS = ("MoE", "dMoE-grouped", "dMoE-sparse")


def layer_step(layer: str, *, experts: int = 16, top_k: int = 4, tokens: int = 64, hidden: int = 64,
               ffn: int = 128, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               seed: int = 0, backend: str | None = None, amp: torch.dtype | None = None):
    """``step()``: one training step of MegaBlocks' own layer ``layer`` (one of :data:`LAYERS`),
    its routing served by ``backend``: a ``MEGABLOCKS_BACKEND`` value, ``"upstream"`` (MegaBlocks'
    and stk's own kernels: the ``cuda`` backend on CUDA tensors, :func:`upstream_kernels` on CPU
    tensors), or ``None`` (whatever ``MEGABLOCKS_BACKEND`` says).

    The layer is built as :mod:`~megablocks_ascend.bench.steps` builds it (``return_bias=False``: the output bias is
    added inside the layer; capacity factor 1; the default load-balancing loss weight, 0.1), on
    ``tokens`` tokens (sequence ``tokens``, batch 1). A step is what a training loop does per
    layer: gradients set to ``None``, the forward, the load-balancing loss
    (``batched_load_balancing_loss``), one backward through the output (with a fixed output
    gradient) and the loss together, and the loss list cleared. With ``amp`` (``torch.bfloat16``,
    say) the parameters and input are ``dtype`` and the forward and the loss run under
    ``torch.autocast`` to ``amp`` (the backward outside it, as a training loop does). ``ffn`` must be a multiple of 128
    for the sparse dMoE (MegaBlocks' block size), and stk's own kernels (:func:`upstream_kernels`)
    also need ``hidden`` to be one.
    """
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import dMoE  # noqa: PLC0415
    from megablocks.layers.moe import MoE, batched_load_balancing_loss, clear_load_balancing_loss  # noqa: PLC0415

    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    device = torch.device(device)
    torch.manual_seed(seed)
    def serving():
        from megablocks_ascend import backends  # noqa: PLC0415
        if backend is None:
            return contextlib.nullcontext()
        if backend == "upstream":
            return backends.use_backend("cuda") if device.type == "cuda" else upstream_kernels()
        return backends.use_backend(backend)

    # A named backend serves the construction too: MegaBlocks' refusal of mlp_impl="sparse" is lifted
    # (or kept) in Arguments by the backend that will serve stk's matmuls on the layer's device, and
    # under MEGABLOCKS_BACKEND=auto that is stk's own kernels on CUDA. ("upstream" builds as the
    # environment says: on CPU its context takes our patches back, the refusal's lifting included.)
    with serving() if backend not in (None, "upstream") else contextlib.nullcontext():
        args = Arguments(hidden_size=hidden, ffn_hidden_size=ffn, moe_num_experts=experts, moe_top_k=top_k,
                         moe_capacity_factor=1, mlp_impl="sparse" if layer == "dMoE-sparse" else "grouped",
                         bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, return_bias=False,
                         device=torch.cuda.current_device() if device.type == "cuda" else device)
    module = (MoE if layer == "MoE" else dMoE)(args)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(tokens, 1, hidden, device=device, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(tokens, 1, hidden, device=device, generator=gen).to(dtype)

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        with serving():
            with torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
                out = module(x)
                loss = batched_load_balancing_loss(args)
            torch.autograd.backward([out, loss], [g.to(out.dtype), None])
        clear_load_balancing_loss()
        return out

    step.module, step.x, step.args = module, x, args
    return step


def count_step(step, *, warmup: int = 1, device=None, where: bool = False) -> LaunchCounter:
    """What one call of ``step()`` launches, after ``warmup`` calls (caches filled, autotuning done)."""
    for _ in range(warmup):
        step()
    with LaunchCounter(device=device, where=where) as counter:
        step()
    return counter
