"""Expert-model parallelism on two GPUs over NCCL: MegaBlocks' unchanged MoE and dMoE, through the
plugin with MEGABLOCKS_BACKEND=ascend (our kernels) and cuda (upstream's), each rank checked
against a one-process run of the same layer (``megablocks_ascend.bench.expert_parallel``, which
CI runs on CPU with gloo in tests/test_expert_parallel.py).

    python benchmarks/expert_parallel_check.py        # needs 2 CUDA devices
"""

import os
import sys

import torch
import torch.multiprocessing as mp

from megablocks_ascend.bench.expert_parallel import WORLD, rendezvous, worker


def main() -> int:
    if torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
    failures = 0
    for layer in ("moe", "dmoe"):
        for backend in ("ascend", "cuda"):
            try:
                mp.spawn(worker, args=(rendezvous(), layer, backend, "cuda", "nccl"), nprocs=WORLD, join=True)
                status = "ok"
            except Exception as e:  # noqa: BLE001 - report every combination
                status = f"FAIL: {e}"
                failures += 1
            print(f"expert parallel, {WORLD} ranks, nccl, {layer:4} backend={backend:6} -> {status}", flush=True)
    print(f"expert parallel checks: {4 - failures}/4 passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
