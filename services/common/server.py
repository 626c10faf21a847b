"""Server lifecycle shared by every service: options, interceptors, health, reflection, SIGTERM.

Every service calls `serve(...)` with its servicers; health starts NOT_SERVING, flips to SERVING
once the service's `start` returned (its model loaded and one warm-up step run through every
configured backend, so a configuration that cannot compute never reports SERVING), follows the service's own check afterwards (NOT_SERVING while
its engine loop has died or is wedged, services/common/liveness.py), and goes NOT_SERVING on
SIGTERM before the drain (`server.stop(grace)`), as in grpc's python examples and TGI's server.
A start that fails closes the port and raises; `exit_refused` turns a configuration error into
the one line on stderr that `python -m tessera.<service>` exits with.

With `$TESSERA_EXIT_UNHEALTHY_AFTER_S` set, a service whose own check has said NOT_SERVING for
that many seconds in a row stops listening and exits with EXIT_UNHEALTHY, so that a supervisor
that restarts processes only when they exit (compose's `restart` policy, systemd) restarts it, as
a Kubernetes liveness probe would: a dead loop never comes back, and a wedged thread cannot be
joined, so the process ends without running the service's `stop`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import auth, logs, metrics
from services.common.errors import InvalidArgument, rich_status_of, set_status
from tessera.protocol import CHANNEL_OPTIONS, EXIT_UNHEALTHY_ENV, MAX_MESSAGE_BYTES
from tessera.rich_status import ErrorInfo

log = logging.getLogger(__name__)

# Clients re-resolve a DNS target (a headless Service, a compose service name) only when a
# connection ends: closing each connection after MAX_CONNECTION_AGE_MS lets them find new
# replicas. Streams open at that moment get the grace period to finish.
MAX_CONNECTION_AGE_MS = 120_000
MAX_CONNECTION_AGE_GRACE_MS = 3_600_000
# Load balancers, meshes and SDKs send keepalive pings, also on idle connections and during a
# long prefill; pings at intervals of MIN_PING_INTERVAL_MS or more are accepted without data
# (grpc's default of 5 min answers a 10 s pinger with GOAWAY "too_many_pings").
MIN_PING_INTERVAL_MS = 5_000
# Every channel one service opens to another (`insecure_channel`) adds KEEPALIVE_OPTIONS: a ping every
# KEEPALIVE_TIME_MS (as often as the servers accept) finds out a peer whose connection stays open while
# its process answers nothing (SIGSTOP, a wedged host) within KEEPALIVE_TIME_MS + PING_TIMEOUT_MS: the connection is
# closed, its calls end UNAVAILABLE and the channel leaves READY until the peer answers again, as
# when the peer is killed. The peer's transport acks a ping without its service's event loop, so a
# busy peer answers in time.
KEEPALIVE_TIME_MS = MIN_PING_INTERVAL_MS
PING_TIMEOUT_MS = 3_000
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    # grpc core closes the connection when any ping (keepalive or flow control's BDP probe) is not
    # acked within ping_timeout_ms (default 60 s); keepalive_timeout_ms alone does not shorten it.
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
    # Also while no call is open, and while the only call sends no data (the health Watch of a
    # replica's channel): by default grpc stops pinging after 2 pings without data.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A port another process holds is an error, not a second listener sharing its traffic.
    ("grpc.so_reuseport", 0),
    ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
    ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
]

HEALTH_POLL_S = 0.5  # how often `serve` asks the service's health check

# The one port table: each service's default port (`tessera up` offsets them from its --base-port).
DEFAULT_PORTS = {"gateway": 50051, "vision": 50052, "decoder": 50053, "pooling": 50054, "adapters": 50055}


def default_address(service: str) -> str:
    """The loopback host:port `service` binds by default."""
    return f"127.0.0.1:{DEFAULT_PORTS[service]}"


def exit_refused(name: str, error: BaseException) -> NoReturn:
    """Exit with status 1 after one line on stderr, "NAME: cause", for a service that cannot start as
    configured (a ValueError from its config or its start, an OSError binding its port)."""
    cause = " ".join(str(error).split()) or type(error).__name__
    logs.stop_line(name, cause if cause.startswith(f"{name}: ") else f"{name}: {cause}")
    raise SystemExit(1)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The backstop: domain errors become their status; anything unexpected is logged and INTERNAL.

    Wraps all four handler kinds, so servicers never catch errors just to translate them. A
    request that is not valid protobuf (e.g. a string field with bad UTF-8) is INVALID_ARGUMENT
    rather than grpc's default UNKNOWN. A streaming handler is either an async generator or a
    coroutine that writes its responses with `context.write` (grpc's health Watch is one); each
    is wrapped in its own shape. Synchronous handlers pass through untouched.
    """

    # kind -> (handler factory, request is a stream, response is a stream)
    _KINDS = {
        "unary_unary": (grpc.unary_unary_rpc_method_handler, False, False),
        "unary_stream": (grpc.unary_stream_rpc_method_handler, False, True),
        "stream_unary": (grpc.stream_unary_rpc_method_handler, True, False),
        "stream_stream": (grpc.stream_stream_rpc_method_handler, True, True),
    }

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        for kind, (factory, streams_in, streams_out) in self._KINDS.items():
            inner = getattr(handler, kind)
            if inner is None:
                continue
            if streams_out and inspect.isasyncgenfunction(inner):
                wrap = _wrap_streaming
            elif inspect.iscoroutinefunction(inner):
                wrap = _wrap_single
            else:
                return handler
            return factory(wrap(inner, details.method, streams_in),
                           _tolerant(handler.request_deserializer), handler.response_serializer)
        return handler


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the handler can answer the status."""

    def __init__(self, error: Exception):
        self.error = error

    def check(self):
        raise InvalidArgument(f"request is not a valid protobuf message: {self.error}")


def _tolerant(deserialize):
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as error:
            return _Undecodable(error)

    return parse


def _checked(request, streams_in: bool):
    if not streams_in:
        if isinstance(request, _Undecodable):
            request.check()
        return request

    async def items():
        async for item in request:
            if isinstance(item, _Undecodable):
                item.check()
            yield item

    return items()


def _wrap_single(inner, method: str, streams_in: bool):
    async def behavior(request, context):
        try:
            return await inner(_checked(request, streams_in), context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as error:  # noqa: BLE001 - this is the backstop
            status = _status_logged(method, error)
        del request  # see _end_with_status
        _end_with_status(context, *status)

    return behavior


def _wrap_streaming(inner, method: str, streams_in: bool):
    async def behavior(request, context):
        try:
            async for response in inner(_checked(request, streams_in), context):
                yield response
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as error:  # noqa: BLE001
            status = _status_logged(method, error)
        else:
            return
        del request  # see _end_with_status
        _end_with_status(context, *status)

    return behavior


def _status_logged(method: str, error: Exception) -> tuple[grpc.StatusCode, str, ErrorInfo]:
    code, message, info = rich_status_of(error)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=error)
    else:
        log.info("%s -> %s: %s", method, code.name, message)
    _drop_tracebacks(error)
    return code, message, info


def _drop_tracebacks(error: BaseException) -> None:
    """Unlink the tracebacks of `error` and of every exception it chains.

    A frame that catches an exception and raises another (`except X as e: raise Y from e`) keeps
    `e` as a local while `e`'s traceback keeps the frame: a reference cycle holding the frame's
    request until a full gc. Once the status is logged nothing needs those frames.
    """
    pending, seen = [error], set()
    while pending:
        chained = pending.pop()
        if chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            chained.__traceback__ = None
            pending += [chained.__cause__, chained.__context__]


def _end_with_status(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, info: ErrorInfo) -> None:
    """End the call with `code` and its ErrorInfo `info`, keeping nothing of the request alive.

    Called after the `except` block, never inside it: the exception's traceback holds every
    servicer frame and the request, and `context.abort` would chain it to an AbortError that grpc
    keeps on the call's state in a reference cycle (a refused 50 MB request stayed in memory until
    a full gc). Setting the status instead of aborting raises nothing at all; grpc discards the
    handler's return value when the code is not OK. The caller drops its `request` first.
    """
    set_status(context, code, message, info)


def create_server(interceptors: Iterable[grpc.aio.ServerInterceptor] = (), *, public: bool = False,
                  max_receive_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Server:
    """A server that logs every call with its request id (logs.py), whose internal port checks the
    cluster's token (auth.py; `public`: the gateway's port, which does not), and that refuses
    requests over `max_receive_bytes` with RESOURCE_EXHAUSTED before reading them."""
    options = [(key, value) for key, value in SERVER_OPTIONS if key != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return grpc.aio.server(interceptors=[logs.RequestLogInterceptor(), *auth.server_interceptors(public), ErrorInterceptor(),
                                         *interceptors],
                           options=options)


def insecure_channel(address: str, extra_options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A client channel to another service: the servers' message limits, keepalive pings (a peer that
    stops answering with its connection open fails its calls UNAVAILABLE within ~8 s instead of
    holding them to their deadlines), `extra_options` (e.g. a service config), the request id being
    handled (logs.py) and the cluster's internal token on every call when this process has one."""
    return grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, *KEEPALIVE_OPTIONS, *extra_options],
                                     interceptors=[*logs.client_interceptors(), *auth.client_interceptors(),
                                                   *metrics.downstream_interceptors(address)])


def bind(server: grpc.aio.Server, name: str, address: str, credentials: grpc.ServerCredentials | None = None) -> None:
    """Listen on `address` (TLS with `credentials`), or raise OSError naming the port when it cannot be had.

    Raises:
        OSError: the port is in use (another process holds it; SO_REUSEPORT is off) or the
            address cannot be bound.
    """
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as error:  # grpc raises on a failed bind; older releases returned 0
        bound, cause = 0, error
    else:
        cause = None
    if bound == 0:
        _, _, port = address.rpartition(":")
        raise OSError(f"{name}: cannot listen on {address}: port {port} is in use or the address is not "
                      f"available on this host") from cause


EXIT_UNHEALTHY = 3  # the exit status of a service that gave up after NOT_SERVING for that long


def exit_unhealthy_after_s() -> float | None:
    """$TESSERA_EXIT_UNHEALTHY_AFTER_S in seconds (None: unset or empty, never exit).

    Raises:
        ValueError: a value that is not a positive number (the message names the variable).
    """
    raw = os.environ.get(EXIT_UNHEALTHY_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"${EXIT_UNHEALTHY_ENV} must be a positive number of seconds, got {raw!r}")
    return value


async def serve(
    name: str,
    address: str,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    start: Callable[[], Awaitable[None]] | None = None,
    stop: Callable[[], Awaitable[None]] | None = None,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    grace_s: float = 5.0,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    public: bool = False,
    credentials: grpc.ServerCredentials | None = None,
    health: Callable[[], str | None] | None = None,
    exit_process: Callable[[int], object] = os._exit,
    health_servicer: grpc_health.aio.HealthServicer | None = None,
) -> None:
    """Run one service until SIGTERM/SIGINT.

    Args:
        name: service name for logs.
        address: "host:port" to bind.
        register: adds servicers to the server; returns their full service names
            (for health and reflection).
        start: awaited after the port is bound and before health says SERVING (model load and a
            warm-up step, on the service's compute thread); afterwards every other thread computes
            single-threaded (services/common/compute.py). What it raises is raised here, once the
            port is closed again, and health never said SERVING.
        stop: awaited after the drain (release engines, close channels).
        max_receive_bytes: the largest request the service can accept (from its config).
        public: the gateway's port: no internal-token check (auth.py).
        credentials: serve TLS with these instead of plaintext.
        health: the service's runtime check, polled every HEALTH_POLL_S seconds on the event loop
            once SERVING: None = healthy, else the reason, which turns every status NOT_SERVING
            (logged once) until the check passes again; with $TESSERA_EXIT_UNHEALTHY_AFTER_S, after
            that many seconds of NOT_SERVING in a row the port closes and `exit_process(EXIT_UNHEALTHY)`
            ends the process (the module's docstring).
        exit_process: how the process ends then (tests pass a recorder).
        health_servicer: the grpc.health.v1 servicer the statuses are set on (default: a new
            one); a caller that reads its own status in process passes its own (the gateway's HTTP
            /health).

    Raises:
        ValueError: $TESSERA_EXIT_UNHEALTHY_AFTER_S is not a positive number (before anything listens).
    """
    give_up_after_s = exit_unhealthy_after_s()
    server = create_server(interceptors, public=public, max_receive_bytes=max_receive_bytes)
    service_names = list(register(server))
    if health_servicer is None:
        health_servicer = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    bind(server, name, address, credentials)
    await server.start()
    not_serving, serving = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    for service in ["", *service_names]:
        await health_servicer.set(service, not_serving)
    if start is not None:
        try:
            await start()
        except BaseException:
            await server.stop(None)
            raise
    if "torch" in sys.modules:  # a model loaded in `start` keeps its compute thread's intra-op threads
        from services.common.compute import confine_other_threads

        confine_other_threads()
    for service in ["", *service_names]:
        await health_servicer.set(service, serving)
    log.info("%s serving on %s", name, address)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    gave_up = asyncio.Event()

    def give_up(reason: str) -> None:
        log.error("%s: NOT_SERVING for %g s (%s): exiting with status %d to be restarted ($%s)", name,
                  give_up_after_s, reason, EXIT_UNHEALTHY, EXIT_UNHEALTHY_ENV)
        gave_up.set()
        stopping.set()

    follower = None if health is None else asyncio.create_task(
        _follow_health(name, health, health_servicer, ["", *service_names], give_up_after_s, give_up))
    await stopping.wait()
    if follower is not None:
        follower.cancel()
    log.info("%s: draining", name)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    if gave_up.is_set():
        logging.shutdown()  # flush the log handlers: exit_process skips interpreter shutdown
        exit_process(EXIT_UNHEALTHY)
        return
    if stop is not None:
        await stop()
    log.info("%s stopped", name)


async def _follow_health(name: str, check: Callable[[], str | None], health_servicer: grpc_health.aio.HealthServicer,
                         services: list[str], give_up_after_s: float | None = None,
                         give_up: Callable[[str], None] = lambda reason: None) -> None:
    """Set every status from `check()` each HEALTH_POLL_S; log each change of verdict once; call
    `give_up(reason)` once the verdict has been unhealthy for `give_up_after_s` in a row."""
    reported: str | None = None
    unhealthy_since: float | None = None  # loop time of the first unhealthy verdict in a row
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(HEALTH_POLL_S)
        try:
            reason = check()
        except Exception as error:  # noqa: BLE001 - a check that fails is itself a verdict
            reason = f"the health check failed: {type(error).__name__}: {error}"
        if reason is None:
            unhealthy_since = None
        elif unhealthy_since is None:
            unhealthy_since = loop.time()
        elif give_up_after_s is not None and loop.time() - unhealthy_since >= give_up_after_s:
            give_up(reason)
            return
        if reason == reported:
            continue
        if reason is None:
            log.warning("%s: healthy again; SERVING", name)
        else:
            log.error("%s: NOT_SERVING: %s", name, reason)
        status = health_pb2.HealthCheckResponse.NOT_SERVING if reason else health_pb2.HealthCheckResponse.SERVING
        for service in services:
            await health_servicer.set(service, status)
        reported = reason
