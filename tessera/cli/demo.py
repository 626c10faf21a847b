"""`tessera demo`: start the cluster, send one of each real request, stop it.

The image request uses the demo vision encoder, whose weights are seeded random: it proves the
plumbing (bytes -> rows -> placeholder expansion -> M-RoPE -> decoder), not image understanding.
The LoRA is random too (written in PEFT's on-disk format): it shows per-request adapters in one
base-model batch, not a trained skill.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file

from tessera.cli import client
from tessera.cli.up.launch import Cluster
from tessera.cli.up.spec import ClusterSpec
from tessera.client import SamplingParams

DEMO_ADAPTER = "demo-lora"


def write_random_lora(directory: Path, model_dir: Path, rank: int = 8, seed: int = 0) -> Path:
    """A PEFT-format LoRA on q_proj/v_proj of every layer, with small random A and B."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv_width = config["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, out in (("q_proj", config["num_attention_heads"] * head_dim), ("v_proj", kv_width)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) / hidden ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "lora_dropout": 0.0,
        "base_model_name_or_path": str(model_dir)}, indent=2))
    return directory


def _banner(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 60 - len(title)), flush=True)


def run_demo(spec: ClusterSpec | None = None) -> int:
    spec = spec or ClusterSpec()
    print("starting tessera (five services) ...", flush=True)
    with Cluster(spec) as cluster:
        address = cluster.spec.address("gateway")
        print(f"tessera is up: gateway at {address}", flush=True)
        gateway = client.connect(address)

        _banner("chat (SmolLM2-135M-Instruct, greedy)")
        question = "What is the capital of France? Answer in one sentence."
        print(f"> {question}")
        client.generate(gateway, question, chat=True, sampling=SamplingParams(max_tokens=48))

        _banner("embeddings (all-MiniLM-L6-v2)")
        client.embed(gateway, ["A cat sits on the mat.", "A kitten rests on a rug.", "Stocks fell sharply today.",
                            "The market dropped at the open."], as_json=False)

        _banner("rerank (bi-encoder cosine)")
        client.rerank(gateway, "What is the capital of France?", [
            "Bananas are a good source of potassium.", "Paris is the capital and largest city of France.",
            "The Eiffel Tower was finished in 1889.", "Mount Everest is the highest mountain."], None, False)

        _banner("image (demo encoder: random weights, plumbing only)")
        with tempfile.TemporaryDirectory() as tmp:
            image_path = Path(tmp) / "gradient.png"
            pixels = Image.linear_gradient("L").resize((96, 64)).convert("RGB")
            buffer = io.BytesIO()
            pixels.save(buffer, format="PNG")
            image_path.write_bytes(buffer.getvalue())
            result = client.generate(gateway, "Describe this image.", chat=True,
                                     sampling=SamplingParams(max_tokens=16), images=[image_path], as_json=True,
                                     out=io.StringIO())
            print(f"answer: {result.text!r}")
            print(f"prompt tokens {result.usage.prompt_tokens} of which image tokens {result.usage.image_tokens}")

        _banner("LoRA (random adapter in PEFT format, per-request)")
        write_random_lora(spec.adapter_root / DEMO_ADAPTER, spec.decoder_model_dir)
        client.adapters(gateway, "load", name=DEMO_ADAPTER, path=DEMO_ADAPTER, replace=True)
        client.adapters(gateway, "list")
        for lora in ("", DEMO_ADAPTER):
            print(f"[{lora or 'base model'}] ", end="")
            client.generate(gateway, "Name three fruits.", chat=True, sampling=SamplingParams(max_tokens=24),
                            lora=lora)
        client.adapters(gateway, "unload", name=DEMO_ADAPTER)
        gateway.close()
        print("\nstopping tessera", flush=True)
    print("done", flush=True)
    return 0
