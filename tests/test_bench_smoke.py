"""Smoke test of benchmarks/bench_routing.py: --quick runs on CPU (Triton interpreter) and
produces the table and the JSON. It measures nothing; the real numbers come from a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_routing.py"


def test_bench_routing_quick_cpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--prep", "--no-plot", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]

    ops = ("binned_gather", "binned_scatter", "binned_scatter_wgrad", "gather", "scatter", "scatter_wgrad",
           "padded_gather", "padded_scatter", "padded_scatter_wgrad")
    table = p.stdout[p.stdout.index("op                     shape"):]
    for op in ops:
        for impl in ("ours", "upstream", "torch"):
            assert any(line.split()[:3] == [op, "quick", impl] for line in table.splitlines()), (op, impl)

    report = json.loads((tmp_path / "bench_routing.json").read_text())
    assert report["copy_ceiling"]["GBps"] > 0
    assert {(r["op"], r["impl"]) for r in report["results"]} == {(o, i) for o in ops
                                                                  for i in ("ours", "upstream", "torch")}
    for r in report["results"]:
        assert r["ms"] > 0 and r["min_bytes"] > 0
    # Correctness of ours against upstream is checked before timing, at these tiny shapes too.
    assert len(report["checks"]) == len(ops)
    assert all(c["ok"] for c in report["checks"]), [c for c in report["checks"] if not c["ok"]]
    # On a CPU nothing about a device is measured, so no target is judged, and it says so: no
    # "MISSED" from the interpreter's times, no nan (targets are judged on a GPU: test_bench_targets_*).
    assert report["targets"] == {} and report["targets_judged"] is False
    assert "measures nothing about a device" in p.stdout and "targets: not judged" in p.stdout
    assert "MISSED" not in p.stdout and "nan" not in p.stdout
    # --prep: the routing preparation of each layer kind, ours equal to upstream's sequence, timed
    variants = [(r["shape"], r["variant"]) for r in report["prep"]]
    assert variants == [("quick", v) for v in ("binned", "dropless", "padded")]
    assert all(r["ok"] and r["ours_ms"] > 0 and r["upstream_ms"] > 0 for r in report["prep"]), report["prep"]


def test_ab_routing_quick_cpu(tmp_path):
    """benchmarks/ab_routing.py --quick: every section runs, and both versions of every op (here the
    working tree's routing.py against itself) pass the check against upstream."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    baseline = REPO / "megablocks_ascend" / "kernels" / "routing.py"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ab_routing.py"), "--quick", "--baseline",
                        str(baseline), "--patterns", "--host", "--out", str(tmp_path), "--name", "ab"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    report = json.loads((tmp_path / "ab.json").read_text())
    ops = [r for r in report["ab"] if "ok" in r]
    assert len(ops) == 9 and all(r["ok"] == {"base": True, "new": True} for r in ops), ops
    assert {r["op"] for r in report["ab"] if "ok" not in r} == {"route_map[0]", "route_map[1]", "route_map[2]"}
    assert not any("WRONG" in name for name in report["patterns"]["quick"])  # the probe kernel's copy is exact
    assert len(report["host"]) == 15
    # Nothing is timed on a CPU, and it says so: no nan anywhere; the route maps of both versions agree.
    assert report["timed"] is False and "measures nothing about a device" in p.stdout
    assert "nan" not in p.stdout, [line for line in p.stdout.splitlines() if "nan" in line]
    assert all(r["same_maps"] for r in report["ab"] if "ok" not in r)


def test_bench_blocksparse_quick_cpu(tmp_path):
    """benchmarks/bench_blocksparse.py --quick: MegaBlocks' topology at a tiny shape, every kernel call
    of the sparse dMoE checked against the float32 reference, stk's own kernels in a child process,
    the sweep; table and JSON."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_blocksparse.py"), "--quick", "--out",
                        str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    report = json.loads((tmp_path / "bench_blocksparse.json").read_text())
    (res,) = report["results"].values()
    calls = [r["call"] for r in res["rows"]]
    assert len(calls) == 6 and {r["form"] for r in res["rows"]} == {"sdd", "dsd", "dsdT"}
    assert all(r["ok"] and r["unwritten"] == 0 and r["ms"] > 0 for r in res["rows"])
    # stk's kernels ran in the child (block indices are small here, so they are correct too)
    assert all(r["stk"].get("ok") and r["stk"]["ms"] > 0 for r in res["rows"]), [r["stk"] for r in res["rows"]]
    assert res["row_indices_ok"] and res["sweep"] and all(r["ok"] for r in res["sweep"])
    assert report["targets"]["all_checks_pass"]["met"] is True
    assert report["targets"]["each_kernel_70pct_of_dense"]["met"] is None  # no GPU: not applicable
    table = p.stdout[p.stdout.index("shape     call"):]
    for call in calls:
        assert any(line.startswith("quick") and call in line for line in table.splitlines()), call


def test_bench_blocksparse_goes_on_after_a_faulting_child(tmp_path, monkeypatch):
    """stk_runs: a child that faults on a call (its CUDA context gone) is replaced by a new one for
    the calls left; a child that dies without a word is charged with the call it was on."""
    from megablocks_ascend.bench import blocksparse as bench  # noqa: PLC0415
    script = [  # what each successive child writes, and its exit status
        ([dict(shape="s", call="a", ok=True, ms=1.0),
          dict(shape="s", call="b", ok=False, crashed=True, error="RuntimeError: CUDA error: illegal address")], 3),
        ([], -11),  # dies on "c" without writing anything
        ([dict(shape="s", call="d", ok=True, ms=2.0)], 0),
    ]
    seen = []

    def fake_run(cmd, **kwargs):
        lines, rc = script[len(seen)]
        seen.append(json.loads(cmd[cmd.index("--stk-child") + 1]))
        out = Path(cmd[cmd.index("--stk-out") + 1])
        out.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return subprocess.CompletedProcess(cmd, rc, "", "Segmentation fault" if rc < 0 else "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    logged = []
    res = bench.stk_runs([("s", c) for c in "abcd"], torch.float16, True, logged.append, tmp_path)
    assert [len(x) for x in seen] == [4, 2, 1]  # a, b ran; then c, d; then d
    assert res[("s", "a")]["ok"] and res[("s", "d")]["ok"]
    assert res[("s", "b")]["crashed"] and res[("s", "c")]["crashed"] and "Segmentation" in res[("s", "c")]["error"]
    assert sum("CRASHED" in line for line in logged) == 2


def test_profile_host_quick_cpu(tmp_path):
    """benchmarks/profile_host.py --quick: both backends' eager steps profiled, a table per backend."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_host.py"), "--quick", "--out",
                        str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    results = json.loads((tmp_path / "profile_host.json").read_text())["results"]
    assert set(results) == {"torch", "ascend"}
    assert all(r["host_ms_per_step"] > 0 and r["top"] for r in results.values())


def test_bench_checks_quick_cpu(tmp_path):
    """benchmarks/bench_checks.py at a tiny routing: each op timed with the checks off and on, the
    table printed, the environment and the rows in the JSON."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    out = tmp_path / "checks.json"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_checks.py"), "--backend", "ascend",
                        "--tokens", "32", "--hidden", "32", "--experts", "4", "--repeat", "1", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["environment"]["device"].startswith("cpu")
    assert [r["op"] for r in report["results"]] == ["binned_gather", "gather", "scatter"]
    assert all(r["ms_checks_off"] > 0 and r["ms_checks_on"] > 0 for r in report["results"])
    assert "checks on ms" in p.stdout


def test_every_benchmark_script_is_a_front_over_the_harness():
    """benchmarks/ holds command lines: each takes --device, and none carries its own device
    timing, synchronization, profiling or environment code (megablocks_ascend.bench has them, for
    an NPU, CUDA and the CPU alike)."""
    import ast  # noqa: PLC0415
    own = {"torch.cuda.synchronize", "torch.cuda.Event", "torch.cuda.set_sync_debug_mode", "triton.testing.do_bench",
           "torch.profiler", "platform"}
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    assert scripts
    for path in scripts:
        tree = ast.parse(path.read_text())
        fronted = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("megablocks_ascend.bench.") and [a.name for a in n.names] == ["main"]]
        if fronted:  # a front of a harness module's main: that module takes --device
            assert len(path.read_text().splitlines()) <= 20, path.name
            path = REPO / (fronted[0].replace(".", "/") + ".py")
            tree = ast.parse(path.read_text())
        used = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name))}
        calls = {(ast.unparse(n.func), *(ast.unparse(a) for a in n.args)) for n in ast.walk(tree)
                 if isinstance(n, ast.Call)}
        assert ("ap.add_argument", "'--device'") in calls or ("p.add_argument", "'--device'") in calls, path.name
        assert not used & own, (path.name, used & own)
        assert ("torch.device", "'cuda'") not in calls, path.name


def test_bench_targets_are_judged_on_device_times():
    """The routing table's targets (judged on a GPU; on a CPU bench_routing does not judge them)."""
    from megablocks_ascend.bench import routing_table as rt
    rows = [dict(op="scatter", shape="big", impl="ours", frac_ceiling=0.95, speedup_vs_upstream=4.0, check_ok=True),
            dict(op="gather", shape="big", impl="ours", frac_ceiling=0.5, speedup_vs_upstream=0.9, check_ok=True)]
    t = rt.targets(rows, None, {"big": {}})
    assert t["ceiling_90pct_large_shapes"]["met"] is False and t["never_slower_than_upstream"]["met"] is False
    assert t["scatter_3x_upstream"]["met"] is True and t["all_checks_pass"]["met"] is True


@pytest.mark.parametrize("script", ["bench_routing.py", "ab_routing.py", "bench_dispatch.py"])
def test_benchmarks_write_under_out_and_by_default_nowhere_git_sees(tmp_path, script):
    """--out's default is $OUT, else ./bench-results (ignored by git): a smoke run in a checkout leaves
    `git status` clean. Run from a scratch folder here, without --out."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    extra = {"ab_routing.py": ["--baseline", str(REPO / "megablocks_ascend" / "kernels" / "routing.py")],
             "bench_routing.py": ["--no-plot"], "bench_dispatch.py": []}[script]
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", *extra],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    written = sorted(x.relative_to(tmp_path).as_posix() for x in tmp_path.rglob("*") if x.is_file())
    assert written and all(w.startswith("bench-results/") for w in written), written
    ignored = subprocess.run(["git", "check-ignore", "-q", "bench-results/x.json"], cwd=REPO)
    assert ignored.returncode == 0, "bench-results/ is not ignored by .gitignore"


def test_ab_routing_baseline_runs_on_its_own_kernels(tmp_path):
    """A baseline's host code (routing.py) runs on the baseline's kernels (routing_kernels.py), from a
    revision or from files, never on the working tree's; the working tree's module is left in place."""
    from megablocks_ascend import kernels
    from megablocks_ascend.kernels import routing_kernels

    from megablocks_ascend.bench import routing_ab as ab

    here = REPO / "megablocks_ascend" / "kernels"
    (tmp_path / "routing.py").write_text((here / "routing.py").read_text())
    (tmp_path / "routing_kernels.py").write_text((here / "routing_kernels.py").read_text()
                                                 + "\nBASELINE_MARK = 'from the baseline'\n")
    base = ab.load_routing(str(tmp_path / "routing.py"))
    assert base.routing_kernels.BASELINE_MARK == "from the baseline"
    assert base.routing_kernels is not routing_kernels and kernels.routing_kernels is routing_kernels
    assert sys.modules["megablocks_ascend.kernels.routing_kernels"] is routing_kernels
    head = ab.load_routing("HEAD")
    assert head.routing_kernels is not routing_kernels and callable(head.gather)
    (tmp_path / "routing_kernels.py").unlink()
    with pytest.raises(SystemExit, match="no routing_kernels.py"):
        ab.load_routing(str(tmp_path / "routing.py"))
    with pytest.raises(SystemExit, match="neither a file nor a revision"):
        ab.load_routing("no-such-revision-xyz")
