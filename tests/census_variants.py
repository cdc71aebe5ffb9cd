"""Kernel variants for the compile gate's census test (``lower --variant NAME=tests.census_variants``):
old forms of our kernels, kept to show that the gate fails what the census targets forbid. Never
launched: only lowered and compiled by tests/test_ascend_backend.py.

* ``_gather_tokens``: the token-major gather as it was before the census, scaling the tile in the
  expression that feeds a store to data-dependent rows. triton-ascend's front end copies that whole
  chain into the per-row store loop: a bf16 weight goes through a one-element buffer and a
  one-element cast on the vector unit, a handshake each way, for every row and slot.
* ``_place``: the routing preparation's placement ranking items with ``tl.cumsum`` along the last
  axis of its one-hot tile: a scalar loop over every element of the tile.
"""

import triton.language as tl

from megablocks_ascend.compat import kernel
from megablocks_ascend.kernels import preparation as _prep
from megablocks_ascend.kernels import routing_kernels

_columns, _offsets = routing_kernels._columns, routing_kernels._offsets


@kernel
def _gather_tokens(
    x, out, slot_to_row, bins, padded_bins, weights,
    num_tokens, num_rows, num_experts, hidden, capacity,
    LAYOUT: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_X: tl.constexpr,
):
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_X)
    for blk in range(pid, tl.cdiv(num_tokens, BLOCK_M), npg):
        tokens = blk * BLOCK_M + m
        in_tokens = tokens < num_tokens
        src = _offsets(tl.where(in_tokens, tokens, 0), hidden, INT64)
        for x0 in range(0, hidden, BLOCK_X):
            c, c_mask = _columns(x0, cols, hidden, EVEN_X, BLOCK_X)
            tile = tl.load(x + src[:, None] + c[None, :], mask=in_tokens[:, None] & c_mask[None, :], other=0)
            for k in tl.static_range(TOP_K):
                slot = tokens * TOP_K + k
                row = tl.load(slot_to_row + slot, mask=in_tokens, other=-1)
                valid = in_tokens & (row >= 0) & (row < num_rows)
                dst = _offsets(tl.where(valid, row, num_rows), hidden, INT64)
                if SCALE:
                    scale = tl.load(weights + slot, mask=valid, other=0).to(tl.float32)
                    value = (tile.to(tl.float32) * scale[:, None]).to(out.dtype.element_ty)  # the chain
                else:
                    value = tile
                tl.store(out + dst[:, None] + c[None, :], value, mask=c_mask[None, :])


@kernel
def _place(
    keys, counts, indices, bin_ids, tokens_per_expert, bins, padded_bins, slot_to_row,
    num_items, num_keys, key_mask, chunk, table_rows, block, capacity,
    PLACE: tl.constexpr, PADDED: tl.constexpr, ROUTE: tl.constexpr, NPU_FORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):  # NPU_FORM: the kernel's signature; this form is the last-axis scan whatever it says
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    e_f = tl.arange(0, BLOCK_E).to(tl.float32)
    begin, end = _prep._chunk(pid, chunk, num_items)
    for m0 in range(begin, end, BLOCK_M):
        items = m0 + m
        inside = items < end
        raw, key, valid = _prep._keys(keys, items, inside, num_keys, key_mask)
        hit = _prep._hit(key, valid, e_f, False)  # [BLOCK_E, BLOCK_M]: the keys along the first axis
        rank = tl.sum(hit * tl.cumsum(hit, axis=1), axis=0).to(tl.int32) - 1  # along the last axis
        tl.store(indices + items, rank, mask=inside)
