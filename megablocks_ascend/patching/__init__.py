"""The patch registry (moved to :mod:`megablocks_ascend.patching.registry`; split per patch next)."""

from megablocks_ascend.patching.registry import *  # noqa: F403
from megablocks_ascend.patching.registry import (  # noqa: F401
    _SPARSE_LIFTED,
    _apply_sparse_mlp_refusal,
    _fingerprint,
    _owner,
)
