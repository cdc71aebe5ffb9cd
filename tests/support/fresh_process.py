"""Scenarios in a fresh Python process, with what it sees on its path made here.

Used by the tests whose subject is what happens at interpreter start (``import torch``, the
``torch.backends`` entry point, the import hook, a broken package on the path): each needs a new
process, a controlled environment and a few fake distributions, and reads back the exit status,
stdout and stderr.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENTRY_POINT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch.backends"]

# Variables a scenario starts without unless it sets them: the plugin's and torch's switches and
# the Triton interpreter (the plugin decides it).
CLEARED = ("TRITON_INTERPRET", "MEGABLOCKS_BACKEND", "MEGABLOCKS_ASCEND_AUTOLOAD", "TORCH_DEVICE_BACKEND_AUTOLOAD")


def fake_distribution(where: pathlib.Path, name: str, version: str, entry_points: dict | None = None,
                      group: str = "torch.backends") -> pathlib.Path:
    """A ``NAME-VERSION.dist-info`` folder under ``where`` (metadata and, optionally, entry points
    of ``group``): what ``importlib.metadata`` and torch's autoload see of an installed package."""
    info = where / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        (info / "entry_points.txt").write_text(
            f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in entry_points.items()))
    return info


def ours(where: pathlib.Path) -> pathlib.Path:
    """This checkout's distribution as the entry point sees it: metadata plus pyproject's entry point."""
    fake_distribution(where, "megablocks-ascend", "0.1.0", ENTRY_POINT)
    return where


def run(code: str = "", *, path=(), checkout: bool = True, args=None, env: dict | None = None,
        cwd=ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``code`` (or ``python ARGS`` with ``args``) in a fresh interpreter, in ``cwd`` (the
    checkout's root unless given: ``-c`` puts it first on ``sys.path``), with ``path`` (folders) first on ``PYTHONPATH`` and then this checkout (unless
    ``checkout`` is False); the variables in :data:`CLEARED` unset unless ``env`` sets them."""
    environ = {k: v for k, v in os.environ.items() if k not in CLEARED}
    environ.update(env or {})
    folders = [*map(str, path)] + ([str(ROOT)] if checkout else [])
    environ["PYTHONPATH"] = os.pathsep.join(folders)
    command = [sys.executable, *(args if args is not None else ["-c", textwrap.dedent(code)])]
    return subprocess.run(command, capture_output=True, text=True, env=environ, cwd=cwd, timeout=timeout)
