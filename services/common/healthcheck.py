"""`python -m services.common.healthcheck ADDRESS [SERVICE]`: one grpc.health.v1 Check, as an exit code.

The probe that docker-compose's `healthcheck` (and anything else without Kubernetes' native gRPC
probes) runs inside the image: exit 0 only when ADDRESS answers SERVING for SERVICE ("" = the
whole server, the default), else exit 1 with one line on stderr naming the address and what it
answered. ADDRESS is any gRPC target ("host:port", "dns:///host:port"). Imports grpc and the
health stubs only — never torch — so a probe every few seconds costs milliseconds of CPU.

A gateway serving TLS is probed with `--tls-ca-file` (the certificate, or the CA that signed it)
and `--tls-server-name` (a name the certificate holds, when ADDRESS's host is not one of them, as
127.0.0.1 inside its own container is not); Kubernetes' native gRPC probes speak plaintext only,
so a TLS gateway's pod probes with this command instead (docs/deployment.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TIMEOUT_S = 2.0


def _request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def not_serving(reply: health_pb2.HealthCheckResponse) -> str | None:
    """None for SERVING, else the status's name (NOT_SERVING, SERVICE_UNKNOWN, ...)."""
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def check(address: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S, tls_ca: bytes | None = None,
          tls_server_name: str | None = None) -> str | None:
    """Ask `address` for the health of `service` (over TLS when `tls_ca`, PEM roots, is given;
    `tls_server_name`: the name the certificate must hold instead of ADDRESS's host).

    Returns:
        None when it answers SERVING; otherwise one line saying what went wrong (the status it
        answered, or the RPC's error code and details: UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND
        for a service name the server does not know).
    """
    options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_ca and tls_server_name else []
    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_ca), options=options)
               if tls_ca else grpc.insecure_channel(address))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(_request(service), timeout=timeout_s)
        except grpc.RpcError as error:
            return f"{address} service {service!r}: {error.code().name}: {error.details()}"
    status = not_serving(reply)
    return None if status is None else f"{address} service {service!r}: {status}"


async def probe(channel: grpc.aio.Channel, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """`check` from a running event loop over an open channel (the gateway's HTTP /health keeps one
    per address): None when SERVING, else the status's name or the failed call's code's name."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(_request(service), timeout=timeout_s)
    except grpc.aio.AioRpcError as error:
        return error.code().name
    return not_serving(reply)


def wait_serving(address: str, timeout_s: float, exited: Callable[[], str | None] = lambda: None,
                 poll_s: float = 0.2) -> None:
    """Block until `address` answers SERVING (`check` every `poll_s` seconds, each with a 1 s deadline).

    Args:
        exited: None while the process behind `address` runs, else why it stopped (checked
            before every probe).

    Raises:
        RuntimeError: `exited()` said why the process stopped.
        TimeoutError: not SERVING within `timeout_s` seconds (the message holds the last verdict).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        stopped = exited()
        if stopped is not None:
            raise RuntimeError(stopped)
        verdict = check(address, timeout_s=1.0)
        if verdict is None:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f} s ({verdict})")
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="gRPC target, e.g. 127.0.0.1:50053")
    parser.add_argument("service", nargs="?", default="", help='service name (default "": the whole server)')
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="RPC deadline in seconds (default %(default)s)")
    parser.add_argument("--tls-ca-file", default=None, help="PEM roots to verify a TLS port with (its certificate, "
                                                             "or its CA): probe over TLS")
    parser.add_argument("--tls-server-name", default=None, help="with --tls-ca-file: the name the certificate must "
                                                                "hold (default: ADDRESS's host)")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if args.tls_server_name and not args.tls_ca_file:
        parser.error("--tls-server-name needs --tls-ca-file")
    try:
        tls_ca = Path(args.tls_ca_file).read_bytes() if args.tls_ca_file else None
    except OSError as error:
        parser.error(f"--tls-ca-file {args.tls_ca_file}: {error.strerror}")
    if tls_ca is not None and b"-----BEGIN CERTIFICATE-----" not in tls_ca:
        parser.error(f"--tls-ca-file {args.tls_ca_file} holds no PEM certificate")
    problem = check(args.address, args.service, args.timeout, tls_ca, args.tls_server_name)
    if problem is not None:
        print("unhealthy: " + " ".join(problem.split()), file=sys.stderr)  # one line, whatever grpc said
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
