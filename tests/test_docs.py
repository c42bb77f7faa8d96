"""The docs as a product: a short README whose results rows each link a committed result file,
relative links that resolve, no issue-number references, and every file under docs/benchmarks
listed in docs/benchmarks/README.md (so reruns and variants cannot pile up unlisted)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCH = DOCS / "benchmarks"
BENCH_INDEX = BENCH / "README.md"
MAX_README_LINES = 200

LINK = re.compile(r"\]\(([^)\s]+)\)")
ISSUE_REF = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)


def _pages() -> list[Path]:
    """README.md, docs/*.md and the benchmark index: the hand-written pages."""
    return [README, *sorted(DOCS.glob("*.md")), BENCH_INDEX]


def _relative_links(page: Path) -> list[str]:
    """Link targets of ``page`` that point into the repository (no URL scheme, no bare anchor),
    with any ``#anchor`` removed."""
    out = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def _results_rows() -> list[str]:
    """The rows of the README's results table (the lines after its header and rule)."""
    lines = README.read_text().splitlines()
    start = lines.index("## Results")
    rows, in_table = [], False
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|---"):
            in_table = True
        elif in_table and line.startswith("|"):
            rows.append(line)
        elif in_table:
            break
    return rows


def test_readme_is_at_most_200_lines():
    n = len(README.read_text().splitlines())
    assert 50 < n <= MAX_README_LINES, n


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        for target in _relative_links(page):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
    assert len(_relative_links(README)) >= 20  # the results table and the docs list are links


def test_no_issue_number_references():
    """Hand-written pages and the generated result pages alike (the benchmarks write their
    goals in their own words)."""
    pages = [*_pages(), *sorted((DOCS / "benchmarks").rglob("*.md"))]
    found = [f"{page.relative_to(ROOT)}: {m.group(0)}" for page in pages
             for m in ISSUE_REF.finditer(page.read_text())]
    assert found == []
    number = "12"  # kept apart so this line is no issue reference itself
    assert ISSUE_REF.search(f"as issue {number} says") and ISSUE_REF.search(f"see Issue #{number}")
    assert not ISSUE_REF.search("issues are tracked elsewhere")


def test_every_benchmark_file_is_listed_in_the_index():
    index = BENCH_INDEX.read_text()
    listed = set()
    for target in _relative_links(BENCH_INDEX):
        stem = (BENCH / target).resolve().relative_to(BENCH.resolve()).with_suffix("")
        listed.add(stem.as_posix())
    listed |= {m for m in re.findall(r"`([\w./-]+)\.png`", index)}  # extra plots named in a row
    files = sorted(p.relative_to(BENCH) for p in BENCH.rglob("*") if p.is_file() and p != BENCH_INDEX)
    unlisted = [str(f) for f in files if f.with_suffix("").as_posix() not in listed]
    assert unlisted == []
    # every listed result set has its JSON and Markdown
    missing = [s for s in sorted(listed) if not (BENCH / f"{s}.json").is_file() and not (BENCH / f"{s}.png").is_file()]
    assert missing == []
    # one current result per benchmark: superseded runs live in git history, so this bound only goes down
    assert 20 <= len(files) <= 90


def test_each_results_row_links_an_existing_benchmark_file():
    rows = _results_rows()
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6, row  # what | pagedkv | peer / baseline | ratio | CPU class | result
        targets = LINK.findall(cells[-1])
        assert len(targets) == 1 and targets[0].startswith("docs/benchmarks/"), row
        linked = ROOT / targets[0]
        assert linked.is_file() and linked.suffix == ".md", row
        assert linked.with_suffix(".json").is_file(), row
        assert cells[4], row  # the CPU class is stated
