"""The registry's persistent catalog: one SQLite row per adapter name.

Rows survive restarts, so a new registry process on the same file lists the same adapters.
Unloaded names keep their row (state "unloaded") so a later load of the same name continues
its generation count: a decoder never sees generation numbers repeat for a name. Each row records
the base model its adapter was registered against; a catalog written before that column existed
gains it empty ("" = unknown base: such adapters must be registered again where a base is known).

SQLite failures while serving are domain errors naming their cause (`_sqlite_errors`): a full
database or disk is ResourceExhausted (reason CATALOG_FULL), an I/O error, a read-only, missing or
locked file Unavailable (CATALOG_UNAVAILABLE); the registry answers them as such, never INTERNAL.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ResourceExhausted, Unavailable
from tessera.protocol import CATALOG_FULL, CATALOG_UNAVAILABLE

log = logging.getLogger(__name__)

READY = "ready"
UNLOADED = "unloaded"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    digest TEXT NOT NULL,
    rank INTEGER NOT NULL,
    alpha REAL NOT NULL,
    use_rslora INTEGER NOT NULL,
    targets TEXT NOT NULL,
    generation INTEGER NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    base_model TEXT NOT NULL DEFAULT '',
    base_model_name TEXT NOT NULL DEFAULT ''
)
"""
# Columns added after the first schema, with their definitions, for catalogs that predate them.
_ADDED_COLUMNS = {"base_model": "TEXT NOT NULL DEFAULT ''", "base_model_name": "TEXT NOT NULL DEFAULT ''"}
# primary result codes (the low byte of an extended one: SQLITE_IOERR_WRITE & 0xFF == SQLITE_IOERR)
_UNAVAILABLE_CODES = frozenset({sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN,
                                sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_PERM,
                                sqlite3.SQLITE_PROTOCOL, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
_COLUMNS = ("name, path, digest, rank, alpha, use_rslora, targets, generation, state, created_at, "
            "base_model, base_model_name")


@dataclass(frozen=True)
class AdapterRecord:
    """What the registry knows about a name.

    Attributes:
        path: POSIX path relative to the adapter root.
        digest: sha256 hex of the effective weights (see lora.adapter_digest).
        targets: sorted module names.
        generation: 1 on first load, +1 on every later load of the name.
        created_at: unix seconds of the load that produced this generation.
        base_model: sha256 hex of the base model's architecture (checkpoint.base_model_digest) the
            adapter was registered against; "" = unknown (no base configured at load, or a row
            older than the column).
        base_model_name: that base model's readable name ("" when unknown).
    """

    name: str
    path: str
    digest: str
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]
    generation: int
    state: str
    created_at: float
    base_model: str = ""
    base_model_name: str = ""

    @classmethod
    def _from_row(cls, row: tuple) -> AdapterRecord:
        name, path, digest, rank, alpha, rslora, targets, generation, state, created_at, base, base_name = row
        return cls(name, path, digest, int(rank), float(alpha), bool(rslora), tuple(json.loads(targets)),
                   int(generation), state, float(created_at), base, base_name)


class Catalog:
    """Thread-safe access to the SQLite catalog (one connection, one lock).

    Every method raises ResourceExhausted (the database or its disk is full) or Unavailable (the
    file cannot be read or written) for a failing SQLite, with SQLite's own words for the cause.
    """

    def __init__(self, db_path: Path) -> None:
        db_path.parent.mkdir(parents=True, exist_ok=True)
        self._path = db_path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """Bring a catalog written by an older schema up to this one (under a write lock, as two
        registries may open the same old file at once)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                present = {row[1] for row in self._db.execute("PRAGMA table_info(adapters)")}
                for column, definition in _ADDED_COLUMNS.items():
                    if column not in present:
                        self._db.execute(f"ALTER TABLE adapters ADD COLUMN {column} {definition}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, name: str) -> AdapterRecord | None:
        """The row for `name` in any state, or None."""
        with self._lock, self._sqlite_errors():
            row = self._db.execute(f"SELECT {_COLUMNS} FROM adapters WHERE name = ?", (name,)).fetchone()
        return AdapterRecord._from_row(row) if row else None

    def list_ready(self) -> list[AdapterRecord]:
        with self._lock, self._sqlite_errors():
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM adapters WHERE state = ? ORDER BY name", (READY,)).fetchall()
        return [AdapterRecord._from_row(row) for row in rows]

    def put_ready(self, name: str, path: str, digest: str, rank: int, alpha: float, use_rslora: bool,
                  targets: list[str], expected_generation: int, base_model: str = "",
                  base_model_name: str = "") -> AdapterRecord | None:
        """Write generation `expected_generation + 1` for `name` as ready.

        Returns None (and writes nothing) if the stored generation is no longer
        `expected_generation` (0 = no row): a concurrent load won the race.
        """
        generation = expected_generation + 1
        values = (name, path, digest, rank, alpha, int(use_rslora), json.dumps(sorted(targets)), generation,
                  READY, time.time(), base_model, base_model_name)
        with self._lock, self._sqlite_errors():
            current = self._db.execute("SELECT generation FROM adapters WHERE name = ?", (name,)).fetchone()
            if (current[0] if current else 0) != expected_generation:
                return None
            self._db.execute(f"INSERT OR REPLACE INTO adapters ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", values)
        return AdapterRecord._from_row(values)

    def mark_unloaded(self, name: str) -> bool:
        """Set a ready name to unloaded; False if it was not ready."""
        with self._lock, self._sqlite_errors():
            cursor = self._db.execute("UPDATE adapters SET state = ? WHERE name = ? AND state = ?",
                                      (UNLOADED, name, READY))
        return cursor.rowcount == 1

    @contextmanager
    def _sqlite_errors(self) -> Iterator[None]:
        """SQLite's failures as the registry's domain errors (the module's docstring); others pass."""
        try:
            yield
        except sqlite3.Error as error:
            code = getattr(error, "sqlite_errorcode", None)
            primary = None if code is None else code & 0xFF
            if primary not in (sqlite3.SQLITE_FULL, *_UNAVAILABLE_CODES):
                raise
            name = getattr(error, "sqlite_errorname", "") or type(error).__name__
            log.error("adapter catalog %s: %s (%s)", self._path, error, name)
            message = f"adapter catalog: {error} ({name})"
            if primary == sqlite3.SQLITE_FULL:
                raise ResourceExhausted(message, reason=CATALOG_FULL) from error
            raise Unavailable(message, reason=CATALOG_UNAVAILABLE) from error

    def close(self) -> None:
        with self._lock:
            self._db.close()
