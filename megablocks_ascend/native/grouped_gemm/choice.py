"""Which implementation serves a grouped GEMM, and what the machine can run: the probes of torch's
``_grouped_mm`` (CUDA and CPU) and torch_npu's ``npu_grouped_matmul``, the per-call checks
(dtype, group count, strides, alignment) that send a call to the loop, :func:`gmm_impl_name`, and
:func:`takes_device_sizes` (whether an expert MLP's GEMMs read no group size on the host).
"""

from __future__ import annotations

import functools
import re

import torch

from megablocks_ascend.native.grouped_gemm import empty_groups

IMPL_NPU = 'npu_grouped_matmul'
IMPL_GROUPED_MM = 'torch._grouped_mm'
IMPL_LOOP = 'loop'

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
        return hasattr(torch_npu, 'npu_grouped_matmul') and empty_groups._fill_kernel_runs(device)
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


def _reads_device_sizes(impl, a, trans_a) -> bool:
    """Whether ``impl`` computes the call from device-resident group sizes without a host read:
    the kernels that take device offsets, provided that where the K-grouped form needs its empty
    groups zeroed, our fill kernel can run on the device."""
    if impl == IMPL_LOOP:
        return False
    if trans_a and (impl == IMPL_NPU or not empty_groups._grouped_mm_writes_empty_groups(a.device)):
        return empty_groups._fill_kernel_runs(a.device)
    return True
