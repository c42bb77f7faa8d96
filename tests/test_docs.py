"""The docs as a product: a short README whose results rows each link a committed result file,
relative links that resolve (a ``#variant`` anchor into a result page names one of its
sections), no issue-number references, and every file under docs/benchmarks listed in
docs/benchmarks/README.md: one result set per benchmark, its configurations variants of it (so
reruns and variants cannot pile up as files)."""

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


def _relative_links(page: Path, anchors: bool = False) -> list[str]:
    """Link targets of ``page`` that point into the repository (no URL scheme, no bare anchor),
    with any ``#anchor`` removed unless ``anchors``."""
    out = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target if anchors else target.split("#", 1)[0])
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


def test_every_variant_anchor_names_a_section_of_its_result_page():
    """``docs/benchmarks/<set>.md#<variant>`` links (README, docs, the index) point at a
    ``## <variant>`` section of that page, and each is a variant of its JSON."""
    import json

    checked = 0
    for page in _pages():
        for target in _relative_links(page, anchors=True):
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve()
            if not anchor or linked.parent != BENCH.resolve() or linked.suffix != ".md":
                continue
            assert f"\n## {anchor}\n" in linked.read_text(), f"{page.relative_to(ROOT)}: {target}"
            assert anchor in json.loads(linked.with_suffix(".json").read_text())["variants"], target
            checked += 1
    assert checked >= 30  # the README's results rows and the index's variant rows


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
    listed = set()
    for target in _relative_links(BENCH_INDEX):
        stem = (BENCH / target).resolve().relative_to(BENCH.resolve()).with_suffix("")
        listed.add(stem.as_posix())
    files = sorted(p.relative_to(BENCH) for p in BENCH.rglob("*") if p.is_file() and p != BENCH_INDEX)
    unlisted = [str(f) for f in files if f.with_suffix("").as_posix() not in listed]
    assert unlisted == []
    # every listed result set has its JSON and Markdown
    missing = [s for s in sorted(listed) if not (BENCH / f"{s}.json").is_file() and not (BENCH / f"{s}.png").is_file()]
    assert missing == []
    assert all(len(f.parts) == 1 for f in files)  # no sub-folders: a CPU class or format is a variant
    # one result set per benchmark (its configurations variants of it), superseded runs in git
    # history: this bound only goes down
    assert 20 <= len(files) + 1 <= 45  # files under docs/benchmarks, this index included


def test_each_results_row_links_an_existing_benchmark_file():
    rows = _results_rows()
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6, row  # what | pagedkv | peer / baseline | ratio | CPU class | result
        targets = LINK.findall(cells[-1])
        assert len(targets) == 1 and targets[0].startswith("docs/benchmarks/"), row
        linked = ROOT / targets[0].split("#", 1)[0]
        assert linked.is_file() and linked.suffix == ".md", row
        assert linked.with_suffix(".json").is_file(), row
        assert cells[4], row  # the CPU class is stated
