"""LLM Foundry's MPT with MegaBlocks' layers through the plugin (README.md, "Using with LLM Foundry").

Skipped where LLM Foundry is not installed; CI runs this file at its ``llmfoundry`` point
(``tools/bootstrap.sh llmfoundry``). Each check runs in a fresh process that imports LLM Foundry
first, as its ``train.py`` does (tests/support/llmfoundry_checks.py).
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llmfoundry") is None,
                                reason="LLM Foundry is not installed here (CI: tools/bootstrap.sh llmfoundry)")


def check(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MEGABLOCKS_BACKEND")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "llmfoundry_checks.py"), *args],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(r.stdout.split("RESULT ", 1)[1])


@pytest.mark.parametrize("ffn_type", ["mb_dmoe", "mb_moe"])
def test_mpt_trains_through_our_kernels_and_matches_torch(ffn_type):
    r = check("backends", ffn_type)
    assert r["ascend"]["served"] == ["ascend"] and r["torch"]["served"] == ["torch"]
    assert {"gather", "scatter"} <= set(r["ascend"]["ops"]) if ffn_type == "mb_dmoe" else \
        {"binned_gather", "binned_scatter"} <= set(r["ascend"]["ops"])
    for a, t in zip(r["ascend"]["losses"], r["torch"]["losses"]):
        assert abs(a - t) <= 1e-5 * abs(t), r
    assert r["max_param_diff"] < 1e-5, r


def test_expert_parallelism_through_llmfoundrys_helpers_matches_one_process():
    """2 gloo ranks on CPU: LLM Foundry's config_moe_args builds the mesh (patch
    llmfoundry-device-mesh; upstream asks for CUDA) and shards the expert weights as DTensors."""
    r = check("expert-parallel")
    for rank in ("rank0", "rank1"):
        report = r[rank]
        assert report["mesh_device_types"] == ["cpu"]
        assert report["served"] == ["ascend"]
        assert abs(report["loss_ep"] - report["loss_single"]) <= 1e-5 * abs(report["loss_single"]), report
        assert max(report["grad_diffs"].values()) < 1e-5, report


def _example(*args, ranks=1):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MEGABLOCKS_BACKEND", "RANK",
                                                            "WORLD_SIZE", "LOCAL_RANK")}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    return subprocess.run([*launcher, str(ROOT / "examples" / "train_llmfoundry_mpt.py"), "--fsdp", "--steps", "3",
                           "--d-model", "32", "--layers", "1", "--seq", "8", "--batch", "2", "--vocab", "32", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


@pytest.mark.slow
def test_fsdp_mode_trains_on_one_process_and_stops_before_fsdp_on_cpu_ranks(tmp_path):
    """``--fsdp`` (Composer's Trainer): one process trains on 2 ranks' batches through our kernels, and
    another run's losses (other data) compare as different; 2 gloo processes build LLM Foundry's
    expert-parallel model and stop, saying why, before Composer's FSDP, which needs a GPU. Three
    launches of LLM Foundry, about 40 s each on a 2-core machine: marked slow."""
    r = _example("--data-ranks", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    first = json.loads((tmp_path / "llmfoundry-single-x2.json").read_text())
    assert first["world"] == 1 and first["data_ranks"] == 2 and not first["fsdp"] and first["served"] == ["ascend"]
    assert len(first["losses"]) == 3 and all(total >= lm > 0 for total, lm in first["losses"])
    other = _example("--data-ranks", "1", "--compare", str(tmp_path / "llmfoundry-single-x2.json"))
    assert other.returncode == 1 and "-> DIFFERENT" in other.stdout, other.stdout[-3000:]  # other data
    cpu = _example(ranks=2)
    assert cpu.returncode != 0 and "stopping before Composer's FSDP" in cpu.stdout, \
        cpu.stdout[-3000:] + cpu.stderr[-3000:]
    assert "expert mesh on ['cpu']" in cpu.stdout and "FSDP needs a non-CPU accelerator device" in cpu.stdout
