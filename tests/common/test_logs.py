"""Log lines (text and JSON), the request-line interceptor with its request id across a hop, and
`tessera up`'s rotated log files and startup-failure causes."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import os
import subprocess
import sys

import grpc
import pytest

from services.common import logs
from services.common.launch import free_port
from services.common.server import insecure_channel
from tessera import log_handlers
from tessera.cli.logfiles import ServiceLog, failure_cause
from tessera.v1 import decoder_pb2, decoder_pb2_grpc, tensor_pb2

from .serving import serving


def _record(message: str, **extra) -> logging.LogRecord:
    return logging.makeLogRecord({"name": "tessera.requests", "levelno": logging.INFO, "levelname": "INFO",
                                  "msg": message, **extra})


def test_a_json_line_is_one_object_with_the_record_and_its_extra_fields():
    formatter = logs.JsonFormatter("decoder")
    line = formatter.format(_record("Generate OK", request_id="abc", status="OK", latency_ms=4.5, prompt_tokens=7))
    parsed = json.loads(line)
    assert parsed["service"] == "decoder" and parsed["level"] == "INFO" and parsed["logger"] == "tessera.requests"
    assert parsed["message"] == "Generate OK"
    assert parsed["ts"].endswith("Z")
    assert {k: parsed[k] for k in ("request_id", "status", "latency_ms", "prompt_tokens")} == {
        "request_id": "abc", "status": "OK", "latency_ms": 4.5, "prompt_tokens": 7}


def test_an_exception_stays_on_its_one_json_line():
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = _record("failed", exc_info=sys.exc_info())
    line = logs.JsonFormatter("gateway").format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert "Traceback" in parsed["exc"] and parsed["exc"].endswith("ValueError: bad\nvalue")


def test_a_text_line_carries_the_extra_fields_as_key_value():
    line = logs.TextFormatter().format(_record("Generate OK", request_id="abc", status="OK"))
    assert line.endswith("INFO tessera.requests: Generate OK request_id=abc status=OK")


def test_a_caller_id_is_kept_printable_and_short_and_an_empty_one_is_made():
    assert logs.use_request_id("a b\nc") == "abc"
    assert len(logs.use_request_id("x" * 1000)) == logs.MAX_REQUEST_ID_CHARS
    made = logs.use_request_id("")
    assert len(made) == 32 and int(made, 16) >= 0


def test_the_format_comes_from_the_flag_or_the_environment(monkeypatch, capsys):
    """JSON mode: records, and every other line written to stderr or stdout, are JSON lines."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level, sys.stdout, sys.stderr
    try:
        logs.configure_logging("pooling", ["--log-format", "json", "--other-flag"])
        logging.getLogger("tessera.test").warning("hello %s", "there", extra={"route": "/x"})
        sys.stderr.write("Loading weights: 0%\rLoading weights: 100%\n")
        print("a library's print")
        err = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert [(r["service"], r["logger"], r["message"]) for r in err] == [
            ("pooling", "tessera.test", "hello there"), ("pooling", "stderr", "Loading weights: 100%"),
            ("pooling", "stdout", "a library's print")]
        assert err[0]["route"] == "/x"
        monkeypatch.setenv("TESSERA_LOG_FORMAT", "xml")
        with pytest.raises(SystemExit, match="log_format must be one of"):
            logs.configure_logging("pooling", [])
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        sys.stdout, sys.stderr = saved[2], saved[3]
        logging.captureWarnings(False)
        sys.excepthook = sys.__excepthook__


def test_a_library_imported_before_logging_is_configured_logs_json_too():
    """transformers adds its own plain handler ("[transformers] ...") on import; the services import
    it before configuring logging, so JSON mode must take that handler's records over."""
    script = (
        "from transformers.utils import logging as hf\n"
        "hf.get_logger('transformers.early').info('configured')\n"  # its handler is made here
        "from services.common import logs\n"
        "logs.configure_logging('pooling', ['--log-format', 'json'])\n"
        "hf.get_logger('transformers.tokenization').warning('Token indices sequence length is longer')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert [(r["logger"], r["level"]) for r in records] == [("transformers.tokenization", "WARNING")], records


class _Decoder(decoder_pb2_grpc.DecoderServicer):
    """Streams two choices' last messages with usage; refuses an empty request_id."""

    async def Generate(self, request, context):
        if not request.request_id:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("request_id is empty")
            return
        usage = tensor_pb2.Usage(prompt_tokens=5, completion_tokens=3)
        yield decoder_pb2.GenerateResponse(token_ids=[1, 2, 3], finish_reason="length", usage=usage, index=0)
        usage = tensor_pb2.Usage(prompt_tokens=5, completion_tokens=2)
        yield decoder_pb2.GenerateResponse(token_ids=[4, 5], finish_reason="stop", usage=usage, index=1)


def _register(server):
    decoder_pb2_grpc.add_DecoderServicer_to_server(_Decoder(), server)
    return [decoder_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name]


def test_each_call_logs_one_line_with_the_id_the_caller_handled(caplog):
    """The calling side's request id goes out as metadata (server.insecure_channel) and is the
    serving side's line's id; tokens are summed over the choices; a refusal logs its status."""
    caplog.set_level(logging.INFO, logger=logs.REQUEST_LOGGER)

    async def call(address: str):
        logs.use_request_id("caller-id-1")
        async with insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderStub(channel)
            call = stub.Generate(decoder_pb2.GenerateRequest(request_id="r"), timeout=10)
            assert len([r async for r in call]) == 2
            assert (logs.REQUEST_ID_METADATA, "caller-id-1") in tuple(await call.trailing_metadata())
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(decoder_pb2.GenerateRequest(), timeout=10):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    async def both():
        address = f"127.0.0.1:{free_port()}"
        async with serving("decoder", _register, lambda: None, address=address):
            await asyncio.create_task(call(address))

    asyncio.run(both())
    lines = [r for r in caplog.records if r.name == logs.REQUEST_LOGGER and r.method.endswith("/Generate")]
    assert [(r.request_id, r.status) for r in lines] == [("caller-id-1", "OK"), ("caller-id-1", "INVALID_ARGUMENT")]
    assert (lines[0].prompt_tokens, lines[0].completion_tokens) == (5, 5)
    assert lines[0].latency_ms >= 0 and not hasattr(lines[1], "prompt_tokens")
    assert all(r.levelno == logging.INFO for r in lines)
    polls = [r for r in caplog.records if r.name == logs.REQUEST_LOGGER and "Health" in r.method]
    assert all(r.levelno == logging.DEBUG for r in polls)


def test_the_log_file_rotates_at_its_size_keeping_whole_lines(tmp_path):
    path = tmp_path / "decoder.log"
    log = ServiceLog(path, max_bytes=1000, backups=2)
    lines = [f"line {i:04d} " + "x" * 40 for i in range(100)]  # 50 bytes each with its newline
    for line in lines:
        log.write(line)
    log.close()
    files = [path, path.with_name("decoder.log.1"), path.with_name("decoder.log.2")]
    assert all(f.exists() for f in files) and not path.with_name("decoder.log.3").exists()
    assert all(f.stat().st_size <= 1000 for f in files)
    kept = [line for f in reversed(files) for line in f.read_text().splitlines()]
    assert kept == lines[-len(kept):]  # the newest lines, whole and in order
    assert len(kept) >= 2 * 1000 // 50


def test_a_followed_process_writes_its_output_to_the_file(tmp_path):
    log = ServiceLog(tmp_path / "x.log", max_bytes=10_000, backups=1)
    process = subprocess.Popen([sys.executable, "-c", "import sys; print('out'); sys.exit('config is wrong')"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log.follow(process.stdout)
    process.wait()
    log.drain()
    assert log.recent() == ["out", "config is wrong"]
    log.close()
    assert (tmp_path / "x.log").read_text() == "out\nconfig is wrong\n"


def test_a_log_file_on_a_full_disk_is_one_warning_not_a_traceback_per_line(tmp_path, capfd):
    """/dev/full answers every write ENOSPC, as a full disk does."""
    path = tmp_path / "decoder.log"
    path.symlink_to("/dev/full")
    log = ServiceLog(path, max_bytes=10_000_000, backups=1)
    for index in range(241):
        log.write(f"line {index}")
    log.close()
    err = capfd.readouterr().err
    assert err == (f"logging: cannot write to {path}: [Errno 28] No space left on device; dropping log records "
                   "until it can be written again\n"), err
    assert log._handler.num_dropped == 241


class _Disk(io.StringIO):
    """A stream that answers ENOSPC while `full`."""

    full = False

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(text)


def test_a_stream_that_is_written_again_takes_the_next_records_and_says_how_many_were_lost(capfd):
    disk = _Disk()
    disk.name = "<disk>"
    handler = log_handlers.StreamHandler(disk)
    logger = logging.getLogger("tests.fail_soft")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("before")
        disk.full = True
        for index in range(3):
            logger.warning("lost %d", index)
        disk.full = False
        logger.warning("after")
        logger.warning("bad format %d", "not a number")  # not the disk's fault: logging's own report stays
    finally:
        logger.removeHandler(handler)
    assert disk.getvalue() == "before\nafter\n"
    err = capfd.readouterr().err
    assert err.startswith("logging: cannot write to <disk>: [Errno 28] No space left on device; dropping log "
                          "records until it can be written again\n"
                          "logging: <disk> is written again; 3 log record(s) were dropped\n"
                          "--- Logging error ---\n"), err
    assert err.count("--- Logging error ---") == 1


TRACEBACK = """\
2026-11-30 18:00:00,000 INFO services.decoder: loading
Traceback (most recent call last):
  File "x.py", line 1, in <module>
ValueError: num_blocks must be >= 0, got -1
"""


def test_the_cause_is_the_last_error_line():
    assert failure_cause(TRACEBACK.splitlines(), exited=True) == "ValueError: num_blocks must be >= 0, got -1"
    usage = ["usage: python -m services.gateway [-h]", "python -m services.gateway: error: unrecognized arguments: --x"]
    assert failure_cause(usage, exited=True) == usage[1]
    records = [json.dumps({"level": "CRITICAL", "message": "OSError: port\n 1 is in use"}),
               json.dumps({"level": "INFO", "message": "decoder: draining"})]
    assert failure_cause(records, exited=True) == "OSError: port 1 is in use"
    assert failure_cause(["", "internal token file /t is empty", ""], exited=True) == "internal token file /t is empty"
    assert failure_cause(["2026 INFO tessera: loading weights"], exited=False) is None
