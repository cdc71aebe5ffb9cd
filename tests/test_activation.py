"""Activation without an import-order trap: the torch.backends entry point and its import hook.

Every scenario runs in a fresh Python process that sees this checkout's package and exactly one
``megablocks-ascend`` distribution: a metadata folder made here, first on the path, declares the
entry point exactly as pyproject.toml does. So the tests do not depend on how (or whether) the
package is installed in the environment that runs them, and they run at whichever torch that
environment has (CI: both version points).
"""

import importlib.machinery
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import pytest

import _megablocks_ascend_autoload as hook
from megablocks_ascend import patching

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENTRY_POINT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch.backends"]

# Upstream alone, where nothing stands in for its CUDA extension: stk fails first where Triton
# asks for a driver when it decorates a kernel (Triton 3.3.1), MegaBlocks' ops otherwise.
_DRIVERLESS = bool(next(p for p in patching.PATCHES if p.name == "triton-driverless").originals)
UPSTREAM_ALONE = "0 active drivers" if _DRIVERLESS else "No module named 'megablocks_ops'"


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory):
    """A folder with a ``megablocks_ascend`` distribution whose only content is the entry point."""
    d = tmp_path_factory.mktemp("dist")
    info = d / "megablocks_ascend-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megablocks-ascend\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[torch.backends]\n" + "".join(f"{name} = {value}\n" for name, value in ENTRY_POINT.items()))
    return d


def run(code, dist_dir, extra_path=(), **env):
    """Run ``code`` in a fresh process (no TRITON_INTERPRET, no backend choice, autoload on
    unless ``env`` says otherwise); return the CompletedProcess."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("TRITON_INTERPRET", "MEGABLOCKS_BACKEND", hook.AUTOLOAD_VAR, hook.TORCH_AUTOLOAD_VAR)}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(dist_dir), *map(str, extra_path), str(ROOT)])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=600)


# A dMoE and a MoE step through the patched layers: our kernels (`ascend`, checked with trace())
# against the `torch` backend, which must agree.
TRAIN = textwrap.dedent("""
    import os, sys, torch
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE
    from megablocks.layers.moe import MoE, clear_load_balancing_loss
    import megablocks_ascend, _megablocks_ascend_autoload as hook
    for name, impl in LAYERS:
        layer_cls = {"dMoE": dMoE, "MoE": MoE}[name]
        torch.manual_seed(0)
        args = Arguments(hidden_size=16, ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2,
                         mlp_impl=impl, fp16=False, bf16=False)
        layer = layer_cls(args)
        x = torch.randn(4, 3, 16)
        grads = {}
        for backend in ("ascend", "torch"):
            layer.zero_grad()
            with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
                out, bias = layer(x)
                (out.square().sum() + bias.sum()).backward()
            clear_load_balancing_loss()
            assert calls and {c.backend for c in calls} == {backend}, (backend, calls)
            grads[backend] = (out.detach(), [p.grad.clone() for p in layer.parameters()])
            assert all(g.abs().sum() > 0 for g in grads[backend][1])
        torch.testing.assert_close(grads["ascend"][0], grads["torch"][0])
        for a, b in zip(grads["ascend"][1], grads["torch"][1]):
            torch.testing.assert_close(a, b)
    print("TRAINED")
    print("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
    print("installed", megablocks_ascend.installed())
    print("hook idle on sys.meta_path", hook.FINDER in sys.meta_path and not hook.FINDER.waiting)
    print("EVENTS", hook.events())
""")


def train(layers="dMoE"):
    """TRAIN for the dMoE (grouped), or with ``layers="dMoE, MoE"`` for the MoE (binned routing) too."""
    impls = {"dMoE": "grouped", "MoE": "sparse"}
    return f"LAYERS = {[(n.strip(), impls[n.strip()]) for n in layers.split(',')]!r}\n" + TRAIN


def _ok(r):
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TRAINED" in r.stdout and "installed True" in r.stdout
    assert "hook idle on sys.meta_path False" in r.stdout
    return r.stdout


def test_pyproject_declares_the_entry_point_and_it_is_the_hook():
    assert ENTRY_POINT == {"megablocks_ascend": "_megablocks_ascend_autoload:autoload"}
    module, _, func = ENTRY_POINT["megablocks_ascend"].partition(":")
    assert getattr(hook, func) is hook.autoload and hook.__name__ == module


def test_installed_metadata_matches_pyproject_when_this_checkout_is_installed():
    """Where the installed distribution is this checkout (CI's editable install), its metadata
    declares the same entry point; elsewhere (another checkout installed, or none) say so and skip."""
    import importlib.metadata
    import json
    try:
        dist = importlib.metadata.distribution("megablocks-ascend")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megablocks-ascend is not installed here (the tests import it from the checkout)")
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if pathlib.Path(url.removeprefix("file://")).resolve() != ROOT:
        pytest.skip(f"the installed megablocks-ascend is another checkout ({url or 'not a local install'})")
    eps = {ep.name: ep.value for ep in dist.entry_points if ep.group == "torch.backends"}
    assert eps == ENTRY_POINT, "reinstall this checkout (pip install --no-deps -e .): its entry point changed"


def test_import_torch_alone_loads_nothing_but_the_hook(dist_dir):
    r = run("""
        import sys, os, torch
        import _megablocks_ascend_autoload as hook
        heavy = [m for m in ("megablocks_ascend", "megablocks", "stk", "triton", "torch_npu") if m in sys.modules]
        print("heavy", heavy, "interp", os.environ.get("TRITON_INTERPRET"), "hooked", hook.FINDER in sys.meta_path)
        print("EVENTS", hook.events())
    """, dist_dir)
    assert r.returncode == 0, r.stderr
    assert "heavy [] interp None hooked True" in r.stdout
    assert "import hook installed by torch's 'torch.backends' entry point (import torch)" in r.stdout


def test_the_hook_module_imports_only_the_standard_library(dist_dir):
    r = run("""
        import sys
        before = set(sys.modules)
        import _megablocks_ascend_autoload as hook
        hook.autoload()
        new = sorted(m.partition(".")[0] for m in set(sys.modules) - before)
        print("new", [m for m in new if m not in sys.stdlib_module_names and m != "_megablocks_ascend_autoload"])
    """, dist_dir)
    assert r.returncode == 0, r.stderr
    assert "new []" in r.stdout


# What `import torch` changes of CPython's import system: the functions of importlib._bootstrap
# (and _bootstrap_external), by identity, before and after.
SNAPSHOT = """
    import importlib._bootstrap as b, importlib._bootstrap_external as be
    def snapshot():
        return {(m.__name__, k): v for m in (b, be) for k, v in vars(m).items() if callable(v)}
"""


def test_import_torch_leaves_cpythons_import_functions_untouched_until_megablocks_is_imported(dist_dir):
    r = run(textwrap.dedent(SNAPSHOT) + textwrap.dedent("""
        import sys
        before = snapshot()
        import torch, json, csv, xml.dom.minidom, torch.distributed  # a torch program without MegaBlocks
        import _megablocks_ascend_autoload as hook
        changed = [k for k, v in snapshot().items() if before.get(k) is not v]
        print("after torch: changed", changed, "hook", hook.FINDER in sys.meta_path)
        import megablocks.layers.dmoe
        print("after megablocks: changed", [k for k, v in snapshot().items() if before.get(k) is not v],
              "hook", hook.FINDER in sys.meta_path)
        print("EVENTS", hook.events())
    """), dist_dir)
    assert r.returncode == 0, r.stderr
    assert "after torch: changed [] hook True" in r.stdout  # (the finder, on the public sys.meta_path)
    assert "after megablocks: changed [] hook False" in r.stdout
    events = r.stdout.split("EVENTS", 1)[1]
    opened = events.index("import order for threads installed (`megablocks` is about to be imported)")
    assert opened < events.index("activated by the import hook") < events.index("import order for threads removed")


WARNER = "import warnings\nwarnings.warn('warned at import', UserWarning, stacklevel=2)\n"
RAISER = "raise RuntimeError('raised at import')\n"


@pytest.mark.parametrize("window", ["after import torch", "with the window open"])
def test_warnings_and_tracebacks_of_other_packages_name_their_importer(dist_dir, tmp_path, window):
    """A module that warns at import with stacklevel=2 is attributed to the line that imported it,
    and an import that fails shows no frame of ours: after `import torch` (nothing of ours is on
    the stack), and while the import-order window is open (its frame counts as the import system's
    for warnings, as CPython's own frames do)."""
    (tmp_path / "warner.py").write_text(WARNER)
    (tmp_path / "raiser.py").write_text(RAISER)
    (tmp_path / "importer.py").write_text("import warner\n")
    r = run(f"""
        import sys, traceback, warnings, torch
        import _megablocks_ascend_autoload as hook
        if {window == "with the window open"}:
            assert hook.install_import_order("test")
        print("wrapped", hook.import_order_installed())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            import importer
        print("WARNED", [(w.filename.rsplit("/", 1)[-1], w.lineno, str(w.message)) for w in seen])
        try:
            import raiser
        except RuntimeError:
            print("TRACEBACK", traceback.format_exc())
    """, dist_dir, extra_path=[tmp_path])
    assert r.returncode == 0, r.stderr
    assert f"wrapped {window != 'after import torch'}" in r.stdout
    assert "WARNED [('importer.py', 1, 'warned at import')]" in r.stdout
    trace = r.stdout.split("TRACEBACK", 1)[1]
    assert "raised at import" in trace and "raiser.py" in trace
    if window == "after import torch":
        assert "megablocks" not in trace.lower(), trace
    else:  # the one frame of the wrapper, under its own name (not a file of the package)
        assert "_megablocks_ascend_autoload.py" not in trace and hook.WRAPPER_FILENAME in trace


def test_megablocks_import_is_quiet_and_passes_with_warnings_as_errors(dist_dir):
    """MegaBlocks' @torch.jit.script (layers/gelu.py) warns 'deprecated' from torch 2.10 on: not
    while MegaBlocks imports (the jit-script-warning patch), with warnings as errors too, and a
    call of torch.jit.script from the program afterwards still warns (no filter is left)."""
    import inspect
    import torch.jit
    torch_warns = "is deprecated" in inspect.getsource(inspect.unwrap(torch.jit.script))
    for first in ("import megablocks_ascend, megablocks", "import torch, megablocks", "import megablocks"):
        r = run(first + textwrap.dedent("""
            import warnings, torch, torch.jit
            print("torch's own", not hasattr(torch.jit.script, "__wrapped__"))
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.jit.script(torch.nn.Identity())
            print("program's call warned", any("deprecated" in str(w.message) for w in seen))
        """), dist_dir, PYTHONWARNINGS="error")
        assert r.returncode == 0, (first, r.stderr)
        assert "Warning" not in r.stderr, (first, r.stderr)
        assert "torch's own True" in r.stdout
        assert f"program's call warned {torch_warns}" in r.stdout


@pytest.mark.parametrize("first", ["import megablocks", "import stk", "import torch"])
def test_whatever_is_imported_first_the_layers_run_through_our_kernels(dist_dir, first):
    out = _ok(run(first + "\n" + train("dMoE, MoE" if first == "import megablocks" else "dMoE"), dist_dir))
    assert "TRITON_INTERPRET 1" in out  # a CPU machine: the plugin switched the interpreter on
    assert "activated by the import hook, just before" in out
    if first != "import torch":  # MegaBlocks or stk was part-way through its import at `import torch`
        assert "the rest deferred until" in out and "remaining patches installed once" in out


def test_a_client_that_swallows_the_import_error_gets_megablocks(dist_dir, tmp_path):
    """LLM Foundry's ffn.py wraps `import megablocks` in try/except ImportError and registers its
    MegaBlocks layers only if that worked; a stand-in client does the same here."""
    (tmp_path / "client.py").write_text(textwrap.dedent("""
        try:
            import megablocks
            import megablocks.layers.dmoe
            is_megablocks_imported = True
        except ImportError:
            is_megablocks_imported = False
    """))
    r = run("import client\nprint('client saw megablocks:', client.is_megablocks_imported)\n" + train(),
            dist_dir, extra_path=[tmp_path])
    out = _ok(r)
    assert "client saw megablocks: True" in out


def test_triton_first_runs_auto_and_says_what_to_set_for_ascend_on_cpu(dist_dir):
    """A program that imported triton before anything else has chosen compiled Triton: the plugin
    does not switch the interpreter on behind its back. CPU tensors are served by `torch` under
    `auto`; `ascend` on CPU tensors says what to set."""
    r = run("""
        import triton, torch, megablocks_ascend, _megablocks_ascend_autoload as hook
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE
        args = Arguments(hidden_size=16, ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2,
                         mlp_impl="grouped", fp16=False, bf16=False)
        layer = dMoE(args)
        with megablocks_ascend.trace() as calls:
            layer(torch.randn(4, 2, 16))[0].sum().backward()
        print("auto:", sorted({c.backend for c in calls}))
        print("EVENTS", hook.events())
        try:
            with megablocks_ascend.use_backend("ascend"):
                layer(torch.randn(4, 2, 16))
        except megablocks_ascend.BackendUnavailable as e:
            print("ascend:", e)
    """, dist_dir)
    assert r.returncode == 0, r.stderr
    assert "auto: ['torch']" in r.stdout
    assert "Triton interpreter left as found: triton was imported before megablocks-ascend" in r.stdout
    assert "ascend: MEGABLOCKS_BACKEND=ascend:" in r.stdout and "TRITON_INTERPRET=1" in r.stdout


def test_triton_first_with_the_interpreter_requested_runs_our_kernels(dist_dir):
    _ok(run("import triton\n" + train(), dist_dir, TRITON_INTERPRET="1"))


@pytest.mark.parametrize("switch", [{hook.AUTOLOAD_VAR: "0"}, {hook.TORCH_AUTOLOAD_VAR: "0"}],
                         ids=["MEGABLOCKS_ASCEND_AUTOLOAD=0", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"])
def test_autoload_off_leaves_upstream_alone_until_the_plugin_is_imported(dist_dir, switch):
    r = run(textwrap.dedent("""
        import sys, _megablocks_ascend_autoload as hook
        try:
            import megablocks
        except Exception as e:
            print("upstream alone:", type(e).__name__, e)
        print("hooked", hook.FINDER in sys.meta_path)
        import megablocks_ascend
    """) + (train() if hook.AUTOLOAD_VAR in switch else "print('TRAINED', 'installed', megablocks_ascend.installed())"),
        dist_dir, TRITON_INTERPRET="1", **switch)  # the failed import imported triton
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "upstream alone: " in out and UPSTREAM_ALONE in out
    assert "hooked False" in out and "installed True" in out
    if hook.AUTOLOAD_VAR not in switch:
        return  # torch's switch: the same path from here on
    # `import megablocks_ascend` (in TRAIN, after the failed import) activates the plugin and
    # repairs MegaBlocks, as it always did
    assert "activated by `import megablocks_ascend`" in out and "activated by the import hook" not in out


def test_an_invalid_autoload_value_warns_and_import_torch_goes_on(dist_dir):
    """(It used to make `import torch` fail; tests/test_activation_faults.py has the rest.)"""
    r = run("import torch, megablocks; print('ok')", dist_dir, **{hook.AUTOLOAD_VAR: "sometimes"})
    assert r.returncode == 0, r.stderr
    assert "MEGABLOCKS_ASCEND_AUTOLOAD='sometimes': expected 0 or 1" in r.stderr and "ok" in r.stdout


def test_a_client_that_swallowed_the_error_with_autoload_off_is_warned_about(dist_dir, tmp_path):
    """What the plugin cannot repair: LLM Foundry imported MegaBlocks before the plugin was active,
    swallowed the ImportError and registered no MegaBlocks layers. It says so, and what to do."""
    pkg = tmp_path / "llmfoundry" / "models" / "layers"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "llmfoundry", tmp_path / "llmfoundry" / "models", pkg):
        (d / "__init__.py").write_text("")
    # (Exception, not ImportError: at Triton 3.3.1 stk fails with a RuntimeError before MegaBlocks
    # gets to its missing extension, which LLM Foundry would not swallow.)
    (pkg / "ffn.py").write_text("try:\n    import megablocks\n    is_megablocks_imported = True\n"
                                "except Exception:\n    is_megablocks_imported = False\n")
    r = run("""
        import warnings
        warnings.simplefilter("always")
        import llmfoundry.models.layers.ffn as ffn
        print("client saw megablocks:", ffn.is_megablocks_imported)
        import megablocks_ascend
    """, dist_dir, extra_path=[tmp_path], **{hook.AUTOLOAD_VAR: "0"})
    assert r.returncode == 0, r.stderr
    assert "client saw megablocks: False" in r.stdout
    assert "RuntimeWarning: llmfoundry was imported before megablocks-ascend was active" in r.stderr
    assert "import megablocks_ascend` before llmfoundry" in r.stderr


def test_megablocks_that_cannot_be_patched_fails_to_import_and_nothing_stays_patched(dist_dir):
    """A patch that fails once MegaBlocks has finished importing (here one made to fail) takes
    every patch back, and `import megablocks` fails, again on the next attempt: never half-patched."""
    r = run("""
        import sys, torch, _megablocks_ascend_autoload as hook
        activate = hook.FINDER.before

        def activate_then_break_a_patch(name):
            activate(name)
            from megablocks_ascend import patching
            def fail(patch):
                raise patching.PatchError("simulated upstream change")
            next(p for p in patching.PATCHES if p.name == "routing-ops").apply = fail

        hook.FINDER.before = activate_then_break_a_patch
        for attempt in (1, 2):
            try:
                import megablocks
                print("imported")
            except ImportError as e:
                print(f"attempt {attempt}:", e)
            from megablocks_ascend import patching
            print("patched:", [p.name for p in patching.PATCHES if p.originals],
                  "megablocks in sys.modules:", "megablocks" in sys.modules,
                  "megablocks_ops:", "megablocks_ops" in sys.modules)
    """, dist_dir)
    assert r.returncode == 0, r.stderr
    assert "imported" not in r.stdout.split("attempt")[0]
    for attempt in (1, 2):
        assert f"attempt {attempt}: megablocks-ascend could not patch megablocks (PatchError: simulated " \
               "upstream change)" in r.stdout
    assert "MEGABLOCKS_ASCEND_AUTOLOAD=0" in r.stdout
    assert r.stdout.count("patched: [] megablocks in sys.modules: False megablocks_ops: False") == 2


# ---------------------------------------------------------------------------------------------
# The mechanism: watching a module start and finish executing.


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    pkg = tmp_path / "toy_watched"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import toy_watched.sub\nLOG.append('toy_watched body ran')\n"
                                     "if FAIL: raise ValueError('toy failure')\n")
    (pkg / "sub.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "toy_watched"
    for name in ("toy_watched", "toy_watched.sub"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("fail", [False, True])
def test_watch_calls_back_before_and_after_a_module_executes(toy_package, fail):
    import builtins
    log = []
    builtins.LOG, builtins.FAIL = log, fail
    try:
        spec = importlib.util.find_spec(toy_package)
        loader = spec.loader
        assert hook.watch(spec, on_start=lambda n: log.append(f"start {n}"),
                          on_end=lambda n, ok: log.append(f"end {n} {ok}"))
        # what `import toy_watched` does with this spec
        if fail:
            with pytest.raises(ValueError, match="toy failure"):
                importlib._bootstrap._load(spec)
        else:
            module = importlib._bootstrap._load(spec)
            assert module.__loader__ is loader and type(module.__spec__) is importlib.machinery.ModuleSpec
        assert log == ["start toy_watched", "toy_watched body ran", f"end toy_watched {not fail}"]
        assert type(spec) is importlib.machinery.ModuleSpec  # the plain class is back
    finally:
        del builtins.LOG, builtins.FAIL


def test_watch_refuses_a_spec_of_another_class():
    class OtherSpec(importlib.machinery.ModuleSpec):
        pass

    assert not hook.watch(OtherSpec("x", None), on_start=print)


def test_when_imported_calls_back_now_or_once_the_module_has_been_imported(toy_package):
    import builtins
    builtins.LOG, builtins.FAIL = [], False
    try:
        seen = []
        hook.when_imported(toy_package, lambda m: seen.append(m.__name__))  # not imported yet: waits
        assert seen == [] and hook.FINDER in sys.meta_path
        importlib.import_module(toy_package)
        assert seen == [toy_package]
        assert toy_package not in hook.FINDER.waiting
        hook.when_imported(toy_package, lambda m: seen.append("again"))  # imported: at once
        assert seen == [toy_package, "again"]
    finally:
        del builtins.LOG, builtins.FAIL
        hook.FINDER.retire_if_idle()
    # off sys.meta_path unless it still waits for something else (where LLM Foundry is installed,
    # the llmfoundry-device-mesh patch waits for LLM Foundry's module)
    assert (hook.FINDER in sys.meta_path) == bool(hook.FINDER.waiting)


def test_install_before_import_applies_only_the_patches_that_need_no_megablocks():
    early = {p.name for p in patching.PATCHES if not p.needs_megablocks}
    assert early == {"triton-driverless", "megablocks-ops-extension", "grouped-gemm", "triton-interpreter-index",
                     "jit-script-warning"}
    import torch.jit
    jit_script = torch.jit.script
    patching.uninstall()
    try:
        patching.install_before_import()
        assert {p.name for p in patching.PATCHES if p.applied} == early and not patching.installed()
        jit = next(p for p in patching.PATCHES if p.name == "jit-script-warning")
        assert (torch.jit.script is not jit_script) == bool(jit.originals)  # (applied where torch warns)
        patching.install()
        # every patch in place, but those for the time MegaBlocks imports, which install() took back
        assert all(p.applied != p.import_only for p in patching.PATCHES) and patching.installed()
        assert torch.jit.script is jit_script
    finally:
        patching.install()


def test_a_failing_patch_after_install_before_import_takes_every_patch_back(monkeypatch):
    patching.uninstall()
    broken = next(p for p in patching.PATCHES if p.name == "routing-ops")
    try:
        patching.install_before_import()

        def fail(patch):
            raise patching.PatchError("simulated")
        monkeypatch.setattr(broken, "apply", fail)
        with pytest.raises(patching.PatchError, match="simulated"):
            patching.install()
        assert not any(p.applied or p.originals for p in patching.PATCHES) and not patching.installed()
    finally:
        monkeypatch.undo()
        patching.install()
    assert patching.installed()
