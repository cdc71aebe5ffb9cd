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
    why="The sparse dMoE reads padded_bins[-1] on the host to size its padded buffer (ops.padded_gather, "
        "in the forward and again in the backward), so the host waits for the router every step and the "
        "step cannot be captured in a CUDA or NPU graph; its topology is a dozen launches (ops.topology, "
        "stk.ops.row_indices, and a sort, gather, histogram, cumsum and concatenation for the transpose).",
    how="sparse_forward_once and sparse_permute_and_compute pass padded_gather a row count the host knows "
        "(ops.padded_rows: tokens x top_k plus at most block - 1 rows of padding per expert), whose rows past "
        "padded_bins[-1] are zero; topology builds stk's six index tensors for that many block rows in one "
        "launch (ops.topology), the block rows past padded_bins[-1] spare (no blocks: the block-sparse "
        "kernels skip them). MEGABLOCKS_ASCEND_SPARSE_SIZES=exact, and MEGABLOCKS_BACKEND=cuda, keep "
        "upstream's sizes. The rest of each method is upstream's code; the patch refuses to install over a "
        "changed upstream body.",
    upstream_fix="Size the padded buffer with a static bound and keep the real extent on the device "
                 "(padded_gather and stk's kernels reading it), and build the topology with its transpose "
                 "in one kernel.",
    apply=apply,
)
