"""The documentation cites only what the repository holds: every link in README.md and docs/
resolves (a file, and a heading when it names one), every file the present-tense docs name in
backticks exists, and no text cites a document or numbered section from outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), RESULTS / "README.md"]
# Where a doc's short file names are read from ("backend/ops.py" in the runtime's design, a results
# folder in a table of results.md), besides the repository's root and the doc's own folder.
BASES = ("", "ygg_runtime", "ygg_compile", "ygg_bench", "benchmarks/results")
# The dated notes (docs/notes/) name files as they were then (some have moved since): their links
# must resolve, the files they name need not.
HISTORY = "notes"
FOREIGN = re.compile(r"DESIGN\.md|\u00a7\s*\d")  # a design document and numbered sections we do not have


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but - and _ dropped, spaces -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            s = slug(m.group(1))
            found.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return found


def prose(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc)):
        if re.match(r"[a-z]+:", target):  # a web address
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no such heading")
    return broken


def missing_files(doc: Path) -> list[str]:
    named = re.findall(r"`([\w./-]+/[\w.-]+\.(?:py|md|cpp|yaml|toml|json))`", prose(doc))
    return [n for n in named if not any((ROOT / base / n).exists() or (doc.parent / n).exists() for base in BASES)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_in_the_docs_resolves_and_every_file_they_name_exists(doc):
    assert broken_links(doc) == []
    if doc.parent.name != HISTORY:
        assert missing_files(doc) == []


def test_the_checks_find_a_broken_link_a_missing_heading_and_a_missing_file(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n[ok](#title) [gone](nothing.md) [heading](#no-such) `ygg_runtime/nothing.py` "
                   "`ygg_runtime/serving/app.py`\n\n```\n[in a fence](ignored.md)\n```\n")
    assert broken_links(doc) == ["nothing.md: no such file", "#no-such: no such heading"]
    assert missing_files(doc) == ["ygg_runtime/nothing.py"]


def test_nothing_cites_a_document_or_section_the_repository_does_not_have():
    texts = [*DOCS, ROOT / "Makefile", *(ROOT / "deploy").glob("*.yaml"), *ROOT.glob("benchmarks/*.py"),
             *(p for d in ("ygg_runtime", "ygg_compile", "ygg_bench", "tests", "tools") for p in (ROOT / d).rglob("*.py"))]
    cited = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in texts
             for m in FOREIGN.finditer(p.read_text(encoding="utf-8"))]
    assert cited == []
    assert FOREIGN.search("as DESIGN" + ".md says") and FOREIGN.search("see \u00a711")


def test_the_results_index_lists_every_results_folder_once():
    listed = re.findall(r"^\| \[([^\]]+)\]\(", (RESULTS / "README.md").read_text(encoding="utf-8"), flags=re.M)
    assert sorted(listed) == sorted(d.name for d in RESULTS.iterdir() if d.is_dir())
    rows = [line.split(" | ") for line in (RESULTS / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| [")]
    # folder, machine, first run, made by (the tool: `ygg bench`, a script in benchmarks/), what, note
    assert all(len(r) == 6 and re.fullmatch(r"20\d\d-\d\d-\d\d", r[2]) and r[3].startswith("`") for r in rows)
