"""Registry domain objects <-> tessera.v1 protobuf messages (the only place that knows both)."""

from __future__ import annotations

from services.adapters.catalog import AdapterRecord
from services.adapters.config import RegistryConfig
from services.adapters.leases import AdapterRef
from services.adapters.types import AdapterStatus, LoRAAdapter
from services.common.limits import check_chars, check_count
from services.common.tensor import to_pb
from tessera.v1 import adapters_pb2


def info_to_pb(record: AdapterRecord) -> adapters_pb2.AdapterInfo:
    return adapters_pb2.AdapterInfo(
        name=record.name, digest=record.digest, rank=record.rank, target_modules=list(record.targets),
        lora_alpha=record.alpha, use_rslora=record.use_rslora, path=record.path,
        generation=record.generation, state=record.state, base_model=record.base_model,
        base_model_name=record.base_model_name)


def status_to_pb(status: AdapterStatus) -> adapters_pb2.AdapterInfo:
    """AdapterInfo with per-decoder residency, total leases and the listed state (AdapterStatus.state)."""
    info = info_to_pb(status.record)
    info.residency.extend(adapters_pb2.AdapterResidency(decoder_id=d, leases=n) for d, n in status.residency)
    info.leases = status.num_leases
    info.state = status.state
    return info


def check_request(request, config: RegistryConfig) -> None:
    """The caps of a Load/Unload/GetAdapter request, before any work: its name and (LoadAdapter)
    path. Raises InvalidArgument naming the field, its size and the limit."""
    check_chars("name", request.name, config.max_name_chars, "max_name_chars")
    if hasattr(request, "path"):
        check_chars("path", request.path, config.max_path_chars, "max_path_chars")


def report_from_pb(report: adapters_pb2.ResidencyReport, config: RegistryConfig | None = None,
                   ) -> tuple[dict[str, int], dict[AdapterRef, int], set[AdapterRef]]:
    """({digest: leases}, {(name, digest): leases}, acknowledged draining (name, digest)) of a decoder's report.

    Raises InvalidArgument: a cap of `config` passed (list lengths, then string sizes), checked first.
    """
    if config is not None:
        _check_report(report, config)
    resident = {r.digest: r.leases for r in report.resident}
    leases = {(n.name, r.digest): n.leases for r in report.resident for n in r.by_name}
    return resident, leases, {(ref.name, ref.digest) for ref in report.draining_acked}


def ack_to_pb(draining: list[AdapterRef], registered: list[AdapterRef]) -> adapters_pb2.ResidencyAck:
    return adapters_pb2.ResidencyAck(draining=[adapters_pb2.AdapterRef(name=n, digest=d) for n, d in draining],
                                     registered=[adapters_pb2.AdapterRef(name=n, digest=d) for n, d in registered])


def weights_to_pb(record: AdapterRecord, adapter: LoRAAdapter | None) -> adapters_pb2.AdapterWeights:
    """AdapterWeights with tensors sorted by module name (empty when `adapter` is None)."""
    tensors = []
    if adapter is not None:
        tensors = [adapters_pb2.AdapterTensor(module=module, lora_a=to_pb(target.lora_a), lora_b=to_pb(target.lora_b))
                   for module, target in sorted(adapter.targets.items())]
    return adapters_pb2.AdapterWeights(info=info_to_pb(record), tensors=tensors)


def _check_report(report: adapters_pb2.ResidencyReport, config: RegistryConfig) -> None:
    entries, chars = config.max_report_entries, config.max_name_chars
    check_count("resident", len(report.resident), entries, "max_report_entries")
    check_count("draining_acked", len(report.draining_acked), entries, "max_report_entries")
    check_chars("decoder_id", report.decoder_id, chars, "max_name_chars")
    for i, resident in enumerate(report.resident):
        check_count(f"resident[{i}].by_name", len(resident.by_name), entries, "max_report_entries")
        check_chars(f"resident[{i}].digest", resident.digest, chars, "max_name_chars")
        for j, by_name in enumerate(resident.by_name):
            check_chars(f"resident[{i}].by_name[{j}].name", by_name.name, chars, "max_name_chars")
    for i, ref in enumerate(report.draining_acked):
        check_chars(f"draining_acked[{i}].name", ref.name, chars, "max_name_chars")
        check_chars(f"draining_acked[{i}].digest", ref.digest, chars, "max_name_chars")
