"""The command-line tools: doctor and selftest (lower is tested in test_lowering.py)."""

import math
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


# ---------------------------------------------------------------------------------------------
# What the user is told where something is missing or wrong (not torch's words).


def _run(args, env=None):
    environ = dict(os.environ, PYTHONPATH=str(ROOT))
    environ.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environ, cwd=ROOT,
                          timeout=600)


def test_an_npu_without_torch_npu_is_named_wherever_a_device_is_parsed():
    """torch alone says "Expected one of cpu, cuda, ... device type at start of device string: npu";
    every command that takes --device says what is missing (torch_npu, CANN) and where to look
    (doctor), before anything runs, without a traceback."""
    import importlib.util
    if importlib.util.find_spec("torch_npu") is not None:
        import pytest
        pytest.skip("torch_npu is installed here")
    for args in (["examples/train_moe.py", "--device", "npu", "--steps", "1"],
                 ["-m", "megablocks_ascend", "selftest", "--device", "npu"],
                 ["-m", "megablocks_ascend", "bench", "--device", "npu:0", "--quick", "--out", "/nonexistent"],
                 ["benchmarks/bench_checks.py", "--device", "npu"]):
        r = _run(args)
        assert r.returncode != 0, args
        assert "Traceback" not in r.stderr, (args, r.stderr)
        text = r.stderr + r.stdout
        assert "--device npu" in text and "torch_npu is not installed" in text, (args, text)
        assert "CANN" in text and "python -m megablocks_ascend doctor" in text, (args, text)
        assert "Expected one of" not in text


def test_requested_device_errors_name_the_argument():
    import pytest

    from megablocks_ascend import devices
    assert devices.requested("cpu") == torch.device("cpu")
    with pytest.raises(devices.DeviceUnavailable, match=r"--device 'gpu0' is not a device: expected cpu, cuda"):
        devices.requested("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(devices.DeviceUnavailable, match="--where cuda:1: this torch sees no CUDA device"):
            devices.requested("cuda:1", argument="--where")


def test_a_torch_npu_that_sees_no_npu_is_named(monkeypatch):
    """torch_npu imported but no NPU usable (CANN's driver or environment): said so, with CANN and doctor."""
    import types

    import pytest

    from megablocks_ascend import devices
    if getattr(torch, "npu", None) is not None:
        pytest.skip("torch has an npu module here")
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0),
                        raising=False)
    monkeypatch.setattr(torch, "device", lambda text: types.SimpleNamespace(type=text.partition(":")[0], index=None))
    with pytest.raises(devices.DeviceUnavailable, match=r"torch_npu is imported but sees no NPU .*CANN.*doctor"):
        devices.requested("npu")


def test_doctor_reports_every_invalid_switch_instead_of_crashing():
    bad = {"MEGABLOCKS_BACKEND": "foo", "MEGABLOCKS_ASCEND_CHECKS": "maybe", "MEGABLOCKS_ASCEND_NUM_PROGRAMS": "-3",
           "MEGABLOCKS_ASCEND_STORES": "sideways", "MEGABLOCKS_ASCEND_AUTOLOAD": "perhaps"}
    r = _run(["-m", "megablocks_ascend", "doctor"], env=bad)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    fixes = r.stdout.split("to fix:", 1)[1]
    for name, value in bad.items():
        assert f"{name}={value!r}" in fixes, (name, fixes)
    assert "MEGABLOCKS_BACKEND='foo' (invalid)" in r.stdout and "not decided until MEGABLOCKS_BACKEND is valid" in r.stdout
    ok = _run(["-m", "megablocks_ascend", "doctor"], env={"MEGABLOCKS_BACKEND": "torch"})
    assert "to fix:" not in ok.stdout or "MEGABLOCKS_" not in ok.stdout.split("to fix:", 1)[1]


def test_doctor_says_when_a_patch_waits_for_its_package_to_import_a_module(tmp_path):
    """llmfoundry-device-mesh applies once LLM Foundry imports its module: doctor says so (it used to
    print "0 target(s) replaced", which reads as broken). A stand-in llmfoundry package on the path,
    not imported, is enough."""
    (tmp_path / "llmfoundry").mkdir()
    (tmp_path / "llmfoundry" / "__init__.py").write_text("")
    r = _run(["-m", "megablocks_ascend", "doctor"], env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "llmfoundry-device-mesh" in x)
    assert "waits for `llmfoundry.models.utils.config_moe_args` to be imported, and applies then" in line
    jit = next(x for x in r.stdout.splitlines() if x.strip().startswith("jit-script-warning"))
    assert "in place only while MegaBlocks and stk import" in jit or "not needed here" in jit


def _llmfoundry_example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_llmfoundry_mpt", ROOT / "examples" / "train_llmfoundry_mpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (imports LLM Foundry only when it runs: not needed here)
    return module


def test_llmfoundry_example_checks_compare_before_it_imports_or_trains(tmp_path):
    """--compare FILE used to train 30 steps and then fail on a missing FILE; now the arguments are
    checked first (here even without LLM Foundry installed: the error comes before its import)."""
    (tmp_path / "other.json").write_text('{"something": 1}')
    for args, said in ((["--fsdp", "--compare", str(tmp_path / "missing.json")], "cannot read it"),
                       (["--fsdp", "--compare", str(tmp_path / "other.json")], "not a result of this script"),
                       (["--compare", str(tmp_path / "other.json")], "--compare goes with --fsdp")):
        r = _run(["examples/train_llmfoundry_mpt.py", *args])
        assert r.returncode == 2 and said in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and "ModuleNotFoundError" not in r.stderr, r.stderr


def test_llmfoundry_example_states_the_language_floor_not_a_wrong_start():
    """The example used to say the loss starts near log(vocab) (4.16), where an untrained MPT
    starts at 5.1-5.2; it now states the bigram language's entropy, the floor, computed."""
    m = _llmfoundry_example()
    uniform = torch.full((8, 8), 1 / 8)
    assert abs(m.entropy_floor(uniform) - math.log(8)) < 1e-9
    cycle = torch.eye(8).roll(1, dims=1)  # each token has one successor: nothing to guess
    assert m.entropy_floor(cycle) < 1e-9
    a = m.parse([])
    floor = m.entropy_floor(m.bigram_table(a))
    assert 0 < floor < math.log(3) + 1e-9  # three successors per token at most
    source = (ROOT / "examples" / "train_llmfoundry_mpt.py").read_text()
    assert "loss starts near log(vocab)" not in source
