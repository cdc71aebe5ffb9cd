"""Smoke test of the device probe kept with the notes (docs/notes/repro/check_grouped_mm_empty.py):
``--quick`` runs on a CPU (torch's CPU kernel and the stand-in) and says what it found."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no torch._grouped_mm")
def test_check_grouped_mm_empty_quick_cpu(tmp_path):
    """Every pattern runs through torch._grouped_mm's CPU kernel and the stand-in, and the summary
    says what it found."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(REPO / "docs" / "notes" / "repro" / "check_grouped_mm_empty.py"),
                        "--quick", "--no-time", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    report = json.loads((tmp_path / "check_grouped_mm_empty.json").read_text())
    modes = {(r["shape"], r["pattern"], r["mode"]) for r in report["checks"]}
    assert ("quick", "several", "eager") in modes and ("quick", "several", "stand-in") in modes
    assert report["summary"]["errors"] == 0 and report["summary"]["standin_always_zero"]
    assert report["summary"]["torch_grouped_mm_empty_groups_always_zero"]  # the CPU kernel writes them
