"""Server lifecycle shared by every service: options, interceptors, health, reflection, SIGTERM.

Every service calls `serve(name, Listen(...), register, lifecycle)` with its servicers and its
engine's `Lifecycle` (start, stop, health); health starts NOT_SERVING, flips to SERVING once
`start` returned (its model loaded and one warm-up step run through every configured backend, so a
configuration that cannot compute never reports SERVING), follows `health()` afterwards
(NOT_SERVING while its engine loop has died or is wedged, services/common/liveness.py), and goes
NOT_SERVING on SIGTERM before the drain (`server.stop(grace)`), as in grpc's python examples and
TGI's server; open health Watch streams end there (services/common/health.py). A start that fails closes the port and raises; `exit_refused` turns it into the one
line on stderr that `python -m services.<name>` exits 1 with (services/common/run.py).

With `$TESSERA_EXIT_UNHEALTHY_AFTER_S` set, a service whose own check has said NOT_SERVING for
that many seconds in a row stops listening and exits with EXIT_UNHEALTHY, so that a supervisor
that restarts processes only when they exit (compose's `restart` policy, systemd) restarts it, as
a Kubernetes liveness probe would: a dead loop never comes back, and a wedged thread cannot be
joined, so the process ends without running the service's `stop`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import auth, logs, metrics
from services.common.error_interceptor import ErrorInterceptor
from services.common.health import HealthServicer
from tessera.protocol import CHANNEL_OPTIONS, EXIT_UNHEALTHY_ENV, MAX_MESSAGE_BYTES

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


class Lifecycle(Protocol):
    """What `serve` asks of a service's engine (decoder, pooling and vision engines, the registry,
    the gateway's core): `start` (load, warm up), `stop` (release), `health` (None = healthy)."""

    async def start(self) -> None:
        """Awaited after the port is bound and before health says SERVING (model load and a warm-up
        step, on the service's compute thread); afterwards every other thread computes
        single-threaded (services/common/compute.py). What it raises is raised by `serve`, once
        the port is closed again, and health never said SERVING."""

    async def stop(self) -> None:
        """Awaited after the drain (release engines, close channels)."""

    def health(self) -> str | None:
        """The runtime check, polled every HEALTH_POLL_S seconds on the event loop once SERVING:
        None = healthy, else the reason, which turns every status NOT_SERVING (logged once) until
        the check passes again."""


class Hooks:
    """A Lifecycle from plain functions (each optional: nothing to start or stop, always healthy)."""

    def __init__(self, start: Callable[[], Awaitable[None]] | None = None,
                 stop: Callable[[], Awaitable[None]] | None = None,
                 health: Callable[[], str | None] | None = None) -> None:
        self._start, self._stop, self._health = start, stop, health

    async def start(self) -> None:
        if self._start is not None:
            await self._start()

    async def stop(self) -> None:
        if self._stop is not None:
            await self._stop()

    def health(self) -> str | None:
        return None if self._health is None else self._health()


@dataclass(frozen=True)
class Listen:
    """Where and how a service's server listens.

    Attributes:
        address: "host:port" to bind.
        max_receive_bytes: the largest request the service can accept (from its config).
        interceptors: the service's own, after the shared ones (create_server).
        public: the gateway's port: no internal-token check (auth.py).
        credentials: serve TLS with these instead of plaintext.
    """

    address: str
    max_receive_bytes: int = MAX_MESSAGE_BYTES
    interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
    public: bool = False
    credentials: grpc.ServerCredentials | None = None


async def serve(name: str, listen: Listen | str, register: Callable[[grpc.aio.Server], Iterable[str]],
                lifecycle: Lifecycle | None = None, *, health_servicer: HealthServicer | None = None,
                grace_s: float = 5.0, exit_process: Callable[[int], object] = os._exit) -> None:
    """Run one service until SIGTERM/SIGINT (the module's docstring).

    Args:
        name: service name for logs.
        listen: the port (a bare "host:port" takes the defaults of `Listen`).
        register: adds servicers to the server; returns their full service names (for health and
            reflection).
        lifecycle: the service's start, stop and health (default: none, always healthy); with
            $TESSERA_EXIT_UNHEALTHY_AFTER_S, after that many seconds of NOT_SERVING in a row the
            port closes and `exit_process(EXIT_UNHEALTHY)` ends the process, without `stop`.
        health_servicer: the grpc.health.v1 servicer the statuses are set on (default: a new
            one); a caller that reads its own status in process passes its own (the gateway's HTTP
            /health).
        exit_process: how the process ends then (tests pass a recorder).

    Raises:
        ValueError: $TESSERA_EXIT_UNHEALTHY_AFTER_S is not a positive number (before anything listens).
        OSError: the port cannot be bound.
    """
    give_up_after_s = exit_unhealthy_after_s()
    listen = Listen(listen) if isinstance(listen, str) else listen
    lifecycle = lifecycle or Hooks()
    health_servicer = health_servicer or HealthServicer()
    server, services = _build(name, listen, register, health_servicer)
    await server.start()
    await _start(name, listen.address, server, lifecycle, health_servicer, services)

    stopping, gave_up = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    def give_up(reason: str) -> None:
        log.error("%s: NOT_SERVING for %g s (%s): exiting with status %d to be restarted ($%s)", name,
                  give_up_after_s, reason, EXIT_UNHEALTHY, EXIT_UNHEALTHY_ENV)
        gave_up.set()
        stopping.set()

    follower = asyncio.create_task(_follow_health(name, lifecycle.health, health_servicer, services,
                                                  give_up_after_s, give_up))
    await stopping.wait()
    follower.cancel()
    log.info("%s: draining", name)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    await _rpc_tasks_finished()
    if gave_up.is_set():
        logging.shutdown()  # flush the log handlers: exit_process skips interpreter shutdown
        exit_process(EXIT_UNHEALTHY)
        return
    await lifecycle.stop()
    log.info("%s stopped", name)


async def _rpc_tasks_finished(timeout_s: float = 1.0) -> None:
    """Wait (at most `timeout_s`) for the RPC handler tasks grpc.aio still has after `server.stop`:
    a stream the stop ended (a health Watch answered NOT_SERVING) is sometimes still unwinding when
    stop returns, and a task left at the loop's close is cancelled there and logged by grpc as
    "Exception not handled ... CancelledError" (tests/common/test_health.py). grpc names those tasks
    "rpc_task" and "HandleExceptions[<method>]"; nothing else is waited for."""
    pending = [task for task in asyncio.all_tasks() if not task.done()
               and (task.get_name() == "rpc_task" or task.get_name().startswith("HandleExceptions["))]
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)


def _build(name: str, listen: Listen, register: Callable[[grpc.aio.Server], Iterable[str]],
           health_servicer: HealthServicer) -> tuple[grpc.aio.Server, list[str]]:
    """The bound server with the service's servicers, health and reflection; the names health is
    set for ("" = the whole server, then each service's)."""
    server = create_server(listen.interceptors, public=listen.public, max_receive_bytes=listen.max_receive_bytes)
    service_names = list(register(server))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    bind(server, name, listen.address, listen.credentials)
    return server, ["", *service_names]


async def _start(name: str, address: str, server: grpc.aio.Server, lifecycle: Lifecycle,
                 health_servicer: HealthServicer, services: list[str]) -> None:
    """NOT_SERVING while `lifecycle.start()` runs, SERVING once it returned; a start that raises
    closes the port and raises."""
    for service in services:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        await lifecycle.start()
    except BaseException:
        await server.stop(None)
        raise
    if "torch" in sys.modules:  # a model loaded in `start` keeps its compute thread's intra-op threads
        from services.common.compute import confine_other_threads

        confine_other_threads()
    for service in services:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving on %s", name, address)


async def _follow_health(name: str, check: Callable[[], str | None], health_servicer: HealthServicer,
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
        except Exception as error:  # a check that fails is itself a verdict
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
