"""The HTTP port bounded as a production proxy: a chat body past its route's limit is 413 from its
Content-Length or while streaming, before parsing; bodies past the in-flight budget are 503 with
Retry-After before they are read; eight concurrent 200 MiB chat bodies keep the gateway's memory
bounded and its gRPC port answering within a second; a connection that sends nothing, dribbles
its request head or idles after an answer is closed; a request past the connection cap is 503.
Real processes on loopback: the gateway alone (`python -m services.gateway`, no backend
listening: bodies are read, parsed and refused downstream), spoken to over raw sockets so a
client can stream, stall and watch for the answer."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.message_limits import MIB, gateway_bytes

from .test_frozen_replica import _free_ports, _start, _until

CHUNK = memoryview(b"A" * MIB)  # every body streams from this one buffer: no client holds a whole body
SMALL_IMAGES = 4  # --max-images of the small gateway: its chat limit is gateway_bytes(4), below 200 MiB
SMALL_BUDGET = 150 * MIB  # its --max-body-bytes-in-flight
TIMEOUT_S = 1.0  # its --http-header-timeout and --timeout-keep-alive
SLACK_S = 2.0  # what a loaded machine adds to a timer's firing and a close's arrival


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class Gateway:
    def __init__(self, process, grpc_port: int, http_port: int) -> None:
        self.process, self.grpc_port, self.http_port = process, grpc_port, http_port

    def rss(self) -> int:
        return _rss_bytes(self.process.pid)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.http_port), timeout=30)


def _gateway(tmp_path: Path, name: str, *flags: str):
    grpc_port, http_port = _free_ports()[:2]
    process = _start(["-m", "services.gateway", "--address", f"127.0.0.1:{grpc_port}", "--decoder", "127.0.0.1:1",
                      "--pooling", "127.0.0.1:1", "--adapters", "127.0.0.1:1", "--vision", "",
                      "--http-port", str(http_port), *flags], tmp_path / f"{name}.log")
    gateway = Gateway(process, grpc_port, http_port)

    def listening() -> bool:
        assert process.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
        try:
            socket.create_connection(("127.0.0.1", http_port), timeout=1).close()
            return True
        except OSError:
            return False

    _until(listening, 60, f"the {name} gateway's HTTP port")
    return gateway


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A gateway with a chat limit below 200 MiB, a 150 MiB budget and 1 s connection timeouts."""
    gateway = _gateway(tmp_path_factory.mktemp("small"), "small", "--max-images", str(SMALL_IMAGES),
                       "--max-body-bytes-in-flight", str(SMALL_BUDGET), "--http-header-timeout", str(TIMEOUT_S),
                       "--timeout-keep-alive", str(TIMEOUT_S))
    yield gateway
    gateway.process.kill()
    gateway.process.wait(10)


def _head(path: str, length: int | None, expect: bool = False) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{framing}\r\n"
            + ("Expect: 100-continue\r\n" if expect else "") + "\r\n").encode()


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one response; a 100 Continue is skipped."""
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            piece = sock.recv(65536)
            assert piece, f"the connection closed before an answer (got {data[:200]!r})"
            data += piece
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if status != 100:
            break
    length = int(headers.get("content-length", "0"))
    while len(data) < length:
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return status, headers, data[:length]


def _send_until_answered(sock: socket.socket, pieces: Iterator[bytes], chunked: bool = False) -> None:
    """Sends `pieces` until the server answers (something to read), stops reading, or closes."""
    sock.settimeout(5)
    try:
        for piece in pieces:
            if select.select([sock], [], [], 0)[0]:
                return
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except (TimeoutError, BrokenPipeError, ConnectionResetError):
        return
    finally:
        sock.settimeout(60)


def _filler(num_bytes: int) -> Iterator[memoryview]:
    while num_bytes > 0:
        yield CHUNK[:min(num_bytes, len(CHUNK))]
        num_bytes -= len(CHUNK)


def _chat_pieces(num_images: int, image_bytes: int) -> tuple[int, list]:
    """(Content-Length, pieces) of a chat body of `num_images` base64 data URIs of `image_bytes` each."""
    parts = [(b'{"type":"image_url","image_url":{"url":"data:image/png;base64,', image_bytes, b'"}}')
             for _ in range(num_images)]
    pieces: list = [b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[']
    for index, (before, size, after) in enumerate(parts):
        pieces += [(b"," if index else b"") + before, ("fill", size), after]
    pieces.append(b"]}]}")
    length = sum(p[1] if isinstance(p, tuple) else len(p) for p in pieces)
    return length, pieces


def _stream(pieces: list) -> Iterator[bytes]:
    for piece in pieces:
        if isinstance(piece, tuple):
            yield from _filler(piece[1])
        else:
            yield piece


def test_a_200_mib_chat_body_is_413_from_its_content_length_before_it_is_read(small):
    limit = gateway_bytes(SMALL_IMAGES)
    length, pieces = _chat_pieces(8, 25 * MIB)
    assert length > 200 * MIB > limit
    before = small.rss()
    with small.connect() as sock:
        sock.sendall(_head("/v1/chat/completions", length))
        _send_until_answered(sock, _stream(pieces))
        status, _, body = _read_answer(sock)
    assert status == 413, body[:300]
    assert f"the request body has {length} bytes; the limit is {limit}".encode() in body
    assert small.rss() - before < 64 * MIB  # nothing past the head was kept, let alone parsed


def test_a_chunked_body_past_the_limit_is_413_while_it_streams(small):
    limit = gateway_bytes(SMALL_IMAGES)
    _, pieces = _chat_pieces(8, 25 * MIB)
    with small.connect() as sock:
        sock.sendall(_head("/v1/chat/completions", None))
        _send_until_answered(sock, _stream(pieces), chunked=True)
        status, _, body = _read_answer(sock)
    assert status == 413, body[:300]
    assert f"the request body passed {limit} bytes".encode() in body


def test_bodies_past_the_in_flight_budget_are_503_with_retry_after_before_they_are_read(small):
    held = small.connect()
    try:  # 100 MiB announced, 1 MiB sent: the budget holds 100 MiB for it while it stalls
        held.sendall(_head("/v1/chat/completions", 100 * MIB, expect=True))
        _send_until_answered(held, _filler(MIB))
        with small.connect() as sock:
            sock.sendall(_head("/v1/chat/completions", 100 * MIB))
            status, headers, body = _read_answer(sock)
        assert status == 503, body[:300]
        assert headers["retry-after"] == "1"
        assert f"would pass the budget of {SMALL_BUDGET}".encode() in body
    finally:
        held.close()

    def admitted() -> bool:  # the stalled body's bytes are given back once its client is gone
        with small.connect() as sock:
            sock.sendall(_head("/v1/chat/completions", 100 * MIB, expect=True))
            sock.settimeout(5)
            return sock.recv(64).startswith(b"HTTP/1.1 100")

    _until(admitted, 30, "a 100 MiB body admitted once the stalled one closed")


def _closed_within(sock: socket.socket, timeout_s: float, dribble: bytes = b"") -> float:
    """Seconds until the server closes `sock`, sending `dribble` a byte every 0.2 s meanwhile;
    fails after `timeout_s`."""
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < timeout_s:
        if select.select([sock], [], [], 0.2)[0]:
            try:
                if not sock.recv(65536):
                    return time.monotonic() - start
            except ConnectionResetError:
                return time.monotonic() - start
            continue
        if sent < len(dribble):
            try:
                sock.sendall(dribble[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
            sent += 1
    raise AssertionError(f"the connection was still open after {timeout_s} s ({sent} bytes dribbled)")


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(small):
    with small.connect() as sock:
        assert _closed_within(sock, TIMEOUT_S + SLACK_S) >= TIMEOUT_S - 0.1


def test_a_request_head_dribbled_a_byte_at_a_time_is_closed_after_the_header_timeout(small):
    head = b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 200 + b"\r\n\r\n"
    with small.connect() as sock:
        assert _closed_within(sock, TIMEOUT_S + SLACK_S, head) >= TIMEOUT_S - 0.1


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(small):
    with small.connect() as sock:
        for _ in range(2):  # a second request on the connection gets its own head deadline too
            sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _read_answer(sock)[0] == 200
        _closed_within(sock, TIMEOUT_S + SLACK_S)


def test_a_request_past_the_connection_cap_is_503_until_a_connection_closes(tmp_path):
    """--limit-concurrency (uvicorn's limit_concurrency): with the cap's worth of connections open,
    kept alive after their answers, a request on one more is 503 and its connection closed; once one
    of them closes, a new connection is served."""
    cap = 4
    gateway = _gateway(tmp_path, "capped", "--limit-concurrency", str(cap), "--timeout-keep-alive", "60",
                       "--http-header-timeout", "60")
    held: list[socket.socket] = []
    health = b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    try:
        def hold() -> bool:
            """One more connection served and kept; False (closed) while the server still counts a
            connection the launcher's readiness probes closed (on a loaded machine it may lag)."""
            sock = gateway.connect()
            sock.sendall(health)
            if _read_answer(sock)[0] == 200:
                held.append(sock)
                return True
            sock.close()
            return False

        for _ in range(cap - 1):  # the cap counts the connection asking too
            _until(hold, 30, "a connection under the cap served")
        with gateway.connect() as sock:
            sock.sendall(health)
            status, headers, body = _read_answer(sock)
            assert (status, headers.get("connection"), body) == (503, "close", b"Service Unavailable")
        held.pop().close()

        def served() -> bool:
            with gateway.connect() as sock:
                sock.sendall(health)
                return _read_answer(sock)[0] == 200

        _until(served, 30, "a request served once a held connection closed")
    finally:
        for sock in held:
            sock.close()
        gateway.process.kill()
        gateway.process.wait(10)


MUST_SHOW_BODIES = 8
RSS_BOUND = 2 * 1024 * MIB  # the gateway's growth with 8 x 200 MiB sent at once (measured ~800 MiB)
GRPC_BOUND_S = 1.0  # every probe answers within it (measured 0.16 s; a parse holding the GIL: 0.4-1.3 s)


def test_eight_concurrent_200_mib_chat_bodies_keep_memory_bounded_and_grpc_answering(tmp_path):
    gateway = _gateway(tmp_path, "default")  # default caps: chat limit gateway_bytes(8), budget twice it
    try:
        length, pieces = _chat_pieces(8, 25 * MIB)
        assert 200 * MIB < length <= gateway_bytes(8)
        before = gateway.rss()
        peak = [before]
        answers: list = []
        latencies: list[float] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], gateway.rss())
                time.sleep(0.02)

        def probe() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                health.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected before the bodies come
                while not done.is_set():
                    start = time.monotonic()
                    health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                    latencies.append(time.monotonic() - start)
                    time.sleep(0.05)

        def client() -> None:
            try:
                with gateway.connect() as sock:
                    sock.sendall(_head("/v1/chat/completions", length))
                    _send_until_answered(sock, _stream(pieces))
                    answers.append(_read_answer(sock))
            except OSError as error:
                answers.append(error)

        watchers = [threading.Thread(target=sample, daemon=True), threading.Thread(target=probe, daemon=True)]
        for thread in watchers:
            thread.start()
        clients = [threading.Thread(target=client, daemon=True) for _ in range(MUST_SHOW_BODIES)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(120)
        done.set()
        for thread in watchers:
            thread.join(15)
        statuses = sorted(a[0] if isinstance(a, tuple) else repr(a) for a in answers)
        assert len(answers) == MUST_SHOW_BODIES and all(isinstance(a, tuple) for a in answers), statuses
        refused = [a for a in answers if a[0] == 503 and b"budget" in a[2]]
        assert all(a[1].get("retry-after") == "1" for a in refused)
        assert 1 <= MUST_SHOW_BODIES - len(refused) <= 2, statuses  # the budget: two chat bodies at once
        print(f"rss growth {(peak[0] - before) / MIB:.0f} MiB, grpc max {max(latencies):.3f} s")
        assert peak[0] - before < RSS_BOUND, f"grew {(peak[0] - before) / MIB:.0f} MiB"
        latencies.sort()
        assert latencies and latencies[-1] < GRPC_BOUND_S, f"gRPC health p100 {latencies[-1]:.2f} s"
    finally:
        gateway.process.kill()
        gateway.process.wait(10)
