"""Transport that production clients rely on, shown on the pooling service: a keepalive-pinging
client keeps an idle stream; a second server on a port in use fails to start, naming the port."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import grpc

from services.common.launch import REPO, free_port, service_env
from services.pooling.engine import PoolingEngine
from services.pooling.servicer import PoolingServicer
from tessera.v1 import pooling_pb2, pooling_pb2_grpc
from tests.common.serving import serving

# What load balancers, meshes and SDKs send: a ping every 10 s, on idle connections too, unlimited
# pings without data. Under grpc's server defaults (one ping per 5 min without data, 2 strikes) such a
# client is cut with GOAWAY "too_many_pings" after ~30 s, and its stream ends UNAVAILABLE.
KEEPALIVE_CLIENT = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_pings_without_data", 0)]
IDLE_S = 45


def test_a_keepalive_client_keeps_an_idle_embed_stream(minilm_config, minilm_loaded):
    service = PoolingEngine(minilm_config, models={minilm_loaded.name: minilm_loaded})

    def register(server):
        pooling_pb2_grpc.add_PoolingServicer_to_server(PoolingServicer(service), server)
        return [pooling_pb2.DESCRIPTOR.services_by_name["Pooling"].full_name]

    async def main():
        address = f"127.0.0.1:{free_port()}"
        async with serving("pooling", register, service.health, address=address):
            queries: asyncio.Queue = asyncio.Queue()

            async def requests():
                while (query := await queries.get()) is not None:
                    yield query

            async with grpc.aio.insecure_channel(address, options=KEEPALIVE_CLIENT) as channel:
                stream = pooling_pb2_grpc.PoolingStub(channel).EmbedStream(requests())
                await queries.put(pooling_pb2.EmbedRequest(inputs=["before the pause"]))
                assert list((await stream.read()).embeddings.shape) == [1, 384]
                await asyncio.sleep(IDLE_S)  # silent: only the client's keepalive pings cross the connection
                await queries.put(pooling_pb2.EmbedRequest(inputs=["after", "the pause"]))
                reply = await stream.read()
                assert reply is not grpc.aio.EOF, f"stream ended: {await stream.code()} {await stream.details()}"
                assert list(reply.embeddings.shape) == [2, 384]
                await queries.put(None)
                assert await stream.code() == grpc.StatusCode.OK

    asyncio.run(main())


def test_a_second_service_on_a_port_in_use_exits_naming_it(minilm_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "services.pooling", "--address", f"127.0.0.1:{port}",
                               "--model-dir", str(minilm_dir)], cwd=REPO, env=service_env({"OMP_NUM_THREADS": "1"}),
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}: port {port} is in use" in done.stderr
