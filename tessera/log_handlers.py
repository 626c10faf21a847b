"""Log handlers that survive a stream that cannot be written: a full disk, a closed pipe.

The stdlib's handlers report a failed write by printing "--- Logging error ---" and a traceback
to stderr, once per record: a full log disk turns every log line of every service into a
traceback on `tessera up`'s terminal. These handlers say it once instead, one line on stderr
naming the file and the error, drop records while writes fail (each record is still tried, so the
first one that is written again ends the outage, and one line says how many were lost), and keep
logging's own report for anything that is not an OSError (a bad format string is a bug to see).
"""

from __future__ import annotations

import logging
import logging.handlers
import sys


class FailSoft:
    """Mixin for a `logging.StreamHandler` (or subclass): an OSError while emitting is one warning
    line per outage (module docstring); `num_dropped` counts the records lost in the current one."""

    num_dropped = 0
    _failed = False  # set by handleError during the current emit

    def emit(self, record: logging.LogRecord) -> None:
        self._failed = False
        super().emit(record)
        if self._failed:
            if self.num_dropped == 0:
                _warn(f"logging: cannot write to {self._target()}: {self._error_text}; "
                      f"dropping log records until it can be written again")
            self.num_dropped += 1
        elif self.num_dropped:
            _warn(f"logging: {self._target()} is written again; {self.num_dropped} log record(s) were dropped")
            self.num_dropped = 0

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self._failed = True
        self._error_text = f"[Errno {error.errno}] {error.strerror}" if error.errno else str(error)

    def close(self) -> None:
        """Close the stream; records it still buffered and cannot write are dropped (warned once)."""
        try:
            super().close()
        except OSError as error:
            if self.num_dropped == 0:
                _warn(f"logging: cannot write to {self._target()}: [Errno {error.errno}] {error.strerror}; "
                      f"its last log records are dropped")

    def _target(self) -> str:
        return getattr(self, "baseFilename", None) or str(getattr(self.stream, "name", self.stream))


def _warn(line: str) -> None:
    """One line on the process's original stderr, or nowhere if that cannot be written either."""
    stream = sys.__stderr__
    try:
        if stream is not None:
            stream.write(line + "\n")
            stream.flush()
    except (OSError, ValueError):
        pass


class StreamHandler(FailSoft, logging.StreamHandler):
    """logging.StreamHandler with FailSoft's one warning per outage."""


class RotatingFileHandler(FailSoft, logging.handlers.RotatingFileHandler):
    """logging.handlers.RotatingFileHandler with FailSoft's one warning per outage."""
