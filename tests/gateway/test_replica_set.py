"""The gateway's replica set over real sockets: DNS targets, and readiness that follows health."""

import asyncio

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.server import create_server
from services.gateway.replicas import ReplicaSet
from tessera.v1 import decoder_pb2_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def _health_server():
    server = create_server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, port


async def _until(predicate, timeout_s: float = 5.0) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        assert loop.time() - start < timeout_s
        await asyncio.sleep(0.01)
    return loop.time() - start


def test_a_replica_is_ready_only_while_it_says_serving():
    async def main():
        server, servicer, port = await _health_server()
        await servicer.set("", NOT_SERVING)
        left = []
        replicas = ReplicaSet("decoder", f"ipv4:127.0.0.1:{port},127.0.0.1:1", decoder_pb2_grpc.DecoderStub,
                              on_leave=left.append)
        try:
            assert await replicas.wait_ready(0.5) == []  # loading: connected, but NOT_SERVING
            await servicer.set("", SERVING)
            [ready] = await replicas.wait_ready(5)
            assert ready.address == f"127.0.0.1:{port}"
            await servicer.set("", NOT_SERVING)  # health Watch tells the channel at once
            assert await _until(lambda: not replicas.ready()) < 1.0
            assert left == [f"127.0.0.1:{port}"]
            await servicer.set("", SERVING)
            await replicas.wait_ready(5)
            await server.stop(None)  # gone: not ready as soon as the connection drops
            assert await _until(lambda: not replicas.ready()) < 1.0
        finally:
            await replicas.close()
            await server.stop(None)

    asyncio.run(main())


def test_dns_target_names_every_resolved_address():
    async def main():
        server, servicer, port = await _health_server()
        await servicer.set("", SERVING)
        replicas = ReplicaSet("pooling", f"dns:///localhost:{port}", decoder_pb2_grpc.DecoderStub)
        try:
            assert set(replicas.replicas) <= {f"127.0.0.1:{port}", f"[::1]:{port}"}
            ready = await replicas.wait_ready(5)
            assert f"127.0.0.1:{port}" in [r.address for r in ready]
        finally:
            await replicas.close()
            await server.stop(None)

    asyncio.run(main())


def test_dns_replicas_join_and_leave_as_the_name_resolves():
    answers = [["10.0.0.1:7"], ["10.0.0.1:7", "10.0.0.2:7"], [], ["10.0.0.2:7"]]
    seen = []

    def resolver(target):
        seen.append(target.host)
        return answers[min(len(seen) - 1, len(answers) - 1)]

    async def main():
        left = []
        replicas = ReplicaSet("decoder", "dns:///decoder:7", decoder_pb2_grpc.DecoderStub, on_leave=left.append,
                              resolve_interval_s=0.02, resolver=resolver)
        assert list(replicas.replicas) == ["10.0.0.1:7"]
        replicas.start()
        try:
            await _until(lambda: len(seen) >= 5)  # the fourth answer has been applied
            # a failed lookup ([]) kept both; the last answer dropped the first replica
            assert list(replicas.replicas) == ["10.0.0.2:7"] and left == ["10.0.0.1:7"]
        finally:
            await replicas.close()

    asyncio.run(main())
