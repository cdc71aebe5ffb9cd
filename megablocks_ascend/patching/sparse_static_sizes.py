"""The ``sparse-static-sizes`` patch (page: ``patches/sparse-static-sizes.md``): MegaBlocks' sparse
dMoE (``mlp_impl="sparse"``, ``ParallelDroplessMLP.sparse_forward_once`` /
``sparse_permute_and_compute`` / ``topology``) sizes its padded buffer and its block-sparse topology
from what the host knows (:func:`megablocks_ascend.ops.padded_rows`) instead of reading
``padded_bins[-1]`` on the host, and builds the topology in one launch
(:func:`megablocks_ascend.ops.topology`); the rest of each method is upstream's code, and the patch
checks the fingerprint of every upstream body it replaces.
"""

from __future__ import annotations

import torch

from megablocks_ascend.patching.registry import Patch, replace_followed


def padded_rows(layer, x: torch.Tensor, assignments: int, experts: int) -> int | None:
    """The row count of the sparse dMoE's padded buffer for ``assignments`` routed to ``experts``:
    :func:`megablocks_ascend.ops.padded_rows` (static), or None (``padded_bins[-1]``, read on the
    host, as upstream does) where ``MEGABLOCKS_ASCEND_SPARSE_SIZES=exact`` or where the backend
    serving ``x``'s device runs upstream's kernels, which take no static size."""
    from megablocks_ascend import backends, envs, ops  # noqa: PLC0415
    if envs.sparse_sizes() == "exact" or not backends.static_sizes(x.device):
        return None
    return ops.padded_rows(assignments, experts, layer.blocking)


def _sparse_forward_once(self, x, expert_weights, top_experts):
    """``ParallelDroplessMLP.sparse_forward_once`` with the padded buffer's size from
    :func:`padded_rows`; the rest as upstream's."""
    from megablocks_ascend import ops  # noqa: PLC0415
    # x: [sl, bs, hs]
    # expert_weights: [sl * bs, top-k]
    # top_experts: [sl * bs, top-k]
    expert_weights = expert_weights.flatten()
    top_experts = top_experts.flatten()
    with torch.no_grad():
        indices, bin_ids, bins, padded_bins, tokens_per_expert = (self.indices_and_padded_bins(top_experts))

    # Route the tokens for MoE computation.
    x = x.view(-1, x.shape[-1])
    rows = padded_rows(self, x, indices.shape[0], padded_bins.shape[0])
    x = ops.padded_gather(x, indices, bin_ids, bins, padded_bins, self.top_k, rows)

    # Create the sparse matrix topology.
    with torch.no_grad():
        topo = self.topology(x, padded_bins)

    # Perform the expert computation.
    x = self.mlp(x, topo)

    # Un-route the data for the MoE output.
    x = ops.padded_scatter(x, indices, bin_ids, expert_weights, bins, padded_bins, self.top_k)
    return x, tokens_per_expert


def _sparse_permute_and_compute(self, x, tokens_per_expert, indices, bin_ids, expert_weights, bins,
                                expert_capactiy, top_k):
    """``ParallelDroplessMLP.sparse_permute_and_compute`` (the expert-parallel path) with the padded
    buffer's size from :func:`padded_rows`; the rest as upstream's."""
    import megablocks.ops as mops  # noqa: PLC0415
    from megablocks.layers.dmoe import promote_scalar  # noqa: PLC0415
    from megablocks_ascend import ops  # noqa: PLC0415

    # Round the token counts up to the block size used in the matrix
    # multiplication. Calculate the starting position of each bin.
    padded_tokens_per_expert = mops.round_up(tokens_per_expert, self.blocking)
    padded_bins = mops.inclusive_cumsum(padded_tokens_per_expert, 0)
    padded_bins = promote_scalar(padded_bins)

    # Route the tokens for MoE computation.
    x = x.view(-1, x.shape[-1])
    rows = padded_rows(self, x, indices.shape[0], padded_bins.shape[0])
    x = ops.padded_gather(x, indices, bin_ids, bins, padded_bins, top_k, rows)

    # Create the sparse matrix topology.
    with torch.no_grad():
        topo = self.topology(x, padded_bins)

    # Perform the expert computation.
    x = self.mlp(x, topo)

    # Un-route the data for the MoE output.
    return ops.padded_scatter(x, indices, bin_ids, expert_weights, bins, padded_bins, top_k)


def _topology(self, x, padded_bins):
    """``ParallelDroplessMLP.topology`` (and its ``sparse_transpose``) through
    :func:`megablocks_ascend.ops.topology`: the six index tensors in one launch on ``ascend``, for
    as many block rows as ``x`` has (those past ``padded_bins[-1]`` spare: no blocks). The checks
    and the matrix are upstream's."""
    import stk  # noqa: PLC0415
    from megablocks.layers import common, mpu  # noqa: PLC0415
    from megablocks_ascend import ops, validation  # noqa: PLC0415
    padded_tokens, _ = x.size()
    assert padded_tokens % self.blocking == 0
    if self.ffn_hidden_size % self.blocking != 0:
        raise ValueError(
            f'The ffn_hidden_size {self.ffn_hidden_size} must be divisible by ' +
            f'the block size {self.blocking}. Please update your configuration.',
        )
    block_rows = padded_tokens // self.blocking
    blocks_per_row = self.ffn_hidden_size // self.blocking
    if torch.compiler.is_compiling():
        # With exact sizes the row count is data-dependent, and stk.Matrix compares it with its int16
        # limit, which the compiler cannot decide; ops.topology refuses more block rows at run time.
        torch._check(padded_tokens <= validation.INT16_BLOCKS * self.blocking)
    row_indices, column_indices, offsets, column_indices_t, offsets_t, block_offsets_t = ops.topology(
        padded_bins, self.blocking, block_rows, blocks_per_row)
    # Unused by stk's kernels (upstream's TODO); on the meta device, as upstream makes it.
    data = torch.empty(column_indices.numel(), self.blocking, self.blocking, dtype=common.dtype(self.args),
                       device='meta')
    shape = (padded_tokens, self.ffn_hidden_size * mpu.experts_per_rank(self.args))
    return stk.Matrix(shape, data, row_indices, column_indices, offsets, column_indices_t, offsets_t,
                      block_offsets_t)


# The methods replaced: the fingerprint (registry.source_fingerprint) of MegaBlocks 0.10.0's code,
# and its parameters.
METHODS = {
    "megablocks.layers.dmoe:ParallelDroplessMLP.sparse_forward_once": (
        _sparse_forward_once, "5e5a6080c5c65ec2", ("self", "x", "expert_weights", "top_experts")),
    "megablocks.layers.dmoe:ParallelDroplessMLP.sparse_permute_and_compute": (
        _sparse_permute_and_compute, "bd2d132e535c714b",
        ("self", "x", "tokens_per_expert", "indices", "bin_ids", "expert_weights", "bins", "expert_capactiy",
         "top_k")),
    "megablocks.layers.dmoe:ParallelDroplessMLP.topology": (_topology, "b3b804f3332be5bf", ("self", "x", "padded_bins")),
}


def apply(p: Patch) -> None:
    for target, (replacement, fingerprint, params) in METHODS.items():
        replace_followed(p, target, replacement, fingerprint, params)


PATCH = Patch(
    name="sparse-static-sizes",
    targets=tuple(METHODS),
    why="The sparse dMoE routes each expert's tokens into a buffer whose segments are rounded up to the "
        "block size (128), `padded_bins[-1]` rows in all, and describes the expert MLP's activation as an "
        "stk block-sparse matrix of that many rows. Upstream sizes both by reading `padded_bins[-1]` on "
        "the host: `ops.padded_gather` does `padded_bins[-1].cpu().item()` in the forward and again in the "
        "backward (inside `padded_scatter`'s backward). Each read is a device-to-host sync: the host waits "
        "for the router every step, so the step runs at the host's pace, and a graph capture of the step "
        "fails (on an H200, `cudaErrorStreamCaptureInvalidated`, after which the process's CUDA RNG is "
        "left in capture state). The topology itself is a dozen launches: `ops.topology`, "
        "`stk.ops.row_indices`, and for the transpose a radix sort of the column indices, a gather, a "
        "histogram, a cumsum, a concatenation and an `arange`.",
    how="- `sparse_forward_once` and `sparse_permute_and_compute` are upstream's code with one change: "
        "`ops.padded_gather` gets a row count the host knows, `megablocks_ascend.ops.padded_rows(tokens x "
        "top_k, experts, 128)`: every expert that receives tokens adds at most 127 rows of padding, so "
        "`128 * floor((n + min(E, n) * 127) / 128)` rows hold any routing. The rows past `padded_bins[-1]` "
        "are zero (the gather writes them, no host read), and the gradient of the buffer has its rows "
        "(`padded_scatter`'s backward sizes it from its input, not from `padded_bins`).\n"
        "- `topology` is upstream's checks and `stk.Matrix`, with the six index tensors from "
        "`megablocks_ascend.ops.topology` (one launch on `ascend`: "
        "`megablocks_ascend/kernels/topology.py`) for as many block rows as the buffer has. The first "
        "`padded_bins[-1] / 128` block rows are the experts' (exactly upstream's topology); the others are "
        "spare: `offsets` gives them no blocks, so `offsets[-1]` is the number of live blocks, and the "
        "transposed metadata lists only the live ones. The block-sparse kernels "
        "(`megablocks_ascend/kernels/blocksparse.py`, and the `torch` backend's) take the live blocks from "
        "`offsets`: `sdd` writes the spare blocks as zeros without computing them, `dsd` and `dds` never "
        "visit them. stk's own matrices have no spare blocks, so nothing changes for them.\n"
        "- Memory: the buffer, the expert MLP's dense results and its block-sparse activations are at most "
        "`min(E, n) x 127` rows larger than upstream's (they were `padded_bins[-1]` rows); the work done "
        "on them is upstream's (no products for the spare rows; their zeros are written).\n"
        "- `MEGABLOCKS_ASCEND_SPARSE_SIZES=exact` keeps upstream's sizes (the sync, and no spare rows) for "
        "whoever needs the last bytes; a graph capture then stops with `megablocks_ascend.CaptureError` "
        "naming the call and the switch, raised before the read, so the capture is not left broken. "
        "`MEGABLOCKS_BACKEND=cuda` (upstream's kernels, which take no static size) always runs upstream's "
        "sizes and upstream's topology sequence (`backends.upstream_topology`).",
    upstream_fix="Size the padded buffer with the static bound and keep the real extent on the device: "
                 "`padded_gather` taking a row count, stk's kernels skipping the blocks past "
                 "`offsets[-1]`, and the topology with its transpose built in one kernel.",
    apply=apply,
)
