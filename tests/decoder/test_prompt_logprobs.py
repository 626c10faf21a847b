"""Prompt logprobs computed in the prefill (equal to transformers' log_softmax of the same ids,
alone, chunked, after a prefix-cache hit, for n choices and through preemption), the prompt
returned with the first output, and each logprob token's text and exact bytes (tiny Llama with
SmolLM2's byte-level BPE tokenizer)."""

import asyncio

import pytest
import torch
from decoder_testing import run_requests
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from services.decoder import model_runner
from services.decoder.config import DecoderConfig
from services.decoder.convert import generate_from_pb, output_to_pb
from services.decoder.engine import start_engine
from services.decoder.token_text import TokenTexts
from services.decoder.types import GenerateInput, RequestOutput, Sample, SamplingParams, TextPart, TokenText
from tessera.v1 import decoder_pb2

TEXT = ("The list of animals: cat, dog, cat, dog, cat, dog, and then a horse, a cow, a sheep and "
        "a goat walked into the barn before the rain.")
NUM_TOP = 5


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompt_ids(engine) -> tuple[int, ...]:
    ids = tuple(engine.parts.tokenizer(TEXT)["input_ids"])
    assert len(ids) > 32  # two full 16-token blocks: a prefix-cache hit is possible
    return ids


def _reference(model, ids) -> torch.Tensor:
    """transformers' log_softmax of the fp32 logits at every prompt position [len(ids), vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_entries(entries: list[Sample], ids, ref: torch.Tensor, num_top: int = NUM_TOP) -> None:
    assert len(entries) == len(ids) - 1
    for j, entry in enumerate(entries):
        assert entry.token_id == ids[j + 1]
        assert entry.logprob == pytest.approx(float(ref[j, ids[j + 1]]), abs=1e-4)
        values, top_ids = torch.topk(ref[j], num_top)
        target = float(ref[j, ids[j + 1]])  # its rank: the tokens at least as likely (vLLM's), to the tolerance
        assert int((ref[j] >= target + 1e-4).sum()) <= entry.rank <= int((ref[j] >= target - 1e-4).sum())
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def _request(ids, request_id="r", **sampling):
    sampling.setdefault("max_tokens", 3)
    return GenerateInput(SamplingParams(**sampling), request_id=request_id, prompt_token_ids=tuple(ids))


def _outputs(engine, request) -> list[RequestOutput]:
    return _outputs_concurrently(engine, [request])[0]


def _outputs_concurrently(engine, requests) -> list[list[RequestOutput]]:
    """Every output of each of `requests`, submitted at once."""
    async def collect(request):
        return [out async for out in engine.generate(request)]

    async def main():
        return await asyncio.gather(*(collect(r) for r in requests))

    return asyncio.run(main())


def _first_of_each_choice(outputs: list[RequestOutput]) -> dict[int, RequestOutput]:
    first: dict[int, RequestOutput] = {}
    for out in outputs:
        first.setdefault(out.index, out)
    return first


def test_prompt_logprobs_equal_transformers_on_the_first_output_only(engine, hf_model, prompt_ids):
    outputs = _outputs(engine, _request(prompt_ids, prompt_logprobs=NUM_TOP, max_tokens=4))
    _check_entries(outputs[0].prompt_logprobs, prompt_ids, _reference(hf_model, prompt_ids))
    assert len(outputs) == 4 and all(out.prompt_logprobs is None for out in outputs[1:])
    assert outputs[0].prompt_token_ids is None and outputs[0].prompt_text is None  # return_prompt not asked


def test_prompt_logprobs_zero_gives_the_chosen_token_only_and_none_when_unset(engine, hf_model, prompt_ids):
    entries = _outputs(engine, _request(prompt_ids, prompt_logprobs=0))[0].prompt_logprobs
    _check_entries(entries, prompt_ids, _reference(hf_model, prompt_ids), num_top=0)
    assert all(entry.top == [] for entry in entries)
    assert _outputs(engine, _request(prompt_ids))[0].prompt_logprobs is None


def test_one_token_prompt_has_no_entry(engine):
    outputs = _outputs(engine, _request([400], prompt_logprobs=2, max_tokens=1))
    assert outputs[0].prompt_logprobs == [] and outputs[0].finish_reason == "length"


def test_chunked_prefill_in_slices_equals_transformers_and_projects_only_asking_rows(
        tiny_llama, hf_model, prompt_ids, monkeypatch):
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_ROWS", 4)
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512,
                                        max_num_batched_tokens=12, enable_prefix_caching=False))
    projected = []
    compute = engine.parts.runner.model.compute_logits
    engine.parts.runner.model.compute_logits = lambda rows: (projected.append(rows.shape[0]), compute(rows))[1]
    fused = engine.parts.runner.model.fused_decode
    if fused is not None:  # sampled rows: the fused step's one-call logits where they apply (FusedDecode.logits)
        fused_logits = fused.logits

        def counting(model, hidden):
            done = fused_logits(model, hidden)
            if done is not None:
                projected.append(hidden.shape[0])
            return done

        fused.logits = counting
    other = list(range(500, 530))
    try:
        results = run_requests(engine, [_request(prompt_ids, "asks", prompt_logprobs=NUM_TOP, max_tokens=1),
                                        _request(other, "plain", max_tokens=1)])
    finally:
        engine.shutdown()
    asks = results[0][2]  # its only (first and last) output
    _check_entries(asks.prompt_logprobs, prompt_ids, _reference(hf_model, prompt_ids))
    assert results[1][2].prompt_logprobs is None
    # every prompt row of the asking request once, in slices of at most 4, plus one sampled row each
    assert sum(projected) == len(prompt_ids) - 1 + 2 and max(projected) <= 4


def test_a_prefix_cache_hit_skips_no_asked_position_and_still_registers_blocks(engine, hf_model):
    ids = tuple(engine.parts.tokenizer(TEXT + " Then it rained on all of them.")["input_ids"])  # seen by no other test
    ref = _reference(hf_model, ids)
    first = _outputs(engine, _request(ids, "asks", prompt_logprobs=NUM_TOP))
    plain = _outputs(engine, _request(ids, "plain"))[-1]  # hits the blocks the asking request registered
    second = _outputs(engine, _request(ids, "asks again", prompt_logprobs=NUM_TOP))
    for outputs in (first, second):
        _check_entries(outputs[0].prompt_logprobs, ids, ref)
        assert outputs[-1].usage.cached_prompt_tokens == 0
    assert second[0].prompt_logprobs == first[0].prompt_logprobs
    assert plain.usage.cached_prompt_tokens == 32


def test_every_choice_gets_the_prompt_logprobs_and_later_choices_reuse_the_blocks(engine, hf_model, prompt_ids):
    sampling = SamplingParams(max_tokens=3, prompt_logprobs=NUM_TOP, n=3, temperature=1.0, seed=1)
    outputs = _outputs(engine, GenerateInput(sampling, prompt_token_ids=prompt_ids, return_prompt=True))
    first = _first_of_each_choice(outputs)
    assert sorted(first) == [0, 1, 2]
    ref = _reference(hf_model, prompt_ids)
    for out in first.values():
        _check_entries(out.prompt_logprobs, prompt_ids, ref)
        assert out.prompt_token_ids == list(prompt_ids)
    later = [out for out in outputs if out not in first.values()]
    assert later and all(out.prompt_logprobs is None and out.prompt_token_ids is None for out in later)
    finals = {out.index: out.usage for out in outputs if out.finish_reason is not None}
    assert finals[0].cached_prompt_tokens == 0 and finals[1].cached_prompt_tokens == finals[2].cached_prompt_tokens == 32


def test_preemption_recomputes_without_duplicating_entries(tiny_llama, hf_model):
    # 12 blocks of 8 tokens cannot hold four requests of 30 + 20 tokens (7 blocks each) at once
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=12, block_size=8, max_model_len=512,
                                        max_num_batched_tokens=16))
    preempted = []
    original = engine.parts.scheduler._preempt
    engine.parts.scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    prompts = [list(range(1000 + 40 * i, 1030 + 40 * i)) for i in range(4)]
    try:
        results = _outputs_concurrently(engine, [_request(p, f"r{i}", prompt_logprobs=2, max_tokens=20)
                                                 for i, p in enumerate(prompts)])
        assert engine.stats().num_free_blocks == 12
    finally:
        engine.shutdown()
    assert preempted, "the pool was meant to force preemption"
    for prompt, outputs in zip(prompts, results):
        assert sum(len(out.token_ids) for out in outputs) == 20
        _check_entries(outputs[0].prompt_logprobs, prompt, _reference(hf_model, prompt), num_top=2)


def test_return_prompt_gives_the_ids_and_text_special_tokens_kept(engine):
    text = "<|im_start|>user\nHello there<|im_end|>"
    outputs = _outputs(engine, GenerateInput(SamplingParams(max_tokens=2), prompt=(TextPart(text),),
                                             return_prompt=True))
    ids = engine.parts.tokenizer(text)["input_ids"]
    assert outputs[0].prompt_token_ids == ids and outputs[0].prompt_text == text
    assert ids[0] == engine.parts.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert outputs[1].prompt_token_ids is None and outputs[1].prompt_text is None


def test_token_texts_join_back_to_the_text_and_bytes_decode_to_it(engine, prompt_ids):
    outputs = _outputs(engine, _request(prompt_ids, prompt_logprobs=2, top_logprobs=3, max_tokens=12))
    first = outputs[0]
    texts = first.token_texts
    joined = engine.parts.tokenizer.decode(prompt_ids[:1]) + "".join(texts[e.token_id].text for e in first.prompt_logprobs)
    assert joined == TEXT
    for out in outputs:  # every id of the output's entries, chosen and alternatives, has its text
        for entry in (*out.logprobs, *(out.prompt_logprobs or ())):
            for token_id in (entry.token_id, *(t for t, _ in entry.top)):
                text = out.token_texts[token_id]
                assert text == TokenText(engine.parts.tokenizer.decode([token_id]), text.bytes)
                if "\ufffd" not in text.text:
                    assert text.bytes.decode() == text.text
    # the random model's tokens may split characters: their bytes still concatenate to the output
    generated = [t for out in outputs for t in out.token_ids]
    token_bytes = b"".join(out.token_texts[e.token_id].bytes for out in outputs for e in out.logprobs)
    assert token_bytes.decode("utf-8", errors="replace") == engine.parts.tokenizer.decode(generated)
    assert not _outputs(engine, _request(prompt_ids, max_tokens=2))[0].token_texts  # none asked: none computed


def test_a_character_split_across_tokens_gives_bytes_that_concatenate_to_its_utf8(engine):
    text = "x 你好😀é"
    ids = engine.parts.tokenizer(text)["input_ids"]
    first = _outputs(engine, _request(ids, prompt_logprobs=0, max_tokens=1))[0]
    pieces = [first.token_texts[e.token_id] for e in first.prompt_logprobs]
    assert any(piece.text == "\ufffd" for piece in pieces)  # some token holds part of a character
    assert engine.parts.tokenizer.decode(ids[:1]) == "x"
    assert b"".join(piece.bytes for piece in pieces) == text[1:].encode()


def test_byte_fallback_pieces_give_their_byte():
    vocab = {"<unk>": 0, "<0xE4>": 1, "<0xBD>": 2, "<0xA0>": 3, "a": 4}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    texts = TokenTexts(PreTrainedTokenizerFast(tokenizer_object=backend))
    assert b"".join(texts(i).bytes for i in (1, 2, 3)).decode() == "你"
    assert texts(4) == TokenText("a", b"a")


def test_the_wire_carries_prompt_fields_and_token_texts():
    entry = Sample(7, -0.5, [(7, -0.5), (9, -1.5)], rank=1)
    output = RequestOutput("r", [9], "b", logprobs=[Sample(9, -1.0, [(7, -0.4)])], prompt_logprobs=[entry],
                           prompt_token_ids=[3, 7], prompt_text="ab",
                           token_texts={7: TokenText("a", b"a"), 9: TokenText("\ufffd", b"\xe4")})
    pb = output_to_pb(output)
    assert list(pb.prompt_token_ids) == [3, 7] and pb.prompt_text == "ab"
    (prompt_entry,) = pb.prompt_logprobs
    assert (prompt_entry.token_id, prompt_entry.token, prompt_entry.token_bytes, prompt_entry.rank) == (7, "a", b"a", 1)
    assert pb.logprobs[0].rank == 0  # a sampled token's rank is not computed
    assert [(t.token_id, t.token, t.token_bytes) for t in prompt_entry.top] == [(7, "a", b"a"), (9, "\ufffd", b"\xe4")]
    assert (pb.logprobs[0].token, pb.logprobs[0].token_bytes, pb.logprobs[0].top[0].token) == ("\ufffd", b"\xe4", "a")
    plain = output_to_pb(RequestOutput("r", [9], "b"))
    assert not plain.prompt_logprobs and not plain.prompt_token_ids and plain.prompt_text == ""
    request = decoder_pb2.GenerateRequest(prompt_token_ids=[1, 2], return_prompt=True,
                                          sampling=decoder_pb2.SamplingParams(prompt_logprobs=3))
    parsed = generate_from_pb(request)
    assert parsed.return_prompt and parsed.sampling.prompt_logprobs == 3
