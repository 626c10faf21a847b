"""The Decoder gRPC service: protobuf in -> engine -> protobuf out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from services.common.errors import Unavailable
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine
from services.decoder.convert import generate_from_pb, output_to_pb
from tessera.v1 import decoder_pb2, decoder_pb2_grpc


class DecoderServicer(decoder_pb2_grpc.DecoderServicer):
    """Holds the engine once `start()` has loaded it (health stays NOT_SERVING until then)."""

    def __init__(self, config: DecoderConfig) -> None:
        self.config = config
        self.engine: LLMEngine | None = None

    async def start(self) -> None:
        # the count read here, on the event loop's thread: the worker that builds the engine never touches
        # torch threading, so only the engine thread has an OpenMP team (services/common/compute.py)
        self.engine = await asyncio.to_thread(LLMEngine, self.config, torch.get_num_threads())
        self.engine.adapters.start_reporting()  # residency reports from service start, not first acquire

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.adapters.close()
            await asyncio.to_thread(self.engine.shutdown)

    def health(self) -> str | None:
        """None while the engine works (or is still loading: health is NOT_SERVING then anyway)."""
        return None if self.engine is None else self.engine.health()

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise Unavailable("the decoder is still loading its model")
        return self.engine

    async def Generate(self, request, context):
        # Leaving this generator (cancel, deadline, disconnect) closes the engine stream, which aborts it.
        async for output in self._engine().generate(
                generate_from_pb(request, self.config.limits, self.config.max_model_len)):
            yield output_to_pb(output)

    async def GetInfo(self, request, context):
        engine = self._engine()
        spec, stats = engine.model.spec, engine.stats()
        return decoder_pb2.DecoderInfo(
            model=Path(self.config.model_dir).name, architecture=spec.architecture,
            max_model_len=self.config.max_model_len, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            block_size=self.config.block_size, num_blocks=stats.num_blocks, num_free_blocks=stats.num_free_blocks,
            mrope_section=list(self.config.mrope_section or ()), image_token_id=engine.image_token_id or 0,
            num_running=stats.num_running, num_waiting=stats.num_waiting, dtype=self.config.dtype,
            num_cached_blocks=stats.num_cached_blocks, prefix_cache_hits=stats.prefix_cache_hits,
            prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens,
            resident_adapters=engine.adapters.resident_names())
