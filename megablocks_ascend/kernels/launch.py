"""Host-side helpers the kernel launchers share: integer division rounded up, and the one int32
convention.

The int32 convention, for every launcher: a kernel computes an integer (an element offset, an index
within a dimension, a tile count) in int32 only where the largest value it can form is
``<= INT32_MAX``; past that, the launcher specialises the kernel for int64 (``INT64=True``) or
refuses the call. :func:`needs_int64` is that test. A launcher that must be able to pretend a
small tensor is huge (the tests and the compile gate lower its limit) keeps its own module-level
limit, set to :data:`INT32_MAX`, and passes it as ``limit``.

Nothing here imports Triton, and nothing here is a kernel.
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1
"""The largest value a kernel may form in int32 arithmetic (an offset must be ``<= INT32_MAX``)."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for Python ints. Not ``triton.cdiv``: a jit-callable function that unwraps
    constexprs on every host-side call (~4-5 us each on a CPU, measured), and launchers call this
    on every launch."""
    return -(-a // b)


def needs_int64(*largest: int, limit: int = INT32_MAX) -> bool:
    """Whether a kernel whose largest formed values are ``largest`` must form them in int64: one of
    them is past ``limit`` (:data:`INT32_MAX` but where a test lowers it)."""
    return max(largest) > limit
