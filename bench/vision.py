"""`tessera bench vision`: repeated-image request latency, encoder-cache hit vs miss (target >= 10x).

In process (a `VisionCore`, the servicer's core: byte caps, content hash, cache lookup, decode,
preprocess, encoder), one run:
  miss: N distinct images of the same size, each seen for the first time (decode + encoder);
  hit:  the same N images again (hash + cache lookup; no decode, no encoder).
Encoders: the demo tower, and a Qwen2-VL vision tower -- `--model-dir` (a real Qwen2-VL checkpoint)
or, by default, a seeded random one built here with transformers' config classes (depth 4,
embed 256, hidden 512) on 448x448 images (1024 patches -> 256 rows). Latency is per request of
one image. Decoder prefix cache, reported separately: an in-process LLMEngine on the same
checkpoint's language model; time to first token (max_tokens 1) of "text + image + text" with
each image seen for the first time (miss: full prefill) and then again (hit: every full block of
the prompt, image included, comes from the prefix cache). Image rows come from the vision engine
(already cached), so this half measures only the decoder. Writes bench/results/vision.md; never a
test assertion.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.encoder import DemoEncoderConfig
from services.vision.processor import ImageSource, ProcessorConfig
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig

REPO = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), python {platform.python_version()}")


def images(count: int, size: int) -> list[bytes]:
    out = []
    for seed in range(count):
        array = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def build_random_qwen2_vl(directory: Path) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=1, num_attention_heads=8,
                num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0})
    vision = dict(depth=4, embed_dim=256, hidden_size=512, num_heads=4, mlp_ratio=4, spatial_merge_size=2)
    torch.manual_seed(0)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                           vision_start_token_id=252, vision_end_token_id=253)
    Qwen2VLForConditionalGeneration(config).save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)


def char_tokenizer():
    """Character-level tokenizer for the random checkpoint (vocab 256): printable ASCII at ids 3..97,
    <|image_pad|> 250, <|vision_start|> 252, <|vision_end|> 253 as in its config.json."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): c - 29 for c in range(32, 127)}
    vocab.update({f"<|extra_{i}|>": i for i in range(98, 256)})
    vocab.update({"<|endoftext|>": 0, "<|im_end|>": 1, "<|im_start|>": 2, "<|image_pad|>": 250,
                  "<|vision_start|>": 252, "<|vision_end|>": 253})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                   additional_special_tokens=["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])


def measure(engine: VisionCore, data: list[bytes]) -> tuple[list[float], list[float]]:
    """(miss ms, hit ms) per single-image request; checks the hits really skipped the encoder."""
    def one(image: bytes) -> float:
        start = time.perf_counter()
        engine.encode(engine.process([ImageSource(data=image)]))
        return (time.perf_counter() - start) * 1000

    one(images(1, 64)[0] + b"warmup")  # PNG readers ignore trailing bytes; a distinct key warms the path
    before = engine.images_encoded
    misses = [one(image) for image in data]
    hits = [one(image) for image in data]
    if engine.images_encoded - before != len(data):
        raise RuntimeError("hits ran the encoder; the encoder cache is not working")
    return misses, hits


def decoder_prefix(model_dir: Path, vision: VisionCore, data: list[bytes]) -> tuple[list[float], list[float], int]:
    """(miss ms, hit ms, cached prompt tokens of the last hit) per single-image request, TTFT."""
    import asyncio

    from services.decoder.config import DecoderConfig
    from services.decoder.engine import start_engine
    from services.decoder.types import GenerateInput, ImagePart, SamplingParams, TextPart

    engine = start_engine(DecoderConfig(model_dir=str(model_dir), max_model_len=2048, num_blocks=1024))

    async def one(image: bytes) -> tuple[float, int]:
        e = vision.encode(vision.process([ImageSource(data=image)]))[0]
        request = GenerateInput(SamplingParams(max_tokens=1, ignore_eos=True), prompt=(
            TextPart("Describe this picture: "), ImagePart(e.rows, e.grid_thw, e.mrope_section, e.content_hash),
            TextPart(" in one sentence.")))
        start = time.perf_counter()
        async for out in engine.generate(request):
            last = out
        return (time.perf_counter() - start) * 1000, last.usage.cached_prompt_tokens

    try:
        asyncio.run(one(data[0] + b"warmup"))
        misses = [asyncio.run(one(image))[0] for image in data]
        hits = [asyncio.run(one(image)) for image in data]
    finally:
        engine.shutdown()
    return misses, [ms for ms, _ in hits], hits[-1][1]


def row(name: str, detail: str, misses: list[float], hits: list[float]) -> str:
    miss, hit = statistics.median(misses), statistics.median(hits)
    return f"| {name} | {detail} | {miss:.2f} | {hit:.3f} | {miss / hit:.0f}x |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera bench vision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a Qwen2-VL checkpoint (default: random, built here)")
    parser.add_argument("--images", type=int, default=8, help="distinct images, each sent twice (default %(default)s)")
    parser.add_argument("--size", type=int, default=448, help="image side in pixels (default %(default)s)")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "vision.md")
    args = parser.parse_args(argv)
    data = images(args.images, args.size)
    lines = []
    demo = VisionCore(VisionConfig(encoder=DemoEncoderConfig(output_width=576)))
    lines.append(row("demo", "64x64 after resize, 64 rows x 576", *measure(demo, data)))
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or Path(scratch)
        if args.model_dir is None:
            build_random_qwen2_vl(model_dir)
        config = VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(model_dir)), ProcessorConfig())
        qwen = VisionCore(config)
        misses, hits = measure(qwen, data)
        grid = qwen.encode(qwen.process([ImageSource(data=data[0])]))[0].grid_thw
        name = model_dir.name if args.model_dir else "qwen2-vl (random: depth 4, embed 256)"
        lines.append(row(name, f"grid {grid}, {grid[1] * grid[2]} rows x {qwen.encoder.output_width}", misses, hits))
        d_misses, d_hits, cached = decoder_prefix(model_dir, qwen, data)
    decoder = row(name, f"{grid[1] * grid[2]} image tokens, {cached} prompt tokens cached on a hit", d_misses, d_hits)
    table = "\n".join(["| encoder | image | miss p50 ms | hit p50 ms | miss/hit |", "|---|---|---|---|---|", *lines])
    text = (f"# tessera bench vision\n\nMachine: {machine()}\n\n"
            f"Encoder cache, in-process VisionCore; {args.images} distinct {args.size}x{args.size} PNGs, each sent "
            "once (miss: decode + preprocess + encoder) then again (hit: content hash + cache lookup). "
            "Target: miss/hit >= 10x.\n\n" + table + "\n\n"
            "Decoder prefix cache, in-process LLMEngine (the checkpoint's language model, fp32): time to first "
            "token of text + image + text, each image first seen (miss: full prefill) then again (hit: prompt "
            "blocks from the prefix cache).\n\n"
            "| model | prompt | miss p50 ms | hit p50 ms | miss/hit |\n|---|---|---|---|---|\n" + decoder + "\n")
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
