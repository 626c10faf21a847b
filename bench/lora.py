"""`tessera bench lora`: many adapters in one base-model batch vs base-only and vs PEFT switching.

In one run on one machine, the same N requests (random prompts, EOS ignored, greedy):
  1. base-only: N requests without adapter, sent concurrently over gRPC to `python -m
     services.decoder`; generated tokens/s;
  2. multi-LoRA: the same N requests spread round-robin over K random rank-R PEFT adapters
     (all seven projections) registered in `python -m services.adapters`, sent concurrently to
     the same decoder (K slots; each adapter served once before timing, so it is resident);
  3. the anchor: PeftModel in process holding the K adapters, one left-padded `generate` batch
     per adapter (set_adapter between batches).
The machine's speed drifts over minutes, so the three steps run as a round, five rounds in a
row (anchor, then base-only and multi-LoRA, which of the two first alternating by round); each
target ratio is the median of the rounds' own ratios. The decoder runs with the cpu LoRA and
attention backends (C kernels; `--lora-backend`, `--attention-backend` choose).
Targets: multi-LoRA >= 0.8x base-only and >= 4x PEFT. Prints one table and rewrites
bench/results/lora.md. Never a test assertion.

A quantized base (`--model-dir` holding GGUF blocks, `tessera models import --keep-quantized`; issue
35's target: 8 adapters r16 >= 0.9x base) is served with `--quant-mode` (default fast); the adapters
and the PEFT anchor use `--reference-model-dir`, the float checkpoint transformers loads (what
transformers makes of the GGUF: its dequantized weights); the table goes to lora-quantized.md.
`--lora-dtype bfloat16` serves the factors in bfloat16 (half the bytes per decode step); its table
goes to lora[-quantized]-lora-bfloat16.md.

`--dtype bfloat16` serves the model in bf16 (the decoder's `--dtype`; the adapters' factors follow the
model's dtype under `--lora-dtype auto`) and runs the PEFT anchor on a bf16 model; its table goes to
lora[-lora-DTYPE]-bfloat16[-batch1].md.

`--batch1` (issue 37's "8 adapters r16 >= 0.9x base at batch 1"): every mode sends its requests one at
a time (each decode step holds one row; multi-LoRA still cycles the requests over the K adapters, so
consecutive requests use different slots), the PEFT anchor generates one request at a time too; the
table goes to lora[-quantized][-lora-DTYPE]-batch1.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _decoder_proc import REPO, RESULTS, free_port, machine, start_decoder, stop

from services.common.launch import wait_serving

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROUNDS = 5


def make_adapters(model_dir: Path, root: Path, count: int, rank: int) -> list[str]:
    """root/lora{i}: PEFT adapters of rank `rank` on every projection, random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    names = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
        model.save_pretrained(root / f"lora{i}")
        names.append(f"lora{i}")
    return names


def start_registry(model_dir: Path, root: Path, rank: int) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port()}"
    log = (RESULTS / "lora-registry.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "services.adapters", "--address", address, "--root", str(root),
                                "--base-model-dir", str(model_dir), "--max-rank", str(rank)], cwd=REPO,
                               env={**os.environ, "TESSERA_ADMIN_TOKEN": ""}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_serving(address, process, 120.0, "registry", lambda: "see bench/results/lora-registry.log")
    except BaseException:
        process.kill()
        raise
    return process, address


async def _load(registry: str, names: list[str]) -> None:
    import grpc

    from tessera.v1 import adapters_pb2, adapters_pb2_grpc

    async with grpc.aio.insecure_channel(registry) as channel:
        stub = adapters_pb2_grpc.AdaptersStub(channel)
        for name in names:
            await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name=name, path=name))


async def _grpc_run(address: str, work: list[tuple[list[int], str]], max_tokens: int, batch1: bool = False) -> float:
    """Generated tokens/s of all requests sent at once, or one after another with `batch1` (each
    distinct adapter warmed up first)."""
    import grpc

    from tessera.v1 import decoder_pb2, decoder_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderStub(channel)

        async def one(prompt, lora, n):
            request = decoder_pb2.GenerateRequest(prompt_token_ids=prompt, lora=lora, sampling=decoder_pb2.SamplingParams(
                max_tokens=n, ignore_eos=True))
            return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=3600)])

        await asyncio.gather(*(one([5, 6, 7, 8], lora, 2) for lora in sorted({lora for _, lora in work})))
        start = time.perf_counter()
        if batch1:
            counts = [await one(p, lora, max_tokens) for p, lora in work]
        else:
            counts = await asyncio.gather(*(one(p, lora, max_tokens) for p, lora in work))
        return sum(counts) / (time.perf_counter() - start)


def peft_runner(model_dir: Path, root: Path, names: list[str], work, max_tokens: int, batch1: bool = False,
                dtype: torch.dtype = torch.float32):
    """PeftModel in process over the base model in `dtype`, loaded once; the returned callable runs, per
    adapter, one left-padded greedy batch of its requests (`batch1`: each request alone, in the work's
    order) and returns tokens/s."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval(),
                                      root / names[0],
                                      adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(root / name, adapter_name=name)
    model.eval()

    def batch(prompts):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=2)
        return (out.shape[1] - width) * len(prompts)

    model.set_adapter(names[0])
    batch([[5, 6, 7, 8]])  # warm-up

    def run() -> float:
        start, tokens = time.perf_counter(), 0
        if batch1:
            for prompt, name in work:
                model.set_adapter(name)
                tokens += batch([prompt])
            return tokens / (time.perf_counter() - start)
        for name in names:
            model.set_adapter(name)
            tokens += batch([p for p, lora in work if lora == name])
        return tokens / (time.perf_counter() - start)

    return run


def main(argv: list[str] | None = None) -> int:
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--lora-backend", choices=("cpu", "torch", "triton"), default="cpu",
                        help="the decoder's LoRA backend (default cpu: the C BGMV kernel for decode rows)")
    parser.add_argument("--attention-backend", choices=("cpu", "torch", "triton"), default="cpu",
                        help="the decoder's attention backend (default cpu: the C decode kernel)")
    parser.add_argument("--reference-model-dir", type=Path, default=None,
                        help="the float checkpoint transformers loads, for the adapters and the PEFT anchor, where "
                             "--model-dir holds GGUF blocks (default: --model-dir)")
    parser.add_argument("--quant-mode", choices=("exact", "fast"), default="fast",
                        help="the decoder's --quant-mode for a quantized --model-dir (default fast)")
    parser.add_argument("--lora-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the decoder's --lora-dtype (default auto: the model's; bfloat16 on a float32 or "
                             "quantized model halves the factor bytes; results go to a file of their own)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype: the decoder's --dtype and the PEFT anchor's (default float32; "
                             "bfloat16's results go to a file of their own)")
    parser.add_argument("--batch1", action="store_true",
                        help="send the requests one at a time (batch-1 decode); results go to a file of their own")
    args = parser.parse_args(argv)
    from services.decoder.model_llama import quantized_types

    quantized = sorted(set(quantized_types(args.model_dir).values()))
    if quantized and args.dtype != "float32":
        parser.error(f"--model-dir {args.model_dir} holds GGUF blocks, which run float32 activations: --dtype float32")
    if quantized and args.reference_model_dir is None:
        parser.error(f"--model-dir {args.model_dir} holds GGUF blocks ({'+'.join(quantized)}): give "
                     "--reference-model-dir, the float checkpoint transformers loads")
    reference = args.reference_model_dir or args.model_dir
    RESULTS.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="tessera-bench-lora-") as tmp:
        root = Path(tmp)
        names = make_adapters(reference, root, args.adapters, args.rank)
        work = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
        registry, registry_address = start_registry(args.model_dir, root, args.rank)
        try:
            asyncio.run(_load(registry_address, names))
            flags = ["--adapters-address", registry_address, "--adapter-slots", str(args.adapters),
                     "--max-lora-rank", str(args.rank), "--max-model-len", "1024", "--no-prefix-caching",
                     "--lora-backend", args.lora_backend, "--attention-backend", args.attention_backend,
                     "--lora-dtype", args.lora_dtype, "--dtype", args.dtype]
            if quantized:
                flags += ["--quant-mode", args.quant_mode]
            decoder, address = start_decoder(args.model_dir, flags, RESULTS / "lora-server.log")
            # This machine's speed drifts by 10-15% over minutes: three rounds, each running the PEFT
            # anchor (in this process, the decoder idle), base-only and multi-LoRA back to back; the
            # ratios are medians of the per-round ratios.
            try:
                peft_run = peft_runner(reference, root, names, work, args.max_tokens, args.batch1,
                                       getattr(torch, args.dtype))
                bases, multis, pefts = [], [], []
                for round_ in range(ROUNDS):
                    pefts.append(peft_run())
                    # base and multi alternate which runs first: neither always gets the warmer machine
                    for first in ((True, False) if round_ % 2 == 0 else (False, True)):
                        if first:
                            bases.append(asyncio.run(_grpc_run(address, [(p, "") for p in prompts], args.max_tokens,
                                                               args.batch1)))
                        else:
                            multis.append(asyncio.run(_grpc_run(address, work, args.max_tokens, args.batch1)))
            finally:
                stop(decoder)
        finally:
            stop(registry)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    base, multi, peft = median(bases), median(multis), median(pefts)
    vs_base = median([m / b for m, b in zip(multis, bases)])
    vs_peft = median([m / p for m, p in zip(multis, pefts)])
    runs = lambda values: ", ".join(f"{v:.1f}" for v in values)  # noqa: E731
    rows = [(f"base only (tessera, no adapter; rounds {runs(bases)})", base),
            (f"{args.adapters} adapters rank {args.rank} (tessera; rounds {runs(multis)})", multi),
            (f"PEFT in process, adapter switched per batch (anchor; rounds {runs(pefts)})", peft)]
    precision = (f"{'+'.join(quantized)} blocks, --quant-mode {args.quant_mode}" if quantized
                 else {"float32": "fp32", "bfloat16": "bf16"}[args.dtype])
    model = (f"model: {args.model_dir.name}, {precision}, lora backend {args.lora_backend}, "
             f"--lora-dtype {args.lora_dtype}, attention backend {args.attention_backend}")
    workload = (f"workload: {args.requests} {'requests one at a time' if args.batch1 else 'concurrent requests'}, "
                f"{args.prompt_len}-token random prompts, "
                f"{args.max_tokens} new tokens each (EOS ignored), round-robin over {args.adapters} adapters\n")
    lines = ["# bench lora\n", f"machine: {machine()}", model, workload,
             "| mode | generated tok/s (median of the rounds) |", "|---|---|"]
    if args.batch1:
        rows[2] = (f"PEFT in process, one request at a time (anchor; rounds {runs(pefts)})", peft)
    lines += [f"| {name} | {rate:.1f} |" for name, rate in rows]
    lines += ["", "ratios: median over the rounds of the round's own ratio",
              f"multi-LoRA / base-only: {vs_base:.2f}x (target >= {0.9 if quantized or args.batch1 else 0.8}x)",
              f"multi-LoRA / PEFT: {vs_peft:.2f}x ({'no target at batch 1' if args.batch1 else 'target >= 4x'})"]
    text = "\n".join(lines) + "\n"
    print(text)
    suffix = (("" if args.lora_dtype == "auto" else f"-lora-{args.lora_dtype}")
              + ("" if args.dtype == "float32" else f"-{args.dtype}") + ("-batch1" if args.batch1 else ""))
    (RESULTS / f"lora{'-quantized' if quantized else ''}{suffix}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
