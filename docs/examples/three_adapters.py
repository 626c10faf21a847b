"""Three LoRA adapters served at once: make three small PEFT adapters, load them into the
registry, and generate with each (and the base model) concurrently from one client.

    python docs/examples/three_adapters.py [--address localhost:50051] [--adapter-root DIR]

--adapter-root must be the registry's root (`tessera up --adapter-root`, default
$TESSERA_HOME/adapters): the registry loads only directories inside it. The adapters are random
(PEFT with init_lora_weights=False), so each one's answer differs from the base model's; a real
adapter comes from fine-tuning. Making them needs torch, transformers and peft; serving them
needs only the client.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tessera.client import Client

HOME = Path(os.environ.get("TESSERA_HOME", Path.home() / ".cache" / "tessera")).expanduser()
ADAPTERS = {"pirate": 1, "poet": 2, "terse": 3}  # name -> seed of its random weights


def make_adapters(base_model_dir: Path, root: Path) -> None:
    """Write one PEFT LoRA directory per name of ADAPTERS under `root` (rank 4 on q_proj and v_proj),
    each with its own random weights: one PEFT model, its LoRA matrices re-drawn per adapter."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    for name, seed in ADAPTERS.items():
        torch.manual_seed(seed)
        for path, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (".lora_A." in path or ".lora_B." in path):
                module.reset_parameters()  # nn.Linear's random init, as init_lora_weights=False leaves it
        model.save_pretrained(root / f"example-{name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("TESSERA_ADDRESS", "localhost:50051"))
    parser.add_argument("--adapter-root", type=Path, default=HOME / "adapters")
    parser.add_argument("--base-model-dir", type=Path, default=HOME / "models" / "smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    make_adapters(args.base_model_dir, args.adapter_root)

    messages = [{"role": "user", "content": "Describe the sea in one sentence."}]
    with Client(args.address, timeout=120) as client:
        for name in ADAPTERS:  # relative to the registry's root
            info = client.load_adapter(name, f"example-{name}", replace=True)
            print(f"loaded {info.name}: rank {info.rank} on {len(info.target_modules)} modules, "
                  f"digest {info.digest[:12]}")
        print("registered:", ", ".join(sorted(a.name for a in client.list_adapters())))

        # One request per adapter plus one for the base model, all in flight together: the decoder
        # batches them in the same steps, each row with its own adapter.
        def ask(lora: str) -> str:
            return client.chat(messages, max_tokens=args.max_tokens, lora=lora).text.strip()

        names = ["", *ADAPTERS]
        with ThreadPoolExecutor(len(names)) as pool:
            answers = dict(zip(names, pool.map(ask, names)))
        for name, text in answers.items():
            print(f"{name or 'base'}: {text!r}")

        for name in ADAPTERS:
            client.unload_adapter(name)


if __name__ == "__main__":
    main()
