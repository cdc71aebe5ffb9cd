"""The benchmark harness: ``python -m megablocks_ascend bench`` and the scripts in ``benchmarks/``.

Modules, top-down:

``suite``            the ``bench`` command: routing ops, the routing preparation, torch_npu's fused
                     MoE ops (on an NPU) and layer steps, ours against every alternative the device
                     has, with the precision verdict; tables, JSON, PNG
``fused_npu``        torch_npu's ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` /
                     ``npu_moe_init_routing_v2`` mapped onto MegaBlocks' routing, as documented
``routing_table``    the routing benchmark's sections (``benchmarks/bench_routing.py``)
``steps``            the layer-step harness (``benchmarks/bench_steps.py``)
``routing_ops``      named shapes, one routing problem, minimal bytes, the implementations, the check
``launches``         one training step of MegaBlocks' layers, and what it launches
``blocksparse``      the block-sparse matmuls against dense, grouped and stk's own kernels
                     (``benchmarks/bench_blocksparse.py``)
``host_profile``     where an eager step's host time goes, per backend (``benchmarks/profile_host.py``)
``value_checks``     what ``MEGABLOCKS_ASCEND_CHECKS=1`` costs per call (``benchmarks/bench_checks.py``)
``expert_parallel_steps``  expert parallelism under ``torchrun``: parity, step, all-to-all and launch
                     figures per rank (``benchmarks/bench_expert_parallel.py``)
``expert_parallel``  the expert-parallel layer and the same layer in one process; the parity check
``layers``           MegaBlocks' layers as the step harnesses build them; the backend switch
``precision``        the precision verdict in the Ascend form (also used by ``selftest``), a
                     step's verdicts, the relative error against a reference
``instruments``      the launch counter and the host-sync detector (any device)
``timing``           device-generic timing: events, synchronisation, graph capture, the L2 flush,
                     a training step's times
``report``, ``plot`` log, environment, JSON; the PNG plots

Nothing in the runtime package imports from here.
"""
