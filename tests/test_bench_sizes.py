"""The bench at today's MoE sizes (issue 33): the step configs of DeepSeek-V3 and Qwen3, comparisons
without whole-tensor float64 copies, results kept on the host when large, one layer alive at a time,
the peak memory column, and precision verdicts on a reduced layer of the same family.

All on the CPU (the Triton interpreter, tiny shapes): the code paths the H200 run takes; what they
measure there is in BENCHMARKS.md."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from megablocks_ascend.bench import precision, steps, suite


def test_todays_layers_are_step_configs():
    """DeepSeek-V3 (7168 / 2048 / 256 experts / top-8), Qwen3-235B (4096 / 1536 / 128 / top-8) and a
    256-expert one, in the harness's default set."""
    assert steps.CONFIGS["dsv3"] == dict(H=7168, ffn=2048, E=256, k=8)
    assert steps.CONFIGS["qw3"] == dict(H=4096, ffn=1536, E=128, k=8)
    assert steps.CONFIGS["e256"]["E"] == 256 and steps.CONFIGS["e256"]["k"] == 8
    assert {"dsv3", "qw3", "e256"} <= set(steps.DEFAULT["config"])
    assert {v.config for v in steps.select([], quick=False)} >= {"dsv3", "qw3", "e256"}


@pytest.mark.parametrize("n, chunk", [(1, 4), (17, 4), (64, 16), (1000, 7), (1000, 1 << 24)])
def test_rel_l2_in_chunks_is_the_whole_tensor_value(n, chunk):
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = (a.double() - b.double()).norm().item() / b.double().norm().item()
    assert math.isclose(precision.rel_l2(a, b, chunk=chunk), want, rel_tol=1e-12)
    assert precision.rel_l2(b, b, chunk=chunk) == 0.0
    assert precision.rel_l2(a.reshape(-1, 1), b.reshape(1, -1), chunk=chunk) == pytest.approx(want, rel=1e-12)


def test_rel_l2_sees_a_non_finite_element_in_any_chunk_and_refuses_other_sizes():
    a = torch.zeros(100)
    a[73] = float("nan")
    assert precision.rel_l2(a, torch.ones(100), chunk=8) == math.inf
    a[73] = float("inf")
    assert precision.rel_l2(a, torch.ones(100), chunk=8) == math.inf
    assert precision.rel_l2(torch.ones(3), torch.zeros(3)) == math.sqrt(3)  # a zero reference: absolute
    with pytest.raises(ValueError, match="sizes differ"):
        precision.rel_l2(torch.ones(3), torch.ones(4))


def test_kept_results_go_to_the_host_past_the_limit():
    t = [torch.ones(4, 4), None, torch.arange(6.0)]
    small = steps.snapshot(t, limit=1 << 20)
    big = steps.snapshot(t, limit=8)
    for kept in (small, big):
        assert kept[1] is None and torch.equal(kept[0], t[0]) and torch.equal(kept[2], t[2])
        assert kept[0].data_ptr() != t[0].data_ptr()  # copies, not views of the live results
    assert all(x.device.type == "cpu" for x in big if x is not None)


def test_kept_results_stay_on_the_device_while_they_fit_a_third_of_its_free_memory(monkeypatch):
    """By default the host takes them only past a third of the device's free memory; a device without
    the figure (the CPU) keeps them where they are; an explicit limit overrides."""
    from megablocks_ascend.bench import timing
    t = [torch.ones(4, 4), None, torch.arange(6.0)]
    total = 16 * 4 + 6 * 4
    for free, host in ((3 * total, False), (3 * total - 3, True), (None, False)):
        monkeypatch.setattr(timing, "free_memory", lambda device, free=free: free)
        assert steps.on_host(t) is host, free
        assert steps.on_host(t, limit=total) is False and steps.on_host(t, limit=total - 1) is True


def test_precision_verdicts_run_on_a_reduced_layer_of_the_same_family():
    dsv3 = precision.precision_config(steps.CONFIGS["dsv3"])
    assert dsv3 == dict(H=precision.PRECISION_HIDDEN, ffn=precision.PRECISION_FFN, E=256, k=8)
    assert precision.precision_config(steps.CONFIGS["dsv3"], full=True) == steps.CONFIGS["dsv3"]
    e1k = precision.precision_config(dict(H=4096, ffn=4096, E=1000, k=4))
    assert e1k["H"] == 1008 and e1k["E"] == 1000  # a feature per expert for the decisive router
    tiny = dict(H=64, ffn=128, E=4, k=2)
    assert precision.precision_config(tiny) == tiny  # small layers are judged as they are
    assert precision.precision_config(tiny, max_params=1 << 10, hidden=32, ffn=16) == dict(H=32, ffn=16, E=4, k=2)
    for c in steps.CONFIGS.values():  # every default config's verdict is a layer a CPU steps in seconds
        on = precision.precision_config(c)
        assert (on["E"], on["k"]) == (c["E"], c["k"]) and 2 * on["E"] * on["H"] * on["ffn"] <= 1 << 28


def test_one_layer_lives_at_a_time(monkeypatch):
    """The harness releases a family's layer, inputs and kept results before it builds the next
    (a DeepSeek-V3 layer and its kept gradients are 30 GB)."""
    alive = []

    class Tracked(steps.Case):
        def __init__(self, *args, **kwargs):
            gc.collect()
            assert not any(ref() is not None for ref in alive), "the previous family's layer is still alive"
            super().__init__(*args, **kwargs)
            alive.append(weakref.ref(self.layer))

    monkeypatch.setattr(steps, "Case", Tracked)
    variants = steps.select(["config=tiny", "backend=ascend,torch", "layer=dMoE,MoE"], quick=True)
    settings = steps.Settings(configs=steps.QUICK_CONFIGS, tokens=16, steps=1, warmup=0, profile_steps=0,
                              host_snapshot_bytes=0)
    lines = []
    rows = steps.run(variants, torch.device("cpu"), settings, "torch", lines.append)
    assert len(alive) == len({v.family for v in variants}) == 3 and all(r.get("ok") for r in rows), rows  # (+ sparse)
    assert any(line.startswith("  [tiny dMoE] done in") for line in lines)
    assert any("parameters (" in line and "built in" in line for line in lines)


def test_peak_memory_and_its_ratio_to_upstream(monkeypatch):
    """Each row's peak above resident, from the device's allocator (stood in for here), and its ratio
    to the reference backend's row of the same family and mode."""
    from megablocks_ascend.bench import timing
    peaks = {"torch": 200 * 2**20, "ascend": 150 * 2**20}
    current = {}
    monkeypatch.setattr(timing, "memory_allocated", lambda device: 1000)
    monkeypatch.setattr(timing, "reset_peak_memory", lambda device: None)
    monkeypatch.setattr(timing, "peak_memory_allocated", lambda device: 1000 + peaks[current["backend"]])
    real = steps.build

    def build(v, case):
        current["backend"] = v.backend
        return real(v, case)
    monkeypatch.setattr(steps, "build", build)
    variants = steps.select(["config=tiny", "backend=ascend,torch", "layer=MoE"], quick=True)
    settings = steps.Settings(configs=steps.QUICK_CONFIGS, tokens=16, steps=1, warmup=0, profile_steps=0)
    rows = {r["backend"]: r for r in steps.run(variants, torch.device("cpu"), settings, "torch", lambda s: None)}
    assert rows["torch"]["peak_mib"] == 200 and rows["ascend"]["peak_mib"] == 150
    assert rows["ascend"]["mem_vs_up"] == 0.75 and rows["torch"]["mem_vs_up"] == 1.0
    assert "peak MiB" in steps.table(list(rows.values()))


def test_each_rows_peak_starts_from_no_gradients(monkeypatch):
    """Every row's resident memory is taken after the previous row's gradients are released, so each
    peak holds its own step's gradients: the first row of a family (no gradients before it) and the
    later ones (an earlier row's gradients alive until their step) are measured alike."""
    from megablocks_ascend.bench import timing
    alive_at_resident = []

    def memory_allocated(device):
        case = current["case"]
        alive_at_resident.append(any(p.grad is not None for p in case.params) or case.x.grad is not None)
        return 0
    current = {}
    real = steps.run_variant

    def run_variant(v, case, *args, **kwargs):
        current["case"] = case
        return real(v, case, *args, **kwargs)
    monkeypatch.setattr(timing, "memory_allocated", memory_allocated)
    monkeypatch.setattr(steps, "run_variant", run_variant)
    variants = steps.select(["config=tiny", "backend=ascend,torch", "layer=MoE"], quick=True)
    settings = steps.Settings(configs=steps.QUICK_CONFIGS, tokens=16, steps=1, warmup=0, profile_steps=0)
    rows = steps.run(variants, torch.device("cpu"), settings, "torch", lambda s: None)
    assert all(r.get("ok") for r in rows) and len(alive_at_resident) == len(rows) >= 2
    assert not any(alive_at_resident), alive_at_resident


def test_bench_quick_judges_reduced_layers_and_reports_its_sections(tmp_path):
    """``bench --quick`` on the CPU: its step verdicts go through the reduced-layer path (quick limits),
    every verdict row says which layer it judged, and the run reports each section's seconds."""
    plan = suite.plan_for(torch.device("cpu"), quick=True, configs=["tiny"], sections=("steps",))
    lines = []
    results = suite.run(plan, tmp_path, "q", plot_png=False, log=lines.append)
    judged = [r for r in results["rows"] if r.get("precision")]
    assert judged and all(r["precision_layer"]["reduced"] and r["precision_layer"]["H"] == 32 for r in judged)
    assert all(r["precision_ok"] for r in judged)
    assert set(results["section_seconds"]) == {"steps"}
    assert any(line.startswith("[steps] precision tiny dMoE: a reduced layer of its family") for line in lines)
    assert any(line.startswith("[steps] precision tiny dMoE-sparse: a reduced layer of its family, H=32 ffn=128")
               for line in lines)
    plan.precision_full = True
    results = suite.run(plan, tmp_path, "q", plot_png=False, log=lambda s="": None)
    judged = [r for r in results["rows"] if r.get("precision")]
    assert judged and not any(r["precision_layer"]["reduced"] for r in judged)


def test_the_default_bench_steps_on_cuda():
    """On a CUDA host ``bench`` times ours and upstream's steps, eager and captured, at every config,
    today's fine-grained layers included; the torch backend's step is judged, not timed there. (The
    default run is sized for 5 minutes on an H200 host: BENCHMARKS.md has what it took.)"""
    plan = suite.plan_for(torch.device("cuda"), quick=False)
    assert {"dsv3", "qw3", "e256"} <= set(plan.configs)
    variants = suite.step_variants(plan, graph=True)
    assert {(v.backend, v.mode) for v in variants} == {(b, m) for b in ("ascend", "cuda") for m in ("eager", "graph")}
    # dMoE and MoE, ours and upstream's, eager and graph; the sparse dMoE ours only (upstream refuses it)
    assert len(variants) == len(plan.configs) * (2 * 4 + 2)
    assert {(v.backend, v.mode) for v in variants if v.mlp_impl == "sparse"} == {("ascend", "eager"), ("ascend", "graph")}
    assert suite.step_backends("cuda") == ("ascend", "torch", "cuda")  # all three judged
    assert (plan.steps, plan.warmup, plan.profile_steps) == (10, 2, 1)
    # (elsewhere ours against the torch backend's step: tests/test_bench.py, a stand-in NPU)
