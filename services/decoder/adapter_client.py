"""Resolves adapter names through the registry and keeps their weights resident in the bank.

`acquire(name)` asks the registry for the name's digest (no weights); if the bank does not hold
that digest it asks again with weights and loads them into an idle slot, then leases the slot.
Leases are released by the engine when the request finishes or is aborted.
"""

from __future__ import annotations

import asyncio

import grpc

from services.common.errors import NotFound, ResourceExhausted, Unavailable
from services.common.server import insecure_channel
from services.common.tensor import from_pb
from services.decoder.lora import AdapterBank, LoRAWeights
from tessera.v1 import adapters_pb2, adapters_pb2_grpc


class AdapterClient:
    def __init__(self, address: str | None, bank: AdapterBank, timeout_s: float = 30.0) -> None:
        self.address = address
        self.bank = bank
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub = None

    async def acquire(self, name: str) -> int:
        """Lease a bank slot holding adapter `name`; returns the slot.

        Raises:
            NotFound: no registry configured, or the registry does not know `name`.
            Unavailable: the registry cannot be reached.
            ResourceExhausted: every slot is leased by running requests.
        """
        if self.address is None:
            raise NotFound(f"unknown adapter {name!r}: this decoder has no adapter registry configured")
        info = await self._get(name, include_weights=False)
        slot = self.bank.acquire(info.info.digest)
        if slot is not None:
            return slot
        weights = await self._get(name, include_weights=True)
        modules = {t.module: (from_pb(t.lora_a), from_pb(t.lora_b)) for t in weights.tensors}
        loaded = LoRAWeights(weights.info.digest, modules)
        slot = await asyncio.to_thread(self.bank.load, loaded)
        if slot is None:
            raise ResourceExhausted(f"all {self.bank.num_slots} adapter slots are leased by running requests")
        slot = self.bank.acquire(loaded.digest)
        if slot is None:  # evicted between load and lease by a concurrent load
            raise ResourceExhausted(f"all {self.bank.num_slots} adapter slots are busy; retry")
        return slot

    async def _get(self, name: str, include_weights: bool) -> adapters_pb2.AdapterWeights:
        if self._stub is None:
            self._channel = insecure_channel(self.address)
            self._stub = adapters_pb2_grpc.AdaptersStub(self._channel)
        request = adapters_pb2.GetAdapterRequest(name=name, include_weights=include_weights)
        try:
            return await self._stub.GetAdapter(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"unknown adapter {name!r}") from None
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"adapter registry at {self.address} is unavailable: {error.details()}") from None
            raise

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
