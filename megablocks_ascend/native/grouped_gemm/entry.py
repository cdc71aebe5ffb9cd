"""The entry points MegaBlocks calls: ``grouped_gemm.backend.gmm`` (:func:`gmm`: autocast casts,
then the checks, the implementation's choice and the call; one custom op under torch.compile) and
``grouped_gemm.ops.gmm`` (:class:`GroupedGemm`, with the real package's backward), and the module
objects that present them as the ``grouped_gemm`` package (:func:`make_modules`).
"""

from __future__ import annotations

import types

import torch

from megablocks_ascend import keeping
from megablocks_ascend.native.grouped_gemm import checks, choice, impls


# --------------------------------------------------------------------------
# Autocast, and grouped_gemm.backend.gmm
# --------------------------------------------------------------------------

def _autocast_operands(a, b):
    """``(a, b)`` as ``torch.matmul`` would see them under autocast.

    When autocast is on for ``a``'s device type, each floating-point operand on that device type
    other than float64 is cast to the autocast dtype (autocast's rule for matmuls); anything else,
    including arguments that are not tensors, is returned as is and left to ``checks._validate``.
    """
    if not isinstance(a, torch.Tensor):
        return a, b
    device_type = a.device.type
    if not torch.is_autocast_enabled(device_type):
        return a, b
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64 \
                and t.device.type == device_type:
            return t.to(dtype)
        return t

    return cast(a), cast(b)


def gmm(a, b, batch_sizes, trans_a=False, trans_b=False, c=None):
    """Grouped GEMM with the semantics of ``grouped_gemm.backend.gmm``.

    Args:
        a: [T, K] (or [T, M] with ``trans_a``).
        b: [E, K, N], [E, N, K] with ``trans_b``, or [T, N] with ``trans_a``.
        batch_sizes: 1-D int64/int32 tensor of per-group row counts, summing
            to ``T``: on the CPU (the real package's contract), or on the
            operands' device, where ``torch._grouped_mm`` and
            ``npu_grouped_matmul`` use it without a host read (module doc).
        trans_a: compute ``a_g.T @ b_g`` per group -> [E, M, N].
        trans_b: use ``b[g].T``.
        c: optional output buffer of the result's shape/dtype/device; it is
            overwritten and returned.

    Not differentiable (like the real backend); use ``ops.gmm`` for autograd.
    Under autocast, ``a`` and ``b`` are cast to the autocast dtype first, and ``c`` must have it.
    Raises ``ValueError`` naming the offending argument before doing any work.
    """
    a, b = _autocast_operands(a, b)
    if c is None and torch.compiler.is_compiling():
        # One opaque node for torch.compile (the loop reads the group sizes on the host inside it);
        # like the real backend, the result does not carry autograd history.
        with torch.no_grad():
            return _gmm_op(a, b, batch_sizes, bool(trans_a), bool(trans_b))
    # Eager: straight to the implementation. Going through the custom op here too cost ~50 us of
    # host time per call on a CPU (its Python dispatch, and the arguments checked twice), six
    # times per expert-MLP step.
    return _gmm_eager(a, b, batch_sizes, trans_a, trans_b, c)


def _gmm_eager(a, b, batch_sizes, trans_a, trans_b, c):
    checks._validate(a, b, batch_sizes, trans_a, trans_b, c)
    impl = choice._select_impl(a, b, batch_sizes, trans_a, trans_b)
    rows = a.shape[0]
    if checks._device_sizes(batch_sizes, a) and (a.numel() == 0 or b.numel() == 0
                                                 or choice._reads_device_sizes(impl, a, trans_a)):
        # Device sizes, and an implementation (or an empty problem) that needs no host read.
        if checks._value_checks_enabled():
            checks._host_sizes(batch_sizes, rows)  # the checks only; the kernels keep the device sizes
        sizes = None
    else:
        sizes = checks._host_sizes(batch_sizes, rows)
    with torch.no_grad():
        if sizes is None and (a.numel() == 0 or b.numel() == 0):
            # An empty operand: every block is an empty sum (or the result is empty), whatever
            # the group sizes are, so they need not be read.
            if c is not None:
                return c.zero_()
            return torch.zeros(checks._output_shape(a, b, batch_sizes.shape[0], trans_a, trans_b),
                               dtype=a.dtype, device=a.device)
        if impl == choice.IMPL_NPU:
            return impls._gmm_npu(a, b, batch_sizes, sizes, trans_a, trans_b, c)
        if impl == choice.IMPL_GROUPED_MM:
            return impls._gmm_grouped_mm(a, b, batch_sizes, sizes, trans_a, trans_b, c)
        if c is None:
            c = torch.empty(checks._output_shape(a, b, len(sizes), trans_a, trans_b),
                            dtype=a.dtype, device=a.device)
        return impls._gmm_loop(a, b, sizes, trans_a, trans_b, c)


@torch.library.custom_op("megablocks_ascend::gmm", mutates_args=())
def _gmm_op(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_a: bool,
            trans_b: bool) -> torch.Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return _gmm_eager(a, b, batch_sizes, trans_a, trans_b, None)


@_gmm_op.register_fake
def _(a, b, batch_sizes, trans_a, trans_b):
    return a.new_empty(checks._output_shape(a, b, batch_sizes.shape[0], trans_a, trans_b))


# --------------------------------------------------------------------------
# Autograd wrapper (grouped_gemm.ops)
# --------------------------------------------------------------------------

class GroupedGemm(torch.autograd.Function):
    """``out = gmm(a, b, batch_sizes, trans_b=trans_b)`` with the real package's backward.

    grad_a = gmm(grad, b, batch_sizes, trans_b=not trans_b)
    grad_b = gmm(grad, a, batch_sizes, trans_a=True)   if trans_b  ([E, N, K])
             gmm(a, grad, batch_sizes, trans_a=True)   otherwise  ([E, K, N])

    The backward runs under the autocast state of the forward, as ``torch.amp.custom_bwd`` does.
    """

    @staticmethod
    def forward(ctx, a, b, batch_sizes, trans_b):
        ctx.autocast_state = (a.device.type, torch.is_autocast_enabled(a.device.type),
                              torch.get_autocast_dtype(a.device.type))
        ctx.save_for_backward(a, b, batch_sizes)
        ctx.trans_b = trans_b
        return gmm(a, b, batch_sizes, trans_a=False, trans_b=trans_b)

    @staticmethod
    def backward(ctx, grad):
        device_type, enabled, dtype = ctx.autocast_state
        with torch.autocast(device_type=device_type, enabled=enabled, dtype=dtype):
            return GroupedGemm._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        grad = grad.contiguous()
        a, b, batch_sizes = ctx.saved_tensors
        trans_b = ctx.trans_b
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = gmm(grad, b, batch_sizes, trans_a=False, trans_b=not trans_b)
        if ctx.needs_input_grad[1]:
            lhs, rhs = (grad, a) if trans_b else (a, grad)
            grad_b = gmm(lhs, rhs, batch_sizes, trans_a=True, trans_b=False)
        return grad_a, grad_b, None, None


def _ops_gmm(a, b, batch_sizes, trans_b=False):
    """Differentiable grouped GEMM, same contract as ``grouped_gemm.ops.gmm``.

    Under autocast the operands are cast here, outside the Function, so that autograd records the
    casts (and hands float32 inputs float32 gradients), as it does for ``torch.matmul``.
    """
    a, b = _autocast_operands(a, b)
    return GroupedGemm.apply(a, b, batch_sizes, trans_b)


_ops_gmm.__name__ = 'gmm'
_ops_gmm.__qualname__ = 'gmm'

backend = types.SimpleNamespace(gmm=gmm)
ops = types.SimpleNamespace(gmm=_ops_gmm, GroupedGemm=GroupedGemm)


# --------------------------------------------------------------------------
# Module objects for sys.modules injection
# --------------------------------------------------------------------------

_STANDIN_DOC = ('megablocks-ascend stand-in for the CUDA-only `grouped_gemm` package '
                '(tgale96/grouped_gemm); implemented in '
                'megablocks_ascend.native.grouped_gemm.')


def make_modules() -> dict:
    """Build fresh module objects that look like the real ``grouped_gemm``.

    Returns ``{'grouped_gemm': pkg, 'grouped_gemm.backend': backend_mod,
    'grouped_gemm.ops': ops_mod}``.  Put all three into ``sys.modules`` and
    ``import grouped_gemm`` / ``grouped_gemm.backend.gmm`` /
    ``grouped_gemm.ops.gmm`` resolve to this implementation.  The modules have
    no ``__file__``; each carries ``__megablocks_ascend_standin__ = True`` and
    a ``__doc__`` saying what it is.  Nothing is registered by this function.
    """
    import importlib.machinery

    def new(name, doc, is_package=False):
        mod = types.ModuleType(name, doc)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
        if is_package:
            mod.__path__ = []
        mod.__package__ = name if is_package else name.rpartition('.')[0]
        mod.__megablocks_ascend_standin__ = True
        return mod

    backend_mod = new('grouped_gemm.backend',
                      _STANDIN_DOC + ' Submodule `backend`: gmm(a, b, batch_sizes, '
                      'trans_a=False, trans_b=False, c=None), not differentiable.')
    backend_mod.gmm = gmm
    backend_mod.gmm_impl_name = choice.gmm_impl_name

    ops_mod = new('grouped_gemm.ops',
                  _STANDIN_DOC + ' Submodule `ops`: gmm(a, b, batch_sizes, '
                  'trans_b=False) as a torch.autograd.Function.')
    ops_mod.gmm = _ops_gmm
    ops_mod.GroupedGemm = GroupedGemm
    ops_mod.backend = backend_mod

    pkg = new('grouped_gemm', _STANDIN_DOC, is_package=True)
    pkg.backend = backend_mod
    pkg.ops = ops_mod
    pkg.gmm_impl_name = choice.gmm_impl_name

    return {
        'grouped_gemm': pkg,
        'grouped_gemm.backend': backend_mod,
        'grouped_gemm.ops': ops_mod,
    }
