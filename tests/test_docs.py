"""docs/README.md indexes every page of docs/notes/, each marked design (current) or record
(dated), and every relative link in the Markdown of the repository resolves: the file exists and,
where the link names a heading of a Markdown page, the heading does. The recorded benchmark
results are one folder per run, each with its ``RUN.md`` naming every file in it, and every
results path the Markdown cites, and every repository path BENCHMARKS.md cites, exists."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "README.md"
KINDS = {"Design (current)": "design", "Records (dated)": "record"}
RESULTS = ROOT / "benchmarks" / "results"


def _outside_code(text: str) -> str:
    """``text`` without fenced blocks and inline code (where a bracket is not a link)."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"(?ms)^```.*?^```", "", text))


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")


def _index() -> dict[str, str]:
    """page (relative to docs/) -> the kind of the section of docs/README.md that lists it."""
    kinds, kind = {}, None
    for line in INDEX.read_text().splitlines():
        if line.startswith("## "):
            kind = KINDS.get(line[3:].strip())
        elif kind and line.startswith("| ["):
            page = re.match(r"\| \[[^\]]+\]\(([^)]+)\)", line).group(1)
            assert page not in kinds, f"{page} is listed twice"
            kinds[page] = kind
    return kinds


def test_every_note_is_indexed_once_as_design_or_record():
    listed = _index()
    notes = {f"notes/{p.name}" for p in (ROOT / "docs" / "notes").glob("*.md")}
    assert notes <= set(listed), sorted(notes - set(listed))
    assert {"design", "record"} == set(listed.values())


def test_design_pages_are_titled_by_subject():
    """A design page's title says what it is about, not which issue it came from."""
    for page, kind in _index().items():
        if kind == "design" and page.endswith(".md"):
            title = (ROOT / "docs" / page).read_text().splitlines()[0]
            assert title.startswith("# ") and not re.search(r"\bissue \d", title, re.I), (page, title)


def _markdown() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"]
    return (pages + sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "patches").glob("*.md"))
            + sorted(RESULTS.glob("*/RUN.md")))


@pytest.mark.parametrize("page", _markdown(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _outside_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, heading = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
        elif heading and dest.suffix == ".md":
            text = re.sub(r"(?ms)^```.*?^```", "", dest.read_text())
            if heading not in {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}:
                bad.append(target)
    assert not bad, bad


def _expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd`` (as the pages write several files of one run)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _missing(paths: set[str]) -> list[str]:
    """The repository paths (braces and globs allowed) that name no file or folder."""
    return sorted(p for p in paths if not any(
        (ROOT / q).exists() or any(ROOT.glob(q)) for q in _expand(p.rstrip("/"))))


def test_every_results_folder_has_its_run_record():
    """benchmarks/results/ holds one folder per run (no loose files); its RUN.md says the device,
    software and commit, and names every file of the folder in its table of files."""
    assert not [p.name for p in RESULTS.iterdir() if p.is_file()]
    for run in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9]+-[a-z0-9-]+", run.name), run.name
        record = run / "RUN.md"
        assert record.exists(), f"{run.name} has no RUN.md"
        text = record.read_text()
        for field in ("device", "software", "commit"):
            assert re.search(rf"^\| {field} \| .+ \|$", text, re.M), (run.name, field)
        named = [p for cell in re.findall(r"^\| `([^`]+)` \|", text, re.M) for p in _expand(cell)]
        files = [p.name for p in run.iterdir() if p.name != "RUN.md"]
        unnamed = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in named)]
        assert files and not unnamed, (run.name, unnamed)


def test_every_cited_results_path_exists():
    cited = {m for page in _markdown() for m in re.findall(r"benchmarks/results/[\w.{},*/-]*[\w}*/]", page.read_text())}
    assert not _missing(cited)


def test_every_path_benchmarks_md_cites_exists():
    """BENCHMARKS.md holds what is current: every script, test, note or result it names is there."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    cited = set(re.findall(r"\b(?:benchmarks|tests|docs|tools|megablocks_ascend|examples)/[\w.{},*/-]*[\w}*/]", text))
    assert not _missing(cited)
