"""`tessera models export-gguf`: a prepared Llama-family decoder checkpoint written as one GGUF file.

The file is what llama.cpp's `convert_hf_to_gguf.py` writes for a `LlamaForCausalLM` with a GPT-2
style BPE tokenizer, so llama.cpp's `llama-server` serves the same weights tessera does:

- metadata `llama.*` from config.json (blocks, context, widths, heads, RoPE base and dimension,
  RMS epsilon, vocab size) and `general.file_type` (ALL_F32 or MOSTLY_BF16);
- tensors named by gguf's own HF -> GGUF map (`blk.N.attn_q.weight`, `token_embd.weight`, ...);
  q/k projections permuted from HF's rotate-half RoPE layout to GGML's interleaved one (the
  converter's `LlamaModel.permute`; transformers undoes it when it loads a GGUF); 1-D tensors and
  norms stay F32, matrices take the requested type;
- tokenizer `gpt2` with the pre-tokenizer named by the converter's hash of its check text, the
  token list and types, merges, special ids and the chat template (gguf's `SpecialVocab`).

Only what the prepared checkpoints need is covered: an unknown architecture, RoPE scaling or
pre-tokenizer raises ValueError rather than writing a file llama.cpp would misread.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.paths import DECODER_MODEL, models_dir, tessera_home

if TYPE_CHECKING:  # gguf, torch and numpy load on export only: `tessera` starts without them
    import gguf
    import torch

# outtype -> (gguf LlamaFileType, GGMLQuantizationType of the matrices)
OUTTYPES = {"f32": ("ALL_F32", "F32"), "bf16": ("MOSTLY_BF16", "BF16")}

# llama.cpp's check text for naming a BPE pre-tokenizer: sha256 of str(token ids) -> name
# (convert_hf_to_gguf.py get_vocab_base_pre; only the families tessera prepares)
PRE_TOKENIZER_CHECK_TEXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 '
    '3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
    '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
    '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
PRE_TOKENIZER_BY_HASH = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
}


def default_output(model_dir: Path, outtype: str) -> Path:
    """`$TESSERA_HOME/gguf/<model dir name>-<F32|BF16>.gguf`."""
    return tessera_home() / "gguf" / f"{model_dir.name}-{outtype.upper()}.gguf"


def resolve_model_dir(model: str | None, directory: str | None) -> Path:
    """`--dir` as given, else `--model` (default the decoder) under `$TESSERA_HOME/models`.

    Raises:
        FileNotFoundError: the directory has no config.json.
    """
    model_dir = Path(directory) if directory else models_dir() / (model or DECODER_MODEL)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a prepared checkpoint")
    return model_dir


def export_gguf(model_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """Write `model_dir` (config.json, *.safetensors, tokenizer files) as GGUF at `out`.

    Args:
        outtype: "f32" (every tensor float32) or "bf16" (matrices bfloat16, norms float32).
    Raises:
        ValueError: an unknown outtype, an architecture other than LlamaForCausalLM, RoPE scaling,
            or a pre-tokenizer this exporter cannot name.
    """
    import gguf

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}, got {outtype!r}")
    file_type = gguf.LlamaFileType[OUTTYPES[outtype][0]]
    matrix_type = gguf.GGMLQuantizationType[OUTTYPES[outtype][1]]
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"{model_dir}: export-gguf writes LlamaForCausalLM only, got {config.get('architectures')}")
    if not isinstance(config, dict):
        raise ValueError(f"{model_dir}: config.json holds a JSON {type(config).__name__}, not an object")
    from services.common.checkpoint import rope_settings  # here: the client commands import no service code

    rope_type, rope_theta = rope_settings(config)
    if rope_type != "default":
        raise ValueError(f"{model_dir}: RoPE scaling {rope_type!r} is not exported")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(model_dir.name)
    _add_hparams(writer, config, rope_theta)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(writer, model_dir, config["vocab_size"])
    for name, data in _tensors(model_dir, config):
        qtype = gguf.GGMLQuantizationType.F32 if data.ndim <= 1 or name.endswith("_norm.weight") else matrix_type
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_hparams(writer: gguf.GGUFWriter, config: dict, rope_theta: float) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)


def _add_vocab(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """The converter's `_set_vocab_gpt2`: tokens, types, pre-tokenizer, merges, special ids, template."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    digest = sha256(str(tokenizer.encode(PRE_TOKENIZER_CHECK_TEXT)).encode()).hexdigest()
    if digest not in PRE_TOKENIZER_BY_HASH:
        raise ValueError(f"{model_dir}: unknown BPE pre-tokenizer (check-text hash {digest})")
    id_to_token = {token_id: token for token, token_id in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    tokens, types = [], []
    for token_id in range(vocab_size):
        token = id_to_token.get(token_id)
        if token is None:
            tokens.append(f"[PAD{token_id}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            tokens.append(token)
            special = tokenizer.added_tokens_decoder[token_id].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER_BY_HASH[digest])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)
    if vocab_size == 49152:  # the converter's rule for SmolLM/Granite-small vocabularies: no BOS
        writer.add_add_bos_token(False)


def _tensors(model_dir: Path, config: dict):
    """(GGUF name, float32 array [out, in] or [n]) for every checkpoint tensor, q/k permuted."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads", num_heads)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for hf_name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue
                data = handle.get_tensor(hf_name).to(torch.float32)
                if hf_name.endswith("q_proj.weight"):
                    data = permute_for_ggml(data, num_heads)
                elif hf_name.endswith("k_proj.weight"):
                    data = permute_for_ggml(data, num_kv_heads)
                name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ValueError(f"{path}: no GGUF name for tensor {hf_name!r}")
                yield name, np.ascontiguousarray(data.numpy())


def permute_for_ggml(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[heads * head_dim, hidden] rows from rotate-half pairs (i, i + d/2) to adjacent pairs (2i, 2i + 1).

    llama.cpp's `LlamaModel.permute`:

        head rows  [x0 x1 .. x(d/2-1) | y0 y1 .. y(d/2-1)]  ->  [x0 y0 x1 y1 ..]
    """
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def add_export_gguf_parser(models_sub) -> None:
    """`tessera models export-gguf [--model NAME | --dir DIR] [--outtype f32|bf16] [--out PATH]`."""
    parser = models_sub.add_parser("export-gguf", help="write a prepared decoder checkpoint as GGUF (for llama.cpp)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help=f"a prepared model's name (default {DECODER_MODEL})")
    source.add_argument("--dir", default=None, help="a checkpoint directory instead of a prepared model (default: none, use --model)")
    parser.add_argument("--outtype", choices=sorted(OUTTYPES), default="f32", help="matrix type (default f32)")
    parser.add_argument("--out", type=Path, default=None,
                        help="GGUF path (default $TESSERA_HOME/gguf/<model>-<OUTTYPE>.gguf)")
    parser.set_defaults(func=_export_gguf_command)


def _export_gguf_command(args) -> int:
    model_dir = resolve_model_dir(args.model, args.dir)
    out = export_gguf(model_dir, args.out or default_output(model_dir, args.outtype), args.outtype)
    print(f"[models] {model_dir.name}: wrote {out} ({out.stat().st_size / 2**20:.0f} MiB, {args.outtype.upper()})")
    return 0
