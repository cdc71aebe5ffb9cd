"""README.md leads: a table of contents naming every section in order, the user's path (install,
quick start, the Ascend install, LLM Foundry, activation, switches, troubleshooting) before the
internals, every link to a section of it resolving, and install lines that keep the options an
offline cluster needs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

USER_PATH = ["Quick start", "Install into your own environment", "Installing on an Ascend machine",
             "Using with LLM Foundry", "Activation", "Switches", "Troubleshooting"]
INTERNALS = ["What is replaced, and what is verified where", "How the kernels work", "The grouped GEMM",
             "The sparse dMoE", "Mixed precision", "Numerics", "Robustness", "Host syncs and graph capture"]


def _outside_code(text: str) -> str:
    return re.sub(r"(?ms)^```.*?^```", "", text)


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def headings(level: str = "## ") -> list[str]:
    return [line[len(level):] for line in _outside_code(README).splitlines() if line.startswith(level)]


def test_every_link_to_a_section_of_the_readme_resolves():
    anchors = {anchor(h) for level in ("## ", "### ") for h in headings(level)}
    links = re.findall(r"\]\(#([^)]+)\)", README)
    assert links and not sorted(set(links) - anchors), sorted(set(links) - anchors)


def test_the_contents_name_every_section_in_order_user_path_first():
    sections = [h for h in headings() if h != "Contents"]
    contents = README[README.index("## Contents"):]
    contents = contents[:contents.index("\n## ", 1)]
    listed = re.findall(r"\]\(#([^)]+)\)", contents)
    assert listed == [anchor(h) for h in sections], (listed, sections)
    order = [next(i for i, h in enumerate(sections) if h.startswith(name)) for name in USER_PATH + INTERNALS]
    assert order == sorted(order), "the user's path first, then the internals, each in this order"
    assert order[len(USER_PATH) - 1] < order[len(USER_PATH)]


def test_install_lines_keep_what_an_offline_cluster_needs():
    """Every pip line that builds something passes --no-build-isolation (no build tools fetched),
    every MegaBlocks/stk line --no-deps; torchvision is pinned to an exact release or the stand-in."""
    blocks = re.findall(r"(?ms)^```bash\n(.*?)^```", README)
    lines = [line.strip() for block in blocks for line in block.splitlines()
             if line.strip().startswith(("pip install", "#   pip install"))]
    lines = [line.lstrip("#").strip() for line in lines]
    assert lines
    for line in lines:
        if " -e " in line or line.endswith(" -e .") or "megablocks==" in line or "torchvision-standin" in line:
            assert "--no-build-isolation" in line and "--no-deps" in line, line
        if "torchvision" in line and "standin" not in line:
            assert re.search(r"torchvision==\d+\.\d+\.\d+", line), line
    assert not re.search(r"<the release|paired with your torch>", README)
    assert "pip install --no-deps --no-build-isolation tools/torchvision-standin" in README


def test_the_changelog_has_one_unreleased_section():
    changelog = _outside_code((ROOT / "CHANGELOG.md").read_text())
    sections = [line for line in changelog.splitlines() if line.startswith("## ")]
    assert [s for s in sections if "unreleased" in s.lower()] == ["## Unreleased"], sections
