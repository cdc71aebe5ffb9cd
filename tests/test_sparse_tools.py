"""Smoke test of benchmarks/run_stk_tests.py: --quick runs stk's own shipped tests (their smallest
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
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run_stk_tests.py"), "--quick", "--boundary",
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
    assert refused == {("sdd rows", 32896), ("sdd columns", 32896), ("dsd rhs.t()", 32896),
                       ("dds lhs contiguous", 32896)}
    assert all(r["ascend_right"] for r in report["boundary"])
