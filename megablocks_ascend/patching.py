"""The patch registry: every change megablocks-ascend makes to MegaBlocks, and how to undo it.

Each :class:`Patch` names its targets, why it exists, how it works and the upstream change
that would make it unnecessary (``patches/<name>.md`` says the same at length, and a test keeps
the two in step). Before replacing anything a patch checks that the upstream symbol still has
the shape it was written against, and raises :class:`PatchError` if not, rather than patching
something it does not understand.

:func:`install` applies every patch (a second call is a no-op); :func:`uninstall` puts every
original object back exactly (``is``-identical).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import io
import sys
import textwrap
import tokenize
import types
from typing import Any, Callable

import torch


class PatchError(RuntimeError):
    """An upstream symbol a patch relies on is missing or has changed shape."""


_MISSING = object()


@dataclasses.dataclass
class Patch:
    name: str
    targets: tuple[str, ...]
    why: str
    how: str
    upstream_fix: str
    apply: Callable[["Patch"], None]
    originals: dict[str, Any] = dataclasses.field(default_factory=dict)
    applied: bool = False

    def replace(self, target: str, new: Any) -> None:
        """Set ``target`` (``package.module.attr`` or ``package.module:Class.attr``) to ``new``."""
        owner, attr = _owner(target)
        if target not in self.originals:
            self.originals[target] = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) \
                else getattr(owner, attr, _MISSING)
        setattr(owner, attr, new)

    def set_module(self, name: str, module: Any) -> None:
        key = f"sys.modules[{name!r}]"
        if key not in self.originals:
            self.originals[key] = sys.modules.get(name, _MISSING)
        sys.modules[name] = module

    def revert(self) -> None:
        for target, original in reversed(list(self.originals.items())):
            if target.startswith("sys.modules["):
                name = target[len("sys.modules['"):-2]
                if original is _MISSING:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = original
                continue
            owner, attr = _owner(target)
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self.originals.clear()
        self.applied = False


def _owner(target: str):
    if ":" in target:
        module_name, path = target.split(":")
        owner = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        return owner, attr
    module_name, attr = target.rsplit(".", 1)
    return importlib.import_module(module_name), attr


def _expect_params(target: str, fn: Any, params: tuple[str, ...]) -> None:
    try:
        found = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        raise PatchError(f"{target}: cannot read its signature ({e})") from e
    if found != params:
        raise PatchError(
            f"{target} has parameters {found}, but megablocks-ascend was written against {params}; "
            "this MegaBlocks version is not supported by this megablocks-ascend version")


def _absent(module: str) -> bool:
    if module in sys.modules:
        return False
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


# ------------------------------------------------------------------------------------------
# The patches.


def _kernel_name(fn: Any) -> str:
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):  # JITFunction, Heuristics...
        fn = fn.fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(fn)


def _apply_triton_driverless(p: Patch) -> None:
    from megablocks_ascend import compat  # noqa: PLC0415
    if not compat.autotuner_needs_driver() or compat.active_drivers():
        return  # a driver is there, or this Triton asks for one only when it benchmarks
    target = "triton.runtime.autotuner:Autotuner.__init__"
    owner, attr = _owner(target)
    original = owner.__dict__[attr]
    params = list(inspect.signature(original).parameters)[1:]  # without self
    for name in ("fn", "configs", "do_bench"):
        if name not in params:
            raise PatchError(f"{target} has no parameter {name!r} (it has {tuple(params)}); this "
                             "Triton version is not supported by this megablocks-ascend version")
    fn_at, configs_at, do_bench_at = (params.index(n) for n in ("fn", "configs", "do_bench"))

    def __init__(self, *args, **kwargs):
        if len(args) <= do_bench_at and kwargs.get("do_bench") is None:
            fn = args[fn_at] if len(args) > fn_at else kwargs.get("fn")
            configs = args[configs_at] if len(args) > configs_at else kwargs.get("configs")
            kwargs["do_bench"] = compat.RefusingBenchmarker(_kernel_name(fn), len(configs or ()) or 1)
        original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    __init__.__signature__ = inspect.signature(original)
    p.replace(target, __init__)


def _apply_triton_interpreter_index(p: Patch) -> None:
    from megablocks_ascend import compat  # noqa: PLC0415
    if not compat.interpreter_active() or not compat.interpreter_index_broken():
        return  # compiled Triton, or an interpreter that converts scalars correctly
    target = "triton.runtime.interpreter._patch_lang_tensor"
    owner, attr = _owner(target)
    original = getattr(owner, attr)
    params = tuple(inspect.signature(original).parameters)
    if params not in compat.INTERPRETER_TENSOR_FORMS:
        raise PatchError(f"{target} has parameters {params}, but megablocks-ascend was written against "
                         f"{' or '.join(map(str, compat.INTERPRETER_TENSOR_FORMS))}; this Triton version "
                         "is not supported by this megablocks-ascend version")

    def _patch_lang_tensor(tensor, *scope):
        original(tensor, *scope)
        if scope:  # Triton 3.6: through the launch's scope, which restores it after the launch
            scope[0].set_attr(tensor, "__index__", compat.interpreter_index)
        else:  # Triton 3.3.1: set directly, as the original does
            tensor.__index__ = compat.interpreter_index

    _patch_lang_tensor.__wrapped__ = original
    _patch_lang_tensor.__signature__ = inspect.signature(original)
    p.replace(target, _patch_lang_tensor)


def _apply_megablocks_ops(p: Patch) -> None:
    from megablocks_ascend.native import megablocks_ops  # noqa: PLC0415
    if _absent("megablocks_ops"):
        p.set_module("megablocks_ops", megablocks_ops)


def _apply_grouped_gemm(p: Patch) -> None:
    from megablocks_ascend.native import grouped_gemm  # noqa: PLC0415
    if not _absent("grouped_gemm") and not getattr(sys.modules.get("grouped_gemm"),
                                                   "__megablocks_ascend_standin__", False):
        return  # the real package is installed: leave it alone
    modules = sys.modules.get("grouped_gemm")
    if modules is None:
        modules = grouped_gemm.make_modules()
        for name, module in modules.items():
            p.set_module(name, module)
    # MegaBlocks decided at its import whether grouped_gemm exists; if that import came first,
    # correct what it recorded.
    if "megablocks.grouped_gemm_util" in sys.modules:
        gg = sys.modules["megablocks.grouped_gemm_util"]
        for attr in ("_grouped_gemm_is_available", "backend", "ops"):
            if not hasattr(gg, attr):
                raise PatchError(f"megablocks.grouped_gemm_util.{attr} is missing")
        if not gg._grouped_gemm_is_available:
            top = sys.modules["grouped_gemm"]
            p.replace("megablocks.grouped_gemm_util._grouped_gemm_is_available", True)
            p.replace("megablocks.grouped_gemm_util.backend", top.backend)
            p.replace("megablocks.grouped_gemm_util.ops", top.ops)


def default_device() -> torch.device | int:
    """The device ``Arguments`` uses when none is given: the current NPU, else CUDA's
    current device (upstream's default), else the CPU."""
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return torch.device("npu", npu.current_device())
    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return torch.device("cpu")


def _apply_arguments_device(p: Patch) -> None:
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    fields = {f.name: f for f in dataclasses.fields(Arguments)}
    if "device" not in fields or fields["device"].default_factory is not torch.cuda.current_device:
        raise PatchError("megablocks.layers.arguments.Arguments.device no longer defaults to "
                         "torch.cuda.current_device")
    original = Arguments.__init__
    names = list(inspect.signature(original).parameters)[1:]
    position = names.index("device")

    def __init__(self, *args, **kwargs):
        if len(args) <= position and "device" not in kwargs:
            kwargs["device"] = default_device()
        original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    __init__.__signature__ = inspect.signature(original)
    p.replace("megablocks.layers.arguments:Arguments.__init__", __init__)


def _redecorate(p: Patch, cls_target: str, upstream: tuple[Callable, Callable], ours: tuple[Callable, Callable],
                what: str) -> None:
    """Re-decorate ``cls_target``'s ``forward``/``backward``: their undecorated functions (found
    through ``__wrapped__``) wrapped by ``ours`` instead of the ``upstream`` decorators (``what``)."""
    module_name, cls_name = cls_target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    for method, decorate, wrap in zip(("forward", "backward"), upstream, ours):
        sm = cls.__dict__.get(method)
        wrapper = getattr(sm, "__func__", None)
        inner = getattr(wrapper, "__wrapped__", None)
        # Every function a decorator returns shares the code object of its inner wrapper.
        expected_code = decorate(lambda *args: None).__code__
        if not isinstance(sm, staticmethod) or inner is None \
                or getattr(wrapper, "__code__", None) is not expected_code:
            raise PatchError(f"{cls_target}.{method} is no longer a staticmethod wrapped by {what}")
        p.replace(f"{cls_target}.{method}", staticmethod(wrap(inner)))


def _apply_autocast(p: Patch) -> None:
    from megablocks_ascend import autocast  # noqa: PLC0415
    target = "megablocks.layers.common.cast_if_autocast_enabled"
    owner, attr = _owner(target)
    _expect_params(target, getattr(owner, attr), ("tensor",))
    p.replace(target, autocast.cast_if_autocast_enabled)
    for cls_target in AUTOCAST_FUNCTIONS:
        _redecorate(p, cls_target,
                    (torch.amp.custom_fwd(device_type="cuda"), torch.amp.custom_bwd(device_type="cuda")),
                    (autocast.custom_fwd, autocast.custom_bwd), "torch.amp.custom_fwd/custom_bwd")


AUTOCAST_FUNCTIONS = (
    "megablocks.layers.mlp:ScaleGradient",
    "megablocks.layers.mlp:MemoryOptimizedMLP",
    "megablocks.layers.mlp:MemoryOptimizedGroupedMLP",
    "megablocks.layers.glu:MemoryOptimizedGroupedGLU",
)


def _apply_stk_autocast(p: Patch) -> None:
    from megablocks_ascend import autocast  # noqa: PLC0415
    # By module name, not attribute: after a failed `import megablocks` (no driver, say) the
    # package `stk` can lack its `backend` attribute although the submodule is importable.
    upstream = importlib.import_module("stk.backend.autocast")
    for cls_target in STK_AUTOCAST_FUNCTIONS:
        _redecorate(p, cls_target, (upstream.custom_fwd, upstream.custom_bwd),
                    (autocast.custom_fwd(cast_inputs=True), autocast.custom_bwd),
                    "stk.backend.autocast.custom_fwd/custom_bwd")


# stk.backend.sputnik's RowIndices is not decorated (it only handles index tensors).
STK_AUTOCAST_FUNCTIONS = (
    "stk.backend.sputnik:SDD",
    "stk.backend.sputnik:DSD",
    "stk.backend.sputnik:DDS",
)


def _dtensor_class() -> type | None:
    """``DTensor``, the class ``resolve_dtensor`` unwraps; ``None`` in a torch without
    ``torch.distributed``, where no DTensor can exist."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed._tensor import DTensor  # noqa: PLC0415  (upstream's import)
    return DTensor


def _apply_resolve_dtensor(p: Patch) -> None:
    import megablocks.layers.glu as glu  # noqa: PLC0415
    import megablocks.layers.mlp as mlp  # noqa: PLC0415
    upstream = mlp.resolve_dtensor
    _expect_params("megablocks.layers.mlp.resolve_dtensor", upstream, ("weight",))
    if getattr(glu, "resolve_dtensor", None) is not upstream:
        raise PatchError("megablocks.layers.glu.resolve_dtensor is no longer the function imported "
                         "from megablocks.layers.mlp")
    dtensor = _dtensor_class()  # upstream asks on every call whether torch >= 2.0; it is

    def resolve_dtensor(weight: torch.Tensor):
        if dtensor is not None and isinstance(weight, dtensor):
            return weight.to_local()
        return weight

    resolve_dtensor.__wrapped__ = upstream
    resolve_dtensor.__doc__ = "megablocks.layers.mlp.resolve_dtensor, its torch version check made once."
    for target in RESOLVE_DTENSOR:
        p.replace(target, resolve_dtensor)


RESOLVE_DTENSOR = ("megablocks.layers.mlp.resolve_dtensor", "megablocks.layers.glu.resolve_dtensor")


def _replace_dispatched(p: Patch, module, replacements: dict, specs: dict, upstream: dict) -> None:
    """Replace each ``module.<name>`` by ``replacements[name]`` after checking that upstream's
    function still takes ``specs[name][0]``, and record upstream's function in ``upstream`` (the
    ``cuda`` backend calls it). A function that is already ours (a second install) is not recorded."""
    for name, replacement in replacements.items():
        target = f"{module.__name__}.{name}"
        current = getattr(module, name, None)
        if current is None:
            raise PatchError(f"{target} is missing")
        if not getattr(current, "__megablocks_ascend__", False):
            _expect_params(target, current, specs[name][0])
            upstream[name] = current
        p.replace(target, replacement)


def _apply_kernels(p: Patch) -> None:
    from megablocks_ascend import backends  # noqa: PLC0415
    import megablocks.backend.kernels as upstream  # noqa: PLC0415
    _replace_dispatched(p, upstream, backends.KERNELS, backends.SPECS, backends.UPSTREAM)


def _apply_ops(p: Patch) -> None:
    from megablocks_ascend import ops  # noqa: PLC0415
    import megablocks.ops as upstream  # noqa: PLC0415
    for name, fn in ops.OPS.items():
        target = f"megablocks.ops.{name}"
        current = getattr(upstream, name, None)
        if current is None:
            raise PatchError(f"{target} is missing")
        expected = tuple(inspect.signature(fn).parameters)
        if hasattr(current, "__self__") and isinstance(current.__self__, type):  # Function.apply
            _expect_params(target, current.__self__.forward, ("ctx",) + expected)
        else:
            _expect_params(target, current, expected)
        p.replace(target, fn)


def _apply_stk_kernels(p: Patch) -> None:
    from megablocks_ascend import backends, library  # noqa: PLC0415
    import stk.backend.triton_kernels as upstream  # noqa: PLC0415
    _replace_dispatched(p, upstream, library.STK_ENTRY_POINTS, backends.STK_SPECS, backends.UPSTREAM_STK)


SPARSE_REFUSAL = "Sparse MLP is not supported with triton"
_SPARSE_LIFTED = "sparse (megablocks-ascend: refusal lifted)"  # what __post_init__ sees while it runs


def sparse_mlp_blocker(device: Any) -> str | None:
    """Why MegaBlocks' refusal of ``mlp_impl="sparse"`` must stay for a layer on ``device``, or
    None when stk's matmuls on that device are served by our kernels or the torch reference."""
    from megablocks_ascend import backends  # noqa: PLC0415
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        return f"the layer's device {device!r} cannot be read ({e})"
    try:
        backend = backends.resolve(dev)
    except backends.BackendUnavailable as e:
        return str(e)
    if backend == "cuda":
        return (f"MEGABLOCKS_BACKEND={backends.requested()} sends stk's block-sparse matmuls on {dev} to stk's own "
                "Triton kernels, which with Triton >= 3.2 compute wrong results once a sparse matrix has more than "
                "32768 rows or columns (megablocks-ascend refuses those calls; see patches/sparse-mlp-refusal.md). "
                "Set MEGABLOCKS_BACKEND=ascend to use megablocks-ascend's kernels (or torch for plain PyTorch), "
                "or use mlp_impl=\"grouped\"")
    return None


def _apply_sparse_mlp_refusal(p: Patch) -> None:
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    target = "megablocks.layers.arguments:Arguments.__post_init__"
    original = Arguments.__dict__.get("__post_init__")
    if original is None:
        raise PatchError(f"{target} is missing")
    _expect_params(target, original, ("self",))
    # Shape check by behaviour: the original refuses "sparse" with its message, and runs the rest of
    # its checks for a value it does not know (which the wrapper below relies on).
    try:
        original(types.SimpleNamespace(mlp_impl="sparse", shared_expert_hidden_size=None, ffn_hidden_size=8))
    except ValueError as e:
        if SPARSE_REFUSAL not in str(e):
            raise PatchError(f"{target} raises {e!r} for mlp_impl='sparse', not the refusal this patch lifts") from e
    else:
        return  # this MegaBlocks / Triton does not refuse the sparse MLP: nothing to lift
    probe = types.SimpleNamespace(mlp_impl=_SPARSE_LIFTED, shared_expert_hidden_size=None, ffn_hidden_size=8)
    try:
        original(probe)
    except Exception as e:  # noqa: BLE001
        raise PatchError(f"{target} no longer accepts an mlp_impl it does not check ({e!r})") from e
    if probe.shared_expert_hidden_size != 8:
        raise PatchError(f"{target} no longer defaults shared_expert_hidden_size to ffn_hidden_size")

    p.replace(target, lift_sparse_refusal(original))


def lift_sparse_refusal(original: Callable) -> Callable:
    """``Arguments.__post_init__`` without its refusal of ``mlp_impl="sparse"`` while stk's matmuls
    on the layer's device are ours, and with the reason added to the refusal otherwise."""

    def __post_init__(self):
        if self.mlp_impl != "sparse":
            return original(self)
        blocker = sparse_mlp_blocker(self.device)
        if blocker is not None:
            try:
                return original(self)
            except ValueError as e:
                if SPARSE_REFUSAL not in str(e):
                    raise
                raise ValueError(f"{e} (megablocks-ascend: the refusal stays: {blocker})") from e
        # stk's matmuls are ours: run every other check of the original, then restore the value.
        self.mlp_impl = _SPARSE_LIFTED
        try:
            return original(self)
        finally:
            self.mlp_impl = "sparse"

    __post_init__.__wrapped__ = original
    return __post_init__


def source_fingerprint(fn: Callable) -> str:
    """A digest of ``fn``'s code that ignores comments and layout (its tokens, joined): a patch
    that replaces a function's body checks it, so that a changed upstream body is refused rather
    than silently replaced by a copy of the old one."""
    return _fingerprint(inspect.getsource(fn))


def _fingerprint(source: str) -> str:
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    lines = io.StringIO(textwrap.dedent(source)).readline
    tokens = [t.string for t in tokenize.generate_tokens(lines) if t.type not in skip]
    return hashlib.sha256(" ".join(tokens).encode()).hexdigest()[:16]


def _expect_source(target: str, fn: Any, fingerprint: str) -> None:
    try:
        found = source_fingerprint(fn)
    except (OSError, TypeError, tokenize.TokenError) as e:
        raise PatchError(f"{target}: cannot read its source ({e})") from e
    if found != fingerprint:
        raise PatchError(
            f"{target} is not the code megablocks-ascend was written against (source fingerprint "
            f"{found}, expected {fingerprint}); this MegaBlocks version is not supported by this "
            "megablocks-ascend version")


def expert_batch_sizes(layer, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The group sizes a grouped expert MLP hands its grouped GEMMs: ``tokens_per_expert`` as it is
    (on the device) where every GEMM of the step takes device sizes
    (:func:`megablocks_ascend.native.grouped_gemm.takes_device_sizes`), else upstream's
    ``tokens_per_expert.cpu().to(torch.long)`` (a device-to-host copy)."""
    from megablocks.layers import mpu  # noqa: PLC0415
    from megablocks_ascend.native import grouped_gemm  # noqa: PLC0415
    experts = mpu.experts_per_rank(layer.args)
    if tokens_per_expert.device == x.device and _takes_device_sizes(
            grouped_gemm, x.device, x.dtype, (layer.args.hidden_size, layer.w1.shape[0] // experts), experts):
        return tokens_per_expert
    return tokens_per_expert.cpu().to(torch.long)


@torch.compiler.assume_constant_result
def _device_sizes_decision(device, dtype, dims, groups) -> bool:
    from megablocks_ascend.native import grouped_gemm  # noqa: PLC0415
    return grouped_gemm.takes_device_sizes(device, dtype, dims, groups)


def _takes_device_sizes(grouped_gemm, device, dtype, dims, groups) -> bool:
    # Under torch.compile the decision is a constant of the trace (it depends on the device, the
    # dtype and static sizes only), evaluated once when the graph is traced.
    if torch.compiler.is_compiling():
        return _device_sizes_decision(device, dtype, dims, groups)
    return grouped_gemm.takes_device_sizes(device, dtype, dims, groups)


def _grouped_mlp_forward(self, x, tokens_per_expert):
    """``megablocks.layers.mlp.GroupedMLP.forward`` with the group sizes from
    :func:`expert_batch_sizes`; the rest as upstream's."""
    from megablocks import grouped_gemm_util as gg  # noqa: PLC0415
    from megablocks.layers import mlp, mpu  # noqa: PLC0415
    batch_sizes = expert_batch_sizes(self, x, tokens_per_expert)
    w1, w2 = (self.scale_grad(self.w1), self.scale_grad(self.w2))

    # Re-shape the weights for the grouped GEMMs.
    ne = mpu.experts_per_rank(self.args)
    w1 = mlp.resolve_dtensor(w1).view(ne, -1, self.args.hidden_size)
    w2 = mlp.resolve_dtensor(w2).view(ne, -1, self.args.hidden_size)

    if self.args.memory_optimized_mlp:
        return mlp.memory_optimized_grouped_mlp(x, w1, w2, batch_sizes, self.args.activation_fn)

    # Compute the MLP.
    assert gg.ops is not None
    x = gg.ops.gmm(x, w1, batch_sizes, trans_b=True)
    x = self.args.activation_fn(x)
    return gg.ops.gmm(x, w2, batch_sizes)


def _grouped_glu_forward(self, x, tokens_per_expert):
    """``megablocks.layers.glu.GroupedGLU.forward`` with the group sizes from
    :func:`expert_batch_sizes`; the rest as upstream's."""
    from megablocks import grouped_gemm_util as gg  # noqa: PLC0415
    from megablocks.layers import glu, mpu  # noqa: PLC0415
    batch_sizes = expert_batch_sizes(self, x, tokens_per_expert)
    w1, v1, w2 = (self.scale_grad(self.w1), self.scale_grad(self.v1), self.scale_grad(self.w2))
    w1, v1, w2 = glu.resolve_dtensor(w1), glu.resolve_dtensor(v1), glu.resolve_dtensor(w2)

    # Re-shape the weights for the grouped GEMMs.
    ne = mpu.experts_per_rank(self.args)
    w1 = w1.view(ne, -1, self.args.hidden_size)
    v1 = v1.view(ne, -1, self.args.hidden_size)
    w2 = w2.view(ne, -1, self.args.hidden_size)

    if self.args.memory_optimized_mlp:
        return glu.memory_optimized_grouped_glu(x, w1, v1, w2, batch_sizes, self.args.activation_fn)

    # Compute the MLP.
    assert gg.ops is not None
    x1 = gg.ops.gmm(x, w1, batch_sizes, trans_b=True)
    x2 = gg.ops.gmm(x, v1, batch_sizes, trans_b=True)
    x1 = self.args.activation_fn(x1) * x2
    return gg.ops.gmm(x1, w2, batch_sizes)


# The forwards replaced, with the fingerprint (source_fingerprint) of MegaBlocks 0.10.0's code.
GROUPED_FORWARDS = {
    "megablocks.layers.mlp:GroupedMLP.forward": (_grouped_mlp_forward, "5cf27d163b10e7dc"),
    "megablocks.layers.glu:GroupedGLU.forward": (_grouped_glu_forward, "a9e48f69fbbb9b6d"),
}


def _apply_grouped_mlp_device_sizes(p: Patch) -> None:
    import megablocks.grouped_gemm_util as gg  # noqa: PLC0415
    if not getattr(gg.backend, "__megablocks_ascend_standin__", False):
        return  # the real grouped_gemm package takes CPU sizes only: leave upstream's forwards alone
    for target, (replacement, fingerprint) in GROUPED_FORWARDS.items():
        owner, attr = _owner(target)
        original = owner.__dict__.get(attr)
        if original is None:
            raise PatchError(f"{target} is missing")
        _expect_params(target, original, ("self", "x", "tokens_per_expert"))
        _expect_source(target, original, fingerprint)
        replacement.__wrapped__ = original
        p.replace(target, replacement)


PATCHES: tuple[Patch, ...] = (
    # First: every later patch imports MegaBlocks, which imports stk, whose kernels are autotuned.
    Patch(
        name="triton-driverless",
        targets=("triton.runtime.autotuner:Autotuner.__init__",),
        why="Triton 3.3.1 and triton-ascend 3.2.0 ask the driver for a benchmarker when "
            "triton.autotune decorates a kernel, so on a machine where Triton has no driver (CPU "
            "only; triton-ascend without an NPU) importing stk, hence MegaBlocks, raises "
            "'0 active drivers'.",
        how="Only where Triton has no active driver and its Autotuner asks for the benchmarker at "
            "construction: Autotuner.__init__ is wrapped to pass a RefusingBenchmarker as do_bench. "
            "An autotuner with one config never calls it and runs; one asked to time several "
            "configs raises NoTritonDriver before any of them runs. Nothing pretends a device exists.",
        upstream_fix="Ask the driver for the benchmarker when benchmarking, as Triton 3.9 does "
                     "(triton-ascend: rebase on such a Triton).",
        apply=_apply_triton_driverless,
    ),
    Patch(
        name="megablocks-ops-extension",
        targets=("sys.modules['megablocks_ops']",),
        why="megablocks/ops/{sort,histogram,cumsum,replicate,topology}.py import the CUDA extension "
            "megablocks_ops at import time, so `import megablocks` fails wherever it was not built.",
        how="When megablocks_ops cannot be found, a device-agnostic PyTorch module with the same "
            "functions (megablocks_ascend.native.megablocks_ops) is registered under that name.",
        upstream_fix="Import megablocks_ops lazily and fall back to PyTorch implementations off CUDA.",
        apply=_apply_megablocks_ops,
    ),
    Patch(
        name="grouped-gemm",
        targets=("sys.modules['grouped_gemm']", "megablocks.grouped_gemm_util._grouped_gemm_is_available",
                 "megablocks.grouped_gemm_util.backend", "megablocks.grouped_gemm_util.ops"),
        why="dMoE with mlp_impl='grouped' asserts that grouped_gemm (a CUDA-only package) is installed.",
        how="When grouped_gemm is not installed, megablocks_ascend.native.grouped_gemm is registered "
            "as grouped_gemm (npu_grouped_matmul on NPU, torch._grouped_mm on CUDA and CPU where "
            "torch supports the call, a loop elsewhere; group sizes on the host or on the device); "
            "if MegaBlocks was imported first, grouped_gemm_util's availability flag and modules are "
            "corrected too. An installed grouped_gemm is left alone.",
        upstream_fix="Let grouped_gemm_util choose a grouped GEMM per device (e.g. torch._grouped_mm).",
        apply=_apply_grouped_gemm,
    ),
    Patch(
        name="arguments-device",
        targets=("megablocks.layers.arguments:Arguments.__init__",),
        why="Arguments.device defaults to torch.cuda.current_device(), which raises without CUDA.",
        how="Arguments.__init__ is wrapped: when no device is given it passes default_device() "
            "(the current NPU, else CUDA's current device as upstream, else the CPU).",
        upstream_fix="A device-neutral default for Arguments.device (e.g. torch.get_default_device()).",
        apply=_apply_arguments_device,
    ),
    Patch(
        name="autocast-device",
        targets=("megablocks.layers.common.cast_if_autocast_enabled",)
        + tuple(f"{c}.{m}" for c in AUTOCAST_FUNCTIONS for m in ("forward", "backward")),
        why="common.cast_if_autocast_enabled raises NotImplementedError for NPU tensors under "
            "autocast, and the memory-optimized MLPs use torch.amp.custom_fwd(device_type='cuda'), "
            "so on other devices they ignore the caller's autocast state.",
        how="cast_if_autocast_enabled is replaced by a version that asks autocast about the "
            "tensor's own device type; the four custom autograd functions are re-wrapped with "
            "decorators that keep torch.amp.custom_fwd/custom_bwd's contract (ctx._dtype, "
            "ctx._fwd_used_autocast, the backward under the forward's autocast state) but take the "
            "device type from their inputs.",
        upstream_fix="Use torch.is_autocast_enabled(x.device.type) and pass the device type through.",
        apply=_apply_autocast,
    ),
    Patch(
        name="stk-autocast-device",
        targets=tuple(f"{c}.{m}" for c in STK_AUTOCAST_FUNCTIONS for m in ("forward", "backward")),
        why="stk's autocast decorators (stk.backend.autocast) ask only CUDA's autocast and cast only "
            "CUDA tensors, so under autocast on an NPU or the CPU its block-sparse matmuls get "
            "operands of mixed dtypes.",
        how="SDD, DSD and DDS's undecorated forward/backward are re-wrapped with "
            "megablocks_ascend.autocast.custom_fwd(cast_inputs=True)/custom_bwd: the same rule "
            "(floating inputs cast to the autocast dtype, forward and backward with autocast off) "
            "for the device type of the inputs.",
        upstream_fix="Use torch.amp.custom_fwd(device_type=x.device.type, cast_inputs=...) in stk.",
        apply=_apply_stk_autocast,
    ),
    Patch(
        name="routing-kernels",
        targets=tuple(f"megablocks.backend.kernels.{n}" for n in (
            "binned_gather", "binned_scatter", "binned_scatter_wgrad", "gather", "scatter",
            "scatter_wgrad", "padded_gather", "padded_scatter", "padded_scatter_wgrad")),
        why="MegaBlocks' routing kernels are written for CUDA GPUs: one program per row, and "
            "scatters that go through a [tokens, top_k, hidden] temporary.",
        how="Each function is replaced by a dispatcher that validates its inputs and hands them to "
            "the backend MEGABLOCKS_BACKEND selects: our Triton kernels (ascend), upstream's own "
            "function (cuda), or plain PyTorch (torch).",
        upstream_fix="A backend registry in megablocks.backend that plugins can register kernels with.",
        apply=_apply_kernels,
    ),
    Patch(
        name="routing-ops",
        targets=tuple(f"megablocks.ops.{n}" for n in (
            "binned_gather", "binned_scatter", "gather", "scatter", "padded_gather", "padded_scatter")),
        why="Upstream's autograd wrappers use stk's autocast decorators, which assume CUDA.",
        how="Each op is replaced by an autograd Function with upstream's forward and backward that "
            "calls the dispatched kernels and handles autocast for the tensors' own device.",
        upstream_fix="Device-aware autocast decorators in megablocks.ops.",
        apply=_apply_ops,
    ),
    Patch(
        name="stk-kernels",
        targets=tuple(f"stk.backend.triton_kernels.{n}" for n in ("sdd", "dsd", "dds", "row_indices")),
        why="stk's block-sparse matmuls, which the sparse dMoE runs, are written for NVIDIA GPUs, and with "
            "Triton >= 3.2 its sdd computes wrong results (or reads out of bounds) once the sparse matrix has "
            "more than 32768 rows or columns: arithmetic on its int16 block indices stays int16.",
        how="Each function is replaced by an entry point that validates its inputs and hands them to the "
            "backend MEGABLOCKS_BACKEND selects: our Triton kernels (ascend), stk's own function (cuda, "
            "refused with BackendUnavailable where it overflows), or plain PyTorch (torch); a "
            "torch.library custom op while torch.compile traces.",
        upstream_fix="stk PR #17 (int32/int64 block offsets) released, and a kernel registry in "
                     "stk.backend that plugins can register with.",
        apply=_apply_stk_kernels,
    ),
    Patch(
        name="sparse-mlp-refusal",
        targets=("megablocks.layers.arguments:Arguments.__post_init__",),
        why="Arguments refuses mlp_impl='sparse' (the default) with triton >= 3.2, because stk's kernels "
            "overflow there; with the stk-kernels patch the sparse path no longer runs them.",
        how="__post_init__ is wrapped: for mlp_impl='sparse' it runs the original's other checks without the "
            "refusal when stk's matmuls on the layer's device are served by our kernels or the torch "
            "reference, and keeps the refusal (saying why and what to set) when they would go to stk's own.",
        upstream_fix="Release stk's overflow fix (stk PR #17) and drop the Triton version check.",
        apply=_apply_sparse_mlp_refusal,
    ),
    Patch(
        name="triton-interpreter-index",
        targets=("triton.runtime.interpreter._patch_lang_tensor",),
        why="The interpreters of Triton 3.3.1 and 3.6.0 convert a scalar (a NumPy array of shape "
            "(1,)) to an int with int(array), which NumPy 2.4 refuses, so every kernel with a loop such as "
            "range(pid, n, num_programs) fails on CPU tensors: 'only 0-dimensional arrays can be "
            "converted to Python scalars'.",
        how="Only with the interpreter on, and only when its own definition fails that conversion: "
            "the function that sets the interpreter's tl.tensor methods before each launch is "
            "wrapped to set __index__ to int(data.squeeze()), Triton 3.9's definition. Compiled "
            "kernels (CUDA, NPU) are not involved.",
        upstream_fix="None needed in Triton 3.9 (it squeezes); 3.3.x and 3.6.x releases would need the "
                     "same one-line fix.",
        apply=_apply_triton_interpreter_index,
    ),
    Patch(
        name="resolve-dtensor",
        targets=RESOLVE_DTENSOR,
        why="resolve_dtensor parses torch.__version__ with packaging on every expert-MLP forward; "
            "dynamo cannot trace packaging's Version on torch 2.7 or 2.11, so torch.compile of an "
            "unchanged MoE or dMoE fails there, whatever backend serves the routing.",
        how="Both names (glu imports it from mlp) are replaced by one function that does what "
            "upstream does on every torch >= 2.0 (the only ones MegaBlocks 0.10.0 runs on): unwrap a "
            "DTensor to its local tensor, return anything else unchanged. DTensor is looked up once, "
            "at install.",
        upstream_fix="Decide the version check once at import (or drop it: MegaBlocks needs "
                     "torch >= 2.0 anyway).",
        apply=_apply_resolve_dtensor,
    ),
    Patch(
        name="grouped-mlp-device-sizes",
        targets=tuple(GROUPED_FORWARDS),
        why="GroupedMLP.forward and GroupedGLU.forward copy tokens_per_expert to the host on every "
            "step (tokens_per_expert.cpu()), as the grouped_gemm package wants CPU group sizes: a "
            "device-to-host sync per layer and step, which drains the device's queue and makes the "
            "step impossible to capture in a CUDA or NPU graph.",
        how="Where MegaBlocks uses the grouped_gemm stand-in and every grouped GEMM of the step "
            "takes the sizes on the device (grouped_gemm.takes_device_sizes: torch._grouped_mm's "
            "fused CUDA kernel or its CPU kernel, npu_grouped_matmul), both forwards pass "
            "tokens_per_expert on as it is; everywhere else they copy it to the host exactly as "
            "upstream does. The rest of each forward, the memory-optimized variants included, is "
            "upstream's code; the patch refuses to install over a changed upstream body.",
        upstream_fix="Pass tokens_per_expert to a grouped GEMM that takes device sizes "
                     "(torch._grouped_mm) instead of copying it to the host.",
        apply=_apply_grouped_mlp_device_sizes,
    ),
)

# patches that need no MegaBlocks
_STANDINS = ("triton-driverless", "triton-interpreter-index", "megablocks-ops-extension", "grouped-gemm")
_installed = False


def install() -> None:
    """Apply every patch. Idempotent: a second call changes nothing. Patches applied before
    (:func:`install_before_import`) are kept; if one fails, half-way or not, every patch is taken back."""
    global _installed
    if _installed:
        return
    _apply(PATCHES)
    _installed = True


def install_before_import() -> None:
    """Apply only the patches that MegaBlocks and stk need while they import (stand-ins for their
    native dependencies, Triton fixes: they need no MegaBlocks); :func:`install` applies the rest.
    The autoload calls this when it finds MegaBlocks part-way through its import."""
    _apply(tuple(p for p in PATCHES if p.name in _STANDINS))


def _apply(patches) -> None:
    try:
        for patch in patches:
            if patch.applied:
                continue
            if patch.name not in _STANDINS and importlib.util.find_spec("megablocks") is None:
                raise PatchError("MegaBlocks is not installed (pip install --no-deps megablocks==0.10.0; "
                                 "see the README)")
            patch.apply(patch)
            patch.applied = True
    except BaseException:
        uninstall()  # every patch, including one that failed half-way
        raise


def uninstall() -> None:
    """Undo every patch, restoring each original object exactly."""
    global _installed
    for patch in reversed(PATCHES):
        patch.revert()
    _installed = False


def installed() -> bool:
    return _installed
