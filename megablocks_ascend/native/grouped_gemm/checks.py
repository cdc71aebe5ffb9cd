"""The grouped GEMM's argument checks: every argument's type, shape, dtype and device before any
work (:func:`_validate`), and the checks that read the group sizes' values (:func:`_host_sizes`),
run where the values are on the host anyway or with ``MEGABLOCKS_ASCEND_CHECKS=1``.

Bad inputs raise ``ValueError`` naming the argument (the real package fails a ``TORCH_CHECK``).
"""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32)


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
    # the top, so that loading the package imports only torch and keeping (package docstring).
    global _envs
    if _envs is None:
        from megablocks_ascend import envs as _envs  # noqa: PLC0415
    return _envs.checks_enabled()


def _output_shape(a, b, n_groups, trans_a, trans_b):
    if trans_a:
        return (n_groups, a.shape[1], b.shape[1])
    return (a.shape[0], b.shape[1] if trans_b else b.shape[2])
