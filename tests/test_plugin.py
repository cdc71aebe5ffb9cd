"""Registration, the backend toggle, and the patch registry."""

import importlib
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import megablocks
import megablocks.backend.kernels as upstream_kernels
import megablocks.ops as upstream_ops
import megablocks_ascend
from megablocks.layers.arguments import Arguments
from megablocks_ascend import backends, ops, patching
from megablocks_ascend.patching import registry, triton_driverless

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _routing(tokens=6, experts=3, top_k=2):
    top = torch.randint(0, experts, (tokens * top_k,), dtype=torch.int32)
    bin_ids, indices = torch.sort(top, stable=True)
    bins = torch.cumsum(torch.bincount(top, minlength=experts), 0).int()
    return indices.int(), bin_ids.int(), bins


def _run_python(code, env_drop=(), **env):
    environ = {k: v for k, v in os.environ.items() if k not in env_drop}
    environ.update(env)
    environ["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=300)


# ---------------------------------------------------------------------------------------------
# Backend selection and the routing record.


@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_env_var_selects_backend(monkeypatch, backend):
    monkeypatch.setenv("MEGABLOCKS_BACKEND", backend)
    x = torch.randn(6, 8)
    indices, bin_ids, bins = _routing()
    with megablocks_ascend.trace() as calls:
        megablocks.ops.gather(x, indices, bin_ids, bins, 2)
        upstream_kernels.binned_gather(x, indices, None, bins, 4, 2)
    assert [(c.op, c.backend, c.device) for c in calls] == [
        ("gather", backend, "cpu"), ("binned_gather", backend, "cpu")]
    assert megablocks_ascend.last_backend("binned_gather") == backend


def test_auto_serves_cpu_tensors_with_torch(monkeypatch):
    monkeypatch.delenv("MEGABLOCKS_BACKEND", raising=False)
    assert megablocks_ascend.resolve(torch.device("cpu")) == "torch"
    assert megablocks_ascend.resolve(torch.device("cuda", 0)) == "cuda"


def test_auto_sends_npu_tensors_to_ascend_or_says_why(monkeypatch):
    monkeypatch.delenv("MEGABLOCKS_BACKEND", raising=False)
    npu = types.SimpleNamespace(type="npu", index=0)  # torch.device("npu") needs torch_npu
    monkeypatch.setattr(megablocks_ascend.compat, "is_triton_ascend", lambda: True)
    assert megablocks_ascend.resolve(npu) == "ascend"
    monkeypatch.setattr(megablocks_ascend.compat, "is_triton_ascend", lambda: False)
    with pytest.raises(megablocks_ascend.BackendUnavailable, match="triton-ascend"):
        megablocks_ascend.resolve(npu)


def test_use_backend_overrides_env_and_nests(monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_BACKEND", "torch")
    with megablocks_ascend.use_backend("ascend"):
        assert megablocks_ascend.requested() == "ascend"
        with megablocks_ascend.use_backend("auto"):
            assert megablocks_ascend.requested() == "auto"
        assert megablocks_ascend.requested() == "ascend"
    assert megablocks_ascend.requested() == "torch"


def test_unknown_backend_is_rejected_with_the_valid_values(monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_BACKEND", "gpu")
    with pytest.raises(ValueError, match="auto, ascend, cuda, torch"):
        megablocks_ascend.requested()
    with pytest.raises(ValueError, match="valid values"):
        with megablocks_ascend.use_backend("npu"):
            pass


def test_cuda_backend_on_cpu_tensors_is_a_clear_error_and_runs_nothing():
    x = torch.randn(6, 8)
    indices, bin_ids, bins = _routing()
    before = x.clone()
    with megablocks_ascend.use_backend("cuda"), megablocks_ascend.trace() as calls:
        with pytest.raises(megablocks_ascend.BackendUnavailable, match="MEGABLOCKS_BACKEND=ascend"):
            megablocks.ops.gather(x, indices, bin_ids, bins, 2)
    assert calls == []
    assert torch.equal(x, before)


def test_ascend_on_cpu_without_the_interpreter_says_what_to_set():
    r = _run_python("""
        import triton  # imported before the plugin, without TRITON_INTERPRET
        import torch, megablocks_ascend, megablocks
        top = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
        bin_ids, indices = torch.sort(top, stable=True)
        bins = torch.tensor([2, 4], dtype=torch.int32)
        with megablocks_ascend.use_backend("ascend"):
            megablocks.ops.gather(torch.randn(4, 8), indices.int(), bin_ids.int(), bins, 1)
    """, env_drop=("TRITON_INTERPRET",))
    assert r.returncode != 0
    assert "BackendUnavailable" in r.stderr and "TRITON_INTERPRET=1" in r.stderr, r.stderr


def test_fresh_process_cpu_machine_runs_ascend_without_any_setting():
    r = _run_python("""
        import os, torch, megablocks_ascend
        assert os.environ["TRITON_INTERPRET"] == "1"
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE
        args = Arguments(hidden_size=16, ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2,
                         mlp_impl="grouped", fp16=False, bf16=False)
        with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
            out, bias = dMoE(args)(torch.randn(4, 2, 16))
        print(sorted({(c.op, c.backend) for c in calls}))
    """, env_drop=("TRITON_INTERPRET", "MEGABLOCKS_BACKEND"))
    assert r.returncode == 0, r.stderr
    assert "('gather', 'ascend')" in r.stdout and "('scatter', 'ascend')" in r.stdout


def test_megablocks_imported_first_fails_then_plugin_repairs_it():
    # Where Triton has no driver and asks for one when stk decorates its kernels (Triton 3.3.1),
    # stk fails first; elsewhere MegaBlocks' missing CUDA extension does.
    driverless = bool(triton_driverless.PATCH.originals)
    first_error = ("RuntimeError: 0 active drivers" if driverless
                   else "ModuleNotFoundError: No module named 'megablocks_ops'")
    r = _run_python("""
        try:
            import megablocks
        except (ModuleNotFoundError, RuntimeError) as e:
            print(f"upstream alone: {type(e).__name__}: {e}")
        import megablocks_ascend
        import megablocks
        from megablocks import grouped_gemm_util
        assert grouped_gemm_util.grouped_gemm_is_available()
        from megablocks.layers.arguments import Arguments
        Arguments(hidden_size=8, ffn_hidden_size=8, mlp_impl="grouped", fp16=False)
        print("repaired")
    """, MEGABLOCKS_ASCEND_AUTOLOAD="0")  # with the autoload on, `import megablocks` works first
    assert r.returncode == 0, r.stderr
    assert f"upstream alone: {first_error}" in r.stdout
    assert "repaired" in r.stdout


# ---------------------------------------------------------------------------------------------
# Patches: install, uninstall, shape checks, documentation.


def _targets_now():
    return {
        "kernels": {n: getattr(upstream_kernels, n) for n in backends.SPECS},
        "ops": {n: getattr(upstream_ops, n) for n in ops.OPS},
        "init": Arguments.__dict__["__init__"],
    }


def test_install_is_idempotent():
    before = _targets_now()
    patching.install()
    patching.install()
    assert _targets_now() == before
    assert all(getattr(f, "__megablocks_ascend__", False) for f in before["kernels"].values())
    assert before["ops"] == ops.OPS


def test_uninstall_restores_every_original_exactly_and_install_comes_back():
    patched = _targets_now()
    originals = {p.name: dict(p.originals) for p in patching.PATCHES}
    try:
        patching.uninstall()
        assert not patching.installed()
        for name in backends.SPECS:
            assert getattr(upstream_kernels, name) is backends.UPSTREAM[name]
        assert upstream_ops.binned_gather is importlib.import_module("megablocks.ops.binned_gather").binned_gather
        assert upstream_ops.scatter is importlib.import_module("megablocks.ops.scatter").scatter
        assert Arguments.__dict__["__init__"] is originals["arguments-device"][
            "megablocks.layers.arguments:Arguments.__init__"]
        for patch in patching.PATCHES:
            for target, original in originals[patch.name].items():
                if target.startswith("sys.modules"):
                    continue
                owner, attr = registry.owner(target)
                now = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
                assert now is original, target
    finally:
        patching.install()
    now = _targets_now()
    assert now["kernels"] == patched["kernels"] and now["ops"] == patched["ops"]
    assert now["init"].__wrapped__ is patched["init"].__wrapped__


def test_patch_refuses_an_upstream_function_whose_signature_changed(monkeypatch):
    patching.uninstall()
    try:
        def binned_gather(x, indices, weights, bins, capacity, top_k, extra=None):  # changed shape
            raise AssertionError("must not be called")
        monkeypatch.setattr(upstream_kernels, "binned_gather", binned_gather)
        backends.UPSTREAM.pop("binned_gather", None)
        with pytest.raises(patching.PatchError, match="binned_gather"):
            patching.install()
        assert not patching.installed()
        assert upstream_kernels.binned_gather is binned_gather  # nothing left half-patched
        assert not getattr(upstream_kernels.gather, "__megablocks_ascend__", False)
    finally:
        monkeypatch.undo()
        backends.UPSTREAM.pop("binned_gather", None)
        patching.install()
    assert getattr(upstream_kernels.binned_gather, "__megablocks_ascend__", False)


def test_registry_applies_in_order_rolls_back_a_half_applied_patch_and_restores_exactly(monkeypatch):
    """The registry on its own, over a throwaway module: what install/uninstall promise for the
    real patches (order, idempotence, rollback of a patch that fails half-way and of every patch
    before it, ``is``-identical originals, registered modules removed)."""
    target = types.ModuleType("_registry_target")
    a, b, c = object(), object(), object()
    target.a, target.b = a, b  # no attribute c: a patch that adds one must delete it again
    monkeypatch.setitem(sys.modules, "_registry_target", target)
    calls, fail = [], [True]

    def first(p):
        calls.append(p.name)
        p.replace("_registry_target.a", "new a")
        p.set_module("_registry_standin", types.ModuleType("_registry_standin"))

    def second(p):
        calls.append(p.name)
        p.replace("_registry_target.b", "new b")
        p.replace("_registry_target.c", "new c")
        if fail[0]:
            raise registry.PatchError("upstream changed")  # after two of its replacements

    def patch(name, apply, needs_megablocks=False):
        return registry.Patch(name=name, targets=(), why="", how="", upstream_fix="", apply=apply,
                              needs_megablocks=needs_megablocks)

    reg = registry.Registry([patch("first", first), patch("second", second)])
    with pytest.raises(registry.PatchError, match="upstream changed"):
        reg.install()
    assert calls == ["first", "second"] and not reg.installed()
    assert target.a is a and target.b is b and not hasattr(target, "c")
    assert "_registry_standin" not in sys.modules
    assert not any(p.applied or p.originals for p in reg.patches)

    fail[0] = False
    reg.install()
    reg.install()  # a no-op
    assert calls == ["first", "second"] * 2 and reg.installed()
    assert (target.a, target.b, target.c) == ("new a", "new b", "new c") and "_registry_standin" in sys.modules
    reg.uninstall()
    assert target.a is a and target.b is b and not hasattr(target, "c")
    assert "_registry_standin" not in sys.modules and not reg.installed()

    with pytest.raises(ValueError, match="unique"):
        registry.Registry([patch("first", first), patch("first", second)])
    # A patch that needs MegaBlocks refuses to run without it, and what ran before is rolled back.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megablocks" else 1)
    reg = registry.Registry([patch("first", first), patch("second", second, needs_megablocks=True)])
    with pytest.raises(registry.PatchError, match="MegaBlocks is not installed"):
        reg.install()
    assert target.a is a and "_registry_standin" not in sys.modules and calls[-1] == "first"


def test_an_import_only_patch_is_in_place_until_install_ends(monkeypatch):
    """`import_only` patches (jit-script-warning): applied with the patches MegaBlocks needs while it
    imports, taken back at the end of install(), once every patch has imported what it patches."""
    target = types.SimpleNamespace(a="a", b="b")
    monkeypatch.setitem(sys.modules, "_registry_target2", target)
    seen = []

    def during(p):
        p.replace("_registry_target2.a", "during import")

    def later(p):
        seen.append(target.a)  # what a patch that imports MegaBlocks sees
        p.replace("_registry_target2.b", "patched")

    reg = registry.Registry([
        registry.Patch(name="during", targets=(), why="", how="", upstream_fix="", apply=during,
                       needs_megablocks=False, import_only=True),
        registry.Patch(name="later", targets=(), why="", how="", upstream_fix="", apply=later,
                       needs_megablocks=False)])
    reg.install_before_import()
    assert target.a == "during import" and not reg.installed()
    reg.install()
    assert seen == ["during import"] and target.a == "a" and target.b == "patched" and reg.installed()
    assert [p.applied for p in reg.patches] == [False, True]
    reg.uninstall()
    assert target.b == "b"


def test_arguments_default_device_is_cpu_here_and_explicit_device_wins():
    assert Arguments(mlp_impl="grouped").device == torch.device("cpu")
    assert Arguments(mlp_impl="grouped", device=torch.device("meta")).device == torch.device("meta")


def test_cast_if_autocast_enabled_follows_the_tensor_device():
    from megablocks.layers import common
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert common.cast_if_autocast_enabled(x).dtype == torch.bfloat16
    assert common.cast_if_autocast_enabled(x).dtype == torch.float32


def test_every_patch_module_is_registered_once_under_its_own_name():
    """One module per patch: every module in megablocks_ascend/patching/ but the registry is in
    ORDER, each module's PATCH is named after it and is the registry's, in ORDER's order. (The
    registry and the pages' tool are the two modules there that are not patches.)"""
    folder = ROOT / "megablocks_ascend" / "patching"
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__", "registry", "pages"}
    assert sorted(patching.ORDER) == sorted(modules)  # each listed once, none forgotten
    assert len(set(patching.ORDER)) == len(patching.ORDER)
    assert patching.ORDER[0] == "triton_driverless"  # every later patch imports stk
    assert [m.__name__ for m in patching.MODULES] == [f"megablocks_ascend.patching.{n}" for n in patching.ORDER]
    for name, module, patch in zip(patching.ORDER, patching.MODULES, patching.PATCHES, strict=True):
        assert module.PATCH is patch and isinstance(patch, patching.Patch)
        assert patch.name == name.replace("_", "-"), (name, patch.name)
        assert patch.apply is module.apply, name
        assert f"patches/{patch.name}.md" in module.__doc__, name
    assert patching.REGISTRY.patches == patching.PATCHES


def test_every_patch_is_documented_in_patches_folder():
    documented = {p.stem for p in (ROOT / "patches").glob("*.md") if p.name != "README.md"}
    assert documented == {p.name for p in patching.PATCHES}
    assert documented == {m.replace("_", "-") for m in patching.ORDER}
    index = (ROOT / "patches" / "README.md").read_text()
    for patch in patching.PATCHES:
        text = (ROOT / "patches" / f"{patch.name}.md").read_text()
        for target in patch.targets:
            assert target in text, (patch.name, target)
        for heading in ("## Why", "## How", "## Upstream fix", "## Tests"):
            assert heading in text, (patch.name, heading)
        assert f"[{patch.name}]" in index


def test_every_patch_record_is_the_first_paragraph_of_its_pages_sections():
    """PATCH.why, .how and .upstream_fix are the one source of the first paragraph of the page's
    ``## Why``, ``## How`` and ``## Upstream fix`` (``python -m megablocks_ascend.patching.pages
    --write`` rewrites them from the records)."""
    from megablocks_ascend.patching import pages
    assert pages.stale() == {}


def test_the_pages_tool_rewrites_exactly_the_first_paragraphs():
    """With every section's first paragraph replaced, a rewrite gives back each section's record,
    and touches nothing else of the page."""
    from megablocks_ascend.patching import pages
    for patch in patching.PATCHES:
        page = (ROOT / "patches" / f"{patch.name}.md").read_text()
        lines = page.splitlines()
        for heading in reversed(pages.SECTIONS.values()):
            start, end = pages._lead(lines, heading)
            lines[start:end] = ["Out of date.", "Two lines."]
        broken = "\n".join(lines) + "\n"
        assert len(pages.differences(patch, broken)) == 3, patch.name
        fixed = pages.rewrite(patch, broken)
        assert pages.differences(patch, fixed) == [], patch.name
        assert pages.rewrite(patch, page) == page, patch.name  # an agreeing page is left as it is
        assert _outside_leads(fixed) == _outside_leads(page), patch.name  # the rest is the page's own


def _outside_leads(page: str) -> list[str]:
    """The page's lines but the first paragraph of each of the record's sections."""
    from megablocks_ascend.patching import pages
    lines = page.splitlines()
    for heading in reversed(pages.SECTIONS.values()):
        start, end = pages._lead(lines, heading)
        del lines[start:end]
    return lines


def test_use_backend_also_serves_backward_run_by_another_thread():
    """On CUDA and NPU the autograd engine runs backward on its own threads: the override must
    reach them (seen on an H200: without this, backward fell back to MEGABLOCKS_BACKEND)."""
    import threading

    seen = []
    with megablocks_ascend.use_backend("ascend"):
        t = threading.Thread(target=lambda: seen.append(megablocks_ascend.requested()))
        t.start()
        t.join()
    assert seen == ["ascend"]


def test_upstream_calling_its_siblings_is_not_dispatched_twice(monkeypatch):
    """Upstream's scatter() calls padded_scatter() by module-global name, which is our dispatcher
    after patching; that inner call must go straight to upstream, unrecorded and unvalidated."""
    inner = []

    def fake_upstream_scatter(x, indices, bin_ids, weights, bins, top_k):
        return upstream_kernels.padded_scatter(x, indices, bin_ids, weights, bins, bins, top_k)

    def fake_upstream_padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k):
        inner.append("padded_scatter")
        return x[: indices.shape[0] // top_k]

    monkeypatch.setitem(backends.UPSTREAM, "scatter", fake_upstream_scatter)
    monkeypatch.setitem(backends.UPSTREAM, "padded_scatter", fake_upstream_padded_scatter)
    monkeypatch.setattr(backends, "resolve", lambda device: "cuda")
    indices, bin_ids, bins = _routing()
    with megablocks_ascend.trace() as calls:
        backends.KERNELS["scatter"](torch.randn(12, 8), indices, bin_ids, None, bins, 2)
    assert [c.op for c in calls] == ["scatter"] and inner == ["padded_scatter"]


def test_route_map_is_reused_within_a_step_and_recomputed_when_the_routing_changes(monkeypatch):
    from megablocks_ascend.kernels import routing

    routing.clear_route_maps()
    launches = []
    real = routing._compute_route_map
    monkeypatch.setattr(routing, "_compute_route_map", lambda *a, **k: launches.append(1) or real(*a, **k))
    indices, bin_ids, bins = _routing(tokens=8, experts=3, top_k=2)
    first = routing.route_map(indices, bins, None, layout=routing.DROPLESS)
    assert routing.route_map(indices, bins, None, layout=routing.DROPLESS) is first and len(launches) == 1
    routing.route_map(indices, bins, None, layout=routing.BINNED, capacity=2)  # another layout
    assert len(launches) == 2
    before = first.clone()
    indices.copy_(indices.flip(0))  # in place: same storage, new version
    again = routing.route_map(indices, bins, None, layout=routing.DROPLESS)
    assert len(launches) == 3 and again is not first
    torch.testing.assert_close(first, before)  # a cached map is never written over
    # the map really follows the new routing
    assert torch.equal(again[indices.long()], torch.arange(16, dtype=torch.int32))


@pytest.mark.parametrize("layer_kind", ["MoE", "dMoE-grouped", "dMoE-sparse"])
def test_a_whole_layer_step_launches_no_route_map(monkeypatch, layer_kind):
    """The routing preparation writes the step's route map in its own launch: none of the routing
    calls (forward gather and scatter, both backwards, the weight gradient) launches one. With
    upstream's preparation (the routing-preparation patch taken out), the first routing call
    computes it and the others share it."""
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE
    from megablocks.layers.moe import MoE, clear_load_balancing_loss
    from megablocks_ascend.kernels import routing

    cls = MoE if layer_kind == "MoE" else dMoE
    args = Arguments(hidden_size=16, ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2,
                     mlp_impl="sparse" if layer_kind == "dMoE-sparse" else "grouped", fp16=False, bf16=False,
                     moe_loss_weight=0.0)
    layer = cls(args)
    routing.clear_route_maps()
    launches = []
    real = routing._compute_route_map
    monkeypatch.setattr(routing, "_compute_route_map", lambda *a, **k: launches.append(1) or real(*a, **k))

    def step():
        with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
            out, bias = layer(torch.randn(4, 2, 16, requires_grad=True))
            out.sum().backward()
        clear_load_balancing_loss()
        return {c.op for c in calls}

    assert "prepare_routing" in step() and launches == []
    patch = next(p for p in patching.PATCHES if p.name == "routing-preparation")
    patch.revert()
    try:
        assert "prepare_routing" not in step()
    finally:
        patch.apply(patch)
        patch.applied = True
    assert len(launches) == 1


def test_route_map_under_inference_mode():
    from megablocks_ascend.kernels import routing

    with torch.inference_mode():
        indices, bin_ids, bins = _routing(tokens=8, experts=3, top_k=2)
        a = routing.route_map(indices, bins, None, layout=routing.DROPLESS)
        assert torch.equal(a[indices.long()], torch.arange(16, dtype=torch.int32))


def test_an_installed_torch_npu_is_imported_so_the_npu_device_exists(tmp_path):
    """On an Ascend machine the npu device only exists once torch_npu is imported; the plugin
    imports it (a stand-in package here records that it was imported)."""
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text("import builtins\nbuiltins._fake_torch_npu_imported = True\n")
    r = _run_python("""
        import builtins, os, megablocks_ascend
        print("imported:", getattr(builtins, "_fake_torch_npu_imported", False))
        print("interpreter forced:", os.environ.get("TRITON_INTERPRET"))
    """, env_drop=("TRITON_INTERPRET",), PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    assert r.returncode == 0, r.stderr
    assert "imported: True" in r.stdout
    assert "interpreter forced: None" in r.stdout  # an NPU machine compiles, it does not interpret
