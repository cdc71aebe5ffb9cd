"""The three implementations of the grouped GEMM, each called under ``torch.no_grad()`` with
validated inputs: the per-group loop (:func:`_gmm_loop`), ``torch._grouped_mm`` on CUDA and CPU
(:func:`_gmm_grouped_mm`) and ``torch_npu.npu_grouped_matmul`` on an NPU (:func:`_gmm_npu`).
"""

from __future__ import annotations

import torch

from megablocks_ascend.native.grouped_gemm import choice, device_sizes, empty_groups


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


def _finish(out, c):
    if c is None:
        return out if out.is_contiguous() else out.contiguous()
    c.copy_(out)
    return c


def _gmm_grouped_mm(a, b, batch_sizes, sizes, trans_a, trans_b, c):
    """CUDA and CPU path via ``torch._grouped_mm``.

    ``sizes``: the group sizes as Python ints when they were read on the host, ``None`` when
    ``batch_sizes`` is used on the device (see :func:`device_sizes._device_groups`).

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
    to the loop by ``choice._grouped_mm_usable``.

    For trans_a on an accelerator, the blocks of groups with zero rows are zeroed afterwards, and
    nothing else is touched (see :mod:`~megablocks_ascend.native.grouped_gemm.empty_groups`): whether the CUDA
    kernel writes them is not established (pytorch/pytorch#172439). torch's CPU kernel writes them.
    """
    mat_a, mat_b = choice._grouped_mm_operands(a, b, trans_a, trans_b)
    guard = trans_a and not empty_groups._grouped_mm_writes_empty_groups(a.device)
    if sizes is None:
        groups = device_sizes._device_groups(batch_sizes, a.shape[0])
        out = torch._grouped_mm(mat_a, mat_b, offs=groups.offsets)
        if guard:
            empty_groups._zero_empty_device(out, groups)
        return _finish(out, c)
    offs = torch.cumsum(batch_sizes.to(torch.int64), 0).to(dtype=torch.int32)
    offs = offs.to(device=a.device, non_blocking=True)
    out = torch._grouped_mm(mat_a, mat_b, offs=offs)
    if guard:
        empty_groups._zero_empty_host(out, sizes)
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
      on the device by :func:`device_sizes._device_groups` (negative sizes clamped, the
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

    groups = device_sizes._device_groups(batch_sizes, a.shape[0]) if sizes is None else None
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
            empty_groups._zero_empty_device(out, groups)
        else:
            empty_groups._zero_empty_host(out, sizes)
    else:
        x = a.contiguous()
        w = b.contiguous()
        if trans_b:
            w = w.transpose(1, 2)         # transposed view; the kernel reads it as-is
        out = torch_npu.npu_grouped_matmul(
            [x], [w], group_list=group_list, split_item=2,
            group_type=0, group_list_type=1)[0]
    return _finish(out, c)
