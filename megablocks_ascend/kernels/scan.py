"""An inclusive prefix sum of a short vector, in vector operations only.

``tl.cumsum`` along the only axis of a 1-D vector (and along the last axis of a 2-D tile) lowers,
through triton-ascend 3.2.0 and bishengir-compile, to a scalar loop over the elements: each one a
load, an add and a store on the Unified Buffer by the scalar unit, bracketed by handshakes with the
vector unit. Along the first axis of a 2-D tile it is a vector library call (each step adds a row
to the next), and ``tl.trans`` is a vector transpose (docs/notes/npu-census.md). So a vector of
``BLOCK = R * C`` elements is summed as a ``[R, C]`` tile whose column ``c`` holds elements
``c * R .. c * R + R - 1``: a scan down the columns, then each column's total before it (a
``[C, C]`` masked sum), added back. The work is ``O(BLOCK + C**2)`` vector element operations, the
scalar loop's was ``O(BLOCK)`` scalar instructions each costing a vector instruction's time or more.

Integers stay integers (exact); the interpreter and CUDA run the same code (``tl.trans`` and
``tl.reshape`` keep the element order there too).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cumsum(v, BLOCK: tl.constexpr):
    """The inclusive prefix sum of the ``[BLOCK]`` vector ``v`` (``BLOCK`` a power of two)."""
    if BLOCK == 1:
        out = v
    elif BLOCK < 4:  # one add, unrolled: no loop to avoid
        out = tl.cumsum(v, axis=0)
    else:
        # C >= 2 columns: with a single column the compiler folds the tile back into a vector and
        # emits the scalar loop again (seen with bishengir-compile 1.2.0 at BLOCK 8, R 8).
        R: tl.constexpr = BLOCK // 2 if BLOCK < 64 else 32
        C: tl.constexpr = BLOCK // R
        t = tl.trans(tl.reshape(v, (C, R)))  # t[r, c] = v[c * R + r]
        down = tl.cumsum(t, axis=0)  # within each column
        total = tl.sum(t, axis=0)  # [C]
        c = tl.arange(0, C)
        # earlier[i, j] = 1 where j < i: the sign bit of j - i, not a compare (a select along a
        # broadcast axis lowers row by row)
        earlier = -((c[None, :] - c[:, None]) >> 31)
        before = tl.sum(earlier * total[None, :], axis=1)  # [C], exclusive
        out = tl.reshape(tl.trans(down + before[None, :]), (BLOCK,))
    return out
