"""`python -m services.pooling`: embeddings and rerank over gRPC."""

from __future__ import annotations

import argparse
import asyncio

from services.common.server import DEFAULT_PORTS, configure_logging, serve
from services.pooling.config import PoolingConfig
from services.pooling.service import PoolingService
from services.pooling.servicer import PoolingServicer
from tessera.v1 import pooling_pb2, pooling_pb2_grpc


def parse_args(argv: list[str] | None = None) -> PoolingConfig:
    parser = argparse.ArgumentParser(prog="python -m services.pooling", description=__doc__)
    parser.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORTS['pooling']}",
                        help="bind host:port (default %(default)s)")
    parser.add_argument("--model-dir", default=None,
                        help="local transformers / sentence-transformers directory (default: the prepared all-MiniLM-L6-v2)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="most inputs per request (default %(default)s)")
    parser.add_argument("--max-input-length", type=int, default=None,
                        help="most tokens per input (default: the model's max_seq_length)")
    parser.add_argument("--pooling-mode", choices=["mean", "cls", "last"], default=None,
                        help="default: the model's 1_Pooling/config.json")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                        help="unit-normalize embeddings by default (default: the model's Normalize module)")
    parser.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    args = parser.parse_args(argv)
    optional = {"model_dir": args.model_dir} if args.model_dir else {}
    try:
        return PoolingConfig(address=args.address, max_batch_size=args.max_batch_size,
                             max_input_length=args.max_input_length, pooling_mode=args.pooling_mode,
                             normalize=args.normalize, device=args.device, **optional)
    except ValueError as error:
        parser.error(str(error))


async def _main(config: PoolingConfig) -> None:
    service = PoolingService(config)

    def register(server):
        pooling_pb2_grpc.add_PoolingServicer_to_server(PoolingServicer(service), server)
        return [pooling_pb2.DESCRIPTOR.services_by_name["Pooling"].full_name]

    async def start() -> None:
        await asyncio.to_thread(service.load)

    await serve("pooling", config.address, register, start=start)


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    asyncio.run(_main(parse_args(argv)))


if __name__ == "__main__":
    main()
