"""Smoke test of tools/run_stk_tests.py: --quick runs stk's own shipped tests (their smallest
problem, every transpose) on CPU with our kernels and the torch reference serving them, and the
int16-boundary section (refusal decisions, our kernels); it must prove who served the calls."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_run_stk_tests_quick_cpu(tmp_path):
    pytest.importorskip("absl", reason="stk's shipped tests need absl-py (tools/bootstrap.sh installs it)")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(REPO / "tools" / "run_stk_tests.py"), "--quick", "--boundary",
                        "--backend", "ascend", "torch", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ALL OK" in p.stdout
    report = json.loads((tmp_path / "run_stk_tests.json").read_text())
    for run in report["stk_tests"]:
        assert run["tests"] == 12 and run["failed"] == 0 and run["stk_own_calls"] == {}
        assert {k.split(" by ")[1] for k in run["served"]} == {run["backend"]}
        assert {k.split(" by ")[0] for k in run["served"]} == {"sdd", "dsd", "dds"}
    refused = {(r["case"], r["size"]) for r in report["boundary"] if r["refused"]}
    assert refused == {("sdd rows", 32896), ("sdd columns", 32896)}
    assert all(r["ascend_right"] for r in report["boundary"])


def test_selftest_checks_the_block_sparse_kernels(monkeypatch, capsys):
    """``python -m megablocks_ascend selftest`` (the first thing to run on an NPU) covers stk's
    calls too, and fails when one of our block-sparse kernels is wrong."""
    import torch

    from megablocks_ascend.cli import selftest
    from megablocks_ascend.kernels import blocksparse

    original = blocksparse.dsd

    def broken(*args, **kwargs):
        original(*args, **kwargs)
        kwargs["out"].mul_(1.01)  # the dispatcher passes arguments by name

    monkeypatch.setattr(blocksparse, "dsd", broken)
    assert selftest.run(torch.device("cpu"), dtypes=(torch.float32,), families=("blocksparse",)) == 1
    table = capsys.readouterr().out
    assert [line.split()[-2] for line in table.splitlines() if line.startswith("dsd ")] == ["FAIL", "FAIL"]
    assert all(line.split()[-2] == "ok" for line in table.splitlines() if line.startswith(("sdd ", "dds ")))
