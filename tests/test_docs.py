"""The docs and what they cite: every raw report in ``benchmarks/results/`` is cited by README.md or a file in
``docs/``, every report they cite exists, and every pointer into a doc (an anchor, or a quoted name in
``docs/results.md``) names something the doc has."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CITED = re.compile(r"benchmarks/results/([\w./-]*\w)")
ANCHOR = re.compile(r"(?:docs/)?(results|design|cli)\.md#([\w-]+)")
QUOTED = re.compile(r"results\.md`?,\s*\"([^\"]+)\"")
DATED = re.compile(r"results\.md`?,\s*(\d{4}-\d\d-\d\d)")


def _cited() -> dict[str, str]:
    """Each path under benchmarks/results/ a doc cites -> where, first."""
    out: dict[str, str] = {}
    for doc in DOCS:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for m in CITED.finditer(line):
                out.setdefault(m.group(1), f"{doc.relative_to(REPO)}:{i}")
    return out


def test_every_report_a_doc_cites_exists():
    missing = [f"{where}: benchmarks/results/{name}" for name, where in _cited().items()
               if not (RESULTS / name).is_file()]
    assert not missing, "\n".join(missing)


def test_every_file_in_benchmarks_results_is_cited_by_a_doc():
    cited = set(_cited())
    stray = [p.relative_to(RESULTS).as_posix() for p in sorted(RESULTS.rglob("*")) if p.is_file()]
    stray = [name for name in stray if name not in cited]
    assert not stray, "cited by no doc (cite it in docs/results.md, or delete it): " + ", ".join(stray)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sources() -> list[Path]:
    code = [p for d in ("hsd_opt", "benchmarks", "tests") for p in sorted((REPO / d).rglob("*.py"))]
    return DOCS + code


def _joined(path: Path) -> str:
    """The file's text with line breaks (and a comment's continuation marks) read as spaces."""
    return re.sub(r"\s*\n\s*(?:#:?\s)?", " ", path.read_text())


def test_every_pointer_into_a_doc_names_what_it_has():
    anchors = {name: {_slug(h) for h in re.findall(r"(?m)^#+ (.+)$", (REPO / "docs" / f"{name}.md").read_text())}
               for name in ("results", "design", "cli")}
    results = re.sub(r"\s+", " ", (REPO / "docs" / "results.md").read_text()).lower()
    bad = []
    for path in _sources():
        if path == Path(__file__):
            continue
        text = _joined(path)
        for doc, anchor in ANCHOR.findall(text):
            if anchor not in anchors[doc]:
                bad.append(f"{path.relative_to(REPO)}: {doc}.md#{anchor}")
        for name in QUOTED.findall(text) + DATED.findall(text):
            if name.lower() not in results:
                bad.append(f"{path.relative_to(REPO)}: results.md, {name!r}")
    assert not bad, "\n".join(bad)
