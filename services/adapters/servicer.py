"""gRPC servicer for tessera.v1.Adapters: protobuf in -> AdapterRegistry -> protobuf out."""

from __future__ import annotations

import asyncio

from services.adapters.convert import (
    ack_to_pb,
    check_request,
    info_to_pb,
    report_from_pb,
    status_to_pb,
    weights_to_pb,
)
from services.adapters.engine import AdapterRegistry
from tessera.v1 import adapters_pb2, adapters_pb2_grpc


class AdaptersServicer(adapters_pb2_grpc.AdaptersServicer):
    """Thin: file reads and hashing run in a worker thread so the event loop keeps serving."""

    def __init__(self, registry: AdapterRegistry) -> None:
        self.registry = registry

    async def LoadAdapter(self, request, context):
        check_request(request, self.registry.config)
        record = await self.registry.load_async(request.name, request.path, request.replace, request.drain)
        return info_to_pb(record)

    async def UnloadAdapter(self, request, context):
        check_request(request, self.registry.config)
        await self.registry.unload_async(request.name, request.drain)
        return adapters_pb2.UnloadAdapterResponse(name=request.name)

    async def ListAdapters(self, request, context):
        statuses = await asyncio.to_thread(self.registry.list_status)
        return adapters_pb2.ListAdaptersResponse(adapters=[status_to_pb(s) for s in statuses])

    async def GetAdapter(self, request, context):
        check_request(request, self.registry.config)
        if request.include_weights:
            record, adapter = await asyncio.to_thread(self.registry.get_weights, request.name)
            return await asyncio.to_thread(weights_to_pb, record, adapter)
        record = await asyncio.to_thread(self.registry.get_admissible, request.name)
        return weights_to_pb(record, None)

    async def ReportResidency(self, request, context):
        resident, leases, acked = report_from_pb(request, self.registry.config)
        draining = self.registry.report_residency(request.decoder_id, resident, leases, acked)
        registered = await asyncio.to_thread(self.registry.registered, resident) if resident else []
        return ack_to_pb(draining, registered)


def register(server, registry: AdapterRegistry) -> list[str]:
    """Add the Adapters servicer to `server`; returns the full service names (health, reflection)."""
    adapters_pb2_grpc.add_AdaptersServicer_to_server(AdaptersServicer(registry), server)
    return [adapters_pb2.DESCRIPTOR.services_by_name["Adapters"].full_name]
