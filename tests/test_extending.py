"""docs/notes/extending.md's checklists, held against the code where the code can tell: the files
they name exist, the tables that must agree do, and the package imports no cycle."""

from __future__ import annotations

import ast
import importlib
import re
import tokenize
from pathlib import Path

import pytest

from megablocks_ascend import __main__ as cli_main
from megablocks_ascend import backends, envs, keeping
from megablocks_ascend.lowering import table

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megablocks_ascend"
DOC = ROOT / "docs" / "notes" / "extending.md"


def _doc() -> str:
    return DOC.read_text()


def test_every_file_the_checklists_name_exists():
    paths = set(re.findall(r"`((?:megablocks_ascend|tests|patches|docs)/[^`<>]+?)`", _doc()))
    assert len(paths) > 20, paths
    for path in sorted(paths):
        assert (ROOT / path).exists(), path


LONG = 600  # lines: a module past it says why it is one idea ("One idea: ..." in its docstring)


def test_a_long_module_says_why_it_is_one_idea():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if len(path.read_text().splitlines()) <= LONG:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "One idea: " in doc, f"{name}: over {LONG} lines, and its docstring does not say why it is one idea"


def test_the_tests_folder_holds_tests_and_their_helpers_sit_in_support():
    """tests/ holds test files and conftest.py; what they import (references, fakes, detectors)
    is in tests/support/, which holds no test. (census_variants.py: kernels the gate's tests load
    by module path, tests.census_variants.)"""
    tests = ROOT / "tests"
    loose = {p.name for p in tests.glob("*.py")
             if not p.name.startswith("test_") and p.name not in ("conftest.py", "census_variants.py")}
    assert not loose, sorted(loose)
    support = {p.name for p in (tests / "support").glob("*.py")}
    assert support and not {n for n in support if n.startswith("test_")}


def test_every_link_reaches_a_heading():
    for target, anchor in re.findall(r"\]\(([^)#]+)#([^)]+)\)", _doc()):
        text = (DOC.parent / target).read_text()
        headings = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
                    for h in re.findall(r"^#+ (.+)$", text, re.M)}
        assert anchor in headings, (target, anchor)


# ------------------------------------------------------------------------------------------
# A kernel


def test_every_kernel_module_is_in_the_gates_table():
    """A new family (a new file in kernels/ with kernels of its own) must have its kernels in the
    gate's table, which tests/test_lowering.py then holds against the kernels and their launchers.
    (A module of jit helpers only, such as kernels/scan.py, is compiled inside its callers.)"""
    import importlib

    from megablocks_ascend.compat import Kernel
    modules = set()
    for p in (PACKAGE / "kernels").glob("*.py"):
        if p.stem != "__init__":
            module = importlib.import_module(f"megablocks_ascend.kernels.{p.stem}")
            if any(isinstance(v, Kernel) for v in vars(module).values()):
                modules.add(p.stem)
    assert modules == {spec.module for spec in table.KERNELS}
    assert {spec.name for spec in table.KERNELS} >= {
        name for m in modules for name, v in vars(importlib.import_module(f"megablocks_ascend.kernels.{m}")).items()
        if isinstance(v, Kernel)}


def test_the_launchers_share_one_cdiv_and_one_int32_bound():
    """``cdiv`` and the int32 bound live in kernels/launch.py: no other kernel module defines its
    own (``def _cdiv``, ``2**31``, ``1 << 31``) or rounds up by hand (``-(-a // b)``)."""
    pattern = re.compile(r"def_?cdiv\b|2\*\*31|1<<31|-\(-")
    for path in sorted((PACKAGE / "kernels").glob("*.py")):
        if path.name == "launch.py":
            continue
        with path.open() as f:  # the code's tokens, without comments and strings (docstrings)
            code = "".join(t.string for t in tokenize.generate_tokens(f.readline)
                           if t.type not in (tokenize.COMMENT, tokenize.STRING))
        assert not pattern.findall(code), (path.name, pattern.findall(code))


# ------------------------------------------------------------------------------------------
# A backend


def test_the_backend_records_are_the_variables_values():
    assert envs.BACKENDS == ("auto", *backends.RECORDS)
    assert all(name == record.name for name, record in backends.RECORDS.items())
    doc = envs.__doc__
    for name in envs.BACKENDS:
        assert f"``{name}``" in doc, name


def test_auto_gives_each_device_type_one_backend():
    kinds = [kind for record in backends.RECORDS.values() for kind in record.auto]
    assert len(kinds) == len(set(kinds)) and set(kinds) == {"npu", "cuda", "cpu"}
    for record in backends.RECORDS.values():
        assert record.devices is None or set(record.auto) <= set(record.devices), record.name


def _readme_backends() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Backends"):]
    section = section[:section.index("\n\n", section.index("| --- |"))]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `") and not line.startswith("| `MEGABLOCKS_BACKEND`"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[re.match(r"`(\w+)`", cells[0]).group(1)] = cells
    return rows


def test_the_readme_table_lists_every_backend_where_it_runs():
    rows = _readme_backends()
    assert list(rows) == list(envs.BACKENDS)
    words = {"npu": "NPU", "cuda": "CUDA", "cpu": "CPU"}
    for name, record in backends.RECORDS.items():
        runs_on = rows[name][2]
        if record.devices is None:
            assert runs_on == "any", name
        else:
            assert set(re.findall(r"NPU|CUDA|CPU", runs_on)) == {words[k] for k in record.devices}, name
    auto = rows["auto"][1]
    for kind, name in backends._AUTO.items():
        assert f"{words[kind]} tensors: `{name}`" in auto


@pytest.mark.parametrize("name", list(backends.RECORDS))
def test_every_backend_serves_every_entry_point(name):
    record = backends.RECORDS[name]
    for op in backends.SPECS:
        assert callable(record.routing(op)), op
    for op in backends.STK_SPECS:
        assert callable(record.blocksparse(op)), op
    assert callable(record.preparation())
    if record.counting_sort is not None:
        assert record.sort_keys > 0
        for op in ("sort", "histogram"):
            assert callable(record.counting_sort(op)), op


# ------------------------------------------------------------------------------------------
# A command


def _cli_modules() -> dict[str, str]:
    """command module -> the file or package it is, for every tool in megablocks_ascend/cli/."""
    found = {}
    for p in (PACKAGE / "cli").iterdir():
        if p.suffix == ".py" and p.stem != "__init__":
            found[f"megablocks_ascend.cli.{p.stem}"] = p.stem
        elif p.is_dir() and (p / "command.py").exists():
            found[f"megablocks_ascend.cli.{p.name}.command"] = p.name
    return found


def test_every_command_module_is_registered_and_listed():
    registered = {command.module: name for name, command in cli_main.SUBCOMMANDS.items()}
    assert set(registered) == set(_cli_modules())
    listing = importlib.import_module("megablocks_ascend.cli").__doc__
    for module, name in registered.items():
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.main), module
        assert f"``{name}``" in listing, name


def _imports(path: Path, everywhere: bool) -> set[str]:
    """The megablocks_ascend modules ``path`` imports (at its top level, or ``everywhere``)."""
    tree = ast.parse(path.read_text())
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    out = set()
    for node in (ast.walk(tree) if everywhere else tree.body):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("megablocks_ascend")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("megablocks_ascend"):
                out |= {f"{base}.{a.name}" for a in node.names} | {base}
    return out


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


TOOLS = ("megablocks_ascend.cli", "megablocks_ascend.bench", "megablocks_ascend.lowering", "megablocks_ascend.__main__")


def test_nothing_in_the_runtime_package_imports_the_tools():
    """The commands (cli/), the benchmark harness (bench/) and the compile gate (lowering/) sit
    beside the runtime package."""
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if not name.startswith(TOOLS):
            assert not any(m.startswith(TOOLS) for m in _imports(path, everywhere=True)), name


_GATE_READS = ("megablocks_ascend.lowering", "megablocks_ascend.kernels", "megablocks_ascend.devices",
               "megablocks_ascend.compat")


def test_the_compile_gate_reads_only_the_kernels_and_the_devices():
    """lowering/ lowers the kernels as the launchers would launch them on an NPU: it imports the
    kernels, devices.py and compat.py, and neither a layer above the kernels nor another tool."""
    for path in (PACKAGE / "lowering").rglob("*.py"):
        outside = {m for m in _imports(path, everywhere=True)
                   if m != "megablocks_ascend" and not m.startswith(_GATE_READS)}
        assert not outside, (path.name, sorted(outside))


def test_the_package_imports_no_cycle():
    """Module by module, imports included wherever they are (a lazy import inside a function runs
    too); importing a submodule through its package is not counted as importing the package."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in _imports(path, everywhere=True) if m in modules and m != name
                    and not name.startswith(m + ".") and m != "megablocks_ascend"}
             for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(name, stack):
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, " -> ".join(stack[stack.index(dep):] + [dep])
            if dep not in state:
                visit(dep, stack)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


# ------------------------------------------------------------------------------------------
# A result kept on a tensor


def test_every_module_that_keeps_a_result_is_in_keepings_table():
    keepers = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name != "keeping.py" and re.search(r"keeping\.(keep|put)\(", path.read_text()):
            keepers.add(path)
    assert keepers
    for path in keepers:
        relative = path.relative_to(PACKAGE)
        named = relative.stem if len(relative.parts) == 1 else relative.as_posix()  # (validation, kernels/routing.py)
        assert f"``{named}" in keeping.__doc__, path
