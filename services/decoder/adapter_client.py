"""Resolves adapter names through the registry, keeps their weights resident, reports leases.

`acquire(name)` asks the registry for the name's digest (no weights); if the bank does not hold
that digest it asks again with weights and loads them into an idle slot, then leases the slot.
Leases are released by the engine when the request finishes or is aborted.

A background task reports `{digest: leases}` to the registry every `report_interval_s` (the
lease protocol of ARCHITECTURE.md). The answer lists digests being drained; admissions for them
are refused from then on, and the next report acknowledges them, which lets the registry finish
an unload once every decoder reports zero leases. While the registry is unreachable, names
resolved before keep working if their weights are still resident.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

import grpc

from services.common.errors import FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from services.common.server import insecure_channel
from services.common.tensor import from_pb
from services.decoder.lora import AdapterBank, LoRAWeights
from tessera.v1 import adapters_pb2, adapters_pb2_grpc

log = logging.getLogger(__name__)


class AdapterClient:
    def __init__(self, address: str | None, bank: AdapterBank, timeout_s: float = 30.0,
                 decoder_id: str | None = None, report_interval_s: float = 1.0) -> None:
        self.address = address
        self.bank = bank
        self.timeout_s = timeout_s
        self.decoder_id = decoder_id or f"decoder-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.report_interval_s = report_interval_s
        self.draining: set[str] = set()          # digests whose admissions are refused
        self._name_to_digest: dict[str, str] = {}  # last resolution, used while the registry is down
        self._channel: grpc.aio.Channel | None = None
        self._stub = None
        self._reporter: asyncio.Task | None = None

    async def acquire(self, name: str) -> int:
        """Lease a bank slot holding adapter `name`; returns the slot.

        Raises:
            NotFound: no registry configured, or the registry does not know `name`.
            FailedPrecondition: the adapter is draining (being unloaded or replaced).
            Unavailable: the registry cannot be reached and `name` is not resident here.
            ResourceExhausted: every slot is leased by running requests.
        """
        if self.address is None:
            raise NotFound(f"unknown adapter {name!r}: this decoder has no adapter registry configured")
        self.start_reporting()
        try:
            info = await self._get(name, include_weights=False)
        except Unavailable:
            slot = self._lease(name, self._name_to_digest.get(name))
            if slot is None:
                raise
            return slot
        self._name_to_digest[name] = info.info.digest
        slot = self._lease(name, info.info.digest)
        if slot is not None:
            return slot
        weights = await self._get(name, include_weights=True)
        modules = {t.module: (from_pb(t.lora_a), from_pb(t.lora_b)) for t in weights.tensors}
        loaded = LoRAWeights(weights.info.digest, modules)
        slot = await asyncio.to_thread(self.bank.load, loaded)
        if slot is None:
            raise ResourceExhausted(f"all {self.bank.num_slots} adapter slots are leased by running requests")
        slot = self._lease(name, loaded.digest)
        if slot is None:  # evicted between load and lease by a concurrent load
            raise ResourceExhausted(f"all {self.bank.num_slots} adapter slots are busy; retry")
        return slot

    def _lease(self, name: str, digest: str | None) -> int | None:
        # no await between the drain check and the lease: a report sent after this sees the lease
        if digest is None:
            return None
        if digest in self.draining:
            raise FailedPrecondition(f"adapter {name!r} is being unloaded or replaced (draining); "
                                     "new requests for it are refused")
        return self.bank.acquire(digest)

    def start_reporting(self) -> None:
        """Start the periodic residency report on the running loop (idempotent)."""
        if self.address is not None and (self._reporter is None or self._reporter.done()):
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def report_once(self) -> None:
        """Send {digest: leases} and the acknowledged drains; adopt the registry's draining set."""
        acked = sorted(self.draining)  # taken before the residency snapshot
        resident = [adapters_pb2.ResidentDigest(digest=d, leases=n) for d, n in self.bank.residency().items()]
        ack = await self._call("ReportResidency", adapters_pb2.ResidencyReport(
            decoder_id=self.decoder_id, resident=resident, draining_acked=acked))
        self.draining = set(ack.draining)

    async def _report_loop(self) -> None:
        while True:
            try:
                await self.report_once()
            except (Unavailable, grpc.aio.AioRpcError) as error:
                log.debug("residency report to %s failed: %s", self.address, error)
            await asyncio.sleep(self.report_interval_s)

    async def _get(self, name: str, include_weights: bool) -> adapters_pb2.AdapterWeights:
        request = adapters_pb2.GetAdapterRequest(name=name, include_weights=include_weights)
        try:
            return await self._call("GetAdapter", request)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"unknown adapter {name!r}") from None
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(error.details()) from None
            raise

    async def _call(self, method: str, request):
        if self._stub is None:
            self._channel = insecure_channel(self.address)
            self._stub = adapters_pb2_grpc.AdaptersStub(self._channel)
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"adapter registry at {self.address} is unavailable: {error.details()}") from None
            raise

    async def close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
        if self._channel is not None:
            await self._channel.close()
