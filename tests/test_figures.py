"""Every figure in the README's tables comes from a committed record: each table names its records in a comment
on the line before it (``<!-- source: docs/NAME.jsonl -->``, JSON lines, JSON or CSV that a benchmark in
benchmarks/ wrote; several separated by commas), and every decimal number in its rows must be, at the precision
the table prints, a number in one of them. A table figure typed by hand, or left over from an earlier run, fails
here. The tables of docs/ that name their records are held to the same rule."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a percentage is checked as its fraction; thousands may be grouped by commas (1,570.7)
DECIMAL = re.compile(r"(?<![\w.,])-?\d{1,3}(?:,\d{3})+\.\d+%?(?![\w.])|(?<![\w.,])-?\d+\.\d+%?(?![\w.])")


SOURCE = re.compile(r"<!--\s*source:\s*(.+?)\s*-->")
NOT_MEASURED = re.compile(r"<!--\s*not measured:\s*.+?-->")  # a table of definitions (a model's parameters)

# Tables of docs/ whose figures name no record yet, per page: known debt, measured again or removed page by page.
# The count must fall as they are (the test fails when a page has more, and when it has fewer: lower it here).
UNSOURCED = {"benchmarks.md": 5, "cost-models.md": 2, "mapping.md": 11, "multi.md": 2, "ray.md": 3}


def _tables(markdown: str) -> list[tuple[str | None, list[tuple[int, str]]]]:
    """Each table of ``markdown``: the record its comment names (None without one), and (line number, figure) for
    every decimal number in its rows (header rows excluded)."""
    tables: list[tuple[str | None, list[tuple[int, str]]]] = []
    lines = markdown.splitlines()
    for k, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            continue
        if k == 0 or not lines[k - 1].lstrip().startswith("|"):  # a table starts here
            source = SOURCE.search(lines[k - 1]) if k else None
            tables.append((source.group(1) if source else None, []))
        is_rule = set(line.replace("|", "").strip()) <= set("-: ")
        is_header = k + 1 < len(lines) and set(lines[k + 1].replace("|", "").strip()) <= set("-: ") \
            and lines[k + 1].lstrip().startswith("|")
        if not is_rule and not is_header:
            tables[-1][1].extend((k + 1, figure) for figure in DECIMAL.findall(line))
    return tables


def _recorded_values(path: Path) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+", path.read_text())]


def _recorded(figure: str, values: list[float]) -> bool:
    scale = 100.0 if figure.endswith("%") else 1.0
    figure = figure.removesuffix("%").replace(",", "")
    places = len(figure.split(".")[1])
    target = float(figure)
    half = 0.5 * 10 ** -places * (1 + 1e-9)  # a value half-way between two figures rounds to either
    return any(abs(v * scale - target) <= half for v in values)


def _check(page: str, source: str, figures: list[tuple[int, str]]) -> None:
    paths = [ROOT / name.strip() for name in source.split(",")]
    for path in paths:
        assert path.is_file(), f"{page}:{figures[0][0]}: {path.relative_to(ROOT)} is not committed"
    values = [v for path in paths for v in _recorded_values(path)]
    missing = [f"{page}:{line}: {figure}" for line, figure in figures if not _recorded(figure, values)]
    assert not missing, f"figures not in {source}: " + ", ".join(missing)


def test_every_figure_in_the_readmes_tables_is_in_the_record_the_table_names():
    tables = _tables((ROOT / "README.md").read_text())
    assert tables, "the README has tables"
    for source, figures in tables:
        if figures:
            assert source is not None, f"README.md:{figures[0][0]}: a table of figures names no record (<!-- source: ... -->)"
            _check("README.md", source, figures)


def test_every_figure_in_a_docs_table_that_names_its_records_is_in_them():
    checked = 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        for source, figures in _tables(page.read_text()):
            if source and figures:
                _check(f"docs/{page.name}", source, figures)
                checked += 1
    assert checked, "no table in docs/ names its records"


def test_a_docs_table_of_figures_names_its_records_but_for_the_known_debt():
    unsourced = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        for source, figures in _tables(page.read_text()):
            if figures and not source:
                start = figures[0][0] - 1
                while start and lines[start - 1].lstrip().startswith("|"):
                    start -= 1
                if not (start and NOT_MEASURED.search(lines[start - 1])):
                    unsourced.setdefault(page.name, []).append(start + 1)
    counts = {page: len(starts) for page, starts in unsourced.items()}
    assert counts == UNSOURCED, (f"tables of figures without <!-- source: ... --> (page: their lines): {unsourced}; "
                                 f"a new table names its record, and a page's count here only falls")


def test_the_check_finds_a_figure_typed_by_hand():
    table = "<!-- source: docs/x.jsonl -->\n| model | ms |\n|---|---|\n| a | 12.34 |\n"
    assert _tables(table) == [("docs/x.jsonl", [(4, "12.34")])]
    assert _tables("| a | b |\n|---|---|\n| 1.5 | 2 |\n") == [(None, [(3, "1.5")])]
    assert _tables("<!-- source: a.json, b.json -->\n| a |\n|---|\n| 1.5 |\n") == [("a.json, b.json", [(4, "1.5")])]
    assert _recorded("12.34", [12.3412]) and not _recorded("12.34", [12.5, 1234.0])
    assert _recorded("2.8%", [0.02804]) and not _recorded("2.8%", [2.8])
    assert _tables("| a |\n|---|\n| 1,570.7 MB, 0.5 |\n") == [(None, [(3, "1,570.7"), (3, "0.5")])]
    assert _recorded("1,570.7", [1570.71]) and not _recorded("1,570.7", [570.7])
