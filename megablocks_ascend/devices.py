"""Device facts and the tile budget: how many programs a kernel launches and how big its tiles are.

One idea: every hardware number the kernels use (grids, tiles, on-chip budgets, the forms each target
runs) is decided here and nowhere else, so this module is as long as the kinds of kernels need.

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
An A2/A3 vector core (Ascend 910B, 910_93) has a 192 KiB Unified Buffer (UB). How many bytes of it
a routing kernel's program takes is decided by the back-end compiler, ``bishengir-compile``: its
memory planner places every buffer (the tiles, their double-buffered copies, masks, float32 copies
and accumulators, index vectors, its own temporaries) at an offset in the UB. The model here,
:func:`ub_bytes`, is calibrated on those plans (``python -m megablocks_ascend lower`` reads each
configuration's plan; ``docs/notes/ascend-backend.md``) and is an **upper bound** of them::

    ub_bytes = UB_BUFFERS * ( BLOCK_M * BLOCK_X * per_element      (the [BLOCK_M, BLOCK_X] tiles)
                            + BLOCK_M * (per_row + 4 * BLOCK_E * per_row_expert)
                            + BLOCK_X * 4 * top_k * per_column )    (column vectors, per unrolled k)
               + fixed
    per_element = es * dtype_copies + 4 * f32_copies + (0 if hidden % BLOCK_X == 0 else masks)
                  + (top_k - 1) * (es * dtype_copies_k + 4 * f32_copies_k)

with one set of coefficients per kernel kind (:data:`UB_MODELS`), ``es`` the element size and
``BLOCK_E`` the experts rounded up to a power of two. The coefficients are not a count of buffers
(the planner shares offsets between buffers whose lives do not overlap, and unrolls ``top_k``):
they are the least a linear model of these terms needs to stay at or above every plan recorded in
``tests/data/ascend_memory_plans.json``, rounded up. Two checks hold it: a CI test compares the
model with every recorded plan and checks that the recorded tiles are the ones :func:`tile` picks
today, and the compile gate compares it with the plan of every configuration it compiles, on
every CI run (a shortfall fails the gate). A tile is the largest power-of-two ``BLOCK_M`` (at most
64) whose model fits ``UB_BYTES - UB_RESERVE``; the reserve is a margin for other compiler
versions, whose plans can differ. ``BLOCK_X`` is a power of two (``tl.arange`` requires it), at
most 512 and at least 32 bytes of the element type (one UB block: 16 bf16/fp16 or 8 fp32).

The cube budget (``npu``, the block-sparse matmuls)
---------------------------------------------------
The block-sparse kernels (``kernels/blocksparse.py``) are cube kernels: their work is ``tl.dot``,
which triton-ascend runs on the AI (cube) cores, so they launch one program per AI core
(``num_aicore``, half the vector cores on A2), each looping over its output tiles. A tile
``(BLOCK_M, BLOCK_N)`` is accumulated in float32 over K-steps of ``BLOCK_K``; per program::

    L0A  2 * BLOCK_M * BLOCK_K * es         <= 64 KiB   (the A slice, ping-pong)
    L0B  2 * BLOCK_K * BLOCK_N * es         <= 64 KiB   (the B slice, ping-pong)
    L0C  BLOCK_M * BLOCK_N * 4              <= 128 KiB  (the float32 accumulator)
    L1   2 * (BLOCK_M + BLOCK_N) * BLOCK_K * es <= 512 KiB  (both tiles, double-buffered)

(``es``: bytes per element of the operands.) Within that budget the tile maximises the work per
element brought from global memory, ``BLOCK_M * BLOCK_N / (BLOCK_M + BLOCK_N)``, then ``BLOCK_K``;
sides are powers of two of at least 16 (the cube's 16 x 16 fractal), and a side that lies inside a
sparse block is at most the block size. bf16 at block size 128 gives sdd ``128 x 128 x 128``
(L0A/L0B 64 KiB each, L0C 64 KiB, L1 128 KiB) and dsd ``128 x 256 x 64`` (L0A 32 KiB, L0B 64 KiB,
L0C 128 KiB, L1 96 KiB). Where the numbers come from: the L1/L0A/L0B/L0C capacities of an A2 AI
core are those of ``struct AtlasA2`` in CANN's CATLASS templates (``include/catlass/arch/arch.hpp``:
L1 512 KiB, L0A 64 KiB, L0B 64 KiB, L0C 128 KiB, UB 192 KiB); triton-ascend's programming guide
("Cube Operator Development") asks for tiles within the hardware's L1/UB limits, fp32
accumulation, a K loop that the compiler multi-buffers (on by default, hence the factor 2) and a
grid of the physical cube-core count with programs looping over tiles; its general page gives the
192 KiB on-chip buffer and the ``num_aicore`` / ``num_vectorcore`` driver properties. The guide
itself does not list the L0/L1 sizes. How the compiler splits a tile between L1 and L0 is its own
choice; the budget keeps each K-step's slices within L0 so it need not split them further.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from megablocks_ascend import envs

UB_BYTES = 192 * 1024  # A2 (910B) vector core Unified Buffer
UB_RESERVE = 16 * 1024  # left to the compiler's own temporaries
UB_BUFFERS = 2  # double buffering
UB_BLOCK_BYTES = 32  # UB alignment unit

@dataclasses.dataclass(frozen=True)
class UbModel:
    """Coefficients of :func:`ub_bytes` for one kernel kind (see the module docstring)."""
    dtype_copies: float  # tile bytes per element, in units of the element size
    f32_copies: float  # ... in float32 units
    masks: float  # bytes per element added when the last feature tile is partial (EVEN_X false)
    dtype_copies_k: float  # per top_k beyond the first (top_k unrolled: tl.static_range)
    f32_copies_k: float
    per_row: float  # bytes per row of the sub-block
    per_row_expert: float  # int32 words per row per BLOCK_E (the walks' per-expert vectors, CUDA's forms)
    per_column: float  # int32 words per feature column per top_k (column offsets and masks)
    fixed: int  # bytes per program (scalars, BLOCK_E vectors, the compiler's own)


# Calibrated on bishengir-compile 1.2.0's plans for triton-ascend 3.2.0's IR (A2 and A3 targets):
# the least coefficients (a linear program over every recorded plan of the kind's kernels) under
# which the model bounds them all, rounded up, and 2 KiB more in the fixed part as a margin. Kinds
# and their kernels: gather (_gather), gather_tokens (_gather_tokens), scatter (_scatter),
# scatter_one (_scatter_one), wgrad (_wgrad, _wgrad_one; wgrad_walk is the same kernel walking
# experts). gather and scatter as fitted on 2026-12-01; wgrad, gather_tokens and scatter_one refitted
# on 2026-12-02 after the census's kernel changes (docs/notes/npu-census.md). docs/notes/ascend-backend.md
# has the data and how to refit.
UB_MODELS = {
    #                 dtype   f32     masks   dtype/k f32/k   row  row/E  col/k  fixed
    # gather: since the row map (2026-12-04, docs/notes/many-experts.md) the kernel has no per-row
    # search over the experts; its per-row term is the fitted one at 8 experts (192 + 4 * 8 * 8.125),
    # so its tiles are the ones it had at 8 experts, now at every expert count.
    "gather": UbModel(0.5, 1.5625, 1.5, 0.0, 0.0, 452, 0.0, 1.25, 9 * 1024),
    "scatter": UbModel(0.5, 2.0, 3.1875, 0.5625, 2.125, 496, 0.0, 0.0, 13 * 1024),
    "wgrad": UbModel(1.0625, 3.0, 1.9375, 0.0, 0.0, 0, 2.75, 0.25, 25 * 1024),
    # The kernels of the scattered-store form (STORES: CUDA's; an NPU runs them only when
    # MEGABLOCKS_ASCEND_STORES asks), each a kind of its own so that their plans, which grow where a
    # select keeps their scaling off the per-row store loop, do not shrink the tiles of the kernels
    # an NPU runs: the token-major gather, the position-major top_k-1 scatter.
    "gather_tokens": UbModel(1.6875, 0.0, 1.5625, 0.375, 0.0, 192, 1.125, 0.5, 103 * 1024),
    "scatter_one": UbModel(1.5, 1.125, 1.5, 0.0, 0.0, 0, 3.25, 0.625, 15 * 1024),
}
UB_MODELS["wgrad_walk"] = UB_MODELS["wgrad"]

# The most programs one launch may have: triton-ascend refuses grids past 65,536 (seen in public
# ports of Triton MoE kernels to Ascend); the kernels loop over their work inside, so no launch needs
# more (tests/test_npu_constraints.py holds every launcher to it at 1M tokens and 1024 experts).
MAX_PROGRAMS = 65536
CUDA_PROGRAMS_PER_SM = 16  # 16 programs x 4 warps: a full SM (64 warps); see docs/notes/h200-speed.md
INTERPRETER_PROGRAMS = 4


@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int  # rows (sorted positions, buffer rows or tokens) per sub-block
    block_x: int  # features per tile
    num_warps: int = 4  # CUDA only; ignored by triton-ascend and the interpreter


class DeviceUnavailable(ValueError):
    """A device named on a command line that this machine cannot give (its message says what to do)."""


def no_npu_help() -> str:
    """What an NPU needs, for the errors that say it is missing."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return (f"an Ascend NPU needs torch_npu (its release for this torch: torch-npu {release}.*) and Huawei's "
            "CANN, whose set_env.sh must be sourced before Python starts; `python -m megablocks_ascend doctor` "
            "says what this machine has")


def requested(name: str, argument: str = "--device") -> torch.device:
    """The device a user named (``--device npu``, ``cuda:1``, ``cpu``), checked before anything
    runs on it: a malformed name, an NPU without a working torch_npu (torch itself only says
    "Expected one of cpu, cuda, ... device type at start of device string: npu") or a device type
    this machine does not have raises :class:`DeviceUnavailable`, which names ``argument``, what
    is missing and, for an NPU, torch_npu, CANN and ``doctor``."""
    text = str(name).strip()
    kind = text.partition(":")[0].lower()
    npu = getattr(torch, "npu", None)
    if kind == "npu" and npu is None:
        import importlib.util  # noqa: PLC0415
        why = ("torch_npu is installed but was not imported (megablocks-ascend imports it when it activates)"
               if importlib.util.find_spec("torch_npu") is not None else "torch_npu is not installed")
        raise DeviceUnavailable(f"{argument} {text}: {why}, so torch has no npu device; {no_npu_help()}")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise DeviceUnavailable(f"{argument} {text!r} is not a device: expected cpu, cuda[:N] or npu[:N] "
                                f"(torch: {e})") from e
    if device.type == "npu" and not npu.is_available():
        raise DeviceUnavailable(f"{argument} {text}: torch_npu is imported but sees no NPU (torch.npu.is_available() "
                                f"is False: CANN's environment or the NPU driver); {no_npu_help()}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(f"{argument} {text}: this torch sees no CUDA device (torch.cuda.is_available() is "
                                "False); `python -m megablocks_ascend doctor` says what this machine has")
    for module in (("npu", npu), ("cuda", torch.cuda)):
        if device.type == module[0] and device.index is not None and device.index >= module[1].device_count():
            raise DeviceUnavailable(f"{argument} {text}: this machine has {module[1].device_count()} {module[0]} "
                                    f"device(s) (indices from 0)")
    return device


def target(device: torch.device) -> str:
    if device.type == "cpu":
        return "interpreter"
    if device.type in ("cuda", "npu"):
        return device.type
    raise ValueError(f"no Triton target for device {device}: expected cpu, cuda or npu tensors")


# The form of the routing kernels each target runs (kernels/routing_kernels.py; MEGABLOCKS_ASCEND_STORES
# overrides it). Census of the planned modules (bishengir-compile 1.2.0, bf16, hidden 1024, per row;
# docs/notes/npu-census.md): the token-major gather stores each token row to its top_k data-dependent
# rows, 2.1 pipe_barrier[MTE3] per row at top_k 2 (stores one at a time, each waiting for the last),
# against 0.13 for the buffer-row-major gather, which gathers on load and stores whole sub-blocks;
# the position-major top_k-1 scatter and weight gradient store to data-dependent rows and elements
# (2.0 and 1.0 MTE3 barriers per row) where the token- and slot-major ones store contiguously
# (0.13). On CUDA the scattered forms are the faster ones (an H200: the token-major gather reads
# each token row once, 2.5 -> 3.4 TB/s at fine-grained shapes; the one-launch top_k-1 forms save
# the route map): docs/notes/h200-speed.md. The interpreter (CPU tensors, CI) runs the NPU's forms.
STORES = {"npu": "contiguous", "cuda": "scattered", "interpreter": "contiguous"}


# The routing preparation's form (kernels/preparation.py, NPU_FORM): on an NPU it scans along a
# tile's first axis and through kernels/scan.py (elsewhere a scan is a scalar loop there) and writes
# bin_ids in position order; CUDA keeps warp-level scans along the last axis and stores bin_ids with
# indices (on an H200 the NPU's form made the preparation 1.1-1.5x slower: docs/notes/npu-census.md).
# The interpreter runs the NPU's; not switched by MEGABLOCKS_ASCEND_STORES.
PREP_NPU_FORM = {"npu": True, "cuda": False, "interpreter": True}


# How the contiguous-store form's kernels load the rows they gather (kernels/routing_kernels.py, SELECT;
# MEGABLOCKS_ASCEND_ROW_LOADS overrides it), per kernel kind: "masked", a 2-D tile load whose row
# offsets come from an index vector, or "select", triton-ascend's index_select_simd builtin (on an NPU;
# the interpreter runs its documented semantics in plain Triton). Chosen for the NPU from the compile
# gate's census of both forms (docs/notes/many-experts.md); the interpreter runs the NPU's choice;
# CUDA keeps its masked loads. Either form applies only where rows are int32-addressed and the
# feature tiles are whole (the builtin, as triton-ascend 3.2.0 lowers it, reads BLOCK_X columns of
# every row, past the end of a row in a partial last tile).
ROW_LOADS = {
    "npu": {"gather": "masked", "scatter": "masked", "wgrad": "masked"},
    "cuda": {"gather": "masked", "scatter": "masked", "wgrad": "masked"},
}
ROW_LOADS["interpreter"] = ROW_LOADS["npu"]


def row_select(device: torch.device, kind: str) -> bool:
    """Whether kernel ``kind`` on ``device`` loads its gathered rows with ``index_select_simd``
    (:data:`ROW_LOADS`), before the launcher's own conditions (int32 offsets, whole feature tiles)."""
    choice = envs.row_loads()
    if choice == "auto":
        choice = ROW_LOADS[target(device)][kind]
    return choice == "select"


def contiguous_stores(device: torch.device) -> bool:
    """Whether the routing kernels on ``device`` take the contiguous-store form (see :data:`STORES`)."""
    choice = envs.stores()
    if choice == "auto":
        choice = STORES[target(device)]
    return choice == "contiguous"


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def block_k(top_k: int) -> int:
    """Width of the token-major scatter's slot axis (``BLOCK_K``): ``top_k`` to a power of two."""
    return _next_pow2(max(int(top_k), 1))


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


@functools.lru_cache(maxsize=None)
def _aicore_count(index: int) -> int:
    """Cube cores (AI cores) of an NPU: triton-ascend's ``num_aicore`` (half its vector cores on A2)."""
    import triton  # noqa: PLC0415
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return int(props["num_aicore"])


def num_programs(device: torch.device, work_items: int, *, unit: str = "vector",
                 programs_per_sm: int = CUDA_PROGRAMS_PER_SM) -> int:
    """The 1-D grid: programs loop over ``work_items`` sub-blocks (or tiles) inside.

    ``unit`` is the NPU core a program runs on: ``"vector"`` (the routing kernels: one program
    per vector core) or ``"cube"`` (the block-sparse matmuls, whose ``tl.dot`` runs on the cube
    cores: one program per AI core, ``num_aicore``). On CUDA a kernel asks for
    ``programs_per_sm`` programs per SM.
    """
    if unit not in ("vector", "cube"):
        raise ValueError(f"unknown core unit {unit!r}: expected 'vector' or 'cube'")
    override = envs.num_programs_override()
    if override is not None:
        n = override
    elif device.type == "cpu":
        n = INTERPRETER_PROGRAMS
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        n = _core_count("cuda", index) * programs_per_sm
    elif device.type == "npu":
        index = device.index if device.index is not None else torch.npu.current_device()
        n = _aicore_count(index) if unit == "cube" else _core_count("npu", index)
    else:
        raise ValueError(f"no Triton target for device {device}")
    return max(1, min(n, work_items, MAX_PROGRAMS))


def ub_bytes(kind: str, block_m: int, block_x: int, element_size: int, *, even: bool = True,
             top_k: int = 1, block_e: int = 2) -> int:
    """UB bytes one program of ``kind`` takes, double buffering and the compiler's own buffers
    included: an upper bound of bishengir-compile's plan (module docstring). ``even``: the feature
    size is a multiple of ``block_x``; ``top_k``: slots per token; ``block_e``: ``block_e(experts)``."""
    m = UB_MODELS[kind]
    per_element = (element_size * m.dtype_copies + 4 * m.f32_copies + (0 if even else m.masks)
                   + (top_k - 1) * (element_size * m.dtype_copies_k + 4 * m.f32_copies_k))
    live = (block_m * block_x * per_element + block_m * (m.per_row + 4 * block_e * m.per_row_expert)
            + block_x * 4 * top_k * m.per_column)
    total = math.ceil(UB_BUFFERS * live) + m.fixed
    return -(-total // UB_BLOCK_BYTES) * UB_BLOCK_BYTES


@functools.lru_cache(maxsize=4096)  # called on every launch; a pure function of its arguments
def tile(kind: str, dtype: torch.dtype, hidden: int, device_target: str, *, top_k: int = 1,
         num_experts: int = 1) -> Tile:
    """Sub-block rows and feature-tile width for a kernel of ``kind`` on ``device_target``.

    On an NPU the rows are the most the Unified Buffer model allows (:func:`ub_bytes`), which
    grows with ``top_k`` (the scatter and the token-major gather unroll their top_k slots) and, for
    the kernels an NPU runs only on request (``devices.STORES``), ``num_experts`` (their walks'
    per-expert vectors); other targets ignore both."""
    if kind not in UB_MODELS:
        raise ValueError(f"unknown kernel kind {kind!r}")
    es = dtype.itemsize  # (not torch.empty(...).element_size(): this runs on every launch)
    min_x = max(UB_BLOCK_BYTES // es, 1)
    hidden_pow2 = max(_next_pow2(hidden), min_x)
    if device_target == "npu":
        budget = UB_BYTES - UB_RESERVE

        def rows(block_x: int) -> int:
            fits = functools.partial(ub_bytes, kind, block_x=block_x, element_size=es,
                                     even=hidden % block_x == 0, top_k=max(int(top_k), 1),
                                     block_e=block_e(num_experts))
            block_m = 1
            while block_m < 64 and fits(block_m * 2) <= budget:
                block_m *= 2
            return block_m

        block_x = min(hidden_pow2, 512)
        block_m = rows(block_x)
        # A sub-block of one row pays the sub-block's own costs (its index loads and the
        # scalar<->vector handshakes around them) on every row: a narrower feature tile buys a
        # second row (the flat scatter at top_k 8 in float32; docs/notes/npu-census.md).
        while block_m == 1 and block_x > 128:
            block_x //= 2
            block_m = rows(block_x)
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
        return Tile(4 if kind in ("gather", "gather_tokens", "scatter_one") else 1, block_x, num_warps=4)
    if device_target == "interpreter":
        return Tile(64, min(hidden_pow2, 256))
    raise ValueError(f"unknown target {device_target!r}")


# --------------------------------------------------------------------------------------------
# The zero fill of empty groups (kernels/grouped.py): one zero tile of BLOCK elements is the only
# live buffer, stored, never loaded. On an NPU 2 * BLOCK * bytes (double buffering) of UB: 64 KiB
# at float32, well inside the budget; on CUDA one 16-byte vector per thread of 4 warps, 8 times.

FILL_BLOCKS = {"npu": 8192, "cuda": 4096, "interpreter": 4096}  # elements per zero tile
FILL_CHUNK_BLOCKS = 16  # tiles per work item: an empty group's zeros are spread over many programs


def fill_block(dtype: torch.dtype, device_target: str) -> int:
    """Elements per zero tile of the empty-group fill on ``device_target``."""
    if device_target not in FILL_BLOCKS:
        raise ValueError(f"unknown target {device_target!r}")
    return FILL_BLOCKS[device_target]


def fill_ub_bytes(block: int, element_size: int) -> int:
    """UB bytes one program of the empty-group fill keeps live (the zero tile, double-buffered)."""
    return UB_BUFFERS * block * element_size


@functools.lru_cache(maxsize=None)
def npu_product(index: int) -> str:
    """The NPU's product name as torch_npu reports it (e.g. ``Ascend910B4`` for an Atlas A2
    training card, ``Ascend910_9391`` for A3, ``Ascend310P3`` for an Atlas inference card)."""
    return str(torch.npu.get_device_name(index))


def is_atlas_a2(device: torch.device) -> bool:
    """Whether ``device`` is an Atlas A2 training-series NPU (Ascend 910B): the product line that
    torch_npu's ``npu_grouped_matmul`` documentation lists float32 operands for."""
    if device.type != "npu":
        return False
    index = device.index if device.index is not None else torch.npu.current_device()
    return npu_product(index).startswith("Ascend910B")


# The routing preparation (kernels/preparation.py): a counting sort of expert ids. Its work tiles are
# [BLOCK_E, BLOCK_M] (which of BLOCK_E keys each of BLOCK_M items has, float32), with BLOCK_E the next
# power of two of the number of keys. On an NPU, bishengir-compile plans ~120-130 KiB of the 192 KiB
# Unified Buffer for 4096-element tiles at 8 to 256 experts and ~185 KiB at 1024, where the per-key
# vectors dominate (docs/notes/routing-preparation.md). On CUDA 4096 elements are 32 per thread of 4
# warps per tile. The interpreter's cost is per tile operation.

MAX_PREP_KEYS = 1024  # experts (or sort keys) the counting sort takes; BLOCK_E up to this
PREP_TILE_ELEMENTS = {"npu": 4096, "cuda": 4096, "interpreter": 16384}
PREP_MAX_BLOCK_M = 1024
# The count (_count, NPU form) compares its block's keys with CHUNK keys at a time, so that its block
# of items is PREP_TILE_ELEMENTS / CHUNK at every key count (at 256 experts a [BLOCK_M, BLOCK_E] one-hot
# of 4096 elements had 16 items a block, and the block's own costs grew 32x per item:
# docs/notes/many-experts.md). 8 float32 keys are one 32-byte UB block; the interpreter's cost is per
# tile operation, so it takes wider chunks. CUDA keeps its one-hot over every key (None).
PREP_KEY_CHUNK = {"npu": 8, "cuda": None, "interpreter": 64}


@dataclasses.dataclass(frozen=True)
class PrepTile:
    block_m: int  # items per block of the walk (a power of two, at least 2: Triton 3.3.1's interpreter
    # cannot scan a block of one)
    num_warps: int = 4  # CUDA only
    count_block_m: int | None = None  # the count's items per block (NPU form; None: block_m)
    key_chunk: int | None = None  # the count's keys per compare (NPU form; None: every key at once)


@functools.lru_cache(maxsize=1024)
def prep_tile(num_keys: int, device_target: str) -> PrepTile:
    """The routing preparation's block of items for ``num_keys`` keys on ``device_target``."""
    if device_target not in PREP_TILE_ELEMENTS:
        raise ValueError(f"unknown target {device_target!r}")
    if not 1 <= num_keys <= MAX_PREP_KEYS:
        raise ValueError(f"the routing preparation takes 1 to {MAX_PREP_KEYS} keys, not {num_keys}")
    elements = PREP_TILE_ELEMENTS[device_target]
    block_m = min(max(elements // block_e(num_keys), 2), PREP_MAX_BLOCK_M)
    chunk = PREP_KEY_CHUNK[device_target]
    if chunk is None:
        return PrepTile(block_m)
    chunk = min(chunk, block_e(num_keys))
    return PrepTile(block_m, count_block_m=min(max(elements // chunk, 2), PREP_MAX_BLOCK_M), key_chunk=chunk)


def prep_count_tile(tile: PrepTile, block_e_: int) -> tuple[int, int]:
    """``(BLOCK_M, CHUNK)`` of the count (``_count``) for ``tile`` at ``block_e_`` keys' width."""
    return tile.count_block_m or tile.block_m, min(tile.key_chunk or block_e_, block_e_)


def prep_block_p(programs: int, block_e_: int) -> int:
    """Rows of the per-program histogram table read at once (``BLOCK_P``), within the same tile budget."""
    return max(min(_next_pow2(programs), PREP_TILE_ELEMENTS["npu"] // block_e_), 1)


# --------------------------------------------------------------------------------------------
# Cube kernels: the block-sparse matmuls (kernels/blocksparse.py). Budget: see the module docstring.

CUBE_L1_BYTES = 512 * 1024  # A2 (910B) AI core L1 buffer
CUBE_L0A_BYTES = 64 * 1024
CUBE_L0B_BYTES = 64 * 1024
CUBE_L0C_BYTES = 128 * 1024
CUBE_BUFFERS = 2  # the compiler's multi-buffering of the K loop
CUBE_FRACTAL = 16  # the cube unit's tile side: every tile side is a multiple
CUBE_KINDS = ("sdd", "dsd", "dds")


@dataclasses.dataclass(frozen=True)
class CubeTile:
    block_m: int  # output rows per tile
    block_n: int  # output columns per tile
    block_k: int  # reduction depth per K-step
    group: int = 1  # tiles walked in groups of `group` rows (L2 reuse); 1: row-major order
    num_warps: int = 4  # CUDA only
    num_stages: int = 3  # CUDA only (software pipelining depth of the K loop)
    programs_per_sm: int = 1  # CUDA only: programs per SM in the persistent grid
    # CUDA only (kernels/blocksparse.py): sdd computes two blocks of a row as one tile (block_n must be
    # the block size); dsd computes the addresses of a line that is one affine run instead of loading them.
    pairs: bool = False
    affine: bool = False


def cube_bytes(tile: CubeTile, element_size: int) -> dict:
    """On-chip bytes of one program of a cube kernel on an A2 AI core (see the module docstring)."""
    m, n, k, es = tile.block_m, tile.block_n, tile.block_k, element_size
    return dict(l0a=CUBE_BUFFERS * m * k * es, l0b=CUBE_BUFFERS * k * n * es, l0c=m * n * 4,
                l1=CUBE_BUFFERS * (m + n) * k * es)


CUBE_LIMITS = dict(l0a=CUBE_L0A_BYTES, l0b=CUBE_L0B_BYTES, l0c=CUBE_L0C_BYTES, l1=CUBE_L1_BYTES)


def cube_fits(tile: CubeTile, element_size: int) -> bool:
    use = cube_bytes(tile, element_size)
    return all(use[key] <= limit for key, limit in CUBE_LIMITS.items())


def _sides(cap: int) -> list[int]:
    """Powers of two from ``cap`` down to the fractal."""
    out, v = [], max(int(cap), CUBE_FRACTAL)
    while v >= CUBE_FRACTAL:
        out.append(v)
        v //= 2
    return out


def _limits(kind: str, block_size: int, dense: int, wide: int) -> tuple[int, int, int]:
    """Largest (BLOCK_M, BLOCK_N, BLOCK_K) a ``kind`` allows: sides inside a sparse block are at
    most the block size; the dense side at most ``wide`` and no larger than the dense size needs."""
    dense_cap = max(min(wide, _next_pow2(max(dense, 1))), CUBE_FRACTAL)
    if kind == "sdd":  # output tile inside one block; K is the dense inner dimension
        return block_size, block_size, min(dense_cap, 256)
    if kind == "dsd":  # rows and K inside the sparse operand's blocks; N dense
        return block_size, dense_cap, block_size
    if kind == "dds":  # columns and K inside the sparse operand's blocks; M dense
        return dense_cap, block_size, block_size
    raise ValueError(f"unknown cube kernel kind {kind!r}: expected one of {CUBE_KINDS}")


def _npu_cube_tile(kind: str, es: int, block_size: int, dense: int) -> CubeTile:
    cap_m, cap_n, cap_k = _limits(kind, block_size, dense, 256)
    best = None
    for m in _sides(cap_m):
        for n in _sides(cap_n):
            if m * n * 4 > CUBE_L0C_BYTES:
                continue
            for k in _sides(cap_k):
                t = CubeTile(m, n, k)
                if cube_fits(t, es):
                    score = (m * n / (m + n), k, m)
                    if best is None or score > best[0]:
                        best = (score, t)
                    break  # the largest k that fits for this (m, n)
    if best is None:  # cannot happen for block sizes >= 16: 16 x 16 x 16 always fits
        raise ValueError(f"no {kind} cube tile fits the A2 budget at block size {block_size}")
    return dataclasses.replace(best[1], group=CUBE_GROUP)


# Tiles walked in groups of 8 rows (kernels/blocksparse.py): the tiles in flight share operand rows
# and columns in the L2. For the mixtral-like sdd (132 block rows of one expert's 117 MB weight)
# row-major order reads each expert's weight once per block row, ~15 GB per call; in groups of 8
# rows, once per group: ~1.9 GB (docs/notes/blocksparse-kernels.md).
CUBE_GROUP = 8


# CUDA (NVIDIA). Per kind: (tile for 2-byte operands, tile for fp32 operands) at block size 128;
# smaller blocks clip the sides that lie inside a block. benchmarks/bench_blocksparse.py sweeps
# candidates on an H200; its best per call form is what belongs here (docs/notes/blocksparse-kernels.md).
# 2-byte operands, measured on an H200 against torch._grouped_mm over the same padded groups
# (docs/notes/sparse-dmoe.md): sdd over pairs of blocks (128 x 256 tiles; 1.21x -> 1.10x the grouped
# GEMM's time at the mixtral-like shape, 1.10x -> ~1.0x at the fine one), dsd with affine runs
# computed (its weight-gradient form 1.17-1.21x -> 1.00x; 1.06x -> 1.04x forward). fp32: unmeasured.
CUDA_CUBE_TILES = {
    "sdd": (CubeTile(128, 128, 64, group=8, num_warps=8, num_stages=3, programs_per_sm=1, pairs=True),
            CubeTile(128, 128, 32, group=8, num_warps=8, num_stages=3, programs_per_sm=2)),
    "dsd": (CubeTile(128, 256, 64, group=8, num_warps=8, num_stages=3, programs_per_sm=1, affine=True),
            CubeTile(128, 128, 32, group=8, num_warps=8, num_stages=3, programs_per_sm=1)),
    "dds": (CubeTile(256, 128, 64, group=8, num_warps=8, num_stages=3, programs_per_sm=1),
            CubeTile(128, 128, 32, group=8, num_warps=8, num_stages=3, programs_per_sm=1)),
}
# The same kinds with the sparse operand transposed (``dsd(S.t(), x)``: the sparse dMoE's weight
# gradients). Their K loops are short (one block column of one expert: ~2k deep at the mixtral-like
# shape, against ~14k for the forward dsd). Kinds without an entry here use CUDA_CUBE_TILES. With
# the addresses loaded at every K-step, 128 x 256 x 128 in 2 stages was the best (3.75 ms at the
# mixtral-like shape, h200-bs2.log in benchmarks/results/2026-12-01-h200-blocksparse-steps/); with
# affine runs computed, the loads pipeline and 128 x 256 x 64 in 3 stages takes 3.25 ms, the
# grouped GEMM's time.
CUDA_CUBE_TILES_TRANSPOSED: dict[str, tuple[CubeTile, CubeTile]] = {
    "dsd": (CubeTile(128, 256, 64, group=8, num_warps=8, num_stages=3, programs_per_sm=1, affine=True),
            CUDA_CUBE_TILES["dsd"][1]),
}


@functools.lru_cache(maxsize=4096)  # called on every launch; a pure function of its arguments
def cube_tile(kind: str, dtype: torch.dtype, block_size: int, dense: int, device_target: str,
              transposed: bool = False) -> CubeTile:
    """The tile of a block-sparse matmul of ``kind`` (``sdd``, ``dsd``, ``dds``) on ``device_target``.

    ``block_size`` is the sparse matrix's block side; ``dense`` the size of the product's dense
    free dimension (sdd: K, dsd: N, dds: M), which only caps a tile side that would be wider than
    it needs to be. ``transposed``: the sparse operand is read transposed (``dsd``/``dds`` with
    ``transpose_a``/``transpose_b``); only the CUDA table tells the two apart."""
    if kind not in CUBE_KINDS:
        raise ValueError(f"unknown cube kernel kind {kind!r}: expected one of {CUBE_KINDS}")
    es = dtype.itemsize
    if device_target == "npu":
        return _npu_cube_tile(kind, es, block_size, dense)
    if device_target == "cuda":
        table = CUDA_CUBE_TILES_TRANSPOSED if transposed and kind in CUDA_CUBE_TILES_TRANSPOSED \
            else CUDA_CUBE_TILES
        base = table[kind][0 if es <= 2 else 1]
        cap_m, cap_n, cap_k = _limits(kind, block_size, dense, 256)
        return dataclasses.replace(base, block_m=min(base.block_m, cap_m), block_n=min(base.block_n, cap_n),
                                   block_k=min(base.block_k, cap_k))
    if device_target == "interpreter":
        # The interpreter's cost is per tile operation: whole blocks, and few K-steps.
        cap_m, cap_n, cap_k = _limits(kind, block_size, dense, 128)
        return CubeTile(cap_m, cap_n, min(cap_k, 128))
    raise ValueError(f"unknown target {device_target!r}")
