"""The zero fill of empty weight-gradient groups (``megablocks_ascend.kernels.grouped.zero_empty_groups``).

Every test takes the ``device`` fixture: on CPU tensors the kernel runs in the Triton interpreter;
``MEGABLOCKS_ASCEND_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest tests/test_zero_fill.py``
runs it compiled on a GPU. Outputs are poisoned (random values and NaNs): the empty groups' blocks
must come out +0.0 everywhere and every other element bit for bit unchanged.
"""

from __future__ import annotations

import pytest
import torch

from megablocks_ascend.kernels import grouped

PATTERNS = {  # group sizes: which groups have no rows
    "first": [0, 5, 3, 4],
    "last": [5, 3, 4, 0],
    "several": [0, 4, 0, 0, 6, 0, 2],
    "all": [0, 0, 0],
    "none": [3, 5, 2],
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _poisoned(shape, dtype, device, seed=0):
    out = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out.view(-1)[::7] = float("nan")
    return out.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ends_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("mn,block,programs", [((4, 8), 16, None),     # 32 elements: 2 tiles per group
                                               ((5, 7), 16, 3),        # 35: a masked tail
                                               ((33, 31), 32, 1),      # 1023: several chunks, one program
                                               ((768, 40), None, None)])  # the device's own tile
def test_zero_fill_writes_the_empty_groups_and_nothing_else(device, dtype, ends_dtype, pattern, mn, block,
                                                              programs):
    sizes = PATTERNS[pattern]
    ends = torch.tensor(sizes).cumsum(0).to(ends_dtype).to(device)
    out = _poisoned((len(sizes), *mn), dtype, device)
    before = out.clone()
    assert grouped.zero_empty_groups(out, ends, block=block, num_programs=programs) is out
    for g, n in enumerate(sizes):
        if n == 0:
            assert torch.count_nonzero(_bits(out[g])) == 0, g       # +0.0 everywhere
        else:
            assert torch.equal(_bits(out[g]), _bits(before[g])), g  # not written (NaNs included)


def test_zero_fill_spaced_groups_and_int64_offsets(device):
    """Groups further apart than their blocks (only the blocks are written); the INT64 variant of
    the kernel (taken for tensors of 2**31 elements or more) computes the same."""
    base = _poisoned((3, 6, 4), torch.float32, device)
    view = base[:, 1:5]                                   # groups 24 elements apart, blocks of 16
    before = base.clone()
    grouped.zero_empty_groups(view, torch.tensor([0, 2, 2], device=device), block=16)
    assert torch.count_nonzero(base[0, 1:5]) == 0 and torch.count_nonzero(base[2, 1:5]) == 0
    for g, rows in ((0, [0, 5]), (1, range(6)), (2, [0, 5])):
        assert torch.equal(_bits(base[g, list(rows)]), _bits(before[g, list(rows)]))
    for int64 in (False, True):
        out = _poisoned((4, 5, 7), torch.float32, device)
        want = out.clone()
        want[[0, 2]] = 0
        grouped._zero_empty_groups[(2,)](out, torch.tensor([0, 3, 3, 9], device=device), 35, 35, 32, 8,
                                          INT64=int64, EVEN=False, BLOCK=16)
        assert torch.equal(_bits(out), _bits(want)), int64


def test_zero_fill_refuses_layouts_it_cannot_write_whole(device):
    out = torch.ones(3, 4, 8, device=device)
    before = out.clone()
    ends = torch.tensor([0, 2, 2], device=device)
    for bad_out, bad_ends, needle in [
            (out.transpose(1, 2), ends, "one contiguous block"),
            (out[:, :, ::2], ends, "one contiguous block"),
            (out, ends[:2], r"'ends' \[E\]"),
            (out[0], ends, r"\[E, M, N\]"),
            (out, ends.float(), "int32 or int64"),
            (out, ends.cpu() if device.type != "cpu" else ends.to("meta"), "int32 or int64 on")]:
        with pytest.raises(ValueError, match=needle):
            grouped.zero_empty_groups(bad_out, bad_ends)
    assert torch.equal(out, before)
