"""Every relative link of the repository's markdown (README.md, docs/, docs/log/, the folders' READMEs)
reaches a file that exists, and a link with an #anchor a heading of that file; and every pointer written
as text, `docs/PAGE.md, "Section"` (in markdown, code, configs and scripts, printed messages included),
names a heading of that page: moving a section or renaming a page cannot leave a reader at a dead link."""

import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
SKIPPED_DIRS = {"runs", "shared", "node_modules", "__pycache__"}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# docs/PAGE.md, "Section" (or 'Section'): a section named by (the start of) its heading, inline code marks aside
SECTION_POINTER = re.compile(r"(docs/[\w/.-]+\.md),\s+[\"']([^\"']{3,}?)[\"']")
POINTING_FILES = (".md", ".py", ".yaml", ".sh")


def markdown_files(suffixes: tuple[str, ...] = (".md",)) -> list[Path]:
    found = []
    for path in sorted(p for p in REPO.rglob("*") if p.suffix in suffixes and p.is_file()):
        parts = path.relative_to(REPO).parts[:-1]
        if any(part.startswith(".") or part in SKIPPED_DIRS or part.endswith(".egg-info") for part in parts):
            continue
        found.append(path)
    return found


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            if count:
                seen[f"{base}-{count}"] = 1
    return set(seen)


def links(path: Path) -> list[str]:
    targets = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = REFERENCE_LINK.match(line)
        if match:
            targets.append(match.group(1))
            continue
        targets += INLINE_LINK.findall(INLINE_CODE.sub("", line))
    return [t for t in targets if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked}")
        elif anchor and linked.suffix == ".md" and unquote(anchor).lower() not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.relative_to(REPO)}")
    return broken


def test_the_markdown_files_are_found():
    names = {str(p.relative_to(REPO)) for p in markdown_files()}
    assert {"README.md", "docs/quality.md", "docs/log/README.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_heading(path):
    assert broken_links(path) == []


def test_a_dead_link_and_a_missing_anchor_are_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "page.md").write_text("# A page\n\n## The `eval` report: figures\n", encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](page.md#the-eval-report-figures) [gone](missing.md) [bad](page.md#nowhere)\n"
        "[web](https://example.com) `[code](nope.md)`\n```\n[fenced](nope.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(doc) == [
        "missing.md: no file missing.md",
        "page.md#nowhere: no heading with anchor #nowhere in page.md",
    ]


def headings(path: Path) -> list[str]:
    """The page's headings, lowercase, without inline code marks."""
    found = (HEADING.match(line) for line in prose_lines(path.read_text(encoding="utf-8")))
    return [match.group(2).replace("`", "").lower() for match in found if match]


def broken_section_pointers(path: Path) -> list[str]:
    """The `docs/PAGE.md, "Section"` pointers of `path` whose page is missing or has no heading that
    starts with the section's name (a pointer may break across lines: whitespace is one space)."""
    text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
    broken = []
    for page, section in SECTION_POINTER.findall(text):
        target = REPO / page
        name = section.replace("`", "").lower().rstrip(" .,;:")
        if not target.exists():
            broken.append(f"{page}, {section!r}: no file {page}")
        elif not any(heading.startswith(name) for heading in headings(target)):
            broken.append(f"{page}, {section!r}: no heading of {page} starts so")
    return broken


POINTING = [p for p in markdown_files(POINTING_FILES) if p != Path(__file__).resolve()]  # not its own examples


@pytest.mark.parametrize("path", POINTING, ids=lambda p: str(p.relative_to(REPO)))
def test_every_section_named_in_text_is_a_heading_of_its_page(path):
    assert broken_section_pointers(path) == []


def test_a_pointer_to_a_renamed_section_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## `torch.compile` on a CPU\n", encoding="utf-8")
    code = tmp_path / "tool.py"
    code.write_text(
        'print("see docs/page.md, \'torch.compile on\'")  # docs/page.md, "Compile"\n# (docs/gone.md, "Anything")\n',
        encoding="utf-8",
    )
    assert broken_section_pointers(code) == [
        "docs/page.md, 'Compile': no heading of docs/page.md starts so",
        "docs/gone.md, 'Anything': no file docs/gone.md",
    ]
