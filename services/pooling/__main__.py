"""`python -m services.pooling`: embeddings, rerank and tokenization over gRPC."""

from __future__ import annotations

import argparse
import asyncio

from services.common import auth
from services.common.message_limits import pooling_bytes
from services.common.metrics import MergedCollector, PoolingCollector, start_metrics_server
from services.common.liveness import DEFAULT_WEDGED_AFTER_S
from services.common.limits import PoolingLimits
from services.common.paths import default_embedding_dir
from services.common.server import DEFAULT_PORTS, configure_logging, serve
from services.pooling.config import CROSS_ENCODER, EMBEDDING, LLM_JUDGE, ModelConfig, PoolingConfig
from services.pooling.service import PoolingService
from services.pooling.servicer import PoolingServicer
from tessera.v1 import pooling_pb2, pooling_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.pooling", description=__doc__)
    parser.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORTS['pooling']}",
                        help="bind host:port (default %(default)s)")
    parser.add_argument("--model-dir", action="append", default=[],
                        help="embedding model directory, repeatable; the first is the default "
                             "(default: the prepared all-MiniLM-L6-v2 when no model is given at all)")
    parser.add_argument("--reranker-dir", action="append", default=[],
                        help="cross-encoder directory (a *ForSequenceClassification checkpoint), repeatable")
    parser.add_argument("--judge-dir", action="append", default=[],
                        help="causal LM directory served as an LLM-judge reranker (Qwen3-Reranker convention), repeatable")
    parser.add_argument("--max-batch-size", type=int, default=64, help="most inputs per request (default %(default)s)")
    parser.add_argument("--max-input-length", type=int, default=None,
                        help="most tokens per input, every model (default: each model's max_seq_length)")
    parser.add_argument("--pooling-mode", choices=["mean", "cls", "last"], default=None,
                        help="embedding models (default: each model's 1_Pooling/config.json)")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                        help="unit-normalize embeddings by default (default: the model's Normalize module)")
    parser.add_argument("--matryoshka-dimensions", default=None,
                        help="comma-separated widths `dimensions` may take, embedding models (default: config.json)")
    parser.add_argument("--judge-instruction", default=None, help="LLM-judge instruction (default: the model's / Qwen3-Reranker's)")
    parser.add_argument("--dynamic-batching", action=argparse.BooleanOptionalAction, default=True,
                        help="gather concurrent requests into shared forwards; --no-dynamic-batching = one "
                             "forward per request under a lock (default on)")
    parser.add_argument("--max-batch-tokens", type=int, default=16384,
                        help="token budget of one forward, padded length x rows (default %(default)s)")
    parser.add_argument("--max-wait-ms", type=float, default=2.0,
                        help="longest hold for more requests before a forward (default %(default)s)")
    parser.add_argument("--max-queue-size", type=int, default=4096,
                        help="most sequences queued per model before RESOURCE_EXHAUSTED (default %(default)s)")
    parser.add_argument("--max-request-chars", type=int, default=2_000_000,
                        help="most characters of text per request, checked before tokenizing (default %(default)s)")
    parser.add_argument("--wedged-after-s", type=float, default=DEFAULT_WEDGED_AFTER_S,
                        help="health turns NOT_SERVING when sequences are queued and no forward completes for this "
                             "long (seconds; must exceed the longest forward; default %(default)s)")
    parser.add_argument("--max-name-chars", type=int, default=PoolingLimits.max_name_chars,
                        help="characters of a request's model, prompt_name and method (default %(default)s)")
    parser.add_argument("--max-request-token-ids", type=int, default=PoolingLimits.max_request_token_ids,
                        help="token ids over one Embed request's input_ids (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    auth.add_arguments(parser)
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port, same host as --address (default 0: off)")
    return parser


def parse_args(argv: list[str] | None = None) -> PoolingConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    embedding_dirs = args.model_dir or ([] if args.reranker_dir or args.judge_dir else [default_embedding_dir()])
    try:
        widths = tuple(int(w) for w in args.matryoshka_dimensions.split(",")) if args.matryoshka_dimensions else None
        models = [ModelConfig(model_dir=d, kind=EMBEDDING, max_input_length=args.max_input_length,
                              pooling_mode=args.pooling_mode, normalize=args.normalize, matryoshka_dimensions=widths)
                  for d in embedding_dirs]
        models += [ModelConfig(model_dir=d, kind=CROSS_ENCODER, max_input_length=args.max_input_length)
                   for d in args.reranker_dir]
        models += [ModelConfig(model_dir=d, kind=LLM_JUDGE, max_input_length=args.max_input_length,
                               judge_instruction=args.judge_instruction) for d in args.judge_dir]
        return PoolingConfig(models=models, address=args.address, max_batch_size=args.max_batch_size,
                             device=args.device, dynamic_batching=args.dynamic_batching,
                             max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
                             max_queue_size=args.max_queue_size, max_request_chars=args.max_request_chars,
                             metrics_port=args.metrics_port, wedged_after_s=args.wedged_after_s,
                             max_name_chars=args.max_name_chars, max_request_token_ids=args.max_request_token_ids)
    except ValueError as error:
        parser.error(str(error))


async def _main(config: PoolingConfig) -> None:
    service = PoolingService(config)
    start_metrics_server(config.metrics_port, config.address, PoolingCollector(service.queue_sizes),
                         MergedCollector(service.batcher_stats))

    def register(server):
        pooling_pb2_grpc.add_PoolingServicer_to_server(PoolingServicer(service), server)
        return [pooling_pb2.DESCRIPTOR.services_by_name["Pooling"].full_name]

    async def start() -> None:
        await service.compute.run(service.load)  # weights touched first by the compute thread

    await serve("pooling", config.address, register, start=start, health=service.health,
                max_receive_bytes=pooling_bytes(config.max_request_chars, config.max_request_token_ids))


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    config = parse_args(argv)
    auth.configure_security(argv)
    asyncio.run(_main(config))


if __name__ == "__main__":
    main()
