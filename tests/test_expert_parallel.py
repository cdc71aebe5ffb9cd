"""MegaBlocks' expert-model parallelism through the plugin: N gloo ranks vs one process.

``benchmarks/bench_expert_parallel.py`` (:mod:`megablocks_ascend.bench.expert_parallel_steps`) is
run as the GPUs would run it, under ``torchrun`` with 2 processes, on the CPU (gloo, the Triton
interpreter, the tiny config): every rank holds half of the experts; the outputs, input gradients
and every weight gradient of MegaBlocks' ``MoE``, grouped ``dMoE`` and sparse ``dMoE`` must match
the same layer with all experts run by rank 0 on both ranks' tokens, with our kernels and with the
``torch`` backend, and the report must hold each rank's step time, all-to-all figures and launch
counts. The run costs about 25 s on an idle 2-core machine (it replaces six spawned checks that
cost about 150 s). The comparison itself is shown to fail where it should in one process.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_expert_parallel.py"
EXPECTED_GRADS = {
    "MoE": {"output", "x.grad", "router.layer.weight.grad", "experts.mlp.w1.grad", "experts.mlp.w2.grad",
            "experts.bias.grad"},
    "dMoE-grouped": {"output", "x.grad", "router.layer.weight.grad", "experts.mlp.w1.grad", "experts.mlp.w2.grad",
                     "experts.bias.grad"},
}
EXPECTED_GRADS["dMoE-sparse"] = EXPECTED_GRADS["dMoE-grouped"]


def torchrun(out, *args, ranks=2):
    """The benchmark under ``torchrun --standalone`` on ``ranks`` CPU processes; its JSON."""
    env = {k: v for k, v in os.environ.items() if k not in ("MEGABLOCKS_BACKEND", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(SCRIPT),
           "--device", "cpu", "--quick", "--out", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    return json.loads((out / f"ep{ranks}.json").read_text()), (out / f"ep{ranks}.log").read_text()


def test_two_ranks_match_one_process_and_report(tmp_path):
    # Capacity factor 1/4: the MoE's capacity per expert (16 on 2 ranks of 32 tokens, top_k 2, 4
    # experts) is half of the mean load, so it drops assignments, and both layers must drop the same.
    report, log = torchrun(tmp_path, "--capacity-factor", "0.25")
    env = report["environment"]
    assert env["world"] == 2 and env["pg_backend"] == "gloo" and env["torch"] == torch.__version__
    rows = report["rows"]
    assert [(r["layer"], r["backend"], r["ep"]) for r in rows] == [
        (layer, backend, True) for layer in ("MoE", "dMoE-grouped", "dMoE-sparse") for backend in ("ascend", "torch")]
    for r in rows:
        p = r["parity"]
        assert r["ok"] and p["ok"] and p["why"] is None, r
        assert set(p["errors"]) == EXPECTED_GRADS[r["layer"]], p["errors"]
        assert p["worst"] <= p["tol"] == 1e-5, p
        assert p["served"] == [[r["backend"]], [r["backend"]]] and p["experts_per_rank"] == 2, p
        assert {"gather", "scatter"} <= set(p["ops"]), p
        per = r["per_rank"]
        assert [q["rank"] for q in per] == [0, 1] and all(q["device"] == "cpu" for q in per)
        for q in per:
            # MegaBlocks' expert-parallel step: forward, the token counts and the tokens both ways;
            # backward, the tokens' gradients both ways.
            assert q["a2a_calls"] == 5 and q["collectives"] == 5, q
            assert q["a2a_bytes"] > 0 and q["a2a_ms"] > 0 and q["a2a_unwaited"] == 0, q
            assert q["wall_ms"] > 0 and q["host_ms"] > 0, q
            assert q["launches"] == q["aten"] + q["triton"] + q["collectives"], q
            assert (q["triton"] > 0) == (r["backend"] == "ascend"), q
        assert r["wall_ms"] == max(q["wall_ms"] for q in per)
        assert r["vs_baseline"] > 0
    assert "2 rank(s), 6 rows passed parity, 0 failed" in log


def test_expert_parallel_under_autocast_and_bf16(tmp_path):
    """2 ranks, bf16 tokens in the all-to-alls and MegaBlocks' ScaleGradient on the expert weights,
    under autocast against one process under autocast (float32 parameters and gradients)."""
    report, _ = torchrun(tmp_path, "--precision", "amp-bf16", "--layers", "dMoE-grouped,MoE", "--backends", "ascend",
                         "--no-timing")
    assert [r["ok"] for r in report["rows"]] == [True, True], report["rows"]
    for r in report["rows"]:
        assert r["parity"]["tol"] == 6 * 2.0**-8 and "per_rank" not in r


# -- in one process: the comparison fails where it should, N = 1's baseline rows, bad settings

@pytest.fixture
def group_of_one():
    from megablocks_ascend.bench import expert_parallel_steps as eps
    ranks = eps.init("cpu", timeout_s=120)
    try:
        yield ranks
    finally:
        torch.distributed.destroy_process_group()


def test_the_check_fails_on_a_wrong_expert_weight(group_of_one):
    from megablocks_ascend.bench import expert_parallel, steps
    c = steps.QUICK_CONFIGS["tiny"]
    pair = expert_parallel.build("dMoE-grouped", c, 16, "fp32", torch.device("cpu"), 0, 1)
    assert expert_parallel.check(pair, "torch")["ok"]
    with torch.no_grad():
        w = pair.ep.experts.mlp.w2
        w[: w.shape[0] // c["E"]] *= 1.01  # the first expert's second matrix, 1% off
    verdict = expert_parallel.check(pair, "torch")
    assert not verdict["ok"] and "experts.mlp.w2.grad" not in verdict["why"], verdict  # w2's own grad is fine
    assert "output" in verdict["why"] and "experts.mlp.w1.grad" in verdict["why"], verdict


def test_one_rank_gives_the_baselines_with_and_without_expert_parallelism(group_of_one):
    from megablocks_ascend.bench import expert_parallel_steps as eps
    from megablocks_ascend.bench import steps
    s = eps.Settings(configs={"tiny": steps.QUICK_CONFIGS["tiny"]}, tokens=16, layers=("dMoE-grouped",),
                     backends=("torch",), precision="fp32", steps=1, warmup=0, profile_steps=0, a2a_steps=1)
    rows = eps.run(s, group_of_one, lambda *_: None)
    assert [(r["backend"], r["ep"]) for r in rows] == [("torch", True), ("torch", False)]
    ep_row, plain = rows
    assert ep_row["ok"] and plain["ok"] and plain["parity"]["worst"] == 0.0, rows
    assert ep_row["per_rank"][0]["a2a_calls"] == 5 and plain["per_rank"][0]["a2a_calls"] == 0
    assert plain["per_rank"][0]["collectives"] == 0 and plain.get("a2a_ms") is None


def test_what_cannot_run_is_said_before_anything_runs():
    from megablocks_ascend.bench import expert_parallel, steps
    tiny = steps.QUICK_CONFIGS["tiny"]  # 4 experts, ffn 128
    assert expert_parallel.why_not("MoE", tiny, 3) == "4 experts do not split over 3 ranks"
    assert "multiple of 128" in expert_parallel.why_not("dMoE-sparse", steps.QUICK_CONFIGS["tiny16"], 1)
    assert expert_parallel.why_not("dMoE-sparse", tiny, 4) is None
    with pytest.raises(ValueError, match="layer must be one of"):
        expert_parallel.layer_arguments("dMoE", tiny, "fp32", torch.device("cpu"))
    with pytest.raises(ValueError, match="device must be one of"):
        from megablocks_ascend.bench import expert_parallel_steps as eps
        eps.init("xpu")
