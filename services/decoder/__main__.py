"""python -m services.decoder --address HOST:PORT [flags]"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from services.common import auth
from services.common.message_limits import decoder_bytes
from services.common.metrics import DecoderCollector, start_metrics_server
from services.common.liveness import DEFAULT_WEDGED_AFTER_S
from services.common.limits import GenerateLimits, add_flags, from_flags
from services.common.paths import default_decoder_dir
from services.common.server import DEFAULT_PORTS, configure_logging, serve
from services.decoder.adapter_client import RegistryAdapterSource
from services.decoder.config import DecoderConfig, read_model_config
from services.decoder.engine import LLMEngine
from services.decoder.model_qwen2_vl import text_config
from services.decoder.servicer import DecoderServicer
from tessera.v1 import decoder_pb2, decoder_pb2_grpc


def parse_section(text: str) -> tuple[int, int, int] | None:
    if not text.strip():
        return None
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"--mrope-section needs three comma-separated ints, got {text!r}")
    return tuple(parts)


def parse_args(argv: list[str] | None = None) -> tuple[str, DecoderConfig]:
    p = argparse.ArgumentParser(prog="python -m services.decoder", description=__doc__)
    p.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORTS['decoder']}")
    p.add_argument("--model-dir", default=str(default_decoder_dir()))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=0, help="0 = derive from max_num_seqs * max_model_len")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=0, help="0 = min(max_position_embeddings, 8192)")
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--mrope-section", type=parse_section, default=None, help='e.g. "8,12,12"; empty = text-only')
    p.add_argument("--image-token", default=None)
    p.add_argument("--adapters-address", default=None)
    p.add_argument("--adapter-slots", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--lora-backend", choices=("torch", "triton", "cpu"), default="torch",
                   help="multi-LoRA compute: torch grouped matmuls, Triton BGMV/SGMV kernels (GPU or "
                        "TRITON_INTERPRET=1), or cpu: decode rows in a C BGMV kernel built at start")
    p.add_argument("--adapter-host-cache-mb", type=int, default=1024,
                   help="host memory for adapter weights by digest (swap-ins without refetching)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention-backend", choices=("torch", "triton", "cpu"), default="torch",
                   help="paged attention implementation; triton needs a GPU (or TRITON_INTERPRET=1); cpu: "
                        "decode rows in a C kernel built at start (needs a C compiler with OpenMP, float32)")
    p.add_argument("--no-prefix-caching", action="store_true", help="never share KV blocks between requests")
    auth.add_arguments(p)
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics on this port, same host as --address (default 0: off)")
    p.add_argument("--wedged-after-s", type=float, default=DEFAULT_WEDGED_AFTER_S,
                   help="health turns NOT_SERVING when requests are queued and no engine step completes for "
                        "this long (seconds; must exceed the longest step; default %(default)s)")
    add_flags(p, GenerateLimits)
    a = p.parse_args(argv)
    config = DecoderConfig(
        model_dir=a.model_dir, block_size=a.block_size, num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len, max_waiting=a.max_waiting,
        mrope_section=a.mrope_section, image_token=a.image_token, adapters_address=a.adapters_address or None,
        adapter_slots=a.adapter_slots, max_lora_rank=a.max_lora_rank, lora_backend=a.lora_backend, dtype=a.dtype,
        adapter_host_cache_mb=a.adapter_host_cache_mb,
        enable_prefix_caching=not a.no_prefix_caching, attention_backend=a.attention_backend,
        metrics_port=a.metrics_port, wedged_after_s=a.wedged_after_s,
        limits=from_flags(GenerateLimits, a))
    return a.address, config


def main(argv: list[str] | None = None) -> None:
    address, config = parse_args(argv)
    auth.configure_security(argv)
    configure_logging()
    engine = LLMEngine(config, RegistryAdapterSource.from_config(config))
    servicer = DecoderServicer(engine)
    start_metrics_server(config.metrics_port, address, DecoderCollector(
        Path(config.model_dir).name, lambda: engine.stats() if engine.started else None))

    def register(server):
        decoder_pb2_grpc.add_DecoderServicer_to_server(servicer, server)
        return [decoder_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name]

    hidden_size = text_config(read_model_config(config.model_dir))["hidden_size"]
    asyncio.run(serve("decoder", address, register, start=engine.start, stop=engine.stop,
                      health=engine.health, max_receive_bytes=decoder_bytes(config.max_model_len, hidden_size)))


if __name__ == "__main__":
    main()
