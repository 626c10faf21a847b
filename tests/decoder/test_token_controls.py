"""The token controls users send with sampling: OpenAI's logit_bias, vLLM's allowed_token_ids and
bad_words (and min_tokens beside them), in the batched sampler and through the engine, against
transformers' own logits processors (SequenceBiasLogitsProcessor, PrefixConstrainedLogitsProcessor,
NoBadWordsLogitsProcessor) on the tiny Llama with SmolLM2's tokenizer."""

import asyncio

import pytest
import torch
from decoder_testing import hf_reference, run_requests
from transformers.generation import (
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig
from services.decoder.convert import sampling_from_pb
from services.decoder.engine import start_engine
from services.decoder.sampler import SamplingRow, adjusted_scores, make_generator, sample
from services.decoder.tokens import bad_words_token_ids
from services.decoder.types import GenerateInput, SamplingParams
from tessera.v1 import decoder_pb2

PROMPT = tuple(range(300, 340))
NUM_NEW = 12
EOS = 2
NEG_INF = float("-inf")


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers' greedy continuation of PROMPT and its raw logits [NUM_NEW, vocab]."""
    return hf_reference(hf_model, list(PROMPT), NUM_NEW)


def _hf_greedy(model, *processors) -> list[int]:
    """transformers' greedy continuation of PROMPT under `processors` (stops at EOS, as the engine)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=NUM_NEW, do_sample=False, logits_processor=LogitsProcessorList(processors))
    return out[0, len(PROMPT):].tolist()


def _request(**sampling) -> GenerateInput:
    sampling.setdefault("max_tokens", NUM_NEW)
    return GenerateInput(SamplingParams(**sampling), prompt_token_ids=PROMPT)


def _ids(engine, **sampling) -> list[int]:
    return run_requests(engine, [_request(**sampling)])[0][0]


# ---- the batched function ---------------------------------------------------------------------

def _row(output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(max_tokens=8, **params), None, (1, 2, 3), list(output))


def _one_row_reference(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row's controls the plain way, token by token (vLLM's rules, written out)."""
    p, out = row.params, list(row.output_ids)
    scores = logits.clone()
    if p.allowed_token_ids is not None:
        for token in range(scores.numel()):
            if token not in p.allowed_token_ids:
                scores[token] = NEG_INF
    for sequence in p.bad_words_token_ids:
        *prefix, last = sequence
        if len(prefix) <= len(out) and (not prefix or out[-len(prefix):] == prefix):
            scores[last] = NEG_INF
    if len(out) < p.min_tokens:
        for token in p.stop_token_ids + p.eos_token_ids:
            scores[token] = NEG_INF
    for token, value in p.logit_bias.items():
        scores[token] += value
    return scores


def test_adjusted_scores_of_a_mixed_batch_leave_rows_that_ask_nothing_untouched():
    torch.manual_seed(0)
    logits = torch.randn(7, 50)  # [rows, vocab]
    rows = [
        _row(),                                                           # nothing
        _row(allowed_token_ids=(3, 7, 9)),
        _row(output=(1, 5), bad_words_token_ids=((4,), (5, 6), (8, 11), (1, 5, 13), (9, 9, 9, 9))),
        _row(logit_bias={10: 5.0, 20: -3.0}),
        _row(output=(0,), min_tokens=3, stop_token_ids=(12,), eos_token_ids=(EOS,)),
        _row(output=(4, 4), temperature=1.0),                             # nothing
        _row(allowed_token_ids=(2, 4, 10), logit_bias={10: 1.0, 4: 100.0}, bad_words_token_ids=((4,),)),
    ]
    original = logits.clone()
    scores = adjusted_scores(logits, rows)
    assert scores is not logits and torch.equal(logits, original)  # a copy: the logits stay raw
    for index, row in enumerate(rows):
        torch.testing.assert_close(scores[index], _one_row_reference(logits[index], row), rtol=0, atol=0)
    assert torch.equal(scores[0], logits[0]) and torch.equal(scores[5], logits[5])
    assert {t for t in range(50) if scores[2, t] == NEG_INF} == {4, 6, 13}  # (8, 11) and (9, 9, 9, 9) do not match
    assert {t for t in range(50) if scores[6, t] > NEG_INF} == {2, 10}
    assert float(scores[6, 10]) == pytest.approx(float(logits[6, 10]) + 1.0)
    # no row asks: the logits themselves, not a copy
    plain = [_row(), _row(temperature=1.0), _row(output=(5,), min_tokens=1, eos_token_ids=(EOS,))]
    batch = logits[:3]
    assert adjusted_scores(batch, plain) is batch


def test_sample_takes_the_adjusted_argmax_and_reports_the_raw_logprobs():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    best = logits.argmax(dim=-1).tolist()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    rows = [_row(), _row(logit_bias={best[1]: -100.0}, logprobs=True), _row(logit_bias={17: 100.0}),
            _row(allowed_token_ids=(5, 6, 7))]
    samples = sample(logits, rows)
    assert samples[0].token_id == best[0]
    assert samples[1].token_id == second[1]  # the next-best token
    raw = torch.log_softmax(logits[1], dim=-1)
    assert samples[1].logprob == pytest.approx(float(raw[second[1]]))  # the model's own distribution
    assert samples[2].token_id == 17
    assert samples[3].token_id == 5 + int(logits[3, 5:8].argmax())


def test_sample_at_temperature_one_keeps_to_the_allowed_ids_and_refuses_a_row_left_with_none():
    torch.manual_seed(2)
    logits = torch.randn(66, 50)
    allowed = (3, 11, 40)
    rows = [_row(allowed_token_ids=allowed, temperature=1.0) for _ in range(64)]
    for row, seed in zip(rows, range(64)):
        row.generator = make_generator(seed)
    rows.append(_row(allowed_token_ids=(EOS,), min_tokens=2, eos_token_ids=(EOS,)))  # every id masked
    rows.append(_row())
    samples = sample(logits, rows)
    drawn = [s.token_id for s in samples[:64]]
    assert set(drawn) <= set(allowed) and len(set(drawn)) > 1
    assert isinstance(samples[64], InvalidArgument) and samples[64].field == "sampling.allowed_token_ids"
    assert samples[65].token_id == int(logits[65].argmax())


# ---- validation and conversion ----------------------------------------------------------------

@pytest.mark.parametrize("fields, field, words", [
    ({"logit_bias": {5: 100.5}}, "logit_bias", "must be in [-100, 100], got 100.5"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias", "got nan"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", "token id -1"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias", "1025 entries; the limit is 1024"),
    ({"allowed_token_ids": ()}, "allowed_token_ids", "must not be empty"),
    ({"allowed_token_ids": (4, -2)}, "allowed_token_ids", "holds -2"),
    ({"bad_words": ("ok", " ")}, "bad_words", "bad_words[1] is ' '"),
    ({"bad_words": ("",)}, "bad_words", "bad_words[0] is ''"),
    ({"bad_words": ("x",) * 129}, "bad_words", "129 words; the limit is 128"),
    ({"bad_words": ("x" * 257,)}, "bad_words", "257 characters; the limit is 256"),
])
def test_bad_token_controls_are_refused_naming_the_field_and_the_limit(fields, field, words):
    with pytest.raises(InvalidArgument) as error:
        SamplingParams(max_tokens=4, **fields)
    assert error.value.field == field and words in str(error.value), str(error.value)


def test_token_controls_from_the_wire():
    params = sampling_from_pb(decoder_pb2.SamplingParams(max_tokens=4, logit_bias={7: -100, 9: 2.5},
                                                         allowed_token_ids=[7, 8], bad_words=["cat"]))
    assert (params.logit_bias, params.allowed_token_ids, params.bad_words) == ({7: -100.0, 9: 2.5}, (7, 8), ("cat",))
    assert sampling_from_pb(decoder_pb2.SamplingParams(max_tokens=4)).allowed_token_ids is None  # empty: every id
    with pytest.raises(InvalidArgument) as error:
        sampling_from_pb(decoder_pb2.SamplingParams(max_tokens=4, logit_bias={7: 101}))
    assert error.value.field == "sampling.logit_bias"


def test_bad_words_are_tokenized_with_and_without_a_leading_space_as_vllm(tokenizer):
    def encode(text):
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    assert bad_words_token_ids(tokenizer, ["hello"]) == (encode("hello"), encode(" hello"))
    assert len(encode("hello")) == len(encode(" hello")) == 1 and encode("hello") != encode(" hello")
    assert bad_words_token_ids(tokenizer, ["  hello"]) == bad_words_token_ids(tokenizer, ["hello"])  # lstripped
    two = bad_words_token_ids(tokenizer, ["big dog"])
    assert two == (encode("big dog"), encode(" big dog")) and all(len(s) == 2 for s in two)


# ---- through the engine, against transformers ---------------------------------------------------

def test_logit_bias_minus_100_on_the_greedy_token_gives_the_next_best(engine, hf_model, reference):
    greedy, logits = reference
    first = greedy[0]
    ids = _ids(engine, logit_bias={first: -100.0})
    assert ids[0] == int(logits[0].topk(2).indices[1])  # transformers' second most likely first token
    assert ids == _hf_greedy(hf_model, SequenceBiasLogitsProcessor([[[first], -100.0]])) != greedy
    assert first not in ids


def test_logit_bias_plus_100_makes_greedy_pick_the_token(engine, hf_model, reference):
    greedy, logits = reference
    token = int(logits[0].argsort()[len(logits[0]) // 2])  # a middling token, never chosen on its own
    assert token not in greedy
    ids = _ids(engine, logit_bias={token: 100.0, greedy[0]: 5.0}, max_tokens=4)
    assert ids == [token] * 4 == _hf_greedy(hf_model, SequenceBiasLogitsProcessor(
        [[[token], 100.0], [[greedy[0]], 5.0]]))[:4]
    small = _ids(engine, logit_bias={greedy[1]: 0.5, greedy[3]: -0.5})  # small biases: same as transformers'
    assert small == _hf_greedy(hf_model, SequenceBiasLogitsProcessor([[[greedy[1]], 0.5], [[greedy[3]], -0.5]]))


def test_allowed_token_ids_hold_at_temperature_one_and_greedy_takes_the_allowed_argmax(engine, hf_model, reference):
    _, logits = reference
    allowed = tuple(int(t) for t in logits[0].argsort()[100:108])  # eight unlikely ids, EOS not among them
    assert EOS not in allowed
    results = run_requests(engine, [_request(allowed_token_ids=allowed, temperature=1.0, seed=s) for s in range(3)])
    drawn = [t for ids, _, _ in results for t in ids]
    assert len(drawn) == 3 * NUM_NEW and set(drawn) <= set(allowed) and len(set(drawn)) > 2
    greedy = _ids(engine, allowed_token_ids=allowed)
    assert greedy[0] == allowed[int(logits[0][list(allowed)].argmax())]
    assert greedy == _hf_greedy(hf_model, PrefixConstrainedLogitsProcessor(lambda batch, ids: list(allowed), 1))


def _word_of(tokenizer, tokens: list[int]) -> str | None:
    """A bad word whose token sequences (bad_words_token_ids) include `tokens` exactly, or None."""
    word = tokenizer.decode(tokens).strip()
    if not word or not word.isascii():
        return None
    return word if tuple(tokens) in bad_words_token_ids(tokenizer, [word]) else None


def test_bad_words_are_never_generated_and_greedy_equals_transformers(engine, hf_model, tokenizer, reference):
    greedy, _ = reference
    single = next((k, w) for k in range(2, NUM_NEW) if (w := _word_of(tokenizer, [greedy[k]])))
    double = next((k, w) for k in range(2, NUM_NEW - 1) if (w := _word_of(tokenizer, greedy[k:k + 2])))
    for k, word in (single, double):
        banned = bad_words_token_ids(tokenizer, [word])
        ids = _ids(engine, bad_words=(word,))
        assert ids[:k] == greedy[:k] and ids != greedy  # the same path until the word would come
        for sequence in banned:
            assert all(tuple(ids[i:i + len(sequence)]) != sequence for i in range(len(ids)))
        assert ids == _hf_greedy(hf_model, NoBadWordsLogitsProcessor([list(s) for s in banned], eos_token_id=EOS))


def test_a_batch_mixing_controls_and_plain_rows_gives_each_its_reference(engine, hf_model, reference):
    greedy, logits = reference
    allowed = tuple(int(t) for t in logits[0].argsort()[200:204])
    requests = [_request(), _request(logit_bias={greedy[0]: -100.0}), _request(), _request(allowed_token_ids=allowed),
                _request(temperature=1.0, seed=5)]
    results = [ids for ids, _, _ in run_requests(engine, requests)]
    assert results[0] == results[2] == greedy
    assert results[1] == _hf_greedy(hf_model, SequenceBiasLogitsProcessor([[[greedy[0]], -100.0]]))
    assert results[3] == _hf_greedy(hf_model, PrefixConstrainedLogitsProcessor(lambda batch, ids: list(allowed), 1))
    assert results[4] == _ids(engine, temperature=1.0, seed=5)  # a seeded draw is the same beside controlled rows


def test_min_tokens_holds_back_eos_until_reached(engine, hf_model):
    # a +100 bias on EOS ends a choice at once, unless min_tokens holds it back
    assert _ids(engine, logit_bias={EOS: 100.0}) == [EOS]
    ids = _ids(engine, logit_bias={EOS: 100.0}, min_tokens=5)
    assert EOS not in ids[:5] and ids[5:] == [EOS]


def test_ids_past_the_vocabulary_are_refused_and_a_choice_left_with_no_token_ends_with_an_error(engine):
    vocab = engine.parts.prompts.vocab_size
    for fields, field in (({"logit_bias": {vocab: 1.0}}, "sampling.logit_bias"),
                          ({"allowed_token_ids": (5, vocab)}, "sampling.allowed_token_ids")):
        with pytest.raises(InvalidArgument) as error:
            _ids(engine, **fields)
        assert error.value.field == field and f"outside the vocabulary [0, {vocab})" in str(error.value)
    with pytest.raises(InvalidArgument, match="mask every token"):
        _ids(engine, allowed_token_ids=(EOS,), min_tokens=2)
    stats = engine.stats()
    assert (stats.num_free_blocks, stats.num_running) == (64, 0)
    assert len(_ids(engine, max_tokens=3)) == 3  # the engine serves on


def test_min_tokens_and_bad_words_over_the_wire_are_the_same_as_in_process(engine):
    params = sampling_from_pb(decoder_pb2.SamplingParams(max_tokens=NUM_NEW, bad_words=["the"], min_tokens=3))
    assert asyncio.run(_collect(engine, GenerateInput(params, prompt_token_ids=PROMPT))) == _ids(
        engine, bad_words=("the",), min_tokens=3)


async def _collect(engine, request):
    return [t async for out in engine.generate(request) for t in out.token_ids]
