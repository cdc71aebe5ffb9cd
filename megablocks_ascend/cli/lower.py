"""``python -m megablocks_ascend lower``: the Ascend compile gate, in the lowering venv of
``tools/ascend_lowering_env.sh``; the command line of :mod:`megablocks_ascend.lowering.command`,
which says what it runs and its exit status."""

from __future__ import annotations

from megablocks_ascend.lowering.command import add_arguments, main

__all__ = ["add_arguments", "main"]
