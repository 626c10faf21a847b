"""The registry's `AdapterSource`: resolves adapter names over gRPC, keeps their weights resident,
reports leases.

`acquire(name)` asks the registry for the name's digest (no weights); if the bank does not hold
that digest it takes the weights from the host-memory cache (bounded LRU by digest) or asks the
registry again with weights, swaps them into an idle slot (LRU) and leases it; when every slot is
leased the admission waits for a release. Leases are released by the engine when the request
finishes or is aborted (kept through preemption).

A background task reports `{digest: leases}`, split by the name each request was admitted
under, to the registry every `report_interval_s` (the lease protocol of ARCHITECTURE.md). Reports
are sequential, each counted after the answer to the previous one arrived: the registry takes a
count as newer than an unload call only when the report before it arrived after the call
(services/adapters/leases.py). The answer lists the (name, digest) pairs being drained;
admissions of such a name resolving to such weights are refused from then on, and the next
report acknowledges them, which lets the registry finish an unload or replace once every decoder
reports zero leases for that pair; it also lists the names it registers for the digests reported
resident, which are the decoder's `resident_names` (DecoderInfo.resident_adapters, read by the
gateway's adapter affinity). Two names
loaded from the same files share a slot but never each other's drains. While the registry is
unreachable, names resolved before keep working if their weights are still resident; a name the
registry answered NOT_FOUND for (unloaded) is forgotten, so it is not served from memory then.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

import grpc
import torch

from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    TesseraError,
    Unavailable,
    error_from_rpc,
)
from services.common.names import check_adapter_name
from services.common.server import insecure_channel
from services.common.tensor import from_pb
from services.decoder.adapter_source import AdapterSource, wait_for_free_slot
from services.decoder.config import DecoderConfig
from services.decoder.lora import AdapterSlots, HostAdapterCache, LoRAWeights
from tessera.protocol import UNKNOWN_ADAPTER
from tessera.v1 import adapters_pb2, adapters_pb2_grpc

log = logging.getLogger(__name__)
_FLOAT32 = frozenset({"float32"})


class RegistryAdapterSource(AdapterSource):
    """Adapters of the registry at `address` (None: no registry, every name is NotFound).

    `start(slots)` begins the residency reports; `acquire` also starts them (on its loop) if they
    are not running.
    """

    def __init__(self, address: str | None, timeout_s: float = 30.0, decoder_id: str | None = None,
                 report_interval_s: float = 1.0, host_cache_bytes: int = 1 << 30,
                 slot_wait_poll_s: float = 1.0, pin_host_cache: bool = False) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.decoder_id = decoder_id or f"decoder-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.report_interval_s = report_interval_s
        self.draining: set[tuple[str, str]] = set()  # (name, digest) whose admissions are refused
        self._name_to_digest: dict[str, str] = {}  # last resolution, used while the registry is down
        self._registered: set[tuple[str, str]] = set()  # the last report's answer: (name, digest) held here
        self._channel: grpc.aio.Channel | None = None
        self._stub = None
        self._reporter: asyncio.Task | None = None
        self._report_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None  # per event loop
        self.host_cache = HostAdapterCache(host_cache_bytes, pin_host_cache)  # digest -> weights, for swap-ins
        self.num_weight_fetches = 0                # weight downloads from the registry
        self._fetching: dict[tuple[str, str], asyncio.Task] = {}  # (name, digest) -> the fetch in flight
        self.num_slot_waits = 0                    # admissions that waited for a leased slot to free
        self.num_host_cache_hits = 0               # weight lookups the host cache answered
        self.slot_wait_poll_s = slot_wait_poll_s

    @classmethod
    def from_config(cls, config: DecoderConfig, **options) -> RegistryAdapterSource:
        """The source a decoder started with `config` uses (its registry address and host cache,
        pinned when the decoder computes on CUDA)."""
        return cls(config.adapters_address, host_cache_bytes=config.adapter_host_cache_mb << 20,
                   pin_host_cache=config.torch_device.type == "cuda", **options)

    async def start(self, slots: AdapterSlots) -> None:
        """Serve leases of `slots`; residency reports start now, not at the first acquire."""
        self.slots = slots
        self.start_reporting()

    async def acquire(self, name: str) -> int:
        """Lease a bank slot holding adapter `name`; returns the slot.

        A digest not resident is swapped into an idle slot (least recently used first) from the
        host cache, or fetched from the registry into it. When every slot is leased this waits
        (never fails) until a running request releases one.

        Raises:
            InvalidArgument: `name` is not an adapter name (services/common/names.py).
            NotFound: no registry configured, or the registry does not know `name`.
            FailedPrecondition: the adapter is draining (being unloaded or replaced).
            Unavailable: the registry cannot be reached and `name` is neither resident nor in
                the host cache.
        """
        check_adapter_name(name)
        if self.address is None:
            raise NotFound(f"unknown adapter {name!r}: this decoder has no adapter registry configured", reason=UNKNOWN_ADAPTER)
        self.start_reporting()
        digest = await self._resolve(name)
        weights: LoRAWeights | None = None
        while True:
            slot = self._lease(name, digest)
            if slot is not None:
                return slot
            if weights is None:
                weights = await self._weights(name, digest)
                digest = weights.digest
            self._check_drain(name, digest)
            slot = self.slots.load_and_acquire(weights, name)  # no await since the drain check (see _lease)
            if slot is not None:
                return slot
            await self._wait_for_slot(name)

    async def _resolve(self, name: str) -> str:
        """The digest `name` maps to now; the last known one while the registry is unreachable."""
        try:
            info = await self._get(name, include_weights=False)
        except NotFound:
            self._name_to_digest.pop(name, None)  # unloaded: not served from the last resolution either
            raise
        except Unavailable:
            digest = self._name_to_digest.get(name)
            if digest is None or (self.slots.slot_of(digest) is None and digest not in self.host_cache):
                raise
            return digest
        self._name_to_digest[name] = info.info.digest
        return info.info.digest

    async def _weights(self, name: str, digest: str) -> LoRAWeights:
        """Weights of `digest` from the host cache, else fetched from the registry (and cached);
        concurrent admissions of one name and digest share a single fetch."""
        cached = self.host_cache.get(digest)
        if cached is not None:
            self.num_host_cache_hits += 1
            return cached
        key = (name, digest)  # by name too: a fetch returns what its name means by then (a replace)
        task = self._fetching.get(key)
        if task is None:
            task = asyncio.ensure_future(self._fetch(name))
            self._fetching[key] = task
            task.add_done_callback(lambda _: self._fetching.pop(key, None))
        return await asyncio.shield(task)

    async def _fetch(self, name: str) -> LoRAWeights:
        reply = await self._get(name, include_weights=True)
        self.num_weight_fetches += 1
        modules = {t.module: (_factor(name, t.module, "lora_a", t.lora_a), _factor(name, t.module, "lora_b", t.lora_b))
                   for t in reply.tensors}
        weights = LoRAWeights(reply.info.digest, modules)
        self._name_to_digest[name] = weights.digest
        return self.host_cache.put(weights)

    async def _wait_for_slot(self, name: str) -> None:
        if await wait_for_free_slot(self.slots, name, self.slot_wait_poll_s):
            self.num_slot_waits += 1

    def _check_drain(self, name: str, digest: str) -> None:
        if (name, digest) in self.draining:
            raise FailedPrecondition(f"adapter {name!r} is being unloaded or replaced (draining); "
                                     "new requests for it are refused")

    def _lease(self, name: str, digest: str | None) -> int | None:
        # no await between the drain check and the lease: a report sent after this sees the lease
        if digest is None:
            return None
        self._check_drain(name, digest)
        return self.slots.acquire(digest, name)

    def resident_names(self) -> list[str]:
        """Adapter names whose weights sit in a device slot now, draining ones left out (sorted).

        The names resolved here and those the registry's last answer to a report registers for the
        digests reported resident (`ResidencyAck.registered`, which also names another adapter
        loaded from the same files); each answer forgets the resolutions it no longer registers, so
        an unloaded or replaced name leaves the list with the next report."""
        with self.slots.lock:
            resident = set(self.slots.residency())
        refs = self._registered | set(self._name_to_digest.items())
        return sorted({name for name, digest in refs if digest in resident and (name, digest) not in self.draining})

    def start_reporting(self) -> None:
        """Start the periodic residency report on the running loop (idempotent)."""
        if self.address is not None and (self._reporter is None or self._reporter.done()):
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def report_once(self) -> None:
        """Send {digest: leases by name} and the acknowledged drains; adopt the registry's draining
        pairs. A call waits for one in flight: the counts are taken after its answer arrives."""
        loop = asyncio.get_running_loop()
        if self._report_lock is None or self._report_lock[0] is not loop:
            self._report_lock = (loop, asyncio.Lock())
        async with self._report_lock[1]:
            await self._report()

    async def _report(self) -> None:
        acked = sorted(self.draining)  # taken before the residency snapshot
        with self.slots.lock:  # one consistent snapshot of both views
            residency, by_name = self.slots.residency(), self.slots.leases_by_name()
        resident = [adapters_pb2.ResidentDigest(digest=d, leases=n, by_name=[
            adapters_pb2.NameLeases(name=k, leases=v) for k, v in sorted(by_name.get(d, {}).items())])
            for d, n in residency.items()]
        ack = await self._call("ReportResidency", adapters_pb2.ResidencyReport(
            decoder_id=self.decoder_id, resident=resident,
            draining_acked=[adapters_pb2.AdapterRef(name=n, digest=d) for n, d in acked]))
        self.draining = {(ref.name, ref.digest) for ref in ack.draining}
        self._registered = {(ref.name, ref.digest) for ref in ack.registered}
        for digest in residency:  # a name the registry no longer binds to weights held here: unloaded, replaced
            for name in [n for n, d in self._name_to_digest.items() if d == digest]:
                if (name, digest) not in self._registered:
                    del self._name_to_digest[name]  # not served from memory while the registry is down either

    async def _report_loop(self) -> None:
        while True:
            try:
                await self.report_once()
            except TesseraError as error:
                log.debug("residency report to %s failed: %s", self.address, error)
            await asyncio.sleep(self.report_interval_s)

    async def _get(self, name: str, include_weights: bool) -> adapters_pb2.AdapterWeights:
        request = adapters_pb2.GetAdapterRequest(name=name, include_weights=include_weights)
        try:
            return await self._call("GetAdapter", request)
        except NotFound:
            raise NotFound(f"unknown adapter {name!r}", reason=UNKNOWN_ADAPTER) from None

    async def _call(self, method: str, request):
        if self._stub is None:
            self._channel = insecure_channel(self.address)
            self._stub = adapters_pb2_grpc.AdaptersStub(self._channel)
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            failure = error_from_rpc(error)
            if isinstance(failure, (Unavailable, DeadlineExceeded)):
                raise Unavailable(f"adapter registry at {self.address} is unavailable: {error.details()}") from None
            raise failure from None

    async def close(self) -> None:
        """Stop the reports and close the channel; a later acquire (on any loop) opens them again."""
        if self._reporter is not None:
            self._reporter.cancel()
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()


def _factor(name: str, module: str, part: str, message) -> torch.Tensor:
    """A LoRA factor as it arrives from the registry: float32, 2-D and finite (the bank checks the
    shapes against the model). Raises InvalidArgument naming the adapter, module and factor."""
    return from_pb(message, f"adapter {name!r} {module[:200]}.{part}", _FLOAT32, (None, None), finite=True)
