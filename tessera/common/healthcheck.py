"""`python -m tessera.common.healthcheck ADDRESS [SERVICE]`: one grpc.health.v1 Check, as an exit code.

The probe that docker-compose's `healthcheck` (and anything else without Kubernetes' native gRPC
probes) runs inside the image: exit 0 only when ADDRESS answers SERVING for SERVICE ("" = the
whole server, the default), else exit 1 with one line on stderr naming the address and what it
answered. ADDRESS is any gRPC target ("host:port", "dns:///host:port"). Imports grpc and the
health stubs only — never torch — so a probe every few seconds costs milliseconds of CPU.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TIMEOUT_S = 2.0


def check(address: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """Ask `address` for the health of `service`.

    Returns:
        None when it answers SERVING; otherwise one line saying what went wrong (the status it
        answered, or the RPC's error code and details: UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND
        for a service name the server does not know).
    """
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as error:
            return f"{address} service {service!r}: {error.code().name}: {error.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address} service {service!r}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.common.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="gRPC target, e.g. 127.0.0.1:50053")
    parser.add_argument("service", nargs="?", default="", help='service name (default "": the whole server)')
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="RPC deadline in seconds (default %(default)s)")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    problem = check(args.address, args.service, args.timeout)
    if problem is not None:
        print("unhealthy: " + " ".join(problem.split()), file=sys.stderr)  # one line, whatever grpc said
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
