"""The patches' pages (``patches/<name>.md``) against their records: each patch's ``PATCH.why``,
``PATCH.how`` and ``PATCH.upstream_fix`` are the one source of the first paragraph of its page's
``## Why``, ``## How`` and ``## Upstream fix`` sections. What follows that paragraph in a section
(evidence, details, history) is the page's own.

    python -m megablocks_ascend.patching.pages --check   # list the pages that differ from their records
    python -m megablocks_ascend.patching.pages --write   # rewrite those first paragraphs from the records

A first paragraph agrees with its record when both have the same words (line breaks and spacing do
not count), so a page may be wrapped as it likes; ``--write`` wraps the record at 100 columns (a
record of several lines is a Markdown list, one item a line). ``tests/test_plugin.py`` runs
the check. A tool of the repository, not of the runtime: nothing in the package imports it, and it
needs the checkout's ``patches/`` folder.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import textwrap

SECTIONS = {"why": "## Why", "how": "## How", "upstream_fix": "## Upstream fix"}
WIDTH = 100
_BLOCK_START = re.compile(r"([*+-]|\d+[.)]|#+|>)( |$)")


def folder() -> pathlib.Path:
    """The checkout's ``patches/`` folder (beside the package)."""
    return pathlib.Path(__file__).resolve().parents[2] / "patches"


def _words(text: str) -> str:
    return " ".join(text.split())


def _lead(lines: list[str], heading: str) -> tuple[int, int]:
    """The line span ``[start, end)`` of the first paragraph under ``heading`` (empty when the
    section starts with a blank line); raises ``ValueError`` when the page has no such heading."""
    start = lines.index(heading) + 1
    end = start
    while end < len(lines) and lines[end].strip() and not lines[end].startswith("#"):
        end += 1
    return start, end


def render(text: str) -> list[str]:
    """A record's text as page lines, wrapped: a paragraph, or a Markdown list of one line per item
    (``"- first\n- second"``, each item's continuation lines indented under it)."""
    lines = []
    for line in text.strip().splitlines():
        wrapped = textwrap.wrap(line, WIDTH, subsequent_indent="  " if line.startswith("- ") else "",
                                break_long_words=False, break_on_hyphens=False)
        for i in range(1, len(wrapped)):
            # A line that would start a list, a heading or a quote: its first word goes up a line.
            while _BLOCK_START.match(wrapped[i].lstrip()) and " " in wrapped[i].lstrip():
                indent = wrapped[i][:len(wrapped[i]) - len(wrapped[i].lstrip())]
                word, rest = wrapped[i].lstrip().split(" ", 1)
                wrapped[i - 1] += " " + word
                wrapped[i] = indent + rest
        lines += wrapped
    return lines


def differences(patch, page: str) -> list[str]:
    """The sections of ``page`` (a page's text) whose first paragraph is not ``patch``'s record."""
    lines = page.splitlines()
    out = []
    for field, heading in SECTIONS.items():
        try:
            start, end = _lead(lines, heading)
        except ValueError:
            out.append(f"{heading}: missing")
            continue
        if _words("\n".join(lines[start:end])) != _words(getattr(patch, field)):
            out.append(f"{heading}: its first paragraph is not PATCH.{field}")
    return out


def rewrite(patch, page: str) -> str:
    """``page`` with the first paragraph of each section set to ``patch``'s record (where the
    words differ; a section that agrees keeps its wrapping)."""
    lines = page.splitlines()
    for field, heading in SECTIONS.items():
        start, end = _lead(lines, heading)
        if _words("\n".join(lines[start:end])) != _words(getattr(patch, field)):
            lines[start:end] = render(getattr(patch, field))
    return "\n".join(lines) + "\n"


def stale(patches=None, where: pathlib.Path | None = None) -> dict[str, list[str]]:
    """``{page name: differences}`` for every patch whose page differs from its record."""
    if patches is None:
        from megablocks_ascend.patching import PATCHES as patches  # noqa: PLC0415
    where = where or folder()
    out = {}
    for patch in patches:
        path = where / f"{patch.name}.md"
        found = differences(patch, path.read_text()) if path.exists() else ["the page is missing"]
        if found:
            out[path.name] = found
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megablocks_ascend.patching.pages",
                                     description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true",
                      help="list the pages whose first paragraphs differ from their records (exit 1 if any)")
    mode.add_argument("--write", action="store_true", help="rewrite those first paragraphs from the records")
    args = parser.parse_args(argv)
    from megablocks_ascend.patching import PATCHES  # noqa: PLC0415
    found = stale(PATCHES)
    if args.write:
        for patch in PATCHES:
            path = folder() / f"{patch.name}.md"
            if path.name in found and path.exists():
                path.write_text(rewrite(patch, path.read_text()))
                print(f"wrote {path.name}")
        found = stale(PATCHES)
    for name, problems in found.items():
        for problem in problems:
            print(f"patches/{name}: {problem}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
