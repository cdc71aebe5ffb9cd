"""docs/README.md indexes every page of docs/notes/, each marked design (current) or record
(dated), and every relative link in the Markdown of the repository resolves: the file exists and,
where the link names a heading of a Markdown page, the heading does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "README.md"
KINDS = {"Design (current)": "design", "Records (dated)": "record"}


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
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md"]
    return pages + sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "patches").glob("*.md"))


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
