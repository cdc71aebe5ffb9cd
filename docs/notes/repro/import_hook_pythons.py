"""Check the import hook's mechanism on any Python (no torch needed): a toy `stk` package and a toy
package that watches itself while executing. Run with each interpreter, e.g.

    python3.12 docs/notes/repro/import_hook_pythons.py

Prints the callbacks seen, in order; docs/notes/dropin.md has the output for 3.11, 3.12 and 3.13.
"""

import builtins
import importlib.util
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[3]
tmp = pathlib.Path(tempfile.mkdtemp())
(tmp / "stk").mkdir()
(tmp / "stk" / "__init__.py").write_text("import builtins\nbuiltins.LOG.append('stk body')\nimport stk.sub\n")
(tmp / "stk" / "sub.py").write_text("import builtins\nbuiltins.LOG.append('stk.sub body')\n")
(tmp / "toyw").mkdir()
(tmp / "toyw" / "__init__.py").write_text(
    "import builtins, sys, _megablocks_ascend_autoload as h\n"
    "h.when_imported('toyw', lambda m: builtins.LOG.append('when_imported'))\n"
    "h.watch(sys.modules['toyw'].__spec__, on_end=lambda n, ok: builtins.LOG.append(f'end {n} {ok}'))\n"
    "if builtins.FAIL: raise ValueError('toy failure')\n")
sys.path[:0] = [str(tmp), str(ROOT)]

import _megablocks_ascend_autoload as hook  # noqa: E402

builtins.LOG = []
hook.FINDER.before = lambda n: builtins.LOG.append(f"before {n} (starting: {hook.starting().name})")
hook.FINDER.after = lambda n, ok: builtins.LOG.append(f"after {n} {ok}")
sys.meta_path.insert(0, hook.FINDER)
assert importlib.util.find_spec("stk") is not None and builtins.LOG == []  # finding executes nothing
import stk  # noqa: E402,F401

print(sys.version.split()[0], "stk:", builtins.LOG, type(sys.modules["stk"].__spec__).__name__)
hook.FINDER.before = hook.FINDER.after = None
for fail in (False, True):
    builtins.LOG, builtins.FAIL = [], fail
    try:
        import toyw  # noqa: F401
    except ValueError:
        pass
    print(sys.version.split()[0], "toyw", "failing:" if fail else "ok:", builtins.LOG, "in sys.modules:",
          "toyw" in sys.modules)
    sys.modules.pop("toyw", None)
