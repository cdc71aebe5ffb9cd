"""Device facts and the tile budget: how many programs a kernel launches and how big its tiles are.

Everything that depends on the hardware is decided here, in one place.

Targets
-------
``npu``          an Ascend NPU through triton-ascend. One program per vector core
                 (``num_vectorcore`` from triton-ascend's driver); a grid much larger than
                 the core count would run in batches. Tiles are sized to the Unified Buffer.
``cuda``         an NVIDIA GPU through standard Triton. Several programs per SM so that
                 enough loads are in flight to saturate HBM; tiles sized for registers.
``interpreter``  CPU tensors, run by the Triton interpreter. A few programs (so the
                 multi-program paths are exercised) and large tiles (the interpreter's cost
                 is per tile operation, not per element).

The Unified Buffer budget (``npu``)
-----------------------------------
An A2-class vector core (Ascend 910B) has a 192 KiB Unified Buffer (UB). triton-ascend
double-buffers loads, so every live buffer is counted twice. For a kernel that holds
``BLOCK_M`` rows of ``BLOCK_X`` features, the live bytes are::

    2 * BLOCK_M * (BLOCK_X * bytes_per_element + bytes_per_row)  <=  UB_BYTES - UB_RESERVE

``bytes_per_element`` counts every tile-sized buffer of the kernel (see ``_TILE_BYTES``):
the loaded tile in its own dtype, float32 copies for scaling or accumulation, and the
tile cast back for the store. ``bytes_per_row`` counts the per-row vectors: the
assignment slot or expert row (int32), the token (int32), the router weight (float32),
and the row offset (int64). ``BLOCK_X`` is a power of two (``tl.arange`` requires it) and
at least 32 bytes of the element type (one UB block: 16 bf16/fp16 or 8 fp32 elements).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megablocks_ascend import envs

UB_BYTES = 192 * 1024  # A2 (910B) vector core Unified Buffer
UB_RESERVE = 16 * 1024  # left to the compiler's own temporaries
UB_BUFFERS = 2  # double buffering
UB_BLOCK_BYTES = 32  # UB alignment unit

# Tile-sized live buffers per element, as (multiple of the element size, extra float32 copies).
_TILE_BYTES = {
    # load tile (dtype) -> float32 scaled copy -> tile cast back (dtype)
    "gather": (2, 1),
    # load tile (dtype) -> float32 copy, float32 accumulator, accumulator cast back (dtype)
    "scatter": (2, 2),
    # two loaded tiles (dtype), their float32 copies, float32 product accumulator
    "wgrad": (2, 3),
    # the same kernel walking the experts' positions (top_k = 1, binned or padded): the rows of
    # a sub-block share one expert lookup, so on CUDA it takes more, narrower rows (see tile())
    "wgrad_walk": (2, 3),
}
_ROW_BYTES = 4 + 4 + 4 + 8  # slot/row int32, token int32, weight float32, row offset int64

CUDA_PROGRAMS_PER_SM = 16  # 16 programs x 4 warps: a full SM (64 warps); see docs/notes/h200-speed.md
INTERPRETER_PROGRAMS = 4


@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int  # rows (sorted positions, buffer rows or tokens) per sub-block
    block_x: int  # features per tile
    num_warps: int = 4  # CUDA only; ignored by triton-ascend and the interpreter


def target(device: torch.device) -> str:
    if device.type == "cpu":
        return "interpreter"
    if device.type in ("cuda", "npu"):
        return device.type
    raise ValueError(f"no Triton target for device {device}: expected cpu, cuda or npu tensors")


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def block_e(num_experts: int) -> int:
    """Width of the kernels' per-expert vectors (``BLOCK_E``): a power of two, at least 2."""
    return max(_next_pow2(max(num_experts, 1)), 2)


@functools.lru_cache(maxsize=None)
def _core_count(device_type: str, index: int) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    if device_type == "npu":
        import triton  # noqa: PLC0415
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["num_vectorcore"])
    raise ValueError(device_type)


def capturing(device: torch.device) -> bool:
    """Whether a graph is being captured on ``device``'s current stream (``torch.cuda.graph``,
    ``torch.npu.graph``, CUDA-graph trees under ``torch.compile(mode="reduce-overhead")``). On an
    NPU whose torch_npu has no such query the answer is True: callers then keep nothing across a
    possible capture boundary, which is always safe."""
    if device.type == "cuda":
        return torch.cuda.is_current_stream_capturing()
    if device.type == "npu":
        query = getattr(getattr(torch, "npu", None), "is_current_stream_capturing", None)
        return True if query is None else bool(query())
    return False


def num_programs(device: torch.device, work_items: int) -> int:
    """The 1-D grid: programs loop over ``work_items`` sub-blocks inside."""
    override = envs.num_programs_override()
    if override is not None:
        n = override
    elif device.type == "cpu":
        n = INTERPRETER_PROGRAMS
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        n = _core_count("cuda", index) * CUDA_PROGRAMS_PER_SM
    elif device.type == "npu":
        index = device.index if device.index is not None else torch.npu.current_device()
        n = _core_count("npu", index)
    else:
        raise ValueError(f"no Triton target for device {device}")
    return max(1, min(n, work_items))


def ub_bytes(kind: str, block_m: int, block_x: int, element_size: int) -> int:
    """UB bytes one program of ``kind`` keeps live, double buffering included."""
    dtype_copies, f32_copies = _TILE_BYTES[kind]
    per_element = dtype_copies * element_size + 4 * f32_copies
    return UB_BUFFERS * block_m * (block_x * per_element + _ROW_BYTES)


@functools.lru_cache(maxsize=4096)  # called on every launch; a pure function of its arguments
def tile(kind: str, dtype: torch.dtype, hidden: int, device_target: str) -> Tile:
    """Sub-block rows and feature-tile width for a kernel of ``kind`` on ``device_target``."""
    if kind not in _TILE_BYTES:
        raise ValueError(f"unknown kernel kind {kind!r}")
    es = dtype.itemsize  # (not torch.empty(...).element_size(): this runs on every launch)
    min_x = max(UB_BLOCK_BYTES // es, 1)
    hidden_pow2 = max(_next_pow2(hidden), min_x)
    if device_target == "npu":
        block_x = min(hidden_pow2, 512)
        budget = UB_BYTES - UB_RESERVE
        block_m = 1
        while block_m < 64 and ub_bytes(kind, block_m * 2, block_x, es) <= budget:
            block_m *= 2
        return Tile(block_m, block_x)
    if device_target == "cuda":
        block_x = min(hidden_pow2, 16 * 128 // es)  # one 16-byte vector per thread of 4 warps
        # One row per sub-block for the kernels that hold float32 copies (scatter: top_k tiles and
        # an accumulator; wgrad: two tiles and a product): fewer registers, so more programs per
        # SM keep loads in flight. The gather keeps 4 rows (its padding-zeroing loop walks rows).
        # The weight gradient over an expert walk takes 4 rows of 256: its per-sub-block expert
        # lookup (a few cross-warp reductions) would otherwise cost as much as a row's dot product.
        # Measured on an H200: docs/notes/h200-speed.md.
        if kind == "wgrad_walk":
            return Tile(4, min(hidden_pow2, 256), num_warps=4)
        return Tile(4 if kind == "gather" else 1, block_x, num_warps=4)
    if device_target == "interpreter":
        return Tile(64, min(hidden_pow2, 256))
    raise ValueError(f"unknown target {device_target!r}")
