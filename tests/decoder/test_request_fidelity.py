"""Every sampling and rendering field a request sends changes the answer as its reference says:
top_k, min_p, min_tokens, stop_token_ids, ignore_eos, include_stop_str_in_output and
skip_special_tokens against transformers (generate, its logits, decode), the checkpoint's
generation_config.json defaults through the protobuf path the servicer takes, served model names,
and continue_final_message / chat_template_kwargs against `apply_chat_template` (tiny Llama with
SmolLM2's tokenizer)."""

import asyncio
import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from decoder_testing import TOKENIZER_FILES, hf_reference
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig
from services.decoder.convert import chat_options_from_pb, generate_from_pb, sampling_from_pb
from services.decoder.detokenizer import IncrementalDetokenizer
from services.decoder.engine import start_engine
from services.decoder.multimodal import PromptBuilder
from services.decoder.servicer import DecoderServicer
from services.decoder.tokens import tokenize
from services.decoder.types import (
    CHAT_TEMPLATE_ARGUMENTS,
    ChatMessage,
    ChatTemplateOptions,
    GenerateInput,
    SamplingParams,
    TextPart,
    TokenizeInput,
)
from tessera.v1 import decoder_pb2

PROMPT = tuple(range(300, 340))
IM_START = 1  # SmolLM2's <|im_start|>: a special token, not an EOS id


def _copy_checkpoint(source: Path, target: Path, model=None) -> Path:
    """`source`'s tokenizer files and config with its weights, or `model`'s when given."""
    target.mkdir(parents=True)
    for name in (*TOKENIZER_FILES, "config.json", "model.safetensors"):
        if (source / name).is_file() and not (model is not None and name == "model.safetensors"):
            shutil.copy(source / name, target / name)
    if model is not None:
        model.save_pretrained(target)
    return target


async def _collect(engine, request):
    return [out async for out in engine.generate(request)]


def _run(engine, prompt=PROMPT, **sampling):
    sampling.setdefault("max_tokens", 12)
    return asyncio.run(_collect(engine, GenerateInput(SamplingParams(**sampling), prompt_token_ids=tuple(prompt))))


def _ids(outputs):
    return [t for o in outputs for t in o.token_ids]


def _text(outputs):
    return "".join(o.text for o in outputs)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


@pytest.fixture(scope="module")
def greedy(hf_model):
    """transformers' greedy continuation of PROMPT (16 tokens)."""
    return hf_reference(hf_model, list(PROMPT), 16)[0]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512))
    yield engine
    engine.shutdown()


# ---- sampling filters ------------------------------------------------------------------------

def test_top_k_one_at_a_high_temperature_is_greedy(engine, greedy):
    hot = dict(temperature=1.5, seed=3)
    assert _ids(_run(engine, top_k=1, **hot)) == greedy[:12]
    assert _ids(_run(engine, **hot)) != greedy[:12]  # the same draw without top_k is not greedy
    assert _ids(_run(engine, top_k=-1, **hot)) == _ids(_run(engine, **hot))  # -1 = disabled, as vLLM


def test_min_p_keeps_only_tokens_near_the_most_likely(engine, greedy, hf_model):
    assert _ids(_run(engine, temperature=1.5, seed=3, min_p=1.0)) == greedy[:12]

    temperature, min_p = 2.0, 0.1

    def below_min_p(ids):
        """How many of `ids` have a probability under min_p x the most likely one's (transformers'
        logits after temperature, MinPLogitsWarper's rule)."""
        with torch.no_grad():
            logits = hf_model(torch.tensor([list(PROMPT) + ids])).logits[0, len(PROMPT) - 1:-1].float()
        probs = torch.softmax(logits / temperature, dim=-1)  # [len(ids), vocab]
        chosen = probs[torch.arange(len(ids)), torch.tensor(ids)]
        return int((chosen < min_p * probs.max(dim=-1).values * (1 - 1e-3)).sum())

    filtered = _ids(_run(engine, temperature=temperature, seed=5, min_p=min_p, max_tokens=16))
    unfiltered = _ids(_run(engine, temperature=temperature, seed=5, max_tokens=16))
    assert below_min_p(filtered) == 0
    assert below_min_p(unfiltered) > 0  # at this temperature the unfiltered draws do reach the tail


# ---- ending: stop ids, min_tokens, stop strings ----------------------------------------------

def test_min_tokens_masks_stop_token_ids_as_transformers_min_new_tokens(engine, greedy, hf_model):
    stop_id = greedy[1]
    early = _run(engine, stop_token_ids=(stop_id,))
    assert _ids(early) == greedy[:2] and early[-1].finish_reason == "stop"
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, min_new_tokens=4, eos_token_id=[2, stop_id])
    reference = out[0, len(PROMPT):].tolist()
    late = _run(engine, stop_token_ids=(stop_id,), min_tokens=4)
    assert _ids(late) == reference
    assert stop_id not in reference[:4] and len(reference) > 4


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token(engine, greedy, tokenizer):
    full = tokenizer.decode(greedy[:12], skip_special_tokens=True)
    assert _text(_run(engine)) == full
    stop = full[len(full) // 2:len(full) // 2 + 3]
    index = full.find(stop)
    assert _text(_run(engine, stop=(stop,))) == full[:index]
    kept = _run(engine, stop=(stop,), include_stop_str_in_output=True)
    assert _text(kept) == full[:index + len(stop)] and kept[-1].finish_reason == "stop"

    stop_id = greedy[3]
    assert _text(_run(engine, stop_token_ids=(stop_id,))) == tokenizer.decode(greedy[:3])
    with_id = _run(engine, stop_token_ids=(stop_id,), include_stop_str_in_output=True)
    assert _text(with_id) == tokenizer.decode(greedy[:4]) and _ids(with_id) == greedy[:4]


def test_min_tokens_holds_back_stop_strings(engine, greedy, tokenizer):
    first = tokenizer.decode(greedy[:1])
    assert _text(_run(engine, stop=(first,))) == ""  # the first token's text stops at once
    late = _run(engine, stop=(first,), min_tokens=3, max_tokens=6)
    assert _ids(late) == greedy[:6] and late[-1].finish_reason == "length"


def test_spaces_between_special_tokens_reaches_decode(tokenizer):
    """transformers' fast tokenizers ignore it (only slow ones act on it, as vLLM documents); the
    detokenizer hands it to decode with skip_special_tokens."""
    seen = []

    class Recording:
        def decode(self, ids, **options):
            seen.append(options)
            return tokenizer.decode(ids, **options)

    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    detokenizer = IncrementalDetokenizer(Recording(), [5, 6], params)
    detokenizer.add(IM_START)
    assert detokenizer.delta(final=True) == "<|im_start|>"
    assert seen and all(o == {"skip_special_tokens": False, "spaces_between_special_tokens": False} for o in seen)


@pytest.fixture(scope="module")
def special_dir(tiny_llama, hf_model, greedy, tmp_path_factory):
    """The tiny model with <|im_start|>'s output row 1.5 x that of PROMPT's first greedy token, so
    greedy emits the special token first."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        model.lm_head.weight[IM_START] = 1.5 * model.lm_head.weight[greedy[0]]
    return _copy_checkpoint(tiny_llama, tmp_path_factory.mktemp("special") / "model", model)


def test_skip_special_tokens_false_keeps_special_tokens_in_text(special_dir, tokenizer):
    reference = hf_reference(AutoModelForCausalLM.from_pretrained(special_dir).eval(), list(PROMPT), 8)[0]
    assert reference[0] == IM_START
    engine = start_engine(DecoderConfig(model_dir=str(special_dir), num_blocks=64, max_model_len=512))
    try:
        kept = _run(engine, max_tokens=8, skip_special_tokens=False)
        skipped = _run(engine, max_tokens=8)
    finally:
        engine.shutdown()
    assert _ids(kept) == _ids(skipped) == reference
    assert _text(kept) == tokenizer.decode(reference, skip_special_tokens=False)
    assert _text(kept).startswith("<|im_start|>")
    assert _text(skipped) == tokenizer.decode(reference, skip_special_tokens=True) != _text(kept)


# ---- the checkpoint's generation_config.json, EOS ids, served names ---------------------------

GENERATION_CONFIG = {"temperature": 0.01, "top_k": 1, "max_new_tokens": 6, "do_sample": True}


@pytest.fixture(scope="module")
def defaults_dir(tiny_llama, greedy, tmp_path_factory):
    """The tiny model whose generation_config.json has sampling defaults and the third greedy token
    of PROMPT as a second EOS id."""
    target = _copy_checkpoint(tiny_llama, tmp_path_factory.mktemp("defaults") / "model")
    (target / "generation_config.json").write_text(json.dumps({**GENERATION_CONFIG, "eos_token_id": [2, greedy[2]]}))
    return target


@pytest.fixture(scope="module")
def defaults_engine(defaults_dir):
    engine = start_engine(DecoderConfig(model_dir=str(defaults_dir), num_blocks=64, max_model_len=512,
                                        served_model_name=("alpha", "beta")))
    yield engine
    engine.shutdown()


def _generate_pb(engine, **sampling):
    """Generate through the servicer (protobuf in, the engine's defaults, protobuf out)."""
    request = decoder_pb2.GenerateRequest(prompt_token_ids=list(PROMPT), sampling=decoder_pb2.SamplingParams(**sampling))

    async def run():
        return [r async for r in DecoderServicer(engine).Generate(request, None)]

    return asyncio.run(run())


def test_generation_config_fills_the_fields_a_request_leaves_unset(defaults_engine, greedy):
    # temperature 0.01 with top_k 1: greedy; max_new_tokens 6: the length
    unset = _generate_pb(defaults_engine, ignore_eos=True)
    assert _ids(unset) == greedy[:6] and unset[-1].finish_reason == "length"
    # the HTTP API's default_temperature gives way to the model's temperature
    assert _ids(_generate_pb(defaults_engine, ignore_eos=True, default_temperature=1.0)) == greedy[:6]
    # fields the request sets win
    sampled = _generate_pb(defaults_engine, ignore_eos=True, temperature=1.0, top_k=0, seed=3, max_tokens=8)
    assert len(_ids(sampled)) == 8 and _ids(sampled) != greedy[:8]
    params = sampling_from_pb(decoder_pb2.SamplingParams(top_p=0.5), defaults_engine.config.generation_defaults)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.max_tokens) == (0.01, 1, 0.5, 0.0, None)


def test_generation_config_vllm_and_a_directory(defaults_dir, tiny_llama):
    vllm = DecoderConfig(model_dir=str(defaults_dir), generation_config="vllm").generation_defaults
    params = sampling_from_pb(decoder_pb2.SamplingParams(default_temperature=1.0), vllm)
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 0, None)
    assert sampling_from_pb(decoder_pb2.SamplingParams(), vllm).temperature == 0.0  # gRPC's neutral: greedy
    elsewhere = DecoderConfig(model_dir=str(tiny_llama), generation_config=str(defaults_dir)).generation_defaults
    assert elsewhere.as_dict() == {"temperature": 0.01, "top_k": 1.0, "max_tokens": 6.0}
    assert DecoderConfig(model_dir=str(tiny_llama)).generation_defaults.as_dict() == {}  # auto, no file


def test_eos_ids_ignore_eos_and_min_tokens(defaults_engine, defaults_dir, greedy, hf_model, tokenizer):
    stopped = _generate_pb(defaults_engine, max_tokens=8)
    assert _ids(stopped) == greedy[:3] and stopped[-1].finish_reason == "stop"
    assert _text(stopped) == tokenizer.decode(greedy[:2])  # the EOS id's text is not returned
    ignored = _generate_pb(defaults_engine, max_tokens=8, ignore_eos=True)
    assert _ids(ignored) == greedy[:8] and ignored[-1].finish_reason == "length"
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                max_new_tokens=8, do_sample=False, min_new_tokens=5, eos_token_id=[2, greedy[2]])
    reference = out[0, len(PROMPT):].tolist()
    assert _ids(_generate_pb(defaults_engine, max_tokens=8, min_tokens=5)) == reference != greedy[:8]
    # even with ignore_eos the EOS ids are masked before min_tokens (vLLM's all_stop_token_ids)
    assert greedy[2] not in _ids(_generate_pb(defaults_engine, max_tokens=5, min_tokens=5, ignore_eos=True))


def test_served_names_and_defaults_in_info_and_tokenize(defaults_engine):
    servicer = DecoderServicer(defaults_engine)
    info = asyncio.run(servicer.GetInfo(decoder_pb2.DecoderInfoRequest(), None))
    assert info.model == "alpha" and list(info.served_model_names) == ["alpha", "beta"]
    assert info.generation_config == "auto"
    assert dict(info.generation_defaults) == {"temperature": pytest.approx(0.01), "top_k": 1.0, "max_tokens": 6.0}
    reply = asyncio.run(servicer.Tokenize(decoder_pb2.DecoderTokenizeRequest(text="hi"), None))
    assert reply.model == "alpha"
    assert defaults_engine.metrics.model_name == "alpha"


# ---- chat template options -------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital is"}]
# reads two variables beyond the conversation: `documents` (apply_chat_template's own) and `enable_thinking`
TEMPLATE = ("{% for d in documents or [] %}<doc>{{ d.text }}</doc>\n{% endfor %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
            "{% endif %}")


def _messages(messages) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(m["role"], (TextPart(m["content"]),), m.get("name", "")) for m in messages)


def _both_ways(tokenizer, messages, options: ChatTemplateOptions) -> list[int]:
    """The ids Generate's prompt builder and Tokenize give `messages`; they must agree."""
    built = PromptBuilder(tokenizer, len(tokenizer), 64, None, None).build(
        GenerateInput(SamplingParams(), messages=_messages(messages), chat=options)).token_ids
    counted = tokenize(tokenizer, TokenizeInput(messages=_messages(messages), chat=options))
    assert list(built) == counted
    return counted


def test_continue_final_message_equals_apply_chat_template(tokenizer):
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=True, continue_final_message=True)["input_ids"]
    assert _both_ways(tokenizer, MESSAGES, options) == expected
    closed = tokenizer.apply_chat_template(MESSAGES, tokenize=True)["input_ids"]
    assert expected != closed and closed[:len(expected)] == expected  # the turn is left open
    with pytest.raises(InvalidArgument, match="must be the assistant's"):
        _both_ways(tokenizer, MESSAGES[:2], options)


def test_chat_template_kwargs_reach_the_template(tokenizer):
    custom = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    custom.chat_template = TEMPLATE
    kwargs = {"enable_thinking": True, "documents": [{"title": "atlas", "text": "Paris is in France."}]}
    expected = custom.apply_chat_template(MESSAGES[:2], tokenize=True, add_generation_prompt=True, **kwargs)["input_ids"]
    assert _both_ways(custom, MESSAGES[:2], ChatTemplateOptions(template_kwargs=kwargs)) == expected
    plain = custom.apply_chat_template(MESSAGES[:2], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert _both_ways(custom, MESSAGES[:2], ChatTemplateOptions()) == plain != expected
    assert "<think>" in custom.decode(expected) and "<doc>Paris is in France.</doc>" in custom.decode(expected)


def test_a_message_name_reaches_the_template_as_transformers_gives_it(tokenizer):
    custom = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    custom.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}"
                            "\n{{ m.content }}<|im_end|>\n{% endfor %}")
    named = [{"role": "user", "content": "Hello", "name": "ada"}, {"role": "user", "content": "Hi"}]
    expected = custom.apply_chat_template(named, tokenize=True, add_generation_prompt=False)["input_ids"]
    options = ChatTemplateOptions(add_generation_prompt=False)
    assert _both_ways(custom, named, options) == expected
    assert "user ada" in custom.decode(expected)
    wire = decoder_pb2.ChatMessage(role="user", content=[decoder_pb2.ContentPart(text="Hello")], name="ada")
    assert generate_from_pb(decoder_pb2.GenerateRequest(messages=[wire])).messages[0].name == "ada"


def _chat_request(**fields) -> decoder_pb2.GenerateRequest:
    return decoder_pb2.GenerateRequest(messages=[decoder_pb2.ChatMessage(
        role="user", content=[decoder_pb2.ContentPart(text="hi")])], **fields)


def test_chat_options_from_the_wire_and_their_refusals(tokenizer):
    assert chat_options_from_pb(_chat_request()) == ChatTemplateOptions()
    assert chat_options_from_pb(_chat_request(continue_final_message=True)) == ChatTemplateOptions(False, True)
    assert chat_options_from_pb(_chat_request(chat_template_kwargs='{"enable_thinking": false}')).template_kwargs == {
        "enable_thinking": False}
    for fields, words in [
        (dict(add_generation_prompt=True, continue_final_message=True), "cannot both be true"),
        (dict(chat_template_kwargs="{not json"), "not JSON"),
        (dict(chat_template_kwargs="[1, 2]"), "JSON object, got a JSON list"),
        (dict(chat_template_kwargs='{"a": NaN}'), "NaN is not a JSON value"),  # Python's json reads it; JSON does not
        (dict(chat_template_kwargs='{"a": [-Infinity]}'), "-Infinity is not a JSON value"),
        (dict(chat_template_kwargs='{"tokenize": false}'), "'tokenize' is refused"),
        (dict(chat_template_kwargs='{"tools": []}'), "own .tools. field"),
    ]:
        with pytest.raises(InvalidArgument, match=words) as refused:
            chat_options_from_pb(_chat_request(**fields))
        assert refused.value.field == next(iter(fields)), fields  # the field to blame, as data
    with pytest.raises(InvalidArgument, match="messages only"):
        tokenize(tokenizer, TokenizeInput(text="hi", chat=ChatTemplateOptions(template_kwargs={"x": 1})))
    # every argument of the installed apply_chat_template but `documents` is refused as a template variable
    arguments = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"documents", "kwargs"}
    assert arguments <= CHAT_TEMPLATE_ARGUMENTS


def test_sampling_fields_are_validated_naming_the_limit():
    for fields, words in [(dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
                          (dict(min_tokens=-1), "min_tokens must be >= 0"),
                          (dict(max_tokens=4, min_tokens=5), "min_tokens must be <= max_tokens (4), got 5"),
                          (dict(top_k=-2), "top_k must be >= 0"),
                          (dict(prompt_logprobs=21), "prompt_logprobs must be in [0, 20]")]:
        with pytest.raises(InvalidArgument, match=re.escape(words)) as refused:
            SamplingParams(**fields)
        assert refused.value.field == words.split()[0]
        with pytest.raises(InvalidArgument) as refused:  # the protobuf's path of the field to blame
            sampling_from_pb(decoder_pb2.SamplingParams(**fields))
        assert refused.value.field == f"sampling.{words.split()[0]}"
    params = sampling_from_pb(decoder_pb2.SamplingParams(min_p=0.2, min_tokens=3, include_stop_str_in_output=True,
                                                         skip_special_tokens=False, prompt_logprobs=0))
    assert (params.min_p, params.min_tokens, params.include_stop_str_in_output, params.skip_special_tokens,
            params.spaces_between_special_tokens, params.prompt_logprobs) == (pytest.approx(0.2), 3, True, False,
                                                                              True, 0)
