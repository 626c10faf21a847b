"""services/gateway/http/json_body.parse: the value json.loads gives the whole body, with its long
plain strings cut out and decoded a slice at a time, for bodies built to confuse the cut (escaped
quotes before a data URI, a long key, backslashes, control characters, invalid UTF-8, placeholders
a client guesses at), and the GIL released while a 200 MiB body parses."""

from __future__ import annotations

import base64
import json
import os
import threading
import time

import pytest

from services.gateway.http import json_body

LONG = base64.b64encode(os.urandom(3 * json_body.LONG_STRING_BYTES)).decode()
URI = "data:image/png;base64," + LONG

VALID = [
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URI}}]}]},
    {"a": [URI, URI[:-4], {"b": URI + "x"}], "n": 1.5, "t": True, "z": None},
    {"text": 'say \\"' + URI + '\\" twice'},  # a data URI inside another string, between escaped quotes
    {URI: 1},  # a long key
    {"k": "\\\\", "u": URI},  # an escaped backslash right before a closing quote
    {"k": "x\\" + LONG},  # a long string with a backslash in it
    {"k": "é" + LONG, "u": URI},  # a long string that is not ASCII
    {"k": f"tessera:{'0' * 32}:0", "u": URI},  # a client's guess at a placeholder
    [URI] * 5,
    "just a string",
    URI,
]


@pytest.mark.parametrize("value", VALID, ids=range(len(VALID)))
def test_parse_gives_what_json_loads_gives(value):
    for text in (json.dumps(value), json.dumps(value, indent=2), json.dumps(value, ensure_ascii=False)):
        raw = text.encode()
        buffer = bytearray(raw)
        assert json_body.parse(buffer) == json.loads(raw) == value
        assert not buffer  # the raw bytes are released


INVALID = [
    b'{"u": "' + URI.encode() + b'\n"}',  # a raw control character in a long string
    b'{"u": "' + URI.encode() + b'"',  # unclosed object
    b'{"u": "' + URI.encode() + b'" "v": 1}',  # a missing comma
    b'{"u": ' + URI.encode() + b'}',  # a long bare word between string tokens' quotes
    b'{"a": "x", ' + URI.encode() + b'"b": 1}',
    b'{"u": "' + URI.encode() + b'", "v": "\xff"}',  # invalid UTF-8 in the rest
    b'{"u": "' + URI.encode() + b'}',  # unclosed string
]


@pytest.mark.parametrize("raw", INVALID, ids=range(len(INVALID)))
def test_parse_refuses_what_json_loads_refuses(raw):
    with pytest.raises((json.JSONDecodeError, UnicodeDecodeError)) as expected:
        json.loads(raw.decode())
    with pytest.raises(expected.type) as got:
        json_body.parse(bytearray(raw))
    assert str(got.value) == str(expected.value)


def test_a_body_with_many_quotes_is_parsed_whole():
    value = {"k": ["q"] * (json_body.MAX_QUOTES + 1), "u": URI}
    assert json_body.parse(bytearray(json.dumps(value).encode())) == value


def test_a_200_mib_body_parses_without_holding_the_gil_for_long():
    """A thread ticking every millisecond is never kept waiting long while parse runs in another
    (json.loads of the same body holds it for the whole parse: 0.8 s on a 2-core host)."""
    images = [base64.b64encode(os.urandom(19 << 20)).decode() for _ in range(8)]
    raw = json.dumps({"content": [{"image_url": {"url": "data:image/png;base64," + i}} for i in images]}).encode()
    assert len(raw) > 200 << 20
    buffer = bytearray(raw)  # copied here: a 200 MiB copy is one C call too
    result, gaps, done = [], [], threading.Event()
    worker = threading.Thread(target=lambda: result.append(json_body.parse(buffer)))

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    worker.start()
    worker.join(60)
    done.set()
    ticker.join(10)
    assert [p["image_url"]["url"][22:] for p in result[0]["content"]] == images
    # what the GIL's switch interval allows between slices, with room for a loaded host's scheduling;
    # json.loads of the body would be one gap of the whole parse
    assert max(gaps) < 0.5, f"longest wait {max(gaps):.3f} s"


@pytest.mark.parametrize("depth", [500, 900])
def test_a_deeply_nested_body_with_a_long_string_parses_as_json_loads_does(depth):
    """Nesting that json.loads takes, past what a recursive walk of the parsed value could (about 490
    levels): the long strings, beside and inside it, are put back."""
    raw = ('{"user": "' + URI + '", "guided_json": {"enum": [' + "[" * depth + '"' + URI + '"'
           + "]" * depth + "]}}").encode()
    expected = json.loads(raw)
    value = json_body.parse(bytearray(raw))
    assert value == expected
    inner = value["guided_json"]["enum"][0]
    for _ in range(depth - 1):
        inner = inner[0]
    assert inner == [URI]


def test_nesting_json_loads_refuses_is_refused_alike():
    raw = ('{"u": "' + URI + '", "d": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()
    with pytest.raises(RecursionError):
        json.loads(raw)
    with pytest.raises(RecursionError):
        json_body.parse(bytearray(raw))
