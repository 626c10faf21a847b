"""`tessera models export-gguf`: a prepared decoder checkpoint written as one GGUF file.

The file is what llama.cpp's `convert_hf_to_gguf.py` writes for the checkpoint's family
(`gguf_families.GGUF_FAMILIES`: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3,
Qwen2-MoE, Qwen3-MoE) with a GPT-2 style BPE tokenizer, so llama.cpp serves the same weights
tessera does:

- metadata `{arch}.*` from config.json (blocks, context, widths, heads, RoPE base, RMS epsilon,
  head and expert sizes, the family's soft-caps and windows), RoPE scaling where the format has
  keys for it (linear, yarn, longrope; llama3 as the `rope_freqs.weight` tensor, longrope's factors
  as `rope_factors_short/long.weight`), and `general.file_type`
  (ALL_F32, MOSTLY_BF16, MOSTLY_Q8_0, MOSTLY_Q4_0, MOSTLY_Q4_1);
- tensors named by gguf's own HF -> GGUF map (`blk.N.attn_q.weight`, `token_embd.weight`, ...);
  q/k projections permuted from HF's rotate-half RoPE layout to GGML's interleaved one for the
  llama architecture (the converter's `LlamaModel.permute`; transformers undoes it when it loads
  a GGUF); 1-D tensors and norms stay F32, matrices take the requested type (a quantized type
  quantized by the gguf package's own `quants.quantize`, as the converter does; a matrix whose rows
  are not whole blocks stays F32, as llama.cpp's quantizer falls back);
- tokenizer `gpt2` with the pre-tokenizer named by the converter's hash of its check text, the
  token list and types, merges, special ids and the chat template (gguf's `SpecialVocab`).

An unknown family, RoPE scaling or pre-tokenizer, or a sliding window narrower than the context in
a family whose format has no window key (Mistral as llama, Qwen2/Qwen3 and their MoE), raises
ValueError rather than writing a file llama.cpp would misread.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.cli.gguf_families import (
    EXPORTED_ROPE_TYPES,
    GGUF_FAMILIES,
    GgufFamily,
    add_rope_scaling,
    family_tensors,
    permute_for_ggml,
    rope_tensors,
    unkeyed_sliding_window,
)
from tessera.paths import DECODER_MODEL, models_dir, tessera_home

if TYPE_CHECKING:  # gguf, torch and numpy load on export only: `tessera` starts without them
    from collections.abc import Callable

    import gguf
    import numpy as np

__all__ = ["export_gguf", "permute_for_ggml"]

# outtype -> (gguf LlamaFileType, GGMLQuantizationType of the matrices)
OUTTYPES = {"f32": ("ALL_F32", "F32"), "bf16": ("MOSTLY_BF16", "BF16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0"),
            "q4_0": ("MOSTLY_Q4_0", "Q4_0"), "q4_1": ("MOSTLY_Q4_1", "Q4_1")}

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
    """`$TESSERA_HOME/gguf/<model dir name>-<OUTTYPE>.gguf` (e.g. SmolLM2-...-Q8_0.gguf)."""
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


def export_gguf(model_dir: Path, out: Path, outtype: str = "f32", pre_tokenizer: str | None = None,
                matrix_type: Callable[[str, np.ndarray], tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
                ) -> Path:
    """Write `model_dir` (config.json, *.safetensors, tokenizer files) as GGUF at `out`.

    Args:
        outtype: "f32" (every tensor float32), "bf16" (matrices bfloat16, norms float32), or
            "q8_0" / "q4_0" / "q4_1" (matrices quantized by `gguf.quants.quantize`, norms float32).
        matrix_type: (GGUF name, float32 matrix) -> (its bytes, their type), replacing `outtype`'s
            for the matrices: how a caller writes types the gguf package cannot quantize (K-quants,
            mixed files such as Q4_K_M); `general.file_type` still says `outtype`'s.
        pre_tokenizer: llama.cpp's name of the BPE pre-tokenizer (`tokenizer.ggml.pre`, e.g. "gpt-2"),
            for a tokenizer the converter's check-text hashes (PRE_TOKENIZER_BY_HASH) do not name.
    Raises:
        ValueError: an unknown outtype, a model_type not in GGUF_FAMILIES, a RoPE scaling type the
            format has no key for, a sliding window narrower than max_position_embeddings in a family
            written without a window key, or a pre-tokenizer this exporter cannot name.
    """
    import gguf

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}, got {outtype!r}")
    file_type = gguf.LlamaFileType[OUTTYPES[outtype][0]]
    default_type = gguf.GGMLQuantizationType[OUTTYPES[outtype][1]]
    config = json.loads((model_dir / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{model_dir}: config.json holds a JSON {type(config).__name__}, not an object")
    family = GGUF_FAMILIES.get(config.get("model_type", ""))
    if family is None:
        raise ValueError(f"{model_dir}: export-gguf writes model_type {', '.join(GGUF_FAMILIES)}; "
                         f"got {config.get('model_type')!r}")
    rope = _full_attention_rope(config)
    if rope["rope_type"] not in EXPORTED_ROPE_TYPES:
        raise ValueError(f"{model_dir}: RoPE scaling {rope['rope_type']!r} is not exported "
                         f"(exported: {', '.join(EXPORTED_ROPE_TYPES)})")
    arch = gguf.MODEL_ARCH[family.arch]
    _refuse_unkeyed_window(model_dir, family, gguf.MODEL_ARCH_NAMES[arch])
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(model_dir.name)
    _add_hparams(writer, config, rope, arch)
    family.extra_hparams(writer, config)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(writer, model_dir, config["vocab_size"], pre_tokenizer)
    for name, data in _tensors(model_dir, config, family, rope, arch):
        if data.ndim <= 1 or name.endswith("_norm.weight"):
            writer.add_tensor(name, data.astype("float32"), raw_dtype=gguf.GGMLQuantizationType.F32)
            continue
        if matrix_type is not None:
            raw, qtype = matrix_type(name, data)
        else:
            qtype = default_type
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if data.shape[-1] % block:  # rows that are not whole blocks: llama.cpp's quantizer keeps F32
                qtype = gguf.GGMLQuantizationType.F32
            raw = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _refuse_unkeyed_window(model_dir: Path, family: GgufFamily, arch_name: str) -> None:
    """ValueError where the checkpoint slides a window the family's GGUF cannot carry: llama.cpp would
    run full attention over the context, another model. config.json read as transformers reads it
    (Mistral's sliding_window defaults to 4096; Qwen's applies with use_sliding_window, per layer_types)."""
    if family.window_key:
        return
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    window = unkeyed_sliding_window(family, hf_config)
    if window is None:
        return
    switch = "use_sliding_window true, " if getattr(hf_config, "use_sliding_window", False) else ""
    raise ValueError(f"{model_dir}: {switch}sliding_window {window} (< max_position_embeddings "
                     f"{hf_config.max_position_embeddings}) is not exported: llama.cpp's {arch_name} architecture "
                     "has no sliding-window key, so the file would attend to the whole context")


def _full_attention_rope(config: dict) -> dict:
    """The full-attention layers' RoPE parameters (Gemma 3 keys them by layer type) with rope_type and
    rope_theta filled in, read as transformers 5 reads them (a legacy rope_scaling wins)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope = dict(rope.get("full_attention", rope))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return rope


def _add_hparams(writer: gguf.GGUFWriter, config: dict, rope: dict, arch: gguf.MODEL_ARCH) -> None:
    """TextModel.set_gguf_parameters' keys (and LlamaModel's vocab size and rotary width for llama)."""
    import gguf

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    add_rope_scaling(writer, rope, config["max_position_embeddings"])
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    experts = config.get("num_local_experts", config.get("num_experts"))
    if experts is not None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)


def _add_vocab(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int, pre_tokenizer: str | None) -> None:
    """The converter's `_set_vocab_gpt2`: tokens, types, pre-tokenizer, merges, special ids, template."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    digest = sha256(str(tokenizer.encode(PRE_TOKENIZER_CHECK_TEXT)).encode()).hexdigest()
    pre_tokenizer = pre_tokenizer or PRE_TOKENIZER_BY_HASH.get(digest)
    if pre_tokenizer is None:
        raise ValueError(f"{model_dir}: unknown BPE pre-tokenizer (check-text hash {digest}); "
                         "name it with --pre-tokenizer")
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
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)
    if vocab_size == 49152:  # the converter's rule for SmolLM/Granite-small vocabularies: no BOS
        writer.add_add_bos_token(False)


def _tensors(model_dir: Path, config: dict, family: GgufFamily, rope: dict, arch: gguf.MODEL_ARCH):
    """(GGUF name, float32 array) for every checkpoint tensor in the converter's layout
    (`family_tensors`), then the RoPE factor tensors of llama3 and longrope (`rope_tensors`)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    def checkpoint_tensors():
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for hf_name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    yield hf_name, handle.get_tensor(hf_name)

    name_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    try:
        for name, data in family_tensors(family, config, checkpoint_tensors(), name_map):
            yield name, np.ascontiguousarray(data.numpy())
    except ValueError as error:
        raise ValueError(f"{model_dir}: {error}") from None
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for name, data in rope_tensors(rope, head_dim):
        yield name, data.numpy()


def add_export_gguf_parser(models_sub) -> None:
    """`tessera models export-gguf [--model NAME | --dir DIR] [--outtype f32|bf16|q8_0|q4_0|q4_1] [--out PATH]`."""
    parser = models_sub.add_parser("export-gguf", help="write a prepared decoder checkpoint as GGUF (for llama.cpp)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help=f"a prepared model's name (default {DECODER_MODEL})")
    source.add_argument("--dir", default=None, help="a checkpoint directory instead of a prepared model (default: none, use --model)")
    parser.add_argument("--outtype", choices=sorted(OUTTYPES), default="f32",
                        help="matrix type (default f32; q8_0, q4_0 and q4_1 quantized as llama.cpp's converter does)")
    parser.add_argument("--pre-tokenizer", default=None,
                        help="llama.cpp's name of the BPE pre-tokenizer (e.g. gpt-2, llama-bpe, qwen2) when the "
                        "converter's hashes do not know the tokenizer (default: named by that hash)")
    parser.add_argument("--out", type=Path, default=None,
                        help="GGUF path (default $TESSERA_HOME/gguf/<model>-<OUTTYPE>.gguf)")
    parser.set_defaults(func=_export_gguf_command)


def _export_gguf_command(args) -> int:
    model_dir = resolve_model_dir(args.model, args.dir)
    out = export_gguf(model_dir, args.out or default_output(model_dir, args.outtype), args.outtype,
                      args.pre_tokenizer)
    print(f"[models] {model_dir.name}: wrote {out} ({out.stat().st_size / 2**20:.0f} MiB, {args.outtype.upper()})")
    return 0
