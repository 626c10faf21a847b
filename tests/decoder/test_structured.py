"""Structured output in the decoder engine (services/decoder/grammar.py, constraints.py), on tiny
random checkpoints with real tokenizers.

- Validity, the defining property: at temperature 1.0, 40 JSON schemas from a seeded generator
  (structured_cases.py) x 3 choices each validate with the `jsonschema` package and end with
  "stop"; regexes (re.fullmatch), choices and an EBNF grammar likewise; some requests carry a LoRA
  adapter, some an image (tiny Qwen2-VL), some run while a tiny KV pool forces preemption.
- Exactness: a constraint that the unconstrained greedy text already satisfies changes no token;
  free rows batched beside constrained ones equal transformers' greedy ids and logits; the masked
  logits of every step equal xgrammar's own matcher applied to transformers' logits of the same
  prefix.
- Refusals (unsupported schema keyword, a regex or grammar that does not compile, a compile past
  --structured-outputs-compile-timeout, min_tokens beside a grammar) leave nothing allocated and
  the requests beside them unaffected.
"""

from __future__ import annotations

import asyncio
import io
import json
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from decoder_testing import hf_reference, run_requests
from lora_mixed_cases import MAX_RANK, registry_weights, save_adapters
from PIL import Image
from structured_cases import CHOICES, GRAMMAR, GRAMMAR_LANGUAGE, REGEXES, random_schemas

import services.decoder.sampler as sampler_module
from services.common.errors import InvalidArgument
from services.decoder.adapter_source import InMemoryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.constraints import Constraint
from services.decoder.convert import sampling_from_pb
from services.decoder.engine import start_engine
from services.decoder.grammar import apply_bitmask, json_schema_grammar
from services.decoder.types import GenerateInput, SamplingParams
from tessera.v1 import decoder_pb2

PROMPT = tuple(range(300, 320))
MAX_TOKENS = 400  # far past the longest valid text (~120 tokens): a choice must end by its grammar
ADAPTER = "plain4"
NUM_BLOCKS = 512


@pytest.fixture(scope="module")
def adapter_root(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-adapters")
    save_adapters(tiny_llama, root)
    return root


@pytest.fixture(scope="module")
def engine(tiny_llama, adapter_root):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=NUM_BLOCKS, max_model_len=512,
                                        max_num_seqs=64, adapter_slots=1, max_lora_rank=MAX_RANK),
                          InMemoryAdapterSource())
    weights = registry_weights(tiny_llama, adapter_root, ADAPTER)
    engine.parts.bank.load(weights)
    engine.adapters.add(ADAPTER, weights)
    yield engine
    engine.shutdown()


def _request(constraint: Constraint | None, request_id: str, seed: int = 0, n: int = 1, lora: str = "",
             prompt=PROMPT, **sampling) -> GenerateInput:
    options = dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=n, constraint=constraint)
    options.update(sampling)
    return GenerateInput(SamplingParams(**options), request_id=request_id, prompt_token_ids=tuple(prompt), lora=lora)


async def _choices(engine, request) -> list[tuple[str, list[int], str]]:
    """(text, token ids, finish_reason) of each of the request's choices, by index."""
    texts, ids, reasons = {}, {}, {}
    async for out in engine.generate(request):
        texts[out.index] = texts.get(out.index, "") + out.text
        ids.setdefault(out.index, []).extend(out.token_ids)
        if out.finish_reason is not None:
            reasons[out.index] = out.finish_reason
    return [(texts[i], ids[i], reasons[i]) for i in sorted(texts)]


def _run(engine, requests) -> list[list[tuple[str, list[int], str]]]:
    async def main():
        return await asyncio.gather(*(_choices(engine, r) for r in requests))
    return asyncio.run(main())


async def _compile_all(engine, constraints) -> None:
    await asyncio.gather(*(engine.parts.grammars.get(c) for c in constraints))


def _assert_nothing_held(engine) -> None:
    assert not engine.core.requests
    assert engine.stats().num_free_blocks == engine.config.num_blocks
    assert all(engine.parts.bank.num_leases(s) == 0 for s in range(engine.parts.bank.num_slots))


_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"')  # JSON string literals


def _json(schema) -> Constraint:
    return Constraint("json_schema", json.dumps(schema))


# -- validity ---------------------------------------------------------------------------------------

def test_forty_random_schemas_three_samples_each_validate_some_with_an_adapter(engine):
    schemas = random_schemas(40)
    requests = [_request(_json(schema), f"s{i}", seed=i, n=3, lora=ADAPTER if i % 4 == 1 else "")
                for i, schema in enumerate(schemas)]
    results = _run(engine, requests)
    for i, (schema, choices) in enumerate(zip(schemas, results)):
        assert len(choices) == 3
        for text, ids, reason in choices:
            assert reason == "stop", (i, text)
            assert ids[-1] == 2, "a complete grammar ends with the served EOS"
            jsonschema.validate(json.loads(text), schema)  # raises with the schema and the text
            assert not re.search(r"\s", _STRINGS.sub("", text)), "compact JSON by default: no whitespace"
    # three choices of one request are sampled apart (seed + i): not all alike over 40 requests
    assert sum(len({c[0] for c in choices}) > 1 for choices in results) > 20
    _assert_nothing_held(engine)


def test_json_object_and_any_whitespace(engine):
    results = _run(engine, [_request(Constraint("json_object"), f"o{i}", seed=i, n=2, max_tokens=300)
                            for i in range(4)])
    ended = [json.loads(text) for choices in results for text, _, reason in choices if reason == "stop"]
    assert ended and all(isinstance(value, dict) for value in ended)
    for choices in results:  # a choice cut by max_tokens is a prefix of an object, never something else
        assert all(text.startswith("{") for text, _, _ in choices)
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}, "maxItems": 4}},
              "required": ["a"], "additionalProperties": False}
    loose = _run(engine, [_request(Constraint("json_schema", json.dumps(schema), any_whitespace=True), f"w{i}",
                                   seed=i, max_tokens=300) for i in range(6)])
    for [(text, _, reason)] in loose:
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
    assert any(re.search(r"\s", text) for [(text, _, _)] in loose), "any_whitespace lets the model write spaces"


def test_regexes_choices_and_a_grammar_validate(engine):
    requests, checks = [], []
    for i, (pattern, python) in enumerate(REGEXES):
        requests.append(_request(Constraint("regex", pattern), f"re{i}", seed=i, n=3, lora=ADAPTER if i % 2 else ""))
        checks.append(lambda text, python=python: re.fullmatch(python, text) is not None)
    for i, choices in enumerate(CHOICES):
        requests.append(_request(Constraint("choice", json.dumps(choices)), f"c{i}", seed=i, n=3))
        checks.append(lambda text, choices=choices: text in choices)
    for i in range(3):
        requests.append(_request(Constraint("grammar", GRAMMAR), f"g{i}", seed=i, n=3, lora=ADAPTER if i else ""))
        checks.append(lambda text: GRAMMAR_LANGUAGE.fullmatch(text) is not None)
    for request, check, choices in zip(requests, checks, _run(engine, requests)):
        for text, _, reason in choices:
            assert reason == "stop" and check(text), (request.request_id, text)
    _assert_nothing_held(engine)


def test_valid_while_a_tiny_pool_preempts(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=32, block_size=8, max_model_len=512))
    preempted = []
    original = engine.parts.scheduler._preempt
    engine.parts.scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    try:
        schemas = random_schemas(8, seed=99)
        requests = [_request(_json(schema), f"p{i}", seed=i, n=1 if i % 2 else 2, max_tokens=200)
                    for i, schema in enumerate(schemas)]
        requests.append(_request(Constraint("grammar", GRAMMAR), "pg", seed=5, n=2, max_tokens=200))
        # compiled first, so the requests arrive together rather than as their compiles end (under
        # load the first could otherwise finish before the last arrived, and nothing would preempt)
        asyncio.run(_compile_all(engine, [r.sampling.constraint for r in requests]))
        results = _run(engine, requests)
        for schema, choices in zip(schemas, results):
            for text, _, reason in choices:
                assert reason == "stop"
                jsonschema.validate(json.loads(text), schema)
        assert all(GRAMMAR_LANGUAGE.fullmatch(text) for text, _, _ in results[-1])
        assert engine.stats().num_free_blocks == 32
    finally:
        engine.shutdown()
    assert preempted, "the pool was meant to force preemption"


def test_valid_with_an_image(tmp_path_factory):
    from services.decoder.types import ChatMessage, ImagePart, TextPart
    from services.vision.config import VisionConfig
    from services.vision.core import VisionCore
    from services.vision.processor import ImageSource
    from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig
    from tests.vision.qwen2_vl_tiny import build_tiny_qwen2_vl

    directory = tmp_path_factory.mktemp("structured-qwen2-vl")
    build_tiny_qwen2_vl(directory)
    vision = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(directory))))
    engine = start_engine(DecoderConfig(model_dir=str(directory), num_blocks=128, block_size=8, max_model_len=512))
    schema = {"type": "object", "properties": {"label": {"enum": ["cat", "dog"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 20},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                        "maxItems": 2}},
              "required": ["label", "count"], "additionalProperties": False}
    try:
        pixels = np.random.default_rng(1).integers(0, 256, (84, 112, 3), dtype=np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")
        [encoded] = vision.encode(vision.process([ImageSource(data=png.getvalue())]))
        image = ImagePart(encoded.rows, encoded.grid_thw, encoded.mrope_section, encoded.content_hash)
        message = ChatMessage("user", (TextPart("Describe "), image, TextPart(" briefly.")))
        requests = [GenerateInput(SamplingParams(max_tokens=300, temperature=1.0, seed=i, n=3, constraint=constraint),
                                  request_id=f"img{i}", messages=(message,))
                    for i, constraint in enumerate([_json(schema), Constraint("regex", r"[a-z]{1,5} \d")])]
        json_choices, regex_choices = _run(engine, requests)
        for text, _, reason in json_choices:
            assert reason == "stop"
            jsonschema.validate(json.loads(text), schema)
        assert all(reason == "stop" and re.fullmatch(r"[a-z]{1,5} \d", text) for text, _, reason in regex_choices)
    finally:
        engine.shutdown()


# -- exactness --------------------------------------------------------------------------------------

PROMPTS = [tuple(range(300, 320)), (1, 5, 77, 300, 12, 9, 4000, 17), tuple(range(1000, 1030, 3)),
           (9, 8, 7, 600, 601, 602)]


def test_a_constraint_the_greedy_text_already_satisfies_changes_no_token(engine, hf_model, tokenizer):
    num_new = 10
    checked = 0
    for k, prompt in enumerate(PROMPTS):
        ids, logits = hf_reference(hf_model, list(prompt), num_new)
        if 2 in ids:
            continue
        text = tokenizer.decode(ids)
        if "\ufffd" in text or tokenizer.encode(text, add_special_tokens=False) == []:
            continue  # a partial UTF-8 character has no text to constrain to
        choice = Constraint("choice", json.dumps([text, text + "!", "zzz"]))
        grammar = Constraint("grammar", "root ::= " + json.dumps(text, ensure_ascii=False))
        free = GenerateInput(SamplingParams(max_tokens=num_new), request_id=f"free{k}", prompt_token_ids=prompt)
        [[(_, choice_ids, choice_reason)], [(_, grammar_ids, _)], [(_, free_ids, free_reason)]] = _run(engine, [
            _request(choice, f"choice{k}", prompt=prompt, temperature=0.0),
            _request(grammar, f"grammar{k}", prompt=prompt, temperature=0.0),
            free])
        # the greedy tokens themselves; then the grammar allows only what completes it
        assert choice_ids[:num_new] == ids and grammar_ids[:num_new] == ids
        assert grammar_ids == [*ids, 2] and choice_reason == "stop"
        assert free_ids == ids and free_reason == "length", "a free row beside constrained ones is untouched"
        checked += 1
    assert checked >= 2


def test_masked_logits_equal_xgrammar_on_transformers_logits(engine, hf_model, tokenizer, monkeypatch):
    """Each step's scores after the grammar's mask (what the sampler draws from) equal xgrammar's
    own matcher, advanced over the same tokens, applied to transformers' logits of that prefix."""
    seen: list[torch.Tensor] = []
    adjusted = sampler_module.adjusted_scores

    def recording(scores, rows):
        seen.append(scores[0].clone())
        return adjusted(scores, rows)

    monkeypatch.setattr(sampler_module, "adjusted_scores", recording)
    schema = random_schemas(3, seed=7)[2]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info)
    # the schema's grammar as the decoder writes it for xgrammar (its strings free of control characters)
    references = {"json": compiler.compile_grammar(json_schema_grammar(json.dumps(schema), False, (",", ":"))),
                  "regex": compiler.compile_regex(REGEXES[0][0])}
    constraints = {"json": _json(schema), "regex": Constraint("regex", REGEXES[0][0])}
    for name, prompt in [("json", PROMPTS[0]), ("json", PROMPTS[1]), ("regex", PROMPTS[2])]:
        seen.clear()
        [[(text, ids, reason)]] = _run(engine, [_request(constraints[name], f"m-{name}", seed=3, prompt=prompt)])
        assert reason == "stop" and len(seen) == len(ids)
        with torch.no_grad():
            full = torch.tensor([list(prompt) + ids[:-1]])
            hf_logits = hf_model(full).logits[0, len(prompt) - 1:].float()  # [len(ids), vocab]
        matcher = xgr.GrammarMatcher(references[name])
        bitmask = xgr.allocate_token_bitmask(1, 49152)
        for step, token in enumerate(ids):
            matcher.fill_next_token_bitmask(bitmask)
            want = hf_logits[step:step + 1].clone()
            xgr.apply_token_bitmask_inplace(want, bitmask)
            got = seen[step]
            assert torch.equal(torch.isinf(got), torch.isinf(want[0])), (name, step)
            finite = torch.isfinite(got)
            torch.testing.assert_close(got[finite], want[0][finite], atol=1e-4, rtol=0)
            assert matcher.accept_token(token)
        assert matcher.is_terminated()


# -- refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 3}}}, "multipleOf"),
    ({"type": "object", "properties": {"u": {"type": "string", "format": "uri"}}}, "format"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, "patternProperties"),
    ({"not": {"type": "null"}}, "not"),
])
def test_unsupported_schema_keywords_are_refused_naming_them(schema, keyword):
    pb = decoder_pb2.SamplingParams(max_tokens=8, json_schema=json.dumps(schema))
    with pytest.raises(InvalidArgument, match=re.escape(repr(keyword))) as refused:
        sampling_from_pb(pb)
    assert refused.value.field == "sampling.json_schema"


def test_bad_constraints_are_refused_and_leave_nothing_behind(engine):
    compiler = engine.parts.grammars
    free = GenerateInput(SamplingParams(max_tokens=12), request_id="beside", prompt_token_ids=PROMPT)
    [(alone, _, _)] = run_requests(engine, [free])

    async def refused(constraint: Constraint) -> InvalidArgument:
        with pytest.raises(InvalidArgument) as error:
            await _choices(engine, _request(constraint, "bad"))
        return error.value

    async def main():
        beside = asyncio.ensure_future(_choices(engine, free))
        errors = [await refused(Constraint("regex", "(")), await refused(Constraint("regex", "[z-a]")),
                  await refused(Constraint("grammar", 'root ::= missing "x"')),
                  await refused(Constraint("grammar", "this is not EBNF"))]
        return errors, await beside

    errors, [(_, beside_ids, _)] = asyncio.run(main())
    assert [e.field for e in errors] == ["sampling.regex", "sampling.regex", "sampling.grammar", "sampling.grammar"]
    assert all("cannot be compiled" in str(e) for e in errors)
    assert beside_ids == alone, "a request beside the refusals is unaffected"

    timeout = compiler.compile_timeout_s
    compiler.compile_timeout_s = 1e-4
    slow = Constraint("grammar", GRAMMAR + "\n".join(f"r{i} ::= [a-z]{{1,{i + 2}}}" for i in range(200)))
    try:
        with pytest.raises(InvalidArgument, match="takes longer than") as too_slow:
            asyncio.run(_choices(engine, _request(slow, "slow")))
        assert too_slow.value.field == "sampling.grammar"
        with pytest.raises(InvalidArgument, match="takes longer than"):  # the refusal is remembered
            asyncio.run(_choices(engine, _request(slow, "slow-again")))
    finally:
        compiler.compile_timeout_s = timeout
    with pytest.raises(InvalidArgument, match="min_tokens"):
        SamplingParams(max_tokens=8, min_tokens=2, constraint=Constraint("regex", "a+"))
    _assert_nothing_held(engine)
    [(again, _, _)] = run_requests(engine, [free])
    assert again == alone


def _metric(metric, name: str, **labels) -> float:
    """The value of `metric`'s sample `name` whose labels include `labels` (0 when there is none)."""
    return sum(s.value for family in metric.collect() for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def test_compiled_grammars_are_cached_per_constraint_and_counted(engine):
    stats, metrics = engine.parts.grammars.stats, engine.metrics
    constraint = Constraint("regex", r"cache-[0-9]{2}")
    hits, misses = stats.hits, stats.misses
    lookups, requests = ("tessera:structured_output_compile_cache_lookups_total",
                         "tessera:structured_output_requests_total")
    compiles, masks = "tessera:structured_output_compile_seconds_count", "tessera:structured_output_mask_seconds_count"
    before = (_metric(metrics.grammar_lookups, lookups, result="hit"),
              _metric(metrics.grammar_lookups, lookups, result="miss"),
              _metric(metrics.constrained, requests, kind="regex"),
              _metric(metrics.grammar_compile, compiles), _metric(metrics.grammar_mask, masks))
    _run(engine, [_request(constraint, "c1")])
    _run(engine, [_request(constraint, "c2"), _request(constraint, "c3", n=2)])
    assert (stats.misses - misses, stats.hits - hits) == (1, 2)
    assert engine.parts.grammars.num_cached() >= 1
    after = (_metric(metrics.grammar_lookups, lookups, result="hit"),
             _metric(metrics.grammar_lookups, lookups, result="miss"),
             _metric(metrics.constrained, requests, kind="regex"),
             _metric(metrics.grammar_compile, compiles), _metric(metrics.grammar_mask, masks))
    hit, miss, constrained, compiled, masked = (a - b for a, b in zip(after, before))
    assert (hit, miss, constrained) == (2, 1, 3)
    assert compiled >= 1, "the miss's compile is timed (a slow one refused earlier may end meanwhile)"
    assert masked >= 3, "each step with a constrained row observes its mask time"


@pytest.mark.parametrize("vocab, rows", [(49152, [0, 1, 2, 3]), (49152, [1, 3]), (1000, [0, 2]), (77, [0])])
def test_apply_bitmask_equals_xgrammars_kernel(vocab, rows):
    """The decoder's CPU masking (unpacked bits, one masked_fill) against xgrammar's own kernel, on
    sparse, dense and random masks, whole batches and some rows, a vocabulary not a multiple of 32."""
    generator = torch.Generator().manual_seed(vocab + len(rows))
    logits = torch.randn(4, vocab, generator=generator)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), dtype=torch.int32, generator=generator)
    bitmask[1] = 0
    bitmask[1, words // 2] = 0x0F0F  # sparse: 8 tokens allowed
    bitmask[2] = -1
    bitmask[2, 0] = 0x7FFFFFFE       # dense: all but two
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=rows)
    assert torch.equal(apply_bitmask(logits, bitmask, rows), want)
    same = logits.clone()
    assert apply_bitmask(same, bitmask, rows, copy=False) is same and torch.equal(same, want)


def test_a_compile_past_the_timeout_ends_its_process_and_a_queued_one_is_not_charged_the_wait(engine):
    """Two slow compiles hold both workers; a cheap constraint queued behind them is compiled once a
    worker is free (its timeout counts its own compile), and each slow one's process is ended."""
    compiler = engine.parts.grammars
    timeout = compiler.compile_timeout_s
    compiler.compile_timeout_s = 1.0
    # thousands of optional properties: tens of seconds for xgrammar 0.2.9
    slow = [_json({"type": "object", "properties": {f"{p}{i}": {"type": "string"} for i in range(3000)}})
            for p in "ab"]
    killed = compiler.stats.workers_killed

    async def main():
        attempts = [asyncio.ensure_future(_choices(engine, _request(c, f"slow{i}", max_tokens=4)))
                    for i, c in enumerate(slow)]
        await asyncio.sleep(0.2)
        cheap = await _choices(engine, _request(Constraint("regex", "queued-[0-9]"), "cheap"))
        return cheap, await asyncio.gather(*attempts, return_exceptions=True)

    try:
        [(text, _, reason)], refused = asyncio.run(main())
    finally:
        compiler.compile_timeout_s = timeout
    assert reason == "stop" and re.fullmatch("queued-[0-9]", text)
    assert all(isinstance(e, InvalidArgument) and "takes longer than" in str(e) for e in refused), refused
    assert compiler.stats.workers_killed - killed == 2
    assert compiler.num_workers() <= 2
    _assert_nothing_held(engine)
