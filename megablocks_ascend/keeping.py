"""Results kept on tensors: the one rule for keeping a result between the calls of a step and
using it again.

Three results are computed once per step and used by the calls that follow. Each is kept on the
tensor it was computed from (its *owner*), in the owner's ``__dict__``, so that it dies with that
tensor and no other tensor can find it (not through a memory address a graph pool or a checkpoint
hands on to a new tensor):

=========================  ==================  ==================================================
result                     owner               kept and found by
=========================  ==================  ==================================================
routing checks done        ``indices``         ``validation.mark_prepared`` / ``_prepared``: the
                                               routing preparation's tensors are well-formed
route map                  ``indices``         ``kernels/routing.py``: ``keep_route_map`` (the
                                               preparation's), ``route_map`` (computed, kept)
grouped GEMM group ends    ``batch_sizes``     ``native/grouped_gemm/device_sizes.py``:
                                               ``keep_group_ends`` (the preparation's ``bins``),
                                               ``_device_groups``
=========================  ==================  ==================================================

The rule
--------
*Keyed by version.* A kept result records a :class:`Kept`: its ``key`` (the owner's version
counter, then what the result is for: a route map is for a layout and a capacity, and for the
lengths of ``indices``, ``bins`` and ``padded_bins``), the *companion* tensors it was computed with
(held, compared by identity) and their version counters at that moment. It serves a later call only
for the same key and the same companions, none of them changed since: an in-place change of the
owner or of a companion (a new version counter) or other companion tensors make it stale.

*Never on an inference tensor* (:func:`keepable`): inference tensors have no version counter, so
nothing would tell an in-place change.

*Never inside* :func:`no_reuse`: the ``torch.library`` custom ops that compiled graphs call run in
it. Under CUDA-graph trees (``torch.compile(mode="reduce-overhead")``) a compiled graph's warm-up
runs outside a capture but allocates from the graph's pool, and a tensor kept on one of the graph's
tensors would outlive it untracked, which CUDA-graph trees refuse ("tensor(s) in the cudagraph pool
not tracked as outputs").

*Under the capture state it was made in* (:func:`capturing`): a result that a captured graph must
record (a tensor a launch wrote) serves only calls made under the capture state it was made in;
each captured call records its own launches. Route maps: one computed during a capture is not
kept, but the preparation's is, as it is written by the launch that writes its owner (every replay
rewrites both), and it serves the captured calls that follow. Group ends: neither kept nor looked
for during a capture. The routing checks are a fact about values, not a launch: they hold
whatever the capture state (``captured=None``).

This module imports only torch, so that every layer of the package (and the light ``grouped_gemm``
stand-in, registered before MegaBlocks imports) can use it.
"""

from __future__ import annotations

import contextlib
import threading

import torch


# --------------------------------------------------------------------------------------------
# The state: a graph being captured, a compiled graph running.


def capturing(device: torch.device) -> bool:
    """Whether a graph is being captured on ``device``'s current stream (``torch.cuda.graph``,
    ``torch.npu.graph``, CUDA-graph trees under ``torch.compile(mode="reduce-overhead")``). On an
    NPU whose torch_npu has no such query the answer is True: callers then keep nothing across a
    possible capture boundary, which is always safe."""
    kind = device.type
    if kind == "cuda":
        return torch.cuda.is_current_stream_capturing()
    if kind == "npu":
        query = getattr(getattr(torch, "npu", None), "is_current_stream_capturing", None)
        return True if query is None else bool(query())
    return False


def capturing_on(t: torch.Tensor) -> bool:
    """:func:`capturing` for ``t``'s device (a CPU tensor answers without looking at its device)."""
    return False if t.is_cpu else capturing(t.device)


class _NoReuse(threading.local):
    depth = 0


_no_reuse = _NoReuse()


@contextlib.contextmanager
def no_reuse():
    """Within this block nothing is kept on a tensor and nothing kept is used again: every result is
    computed (the custom ops compiled graphs call run in it; see the module docstring)."""
    _no_reuse.depth += 1
    try:
        yield
    finally:
        _no_reuse.depth -= 1


def no_reuse_depth() -> int:
    """How many :func:`no_reuse` blocks this thread is in (0: results may be kept and used again)."""
    return _no_reuse.depth


def reuse_allowed(device: torch.device) -> bool:
    """Whether a result may be kept for later calls of the step, or one used again, on ``device``
    by a place that keeps nothing during a capture: not inside :func:`no_reuse`, and not while a
    graph is being captured there."""
    return _no_reuse.depth == 0 and not capturing(device)


def keepable(a: torch.Tensor, b: torch.Tensor | None = None, c: torch.Tensor | None = None) -> bool:
    """Whether results may be kept on (and found through) these tensors: not inside
    :func:`no_reuse`, and none of them an inference tensor (None is skipped)."""
    return not (_no_reuse.depth or a.is_inference() or (b is not None and b.is_inference())
                or (c is not None and c.is_inference()))


# --------------------------------------------------------------------------------------------
# The record.


ANY = object()  # a companion the caller does not name: not compared (see Kept.current)


def key(owner: torch.Tensor, *what) -> tuple:
    """The key of a result kept on ``owner``: its version counter, then ``what`` it is for."""
    return (owner._version, *what)


_UNNAMED = (ANY, ANY, ANY)


class Kept:
    """What a kept result was made for and from (see the module docstring): ``key`` (from
    :func:`key`), up to three companion tensors (None entries allowed) with the version counter of
    each then, and ``captured``: the capture state it was made in, or None for a result that holds
    whatever the state. (Every routing call asks :meth:`current`: it is written for host time,
    unrolled over the three companions a result can have.)"""

    __slots__ = ("key", "captured", "_c0", "_c1", "_c2", "_versions")

    def __init__(self, key: tuple, companions: tuple = (), captured: bool | None = None):
        if len(companions) > 3:
            raise ValueError(f"a kept result has at most three companion tensors, not {len(companions)}")
        self.key = key
        self.captured = captured
        self._c0, self._c1, self._c2 = c0, c1, c2 = companions + (None,) * (3 - len(companions))
        self._versions = (None if c0 is None else c0._version, None if c1 is None else c1._version,
                          None if c2 is None else c2._version)

    def current(self, key: tuple, companions: tuple = (), captured: bool | None = None) -> bool:
        """Whether the result serves a call for ``key`` with ``companions`` (in the recorded order,
        compared by identity; :data:`ANY`, or leaving it out at the end, for one the call does not
        name) under capture state ``captured``: the same key and state, the same companions, and
        none of them changed since."""
        if key != self.key or (self.captured is not None and captured != self.captured):
            return False
        g0, g1, g2 = companions + _UNNAMED[len(companions):]
        c0, c1, c2 = self._c0, self._c1, self._c2
        if (g0 is not c0 and g0 is not ANY) or (g1 is not c1 and g1 is not ANY) or (g2 is not c2 and g2 is not ANY):
            return False
        return (None if c0 is None else c0._version, None if c1 is None else c1._version,
                None if c2 is None else c2._version) == self._versions

    def companions(self) -> tuple:
        """The companion tensors it was made with (None where there was none)."""
        return self._c0, self._c1, self._c2


# --------------------------------------------------------------------------------------------
# Where a result lives: in its owner's __dict__, under an attribute of the place that keeps it
# (in a slot of it, for a place that keeps several results per owner).


def find(owner: torch.Tensor, attr: str, slot=None):
    """What is kept on ``owner`` under ``attr`` (in its ``slot``), or None."""
    found = owner.__dict__.get(attr)
    return found if slot is None or found is None else found.get(slot)


def put(owner: torch.Tensor, attr: str, value, slot=None) -> None:
    """Keep ``value`` on ``owner`` under ``attr`` (in its ``slot``), replacing what was there."""
    if slot is None:
        setattr(owner, attr, value)
        return
    slots = owner.__dict__.get(attr)
    if slots is None:
        slots = {}
        setattr(owner, attr, slots)
    slots[slot] = value


def keep(owner: torch.Tensor, attr: str, value, what: tuple = (), companions: tuple = (),
         captured: bool | None = None, slot=None) -> None:
    """Keep ``value`` (not None) on ``owner`` with the :class:`Kept` record of what it was made for
    (``key(owner, *what)``) and from (``companions``, under capture state ``captured``); the caller
    asked :func:`keepable`."""
    put(owner, attr, (Kept(key(owner, *what), companions, captured), value), slot)


def record(owner: torch.Tensor, attr: str, slot=None) -> Kept | None:
    """The :class:`Kept` record of what is kept on ``owner`` under ``attr`` (in its ``slot``) while
    the owner is unchanged since (its version counter), whatever it serves; else None. For checks
    that compare a call's tensors with those a result was made from (their shapes: no device read)."""
    entry = find(owner, attr, slot)
    if entry is None or entry[0].key[0] != owner._version:
        return None
    return entry[0]


def kept(owner: torch.Tensor, attr: str, what: tuple = (), companions: tuple = (),
         captured: bool | None = None, slot=None):
    """The value :func:`keep` kept on ``owner`` that serves a call for ``what`` with ``companions``
    under capture state ``captured`` (see :meth:`Kept.current`), or None."""
    entry = owner.__dict__.get(attr)
    if entry is not None and slot is not None:
        entry = entry.get(slot)
    if entry is not None and entry[0].current((owner._version,) + what, companions, captured):  # key(owner, *what)
        return entry[1]
    return None
