"""Logging of every service: text or JSON lines on stderr, one line per request, request ids.

`--log-format text|json` ($TESSERA_LOG_FORMAT) and `--log-level` ($TESSERA_LOG_LEVEL) are the
`LogConfig` flags every service's command line carries; `configure_logging(service, argv)` reads
them once at start. A JSON line is one object:

    {"ts": "2026-11-30T18:00:00.123Z", "level": "INFO", "service": "decoder",
     "logger": "tessera.requests", "message": "/tessera.v1.Decoder/Generate OK 41.2 ms",
     "request_id": "3f2a...", "method": "/tessera.v1.Decoder/Generate", "status": "OK",
     "latency_ms": 41.2, "prompt_tokens": 5, "completion_tokens": 8}

A text line carries the same fields after the message as `key=value`. Exceptions are one JSON
line too (`exc` holds the traceback), also an uncaught one at start.

Request ids: the server interceptor (`RequestLogInterceptor`, on every service's port) takes the
caller's `x-request-id` metadata or makes one (uuid4 hex), answers it in the call's trailing
metadata, keeps it for the call in a context variable, stamps it on every log record the call emits, and logs the call's line when it ends
(method, status, latency, prompt/completion tokens from the responses' `usage`). Every channel
a service opens to another (`services.common.server.insecure_channel`) sends that id on as
`x-request-id`, so one request's id is on its lines in the gateway and in the decoder. Polls
(health, reflection, GetInfo, GetMetrics, residency reports) are logged at DEBUG.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextvars
import inspect
import io
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import grpc

from services.common.config_cli import add_flags, from_flags
from services.common.interceptors import metadata_interceptors
from tessera import log_handlers
from tessera.protocol import LOG_FORMAT_ENV, LOG_LEVEL_ENV, REQUEST_ID_METADATA

MAX_REQUEST_ID_CHARS = 128  # a longer caller id is cut (it is only ever logged and passed on)
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
REQUEST_LOGGER = "tessera.requests"
# Calls that pollers make every second or so; their lines would bury the requests.
POLL_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/GetInfo", "/GetMetrics", "/ReportResidency")

# LogRecord's own attributes; everything else on a record is an extra field of the line.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


@dataclass(frozen=True)
class LogConfig:
    """How a service logs: `log_format` "text" or "json" lines on stderr, at `log_level` and above."""

    log_format: str = field(default="text", metadata={
        "help": "log line format: text, or json (one object per line)", "choices": LOG_FORMATS,
        "env": LOG_FORMAT_ENV})
    log_level: str = field(default="INFO", metadata={
        "help": "least severe level logged; INFO logs one line per request", "choices": LOG_LEVELS,
        "env": LOG_LEVEL_ENV, "type": str.upper})

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The logging flags of a service's command line (`LogConfig`'s)."""
    add_flags(parser, LogConfig)


def configure_logging(service: str, argv: Sequence[str] | None = None) -> LogConfig:
    """Log to stderr as the logging flags of `argv` (default sys.argv[1:]) say, every line naming
    `service`. Called once, first thing in every service's `main`; the service's own parser has
    the same flags (`add_arguments`) and reports their errors.

    In JSON mode every line is JSON: warnings, an uncaught exception and whatever else is written to
    sys.stdout or sys.stderr (a library's progress bar, a SystemExit message) are records too.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    args, _ = parser.parse_known_args(argv)
    try:
        config = from_flags(LogConfig, args)
    except ValueError as error:  # a bad $TESSERA_LOG_FORMAT / $TESSERA_LOG_LEVEL (argparse checks flags)
        raise SystemExit(str(error)) from None
    handler = log_handlers.StreamHandler(sys.stderr)  # a stderr that cannot be written: one warning, not a traceback a line
    handler.setFormatter(JsonFormatter(service) if config.log_format == "json" else TextFormatter())
    handler.addFilter(_stamp_request_id)
    logging.basicConfig(level=config.log_level, handlers=[handler], force=True)
    logging.captureWarnings(True)
    if config.log_format == "json":
        _adopt_library_handlers()
        sys.excepthook = _log_uncaught
        sys.stdout, sys.stderr = _LinesAsRecords("stdout", sys.stdout), _LinesAsRecords("stderr", sys.stderr)
    return config


def _adopt_library_handlers() -> None:
    """A library imported before logging was configured may hold a handler of its own writing plain
    text to the real stderr (transformers does: "[transformers] ..."): drop it and let the library's
    records propagate to the root handler, so that they are JSON records too. (A library imported
    later writes through sys.stderr, which JSON mode turns into records.)"""
    for logger in list(logging.root.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):
            continue
        plain = [h for h in logger.handlers if type(h) is logging.StreamHandler
                 and h.stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)]
        for handler in plain:
            logger.removeHandler(handler)
        if plain:
            logger.propagate = True


def _log_uncaught(kind, error, traceback) -> None:
    if issubclass(kind, KeyboardInterrupt):
        return sys.__excepthook__(kind, error, traceback)
    logging.getLogger("tessera").critical("%s: %s", kind.__name__, error, exc_info=(kind, error, traceback))


def stop_line(name: str, line: str) -> None:
    """The one line a process prints when it stops for a reason it can name: plain on stderr, or in
    JSON mode (stderr already turned into INFO records) a CRITICAL record of logger `name`, so that
    `tessera up` reports it as the cause rather than an earlier, vaguer error."""
    if isinstance(sys.stderr, _LinesAsRecords):
        logging.getLogger(name).critical(line)
        return
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class _LinesAsRecords(io.TextIOBase):
    """A text stream whose every line becomes an INFO record of logger `name` (JSON mode's
    sys.stdout / sys.stderr). A progress bar's carriage-return updates keep their last state. A
    line written while one is being logged (logging reporting its own error) goes to `raw`."""

    def __init__(self, name: str, raw):
        super().__init__()
        self.log, self.raw = logging.getLogger(name), raw
        self._pending = ""
        self._busy = threading.local()
        atexit.register(self._finish)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.raw.fileno()

    def write(self, text: str) -> int:
        if getattr(self._busy, "on", False):
            return self.raw.write(text)
        *lines, self._pending = (self._pending + text).split("\n")
        _, returned, shown = self._pending.rpartition("\r")
        if returned and shown:  # a progress bar redrawn in place: only its last state is kept
            self._pending = shown
        self._busy.on = True
        try:
            for line in lines:
                shown = next((part for part in reversed(line.split("\r")) if part.strip()), "")
                if shown.strip():
                    self.log.info("%s", shown.rstrip())
        finally:
            self._busy.on = False
        return len(text)

    def _finish(self) -> None:
        if self._pending:
            self.write("\n")


def _stamp_request_id(record: logging.LogRecord) -> bool:
    """Give every record logged while a request is handled that request's id."""
    if not hasattr(record, "request_id"):
        request_id = _request_id.get()
        if request_id:
            record.request_id = request_id
    return True


def extra_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields passed with `extra=` (and the stamped request id), in the order they were set."""
    return {key: value for key, value in vars(record).items() if key not in _RECORD_FIELDS}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601, ms), level, service, logger, message, then the
    record's extra fields; `exc` holds an exception's traceback. Never a line break inside a line."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
                .replace("+00:00", "Z"),
                "level": record.levelname, "service": self.service, "logger": record.name,
                "message": record.getMessage(), **extra_fields(record)}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`ts LEVEL logger: message key=value ...` (the record's extra fields after the message)."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{key}={value}" for key, value in extra_fields(record).items())
        message = super().formatMessage(record)
        return f"{message} {fields}" if fields else message


# ---- request ids ----------------------------------------------------------------------------

def request_id() -> str:
    """The id of the request being handled in this context ("" outside a request)."""
    return _request_id.get()


def use_request_id(value: str | None) -> str:
    """Make `value` or, when it has no printable character, a fresh uuid4 hex the id of the request
    handled in this context; returns it. Spaces and control characters are dropped (the id is one
    token of a text line) and the rest cut to MAX_REQUEST_ID_CHARS."""
    kept = "".join(char for char in value or "" if char.isprintable() and not char.isspace())
    value = kept[:MAX_REQUEST_ID_CHARS] or uuid.uuid4().hex
    _request_id.set(value)
    return value


def _metadata_value(metadata, key: str) -> str | None:
    for entry_key, value in metadata or ():
        if entry_key == key:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


class RequestLogInterceptor(grpc.aio.ServerInterceptor):
    """Takes or makes each call's request id and logs one line when the call ends.

    The line (logger "tessera.requests") carries request_id, method, status (the gRPC code's
    name), latency_ms and, where the responses carry `usage`, prompt_tokens and completion_tokens
    (a Generate's choices summed). INFO, or DEBUG for POLL_METHODS. Wraps the four handler kinds
    in their own shapes, as error_interceptor.ErrorInterceptor does; synchronous handlers pass untouched.
    """

    _FACTORIES = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }

    def __init__(self) -> None:
        self.log = logging.getLogger(REQUEST_LOGGER)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        level = logging.DEBUG if any(poll in details.method for poll in POLL_METHODS) else logging.INFO
        for kind, factory in self._FACTORIES.items():
            inner = getattr(handler, kind)
            if inner is None:
                continue
            if inspect.isasyncgenfunction(inner):
                behavior = self._streaming(inner, details.method, level)
            elif inspect.iscoroutinefunction(inner):
                behavior = self._single(inner, details.method, level)
            else:
                return handler
            return factory(behavior, handler.request_deserializer, handler.response_serializer)
        return handler

    def _single(self, inner, method: str, level: int):
        async def behavior(request, context):
            call = _CallLog(context, method)
            try:
                response = await inner(request, context)
                call.tally(response)
                return response
            except BaseException as error:
                call.failed(error)
                raise
            finally:
                call.emit(self.log, level)

        return behavior

    def _streaming(self, inner, method: str, level: int):
        async def behavior(request, context):
            call = _CallLog(context, method)
            try:
                async for response in inner(request, context):
                    call.tally(response)
                    yield response
            except BaseException as error:
                call.failed(error)
                raise
            finally:
                call.emit(self.log, level)

        return behavior


class _CallLog:
    """One call's id, start time, status and token counts, until its line is logged."""

    def __init__(self, context: grpc.aio.ServicerContext, method: str):
        self.context, self.method = context, method
        self.request_id = use_request_id(_metadata_value(context.invocation_metadata(), REQUEST_ID_METADATA))
        context.set_trailing_metadata(((REQUEST_ID_METADATA, self.request_id),))  # the caller learns the id
        self.started = time.perf_counter()
        self.prompt_tokens: int | None = None
        self.completion_tokens = 0
        self.error_status: str | None = None

    def tally(self, response) -> None:
        fields = getattr(getattr(response, "DESCRIPTOR", None), "fields_by_name", {})
        if "usage" in fields and response.HasField("usage"):  # a Generate: each choice's last message
            self.prompt_tokens = max(self.prompt_tokens or 0, response.usage.prompt_tokens)
            self.completion_tokens += response.usage.completion_tokens

    def failed(self, error: BaseException) -> None:
        if isinstance(error, asyncio.CancelledError):
            self.error_status = grpc.StatusCode.CANCELLED.name
        elif not isinstance(error, grpc.aio.AbortError):  # abort() has set the code
            self.error_status = grpc.StatusCode.UNKNOWN.name

    def status(self) -> str:
        if self.error_status is not None:
            return self.error_status
        code = self.context.code()
        if code is None:
            return grpc.StatusCode.OK.name
        return code.name if isinstance(code, grpc.StatusCode) else grpc.StatusCode(code).name

    def emit(self, log: logging.Logger, level: int) -> None:
        if not log.isEnabledFor(level):
            return
        latency_ms = round((time.perf_counter() - self.started) * 1000, 1)
        status = self.status()
        fields = {"request_id": self.request_id, "method": self.method, "status": status, "latency_ms": latency_ms}
        if self.prompt_tokens is not None:
            fields |= {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        log.log(level, "%s %s %.1f ms", self.method, status, latency_ms, extra=fields)


# ---- passing the id on ------------------------------------------------------------------------

def _request_id_entry(details: grpc.aio.ClientCallDetails) -> tuple[tuple[str, str], ...]:
    """This context's request id for a call's metadata, unless the caller set one."""
    current = _request_id.get()
    if not current or _metadata_value(details.metadata, REQUEST_ID_METADATA) is not None:
        return ()
    return ((REQUEST_ID_METADATA, current),)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio client interceptors sending the current request's id as `x-request-id` metadata."""
    return metadata_interceptors(_request_id_entry)
