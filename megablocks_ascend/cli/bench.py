"""``python -m megablocks_ascend bench``: ours against every alternative this device has, with the
precision verdict; the command line of :mod:`megablocks_ascend.bench.suite`, which says what it runs."""

from __future__ import annotations

from megablocks_ascend.bench.suite import add_arguments, main

__all__ = ["add_arguments", "main"]
