"""Every environment variable megablocks-ascend reads, in one table.

Values are read when they are used (not cached at import), so a test or a
training script may change them between calls; what is cached is only the parse
of each raw string (a routing call reads about five of these).
:func:`invalid` lists every variable whose value is invalid (``doctor`` reports them).

=================================  ========  ==================================================
variable                           default   meaning
=================================  ========  ==================================================
``MEGABLOCKS_BACKEND``             ``auto``  Which implementation serves MegaBlocks' routing ops.
                                             ``auto``: NPU tensors -> ``ascend`` (our Triton
                                             kernels), CUDA tensors -> ``cuda`` (upstream
                                             MegaBlocks), CPU tensors -> ``torch``.
                                             ``ascend``: our Triton kernels on any device (on CPU
                                             through the Triton interpreter).
                                             ``cuda``: upstream MegaBlocks' kernels (CUDA only).
                                             ``torch``: pure PyTorch, any device.
``MEGABLOCKS_ASCEND_CHECKS``       ``0``     ``1`` adds the input checks that need a device-to-host
                                             sync (bins monotone, ``bins[-1]`` equal to the number
                                             of assignments, indices a permutation, bin_ids
                                             consistent with bins, finite weights). Checks that
                                             read only shapes, dtypes and devices are always on.
                                             Cost measured on an H200: ~0.5 ms per call (see
                                             docs/notes/expert-parallel-and-checks.md).
``MEGABLOCKS_ASCEND_NUM_PROGRAMS`` unset     Overrides the number of programs (the 1-D grid) the
                                             Ascend kernels launch; by default it comes from the
                                             device (vector cores on an NPU, SMs on CUDA).
``MEGABLOCKS_ASCEND_STORES``       ``auto``  Which form of the routing kernels runs
                                             (``kernels/routing_kernels.py``). ``contiguous``:
                                             every store lands on consecutive buffer rows and
                                             rows are gathered on load; ``scattered``: the token-major
                                             gather (each token row read once, stored to its
                                             top_k rows) and, at top_k 1, the one-launch
                                             position-major scatter and weight gradient.
                                             ``auto``: ``contiguous`` on NPU and CPU tensors,
                                             ``scattered`` on CUDA (``devices.STORES``). For
                                             comparing the forms on one device.
``MEGABLOCKS_ASCEND_SPARSE_SIZES`` ``static`` How the sparse dMoE (``mlp_impl="sparse"``) sizes its
                                             padded buffers and topology. ``static``: from what
                                             the host knows (tokens, top_k, experts, the block
                                             size), at most ``experts x (block - 1)`` rows more
                                             than the routing needs; no host sync, capturable in
                                             a graph. ``exact``: upstream's sizes, from
                                             ``padded_bins[-1]`` read on the host (a sync per
                                             step; a graph capture is refused with an error).
                                             Under ``MEGABLOCKS_BACKEND=cuda`` (upstream's
                                             kernels) always ``exact``.
``MEGABLOCKS_ASCEND_ROW_LOADS``    ``auto``  How the contiguous-store form's kernels (``_gather``,
                                             ``_scatter``, ``_wgrad``) load the rows they gather.
                                             ``masked``: a 2-D tile load whose row offsets come from
                                             an index vector; ``select``: triton-ascend's
                                             ``index_select_simd`` builtin (on an NPU; elsewhere its
                                             documented semantics in plain Triton), where the rows
                                             are int32-addressed and whole feature tiles.
                                             ``auto``: the form ``devices.ROW_LOADS`` chose from the
                                             compile gate's census (docs/notes/many-experts.md).
                                             For comparing the forms on one device.
``MEGABLOCKS_ASCEND_AUTOLOAD``     ``1``     ``0`` turns the autoload off: ``import torch`` then no
                                             longer puts the import hook in place that activates
                                             the plugin just before MegaBlocks or stk execute, and
                                             ``import megablocks_ascend`` must come before them.
                                             Read at ``import torch``, by
                                             ``_megablocks_ascend_autoload`` (outside the package).
                                             An invalid value warns once and means the
                                             default, ``1``; nothing here makes ``import
                                             torch`` fail (README, troubleshooting).
``TORCH_DEVICE_BACKEND_AUTOLOAD``  ``1``     torch's own switch: ``0`` turns off every
                                             ``torch.backends`` entry point (ours and torch_npu's).
``TRITON_INTERPRET``               unset     Triton's own switch. megablocks-ascend sets it to
                                             ``1`` when it is activated on a machine with neither
                                             CUDA nor torch_npu and nothing imported triton yet:
                                             there the interpreter is the only way Triton kernels
                                             run. ``import torch`` alone never sets it.
=================================  ========  ==================================================
"""

from __future__ import annotations

import os

import _megablocks_ascend_autoload as _autoload

BACKEND_VAR = "MEGABLOCKS_BACKEND"
CHECKS_VAR = "MEGABLOCKS_ASCEND_CHECKS"
NUM_PROGRAMS_VAR = "MEGABLOCKS_ASCEND_NUM_PROGRAMS"
STORES_VAR = "MEGABLOCKS_ASCEND_STORES"
SPARSE_SIZES_VAR = "MEGABLOCKS_ASCEND_SPARSE_SIZES"
ROW_LOADS_VAR = "MEGABLOCKS_ASCEND_ROW_LOADS"
AUTOLOAD_VAR = _autoload.AUTOLOAD_VAR  # parsed there: it is read before this package may be imported
autoload_enabled = _autoload.enabled

BACKENDS = ("auto", "ascend", "cuda", "torch")
STORES = ("auto", "contiguous", "scattered")
SPARSE_SIZES = ("static", "exact")
ROW_LOADS = ("auto", "masked", "select")


_parsed: dict = {}  # (variable, raw value) -> parsed value; invalid values are never stored


def _raw_reader():
    """A function ``name -> raw value or None`` that reads the process environment as
    ``os.environ.get`` does. ``os.environ.get`` encodes the name and decodes the value on every
    call, and an unset variable (the usual case) costs it a ``KeyError`` raised and caught; a
    routing call reads about five of these variables. So where ``os.environ`` is CPython's mapping
    over an encoded dict (its ``_data`` and ``encodekey``, in every CPython 3), the names are
    encoded once and the raw values looked up there, undecoded: they only key the parse cache.
    ``os.environ[...] = ...`` and ``del`` update that dict, so a change is seen on the next read;
    anywhere else (no such dict) this is ``os.environ.get``.

    Why not the public API alone, measured (2-core CPU machine, CPython 3.11, variables unset;
    docs/notes/activation-safety.md, "envs.py"): the five reads of one routing call take 0.72 us
    this way and 3.2-3.3 us through ``os.environ.get`` (``os.environb.get`` and ``os.getenv`` are
    no faster: 0.44-0.56 us a read), about 2.5 us more per call, a tenth of a gather's ~21 us of
    host time."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return os.environ.get
    keys = {}

    def read(name):
        key = keys.get(name)
        if key is None:
            key = keys[name] = encode(name)
        return data.get(key)
    return read


_raw = _raw_reader()


def _read(name: str, default, parse):
    raw = _raw(name)
    key = (name, raw)
    try:
        return _parsed[key]
    except KeyError:
        text = default if raw is None else os.environ.get(name, default)
        value = parse(text)  # raises on an invalid value, which is not stored
        _parsed[key] = value
        return value


def _parse_backend(raw: str) -> str:
    value = raw.strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(
            f"{BACKEND_VAR}={raw!r} is not a backend; valid values are: {', '.join(BACKENDS)}"
        )
    return value


def backend() -> str:
    """The value of ``MEGABLOCKS_BACKEND``, validated."""
    return _read(BACKEND_VAR, "auto", _parse_backend)


def _flag_parser(name: str):
    def parse(raw: str) -> bool:
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("", "0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return parse


_parse_checks = _flag_parser(CHECKS_VAR)


def checks_enabled() -> bool:
    """Whether the input checks that need a device-to-host sync run."""
    return _read(CHECKS_VAR, "0", _parse_checks)


def _parse_num_programs(value):
    if value is None or value.strip() == "":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{NUM_PROGRAMS_VAR}={value!r}: expected a positive integer")
    return n


def num_programs_override() -> int | None:
    return _read(NUM_PROGRAMS_VAR, None, _parse_num_programs)


def _parse_stores(raw: str) -> str:
    value = raw.strip().lower() or "auto"
    if value not in STORES:
        raise ValueError(f"{STORES_VAR}={raw!r}: expected one of {', '.join(STORES)}")
    return value


def stores() -> str:
    """The value of ``MEGABLOCKS_ASCEND_STORES``, validated: ``auto``, ``contiguous`` or ``scattered``."""
    return _read(STORES_VAR, "auto", _parse_stores)


def _parse_row_loads(raw: str) -> str:
    value = raw.strip().lower() or "auto"
    if value not in ROW_LOADS:
        raise ValueError(f"{ROW_LOADS_VAR}={raw!r}: expected one of {', '.join(ROW_LOADS)}")
    return value


def row_loads() -> str:
    """The value of ``MEGABLOCKS_ASCEND_ROW_LOADS``, validated: ``auto``, ``masked`` or ``select``."""
    return _read(ROW_LOADS_VAR, "auto", _parse_row_loads)


def _parse_sparse_sizes(raw: str) -> str:
    value = raw.strip().lower() or "static"
    if value not in SPARSE_SIZES:
        raise ValueError(f"{SPARSE_SIZES_VAR}={raw!r}: expected one of {', '.join(SPARSE_SIZES)}")
    return value


def sparse_sizes() -> str:
    """The value of ``MEGABLOCKS_ASCEND_SPARSE_SIZES``, validated: ``static`` or ``exact``."""
    return _read(SPARSE_SIZES_VAR, "static", _parse_sparse_sizes)


def invalid() -> list[str]:
    """What is wrong with each variable of this table whose value is invalid, one message each
    (empty when all are valid); each would raise where it is read. ``doctor`` lists them to fix."""
    problems = []
    for read in (backend, checks_enabled, num_programs_override, stores, sparse_sizes, row_loads):
        try:
            read()
        except ValueError as e:
            problems.append(str(e))
    try:
        _autoload.parse_flag(os.environ.get(AUTOLOAD_VAR))
    except ValueError as e:
        problems.append(f"{e}; taken as the default, 1 (on), until it is fixed")
    return problems
