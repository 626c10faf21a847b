"""The decoder's memory per weight format: the resident set of `python -m services.decoder` serving
the same weights as float32 and as GGUF blocks kept quantized (Q8_0, Q4_0; `tessera up
--decoder-model-dir FILE.gguf`), with identical flags.

Per model and format, in a process of its own: VmRSS once health says SERVING, then after a load of
8 concurrent requests (prompts of 128 tokens, 64 generated, EOS ignored), and the peak VmHWM
(/proc/PID/status). The ratio column is each format's RSS after the load over float32's. Models:

- SmolLM2-135M-Instruct, the built-in decoder;
- SmolLM2-360M's and SmolLM2-1.7B's shapes (their config.json: hidden 960 / 2048, 32 / 24 layers,
  15 / 32 heads, 5 / 32 KV heads, intermediate 2560 / 8192, tied embeddings) with seeded random
  weights and SmolLM2's tokenizer: the Hugging Face hub is unreachable here, and the resident set
  depends on the shapes, not on the values. Written once under $TESSERA_HOME/bench/ (1.7B: 6.8 GB
  of float32 safetensors, then its GGUF exports and imports).

The runtime (python, torch, transformers, tokenizers, the grammar engine, the KV cache) is the same
in every row, so the ratio falls toward the weights' own (Q4_0: 0.14x) as the model grows.

    tessera bench memory [--models 135m 360m 1.7b] [--outtypes q8_0 q4_0] [--kv-cache-dtype bfloat16]
                         [--output bench/results/memory.md]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import RESULTS, machine, start_decoder, stop

LOAD_REQUESTS, LOAD_PROMPT, LOAD_TOKENS = 8, 128, 64
FLAGS = ["--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "1024"]
# HuggingFaceTB/SmolLM2-360M's and -1.7B's config.json (the architectures' sizes; weights random)
_SMOLLM2 = dict(vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=2, pad_token_id=2)
SHAPES = {"360m": dict(_SMOLLM2, hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                       num_key_value_heads=5, rope_theta=100000.0),
          "1.7b": dict(_SMOLLM2, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                       num_key_value_heads=32, rope_theta=130000.0)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def status_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of process `pid`, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def smollm2_shape(size: str) -> Path:
    """SmolLM2-`size`'s architecture (SHAPES) with seeded random float32 weights and the built-in
    tokenizer, written once under $TESSERA_HOME/bench/."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tessera.paths import default_decoder_dir, tessera_home

    target = tessera_home() / "bench" / f"smollm2-{size}-shape"
    if (target / "model.safetensors").exists():
        return target
    print(f"[memory] writing {target} (random weights of SmolLM2-{size.upper()}'s shape)", flush=True)
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (default_decoder_dir() / name).is_file():
            shutil.copy(default_decoder_dir() / name, target / name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SHAPES[size]), dtype=torch.float32)
    model.save_pretrained(target, max_shard_size="20GB")  # one model.safetensors
    return target


def load(address: str) -> None:
    """LOAD_REQUESTS concurrent greedy requests over gRPC, EOS ignored."""
    import grpc

    from tessera.v1 import decoder_pb2, decoder_pb2_grpc

    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(LOAD_PROMPT)] for _ in range(LOAD_REQUESTS)]

    async def one(stub, prompt):
        request = decoder_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=decoder_pb2.SamplingParams(
            max_tokens=LOAD_TOKENS, ignore_eos=True))
        return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=600)])

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderStub(channel)
            counts = await asyncio.gather(*(one(stub, p) for p in prompts))
        if counts != [LOAD_TOKENS] * LOAD_REQUESTS:
            raise RuntimeError(f"the load generated {counts} tokens, not {LOAD_TOKENS} each")

    asyncio.run(run())


def measure(model_dir: Path, label: str, flags: list[str] = FLAGS) -> dict:
    process, address = start_decoder(model_dir, flags, RESULTS / f"memory-{label}.log")
    try:
        ready = status_kb(process.pid)
        start = time.perf_counter()
        load(address)
        seconds = time.perf_counter() - start
        loaded = status_kb(process.pid)
    finally:
        stop(process)
    row = {"ready": ready["VmRSS"], "loaded": loaded["VmRSS"], "peak": loaded["VmHWM"], "load_s": seconds}
    print(f"[memory] {label}: RSS {row['ready'] / 1024:.0f} MiB ready, {row['loaded'] / 1024:.0f} MiB after the load "
          f"({seconds:.1f} s), peak {row['peak'] / 1024:.0f} MiB", flush=True)
    return row


def weight_mib(model_dir: Path) -> float:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20


def main(argv: list[str] | None = None) -> int:
    from tessera.cli.gguf_export import default_output, export_gguf
    from tessera.cli.models import serve_gguf
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("135m", *SHAPES), default=["135m", *SHAPES])
    parser.add_argument("--outtypes", nargs="+", choices=("q8_0", "q4_0", "q4_1"), default=["q8_0", "q4_0"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16"),
                        help="the decoders' --kv-cache-dtype (auto: float32, the model's)")
    parser.add_argument("--output", type=Path, default=None,
                        help="default bench/results/memory.md (memory-kv-bfloat16.md with a bfloat16 cache)")
    args = parser.parse_args(argv)
    flags = [*FLAGS, "--kv-cache-dtype", args.kv_cache_dtype]
    kv = "" if args.kv_cache_dtype == "auto" else "-kv-bfloat16"
    output = args.output or RESULTS / f"memory{kv}.md"
    lines = ["| model | weights | safetensors MiB | RSS ready MiB | RSS after the load MiB | peak MiB | "
             "RSS beyond the weights MiB | RSS / float32's |", "|---|---|---|---|---|---|---|---|"]
    for name in args.models:
        dense = default_decoder_dir() if name == "135m" else smollm2_shape(name)
        rows = [("float32", dense, measure(dense, f"{name}-f32{kv}", flags))]
        for outtype in args.outtypes:
            gguf_path = default_output(dense, outtype)
            if not gguf_path.exists():
                print(f"[memory] exporting {gguf_path}", flush=True)
                export_gguf(dense, gguf_path, outtype)
            served = serve_gguf(gguf_path)
            rows.append((f"{outtype.upper()} blocks", served, measure(served, f"{name}-{outtype}{kv}", flags)))
        base = rows[0][2]["loaded"]
        for label, model_dir, row in rows:
            lines.append(f"| {dense.name} | {label} | {weight_mib(model_dir):.0f} | {row['ready'] / 1024:.0f} | "
                         f"{row['loaded'] / 1024:.0f} | {row['peak'] / 1024:.0f} | "
                         f"{row['loaded'] / 1024 - weight_mib(model_dir):.0f} | {row['loaded'] / base:.2f}x |")
    table = "\n".join(lines)
    print(table)
    cache = "float32, the default" if args.kv_cache_dtype == "auto" else "bfloat16: --kv-cache-dtype bfloat16"
    output.write_text(
        f"# tessera bench memory\n\nMachine: {machine()}\n\nThe decoder process (`python -m services.decoder "
        f"{' '.join(flags)}`, every other flag default) per weight format; the load: {LOAD_REQUESTS} concurrent "
        f"requests, prompts {LOAD_PROMPT} tokens, {LOAD_TOKENS} generated. Target (issue 35): serving Q4_0 "
        f"<= 0.4x serving F32. 'RSS beyond the weights' is what every format pays alike: python, torch, "
        f"transformers and the tokenizer, the grammar engine, the KV cache ({cache}; "
        f"max_num_seqs x max_model_len / 4 tokens), the step's buffers.\n\n{table}\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
