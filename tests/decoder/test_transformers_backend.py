"""Causal LMs with no native file run transformers' own modeling code on tessera's paged KV cache:
greedy ids and fp32 logits equal transformers in every scheduling regime (GPT-NeoX: partial rotary,
parallel residual, no grouped-query attention whatever config.json's num_key_value_heads says;
Cohere: parallel block, LayerNorm, a logit scale in its head), a PEFT LoRA equals PEFT, a Llama
forced through this path equals transformers as the native path does, GPT-2's Conv1D projections
and learned positions, Gemma 2's windows and soft caps, and what is not a causal LM is refused in
one line."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from decoder_testing import make_tiny_llama
from family_conformance import PROMPTS, REGIMES, check_lora, check_regime, references
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, BertModel

from services.common.checkpoint import check_decoder_dir, decoder_impl
from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig
from services.decoder.convert import info_to_pb
from services.decoder.engine import start_engine
from services.decoder.model_transformers import TransformersForCausalLM
from services.decoder.models import load_model, model_sliding_window
from tessera.cli.client import cluster_rows
from tessera.cli.up import model_path_line
from tessera.cli.up.spec import ClusterSpec
from tessera.client import convert as client_convert
from tessera.v1 import gateway_pb2

NEW_TOKENS = 16
BASE_PROMPTS = PROMPTS[:3]  # 5, 40 and 70 tokens: 70 crosses two 32-token chunks
PREFIX_PROMPT = BASE_PROMPTS[-1][:64] + [4321, 77, 9000, 12, 5, 31000, 8, 400]  # shares 4 blocks of 16
_rng = random.Random(34)
CONCURRENT_PROMPTS = [[_rng.randrange(3, 49152) for _ in range(_rng.randrange(3, 40))] for _ in range(16)]
FAMILIES = {"gpt_neox": {}, "cohere": {"logit_scale": 0.5}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(model_dir, transformers' references for every prompt the regimes use) of a tiny checkpoint."""
    model_dir = make_tiny_llama(tmp_path_factory.mktemp(request.param), family=request.param,
                                **FAMILIES[request.param])
    prompts = BASE_PROMPTS + [PREFIX_PROMPT] + CONCURRENT_PROMPTS
    return model_dir, references(model_dir, prompts=prompts, new_tokens=NEW_TOKENS)


def _regime_options(regime: str) -> dict:
    """check_regime's arguments for these prompts: 16 at once for "concurrent"; for "preempt" a pool of
    17 blocks of 8: the three prompts take 15 (16 once the 40-token one has decoded a token, should
    the third arrive a step late), and with their 16 new tokens 21, so the scheduler must preempt."""
    if regime == "concurrent":
        return dict(prompts=CONCURRENT_PROMPTS, max_num_seqs=16)
    options = dict(prompts=BASE_PROMPTS, prefix_prompt=PREFIX_PROMPT)
    if regime == "preempt":
        options["num_blocks"] = 17
    return options


@pytest.mark.parametrize("regime", REGIMES)
def test_a_family_without_a_native_file_equals_transformers(family, regime):
    model_dir, refs = family
    assert decoder_impl(check_decoder_dir(model_dir)) == "transformers"
    check_regime(model_dir, refs, regime, new_tokens=NEW_TOKENS, **_regime_options(regime))


def test_the_kv_cache_takes_the_key_shape_the_layers_compute(family):
    model_dir, _ = family
    model = load_model(model_dir, torch.float32)
    assert isinstance(model, TransformersForCausalLM)
    config = json.loads((model_dir / "config.json").read_text())
    expected_kv_heads = 4 if config["model_type"] == "gpt_neox" else config["num_key_value_heads"]
    assert (model.spec.num_layers, model.spec.num_kv_heads, model.spec.head_dim) == (2, expected_kv_heads, 16)
    # a --kv-cache-memory-bytes budget is divided by the same block size, probed before any weight is read
    layout = DecoderConfig(model_dir=str(model_dir), kv_cache_memory_bytes=1 << 20, max_model_len=128).kv_block_layout()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, expected_kv_heads, 16)


@pytest.mark.parametrize("family", ["gpt_neox"], indirect=True)
def test_peft_lora_on_the_transformers_path_equals_peft(family):
    model_dir, _ = family  # GPT-NeoX's fused query_key_value and its MLP's output projection
    check_lora(model_dir, ["query_key_value", "dense_4h_to_h"], prompts=BASE_PROMPTS[:2], new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    return model_dir, references(model_dir, prompts=BASE_PROMPTS, new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_a_llama_forced_through_transformers_equals_the_native_path(llama, model_impl):
    model_dir, refs = llama
    assert DecoderConfig(model_dir=str(model_dir), model_impl=model_impl).model_impl == model_impl
    assert DecoderConfig(model_dir=str(model_dir)).model_impl == "native"  # auto: the family's own file
    # both paths equal transformers' greedy ids and logits (1e-4), so they equal each other
    check_regime(model_dir, refs, "chunked", prompts=BASE_PROMPTS, new_tokens=NEW_TOKENS, model_impl=model_impl)


def test_gpt2_conv1d_projections_and_learned_positions(tmp_path):
    """GPT-2: transformers' Conv1D projections (LoRA-capable, weights transposed), learned absolute
    positions past a prefix-cache hit, its context from n_positions (config.json has no
    max_position_embeddings), a PEFT LoRA on c_attn / c_proj."""
    model_dir = make_tiny_llama(tmp_path / "gpt2", family="gpt2")
    config = json.loads((model_dir / "config.json").read_text())
    assert "max_position_embeddings" not in config and config["n_positions"] == 512
    assert DecoderConfig(model_dir=str(model_dir)).max_model_len == 512
    refs = references(model_dir, prompts=BASE_PROMPTS + [PREFIX_PROMPT], new_tokens=NEW_TOKENS)
    check_regime(model_dir, refs, "prefix", prompts=BASE_PROMPTS, prefix_prompt=PREFIX_PROMPT, new_tokens=NEW_TOKENS)
    check_lora(model_dir, ["c_attn", "c_proj"], prompts=BASE_PROMPTS[:2], new_tokens=NEW_TOKENS)


def test_windowed_soft_capped_attention_through_transformers_equals_transformers(tmp_path):
    """Gemma 2's layers forced through this path: a 24-token sliding window on alternate layers, an
    attention soft cap and a final logit soft cap (in its own head), prompts past the window, chunked."""
    model_dir = make_tiny_llama(tmp_path / "gemma2", family="gemma2", sliding_window=24, attn_logit_softcapping=2.0,
                                final_logit_softcapping=3.0, query_pre_attn_scalar=16)
    refs = references(model_dir, prompts=BASE_PROMPTS, new_tokens=NEW_TOKENS)
    check_regime(model_dir, refs, "chunked", prompts=BASE_PROMPTS, new_tokens=NEW_TOKENS, model_impl="transformers")
    # its global layers attend fully: no block may be released before the window
    assert model_sliding_window(load_model(model_dir, torch.float32, model_impl="transformers")) is None


def test_the_native_path_never_imports_transformers_modeling_code(tmp_path):
    """A native model's decoder starts without transformers' modeling modules (~40 MB of resident
    set it would never run: PreTrainedModel, its losses, scipy): checked in a fresh process."""
    import subprocess
    import sys
    from pathlib import Path

    model_dir = make_tiny_llama(tmp_path / "llama")
    script = ("import sys\n"
              "from services.decoder.config import DecoderConfig\n"
              "from services.decoder.engine import start_engine\n"
              f"engine = start_engine(DecoderConfig(model_dir={str(model_dir)!r}, num_blocks=16))\n"
              "engine.shutdown()\n"
              "print('MODELING', 'transformers.modeling_utils' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=300)
    assert "MODELING False" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_a_window_every_layer_shares_releases_blocks_and_equals_transformers(tmp_path):
    """Starcoder2 (no native file) with a 24-token window on every layer: the scheduler releases
    blocks before the window, prompts past it, chunked, 16 at once, and a prefix-cache hit on blocks
    released before the window (they stay cached)."""
    model_dir = make_tiny_llama(tmp_path / "starcoder2", family="starcoder2", sliding_window=24)
    assert model_sliding_window(load_model(model_dir, torch.float32)) == 24
    refs = references(model_dir, prompts=BASE_PROMPTS + CONCURRENT_PROMPTS, new_tokens=NEW_TOKENS)
    check_regime(model_dir, refs, "chunked", prompts=BASE_PROMPTS, new_tokens=NEW_TOKENS)
    check_regime(model_dir, refs, "concurrent", new_tokens=NEW_TOKENS, **_regime_options("concurrent"))
    refs |= references(model_dir, prompts=[PREFIX_PROMPT], new_tokens=NEW_TOKENS)
    check_regime(model_dir, refs, "prefix", prompts=BASE_PROMPTS, prefix_prompt=PREFIX_PROMPT, new_tokens=NEW_TOKENS)


def test_tessera_up_and_info_name_the_path(llama, tmp_path):
    model_dir, _ = llama
    assert ClusterSpec(base_port=40000, decoder_model_dir=model_dir).model_impl == "native"
    forced = ClusterSpec(base_port=40000, decoder_model_dir=model_dir,
                         extra_args={"decoder": ["--model-impl", "transformers"]})
    assert model_path_line(forced) == ("LlamaForCausalLM (model_type 'llama') on transformers (transformers' own "
                                       "modeling code on tessera's paged KV cache)")
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), model_impl="transformers", num_blocks=16,
                                        max_model_len=128))
    try:
        info = engine.info()
    finally:
        engine.shutdown()
    assert info.model_impl == "transformers"
    message = gateway_pb2.ClusterInfo(decoder=info_to_pb(info))
    rows = dict(cluster_rows(client_convert.cluster_info(message), []))
    assert rows["model impl"] == "transformers (transformers' own modeling code on tessera's paged KV cache)"


def _config_dir(path, model_type: str, **fields):
    """A checkpoint directory check_decoder_dir reads: transformers' default config of `model_type`
    with `fields`, and empty weight and tokenizer files (only config.json is read)."""
    path.mkdir(parents=True)
    AutoConfig.for_model(model_type, **fields).save_pretrained(path)
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.mark.parametrize("model_type, architecture, message", [
    ("bert", "BertForMaskedLM", "holds architecture BertForMaskedLM (model_type 'bert'), not a supported decoder; "
                                "supported: LlamaForCausalLM (llama)"),
    ("t5", "T5ForConditionalGeneration", "holds architecture T5ForConditionalGeneration (model_type 't5'), not a "
                                         "supported decoder"),
    ("gpt_neox", "LlamaForCausalLM", "model_type 'gpt_neox' is not supported with it; transformers builds "
                                     "GPTNeoXForCausalLM for that model_type"),
])
def test_what_is_not_a_causal_lm_is_refused_in_one_line(tmp_path, model_type, architecture, message):
    directory = _config_dir(tmp_path / "model", model_type, architectures=[architecture])
    with pytest.raises(InvalidArgument) as refusal:
        check_decoder_dir(directory)
    text = str(refusal.value)
    assert text.startswith(f"decoder model dir {str(directory)!r} ") and message in text and "\n" not in text, text


def test_native_only_and_attention_interface_refusals(tmp_path):
    directory = _config_dir(tmp_path / "neox", "gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(InvalidArgument, match="has no native family"):
        check_decoder_dir(directory, "native")
    # StableLM's attention does not go through transformers' attention interface
    stablelm = _config_dir(tmp_path / "stablelm", "stablelm", architectures=["StableLmForCausalLM"])
    with pytest.raises(ValueError, match=r"^StableLmForCausalLM does not call transformers' attention interface"):
        load_model(stablelm, torch.float32)


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("neox") / "neox", family="gpt_neox")


def _edited(source, path, edit):
    """A copy of checkpoint `source` at `path` whose model.safetensors is `edit`(its tensors)."""
    directory = shutil.copytree(source, path)
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _refusal(call) -> str:
    with pytest.raises(ValueError) as refusal:
        call()
    text = str(refusal.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("name", ["gpt_neox.embed_in.weight", "gpt_neox.layers.1.attention.dense.weight"])
def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(neox, tmp_path, name):
    """transformers loads it with the tensor randomly initialised (it only logs a load report); the
    decoder refuses it in one line, as the native path does, through load_model and the engine."""
    directory = _edited(neox, tmp_path / "model", lambda tensors: tensors.pop(name))
    expected = f"weights in {directory} do not match GPTNeoXForCausalLM: missing [{name!r}] "
    text = _refusal(lambda: load_model(directory, torch.float32))
    assert text.startswith(expected) and "unexpected" not in text, text
    config = DecoderConfig(model_dir=str(directory), num_blocks=16, max_model_len=128)
    assert config.model_impl == "transformers"
    assert _refusal(lambda: start_engine(config)).startswith(expected)


def test_unexpected_and_reshaped_tensors_are_refused_naming_them(neox, tmp_path):
    def edit(tensors):
        tensors.pop("gpt_neox.final_layer_norm.bias")
        tensors["gpt_neox.layers.2.mlp.dense_h_to_4h.weight"] = torch.zeros(4, 4)  # a layer config.json lacks
        tensors["gpt_neox.layers.0.attention.dense.weight"] = torch.zeros(32, 64)

    directory = _edited(neox, tmp_path / "model", edit)
    assert _refusal(lambda: load_model(directory, torch.float32)) == (
        f"weights in {directory} do not match GPTNeoXForCausalLM: missing ['gpt_neox.final_layer_norm.bias'] "
        "(transformers would serve them randomly initialised); unexpected "
        "['gpt_neox.layers.2.mlp.dense_h_to_4h.weight']; gpt_neox.layers.0.attention.dense.weight has shape "
        "[32, 64] where config.json's sizes need [64, 64]")


def test_a_head_tied_to_the_embeddings_is_not_missing(tmp_path):
    """What transformers fills in by design is not refused: GPT-2's lm_head tied to its embeddings
    (tie_word_embeddings, no lm_head.weight in the file) and its non-persistent attention buffers."""
    directory = make_tiny_llama(tmp_path / "gpt2", family="gpt2", tie_word_embeddings=True)
    with safe_open(directory / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in set(weights.keys())
    model = load_model(directory, torch.float32)
    assert model.hf.lm_head.weight.data_ptr() == model.hf.get_input_embeddings().weight.data_ptr()


def test_an_encoder_named_as_its_lm_head_class_is_refused_for_its_missing_head(tmp_path):
    """BertLMHeadModel is in transformers' causal LM mapping, so the path takes a config naming it;
    a BERT encoder's weights (no prediction head) are refused in one line, not served with a random head."""
    bert = AutoConfig.for_model("bert", vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128)
    directory = tmp_path / "bert"
    BertModel(bert).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["BertLMHeadModel"]}))
    (directory / "tokenizer.json").write_text("{}")
    assert decoder_impl(check_decoder_dir(directory)) == "transformers"
    text = _refusal(lambda: load_model(directory, torch.float32))
    assert text.startswith(f"weights in {directory} do not match BertLMHeadModel: missing ['cls.predictions"), text
