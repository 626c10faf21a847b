"""`tessera models import FILE.gguf` for each family llama.cpp's converter writes and transformers reads.

Each family: a tiny seeded checkpoint built by transformers (a 384-token byte-level BPE trained here,
so the GGUF's vocabulary parses in milliseconds), written as GGUF by `tessera models export-gguf`
(llama.cpp's tensor names, layouts and metadata), imported with `tessera models import`. Then
(a) transformers loading the GGUF directly and (b) transformers loading the imported directory give
the source checkpoint's logits, and (c) where tessera's decoder has the family natively, it serves
the imported directory with transformers' greedy ids and logits. Families whose GGUF carries what
transformers' reader drops (llama3 / yarn / linear RoPE scaling, Qwen3's head_dim, Gemma's
soft-caps, Phi-3's partial rotary, MoE widths) check (a) with the config `gguf_config` completes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from services.common.checkpoint import check_decoder_dir
from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.models import MODEL_FAMILIES
from services.decoder.types import GenerateInput, SamplingParams
from tessera.cli.gguf_export import export_gguf
from tessera.cli.gguf_families import llama3_rope_factors
from tessera.cli.gguf_import import gguf_config, llama3_parameters
from tessera.cli.main import main
from tests.decoder.decoder_testing import check_greedy, hf_reference_batch

VOCAB = 384
PROMPTS = [[5, 77, 300, 12, 9, 150, 42, 8, 260, 33, 101, 7], [17, 250, 3, 64]]
NEW_TOKENS = 8
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# name -> (transformers model_type, config overrides, transformers' own GGUF reader gets the config right)
FAMILIES = {
    "llama": ("llama", dict(tie_word_embeddings=True), True),
    "llama3": ("llama", dict(rope_scaling=LLAMA3), False),
    "mistral": ("mistral", dict(sliding_window=None), True),
    "qwen2": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 128}), False),
    "qwen3": ("qwen3", dict(head_dim=32), False),
    "gemma2": ("gemma2", dict(tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=20.0,
                              final_logit_softcapping=15.0), False),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=8,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 1e4}}), False),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5), False),
    # a 12-token prompt is past the original 8 positions: transformers takes the long factors
    "phi3-longrope": ("phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                    "long_factor": [1.0, 4.0, 9.0, 20.0],
                                                    "original_max_position_embeddings": 8}), False),
    "qwen2moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=64), False),
    "qwen3moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True), False),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE of VOCAB tokens (GPT-2's pre-tokenizer) with bos 1, eos 2, trained on a short text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = ["The capital of France is Paris. Rivers run to the sea; models read tokens, one by one."] * 20
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(text, trainer)
    directory = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)
    return directory


def _checkpoint(path, tokenizer_dir, model_type: str, **overrides):
    """A random 2-layer `model_type` (hidden 64, 4 heads, 2 KV heads, head_dim 16) with the BPE above."""
    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    options.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **options)).eval()
    with torch.no_grad():  # decisive logits: no near-ties for greedy argmax
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.15)
            elif p.abs().sum() == 0:  # biases, Gemma's (1 + w) norm weights
                p.normal_(0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _imported(name, tmp_path_factory, tokenizer_dir, models_root, outtype="f32"):
    """(source dir, GGUF path, imported dir) of family `name`."""
    model_type, overrides, _ = FAMILIES[name]
    work = tmp_path_factory.mktemp(name)
    # not "mistral": transformers 5.24 takes a llama GGUF named exactly that for a gguf arch it cannot load
    source = _checkpoint(work / f"tiny-{name}", tokenizer_dir, model_type, **overrides)
    gguf_path = export_gguf(source, work / f"{name}.gguf", outtype, pre_tokenizer="gpt-2")
    assert main(["models", "import", str(gguf_path), "--name", name, "--dir", str(models_root)]) == 0
    return source, gguf_path, models_root / name


def _logits(model) -> torch.Tensor:
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        return model(ids).logits[0].float()


def _served(model_type: str, imported) -> bool:
    """Llama, Qwen2, Qwen3 always; a family whose native file has landed in MODEL_FAMILIES when the
    decoder accepts this configuration of it."""
    if model_type in ("llama", "mistral", "qwen2", "qwen3"):
        return True
    try:
        check_decoder_dir(imported)
    except InvalidArgument:
        return False
    return model_type in MODEL_FAMILIES


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_round_trip(name, tmp_path_factory, tokenizer_dir, models_root):
    model_type, _, transformers_reads_it = FAMILIES[name]
    source, gguf_path, imported = _imported(name, tmp_path_factory, tokenizer_dir, models_root)
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    expected = _logits(original)
    reread = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32).eval()
    assert reread.config.model_type == ("llama" if name == "mistral" else model_type)  # llama.cpp's llama arch
    torch.testing.assert_close(_logits(reread), expected, atol=1e-5, rtol=0)  # (b)
    greedy = [ids for ids, _ in hf_reference_batch(reread, PROMPTS, NEW_TOKENS)]
    assert greedy == [ids for ids, _ in hf_reference_batch(original, PROMPTS, NEW_TOKENS)]
    config = None if transformers_reads_it else gguf_config(gguf_path)
    direct = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, config=config,
                                                  dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(direct), expected, atol=1e-5, rtol=0)  # (a)
    tokens = AutoTokenizer.from_pretrained(imported).encode("The capital of France is Paris.")
    assert tokens == AutoTokenizer.from_pretrained(source).encode("The capital of France is Paris.")
    assert json.loads((imported / "gguf_source.json").read_text())["file_type"] == "F32"
    if _served(model_type, imported):  # (c) the decoder serves the import as transformers does
        refs = dict(zip(map(tuple, PROMPTS), hf_reference_batch(reread, PROMPTS, NEW_TOKENS)))
        engine = start_engine(DecoderConfig(model_dir=str(imported), num_blocks=16, max_model_len=64))
        try:
            requests = [GenerateInput(SamplingParams(max_tokens=NEW_TOKENS), request_id=f"r{i}",
                                      prompt_token_ids=tuple(p)) for i, p in enumerate(PROMPTS)]
            check_greedy(engine, refs, requests)
        finally:
            engine.shutdown()


def test_transformers_alone_misreads_what_the_import_completes(tmp_path_factory, tokenizer_dir):
    """Without `gguf_config`, transformers' reader drops Llama 3's RoPE scaling: other logits."""
    source, gguf_path, _ = _imported("llama3", tmp_path_factory, tokenizer_dir, tmp_path_factory.mktemp("alone"))
    plain = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    assert plain.config.rope_parameters["rope_type"] == "default"
    expected = _logits(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval())
    assert (_logits(plain.eval()) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("parameters", [
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 64},
    {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0, "original_max_position_embeddings": 1000},
])
@pytest.mark.parametrize("head_dim,theta", [(16, 10000.0), (64, 10000.0), (128, 500000.0)])
def test_llama3_divisors_give_back_the_same_frequencies(parameters, head_dim, theta):
    """`rope_freqs.weight` as the converter writes it -> llama3 parameters whose transformers
    inverse frequencies are the source's (the three numbers themselves are not all in the file)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": theta, **parameters}
    divisors = llama3_rope_factors(rope, head_dim).double().numpy()
    solved = llama3_parameters(divisors, theta, head_dim)
    assert solved["factor"] == parameters["factor"]

    def inv_freq(rope_parameters):
        config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                             max_position_embeddings=1 << 17, rope_parameters={"rope_theta": theta, **rope_parameters})
        return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]

    torch.testing.assert_close(inv_freq(solved), inv_freq(rope), rtol=1e-6, atol=0)
    assert llama3_parameters(np.ones(head_dim // 2), theta, head_dim) is None


def test_models_list_names_family_and_gguf_type(tmp_path_factory, tokenizer_dir, capsys):
    root = tmp_path_factory.mktemp("listed")
    _, _, imported = _imported("qwen3", tmp_path_factory, tokenizer_dir, root, outtype="bf16")
    capsys.readouterr()
    assert main(["models", "list", "--dir", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "FAMILY", "ARCHITECTURE", "PARAMS", "DTYPE", "GGUF", "PATH"]
    assert lines[1].split()[:3] == ["qwen3", "decoder", "qwen3"]
    assert lines[1].split()[3:] == ["Qwen3ForCausalLM", lines[1].split()[4], "float32", "BF16", str(imported)]


def test_import_refuses_an_architecture_transformers_cannot_read(tmp_path, capsys):
    import gguf

    path = tmp_path / "encoder.gguf"
    writer = gguf.GGUFWriter(path, "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["models", "import", str(path), "--dir", str(tmp_path / "models")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {str(path)!r}: transformers cannot load this GGUF: ") and "bert" in line
    assert not (tmp_path / "models" / "encoder").exists()


def test_import_refuses_a_mixtral_gguf(tmp_path, tokenizer_dir, capsys):
    """llama.cpp writes Mixtral as llama with stacked experts; transformers reads the file as a dense
    Llama whose MLP weights it cannot find: refused in one line, nothing written."""
    import gguf

    from tessera.cli.gguf_export import _add_vocab

    path = tmp_path / "tiny-mixtral.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 512),
                       (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2), (writer.add_rope_freq_base, 1e4),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_expert_count, 4),
                       (writer.add_expert_used_count, 2), (writer.add_vocab_size, VOCAB)):
        add(value)
    _add_vocab(writer, tokenizer_dir, VOCAB, "gpt-2")
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (VOCAB, 64), "output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,),
              "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64), "blk.0.attn_v.weight": (32, 64),
              "blk.0.attn_output.weight": (64, 64), "blk.0.ffn_norm.weight": (64,),
              "blk.0.ffn_gate_inp.weight": (4, 64), "blk.0.ffn_gate_exps.weight": (4, 128, 64),
              "blk.0.ffn_up_exps.weight": (4, 128, 64), "blk.0.ffn_down_exps.weight": (4, 64, 128)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.normal(0, 0.1, shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    capsys.readouterr()
    assert main(["models", "import", str(path), "--dir", str(tmp_path / "models")]) == 2
    # transformers' own load report precedes the refusal on stderr
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {str(path)!r}: transformers reads it as LlamaForCausalLM but finds no weights "
                           "for 3 of its tensors (model.layers.0.mlp.down_proj.weight, ...)")
    assert not (tmp_path / "models" / "tiny-mixtral").exists()


def test_export_refuses_what_llama_cpp_would_misread(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="export-gguf writes model_type llama, mistral, qwen2, .*; got 'gpt2'"):
        export_gguf(tmp_path, tmp_path / "x.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "rope_scaling": {
        "rope_type": "dynamic", "factor": 2.0}}))
    with pytest.raises(ValueError, match="RoPE scaling 'dynamic' is not exported"):
        export_gguf(tmp_path, tmp_path / "x.gguf")


# (model_type, config.json beside max_position_embeddings 512, the refused fields, llama.cpp's arch)
NARROW_WINDOWS = [
    ("mistral", dict(sliding_window=8), "sliding_window 8", "llama"),
    ("mistral", dict(max_position_embeddings=32768), "sliding_window 4096", "llama"),  # transformers' default
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, num_hidden_layers=2, max_window_layers=1),
     "use_sliding_window true, sliding_window 8", "qwen2"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, num_hidden_layers=2, max_window_layers=0),
     "use_sliding_window true, sliding_window 8", "qwen3"),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, num_hidden_layers=2),
     "use_sliding_window true, sliding_window 8", "qwen2moe"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window true, sliding_window 8",
     "qwen3moe"),
]


@pytest.mark.parametrize("model_type,overrides,fields,arch", NARROW_WINDOWS)
def test_export_refuses_a_sliding_window_the_format_has_no_key_for(model_type, overrides, fields, arch, tmp_path,
                                                                   capsys):
    """llama.cpp's llama (Mistral's), qwen2, qwen3 and their MoE architectures have no window key: the
    file would attend to the whole context, another model. Refused in one line before anything is written."""
    config = {"model_type": model_type, "max_position_embeddings": 512, **overrides}
    (tmp_path / "config.json").write_text(json.dumps(config))
    context = config["max_position_embeddings"]
    out = tmp_path / "out" / "x.gguf"
    with pytest.raises(ValueError, match=f"{fields} \\(< max_position_embeddings {context}\\) is not exported: "
                       f"llama.cpp's {arch} architecture has no sliding-window key"):
        export_gguf(tmp_path, out)
    capsys.readouterr()
    assert main(["models", "export-gguf", "--dir", str(tmp_path), "--out", str(out)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {tmp_path}: {fields} (< max_position_embeddings {context}) is not exported")
    assert not out.parent.exists()


@pytest.mark.parametrize("model_type,overrides", [
    ("mistral", dict(sliding_window=None)),
    ("mistral", dict(sliding_window=512)),  # as wide as the context: full attention
    ("mistral", dict(sliding_window=4096)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=8)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, num_hidden_layers=2, max_window_layers=2)),
    ("qwen3_moe", dict(use_sliding_window=False, sliding_window=8)),
    ("llama", dict(sliding_window=8)),  # transformers' Llama ignores it
    ("gemma2", dict(sliding_window=8)),  # these write {arch}.attention.sliding_window
    ("gemma3_text", dict(sliding_window=8)),
    ("phi3", dict(sliding_window=8)),
])
def test_export_refusal_spares_a_window_the_file_computes_as_the_checkpoint_does(model_type, overrides, tmp_path):
    from tessera.cli.gguf_families import GGUF_FAMILIES, unkeyed_sliding_window

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "max_position_embeddings": 512,
                                                      **overrides}))
    assert unkeyed_sliding_window(GGUF_FAMILIES[model_type], AutoConfig.from_pretrained(tmp_path)) is None


def test_export_refusal_spares_a_mistral_window_as_wide_as_the_context(tmp_path, tokenizer_dir):
    """sliding_window == max_position_embeddings is full attention: written as llama, the same logits."""
    source = _checkpoint(tmp_path / "tiny-wide", tokenizer_dir, "mistral", sliding_window=512)
    gguf_path = export_gguf(source, tmp_path / "wide.gguf", pre_tokenizer="gpt-2")
    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    expected = _logits(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval())
    torch.testing.assert_close(_logits(direct), expected, atol=1e-5, rtol=0)
