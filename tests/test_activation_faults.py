"""Faults at activation, each injected for real in a fresh process: ``import torch`` must survive
every one that megablocks-ascend can catch, and the user must be told what happened and what to do.

* an invalid ``MEGABLOCKS_ASCEND_AUTOLOAD``; an exception inside the entry point (another library
  left ``sys.meta_path`` a tuple);
* a torch_npu that fails to import (a package on the path raising the linker error torch_npu
  raises where CANN's environment is not set up), with and without its own entry point;
* the stale editable install (entry point present, hook module gone), which torch itself turns
  into an error before any code of ours runs: README's troubleshooting quotes its message;
* three threads importing MegaBlocks and stk at once (docs/notes/activation-safety.md).
"""

import sysconfig

import pytest

import fresh_process as fp

HCCL = "libhccl.so: cannot open shared object file: No such file or directory"


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    return fp.ours(tmp_path_factory.mktemp("dist"))


def broken_torch_npu(where, entry_point=False):
    """A torch_npu 2.14.0 that raises what the real one raises without CANN's libraries."""
    pkg = where / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"raise ImportError({HCCL!r})\n")
    (pkg / "autoload.py").write_text("import torch_npu\ndef _autoload():\n    pass\n")
    fp.fake_distribution(where, "torch-npu", "2.14.0",
                         {"torch_npu": "torch_npu.autoload:_autoload"} if entry_point else None)
    return where


def test_an_invalid_switch_warns_once_and_means_on(dist):
    r = fp.run("""
        import sys, torch, _megablocks_ascend_autoload as hook
        print("hooked", hook.FINDER in sys.meta_path, "enabled", hook.enabled(), hook.enabled())
    """, path=[dist], env={"MEGABLOCKS_ASCEND_AUTOLOAD": "sometimes"})
    assert r.returncode == 0, r.stderr
    assert "hooked True enabled True True" in r.stdout
    warning = ("RuntimeWarning: megablocks-ascend: MEGABLOCKS_ASCEND_AUTOLOAD='sometimes': expected 0 or 1 "
               "(0 turns megablocks-ascend's autoload off); taken as the default, 1 (on)")
    assert r.stderr.count(warning) == 1, r.stderr


def test_an_exception_in_the_entry_point_leaves_import_torch_working_and_is_reported(dist):
    r = fp.run("""
        import sys
        sys.meta_path = tuple(sys.meta_path)  # what another library might leave behind
        import torch
        sys.meta_path = list(sys.meta_path)
        import _megablocks_ascend_autoload as hook
        print("torch", torch.__version__.split("+")[0], "failures", hook.failures())
        import megablocks_ascend, megablocks  # the explicit import still activates the plugin
        from megablocks_ascend.cli import doctor
        print("\\n".join(doctor.report()))
    """, path=[dist])
    assert r.returncode == 0, r.stderr
    assert "failures [\"autoload at import torch: AttributeError: 'tuple' object has no attribute 'insert'\"]" \
        in r.stdout
    assert r.stderr.count("RuntimeWarning: megablocks-ascend: its autoload failed at `import torch` "
                          "(AttributeError") == 1, r.stderr
    assert "Set MEGABLOCKS_ASCEND_AUTOLOAD=0 to turn the autoload off" in r.stderr
    assert "Failed to load the backend extension" not in r.stderr
    assert "to fix:\n  - megablocks-ascend: autoload at import torch: AttributeError" in r.stdout
    assert "patches installed: True" in r.stdout


@pytest.mark.parametrize("first", ["megablocks", "megablocks_ascend"])
def test_a_torch_npu_that_fails_to_import_is_named_with_what_to_do(dist, tmp_path, first):
    r = fp.run(f"""
        import torch
        print("torch imported")
        try:
            import {first}
        except ImportError as e:
            print("ERROR", type(e).__name__, e)
    """, path=[dist, broken_torch_npu(tmp_path)])
    assert r.returncode == 0, r.stderr
    assert "torch imported" in r.stdout
    out = r.stdout.split("ERROR", 1)[1]
    assert "ActivationError megablocks-ascend: torch_npu 2.14.0 is installed but fails to import" in out
    assert HCCL in out and "CANN's environment is not set up" in out and "set_env.sh" in out
    assert "pip uninstall torch-npu" in out and "MEGABLOCKS_ASCEND_AUTOLOAD=0" in out


def test_doctor_reports_a_broken_torch_npu_instead_of_crashing(dist, tmp_path):
    """torch_npu with its own entry point, CANN not set up: `import torch` itself fails in
    torch_npu's autoload unless TORCH_DEVICE_BACKEND_AUTOLOAD=0; doctor reports both cases."""
    path = [dist, broken_torch_npu(tmp_path, entry_point=True)]
    plain = fp.run("import torch", path=path)
    assert plain.returncode != 0 and "Failed to load the backend extension: torch_npu" in plain.stderr
    for env in ({}, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}):
        r = fp.run(args=["-m", "megablocks_ascend", "doctor"], path=path, env=env)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert "megablocks-ascend is not active in this process" in r.stdout
        fixes = r.stdout.split("to fix:", 1)[1]
        assert "torch_npu 2.14.0 is installed but fails to import" in fixes and HCCL in fixes
        assert "tested pairs:" in r.stdout and "torch 2.14.0 + Triton 3.8.0" in r.stdout


def test_the_stale_editable_install_message_is_the_one_readme_quotes(tmp_path):
    """Entry point installed, hook module gone (an editable install whose checkout moved): torch
    raises before any code of ours runs. Reproduced with `python -S` (no .pth files, so no
    editable finder) and site-packages on the path; TORCH_DEVICE_BACKEND_AUTOLOAD=0 gets through."""
    dist = fp.ours(tmp_path / "dist")
    path = [dist, sysconfig.get_paths()["purelib"]]
    r = fp.run(args=["-S", "-c", "import torch"], path=path, checkout=False, cwd=tmp_path)
    assert r.returncode != 0
    message = "RuntimeError: Failed to load the backend extension: megablocks_ascend."
    assert message in r.stderr and "No module named '_megablocks_ascend_autoload'" in r.stderr
    readme = (fp.ROOT / "README.md").read_text()
    assert message in readme and "No module named '_megablocks_ascend_autoload'" in readme
    ok = fp.run(args=["-S", "-c", "import torch"], path=path, checkout=False, cwd=tmp_path,
                env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert ok.returncode == 0, ok.stderr


RACE = """
    import importlib, sys, threading, torch
    import _megablocks_ascend_autoload as hook
    if {unordered}:  # the control: CPython's own order, the window never opened
        hook.install_import_order = lambda reason="": False
    names = {names!r}
    errors, barrier = [], threading.Barrier(len(names))
    def imp(name):
        barrier.wait()
        try:
            {statement}
        except BaseException as e:
            errors.append(f"{{name}}: {{type(e).__name__}}")
    threads = [threading.Thread(target=imp, args=(n,)) for n in names]
    [t.start() for t in threads]
    [t.join() for t in threads]
    import megablocks_ascend
    print("errors", errors, "patched", megablocks_ascend.installed())
"""
ISSUE_NAMES = ("megablocks.layers.dmoe", "stk.ops", "megablocks.ops")  # the issue's three threads


def race(names=ISSUE_NAMES, statement="importlib.import_module(name)", unordered=False):
    return RACE.format(names=tuple(names), statement=statement, unordered=unordered)


def test_threads_importing_after_the_main_thread_imported_megablocks_find_it_patched(dist):
    """The pattern that never needed the import order: MegaBlocks imported before threads start."""
    r = fp.run("import megablocks\n" + race().replace("\n    ", "\n"), path=[dist])
    assert r.returncode == 0, r.stderr
    assert "errors [] patched True" in r.stdout


# A package named like MegaBlocks whose modules import each other as MegaBlocks' do:
# `megablocks/__init__` imports `megablocks.layers.dmoe`, which imports `megablocks.ops`; and a
# loader that takes 0.5 s to create `megablocks`' module (the activation, which imports Triton at
# that moment, takes seconds). The thread importing `megablocks.layers.dmoe` holds `megablocks`'
# lock meanwhile; the one importing `megablocks.ops` 0.2 s later takes that module's lock and waits for
# `megablocks`; with CPython's order the first then waits for `megablocks.ops`: deadlock, every time.
FAKE_MEGABLOCKS = {
    "megablocks/__init__.py": "from megablocks.layers import dmoe\n",
    "megablocks/layers/__init__.py": "",
    "megablocks/layers/dmoe.py": "import megablocks.ops\n",
    "megablocks/ops.py": "",
}


@pytest.mark.parametrize("ordered", [False, True], ids=["cpython-order", "import-order"])
def test_the_import_order_removes_the_cycle_that_megablocks_package_makes(tmp_path, ordered):
    """Without torch or the plugin: only the import-order wrapper, installed or not."""
    for name, text in FAKE_MEGABLOCKS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    r = fp.run(f"""
        import importlib, sys, threading, time
        import _megablocks_ascend_autoload as hook
        import importlib.machinery
        class SlowToCreate(importlib.machinery.SourceFileLoader):
            def create_module(self, spec):  # (not under the global import lock, as find_spec is)
                time.sleep(0.5)
        class Finder:
            def find_spec(self, name, path=None, target=None):
                if name == "megablocks":
                    spec = importlib.machinery.PathFinder.find_spec(name, path)
                    spec.loader.__class__ = SlowToCreate
                    return spec
        sys.meta_path.insert(0, Finder())
        if {ordered}:
            assert hook.install_import_order() and hook.install_import_order()  # (idempotent)
        errors = []
        def imp(name, delay):
            time.sleep(delay)
            try:
                importlib.import_module(name)
            except BaseException as e:
                errors.append(type(e).__name__)
        threads = [threading.Thread(target=imp, args=("megablocks.layers.dmoe", 0)),
                   threading.Thread(target=imp, args=("megablocks.ops", 0.2))]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print("errors", errors, hook.events())
    """, path=[tmp_path], checkout=True, env={"MEGABLOCKS_ASCEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr
    if ordered:
        assert "errors []" in r.stdout, r.stdout
        assert "import order for threads installed" in r.stdout
    else:
        assert "errors ['_DeadlockError']" in r.stdout, r.stdout


@pytest.mark.parametrize("window", [False, True], ids=["never-opened", "opened-late"])
def test_a_thread_that_entered_before_the_window_opened_does_not_deadlock(tmp_path, window):
    """The window opens when MegaBlocks is first seen, which is after the thread that sees it has
    taken its import locks; another thread may have entered CPython's own import a moment before
    (taking its module's lock first, then waiting for the parent). Made deterministic here: the
    same package shaped like MegaBlocks; thread A imports `megablocks.ops` (the package is slow to
    create, holding its lock); thread E imports `megablocks.layers.dmoe` 0.1 s later, with CPython's
    order (it takes the locks of `dmoe` and `layers`, then waits for `megablocks`); the window opens
    at 0.3 s, before `megablocks/__init__` executes and needs `layers` and `dmoe`. Never opened:
    `_DeadlockError`, every time. Opened late: A imports the modules E holds without their locks,
    E returns them; no error."""
    for name, text in FAKE_MEGABLOCKS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    r = fp.run(f"""
        import importlib, sys, threading, time
        import _megablocks_ascend_autoload as hook
        import importlib.machinery
        class SlowToCreate(importlib.machinery.SourceFileLoader):
            def create_module(self, spec):
                time.sleep(0.5)
        class Finder:
            def find_spec(self, name, path=None, target=None):
                if name == "megablocks":
                    spec = importlib.machinery.PathFinder.find_spec(name, path)
                    spec.loader.__class__ = SlowToCreate
                    return spec
        sys.meta_path.insert(0, Finder())
        errors = []
        def imp(name, delay):
            time.sleep(delay)
            try:
                importlib.import_module(name)
            except BaseException as e:
                errors.append(type(e).__name__)
        threads = [threading.Thread(target=imp, args=("megablocks.ops", 0)),
                   threading.Thread(target=imp, args=("megablocks.layers.dmoe", 0.1))]
        [t.start() for t in threads]
        time.sleep(0.3)
        if {window}:
            assert hook.install_import_order("test")
        [t.join() for t in threads]
        import megablocks.layers.dmoe as dmoe, megablocks.ops as ops
        print("errors", errors, "complete", all(m.__spec__._initializing is False for m in (dmoe, ops)))
        print("EVENTS", hook.events())
    """, path=[tmp_path], env={"MEGABLOCKS_ASCEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr
    if window:
        assert "errors [] complete True" in r.stdout, r.stdout
        assert "`megablocks.layers.dmoe` imported without its import lock" in r.stdout
    else:
        assert "errors ['_DeadlockError']" in r.stdout, r.stdout


RUNS = 6  # fresh interpreters per scenario (docs/notes/activation-safety.md: 0 of 57 runs deadlocked)


# (CPython's import locks and the hook, not torch: the current point only in CI. RUNS per scenario.)
@pytest.mark.slow
@pytest.mark.one_point
@pytest.mark.parametrize("names, statement", [
    (ISSUE_NAMES, "importlib.import_module(name)"),
    (ISSUE_NAMES, "__import__(name)"),  # (an import statement: the same path, from C)
    (("megablocks_ascend", "stk", "megablocks.layers.moe", "megablocks", "megablocks.layers.dmoe",
      "stk.ops", "megablocks.ops"), "importlib.import_module(name)"),
], ids=["issue", "import-statement", "seven-threads"])
def test_threads_importing_megablocks_and_stk_at_once_never_deadlock(dist, names, statement):
    """The issue's three threads (and more) in fresh interpreters, torch imported first: no
    ``_DeadlockError``, MegaBlocks patched, every time."""
    for _ in range(RUNS):
        r = fp.run(race(names, statement), path=[dist])
        assert r.returncode == 0, r.stderr
        assert "errors [] patched True" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.one_point
def test_without_the_import_order_the_same_threads_deadlock(dist):
    """The control, showing that the scenario above is a real race here: with CPython's own import
    order (the import-order window never opened), the issue's three threads deadlock."""
    outcomes = [fp.run(race(unordered=True), path=[dist]) for _ in range(3)]
    assert all(r.returncode == 0 for r in outcomes), [r.stderr for r in outcomes]
    assert any("_DeadlockError" in r.stdout for r in outcomes), [r.stdout for r in outcomes]


def test_a_failed_import_of_megablocks_where_it_is_not_installed_activates_nothing(dist):
    """The import-order wrapper activates the plugin before the import of a module of MegaBlocks or
    stk starts, but only where the package is installed: a client's ``try: import megablocks``
    in an environment without it must not import megablocks-ascend (or Triton)."""
    r = fp.run("""
        import sys, torch
        sys.path[:] = [p for p in sys.path if "site-packages" not in p]  # MegaBlocks and stk gone
        sys.path_importer_cache.clear()
        for name in ("megablocks", "stk.ops"):
            try:
                __import__(name)
            except ImportError as e:
                print("failed", type(e).__name__)
        import _megablocks_ascend_autoload as hook
        print("activated", "megablocks_ascend" in sys.modules, "wrapped", hook.import_order_installed())
    """, path=[dist])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["failed", "ModuleNotFoundError"] * 2 + ["activated", "False", "wrapped", "False"], \
        r.stdout
