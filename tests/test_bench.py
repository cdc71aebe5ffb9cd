"""The benchmark harness (megablocks_ascend.bench): the precision verdict, device-generic timing, and
the NPU branch of ``bench`` against a stand-in torch_npu written from its documentation."""

import sys
import types

import pytest
import torch

from megablocks_ascend.bench import fused_npu, precision, routing_ops, suite, timing

from _fake_torch_npu import FakeNpuModule, FakeTorchNpu

# An NPU device as the harness sees one (torch itself parses "npu" only once torch_npu registered it)
NPU = types.SimpleNamespace(type="npu", index=0)

# -- the precision verdict -------------------------------------------------------------------


def _golden(n=4096, seed=0):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return torch.where(g.abs() < 0.5, g.sign() * 0.5 + g, g)  # away from zero: relative errors are clean


def test_floors_and_thresholds_are_the_public_ones():
    assert precision.THRESHOLDS == {"MARE": 10.0, "MERE": 2.0, "RMSE": 2.0}
    assert precision.FLOORS == {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-14}
    assert precision.golden_dtype(torch.bfloat16) == precision.golden_dtype(torch.float16) == torch.float32


def test_an_exact_copy_and_a_faithful_rounding_pass():
    g = _golden()
    sim = g.to(torch.bfloat16)
    v = precision.judge("copy", g.clone(), sim, g, torch.bfloat16)
    assert v.ok and v.ratios == {"MARE": 0.0, "MERE": 0.0, "RMSE": 0.0}
    v = precision.judge("rounded", sim.clone(), sim, g, torch.bfloat16)  # the device rounds as the CPU does
    assert v.ok and all(r <= 1.0 for r in v.ratios.values()), v


@pytest.mark.parametrize("units,fails", [(1.5, set()), (2.5, {"MERE", "RMSE"}), (12.0, {"MARE", "MERE", "RMSE"})])
def test_a_known_relative_error_passes_or_fails_where_it_should(units, fails):
    """Every element off by ``units`` bf16 floors (relative): MERE and MARE ratios are ``units`` (the
    simulation's errors are below the floor), RMSE ratio is ``units`` times the golden's RMS (~1.1)."""
    g = _golden()
    err = units * precision.FLOORS[torch.bfloat16]
    v = precision.judge("off", g * (1 + err), g.to(torch.bfloat16), g, torch.bfloat16)
    assert v.ratios["MERE"] == pytest.approx(units * (g.abs() / (g.abs() + 2**-8)).mean().item(), rel=1e-6)
    failed = {m for m in precision.THRESHOLDS if v.ratios[m] > precision.THRESHOLDS[m]}
    assert failed == fails and v.ok == (not fails), v


def test_non_finite_and_wrong_shapes_fail():
    g = _golden(64)
    bad = g.clone()
    bad[3] = float("nan")
    v = precision.judge("nan", bad, g.to(torch.float16), g, torch.float16)
    assert not v.ok and v.device["nonfinite"] == 1 and "non-finite" in v.why
    v = precision.judge("shape", g[:10], g.to(torch.float16), g, torch.float16)
    assert not v.ok and "shapes differ" in v.why
    with pytest.raises(ValueError, match="no precision floor"):
        precision.judge("int", g, g, g, torch.int32)


def test_one_wrong_row_of_a_gather_fails_the_verdict():
    """The routing ops' verdict as bench computes it: a gather with one row from the wrong token."""
    d = routing_ops.Data(**routing_ops.QUICK_SHAPES["quick"], device=torch.device("cpu"), dtype=torch.float16)
    args = routing_ops.arguments("gather", d)
    sim, gold = precision.cpu_references(routing_ops.reference.gather, args, d.dtype)
    out = routing_ops.implementation("gather", "ours")(*args)
    assert precision.judge("out", out, sim, gold, d.dtype).ok
    out[5] = out[6]
    assert not precision.judge("out", out, sim, gold, d.dtype).ok


# -- device-generic timing -------------------------------------------------------------------


def test_the_cpu_is_timed_by_the_wall_clock_and_has_no_graph_capture():
    cpu = torch.device("cpu")
    assert timing.timer(cpu).kind == "wall"
    assert timing.do_bench(lambda: torch.ones(4).sum(), cpu) > 0
    api, why = timing.graph_api(cpu)
    assert api is None and "not available" in why
    assert timing.graph_ms(lambda: None, cpu) is None


def test_an_npu_that_cannot_be_timed_is_reported_and_not_timed(monkeypatch):
    monkeypatch.setattr(torch, "npu", FakeNpuModule(), raising=False)
    npu = NPU
    t = timing.timer(npu)
    assert t.kind == "none" and "Event" in t.how and "synchronize" in t.how
    with pytest.raises(timing.NotTimed, match="cannot be timed"):
        timing.do_bench(lambda: None, npu)
    api, why = timing.graph_api(npu)
    assert api is None and "NPUGraph" in why


# -- the NPU branch against torch_npu's documented semantics ---------------------------------


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", FakeNpuModule(), raising=False)
    return fake


def _quick(dtype=torch.float16):
    return routing_ops.Data(**routing_ops.QUICK_SHAPES["quick"], device=torch.device("cpu"), dtype=dtype)


def test_ours_matches_the_fused_ops_under_the_documented_argument_mapping(fake_npu):
    d = _quick()
    results = {c.item: fused_npu.compare(c, d.dtype) for c in fused_npu.comparisons(d, fake_npu)}
    assert set(results) == {"permute", "permute backward", "unpermute", "unpermute backward", "init_routing_v2"}
    assert all(r["ok"] for r in results.values()), results
    # copies are bit-exact, ours and theirs
    assert results["permute"]["outputs"]["rows"]["equal"]
    assert results["init_routing_v2"]["outputs"]["rows"]["equal"]
    assert results["init_routing_v2"]["outputs"]["tokens_per_expert"]["equal"]
    calls = {c["op"]: c for c in fake_npu.calls}
    p = calls["npu_moe_token_permute"]
    assert p["indices"].shape == (d.T, d.k) and p["num_out_tokens"] == d.N and p["padded_mode"] is False
    u = calls["npu_moe_token_unpermute"]
    assert u["sorted_indices"].dtype == torch.int32 and u["probs"].shape == (d.T, d.k)
    # sorted_indices is the row of each assignment in our (expert-sorted) order
    assert torch.equal(d.indices.long()[u["sorted_indices"].long()], torch.arange(d.N))
    i = calls["npu_moe_init_routing_v2"]
    assert (i["active_num"], i["drop_pad_mode"], i["expert_tokens_num_type"], i["expert_tokens_num_flag"],
            i["quant_mode"], i["active_expert_range"], i["row_idx_type"], i["expert_num"]) == \
        (d.N, 0, 1, True, -1, [0, d.E], 0, d.E)
    assert i["expert_idx"].dtype == torch.int32


def test_a_wrong_kernel_of_ours_is_caught_by_the_fused_comparison(fake_npu, monkeypatch):
    from megablocks_ascend.kernels import routing
    original = routing.gather
    monkeypatch.setattr(routing, "gather", lambda *a, **k: original(*a, **k).roll(1, 0))
    d = _quick()
    permute = next(c for c in fused_npu.comparisons(d, fake_npu) if c.item == "permute")
    result = fused_npu.compare(permute, d.dtype)
    assert not result["ok"] and not result["outputs"]["rows"]["equal"]


def test_bench_on_an_npu_that_cannot_be_timed(fake_npu, tmp_path):
    """The whole NPU branch of ``bench`` over CPU tensors: every row is there, checked, judged and
    marked not timed; the fused ops are compared; nothing claims a time."""
    plan = suite.plan_for(NPU, quick=True, configs=["tiny"], sections=("ops", "fused", "steps"))
    plan.tensor_device, plan.dtype = torch.device("cpu"), torch.float16
    results = suite.run(plan, tmp_path, "npu", plot_png=False, log=lambda s="": None, tnpu=fake_npu)
    rows = results["rows"]
    assert results["device"]["timer"] == "none" and "not available" in results["device"]["graph_capture"]
    assert results["copy_ceiling"]["why"].startswith("not measured")
    assert all(r.get("ms") is None and r.get("why", "").startswith("not timed") for r in rows), \
        [r for r in rows if r.get("ms") is not None or "why" not in r]
    fused = [r for r in rows if r["section"] == "fused"]
    assert {(r["item"], r["impl"]) for r in fused} >= {("permute", "ours"), ("permute", "npu_moe_token_permute"),
                                                        ("unpermute", "npu_moe_token_unpermute"),
                                                        ("init_routing_v2", "npu_moe_init_routing_v2")}
    assert all(r["check_ok"] for r in fused)
    assert results["fused"]["mapping"]["unpermute"].startswith("ours: routing.scatter")
    assert {na["ops"].split(",")[0] for na in results["fused"]["not_applicable"]} >= {"binned_gather", "padded_gather"}
    ops = [r for r in rows if r["section"] == "ops"]
    assert {r["impl"] for r in ops} == {"ours", "torch"} and len(ops) == 18  # no upstream off CUDA
    steps_rows = [r for r in rows if r["section"] == "steps"]
    assert {(r["item"], r["impl"]) for r in steps_rows} == {(f"{layer} eager", impl)
                                                            for layer in ("dMoE", "dMoE-sparse", "MoE")
                                                            for impl in ("ours", "torch")}
    assert all(r["precision_ok"] and r["precision"] for r in steps_rows)
    assert results["summary"]["ok"] and results["summary"]["timed"] == 0
    assert (tmp_path / "npu.json").exists()
