"""Smoke tests of the layer-step harness (benchmarks/bench_steps.py) and the host-time harness
(benchmarks/bench_dispatch.py): ``--quick`` runs on CPU (Triton interpreter) and produces the
table and the JSON. They measure nothing; the real numbers come from a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(script, *args, tmp_path, timeout=300):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", "--out", str(tmp_path),
                        *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    return p.stdout


def test_bench_steps_quick_cpu(tmp_path):
    """Every field of the variant table goes through: eager rows are checked against the
    reference backend and timed, the sparse dMoE included; variants that cannot run here (graph
    capture without CUDA) are error rows, and the run goes on."""
    out = _run("bench_steps.py", "--only", "config=tiny", "--only", "mode=eager,graph",
               "--only", "mlp_impl=grouped,sparse", "--only", "wgrad_fill=empty,full", tmp_path=tmp_path)
    report = json.loads((tmp_path / "bench_steps.json").read_text())
    rows = report["rows"]
    assert "config   layer backend mode" in out and "floor ms" in out
    # The before/after rows: the earlier full masked fill of weight gradients, grouped dMoE only.
    full = [r for r in rows if r["wgrad_fill"] == "full"]
    assert full and all((r["layer"], r["mlp_impl"]) == ("dMoE", "grouped") for r in full)
    assert all(r["ok"] for r in full if r["mode"] == "eager")
    # The routing-bytes floor: dMoE rows only (T=32, k=2, H=64, bf16: 2 gathers, 2 scatters, 1 wgrad).
    n, t, h, meta = 64, 32, 64, 64 * 4 + 4 * 4
    want = 2 * (t * h * 2 + meta + n * h * 2) + 2 * (n * h * 2 + meta + t * h * 2) + n * 2 \
        + (n * h * 2 + t * h * 2 + meta + n * 2)
    assert {r["routing_bytes"] for r in rows if r["layer"] == "dMoE" and r.get("ok")} == {want}
    assert not any("routing_bytes" in r for r in rows if r["layer"] == "MoE")
    eager = [r for r in rows if r["mode"] == "eager" and r["mlp_impl"] == "grouped" and r["wgrad_fill"] == "empty"]
    assert {(r["layer"], r["backend"]) for r in eager} == {(l, b) for l in ("dMoE", "MoE") for b in ("ascend", "torch")}
    for r in eager:
        assert "error" not in r, r
        assert r["ok"] and r["wall_ms"] > 0 and r["vs_up"] > 0
        if r["backend"] == "ascend":
            assert 0 <= r["err"] <= 2e-2  # checked against the reference before it was timed
    # host syncs per eager step, counted on the CPU too (the detector the host-sync tests use): none
    # wherever the grouped GEMM takes device sizes; where it cannot (the CPU stand-in's loop before
    # torch 2.9), the dMoE keeps upstream's host copy of the token counts (tests/test_host_sync.py)
    import torch  # noqa: PLC0415
    from megablocks_ascend.native import grouped_gemm  # noqa: PLC0415
    tiny = report["configs"]["tiny"]
    device_sizes = grouped_gemm.takes_device_sizes(torch.device("cpu"), torch.bfloat16, (tiny["H"], tiny["ffn"]),
                                                   tiny["E"])
    for r in eager:
        if r["layer"] == "MoE" or device_sizes:
            assert r["syncs"] == 0, (r["layer"], r["backend"], r["syncs"])
        else:
            assert r["syncs"] > 0, (r["layer"], r["backend"], r["syncs"])
    # launches per eager step (the CPU counter): ours well under the plain-PyTorch reference's
    launches = {(r["layer"], r["backend"]): r["launches"] for r in eager}
    for layer in ("dMoE", "MoE"):
        assert 0 < launches[(layer, "ascend")] < launches[(layer, "torch")], launches
    graph = [r for r in rows if r["mode"] == "graph" and r["mlp_impl"] == "grouped"]
    assert graph and all("needs graph capture" in r["error"] for r in graph)
    sparse = [r for r in rows if r["layer"] == "dMoE" and r["mlp_impl"] == "sparse"]
    assert {r["backend"] for r in sparse if r["mode"] == "eager" and r.get("ok")} == {"ascend", "torch"}
    assert all("needs graph capture" in r["error"] for r in sparse if r["mode"] == "graph")
    assert not any(r["layer"] == "MoE" and r["mlp_impl"] == "sparse" for r in rows)  # no such variant


def test_a_steps_instruments_count_on_any_device():
    """The step rows' launches and syncs come from the harness's instruments, which count on the
    CPU as on a device: one ``.item()`` is seen by both of the detector's layers."""
    import torch  # noqa: PLC0415

    from megablocks_ascend.bench import instruments  # noqa: PLC0415
    cpu, x = torch.device("cpu"), torch.ones(4)
    assert instruments.count_syncs(lambda: x.sum().item(), cpu) == 2  # Tensor.item, aten._local_scalar_dense
    assert instruments.count_syncs(lambda: x.sum(), cpu) == 0
    assert instruments.count_launches(lambda: x + 1, cpu) == (1, None)
    assert instruments.count_cuda_syncs(lambda: None, cpu) is None  # the cross-check is CUDA's


def test_launches_per_step_quick_cpu(tmp_path):
    """benchmarks/launches_per_step.py on the CPU, MoE only: ours and upstream's kernels (the
    interpreter, upstream's patches lifted for the step) are counted with their source lines, and
    our step launches no more than upstream's."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "launches_per_step.py"), "--layers", "MoE",
                        "--backends", "ascend,upstream", "--out", str(tmp_path), "--name", "lps"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["backend"]: r for r in json.loads((tmp_path / "lps.json").read_text())["rows"]}
    assert set(rows) == {"ascend", "upstream"} and not any("error" in r for r in rows.values()), rows
    wheres = {b: {e["where"].split(":")[0] for e in r["launches"]} for b, r in rows.items()}
    assert "megablocks_ascend/kernels/routing.py" in wheres["ascend"]
    assert "megablocks/backend/kernels.py" in wheres["upstream"]  # upstream's own kernels ran
    assert "megablocks/backend/kernels.py" not in wheres["ascend"]
    assert rows["ascend"]["total"] <= rows["upstream"]["total"]
    assert "| origin | line | op | ascend | upstream |" in (tmp_path / "lps.md").read_text()


def test_bench_steps_rejects_unknown_fields(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_steps.py"), "--quick", "--only",
                        "mode=fast"], capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert p.returncode != 0 and "unknown mode ['fast']" in p.stderr


def test_bench_dispatch_quick_cpu(tmp_path):
    # 285 s alone on a 2-core machine at torch 2.7.1 (the interpreter's host path), over 300 s
    # with the rest of the suite beside it: a generous limit, the run is a smoke test.
    out = _run("bench_dispatch.py", tmp_path=tmp_path, timeout=900)
    report = json.loads((tmp_path / "bench_dispatch.json").read_text())
    rows = report["results"]["stub"]["rows"]
    assert len(rows) == 10 and "launch stubbed" in out
    (prep,) = [r for r in rows if r["op"] == "prepare_routing"]  # the routing preparation, ours vs upstream's
    assert prep["ours op"] > 0 and prep["upstream op"] > 0
    for r in rows:
        if r is prep:
            continue
        for key in ("ours dispatch", "ours launcher", "ours check_routing", "ours resolve", "upstream kernel"):
            assert r[key] > 0, (r, key)
        # the levels nest: the dispatcher costs at least its launcher
        assert r["ours dispatch"] >= r["ours launcher"] * 0.5
