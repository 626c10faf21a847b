"""The log files `tessera up` writes: each process's stdout and stderr, size-rotated, and what a
process that failed to start said last.

Services log to stderr (services/common/logs.py). `up` reads each child's output from a pipe on a
thread of its own and writes it line by line through the stdlib's `RotatingFileHandler`: at
`max_bytes` the file becomes `<name>.log.1` (`.1` -> `.2`, ... up to `backups`). Rotating here
rather than in the services keeps every byte a process writes in one rotated file — also what
comes before its logging is configured (a flag refused by argparse, an import error, a
traceback), what C libraries write to the stderr descriptor, and a crash's last words — and
keeps the services free of file handling (in a container they log to stderr as they do here).
The reader drains the pipe as fast as lines come, so a service never blocks on a full pipe. A
file that cannot be written (a full disk) is one line on `up`'s stderr, not a traceback per line
(tessera/log_handlers.py); the lines are dropped until the file takes them again.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading
from pathlib import Path
from typing import BinaryIO

from tessera import log_handlers

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_BACKUPS = 3
RECENT_LINES = 200  # kept in memory per process: what a failed start is reported from
MAX_LINE_BYTES = 1024 * 1024  # a longer line is written in pieces

# A line saying what went wrong: an exception (`ValueError: ...`), argparse's `prog: error: ...`,
# or a log record at ERROR and above.
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception|Exit)\b|\berror:|\b(ERROR|CRITICAL|FATAL)\b")


class ServiceLog:
    """One process's log file, `path`, rotated at `max_bytes` keeping `backups` old files.

    `follow(pipe)` copies a child's output into it from a daemon thread, one record per line;
    a restarted process follows into the same file. `recent()` is what the process followed
    last wrote, newest last.

    Raises:
        ValueError: `max_bytes` < 1 or `backups` < 0 (the constructor).
    """

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS):
        if max_bytes < 1 or backups < 0:
            raise ValueError(f"log rotation needs max_bytes >= 1 and backups >= 0, got {max_bytes} and {backups}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = log_handlers.RotatingFileHandler(self.path, maxBytes=max_bytes, backupCount=backups,
                                                             encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._recent: collections.deque[str] = collections.deque(maxlen=RECENT_LINES)
        self._threads: list[threading.Thread] = []

    def follow(self, pipe: BinaryIO) -> None:
        """Copy `pipe` (a child's stdout) into the file until it ends, on a daemon thread."""
        self._recent = collections.deque(maxlen=RECENT_LINES)  # an old process's thread keeps its own
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=self._copy, args=(pipe, self._recent), daemon=True,
                                  name=f"log {self.path.name}")
        thread.start()
        self._threads.append(thread)

    def write(self, line: str) -> None:
        """Append one line (without its newline), rotating first when it would pass max_bytes."""
        self._handler.handle(logging.makeLogRecord({"msg": line}))

    def _copy(self, pipe: BinaryIO, recent: collections.deque[str]) -> None:
        with pipe:
            for chunk in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
                line = chunk.decode("utf-8", errors="replace").rstrip("\r\n")
                recent.append(line)
                self.write(line)

    def drain(self, timeout_s: float = 2.0) -> None:
        """Wait (up to `timeout_s` each) until the followed pipes are read to their end: after a
        process exits, so `recent()` holds its last words."""
        for thread in self._threads:
            thread.join(timeout_s)

    def recent(self, lines: int = RECENT_LINES) -> list[str]:
        return list(self._recent)[-lines:]

    def close(self) -> None:
        self.drain()
        self._handler.close()


class StartupError(RuntimeError):
    """A service that exited during startup or was not SERVING in time.

    `reason`: what happened ("exited with code 2"); `cause`: the one line of its log that says
    why (tessera/cli/logfiles.py `failure_cause`), or None; `tail`: its last log lines;
    `log_path`: its whole log.
    """

    def __init__(self, service: str, reason: str, cause: str | None, tail: list[str], log_path: Path):
        self.service, self.reason, self.cause, self.tail, self.log_path = service, reason, cause, tail, log_path
        super().__init__(self.report())

    def report(self) -> str:
        """What `up` prints: one line naming the service and the cause, then the log's last lines."""
        head = f"{self.service} failed to start: {self.cause or self.reason}"
        if self.cause:
            head += f" ({self.reason})"
        shown = "\n".join(f"  {line}" for line in self.tail)
        return f"{head}\nlast {len(self.tail)} lines of {self.log_path}:\n{shown}" if self.tail else head


def failure_cause(lines: list[str], exited: bool) -> str | None:
    """The last line of `lines` that says what went wrong, as one line, or None.

    A JSON record (services/common/logs.py) at ERROR or CRITICAL gives its message; a text line
    counts when it names an exception (`ValueError: ...`), is argparse's `prog: error: ...`, or is
    a record at ERROR and above. When none does and the process `exited`, its last non-empty
    line (a service refusing its configuration prints one line and exits).
    """
    for line in reversed(lines):
        text = line.strip()
        if not text:
            continue
        record = _json_record(text)
        if record is not None:
            if str(record.get("level", "")).upper() in ("ERROR", "CRITICAL"):
                return " ".join(str(record.get("message", "")).split())
            continue
        if _ERROR_LINE.search(text):
            return text
    last = next((line.strip() for line in reversed(lines) if line.strip()), None)
    if not exited or last is None:
        return None
    record = _json_record(last)
    return " ".join(str(record.get("message", "")).split()) if record is not None else last


def _json_record(text: str) -> dict | None:
    if not text.startswith("{"):
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
