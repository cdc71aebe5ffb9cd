"""Group layout from device-resident ``batch_sizes`` (the package docstring's "Where the group
sizes live"): the group ends and what derives from them, computed on the device without a host
read, once per ``batch_sizes`` tensor and kept on it for the later GEMMs of the step
(:mod:`megablocks_ascend.keeping`), or handed over by the routing preparation
(:func:`keep_group_ends`).
"""

from __future__ import annotations

import weakref

import torch

from megablocks_ascend import keeping

_GROUPS_ATTR = '_megablocks_ascend_gmm_groups'


class _DeviceGroups:
    """Group ends and the quantities derived from them, computed on the device from
    ``batch_sizes`` without reading it: ``ends[g] = min(sum(max(batch_sizes[:g+1], 0)), rows)``,
    non-decreasing and at most ``rows``, so every group is a slice inside the operands even when
    ``batch_sizes`` is malformed (its values are checked only with MEGABLOCKS_ASCEND_CHECKS=1).

    ``key`` (``keeping.key(batch_sizes, rows)``) when the groups are kept on ``batch_sizes``, None
    when they serve one call. ``ends`` given: group ends that the caller computed with
    ``batch_sizes`` and vouches for (:func:`keep_group_ends`); nothing is launched, and the groups
    are stale once ``ends`` changes (it is their companion tensor, in the sense of ``keeping``)."""

    def __init__(self, key, batch_sizes, rows: int, ends=None):
        self._derived = {}
        if ends is None:
            self.ends = batch_sizes.clamp(min=0).cumsum(0).clamp_(max=rows)   # int64
            self._sizes = None
        else:
            self.ends = ends
            # The sizes are the ends' differences (npu_grouped_matmul's group_list: one cast). A weak
            # reference: these groups are kept on batch_sizes itself.
            self._sizes = weakref.ref(batch_sizes)
        companions = () if ends is None else (ends,)
        self._kept = None if key is None else keeping.Kept(key, companions, captured=False)

    @property
    def key(self):
        return None if self._kept is None else self._kept.key

    def current(self, key) -> bool:
        """Whether these groups still describe ``batch_sizes`` at ``key`` (its version, the rows)."""
        return self._kept is not None and self._kept.current(key, captured=False)

    def _get(self, name, make):
        value = self._derived.get(name)
        if value is None:
            value = self._derived[name] = make()
        return value

    @property
    def offsets(self):
        """int32 cumulative ends, as torch._grouped_mm's ``offs`` wants them."""
        return self._get('offsets', lambda: self.ends.to(torch.int32))

    @property
    def counts(self):
        """int64 per-group sizes consistent with ``ends`` (npu_grouped_matmul's ``group_list``)."""
        sizes = self._sizes() if self._sizes is not None else None
        if sizes is not None:
            return self._get('counts', lambda: sizes.to(torch.int64))
        return self._get('counts', lambda: torch.diff(self.ends, prepend=self.ends.new_zeros(1)))

    @property
    def empty(self):
        """[E, 1, 1] mask of the groups without rows (their trans_a blocks must be zero)."""
        return self._get('empty', lambda: (self.counts == 0).view(-1, 1, 1))


def _reusable(batch_sizes) -> bool:
    """Whether group ends may be kept on ``batch_sizes`` for later GEMMs, or kept ones used, under
    the rule of :mod:`megablocks_ascend.keeping`: not an inference tensor, not inside
    ``keeping.no_reuse`` (the custom op compiled graphs call), and not during a graph capture (each
    captured call records its own small kernels)."""
    return keeping.keepable(batch_sizes) and not keeping.capturing(batch_sizes.device)


def _device_groups(batch_sizes, rows: int) -> _DeviceGroups:
    """The :class:`_DeviceGroups` of ``batch_sizes``, computed once per tensor (and version)
    and kept on the tensor object itself, so the GEMMs of one step (forward and backward get
    the same ``tokens_per_expert``) share it and it dies with the tensor. Not reused while a
    graph is being captured: each captured call records its own small kernels."""
    if not _reusable(batch_sizes):
        return _DeviceGroups(None, batch_sizes, rows)
    key = keeping.key(batch_sizes, rows)
    groups = keeping.find(batch_sizes, _GROUPS_ATTR)
    if groups is None or not groups.current(key):
        groups = _DeviceGroups(key, batch_sizes, rows)
        keeping.put(batch_sizes, _GROUPS_ATTR, groups)
    return groups


def keep_group_ends(batch_sizes, ends, rows: int) -> None:
    """Let the grouped GEMMs over ``rows`` rows grouped by ``batch_sizes`` take ``ends`` as their
    group ends instead of computing them (a clamp, a cumsum, a clamp and a cast: four launches per
    step). The caller vouches for the values: ``ends`` is the inclusive cumsum of ``batch_sizes``,
    whose entries are non-negative and sum to at most ``rows`` (the routing preparation's ``bins``
    and ``tokens_per_expert``, with ``rows`` its number of assignments). Kept under the rules of
    :func:`_device_groups`; a later in-place change of either tensor, or GEMMs over another number
    of rows, compute their own ends as before."""
    if not _reusable(batch_sizes) or not keeping.keepable(ends) or ends.device != batch_sizes.device \
            or ends.shape != batch_sizes.shape:
        return
    keeping.put(batch_sizes, _GROUPS_ATTR, _DeviceGroups(keeping.key(batch_sizes, rows), batch_sizes, rows, ends))
