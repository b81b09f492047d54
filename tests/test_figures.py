"""Every figure in the README's tables comes from a committed record: each table names its records in a comment
on the line before it (``<!-- source: docs/NAME.jsonl -->``, JSON lines, JSON or CSV that a benchmark in
benchmarks/ wrote; several separated by commas), and every decimal number in its rows (a ratio such as 1.42x and
a quantity such as 12.3 ms included) must be, at the precision the table prints, a number among the record's data
(its provenance, where and when it was measured, left out), or, for a ratio, the quotient of two such figures of
its own row. A table figure typed by hand, or left over from an
earlier run, fails here. The tables of docs/ are held to the same rule, and every record a table names says where and when it
was measured, on every entry."""

import csv
import io
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a decimal figure, its thousands maybe grouped by commas (1,570.7), maybe followed by a unit: a percentage is
# checked as its fraction, a ratio (1.42x) and a quantity (12.3ms) as the number
DECIMAL = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)\.\d+(?:%|x|ms|us|s|MB|GB)?(?![\w.])")
UNIT = re.compile(r"(%|x|ms|us|s|MB|GB)$")
REMARK = re.compile(r"\s*\([^()]*\)$")  # a figure's parenthesised qualifier in a record: "60.0 (limit)"
PROVENANCE = {"machine", "versions", "date", "commit", "session"}  # where and when: never a figure
RECORD_SUFFIXES = (".json", ".jsonl", ".csv")
SOURCE = re.compile(r"<!--\s*source:\s*(.+?)\s*-->")
NOT_MEASURED = re.compile(r"<!--\s*not measured:\s*.+?-->")  # a table of definitions (a model's parameters)


def _tables(markdown: str) -> list[tuple[str | None, list[tuple[int, str]]]]:
    """Each table of ``markdown``: the record its comment names (None without one), and (line number, figure) for
    every decimal number in its rows (header rows excluded, and each row's first cell, which names the row: a
    model's version, SqueezeNet 1.1, is no figure)."""
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
            cells = line.strip().strip("|").split("|")
            tables[-1][1].extend((k + 1, figure) for figure in DECIMAL.findall("|".join(cells[1:])))
    return tables


def _numbers(value, key: str = "") -> list[float]:
    """Every number among the leaves of a parsed record, but those of its provenance."""
    if key in PROVENANCE or isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):  # a number, or a figure as a record quotes it: "1.59x", "60.0 (limit)"
        try:
            return [float(UNIT.sub("", REMARK.sub("", value.strip())))]
        except ValueError:
            return []
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in _numbers(v, k)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v, key)]
    return []


def _recorded_values(path: Path) -> list[float]:
    """The numbers of a record, JSON, JSON lines or CSV, read as data (its provenance left out)."""
    text = path.read_text()
    if path.suffix == ".json":
        return _numbers(json.loads(text))
    if path.suffix == ".jsonl":
        return [n for line in text.splitlines() if line.strip() for n in _numbers(json.loads(line))]
    return [n for row in csv.DictReader(io.StringIO(text)) for n in _numbers(row)]


def _recorded(figure: str, values: list[float]) -> bool:
    scale = 100.0 if figure.endswith("%") else 1.0
    number = UNIT.sub("", figure).replace(",", "")  # the number alone: no unit, no thousands separator
    places = len(number.split(".")[1])
    target = float(number)
    half = 0.5 * 10 ** -places * (1 + 1e-9)  # a value half-way between two figures rounds to either
    return any(abs(v * scale - target) <= half for v in values)


def _check(page: str, source: str, figures: list[tuple[int, str]]) -> None:
    paths = [ROOT / name.strip() for name in source.split(",")]
    for path in paths:
        assert path.is_file(), f"{page}:{figures[0][0]}: {path.relative_to(ROOT)} is not committed"
        assert path.suffix in RECORD_SUFFIXES, f"{page}: {path.name} is not a record (JSON, JSON lines or CSV)"
    values = [v for path in paths for v in _recorded_values(path)]
    missing = [f"{page}:{line}: {figure}" for line, figure in figures
               if not _recorded(figure, values) and not _a_ratio_of_its_row(figure, line, figures, values)]
    assert not missing, f"figures not in {source}: " + ", ".join(missing)


def _a_ratio_of_its_row(figure: str, line: int, figures: list[tuple[int, str]], values: list[float]) -> bool:
    """A ratio (1.76x) that a table derives from two figures of its own row (1.644 and 0.936 ms), each of them in
    the record: the quotient of two recorded figures of the row, at the ratio's precision."""
    if not figure.endswith("x"):
        return False
    row = [float(UNIT.sub("", f).replace(",", "")) for k, f in figures
           if k == line and not f.endswith("x") and _recorded(f, values)]
    quotients = [a / b for a in row for b in row if b]
    return _recorded(figure, quotients)


def _docs_tables():
    """(page, header, record named or None, figures, line, marked as no measurement) of every table of docs/ that
    holds figures."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        lines = text.splitlines()
        for source, figures in _tables(text):
            if not figures:
                continue
            start = figures[0][0] - 1
            while start and lines[start - 1].lstrip().startswith("|"):
                start -= 1
            marked = bool(start and NOT_MEASURED.search(lines[start - 1]))
            yield page.name, lines[start].strip(), source, figures, start + 1, marked


def test_every_figure_in_the_readmes_tables_is_in_the_record_the_table_names():
    tables = _tables((ROOT / "README.md").read_text())
    assert tables, "the README has tables"
    for source, figures in tables:
        if figures:
            assert source is not None, f"README.md:{figures[0][0]}: a table of figures names no record (<!-- source: ... -->)"
            _check("README.md", source, figures)


def test_every_figure_in_a_docs_table_that_names_its_records_is_in_them():
    checked = 0
    for page, _, source, figures, _, _ in _docs_tables():
        if source:
            _check(f"docs/{page}", source, figures)
            checked += 1
    assert checked, "no table in docs/ names its records"


def test_every_docs_table_of_figures_names_its_records():
    for page, _, source, _, line, marked in _docs_tables():
        assert source or marked, f"docs/{page}:{line}: a table of figures names no record (<!-- source: ... -->)"


def _says_where_and_when(path: Path) -> bool:
    """Every entry of the record names its machine and date (a GPU check's JSON: its host and start)."""
    text = path.read_text()
    if path.suffix == ".json":
        record = json.loads(text)
        return bool(record.get("host")) and bool(record.get("started"))
    if path.suffix == ".jsonl":
        entries = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        entries = list(csv.DictReader(io.StringIO(text)))
    return bool(entries) and all(e.get("machine") and e.get("date") for e in entries)


def test_every_record_a_table_names_says_where_and_when_it_was_measured():
    named = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for source, figures in _tables(page.read_text()):
            if source and figures:
                named |= {name.strip() for name in source.split(",")}
    lacking = sorted(n for n in named if not _says_where_and_when(ROOT / n))
    assert not lacking, f"records without machine and date on every entry: {lacking}"


def test_a_table_marked_as_no_measurement_holds_none():
    """The mark is for definitions (a model's parameters), not for results: no figure of a marked table carries a
    unit of time, a ratio or a percentage."""
    for page, _, _, figures, line, marked in _docs_tables():
        if marked:
            measured = [f for _, f in figures if UNIT.search(f)]
            assert not measured, f"docs/{page}:{line}: marked as no measurement but holds {measured}"


def test_the_check_finds_a_figure_typed_by_hand():
    table = "<!-- source: docs/x.jsonl -->\n| model | ms |\n|---|---|\n| a | 12.34 |\n"
    assert _tables(table) == [("docs/x.jsonl", [(4, "12.34")])]
    assert _tables("| a | b |\n|---|---|\n| 1.5 | 2.5 |\n") == [(None, [(3, "2.5")])]  # the first cell names the row
    assert _tables("<!-- source: a.json, b.json -->\n| a | b |\n|---|---|\n| x | 1.5 |\n") == [
        ("a.json, b.json", [(4, "1.5")])]
    assert _recorded("12.34", [12.3412]) and not _recorded("12.34", [12.5, 1234.0])
    assert _recorded("2.8%", [0.02804]) and not _recorded("2.8%", [2.8])
    assert _tables("| a | b |\n|---|---|\n| x | 1,570.7 MB, 0.5 |\n") == [(None, [(3, "1,570.7"), (3, "0.5")])]
    assert _recorded("1,570.7", [1570.71]) and not _recorded("1,570.7", [570.7])
    # ratios and quantities with their unit are figures too
    assert _tables("| a | b |\n|---|---|\n| x | 1.42x, 12.3ms, 0.5 MB, 2.05x** |\n") == [
        (None, [(3, "1.42x"), (3, "12.3ms"), (3, "0.5"), (3, "2.05x")])]
    assert _recorded("1.42x", [1.4213]) and not _recorded("1.42x", [1.5])
    row = [(5, "1.644"), (5, "0.936"), (5, "1.76x"), (5, "1.90x")]
    assert _a_ratio_of_its_row("1.76x", 5, row, [1.644, 0.936])  # 1.644 / 0.936
    assert not _a_ratio_of_its_row("1.90x", 5, row, [1.644, 0.936])
    assert not _a_ratio_of_its_row("1.76x", 5, row, [1.644])  # 0.936 is in no record: no ratio of it counts


def test_a_record_is_read_as_data_without_its_provenance(tmp_path):
    record = tmp_path / "r.jsonl"
    record.write_text(json.dumps({"ms": 12.5, "versions": {"python": "3.11.7"}, "date": "2026-11-26",
                                  "machine": "x86_64, 2 cores", "ok": True, "runs": [1.25, {"p": "0.5"}]}) + "\n")
    assert sorted(_recorded_values(record)) == [0.5, 1.25, 12.5]
