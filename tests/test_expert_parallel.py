"""MegaBlocks' expert-model parallelism through the plugin: 2 gloo ranks vs one process.

Each rank holds half of the experts (``moe_expert_model_parallelism=True``); tokens travel between
ranks with ``all_to_all`` and are routed with ``ops.gather`` / ``ops.scatter`` / ``ops.replicate``
and the binned, dropless or padded ops (the last with stk's block-sparse matmuls: the sparse dMoE).
Every rank checks its output and gradients against the same layer with all experts in one process
(weights copied), run by the ``torch`` backend:

* outputs and input gradients must match;
* router gradients must match (they only see the rank's own tokens);
* expert weight gradients must equal the sum over ranks of the single-process gradients for the
  rank's experts, times MegaBlocks' ``1 / world_size`` expert-parallel gradient scale.

MoE runs with a capacity factor large enough that no token is dropped, because the capacity is
computed over all ranks' tokens in expert-parallel mode and per process otherwise.
"""

import pytest
import torch.multiprocessing as mp

from megablocks_ascend.bench.expert_parallel import WORLD, rendezvous, worker


@pytest.mark.parametrize("backend", ["ascend", "torch"])
@pytest.mark.parametrize("layer_kind", ["moe", "dmoe", "dmoe-sparse"])
def test_expert_parallel_matches_single_process(layer_kind, backend):
    mp.spawn(worker, args=(rendezvous(), layer_kind, backend), nprocs=WORLD, join=True)
