"""The persistent cache of measured latencies (sqlite).

A row is one measured latency, keyed by the device fingerprint (so a cache copied from another machine, or
kept across a PyTorch upgrade, is never used for this one), what was measured (a hash of the unit or stage
signature), the kernels, the batch and the thread configuration. The file lives in ``$OPSCHED_CACHE_DIR``,
else ``$XDG_CACHE_HOME/opsched``, else ``~/.cache/opsched``.

The cache never stops a run. A file that is not an opsched cache (damaged, or another program's database)
is moved aside (``costs.sqlite.unusable-<time>``) with a :class:`CacheWarning` and a new cache started in
its place. Where the file cannot be written (a read-only or full disk, a directory that cannot be made),
the cache continues in memory for this process, with what the file held when it was still readable, and
a warning. Every measurement is committed on its own, so a run interrupted part-way (Ctrl-C) leaves every
finished measurement in the file and nothing of the unfinished one.

>>> import tempfile
>>> cache = LatencyCache(tempfile.mkdtemp() + "/costs.sqlite")
>>> cache.get("cpu:x", "unit:abc", "eager", 1, "2") is None
True
>>> cache.put("cpu:x", "unit:abc", "eager", 1, "2", 0.25, 7)
>>> cache.get("cpu:x", "unit:abc", "eager", 1, "2"), cache.get("cpu:y", "unit:abc", "eager", 1, "2")
(0.25, None)
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import warnings
from pathlib import Path

from opsched.errors import OpschedError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS latency (
    device TEXT NOT NULL, what TEXT NOT NULL, kernels TEXT NOT NULL, batch INTEGER NOT NULL,
    threads TEXT NOT NULL, milliseconds REAL NOT NULL, samples INTEGER NOT NULL, measured_at REAL NOT NULL,
    PRIMARY KEY (device, what, kernels, batch, threads)
)
"""


_COLUMNS = ("device", "what", "kernels", "batch", "threads", "milliseconds", "samples", "measured_at")
# Marks the file as opsched's (sqlite's application_id header field): "opsc".
_APPLICATION_ID = 0x6F707363
# What sqlite reports for a file that is not a database, or a damaged one (a run stopped mid-write on a
# disk that lost its journal, a file truncated by hand).
_UNREADABLE = ("SQLITE_NOTADB", "SQLITE_CORRUPT")


class CacheError(OpschedError):
    """The cache cannot do what was asked (clearing a cache that could not be opened for writing)."""


class CacheWarning(UserWarning):
    """The cache file could not be used as it was; the run goes on (the message says what was done)."""


class _Unusable(Exception):
    """The file at the cache's path is not an opsched cache (``args[0]`` says why)."""


def cache_dir() -> Path:
    """Where the cache lives (see the module docstring)."""
    if os.environ.get("OPSCHED_CACHE_DIR"):
        return Path(os.environ["OPSCHED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "opsched"


def default_path() -> Path:
    return cache_dir() / "costs.sqlite"


class LatencyCache:
    """The cache at ``path`` (default :func:`default_path`); ``in_memory`` says it could not be kept there."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.in_memory = False
        self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                return self._connect()
            except _Unusable as e:
                aside = self._move_aside()
                warnings.warn(f"the latency cache {self.path} {e.args[0]}; moved it to {aside.name} and started "
                              "a new one", CacheWarning, stacklevel=3)
                return self._connect()
        except (OSError, sqlite3.Error, _Unusable) as e:
            return self._to_memory(None, f"cannot write the latency cache {self.path} ({_reason(e)})")

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False)
        try:
            if _check_ours(db) != _APPLICATION_ID:  # a new file, or one written before caches were marked
                db.execute(_SCHEMA)
                db.execute(f"PRAGMA application_id = {_APPLICATION_ID}")
                db.commit()
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self) -> Path:
        """Rename the unusable file (and sqlite's journal files, which would otherwise be applied to the new
        cache) to a name of their own; return the new name of the file."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.unusable-{stamp}")
        for n in range(1, 1000):
            if not aside.exists():
                break
            aside = self.path.with_name(f"{self.path.name}.unusable-{stamp}-{n}")
        self.path.rename(aside)
        for suffix in ("-journal", "-wal", "-shm"):
            companion = self.path.with_name(self.path.name + suffix)
            if companion.exists():
                companion.rename(aside.with_name(aside.name + suffix))
        return aside

    def _to_memory(self, current: sqlite3.Connection | None, why: str) -> sqlite3.Connection:
        """Continue in memory, starting from what the file holds if it can still be read."""
        memory = sqlite3.connect(":memory:", check_same_thread=False)
        with contextlib.suppress(sqlite3.Error, _Unusable):
            if current is not None:
                current.rollback()
                current.backup(memory)
            else:
                with contextlib.closing(sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)) as file:
                    _check_ours(file)
                    file.backup(memory)
        if current is not None:
            with contextlib.suppress(sqlite3.Error):
                current.close()
        memory.execute(_SCHEMA)
        self.in_memory = True
        warnings.warn(f"{why}; measurements are kept in memory for this run only", CacheWarning, stacklevel=4)
        return memory

    def _execute(self, sql: str, parameters: tuple = (), commit: bool = False) -> sqlite3.Cursor:
        """Run one statement; if the file fails (disk full, made read-only, removed), go on in memory."""
        try:
            cursor = self._db.execute(sql, parameters)
            if commit:
                self._db.commit()
            return cursor
        except sqlite3.OperationalError as e:
            if self.in_memory:
                raise
            self._db = self._to_memory(self._db, f"cannot write the latency cache {self.path} ({_reason(e)})")
            cursor = self._db.execute(sql, parameters)
            if commit:
                self._db.commit()
            return cursor

    def get(self, device: str, what: str, kernels: str, batch: int, threads: str) -> float | None:
        row = self._execute(
            "SELECT milliseconds FROM latency WHERE device=? AND what=? AND kernels=? AND batch=? AND threads=?",
            (device, what, kernels, batch, threads)).fetchone()
        return None if row is None else row[0]

    def put(self, device: str, what: str, kernels: str, batch: int, threads: str, milliseconds: float,
            samples: int) -> None:
        self._execute("INSERT OR REPLACE INTO latency VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      (device, what, kernels, batch, threads, milliseconds, samples, time.time()), commit=True)

    def summary(self) -> dict:
        """Rows per device and kernels, and the file's size."""
        rows = self._db.execute("SELECT device, kernels, COUNT(*), MIN(measured_at), MAX(measured_at) "
                                "FROM latency GROUP BY device, kernels ORDER BY device, kernels").fetchall()
        return {"path": str(self.path), "bytes": self.path.stat().st_size if self.path.exists() else 0,
                "in_memory": self.in_memory, "entries": sum(r[2] for r in rows),
                "devices": [{"device": d, "kernels": k, "entries": n, "first": first, "last": last}
                            for d, k, n, first, last in rows]}

    def clear(self) -> int:
        """Delete every row; return how many there were."""
        if self.in_memory:
            raise CacheError(f"cannot clear the latency cache {self.path}: it cannot be written")
        count = self._db.execute("SELECT COUNT(*) FROM latency").fetchone()[0]
        self._db.execute("DELETE FROM latency")
        self._db.commit()
        self._db.execute("VACUUM")
        return count

    def close(self) -> None:
        self._db.close()


def _check_ours(db: sqlite3.Connection) -> int:
    """Raise :class:`_Unusable` unless ``db`` is empty or an opsched cache (one written before the cache
    was marked has the ``latency`` table alone, with opsched's columns); return its application id."""
    try:
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise _Unusable("is damaged")
        marked = db.execute("PRAGMA application_id").fetchone()[0]
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        columns = tuple(row[1] for row in db.execute("PRAGMA table_info(latency)"))
    except sqlite3.DatabaseError as e:
        if getattr(e, "sqlite_errorname", "").startswith(_UNREADABLE):
            raise _Unusable(f"is not a readable sqlite database ({e})") from None
        raise
    if marked not in (0, _APPLICATION_ID):
        raise _Unusable(f"belongs to another program (sqlite application id {marked:#x})")
    if tables and (marked != _APPLICATION_ID and tables != {"latency"} or columns != _COLUMNS):
        raise _Unusable(f"is not an opsched latency cache (tables: {', '.join(sorted(tables))})")
    return marked


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return str(error.args[0]) if error.args else type(error).__name__
