"""Every relative link and image path in the docs resolves.

Checks README.md, docs/*.md and the Markdown files under benchmarks/: each
``[text](path)`` and ``![alt](path)`` outside code must name a file or folder
that exists, and a ``#fragment`` must name a heading of the Markdown file it
points into (GitHub's anchors). Links to the web are not followed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files(root: Path = ROOT) -> list[Path]:
    """The Markdown files whose links are checked."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    files += sorted((root / "benchmarks").rglob("*.md"))
    return [f for f in files if f.is_file()]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with code spans blanked."""
    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield no, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (repeated ones get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """'file:line: target (why)' for each link in ``path`` that does not resolve."""
    problems = []
    for no, line in _prose_lines(path.read_text(encoding="utf-8")):
        for m in _LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:, ...
                continue
            file_part, _, fragment = target.partition("#")
            dest = path if not file_part else (path.parent / file_part).resolve()
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{no}"
            if not dest.exists():
                problems.append(f"{where}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                problems.append(f"{where}: {target} (no heading #{fragment})")
    return problems


def test_every_relative_link_and_image_in_the_docs_resolves():
    files = doc_files()
    assert ROOT / "README.md" in files and len(files) > 5
    problems = [p for f in files for p in broken_links(f)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checker_finds_missing_files_images_and_headings(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "ok.png").write_bytes(b"")
    (tmp_path / "other.md").write_text("# Title\n\n## Where `time` goes (2-core CPU)\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n## A section\n\n"
        "![ok](img/ok.png) [ok](other.md#where-time-goes-2-core-cpu) [ok](#a-section)\n"
        "![gone](img/gone.png) [gone](missing.md) [bad anchor](other.md#nowhere)\n"
        "[self](#no-such-section) [web](https://example.com/x.md)\n"
        "`[in code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
    )
    found = broken_links(doc)
    assert [p.split(": ", 1)[1] for p in found] == [
        "img/gone.png (no such file)",
        "missing.md (no such file)",
        "other.md#nowhere (no heading #nowhere)",
        "#no-such-section (no heading #no-such-section)",
    ]
    assert all(p.startswith(f"{doc}:6") or p.startswith(f"{doc}:7") for p in found)
