"""What differs between the version points CI runs (torch 2.13 + Triton 3.9, torch 2.7.1 + Triton
3.3.1) and the Ascend toolchain without an NPU: the two Triton patches and resolve-dtensor.

Each patch applies only where its Triton fails without it. The tests that say whether it must
apply ask that Triton itself, in a fresh process without the plugin, so they check the patch's
own detection independently at either point; the tests of what a patch does force it on, so they
run at both points too.
"""

import os
import pathlib
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from megablocks_ascend import compat, patching

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _patch(name):
    (patch,) = [p for p in patching.PATCHES if p.name == name]
    return patch


def _run_python(code, python=sys.executable, **env):
    environ = dict(os.environ, **env)
    environ["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
    return subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=300)


# ---------------------------------------------------------------------------------------------
# triton-driverless


def test_driverless_patch_is_applied_exactly_where_stk_cannot_be_imported_alone():
    # No plugin: what a user of this Triton sees. The autoload must be off, or importing stk would
    # import the plugin first (and apply the patch) wherever the package is installed.
    alone = _run_python("import stk", MEGABLOCKS_ASCEND_AUTOLOAD="0")
    if alone.returncode != 0:
        assert "0 active drivers" in alone.stderr, alone.stderr  # any other failure: a broken env
    needed = alone.returncode != 0
    applied = bool(_patch("triton-driverless").originals)
    print(f"triton {triton.__version__}: import stk alone {'fails' if needed else 'works'}; "
          f"triton-driverless {'applied' if applied else 'not applied'}")
    assert applied == needed


@triton.jit
def _fill(out, n, value, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out + offs, tl.zeros((BLOCK,), tl.int32) + value, mask=offs < n)


@pytest.fixture
def driverless(monkeypatch):
    """The triton-driverless patch applied as on a machine without a driver, whatever this one is;
    put back as it was afterwards."""
    patch = _patch("triton-driverless")
    was_applied = bool(patch.originals)
    patch.revert()
    monkeypatch.setattr(compat, "autotuner_needs_driver", lambda: True)
    monkeypatch.setattr(compat, "active_drivers", lambda: [])
    try:
        patch.apply(patch)
        patch.applied = True
        assert patch.originals
        yield patch
    finally:
        patch.revert()
        monkeypatch.undo()
        patch.apply(patch)
        patch.applied = True
        assert bool(patch.originals) == was_applied


def test_autotuner_without_a_driver_refuses_to_time_configs_and_runs_with_one(driverless):
    configs = [triton.Config({"BLOCK": 8}), triton.Config({"BLOCK": 16})]
    two = triton.autotune(configs=configs, key=["n"])(_fill)
    assert isinstance(two.do_bench, compat.RefusingBenchmarker)
    out = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(compat.NoTritonDriver, match=r"_fill was asked to time its 2 configs.*no active driver"):
        two[(1,)](out, 8, 7)
    assert torch.count_nonzero(out) == 0  # refused before any config ran
    assert not two.cache  # and nothing was recorded as the best config

    one = triton.autotune(configs=configs[:1], key=["n"])(_fill)
    one[(1,)](out, 8, 7)
    assert out.tolist() == [7] * 8

    def mine(kernel_call, quantiles):
        return [1.0, 1.0, 1.0]

    own = triton.autotune(configs=configs, key=["n"], do_bench=mine)(_fill)
    assert own.do_bench is mine  # an autotuner's own benchmarker is left alone


def test_driverless_patch_uninstalls_and_refuses_an_autotuner_it_does_not_know(driverless, monkeypatch):
    from triton.runtime.autotuner import Autotuner
    wrapped = Autotuner.__init__
    assert wrapped.__wrapped__ is driverless.originals["triton.runtime.autotuner:Autotuner.__init__"]
    driverless.revert()
    assert Autotuner.__init__ is wrapped.__wrapped__
    monkeypatch.setattr(Autotuner, "__init__", lambda self, fn, arg_names, configs: None)
    with pytest.raises(patching.PatchError, match="do_bench"):
        driverless.apply(driverless)
    assert not driverless.originals


def test_upstream_kernels_with_five_configs_refuse_where_triton_has_no_driver():
    """Upstream MegaBlocks' routing kernels are autotuned over five configs: where Triton has no
    driver, calling one must fail loudly, and with the patch in our words (not with fake timings)."""
    r = _run_python("""
        import torch, megablocks_ascend
        from megablocks_ascend import backends, compat
        from megablocks_ascend.patching import triton_driverless
        applied = bool(triton_driverless.PATCH.originals)
        x = torch.randn(6, 8)
        before = x.clone()
        indices = torch.arange(12, dtype=torch.int32)
        bins = torch.tensor([4, 8, 12], dtype=torch.int32)
        try:
            backends._upstream("binned_gather")(x, indices, None, bins, 4, 2)
        except compat.NoTritonDriver as e:
            print("refused:", e)
        except RuntimeError as e:
            print("triton:", e)
        else:
            print("ran")
        print("applied:", applied, "drivers:", compat.active_drivers(), "x untouched:", torch.equal(x, before))
    """)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    print(out)
    if "applied: True" in out:
        assert "refused: triton.autotune of megablocks.backend.kernels._binned_copy was asked to time its 5 configs" in out
    elif "drivers: []" in out:
        assert "triton: 0 active drivers" in out  # a Triton that asks only when it benchmarks
    else:
        assert "ran" in out
    assert "x untouched: True" in out


def test_fresh_process_imports_megablocks_and_trains_on_the_torch_backend():
    r = _run_python("""
        import megablocks_ascend
        import megablocks
        import torch
        import stk.backend.triton_kernels as stk_kernels
        from triton.runtime.autotuner import Autotuner
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE
        from megablocks_ascend import compat
        from megablocks_ascend.patching import triton_driverless

        applied = bool(triton_driverless.PATCH.originals)
        tuners = [v for v in vars(stk_kernels).values() if isinstance(v, Autotuner)]
        assert tuners
        if applied:
            assert all(isinstance(t.do_bench, compat.RefusingBenchmarker) and len(t.configs) == 1 for t in tuners)
        args = Arguments(hidden_size=16, ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2,
                         mlp_impl="grouped", fp16=False, bf16=False)
        layer = dMoE(args)
        x = torch.randn(4, 2, 16, requires_grad=True)
        with megablocks_ascend.use_backend("torch"), megablocks_ascend.trace() as calls:
            out, bias = layer(x)
            out.sum().backward()
        print("backends:", sorted({c.backend for c in calls}), "ops:", sorted({c.op for c in calls}))
        print("finite:", bool(torch.isfinite(x.grad).all()) and x.grad.abs().sum().item() > 0)
        print("applied:", applied)
    """, MEGABLOCKS_BACKEND="auto")
    assert r.returncode == 0, r.stderr
    assert "backends: ['torch']" in r.stdout and "'scatter'" in r.stdout and "finite: True" in r.stdout
    print(r.stdout)


def _ascend_venv() -> pathlib.Path:
    return pathlib.Path(os.environ.get("ASCEND_VENV", ROOT / ".venv-ascend"))


@pytest.mark.skipif(not (_ascend_venv() / "bin" / "python").exists(),
                    reason="no lowering venv (.venv-ascend): `ASCEND_LOWER_SKIP_RUN=1 bash "
                           "tools/ascend_lowering_env.sh` makes it (CI does, before the tests)")
def test_ascend_toolchain_without_npu_runs_doctor_and_lower_with_megablocks_installed():
    python = _ascend_venv() / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # as a user's shell would be
    have = subprocess.run([str(python), "-c", "import importlib.util as u; "
                           "print(bool(u.find_spec('megablocks') and u.find_spec('stk')))"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert have.stdout.strip() == "True", (
        f"{python} lacks MegaBlocks or stk: run tools/ascend_lowering_env.sh again\n{have.stderr}")

    doctor = subprocess.run([str(python), "-m", "megablocks_ascend", "doctor"], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=300)
    assert doctor.returncode == 0, doctor.stderr
    text = doctor.stdout
    assert "triton-ascend      3.2.0" in text and "megablocks         0.10.0" in text
    assert "active driver: none" in text and "patches installed: True" in text
    assert "triton-driverless          1 target(s) replaced" in text
    assert "routing-kernels            9 target(s) replaced" in text

    lower = subprocess.run([str(python), "-m", "megablocks_ascend", "lower", "--only", "_route_map", "--experts", "8"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert lower.returncode == 0, lower.stdout + lower.stderr
    assert lower.stdout.splitlines()[-1] == "lowered: 3/3"


# ---------------------------------------------------------------------------------------------
# triton-interpreter-index


def test_interpreter_index_patch_is_applied_exactly_where_the_interpreter_fails_alone():
    alone = _run_python("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch, triton, triton.language as tl

        @triton.jit
        def count(out, n):
            for i in range(tl.program_id(0), n, tl.num_programs(0)):
                tl.store(out + i, i)

        out = torch.zeros(5, dtype=torch.int32)
        try:
            count[(2,)](out, 5)
            print("works", out.tolist())
        except Exception as e:
            print("fails", repr(e))
    """, MEGABLOCKS_ASCEND_AUTOLOAD="0")  # the autoload off: this Triton without the plugin
    assert alone.returncode == 0, alone.stderr
    fails = alone.stdout.startswith("fails")
    if fails:
        assert "only 0-dimensional arrays can be converted to Python scalars" in alone.stdout
    else:
        assert "works [0, 1, 2, 3, 4]" in alone.stdout
    applied = bool(_patch("triton-interpreter-index").originals)
    print(f"triton {triton.__version__}, numpy {np.__version__}: interpreter alone "
          f"{'fails' if fails else 'works'}; triton-interpreter-index {'applied' if applied else 'not applied'}")
    assert applied == fails


def test_interpreter_index_converts_one_element_arrays_and_refuses_larger_ones():
    def scalar(data):
        return types.SimpleNamespace(handle=types.SimpleNamespace(data=data))

    assert compat.interpreter_index(scalar(np.array([5], dtype=np.int32))) == 5
    assert compat.interpreter_index(scalar(np.array(6, dtype=np.int64))) == 6
    with pytest.raises(TypeError):
        compat.interpreter_index(scalar(np.array([1, 2], dtype=np.int32)))


@pytest.mark.parametrize("form", ["direct", "scope"])
def test_interpreter_index_patch_handles_both_forms_of_the_interpreter(monkeypatch, form):
    """Triton 3.3.1 sets tl.tensor's methods directly; 3.6 through a scope that restores them after
    each launch (seen on the H200: the same failure). A stand-in of each form, with the broken
    definition, is detected and fixed, and the scope still restores what it set."""
    from triton.runtime import interpreter

    class Scope:
        def __init__(self):
            self.changes = []

        def set_attr(self, obj, name, value):
            self.changes.append((obj, name, obj.__dict__.get(name)))
            setattr(obj, name, value)

        def restore(self):
            while self.changes:
                obj, name, value = self.changes.pop()
                setattr(obj, name, value)

    def broken(self):
        return int(self.handle.data)  # what 3.3.1 and 3.6.0 define

    if form == "direct":
        def fake(tensor):
            tensor.__index__ = broken
    else:
        def fake(tensor, scope):
            scope.set_attr(tensor, "__index__", broken)

    class Tensor:
        __index__ = None

    patch = _patch("triton-interpreter-index")
    was_applied = bool(patch.originals)
    patch.revert()
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", fake)
    monkeypatch.setattr(compat, "interpreter_active", lambda: True)
    try:
        assert compat.interpreter_index_broken() == (np.lib.NumpyVersion(np.__version__) >= "2.4.0")
        monkeypatch.setattr(compat, "interpreter_index_broken", lambda: True)
        patch.apply(patch)
        assert interpreter._patch_lang_tensor.__wrapped__ is fake
        scope = Scope()
        interpreter._patch_lang_tensor(Tensor, *([scope] if form == "scope" else []))
        assert Tensor.__index__ is compat.interpreter_index
        probe = Tensor()
        probe.handle = types.SimpleNamespace(data=np.array([4], dtype=np.int32))
        assert range(10)[probe] == 4
        if form == "scope":
            scope.restore()
            assert Tensor.__index__ is None  # as before the launch
    finally:
        patch.revert()
        monkeypatch.undo()
        patch.apply(patch)
        patch.applied = True
    assert bool(patch.originals) == was_applied


@triton.jit
def _walk_sum(counts, out, BLOCK: tl.constexpr):
    # a loop whose bounds are all interpreted scalars: program id, a reduction, program count
    total = tl.sum(tl.load(counts + tl.arange(0, BLOCK)), axis=0)
    for i in range(tl.program_id(0), total, tl.num_programs(0)):
        tl.store(out + i, i * 2)


def test_loops_bounded_by_computed_scalars_run_in_this_interpreter():
    counts = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    out = torch.full((12,), -1, dtype=torch.int32)
    _walk_sum[(3,)](counts, out, BLOCK=4)
    assert out.tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, -1, -1]


# ---------------------------------------------------------------------------------------------
# resolve-dtensor


def test_resolve_dtensor_is_one_function_that_unwraps_dtensors_and_passes_tensors_through():
    import megablocks.layers.glu as glu
    import megablocks.layers.mlp as mlp
    assert glu.resolve_dtensor is mlp.resolve_dtensor
    assert mlp.resolve_dtensor.__wrapped__ is _patch("resolve-dtensor").originals[
        "megablocks.layers.mlp.resolve_dtensor"]
    w = torch.randn(3, 4)
    assert mlp.resolve_dtensor(w) is w and mlp.resolve_dtensor.__wrapped__(w) is w
    r = _run_python("""
        import os, torch, torch.distributed as dist
        import megablocks_ascend
        import megablocks.layers.mlp as mlp
        from torch.distributed._tensor import DTensor, Replicate
        from torch.distributed.device_mesh import init_device_mesh
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
        local = torch.randn(3, 4)
        d = DTensor.from_local(local, init_device_mesh("cpu", (1,)), [Replicate()])
        ours, upstream = mlp.resolve_dtensor(d), mlp.resolve_dtensor.__wrapped__(d)
        print(type(ours).__name__, type(upstream).__name__, torch.equal(ours, local), torch.equal(upstream, local))
        dist.destroy_process_group()
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["Tensor", "Tensor", "True", "True"]
