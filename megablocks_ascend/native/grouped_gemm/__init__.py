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
  ``torch_npu.npu_grouped_matmul``.  NOT YET RUN ON AN NPU; see ``impls._gmm_npu``.
* ``'torch._grouped_mm'`` -- CUDA tensors, bf16, with a torch that has
  ``torch._grouped_mm`` and operands that meet its alignment rules; CPU
  tensors (bf16/fp16/fp32, torch >= 2.9) likewise.  See ``impls._gmm_grouped_mm``.
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
dtype first, so float32 weights meet bf16/fp16 activations (see ``entry._autocast_operands``).  In
``ops.gmm`` the casts are recorded by autograd, so float32 inputs get float32 gradients, and the
backward runs under the forward's autocast state.  ``torch._grouped_mm`` and
``npu_grouped_matmul`` are not registered with autocast (pytorch/pytorch#174763), so this is done
here, before any implementation is chosen.

Differences from the real package, on purpose: fp16/fp32/fp64 are accepted
(the real one is bf16 only); bad inputs raise ``ValueError`` naming the
argument (the real one fails a ``TORCH_CHECK``); the kernel paths compute into
a fresh tensor and copy into a caller-supplied ``c`` rather than writing it in
place.

The modules, one idea each:

==================  ============================================================================
``entry``           the entry points: :func:`gmm` (``grouped_gemm.backend.gmm``: autocast, checks,
                    choice, call; a custom op under torch.compile), :class:`GroupedGemm` and
                    ``ops.gmm`` (``grouped_gemm.ops``), :func:`make_modules`
``checks``          argument checks (types, shapes, dtypes, devices; the values of the sizes)
``choice``          which implementation serves a call, the machine probes behind it,
                    :func:`gmm_impl_name`, :func:`takes_device_sizes`
``impls``           the three implementations
``empty_groups``    the zero blocks of the K-grouped form's empty groups
``device_sizes``    group ends computed on the device and kept for the step, :func:`keep_group_ends`
==================  ============================================================================

They call each other through the module (``choice._select_impl(...)``, never a copied name), so
a test that replaces a function on the module that defines it replaces it for every caller. The
one switch read from here, ``_legacy_full_fill``, is set on this package.

The package imports only ``torch`` and :mod:`megablocks_ascend.keeping` (which imports
only ``torch``; ``torch_npu`` lazily, in the NPU branch; the package's ``envs``,
``devices``, ``compat`` and ``kernels.grouped`` at their first use), so that it stays
light when the ``grouped-gemm`` patch registers it before MegaBlocks imports.
"""

from __future__ import annotations

from megablocks_ascend.native.grouped_gemm import (  # noqa: F401  (the modules, as attributes: gg.choice, ...)
    checks, choice, device_sizes, empty_groups, entry, impls)
from megablocks_ascend.native.grouped_gemm.choice import (
    IMPL_GROUPED_MM,
    IMPL_LOOP,
    IMPL_NPU,
    _cuda_fast_grouped_mm,  # docs/notes/repro/check_grouped_mm_empty.py reads it here
    gmm_impl_name,
    takes_device_sizes,
)
from megablocks_ascend.native.grouped_gemm.device_sizes import keep_group_ends
from megablocks_ascend.native.grouped_gemm.entry import GroupedGemm, backend, gmm, make_modules, ops

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

# Benchmarks only (bench_steps.py --wgrad-fill full, docs/notes/repro/check_grouped_mm_empty.py): the
# guard of earlier versions, a masked fill that reads and writes the whole [E, M, N] result, for
# before/after timings in one run. Read by empty_groups._zero_empty_device at each call.
_legacy_full_fill = False
