"""The tool-call parsers (services/gateway/http/chat/tool_parsers.py) on crafted texts: several
calls, text before and after, broken JSON left as content, an unclosed last block, a cut tag; and
streaming: the text fed in two pieces cut at every character boundary (and one character at a
time) folds to exactly the whole text's content and calls."""

from __future__ import annotations

import json

import pytest

from services.gateway.http.chat.tool_parsers import (
    CallArguments,
    CallName,
    HermesParser,
    NamedParser,
    Parsed,
    ParsedCall,
    RequiredParser,
    fold,
    parse,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2], "note": "a \\"}\\" b"}}'
TIME = '{"name": "get_time", "arguments": {}}'
WEATHER_ARGS = json.dumps({"city": "Zürich", "days": [1, 2], "note": 'a "}" b'}, ensure_ascii=False)

HERMES_CASES = [
    # two calls in Hermes' layout (newlines around and between the blocks)
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
     Parsed(None, [ParsedCall("get_weather", WEATHER_ARGS), ParsedCall("get_time", "{}")])),
    # text before the calls is content, as written
    (f"Let me look that up.\n<tool_call>{TIME}</tool_call>",
     Parsed("Let me look that up.\n", [ParsedCall("get_time", "{}")])),
    # text after a call is content too
    (f"<tool_call>{TIME}</tool_call>\nDone.", Parsed("\nDone.", [ParsedCall("get_time", "{}")])),
    # broken JSON: the block stays in the content; the good one is a call
    (f"<tool_call>{{\"name\": \"get_time\", \"arguments\": {{}}</tool_call> then <tool_call>{TIME}</tool_call>",
     Parsed('<tool_call>{"name": "get_time", "arguments": {}</tool_call> then ', [ParsedCall("get_time", "{}")])),
    # arguments that are not an object, a name missing: not calls
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     Parsed('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [])),
    ('<tool_call>{"arguments": {}}</tool_call>', Parsed('<tool_call>{"arguments": {}}</tool_call>', [])),
    # an unclosed last block is a call when its JSON is whole (vLLM's), content when not
    (f"<tool_call>\n{TIME}\n", Parsed(None, [ParsedCall("get_time", "{}")])),
    ('<tool_call>{"name": "get_ti', Parsed('<tool_call>{"name": "get_ti', [])),
    # no calls: the text as it is, a cut tag and whitespace included
    ("a < b and <tool_ca", Parsed("a < b and <tool_ca", [])),
    ("  \n", Parsed("  \n", [])),
    ("", Parsed(None, [])),
]


def _fed(parser, text: str, cuts: list[int]) -> Parsed:
    events, start = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    return fold(events + parser.finish())


@pytest.mark.parametrize("text, expected", HERMES_CASES)
def test_hermes_parses_whole_texts(text, expected):
    assert parse(HermesParser(), text) == expected


@pytest.mark.parametrize("text, expected", HERMES_CASES)
def test_hermes_streaming_cut_anywhere_gives_the_whole_texts_result(text, expected):
    for cut in range(len(text) + 1):
        assert _fed(HermesParser(), text, [cut]) == expected, cut
    assert _fed(HermesParser(), text, list(range(1, len(text)))) == expected


def test_hermes_sends_a_call_once_its_block_is_complete_and_content_as_soon_as_it_is_sure():
    parser = HermesParser()
    assert fold(parser.feed("Checking <tool")).content == "Checking "  # "<tool" may open a block: held
    assert parser.feed(f"_call>{TIME[:10]}") == []
    assert parser.feed(f"{TIME[10:]}</tool_call>") == [CallName(0, "get_time"), CallArguments(0, "{}")]
    assert parser.feed("\n") == [] and parser.finish() == []  # whitespace after the last call: dropped


REQUIRED_CASES = [
    ('[{"name": "a", "parameters": {"x": "]}"}}, {"name": "b", "parameters": {}}]',
     Parsed(None, [ParsedCall("a", '{"x": "]}"}'), ParsedCall("b", "{}")])),
    (' [ {"name": "a", "parameters": {"n": 1.5}} ] ', Parsed(None, [ParsedCall("a", '{"n": 1.5}')])),
    # cut short (max_tokens): the whole elements are calls, the rest is content
    ('[{"name": "a", "parameters": {}}, {"name": "b", "param', Parsed(' {"name": "b", "param', [ParsedCall("a", "{}")])),
    ("not json", Parsed("not json", [])),
    ('[{"name": "a"}]', Parsed('{"name": "a"}]', [])),
]


@pytest.mark.parametrize("text, expected", REQUIRED_CASES)
def test_required_parses_the_array_whole_and_cut_anywhere(text, expected):
    assert parse(RequiredParser(), text) == expected
    for cut in range(len(text) + 1):
        assert _fed(RequiredParser(), text, [cut]) == expected, cut
    assert _fed(RequiredParser(), text, list(range(1, len(text)))) == expected


def test_named_streams_the_arguments_as_they_come():
    parser = NamedParser("get_time")
    assert parser.feed('{"zo') == [CallName(0, "get_time"), CallArguments(0, '{"zo')]
    assert parser.feed('ne": 9}') == [CallArguments(0, 'ne": 9}')]
    assert parser.finish() == []
    assert parse(NamedParser("f"), '{"a": 1}') == Parsed(None, [ParsedCall("f", '{"a": 1}')])
    assert parse(NamedParser("f"), "") == Parsed(None, [ParsedCall("f", "")])
