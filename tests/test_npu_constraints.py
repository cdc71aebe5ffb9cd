"""What triton-ascend is known to refuse or run slowly, checked on our kernels without an NPU.

* Every launch's grid stays within ``devices.MAX_PROGRAMS`` (65,536: triton-ascend refuses larger
  grids) up to a million tokens, top_k 8 and 1024 experts, on an NPU's and on CUDA's core counts:
  the launchers are run with recorders in place of the kernels, each grid read off its launch.
* No kernel casts to an unsigned 32-bit type (the compiler rejects uint32 casts).
* No int64 vector arithmetic in a hot loop: held by the census (tests/test_census.py; the gate fails
  a configuration with any), for every configuration the gate compiles.
"""

from __future__ import annotations

import pathlib
import re
import types

import pytest
import torch

from megablocks_ascend import devices
from megablocks_ascend.kernels import blocksparse, grouped, preparation, routing, routing_kernels

TOKENS, TOP_K, EXPERTS, HIDDEN = 1 << 20, 8, 1024, 16  # a narrow hidden keeps the buffers small


class _Grids:
    """Stands in for every Triton kernel of a module: records the grid of each launch."""

    def __init__(self, name, grids):
        self.name, self.grids = name, grids

    def launch(self, grid, *args, **kwargs):
        self.grids.append((self.name, tuple(grid)))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, *args, **kwargs)


@pytest.fixture(params=["npu", "cuda"])
def on_device(request, monkeypatch):
    """The launchers plan as on an NPU (48 vector and 24 cube cores) or an H200 (132 SMs)."""
    target = request.param
    real = devices.num_programs
    fake = types.SimpleNamespace(type=target, index=0)
    monkeypatch.delenv("MEGABLOCKS_ASCEND_NUM_PROGRAMS", raising=False)
    monkeypatch.setattr(devices, "_core_count", lambda kind, index: {"cuda": 132, "npu": 48}[kind])
    monkeypatch.setattr(devices, "_aicore_count", lambda index: 24)
    monkeypatch.setattr(devices, "num_programs", lambda device, work, **kw: real(fake, work, **kw))
    monkeypatch.setattr(devices, "target", lambda device: target)
    routing.clear_plans()
    yield target
    routing.clear_plans()


def _record(monkeypatch, module, grids):
    for name, value in vars(module).items():
        if type(value).__name__ == "Kernel":
            monkeypatch.setattr(module, name, _Grids(name, grids))


def test_every_grid_is_within_the_npu_limit_at_a_million_tokens(on_device, monkeypatch):
    grids = []
    for module in (routing_kernels, preparation, grouped):
        _record(monkeypatch, module, grids)
    n = TOKENS * TOP_K
    x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
    y = torch.empty(n, HIDDEN, dtype=torch.bfloat16)
    w = torch.empty(n, dtype=torch.bfloat16)
    indices = torch.empty(n, dtype=torch.int32)
    bins = torch.linspace(n // EXPERTS, n, EXPERTS).int()
    s2r = torch.empty(n, dtype=torch.int32)
    for layout in (routing.DROPLESS, routing.PADDED, routing.BINNED):
        for launcher in (routing.gather_rows, routing.gather_tokens_rows):
            launcher(x, indices, bins, bins, w, layout=layout, num_rows=n, top_k=TOP_K, capacity=n // EXPERTS)
        routing.scatter_one_rows(y, indices, bins, bins, w, layout=layout, capacity=n // EXPERTS)
        routing.wgrad_one_rows(y, y, indices, bins, bins, layout=layout, capacity=n // EXPERTS)
        routing.route_map(indices, bins, bins if layout == routing.PADDED else None, layout=layout,
                          capacity=n // EXPERTS)
    routing.scatter_rows(y, s2r, w, num_tokens=TOKENS, top_k=TOP_K)
    routing.wgrad_rows(y, x, s2r, top_k=TOP_K)
    preparation.prepare_routing(torch.empty(TOKENS, TOP_K, dtype=torch.int64), EXPERTS, 128, routing.PADDED)
    grouped.zero_empty_groups(torch.empty(EXPERTS, 64, HIDDEN), torch.arange(EXPERTS, dtype=torch.int64))
    launched = {name for name, _ in grids}
    assert {"_gather", "_gather_tokens", "_scatter", "_scatter_one", "_wgrad", "_wgrad_one", "_route_map",
            "_count", "_place", "_zero_empty_groups"} <= launched
    worst = max(grids, key=lambda g: g[1][0])
    assert worst[1][0] <= devices.MAX_PROGRAMS, worst
    # one program per core on an NPU (48 here), a few per SM on CUDA: never one per row
    assert worst[1][0] <= (48 if on_device == "npu" else 132 * devices.CUDA_PROGRAMS_PER_SM), worst


def test_the_block_sparse_grid_is_within_the_limit(on_device):
    tile = devices.cube_tile("dsd", torch.bfloat16, 128, 4096, on_device)
    work = (TOKENS // 128) * (EXPERTS * 16)  # every block of a dense dMoE topology, as tiles
    assert blocksparse._grid(torch.device("cpu"), work, tile, None)[0] <= min(devices.MAX_PROGRAMS,
                                                                              132 * devices.CUDA_PROGRAMS_PER_SM)


def test_no_override_makes_a_grid_larger_than_the_limit(monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_ASCEND_NUM_PROGRAMS", str(10**6))
    assert devices.num_programs(torch.device("cpu"), 10**9) == devices.MAX_PROGRAMS


def test_no_kernel_casts_to_uint32():
    kernels = pathlib.Path(routing.__file__).parent
    hits = [f"{p.name}:{i}" for p in sorted(kernels.glob("*.py")) for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\buint32\b|\bu32\b", line)]
    assert not hits, hits
