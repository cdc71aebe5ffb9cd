"""LLM Foundry's MPT with MegaBlocks' layers through the plugin (README.md, "Using with LLM Foundry").

Skipped where LLM Foundry is not installed; CI runs this file at its ``llmfoundry`` point
(``tools/bootstrap.sh llmfoundry``). Each check runs in a fresh process that imports LLM Foundry
first, as its ``train.py`` does (tests/llmfoundry_checks.py).
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
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "llmfoundry_checks.py"), *args],
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
