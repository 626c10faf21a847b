"""The registry core: names -> (path, digest, generation), weights re-read on demand.

Synchronous and thread-safe; the servicer runs slow calls (file parsing) in a worker thread.
Never imports generated stubs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from contextlib import asynccontextmanager

from services.adapters.base_model import BaseModelShapes
from services.adapters.catalog import READY, AdapterRecord, Catalog
from services.adapters.config import RegistryConfig
from services.adapters.leases import AdapterRef, LeaseTable
from services.adapters.paths import open_in_root
from services.adapters.peft_format import read_peft_dir
from services.adapters.types import BASE_MISMATCH, BASE_UNKNOWN, AdapterStatus, LoRAAdapter
from services.common.checkpoint import CheckpointConfig, base_model_digest, base_model_name
from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    TesseraError,
)
from services.common.names import check_adapter_name
from tessera.protocol import UNKNOWN_ADAPTER

log = logging.getLogger(__name__)


class AdapterRegistry:
    """Authority for adapter names, sources, content digests and generations.

    Raises (from its methods): InvalidArgument (bad name/path/adapter), NotFound (unknown name or
    missing path), AlreadyExists (load of a loaded name without replace), FailedPrecondition
    (files changed on disk since load; registered against another base model than this one's).

    With a base model configured, every load records its digest (checkpoint.base_model_digest) and
    an adapter recorded against another base, or against none, is listed but not servable here:
    decoders are refused its weights until it is loaded again on this base.
    """

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        config.root.mkdir(parents=True, exist_ok=True)
        self.root = config.root.resolve()
        self.base = BaseModelShapes.from_model_dir(config.base_model_dir) if config.base_model_dir else None
        checkpoint = CheckpointConfig.read(config.base_model_dir) if config.base_model_dir else None
        self.base_model = base_model_digest(checkpoint) if checkpoint else ""  # "" = no base: nothing is checked
        self.base_model_name = base_model_name(checkpoint) if checkpoint else ""
        self.catalog = Catalog(config.db_path)
        self.leases = LeaseTable(config.report_ttl_s)
        # A restart starts with an empty lease table while decoders still run requests on the
        # catalog's adapters: unloads and drains wait until every live decoder has reported, i.e.
        # for report_ttl_s (a decoder silent that long counts as gone anyway; reconnecting after
        # the restart takes decoders a few seconds of channel backoff plus a report interval).
        self._leases_known_at = time.monotonic() + (config.report_ttl_s if self.catalog.list_ready() else 0.0)

    def load(self, name: str, path: str, replace: bool = False) -> AdapterRecord:
        """Validate the PEFT directory at `path` (inside the root) and register it as `name`.

        The new record's generation is the previous one + 1 (1 for a new name); reloading the
        same files yields the same digest.
        """
        check_adapter_name(name)
        self._refuse_existing(name, replace)
        directory, adapter = self._read(name, path)
        previous = self._refuse_existing(name, replace)
        if previous is not None and previous.state == READY and previous.digest != adapter.digest:
            self._refuse_leased(previous)
        return self._put(name, directory, adapter, replace)

    async def load_async(self, name: str, path: str, replace: bool = False, drain: bool = False) -> AdapterRecord:
        """`load`, except that replacing leased weights with drain=True waits for their leases to end.

        Raises (besides load's): FailedPrecondition when the replaced weights are leased and not drain.
        """
        check_adapter_name(name)
        self._refuse_existing(name, replace)
        directory, adapter = await asyncio.to_thread(self._read, name, path)  # validate before touching anything
        previous = self._refuse_existing(name, replace)
        if previous is None or previous.state != READY or previous.digest == adapter.digest:
            return self._put(name, directory, adapter, replace)
        async with self._quiesced(previous, drain):
            return self._put(name, directory, adapter, replace)

    async def unload_async(self, name: str, drain: bool = False) -> None:
        """Unload `name`; leased weights raise FailedPrecondition, or with drain=True new admissions
        are refused and the call returns once every decoder reports zero leases."""
        async with self._quiesced(self.get(name), drain):
            self.unload(name)

    def report_residency(self, decoder_id: str, resident: dict[str, int], leases: dict[AdapterRef, int],
                         draining_acked: set[AdapterRef]) -> list[AdapterRef]:
        """A decoder's residency report ({digest: leases}, {(name, digest): leases}, acknowledged
        drains); returns the (name, digest) pairs whose admissions it must refuse."""
        return self.leases.report(decoder_id, resident, leases, draining_acked)

    def registered(self, digests: Collection[str]) -> list[AdapterRef]:
        """(name, digest) of every ready adapter servable on this base whose weights are one of
        `digests`, sorted: the names a decoder holding those weights serves without a fetch."""
        wanted = set(digests)
        return sorted(_ref(r) for r in self.list() if r.digest in wanted and self._base_state(r) is None)

    def list_status(self) -> list[AdapterStatus]:
        """Every ready adapter with its per-decoder residency and lease counts."""
        return [AdapterStatus(r, tuple(self.leases.residency(_ref(r))), self.leases.is_draining(_ref(r)),
                              self._base_state(r)) for r in self.list()]

    def _base_state(self, record: AdapterRecord) -> str | None:
        """BASE_MISMATCH, BASE_UNKNOWN, or None when `record` may serve on this registry's base."""
        if not self.base_model or record.base_model == self.base_model:
            return None
        return BASE_MISMATCH if record.base_model else BASE_UNKNOWN

    def _check_base(self, record: AdapterRecord) -> None:
        """Raises FailedPrecondition naming both base models when `record` may not serve here."""
        state = self._base_state(record)
        if state is None:
            return
        here = f"this cluster serves {self.base_model_name} (base digest {self.base_model[:12]})"
        if state == BASE_UNKNOWN:
            raise FailedPrecondition(f"adapter {record.name!r} was registered before adapters recorded their base "
                                     f"model, and {here}; load it again (replace=true) to serve it on this base")
        raise FailedPrecondition(f"adapter {record.name!r} was registered for base model {record.base_model_name} "
                                 f"(base digest {record.base_model[:12]}), but {here}; load it again "
                                 "(replace=true) with an adapter trained for this base")

    @asynccontextmanager
    async def _quiesced(self, record: AdapterRecord, drain: bool):
        wait = self._leases_known_at - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if not drain:
            await self._confirm_unleased(record)
            yield
            return
        self.leases.start_drain(_ref(record))
        try:
            while not self.leases.drained(_ref(record)):
                await asyncio.sleep(self.config.drain_poll_s)
            yield
        finally:
            self.leases.end_drain(_ref(record))

    async def _confirm_unleased(self, record: AdapterRecord) -> None:
        """Decide on counts taken after this call (LeaseTable.reported_since: each live decoder's
        second report after it), waiting up to `lease_confirm_s` for them; refuse
        (FailedPrecondition) if one then shows leases."""
        since = time.monotonic()
        deadline = since + self.config.lease_confirm_s
        while True:
            if self.leases.reported_since(since) or time.monotonic() >= deadline:
                self._refuse_leased(record)
                return
            await asyncio.sleep(self.config.drain_poll_s)

    def _refuse_leased(self, record: AdapterRecord) -> None:
        residency = self.leases.residency(_ref(record))
        leases = sum(n for _, n in residency)
        if leases:
            where = ", ".join(f"{d}: {n}" for d, n in residency if n)
            raise FailedPrecondition(f"adapter {record.name!r} is leased by {leases} running request(s) ({where}); "
                                     "pass drain=true to refuse new requests and wait for these to finish")

    def _put(self, name: str, directory: str, adapter: LoRAAdapter, replace: bool) -> AdapterRecord:
        digest = adapter.digest
        while True:
            previous = self._refuse_existing(name, replace)
            record = self.catalog.put_ready(
                name=name, path=directory, digest=digest, rank=adapter.rank,
                alpha=adapter.alpha, use_rslora=adapter.use_rslora, targets=adapter.target_modules,
                expected_generation=previous.generation if previous else 0,
                base_model=self.base_model, base_model_name=self.base_model_name)
            if record is not None:
                log.info("loaded adapter %r generation %d digest %s from %s",
                         name, record.generation, digest[:12], record.path)
                return record

    def unload(self, name: str) -> None:
        """Forget `name` (its generation count is kept). Raises NotFound if it is not loaded."""
        check_adapter_name(name)
        if not self.catalog.mark_unloaded(name):
            raise NotFound(f"unknown adapter {name!r}; nothing to unload", reason=UNKNOWN_ADAPTER)
        log.info("unloaded adapter %r", name)

    def list(self) -> list[AdapterRecord]:
        """Every ready adapter, sorted by name."""
        return self.catalog.list_ready()

    def get(self, name: str) -> AdapterRecord:
        """The ready record for `name`. Raises InvalidArgument (not an adapter name) or NotFound
        "unknown adapter 'x'"."""
        check_adapter_name(name)
        record = self.catalog.get(name)
        if record is None or record.state != READY:
            raise NotFound(f"unknown adapter {name!r}", reason=UNKNOWN_ADAPTER)
        return record

    def get_admissible(self, name: str) -> AdapterRecord:
        """`get` for a new admission: FailedPrecondition while the name's weights are draining, or
        when it was registered against another base model (or an unknown one)."""
        record = self.get(name)
        self._check_base(record)
        if self.leases.is_draining(_ref(record)):
            raise FailedPrecondition(f"adapter {name!r} is being unloaded or replaced (draining); "
                                     "new requests for it are refused")
        return record

    def get_weights(self, name: str) -> tuple[AdapterRecord, LoRAAdapter]:
        """The record and its weights, re-read from disk and checked against the recorded digest.

        Raises:
            NotFound: unknown name.
            FailedPrecondition: the files are gone, no longer valid, or hash differently than at load.
        """
        record = self.get_admissible(name)
        try:
            _, adapter = self._read(name, record.path)
        except TesseraError as error:
            raise FailedPrecondition(f"adapter {name!r} can no longer be read from {record.path!r} ({error}); "
                                     "reload it") from None
        if adapter.digest != record.digest:
            raise FailedPrecondition(f"adapter {name!r}: adapter files changed since load; reload it "
                                     f"(digest {record.digest[:12]} at load, {adapter.digest[:12]} now)")
        return record, adapter

    def close(self) -> None:
        self.catalog.close()

    def _refuse_existing(self, name: str, replace: bool) -> AdapterRecord | None:
        previous = self.catalog.get(name)
        if previous is not None and previous.state == READY and not replace:
            unservable = "" if self._base_state(previous) is None else ", for another base model than this cluster's"
            raise AlreadyExists(f"adapter {name!r} is already loaded (generation {previous.generation}{unservable}); "
                                "pass replace=true to load new weights under this name")
        return previous

    def _read(self, name: str, path: str) -> tuple[str, LoRAAdapter]:
        """(the catalog form of `path`, its adapter): the directory opened inside the root and its
        files read through its descriptor (paths.py), so no swapped symlink leads the read outside."""
        with open_in_root(self.root, path) as directory:
            return directory.path, read_peft_dir(directory, name, self.config.max_rank, self.base)


def _ref(record: AdapterRecord) -> AdapterRef:
    """The lease table's key: leases and drains are per name and weights."""
    return record.name, record.digest
