"""The ``routing-preparation`` patch (page: ``patches/routing-preparation.md``):
``ParallelMLP.indices_and_bins`` and ``ParallelDroplessMLP.indices_and_padded_bins`` prepare a step's
routing with ``megablocks_ascend.ops.prepare_routing`` (on ``ascend`` a two-launch counting sort that
also writes the route map of the layer's routing calls) instead of MegaBlocks' sort / histogram /
cumsum sequence; the patch checks the fingerprint of upstream's code.
"""

from __future__ import annotations

import torch

from megablocks_ascend.patching.registry import Patch, replace_followed


def route_for(layer, top_experts: torch.Tensor, *, padded: bool = False) -> tuple[int, int]:
    """``(route, capacity)``: the route map the routing calls after ``layer``'s preparation of
    ``top_experts`` will ask for (``kernels.preparation.NO_ROUTE`` when they ask for none), so the
    preparation writes it in the same launch.

    top_k == 1: none (those kernels walk the positions in one launch). ``padded``: the sparse dMoE's
    padded gather/scatter. The expert-parallel path gathers and scatters its local tokens
    dropless before and after the all-to-all, as dMoE's grouped path does; ``MoE`` alone uses the
    binned layout, with the capacity ``forward_once`` will compute (none when that is 0: the
    capacity then comes from the counts, after the preparation). A wrong guess costs only what a
    routing call without a prepared map costs: it computes its own."""
    from megablocks.layers.dmoe import ParallelDroplessMLP  # noqa: PLC0415
    from megablocks_ascend.kernels import preparation, routing  # noqa: PLC0415
    if layer.top_k == 1:
        return preparation.NO_ROUTE, 0
    if padded:
        return routing.PADDED, 0
    if layer.args.moe_expert_model_parallelism or isinstance(layer, ParallelDroplessMLP):
        return routing.DROPLESS, 0
    capacity = layer.expert_capacity(top_experts.numel() // layer.top_k)
    return (routing.BINNED, capacity) if capacity > 0 else (preparation.NO_ROUTE, 0)


def _indices_and_bins(self, top_expert):
    """``megablocks.layers.moe.ParallelMLP.indices_and_bins`` through the routing preparation
    (``megablocks_ascend.ops.prepare_routing``): the same ``(indices, bin_ids, bins,
    tokens_per_expert)`` as upstream's sort / histogram / cumsum, in two launches on ``ascend``,
    with the route map of the layer's routing calls."""
    from megablocks_ascend import ops  # noqa: PLC0415
    route, capacity = route_for(self, top_expert)
    indices, bin_ids, bins, tokens_per_expert, _ = ops.prepare_routing(top_expert, self.num_experts, 0, route,
                                                                       capacity)
    return indices, bin_ids, bins, tokens_per_expert


def _indices_and_padded_bins(self, top_experts):
    """``megablocks.layers.dmoe.ParallelDroplessMLP.indices_and_padded_bins`` through the routing
    preparation: the same ``(indices, bin_ids, bins, padded_bins, tokens_per_expert)`` as upstream's
    sort / histogram / round_up / cumsums, with the padded route map."""
    from megablocks_ascend import ops  # noqa: PLC0415
    route, _ = route_for(self, top_experts, padded=True)
    indices, bin_ids, bins, tokens_per_expert, padded_bins = ops.prepare_routing(
        top_experts, self.num_experts, self.blocking, route, 0)
    return indices, bin_ids, bins, padded_bins, tokens_per_expert


# The methods replaced: the fingerprint (registry.source_fingerprint) of MegaBlocks 0.10.0's code,
# and its parameters.
PREPARATION_METHODS = {
    "megablocks.layers.moe:ParallelMLP.indices_and_bins": (_indices_and_bins, "ce89f7d65adff247",
                                                          ("self", "top_expert")),
    "megablocks.layers.dmoe:ParallelDroplessMLP.indices_and_padded_bins": (
        _indices_and_padded_bins, "d077f149e389288d", ("self", "top_experts")),
}


def apply(p: Patch) -> None:
    for target, (replacement, fingerprint, params) in PREPARATION_METHODS.items():
        replace_followed(p, target, replacement, fingerprint, params)


PATCH = Patch(
    name="routing-preparation",
    targets=tuple(PREPARATION_METHODS),
    why="Before its routing calls, every MegaBlocks step turns the router's expert ids into the routing "
        "tensors: `ops.sort` (a radix sort: `bin_ids`, `indices`), `ops.histogram` (`tokens_per_expert`), "
        "`ops.inclusive_cumsum` (`bins`), and for the sparse dMoE `ops.round_up` and a second cumsum "
        "(`padded_bins`, which also feeds its block-sparse topology), plus an int32 cast of the ids. On an "
        "H200 that was a dozen or more kernels per step (the radix sort alone is several CUB kernels; with "
        "MegaBlocks' extension not built, the `megablocks_ops` stand-in's `torch.sort` and scatter-add); "
        "on an NPU each is a launch through torch_npu with its own host time. Our token-major routing "
        "kernels then inverted the sort in a launch of their own (the route map). A fine-grained MoE step "
        "is host-bound, so each launch counts.",
    how="Both methods are replaced by versions that call `megablocks_ascend.ops.prepare_routing` (a "
        "`torch.library` custom op while `torch.compile` traces), dispatched like the routing kernels by "
        "`MEGABLOCKS_BACKEND` and recorded by `trace()` as `prepare_routing`:",
    upstream_fix="A fused routing-preparation op in `megablocks.ops` (one counting sort of the expert ids "
                 "giving `indices`, `bin_ids`, `bins`, `tokens_per_expert` and the padded bins) that a "
                 "backend can provide, called by both methods.",
    apply=apply,
)
