"""A decoder replica without a model, for routing tests over real sockets:
`python -m tests.gateway.stub_decoder HOST:PORT`.

It runs on `services.common.server.serve` (the real server options, health and reflection) and
answers Generate with `sampling.max_tokens` tokens (id 7, text "x"), one every TOKEN_INTERVAL_S,
and GetInfo with an idle replica's report. Light enough to start several per test and to stop
with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import sys

from services.common.server import serve
from tessera.v1 import decoder_pb2, decoder_pb2_grpc

TOKEN_INTERVAL_S = 0.05
MODEL = "stub-decoder"


class StubDecoder(decoder_pb2_grpc.DecoderServicer):
    async def Generate(self, request, context):
        num_tokens = request.sampling.max_tokens or 1
        for index in range(num_tokens):
            await asyncio.sleep(TOKEN_INTERVAL_S)
            last = index == num_tokens - 1
            yield decoder_pb2.GenerateResponse(request_id=request.request_id, token_ids=[7], text="x",
                                               finish_reason="length" if last else "")

    async def GetInfo(self, request, context):
        return decoder_pb2.DecoderInfo(model=MODEL, max_model_len=2048, block_size=16, num_blocks=64,
                                       num_free_blocks=64)


def main(address: str) -> None:
    def register(server):
        decoder_pb2_grpc.add_DecoderServicer_to_server(StubDecoder(), server)
        return [decoder_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name]

    asyncio.run(serve("decoder", address, register, grace_s=0.0))


if __name__ == "__main__":
    main(sys.argv[1])
