"""The persistent cache of measured latencies (sqlite).

A row is one measured latency, keyed by the device fingerprint (so a cache copied from another machine, or
kept across a PyTorch upgrade, is never used for this one), what was measured (a hash of the unit or stage
signature), the kernels, the batch and the thread configuration. The file lives in ``$OPSCHED_CACHE_DIR``,
else ``$XDG_CACHE_HOME/opsched``, else ``~/.cache/opsched``.

>>> import tempfile
>>> cache = LatencyCache(tempfile.mkdtemp() + "/costs.sqlite")
>>> cache.get("cpu:x", "unit:abc", "eager", 1, "2") is None
True
>>> cache.put("cpu:x", "unit:abc", "eager", 1, "2", 0.25, 7)
>>> cache.get("cpu:x", "unit:abc", "eager", 1, "2"), cache.get("cpu:y", "unit:abc", "eager", 1, "2")
(0.25, None)
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from opsched.errors import OpschedError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS latency (
    device TEXT NOT NULL, what TEXT NOT NULL, kernels TEXT NOT NULL, batch INTEGER NOT NULL,
    threads TEXT NOT NULL, milliseconds REAL NOT NULL, samples INTEGER NOT NULL, measured_at REAL NOT NULL,
    PRIMARY KEY (device, what, kernels, batch, threads)
)
"""


class CacheError(OpschedError):
    """The cache file cannot be opened or is not an opsched cache."""


def cache_dir() -> Path:
    """Where the cache lives (see the module docstring)."""
    if os.environ.get("OPSCHED_CACHE_DIR"):
        return Path(os.environ["OPSCHED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "opsched"


def default_path() -> Path:
    return cache_dir() / "costs.sqlite"


class LatencyCache:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False)
            self._db.execute(_SCHEMA)
            self._db.commit()
        except (OSError, sqlite3.Error) as e:
            raise CacheError(f"cannot use the latency cache {self.path}: {e}") from None

    def get(self, device: str, what: str, kernels: str, batch: int, threads: str) -> float | None:
        row = self._db.execute(
            "SELECT milliseconds FROM latency WHERE device=? AND what=? AND kernels=? AND batch=? AND threads=?",
            (device, what, kernels, batch, threads)).fetchone()
        return None if row is None else row[0]

    def put(self, device: str, what: str, kernels: str, batch: int, threads: str, milliseconds: float,
            samples: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO latency VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (device, what, kernels, batch, threads, milliseconds, samples, time.time()))
        self._db.commit()

    def summary(self) -> dict:
        """Rows per device and kernels, and the file's size."""
        rows = self._db.execute("SELECT device, kernels, COUNT(*), MIN(measured_at), MAX(measured_at) "
                                "FROM latency GROUP BY device, kernels ORDER BY device, kernels").fetchall()
        return {"path": str(self.path), "bytes": self.path.stat().st_size if self.path.exists() else 0,
                "entries": sum(r[2] for r in rows),
                "devices": [{"device": d, "kernels": k, "entries": n, "first": first, "last": last}
                            for d, k, n, first, last in rows]}

    def clear(self) -> int:
        """Delete every row; return how many there were."""
        count = self._db.execute("SELECT COUNT(*) FROM latency").fetchone()[0]
        self._db.execute("DELETE FROM latency")
        self._db.commit()
        self._db.execute("VACUUM")
        return count

    def close(self) -> None:
        self._db.close()
