"""The rule for results kept on tensors (megablocks_ascend/keeping.py), on its own; the three places
that keep results are tested where they are (test_host_sync.py, test_preparation.py,
test_grouped_gemm.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from megablocks_ascend import keeping

ATTR = "_megablocks_ascend_test_kept"


def _tensors():
    return torch.arange(6), torch.arange(3), torch.arange(2)


def test_a_kept_value_serves_the_same_key_and_companions_until_one_changes():
    owner, a, b = _tensors()
    keeping.keep(owner, ATTR, "v", ("for",), (a, b))
    assert keeping.kept(owner, ATTR, ("for",), (a, b)) == "v"
    assert keeping.kept(owner, ATTR, ("other",), (a, b)) is None  # another purpose
    assert keeping.kept(owner, ATTR, ("for",), (a.clone(), b)) is None  # another companion
    assert keeping.kept(owner, ATTR, ("for",), (a, keeping.ANY)) == "v"  # a companion not named
    assert keeping.kept(owner, ATTR, ("for",), (a,)) == "v"  # ... or left out at the end
    b.add_(0)  # in place: a new version of a companion
    assert keeping.kept(owner, ATTR, ("for",), (a, b)) is None
    keeping.keep(owner, ATTR, "w", ("for",), (a, b))
    owner.mul_(1)  # a new version of the owner
    assert keeping.kept(owner, ATTR, ("for",), (a, b)) is None


def test_none_companions_must_match_none():
    owner, a, b = _tensors()
    keeping.keep(owner, ATTR, "v", (), (a, None))
    assert keeping.kept(owner, ATTR, (), (a, None)) == "v"
    assert keeping.kept(owner, ATTR, (), (a, b)) is None


def test_capture_state():
    owner, a, _ = _tensors()
    keeping.keep(owner, ATTR, "eager", (), (a,), False, "s1")
    keeping.keep(owner, ATTR, "captured", (), (a,), True, "s2")
    keeping.keep(owner, ATTR, "either", (), (a,), None, "s3")
    assert keeping.kept(owner, ATTR, (), (a,), False, "s1") == "eager"
    assert keeping.kept(owner, ATTR, (), (a,), True, "s1") is None
    assert keeping.kept(owner, ATTR, (), (a,), True, "s2") == "captured"
    assert keeping.kept(owner, ATTR, (), (a,), False, "s2") is None
    assert keeping.kept(owner, ATTR, (), (a,), True, "s3") == "either"
    assert keeping.kept(owner, ATTR, (), (a,), False, "s3") == "either"


def test_keepable_no_reuse_and_inference():
    owner, a, _ = _tensors()
    assert keeping.keepable(owner, a, None)
    with keeping.no_reuse():
        assert not keeping.keepable(owner)
        with keeping.no_reuse():
            assert keeping.no_reuse_depth() == 2
        assert keeping.no_reuse_depth() == 1
    assert keeping.no_reuse_depth() == 0
    with torch.inference_mode():
        frozen = torch.arange(3)
    assert frozen.is_inference()  # no version counter
    assert not keeping.keepable(frozen) and not keeping.keepable(owner, None, frozen)


def test_the_value_dies_with_its_owner():
    owner, a, _ = _tensors()
    value = torch.zeros(2)
    ref = weakref.ref(value)
    keeping.keep(owner, ATTR, value, (), (a,))
    del value, owner
    gc.collect()
    assert ref() is None


def test_at_most_three_companions():
    owner, a, b = _tensors()
    keeping.Kept(keeping.key(owner), (a, b, None))
    with pytest.raises(ValueError, match="at most three"):
        keeping.Kept(keeping.key(owner), (a, b, a, b))
