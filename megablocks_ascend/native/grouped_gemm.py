"""Stand-in for the CUDA-only ``grouped_gemm`` package (tgale96/grouped_gemm).

MegaBlocks imports ``grouped_gemm`` and calls two entry points:

* ``grouped_gemm.backend.gmm(a, b, batch_sizes, trans_a=False, trans_b=False, c=None)``
  -- a raw, non-differentiable grouped GEMM that writes into ``c`` (allocated
  when ``None``) and returns it;
* ``grouped_gemm.ops.gmm(a, b, batch_sizes, trans_b=False)`` -- the same op
  wrapped in a ``torch.autograd.Function``.

Semantics (matching the real package; ``batch_sizes`` is a tensor of per-group
row counts, ``E = len(batch_sizes)``, ``T = a.shape[0]``):

==============  =================  =================  =======================================
trans_a/trans_b a                  b                  result
==============  =================  =================  =======================================
False/False     [T, K]             [E, K, N]          [T, N], rows of group g = a_g @ b[g]
False/True      [T, K]             [E, N, K]          [T, N], rows of group g = a_g @ b[g].T
True/False      [T, M]             [T, N]             [E, M, N], out[g] = a_g.T @ b_g
True/True       rejected (the real package rejects it too)
==============  =================  =================  =======================================

``a_g``/``b_g`` are the row slices ``[start_g, start_g + batch_sizes[g])``.
With ``trans_a`` a group of size zero yields an all-zero ``[M, N]`` block.

Three implementations, chosen per call (``gmm_impl_name`` reports which):

* ``'npu_grouped_matmul'`` -- Ascend NPU tensors, fp16/bf16:
  ``torch_npu.npu_grouped_matmul``.  NOT YET RUN ON AN NPU; see ``_gmm_npu``.
* ``'torch._grouped_mm'`` -- CUDA tensors, bf16, with a torch that has
  ``torch._grouped_mm`` and operands that meet its alignment rules; CPU
  tensors (bf16/fp16/fp32, torch >= 2.9) likewise.  See ``_gmm_grouped_mm``.
* ``'loop'`` -- everything else: one ``torch.mm`` per group, in the input
  dtype (fp64, misaligned shapes, fp16/fp32 on CUDA, torch without
  ``torch._grouped_mm``).

Where the group sizes live (``batch_sizes``)
--------------------------------------------
The real package takes ``batch_sizes`` on the CPU, so MegaBlocks copies its
per-expert token counts to the host every step (``tokens_per_expert.cpu()``):
a device-to-host sync that drains the device queue and rules out graph
capture.  The stand-in also accepts ``batch_sizes`` on the operands' own
device ("device sizes"):

* ``torch._grouped_mm`` and ``npu_grouped_matmul`` take their offsets /
  ``group_list`` as device tensors, so with device sizes nothing is read on
  the host: the offsets are computed on the device (sizes clamped at 0, ends
  clamped at the row count, so a malformed ``batch_sizes`` can give a wrong
  result but never an access outside the operands), once per ``batch_sizes``
  tensor and reused by the later calls of the step (not while a graph is
  being captured, where every call records its own);
* the loop needs the sizes as Python ints and reads them (on an accelerator
  that is a sync);
* the checks that read values (no negative size, sizes summing to the rows
  of ``a``) run whenever the values are on the host anyway (CPU sizes for
  accelerator operands, the loop) and otherwise only with
  ``MEGABLOCKS_ASCEND_CHECKS=1``, like the routing ops' value checks.

:func:`takes_device_sizes` says, for a device, dtype and the operands'
dimensions, whether every GEMM of an expert MLP would run without a host
read; the ``grouped-mlp-device-sizes`` patch
(``megablocks_ascend.patching.grouped_mlp_device_sizes``) asks it before it keeps MegaBlocks'
token counts on the device.

Under ``torch.autocast`` (for the device type of ``a``) both entry points behave like
``torch.matmul`` does: floating-point ``a`` and ``b`` (float64 excepted) are cast to the autocast
dtype first, so float32 weights meet bf16/fp16 activations (see ``_autocast_operands``).  In
``ops.gmm`` the casts are recorded by autograd, so float32 inputs get float32 gradients, and the
backward runs under the forward's autocast state.  ``torch._grouped_mm`` and
``npu_grouped_matmul`` are not registered with autocast (pytorch/pytorch#174763), so this is done
here, before any implementation is chosen.

Differences from the real package, on purpose: fp16/fp32/fp64 are accepted
(the real one is bf16 only); bad inputs raise ``ValueError`` naming the
argument (the real one fails a ``TORCH_CHECK``); the kernel paths compute into
a fresh tensor and copy into a caller-supplied ``c`` rather than writing it in
place.

This module imports only ``torch`` and :mod:`megablocks_ascend.keeping` (which imports
only ``torch``; ``torch_npu`` lazily, in the NPU branch; the package's ``envs`` and
``devices`` at their first use) so that it can be loaded on its own, before the rest
of megablocks_ascend.
"""

from __future__ import annotations

import functools
import re
import types
import weakref

import torch

from megablocks_ascend import keeping

__all__ = [
    'gmm',
    'gmm_impl_name',
    'takes_device_sizes',
    'GroupedGemm',
    'backend',
    'ops',
    'make_modules',
    'IMPL_NPU',
    'IMPL_GROUPED_MM',
    'IMPL_LOOP',
]

IMPL_NPU = 'npu_grouped_matmul'
IMPL_GROUPED_MM = 'torch._grouped_mm'
IMPL_LOOP = 'loop'

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32)

# Documented limits of npu_grouped_matmul (op-plugin docs, aclnnGroupedMatmulV4):
# at most 1024 groups when x/weight/y are single tensors, and the inner
# ("last") dimension of each operand must be below 65536.
_NPU_MAX_GROUPS = 1024
_NPU_INNER_LIMIT = 65536
_NPU_DTYPES = (torch.float16, torch.bfloat16)
# torch_npu 2.7.1's docs of npu_grouped_matmul list float32 x/weight/y too, on Atlas A2 training
# products (Ascend 910B), for the non-quantized single-tensor forms with a tensor group_list.
_NPU_A2_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# torch._grouped_mm's CUTLASS kernel (CUDA SM90/SM100) refuses 1024 groups or more
# (TORCH_CHECK(group_count < 1024) in aten/src/ATen/native/cuda/GroupMM.cu).
_CUDA_FAST_MAX_GROUPS = 1023

_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

def _fail(msg: str):
    raise ValueError(f'grouped_gemm.gmm: {msg}')


def _validate(a, b, batch_sizes, trans_a, trans_b, c) -> None:
    """Check every argument's type, shape, dtype and device (nothing here reads
    the values of ``batch_sizes``: see :func:`_host_sizes`).

    Nothing is computed or written before this returns.
    """
    if not isinstance(a, torch.Tensor):
        _fail(f"'a' must be a torch.Tensor, got {type(a).__name__}")
    if not isinstance(b, torch.Tensor):
        _fail(f"'b' must be a torch.Tensor, got {type(b).__name__}")
    if not isinstance(batch_sizes, torch.Tensor):
        _fail(f"'batch_sizes' must be a torch.Tensor, got {type(batch_sizes).__name__}")
    if trans_a and trans_b:
        _fail("'trans_a' and 'trans_b' cannot both be True "
              '(the real grouped_gemm does not support it either)')

    if a.ndim != 2:
        _fail(f"'a' must be 2-D, got {a.ndim}-D with shape {tuple(a.shape)}")
    want_b_ndim = 2 if trans_a else 3
    if b.ndim != want_b_ndim:
        _fail(f"'b' must be {want_b_ndim}-D when trans_a={bool(trans_a)}, "
              f'got {b.ndim}-D with shape {tuple(b.shape)}')

    if a.dtype not in _FLOAT_DTYPES:
        _fail(f"'a' dtype must be one of float16/bfloat16/float32/float64, got {a.dtype}")
    if b.dtype != a.dtype:
        _fail(f"'b' dtype {b.dtype} does not match 'a' dtype {a.dtype}")
    if b.device != a.device:
        _fail(f"'b' is on {b.device} but 'a' is on {a.device}")

    if batch_sizes.device.type != 'cpu' and batch_sizes.device != a.device:
        _fail(f"'batch_sizes' is on {batch_sizes.device}; it must be a CPU tensor or on "
              f"'a''s device ({a.device})")
    if batch_sizes.dtype not in _INDEX_DTYPES:
        _fail(f"'batch_sizes' dtype must be int64 or int32, got {batch_sizes.dtype}")
    if batch_sizes.ndim != 1:
        _fail(f"'batch_sizes' must be 1-D, got shape {tuple(batch_sizes.shape)}")
    n_groups = batch_sizes.shape[0]

    if trans_a:
        if b.shape[0] != a.shape[0]:
            _fail(f"'b' has {b.shape[0]} rows but 'a' has {a.shape[0]} "
                  '(with trans_a both are sliced by batch_sizes)')
        out_shape = (n_groups, a.shape[1], b.shape[1])
    else:
        if n_groups != b.shape[0]:
            _fail(f"'batch_sizes' has {n_groups} groups but 'b' has "
                  f'{b.shape[0]} (b.shape[0])')
        k_b = b.shape[2] if trans_b else b.shape[1]
        if k_b != a.shape[1]:
            _fail(f"contraction mismatch: 'a' has {a.shape[1]} columns but 'b' "
                  f'(shape {tuple(b.shape)}, trans_b={bool(trans_b)}) expects {k_b}')
        out_shape = (a.shape[0], b.shape[1] if trans_b else b.shape[2])

    if c is not None:
        if not isinstance(c, torch.Tensor):
            _fail(f"'c' must be a torch.Tensor or None, got {type(c).__name__}")
        if tuple(c.shape) != out_shape:
            _fail(f"'c' has shape {tuple(c.shape)}, expected {out_shape}")
        if c.dtype != a.dtype:
            _fail(f"'c' dtype {c.dtype} does not match 'a' dtype {a.dtype}")
        if c.device != a.device:
            _fail(f"'c' is on {c.device} but 'a' is on {a.device}")


def _host_sizes(batch_sizes, rows: int) -> list:
    """``batch_sizes`` as Python ints, after the checks that need their values.

    Reads the values: a device-to-host copy (and sync) when ``batch_sizes`` is on an
    accelerator.
    """
    sizes = [int(s) for s in batch_sizes.tolist()]
    negative = [i for i, s in enumerate(sizes) if s < 0]
    if negative:
        _fail(f"'batch_sizes' has negative entries at groups {negative}: {sizes}")
    total = sum(sizes)
    if total != rows:
        _fail(f"'batch_sizes' sums to {total} but 'a' has {rows} rows")
    return sizes


def _device_sizes(batch_sizes, a) -> bool:
    """Whether ``batch_sizes`` lives on the operands' device (CPU operands included):
    then the kernels that take device offsets need no host read."""
    return batch_sizes.device == a.device


_envs = None


def _value_checks_enabled() -> bool:
    # MEGABLOCKS_ASCEND_CHECKS (megablocks_ascend/envs.py lists it). Imported on first use, not at
    # the top, so that this module can still be loaded on its own.
    global _envs
    if _envs is None:
        from megablocks_ascend import envs as _envs  # noqa: PLC0415
    return _envs.checks_enabled()


def _output_shape(a, b, n_groups, trans_a, trans_b):
    if trans_a:
        return (n_groups, a.shape[1], b.shape[1])
    return (a.shape[0], b.shape[1] if trans_b else b.shape[2])


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _torch_version() -> tuple:
    m = re.match(r'^(\d+)\.(\d+)', torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@functools.lru_cache(maxsize=None)
def _cuda_device_supports_grouped_mm(device_index: int) -> bool:
    """Whether this torch build + GPU can run torch._grouped_mm for bf16.

    torch 2.8 added _grouped_mm but only for SM90/SM100 and with no fallback;
    from 2.9 there is a fallback path and the documented floor is SM80.
    """
    if not hasattr(torch, '_grouped_mm'):
        return False
    version = _torch_version()
    if getattr(torch.version, 'hip', None):
        return version >= (2, 9)
    major, _minor = torch.cuda.get_device_capability(device_index)
    if version >= (2, 9):
        return major >= 8
    return major in (9, 10)


def _cuda_fast_grouped_mm(device_index: int) -> bool:
    """Whether torch._grouped_mm runs its fused kernel (bf16, SM90/SM100) on this GPU.

    Only that kernel reads the offsets on the device. torch's fallback for other GPUs
    (SM80+, from torch 2.9) copies them to the host and loops over the groups: a sync.
    """
    if not _cuda_device_supports_grouped_mm(device_index) or getattr(torch.version, 'hip', None):
        return False
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


_CPU_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _cpu_supports_grouped_mm() -> bool:
    """torch._grouped_mm has a CPU kernel from torch 2.9 (2.8 defines the op for CUDA only).

    Run here on torch 2.13 (bf16, fp16, fp32); 2.9-2.12 on CPU not run.
    """
    return hasattr(torch, '_grouped_mm') and _torch_version() >= (2, 9)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _grouped_mm_operands(a, b, trans_a, trans_b):
    """The (mat_a, mat_b) views handed to torch._grouped_mm."""
    if trans_a:
        return a.t(), b                   # 2d x 2d: offsets slice a.t()'s columns / b's rows
    return a, (b.transpose(1, 2) if trans_b else b)   # 2d x 3d: offsets slice a's rows


def _grouped_mm_strides_ok(t: torch.Tensor) -> bool:
    """Mirror of torch's check_valid_strides_and_return_transposed.

    One of the last two strides must be 1 and the other a multiple of 16 bytes
    (and >= the matching size); the data pointer must be 16-byte aligned.
    """
    align = 16 // t.element_size()
    s, n = t.stride(), t.shape
    if t.data_ptr() % 16 != 0:
        return False
    if s[-2] == 1 and s[-1] >= max(1, n[-2]):
        return s[-1] % align == 0
    if s[-1] == 1 and s[-2] >= max(1, n[-1]):
        return s[-2] % align == 0
    return False


def _grouped_mm_usable(a, b, batch_sizes, trans_a, trans_b) -> bool:
    if a.device.type == 'cpu':
        if a.dtype not in _CPU_GROUPED_MM_DTYPES or not _cpu_supports_grouped_mm():
            return False
    elif a.dtype != torch.bfloat16:
        return False                      # CUDA: documented bf16 only (fp16/fp32 -> loop)
    elif not _cuda_device_supports_grouped_mm(_device_index(a.device)):
        return False
    if b is None:
        return True
    if b.dtype != a.dtype or b.device != a.device:
        return False
    if trans_a and trans_b:
        return False
    if a.numel() == 0 or b.numel() == 0:
        return False                      # empty operands: the loop handles them trivially
    if a.shape[0] > _INT32_MAX:
        return False                      # offsets are int32
    mat_a, mat_b = _grouped_mm_operands(a, b, trans_a, trans_b)
    if not (_grouped_mm_strides_ok(mat_a) and _grouped_mm_strides_ok(mat_b)):
        return False
    if a.device.type == 'cuda':
        n_groups = batch_sizes.shape[0] if batch_sizes is not None else (None if trans_a else b.shape[0])
        if n_groups is not None and n_groups > _CUDA_FAST_MAX_GROUPS \
                and _cuda_fast_grouped_mm(_device_index(a.device)):
            return False
        if trans_a and (mat_a.stride(-1) == 1 or mat_b.stride(-1) != 1):
            # The CUTLASS kernel takes an empty K-group only with mat_a column-major and mat_b
            # row-major (a and b row-major); in its other layouts an empty group trips a device-side
            # assert (prepare_grouped_gemm_data in GroupMMCommon.cuh: "CUTLASS cannot handle delta=0").
            return False
    # The output's last dim must be 16-byte aligned too, or torch pads its
    # stride and hands back a non-contiguous tensor; keep it simple.
    n_out = b.shape[1] if (trans_a or trans_b) else b.shape[2]
    return n_out % (16 // a.element_size()) == 0


def _npu_dtype_ok(dtype, device) -> bool:
    """Whether npu_grouped_matmul's documentation lists ``dtype`` operands for our forms on
    ``device``: fp16/bf16 everywhere, fp32 on Atlas A2 (Ascend 910B) only."""
    if dtype in _NPU_DTYPES:
        return True
    if dtype in _NPU_A2_DTYPES:
        from megablocks_ascend import devices  # noqa: PLC0415  (lazy: this module loads on its own)
        return devices.is_atlas_a2(device)
    return False


def _npu_usable(a, b, batch_sizes, trans_a, trans_b) -> bool:
    if not _npu_dtype_ok(a.dtype, a.device):
        return False                      # fp64; fp32 off Atlas A2 -> loop (see _gmm_npu docstring)
    try:
        import torch_npu  # noqa: F401  (lazy: only reached for NPU tensors)
    except ImportError:
        return False
    if not hasattr(torch_npu, 'npu_grouped_matmul'):
        return False
    if b is None:
        return True
    if b.dtype != a.dtype or b.device != a.device or (trans_a and trans_b):
        return False
    if a.numel() == 0 or b.numel() == 0:
        return False
    n_groups = batch_sizes.shape[0] if batch_sizes is not None else (
        None if trans_a else b.shape[0])
    if n_groups is not None and not (2 <= n_groups <= _NPU_MAX_GROUPS):
        return False                      # a group_list of counts "cannot have length 1" (docs)
    inner = (a.shape[1], b.shape[1]) if trans_a else (a.shape[1], *b.shape[1:])
    return max(inner) < _NPU_INNER_LIMIT


def _select_impl(a, b=None, batch_sizes=None, trans_a=False, trans_b=False) -> str:
    dev = a.device.type
    if dev == 'npu':
        return IMPL_NPU if _npu_usable(a, b, batch_sizes, trans_a, trans_b) else IMPL_LOOP
    if dev in ('cuda', 'cpu'):
        if _grouped_mm_usable(a, b, batch_sizes, trans_a, trans_b):
            return IMPL_GROUPED_MM
        return IMPL_LOOP
    return IMPL_LOOP


def takes_device_sizes(device: torch.device, dtype: torch.dtype, dims: tuple, groups: int) -> bool:
    """Whether ``gmm`` can take ``batch_sizes`` on ``device`` and never read them on the host,
    for every GEMM of an expert MLP whose operands have this dtype, ``groups`` experts and the
    non-grouped dimensions ``dims`` (hidden and FFN sizes).

    True where the call would go to an implementation that reads the offsets on the device:
    ``torch._grouped_mm``'s fused kernel (CUDA SM90/SM100, bf16, fewer than 1024 groups; the CPU
    kernel of torch >= 2.9, bf16/fp16/fp32) or ``npu_grouped_matmul`` (fp16/bf16, and fp32 on
    Atlas A2; not run on an NPU), with, on an accelerator, the weight gradient's empty groups
    zeroed by our Triton kernel (:func:`megablocks_ascend.kernels.grouped.zero_empty_groups`), so
    Triton must run there (triton-ascend on an NPU). Per-call facts that are not known here (an
    operand's data pointer alignment) can still send a single call to the loop, which then reads
    the sizes (correct, with a sync).
    """
    dims = tuple(int(d) for d in dims)
    if not dims or min(dims) <= 0 or groups < 1:
        return False
    if device.type == 'npu':
        if not _npu_dtype_ok(dtype, device) or not 2 <= groups <= _NPU_MAX_GROUPS \
                or max(dims) >= _NPU_INNER_LIMIT:
            return False
        try:
            import torch_npu  # noqa: F401,PLC0415  (only reached for NPU tensors)
        except ImportError:
            return False
        return hasattr(torch_npu, 'npu_grouped_matmul') and _fill_kernel_runs(device)
    if device.type == 'cuda':
        if dtype != torch.bfloat16 or not _cuda_fast_grouped_mm(_device_index(device)) \
                or groups > _CUDA_FAST_MAX_GROUPS:
            return False
    elif device.type == 'cpu':
        if dtype not in _CPU_GROUPED_MM_DTYPES or not _cpu_supports_grouped_mm():
            return False
    else:
        return False
    align = 16 // dtype.itemsize
    return all(d % align == 0 for d in dims)


def gmm_impl_name(a, b=None, batch_sizes=None, trans_a=False, trans_b=False) -> str:
    """Name of the implementation ``gmm`` would use.

    With only ``a``, the answer depends on device, dtype and the installed
    torch / torch_npu.  Pass ``b`` (and ``batch_sizes``, ``trans_a``,
    ``trans_b``) as well to include the per-call shape/stride/alignment checks,
    which can send an individual call to ``'loop'``.

    Returns one of ``'npu_grouped_matmul'``, ``'torch._grouped_mm'``, ``'loop'``.
    """
    return _select_impl(a, b, batch_sizes, trans_a, trans_b)


# --------------------------------------------------------------------------
# Implementations (all called under torch.no_grad() with validated inputs)
# --------------------------------------------------------------------------

def _mm_into(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    torch.mm(x, y, out=out)


def _gmm_loop(a, b, sizes, trans_a, trans_b, c):
    """One torch.mm per group, in the input dtype (torch.mm's accumulation)."""
    start = 0
    if trans_a:
        for g, n in enumerate(sizes):
            if n == 0:
                c[g].zero_()
            else:
                _mm_into(c[g], a[start:start + n].t(), b[start:start + n])
            start += n
    else:
        for g, n in enumerate(sizes):
            if n:
                w = b[g].t() if trans_b else b[g]
                _mm_into(c[start:start + n], a[start:start + n], w)
            start += n
    return c


# --------------------------------------------------------------------------
# Empty groups of the K-grouped form (trans_a: the weight gradients)
# --------------------------------------------------------------------------
#
# ``out[g] = a_g.T @ b_g`` over a group without rows is a zero block, and an expert that received
# no tokens has exactly that weight gradient. Whether a kernel writes it (docs/notes/grouped-gemm.md
# has the evidence):
#
# * torch._grouped_mm on CPU (torch >= 2.9): yes. Its CPU kernel is ``_grouped_mm_fallback``
#   (ATen/native/GroupedMMUtils.h), one ``at::mm_out`` per group, and ``mm_out`` with an empty
#   inner dimension zero-fills its output; the tests check it on the torch they run with.
# * torch._grouped_mm on CUDA (the CUTLASS kernel): not established. A K = 0 tile leaves the
#   accumulator unwritten in CUTLASS's SM100 kernel (NVIDIA/cutlass#2674, fixed upstream in
#   cutlass#2746, wrong gradients reported on B200 in pytorch/pytorch#172439, still open); its SM90
#   mainloop asserts k_tile_count >= 1, an assert compiled out of release builds. Guarded;
#   benchmarks/check_grouped_mm_empty.py checks a GPU.
# * npu_grouped_matmul (group_type=2): its documentation says nothing about empty groups. Guarded.
# * the loop: zeroes them itself.
#
# The guard touches the empty groups only: on the host sizes, one zero fill per empty group; on the
# device sizes, kernels/grouped.py's zero_empty_groups (no host read, a fixed grid).

# Benchmarks only (bench_steps.py --wgrad-fill full): the guard of earlier versions, a masked fill
# that reads and writes the whole [E, M, N] result, for before/after timings in one run.
_legacy_full_fill = False


def _grouped_mm_writes_empty_groups(device: torch.device) -> bool:
    """Whether torch._grouped_mm is known to write zeros for the empty groups of the K-grouped
    form on ``device`` (see above): on the CPU only."""
    return device.type == 'cpu'


@functools.lru_cache(maxsize=None)
def _fill_kernel_runs_on(device_type: str) -> bool:
    from megablocks_ascend import compat  # noqa: PLC0415  (lazy: imports triton)
    if device_type == 'npu':
        return compat.is_triton_ascend()
    if device_type == 'cpu':
        return compat.interpreter_active()
    return device_type == 'cuda'


def _fill_kernel_runs(device: torch.device) -> bool:
    """Whether our Triton zero fill of empty groups can run on ``device`` (triton-ascend on an
    NPU, Triton on CUDA, the interpreter for CPU tensors)."""
    if device.type == 'cpu':
        from megablocks_ascend import compat  # noqa: PLC0415  (not cached: it can turn on later)
        return compat.interpreter_active()
    return _fill_kernel_runs_on(device.type)


def _zero_empty_host(out, sizes):
    """Zero the blocks of the empty groups, known on the host: one fill per empty group."""
    for g, n in enumerate(sizes):
        if n == 0:
            out[g].zero_()


def _zero_empty_device(out, groups):
    """Zero the blocks of the empty groups of :class:`_DeviceGroups` ``groups`` on the device."""
    if _legacy_full_fill:
        out.masked_fill_(groups.empty, 0)
        return
    from megablocks_ascend.kernels import grouped  # noqa: PLC0415  (lazy: imports triton)
    grouped.zero_empty_groups(out, groups.ends)


# --------------------------------------------------------------------------
# Group layout from device-resident batch_sizes (see "Where the group sizes live")
# --------------------------------------------------------------------------

_GROUPS_ATTR = '_megablocks_ascend_gmm_groups'


class _DeviceGroups:
    """Group ends and the quantities derived from them, computed on the device from
    ``batch_sizes`` without reading it: ``ends[g] = min(sum(max(batch_sizes[:g+1], 0)), rows)``,
    non-decreasing and at most ``rows``, so every group is a slice inside the operands even when
    ``batch_sizes`` is malformed (its values are checked only with MEGABLOCKS_ASCEND_CHECKS=1).

    ``key`` (``keeping.key(batch_sizes, rows)``) when the groups are kept on ``batch_sizes``, None
    when they serve one call. ``ends`` given: group ends that the caller computed with
    ``batch_sizes`` and vouches for (:func:`keep_group_ends`); nothing is launched, and the groups
    are stale once ``ends`` changes (it is their companion tensor, in the sense of ``keeping``)."""

    def __init__(self, key, batch_sizes, rows: int, ends=None):
        self._derived = {}
        if ends is None:
            self.ends = batch_sizes.clamp(min=0).cumsum(0).clamp_(max=rows)   # int64
            self._sizes = None
        else:
            self.ends = ends
            # The sizes are the ends' differences (npu_grouped_matmul's group_list: one cast). A weak
            # reference: these groups are kept on batch_sizes itself.
            self._sizes = weakref.ref(batch_sizes)
        companions = () if ends is None else (ends,)
        self._kept = None if key is None else keeping.Kept(key, companions, captured=False)

    @property
    def key(self):
        return None if self._kept is None else self._kept.key

    def current(self, key) -> bool:
        """Whether these groups still describe ``batch_sizes`` at ``key`` (its version, the rows)."""
        return self._kept is not None and self._kept.current(key, captured=False)

    def _get(self, name, make):
        value = self._derived.get(name)
        if value is None:
            value = self._derived[name] = make()
        return value

    @property
    def offsets(self):
        """int32 cumulative ends, as torch._grouped_mm's ``offs`` wants them."""
        return self._get('offsets', lambda: self.ends.to(torch.int32))

    @property
    def counts(self):
        """int64 per-group sizes consistent with ``ends`` (npu_grouped_matmul's ``group_list``)."""
        sizes = self._sizes() if self._sizes is not None else None
        if sizes is not None:
            return self._get('counts', lambda: sizes.to(torch.int64))
        return self._get('counts', lambda: torch.diff(self.ends, prepend=self.ends.new_zeros(1)))

    @property
    def empty(self):
        """[E, 1, 1] mask of the groups without rows (their trans_a blocks must be zero)."""
        return self._get('empty', lambda: (self.counts == 0).view(-1, 1, 1))


def _reusable(batch_sizes) -> bool:
    """Whether group ends may be kept on ``batch_sizes`` for later GEMMs, or kept ones used, under
    the rule of :mod:`megablocks_ascend.keeping`: not an inference tensor, not inside
    ``keeping.no_reuse`` (the custom op compiled graphs call), and not during a graph capture (each
    captured call records its own small kernels)."""
    return keeping.keepable(batch_sizes) and not keeping.capturing(batch_sizes.device)


def _device_groups(batch_sizes, rows: int) -> _DeviceGroups:
    """The :class:`_DeviceGroups` of ``batch_sizes``, computed once per tensor (and version)
    and kept on the tensor object itself, so the GEMMs of one step (forward and backward get
    the same ``tokens_per_expert``) share it and it dies with the tensor. Not reused while a
    graph is being captured: each captured call records its own small kernels."""
    if not _reusable(batch_sizes):
        return _DeviceGroups(None, batch_sizes, rows)
    key = keeping.key(batch_sizes, rows)
    groups = keeping.find(batch_sizes, _GROUPS_ATTR)
    if groups is None or not groups.current(key):
        groups = _DeviceGroups(key, batch_sizes, rows)
        keeping.put(batch_sizes, _GROUPS_ATTR, groups)
    return groups


def keep_group_ends(batch_sizes, ends, rows: int) -> None:
    """Let the grouped GEMMs over ``rows`` rows grouped by ``batch_sizes`` take ``ends`` as their
    group ends instead of computing them (a clamp, a cumsum, a clamp and a cast: four launches per
    step). The caller vouches for the values: ``ends`` is the inclusive cumsum of ``batch_sizes``,
    whose entries are non-negative and sum to at most ``rows`` (the routing preparation's ``bins``
    and ``tokens_per_expert``, with ``rows`` its number of assignments). Kept under the rules of
    :func:`_device_groups`; a later in-place change of either tensor, or GEMMs over another number
    of rows, compute their own ends as before."""
    if not _reusable(batch_sizes) or not keeping.keepable(ends) or ends.device != batch_sizes.device \
            or ends.shape != batch_sizes.shape:
        return
    keeping.put(batch_sizes, _GROUPS_ATTR, _DeviceGroups(keeping.key(batch_sizes, rows), batch_sizes, rows, ends))


def _finish(out, c):
    if c is None:
        return out if out.is_contiguous() else out.contiguous()
    c.copy_(out)
    return c


def _gmm_grouped_mm(a, b, batch_sizes, sizes, trans_a, trans_b, c):
    """CUDA and CPU path via ``torch._grouped_mm``.

    ``sizes``: the group sizes as Python ints when they were read on the host, ``None`` when
    ``batch_sizes`` is used on the device (see :func:`_device_groups`).

    ``torch._grouped_mm(mat_a, mat_b, offs=...)`` takes ``offs`` as a 1-D
    **int32 tensor of cumulative end offsets on the operands' device**
    (``offs[i]`` is the end of group ``i``).  The mapping used here:

    * no trans_a: ``mat_a = a`` [T, K] (2-D, sliced by rows),
      ``mat_b = b`` [E, K, N] or, with trans_b, the view ``b.transpose(1, 2)``
      (a column-major 3-D operand -- allowed, no copy);
    * trans_a: ``mat_a = a.t()`` [M, T] (column-major view), ``mat_b = b``
      [T, N]; the 2d x 2d form slices the shared T dimension and returns
      [E, M, N].

    Constraints (from torch's docs, its meta function and GroupedBlas.cpp /
    GroupedMMUtils.h): bf16 inputs (the documented dtype; newer builds accept
    fp16/fp32 through an internal per-group loop with a device-to-host sync,
    no better than ours, and the meta/compile path still rejects them, so
    those go to the loop); one of the last two strides 1 and the other a
    multiple of 16 bytes; 16-byte aligned data pointers; CUDA SM80+ from torch
    2.9, SM90/SM100 only on torch 2.8.  Calls that miss any of this are routed
    to the loop by ``_grouped_mm_usable``.

    For trans_a on an accelerator, the blocks of groups with zero rows are zeroed afterwards, and
    nothing else is touched (see "Empty groups of the K-grouped form" above): whether the CUDA
    kernel writes them is not established (pytorch/pytorch#172439). torch's CPU kernel writes them.
    """
    mat_a, mat_b = _grouped_mm_operands(a, b, trans_a, trans_b)
    guard = trans_a and not _grouped_mm_writes_empty_groups(a.device)
    if sizes is None:
        groups = _device_groups(batch_sizes, a.shape[0])
        out = torch._grouped_mm(mat_a, mat_b, offs=groups.offsets)
        if guard:
            _zero_empty_device(out, groups)
        return _finish(out, c)
    offs = torch.cumsum(batch_sizes.to(torch.int64), 0).to(dtype=torch.int32)
    offs = offs.to(device=a.device, non_blocking=True)
    out = torch._grouped_mm(mat_a, mat_b, offs=offs)
    if guard:
        _zero_empty_host(out, sizes)
    return _finish(out, c)


def _gmm_npu(a, b, batch_sizes, sizes, trans_a, trans_b, c):
    """Ascend path via ``torch_npu.npu_grouped_matmul``.

    NOT YET RUN ON AN NPU.  Written from the op-plugin documentation
    (``docs/context/torch_npu-npu_grouped_matmul.md`` in Ascend's op-plugin
    repository; docs/notes/grouped-gemm.md) and the CANN
    aclnnGroupedMatmulV4 docs, plus the calling pattern used by existing
    Ascend MoE code; only exercised here against a fake that implements that
    reading of the docs.

    Signature used::

        npu_grouped_matmul(x: List[Tensor], weight: List[Tensor], *,
                           group_list: Tensor, split_item: int,
                           group_type: int, group_list_type: int) -> List[Tensor]

    * ``group_list`` is an int64 tensor on the NPU.  ``group_list_type=0``
      means cumulative end offsets (non-decreasing), ``1`` means per-group
      sizes; we pass the per-group sizes with type 1: ``batch_sizes`` itself
      when it was read on the host (``sizes`` given), else the sizes derived
      on the device by :func:`_device_groups` (negative sizes clamped, the
      total clamped to the rows), without a host read.
    * ``split_item`` 2 or 3 makes the output a single tensor (0/1 gives a
      list with one tensor per group).
    * ``group_type=0`` groups the M axis: x [T, K] single tensor, weight a
      single 3-D [E, K, N] tensor, output [T, N].  The weight may be a
      *transposed view* (``b.transpose(1, 2)`` of [E, N, K]); x may not.
    * ``group_type=2`` groups the K axis: x must be a transposed view
      ([M, T] from ``a.t()``), weight [T, N] not transposed, output
      [E, M, N].  (The torch_npu API page only lists -1/0 for group_type on
      A2/A3; the aclnn page and common MoE training code use 2 for the weight
      gradient.  This is the least-documented part of this branch.)

    Needs a torch_npu whose ``npu_grouped_matmul`` accepts ``group_type`` and
    ``group_list_type`` (older releases do not).  Between 2 and 1024 groups: the
    docs refuse a ``group_list`` of counts of length 1, and allow at most 1024
    groups.  fp16 and bf16; fp32 on Atlas A2
    (Ascend 910B) only, where torch_npu 2.7.1's documentation lists float32
    x/weight/y for the non-quantized single-tensor forms with a tensor
    ``group_list`` (and CANN's aclnnGroupedMatmulV3 page: "x, weight, y single
    tensors, non-quantized: float32 supported"); fp32 elsewhere and fp64 go to
    the loop.  Inner dims < 65536 (else: loop).  Empty K-groups are zeroed
    explicitly (only their blocks), as the docs do not say what the kernel
    writes for them.
    """
    import torch_npu  # lazy: only importable on Ascend machines

    groups = _device_groups(batch_sizes, a.shape[0]) if sizes is None else None
    if groups is not None:
        group_list = groups.counts
    else:
        group_list = batch_sizes.to(dtype=torch.int64).to(device=a.device, non_blocking=True)
    if trans_a:
        x = a.contiguous().t()            # transposed view, as group_type=2 requires
        w = b.contiguous()
        out = torch_npu.npu_grouped_matmul(
            [x], [w], group_list=group_list, split_item=3,
            group_type=2, group_list_type=1)[0]
        if groups is not None:
            _zero_empty_device(out, groups)
        else:
            _zero_empty_host(out, sizes)
    else:
        x = a.contiguous()
        w = b.contiguous()
        if trans_b:
            w = w.transpose(1, 2)         # transposed view; the kernel reads it as-is
        out = torch_npu.npu_grouped_matmul(
            [x], [w], group_list=group_list, split_item=2,
            group_type=0, group_list_type=1)[0]
    return _finish(out, c)


# --------------------------------------------------------------------------
# Autocast
# --------------------------------------------------------------------------

def _autocast_operands(a, b):
    """``(a, b)`` as ``torch.matmul`` would see them under autocast.

    When autocast is on for ``a``'s device type, each floating-point operand on that device type
    other than float64 is cast to the autocast dtype (autocast's rule for matmuls); anything else,
    including arguments that are not tensors, is returned as is and left to ``_validate``.
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


def _reads_device_sizes(impl, a, trans_a) -> bool:
    """Whether ``impl`` computes the call from device-resident group sizes without a host read:
    the kernels that take device offsets, provided that where the K-grouped form needs its empty
    groups zeroed, our fill kernel can run on the device."""
    if impl == IMPL_LOOP:
        return False
    if trans_a and (impl == IMPL_NPU or not _grouped_mm_writes_empty_groups(a.device)):
        return _fill_kernel_runs(a.device)
    return True


def _gmm_eager(a, b, batch_sizes, trans_a, trans_b, c):
    _validate(a, b, batch_sizes, trans_a, trans_b, c)
    impl = _select_impl(a, b, batch_sizes, trans_a, trans_b)
    rows = a.shape[0]
    if _device_sizes(batch_sizes, a) and (a.numel() == 0 or b.numel() == 0
                                          or _reads_device_sizes(impl, a, trans_a)):
        # Device sizes, and an implementation (or an empty problem) that needs no host read.
        if _value_checks_enabled():
            _host_sizes(batch_sizes, rows)  # the checks only; the kernels keep the device sizes
        sizes = None
    else:
        sizes = _host_sizes(batch_sizes, rows)
    with torch.no_grad():
        if sizes is None and (a.numel() == 0 or b.numel() == 0):
            # An empty operand: every block is an empty sum (or the result is empty), whatever
            # the group sizes are, so they need not be read.
            if c is not None:
                return c.zero_()
            return torch.zeros(_output_shape(a, b, batch_sizes.shape[0], trans_a, trans_b),
                               dtype=a.dtype, device=a.device)
        if impl == IMPL_NPU:
            return _gmm_npu(a, b, batch_sizes, sizes, trans_a, trans_b, c)
        if impl == IMPL_GROUPED_MM:
            return _gmm_grouped_mm(a, b, batch_sizes, sizes, trans_a, trans_b, c)
        if c is None:
            c = torch.empty(_output_shape(a, b, len(sizes), trans_a, trans_b),
                            dtype=a.dtype, device=a.device)
        return _gmm_loop(a, b, sizes, trans_a, trans_b, c)


@torch.library.custom_op("megablocks_ascend::gmm", mutates_args=())
def _gmm_op(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_a: bool,
            trans_b: bool) -> torch.Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return _gmm_eager(a, b, batch_sizes, trans_a, trans_b, None)


@_gmm_op.register_fake
def _(a, b, batch_sizes, trans_a, trans_b):
    return a.new_empty(_output_shape(a, b, batch_sizes.shape[0], trans_a, trans_b))


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
    backend_mod.gmm_impl_name = gmm_impl_name

    ops_mod = new('grouped_gemm.ops',
                  _STANDIN_DOC + ' Submodule `ops`: gmm(a, b, batch_sizes, '
                  'trans_b=False) as a torch.autograd.Function.')
    ops_mod.gmm = _ops_gmm
    ops_mod.GroupedGemm = GroupedGemm
    ops_mod.backend = backend_mod

    pkg = new('grouped_gemm', _STANDIN_DOC, is_package=True)
    pkg.backend = backend_mod
    pkg.ops = ops_mod
    pkg.gmm_impl_name = gmm_impl_name

    return {
        'grouped_gemm': pkg,
        'grouped_gemm.backend': backend_mod,
        'grouped_gemm.ops': ops_mod,
    }
