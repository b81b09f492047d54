"""Every figure in the README's tables comes from a committed record: each table names its record in a comment
on the line before it (``<!-- source: docs/NAME.jsonl -->``, JSON lines or CSV that a benchmark in benchmarks/
wrote), and every decimal number in its rows must be, at the precision the table prints, a number in that
record. A table figure typed by hand, or left over from an earlier run, fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECIMAL = re.compile(r"(?<![\w.])-?\d+\.\d+(?![\w.])")


SOURCE = re.compile(r"<!--\s*source:\s*(\S+)\s*-->")


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
    places = len(figure.split(".")[1])
    target = float(figure)
    return any(abs(round(v, places) - target) < 0.5 * 10 ** -places + 1e-12 for v in values)


def test_every_figure_in_the_readmes_tables_is_in_the_record_the_table_names():
    tables = _tables((ROOT / "README.md").read_text())
    assert tables, "the README has tables"
    for source, figures in tables:
        if not figures:
            continue
        first = figures[0][0]
        assert source is not None, f"README.md:{first}: a table of figures names no record (<!-- source: ... -->)"
        assert (ROOT / source).is_file(), f"README.md:{first}: {source} is not committed"
        values = _recorded_values(ROOT / source)
        missing = [f"README.md:{line}: {figure}" for line, figure in figures if not _recorded(figure, values)]
        assert not missing, f"figures not in {source}: " + ", ".join(missing)


def test_the_check_finds_a_figure_typed_by_hand():
    table = "<!-- source: docs/x.jsonl -->\n| model | ms |\n|---|---|\n| a | 12.34 |\n"
    assert _tables(table) == [("docs/x.jsonl", [(4, "12.34")])]
    assert _tables("| a | b |\n|---|---|\n| 1.5 | 2 |\n") == [(None, [(3, "1.5")])]
    assert _recorded("12.34", [12.3412]) and not _recorded("12.34", [12.5, 1234.0])
