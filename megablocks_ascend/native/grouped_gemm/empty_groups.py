"""Empty groups of the K-grouped form (``trans_a``: the weight gradients): which kernels write
their zero blocks, and the guard that zeroes them where that is not established.

``out[g] = a_g.T @ b_g`` over a group without rows is a zero block, and an expert that received
no tokens has exactly that weight gradient. Whether a kernel writes it (docs/notes/grouped-gemm.md
has the evidence):

* torch._grouped_mm on CPU (torch >= 2.9): yes. Its CPU kernel is ``_grouped_mm_fallback``
  (ATen/native/GroupedMMUtils.h), one ``at::mm_out`` per group, and ``mm_out`` with an empty
  inner dimension zero-fills its output; the tests check it on the torch they run with.
* torch._grouped_mm on CUDA (the CUTLASS kernel): not established. A K = 0 tile leaves the
  accumulator unwritten in CUTLASS's SM100 kernel (NVIDIA/cutlass#2674, fixed upstream in
  cutlass#2746, wrong gradients reported on B200 in pytorch/pytorch#172439, still open); its SM90
  mainloop asserts k_tile_count >= 1, an assert compiled out of release builds. Guarded;
  docs/notes/repro/check_grouped_mm_empty.py checks a GPU.
* npu_grouped_matmul (group_type=2): its documentation says nothing about empty groups. Guarded.
* the loop: zeroes them itself.

The guard touches the empty groups only: on the host sizes, one zero fill per empty group; on the
device sizes, kernels/grouped.py's zero_empty_groups (no host read, a fixed grid). The package's
``_legacy_full_fill`` switch (benchmarks only) replaces the latter by the guard of earlier versions.
"""

from __future__ import annotations

import functools

import torch


def _grouped_mm_writes_empty_groups(device: torch.device) -> bool:
    """Whether torch._grouped_mm is known to write zeros for the empty groups of the K-grouped
    form on ``device`` (the module docstring): on the CPU only."""
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
    """Zero the blocks of the empty groups of
    :class:`~megablocks_ascend.native.grouped_gemm.device_sizes._DeviceGroups` ``groups`` on the
    device (or, with the package's ``_legacy_full_fill`` switch on, the whole result masked)."""
    from megablocks_ascend.native import grouped_gemm  # noqa: PLC0415  (the switch lives on the package)
    if grouped_gemm._legacy_full_fill:
        out.masked_fill_(groups.empty, 0)
        return
    from megablocks_ascend.kernels import grouped  # noqa: PLC0415  (lazy: imports triton)
    grouped.zero_empty_groups(out, groups.ends)
