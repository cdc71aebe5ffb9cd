"""The command-line tools: doctor and selftest (lower is tested in test_lowering.py)."""

import os
import pathlib
import subprocess
import sys

import torch

from megablocks_ascend.cli import doctor, selftest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "megablocks_ascend", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def test_doctor_reports_backends_versions_and_patches():
    text = "\n".join(doctor.report())
    assert "torch " in text and "megablocks " in text
    assert "cpu   present  -> torch" in text or "cpu   present  -> ascend" in text
    assert "routing-kernels" in text and "9 target(s) replaced" in text
    assert "megablocks_ops: megablocks-ascend stand-in" in text
    assert "grouped_gemm: megablocks-ascend stand-in" in text
    r = _cli("doctor")
    assert r.returncode == 0, r.stderr
    assert "patches installed: True" in r.stdout
    # how the plugin was activated (README.md, "Activation"): here by doctor's own import
    assert "activation:" in r.stdout and "torch.backends entry point:" in r.stdout
    assert "megablocks-ascend's: on (MEGABLOCKS_ASCEND_AUTOLOAD=unset)" in r.stdout or \
        "MEGABLOCKS_ASCEND_AUTOLOAD" in os.environ
    assert "- activated by `import megablocks_ascend`" in r.stdout


def test_doctor_lists_the_tested_pairs_that_readme_and_bootstrap_name():
    """doctor's pairs, README's "Supported versions" and bootstrap's points say the same."""
    import re
    text = "\n".join(doctor.report())
    readme = (ROOT / "README.md").read_text()
    bootstrap = (ROOT / "tools" / "bootstrap.sh").read_text()
    for pair, _ in doctor.TESTED:
        assert pair in text
    for point in ("current", "torch27", "newest"):
        torch_v, triton_v = re.search(rf'^    {point}\) .*torch_spec="torch==([\d.]+)"; '
                                      rf'triton_spec="triton==([\d.]+)"', bootstrap, re.M).groups()
        assert f"torch {torch_v} + Triton {triton_v}" in text
        assert re.search(rf"^\| {re.escape(torch_v)} \(.*\) \+ Triton {re.escape(triton_v)} \|", readme, re.M), point


def test_selftest_passes_on_cpu_and_fails_on_a_broken_kernel(monkeypatch, capsys):
    assert selftest.run(torch.device("cpu"), dtypes=(torch.float32,)) == 0
    assert "passed" in capsys.readouterr().out
    from megablocks_ascend.kernels import routing

    original = routing.scatter

    def broken(*args, **kwargs):
        return original(*args, **kwargs) * 1.01

    monkeypatch.setattr(routing, "scatter", broken)
    assert selftest.run(torch.device("cpu"), dtypes=(torch.float32,), verbose=False) == 1


def test_cli_lists_every_subcommand():
    r = _cli("--help")
    assert r.returncode == 0
    for name in ("doctor", "selftest", "lower"):
        assert name in r.stdout
