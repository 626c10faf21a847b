"""A user's own checkpoint: weights whose shapes config.json does not give are refused naming the
tensor; an index naming a shard outside the directory is refused; a tokenizer with tokens past the
model's embeddings, or a chat template that raises, refuses the one request (INVALID_ARGUMENT) instead
of an internal error that ended every request of its batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from decoder_testing import make_tiny_llama
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from services.common.checkpoint import CheckpointConfig
from services.common.errors import InvalidArgument
from services.decoder.model_llama import LlamaForCausalLM, load_checkpoint
from services.decoder.multimodal import PromptBuilder
from services.decoder.tokens import check_chat_template, tokenize
from services.decoder.types import ChatMessage, GenerateInput, SamplingParams, TextPart, TokenizeInput


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("own") / "tiny")


def _copy(tiny, tmp_path):
    return shutil.copytree(tiny, tmp_path / "model")


def test_a_weight_of_the_wrong_shape_is_named_with_both_shapes(tiny, tmp_path):
    """It was torch.cat's "Sizes of tensors must match" (the q/k/v fusion), naming no tensor."""
    directory = _copy(tiny, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:16].contiguous()
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^weights in .* do not match LlamaForCausalLM: {name} has shape "
                                         r"\[16, 64\]; config.json's sizes need \[32, 64\]$"):
        load_checkpoint(LlamaForCausalLM, CheckpointConfig.read(directory), torch.float32)


def test_a_vocabulary_the_embeddings_do_not_hold_is_named(tiny, tmp_path):
    directory = _copy(tiny, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": 50000}))
    with pytest.raises(ValueError, match=r"(lm_head|model.embed_tokens).weight has shape \[49152, 64\]; config.json's sizes "
                                         r"need \[50000, 64\]"):
        load_checkpoint(LlamaForCausalLM, CheckpointConfig.read(directory), torch.float32)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_an_index_naming_a_shard_outside_the_checkpoint_is_refused(tiny, tmp_path, shard):
    directory = _copy(tiny, tmp_path)
    (directory / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
    with pytest.raises(ValueError, match=rf"names shard '{shard}', which is not a file in "):
        load_checkpoint(LlamaForCausalLM, CheckpointConfig.read(directory), torch.float32)


def _builder(tokenizer) -> PromptBuilder:
    return PromptBuilder(tokenizer, 49152, 64, None, None)


def test_a_token_past_the_embeddings_refuses_the_request(tiny):
    """SmolLM2's tokenizer with one added token (id 49152: special tokens added without resizing the
    embeddings). The embedding lookup raised IndexError inside the step: every request of it ended."""
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.add_tokens(["<tool_call_x>"], special_tokens=True)
    builder = _builder(tokenizer)
    assert builder.build(GenerateInput(SamplingParams(), prompt=(TextPart("plain text"),))).token_ids
    for request in (GenerateInput(SamplingParams(), prompt=(TextPart("call <tool_call_x> now"),)),
                    GenerateInput(SamplingParams(), messages=(ChatMessage("user", (TextPart("<tool_call_x>"),)),))):
        with pytest.raises(InvalidArgument, match=r"^the prompt tokenizes to id 49152 \('<tool_call_x>'\), outside "
                                                  r"the model's vocabulary \[0, 49152\)"):
            builder.build(request)


def test_a_chat_template_that_raises_refuses_the_request_with_its_message(tiny):
    """transformers raises jinja2's TemplateError (raise_exception, an undefined name); it was an
    internal error that dropped the template's message. vLLM answers 400 with it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}"
                               "{{ raise_exception('system messages are not supported') }}{% endif %}"
                               "{{ m.content }}{% endfor %}")
    messages = (ChatMessage("system", (TextPart("be brief"),)), ChatMessage("user", (TextPart("hi"),)))
    expected = r"^the model's chat template refused the messages: system messages are not supported$"
    with pytest.raises(InvalidArgument, match=expected):
        _builder(tokenizer).build(GenerateInput(SamplingParams(), messages=messages))
    with pytest.raises(InvalidArgument, match=expected):
        tokenize(tokenizer, TokenizeInput(messages=messages))
    assert _builder(tokenizer).build(GenerateInput(SamplingParams(), messages=messages[1:])).token_ids


def test_a_chat_template_that_never_finishes_is_refused_at_start(tiny):
    """Nested range loops (the Jinja sandbox allows 100,000 per range): each chat request held a
    worker thread for ever, and after a few even plain prompts timed out while health said SERVING."""
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    check_chat_template(tokenizer, timeout_s=5)  # SmolLM2's own template
    # 20 M loop turns (~2 s here; the tester's 10^10 would spin in this process for hours), given 0.2 s
    tokenizer.chat_template = "{% for i in range(20000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ValueError, match=r"^the checkpoint's chat template did not render a 2-message conversation "
                                         r"within 0.2 s; every chat request would hang a worker$"):
        check_chat_template(tokenizer, timeout_s=0.2)
    tokenizer.chat_template = "{{ raise_exception('no system role') }}"
    check_chat_template(tokenizer, timeout_s=5)  # a refusal is left to the requests it refuses
