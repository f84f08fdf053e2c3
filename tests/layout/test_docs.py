"""The docs stay usable: the README is read in minutes, nothing cites files that live outside the
repository, and every relative link in a Markdown page leads to a file (and heading) that exists."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 220
# Notes and articles that were never part of the repository; the facts they held are in docs/design/.
OUTSIDE_CITATIONS = re.compile(r"\.\./shared|shared/(design|seeds)/|seed 00\d|\b(SYSTEM|V41|REFERENCE|ANCHORS|GPU|STYLE)\.md\b",
                               re.IGNORECASE)
NOTE_NAMES_CASE = re.compile(r"\b(SYSTEM|V41|REFERENCE|ANCHORS|GPU|STYLE)\.md\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def repo_files() -> list[Path]:
    """Tracked files and new ones git does not ignore, so a citation is caught before it is committed."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.splitlines()
    return [REPO / name for name in listed if (REPO / name).is_file()]


def outside_citations(text: str) -> list[str]:
    found = []
    for match in OUTSIDE_CITATIONS.finditer(text):
        # the note names count only in their own spelling: docs/design/v41-reference.md is ours
        if match.group(2) and not NOTE_NAMES_CASE.fullmatch(match.group(0)):
            continue
        found.append(match.group(0))
    return found


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors: lowercase, punctuation dropped, spaces to hyphens (outside code blocks)."""
    anchors, in_code = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check here
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_readme_stays_short_enough_to_read_in_minutes():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_no_file_cites_notes_or_articles_outside_the_repository():
    offenders = {}
    for path in repo_files():
        if path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary files cite nothing
        if found := outside_citations(text):
            offenders[str(path.relative_to(REPO))] = sorted(set(found))
    assert not offenders, f"cite docs/design/ (or state the fact) instead: {offenders}"


def test_every_relative_link_in_the_markdown_pages_leads_to_an_existing_file_and_heading():
    pages = [path for path in repo_files() if path.suffix == ".md"]   # README.md, docs/, per-folder notes
    assert REPO / "README.md" in pages and REPO / "docs" / "README.md" in pages
    broken = {str(page.relative_to(REPO)): links for page in pages if (links := broken_links(page))}
    assert not broken, f"broken links: {broken}"


def test_the_checks_catch_what_they_look_for():
    assert outside_citations("see ../shared/design/SYSTEM.md and seed 003") == ["../shared", "SYSTEM.md", "seed 003"]
    assert outside_citations("docs/design/v41-reference.md, random seeds 0..7") == []
    assert heading_anchors("# `epd chaos`: faults\n```\n# not a heading\n```") == {"epd-chaos-faults"}
