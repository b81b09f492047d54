"""Reading the JSON files users hand us (DAG JSON, plans), each problem one line naming the file and place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opsched.errors import OpschedError


def read_text(path: str | Path, error: type[OpschedError]) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None


def parse_json(text: str, source: str, error: type[OpschedError]) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{source}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def read_json(path: str | Path, error: type[OpschedError]) -> Any:
    return parse_json(read_text(path, error), str(path), error)
