"""The Python client's structured output: SamplingParams' json_schema, json_object, regex, choice,
grammar and any_whitespace reach GenerateRequest's `constraint` oneof (through Client.chat and
Client.generate, over an in-process gateway servicer that records the request), at most one per
request; the decoder's refusal of one comes back as InvalidArgument naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc.error_details_pb2 import ErrorInfo

import tessera.client as tc
from tessera.client import convert
from tessera.protocol import FIELD_METADATA
from tessera.rich_status import status_metadata
from tessera.v1 import decoder_pb2, gateway_pb2_grpc, tensor_pb2

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _constraint(sampling: decoder_pb2.SamplingParams):
    kind = sampling.WhichOneof("constraint")
    value = getattr(sampling, kind) if kind else None
    return kind, list(value.choices) if kind == "choice" else value


@pytest.mark.parametrize("fields, expected", [
    ({"json_schema": SCHEMA}, ("json_schema", json.dumps(SCHEMA))),
    ({"json_schema": '{"type": "array"}'}, ("json_schema", '{"type": "array"}')),
    ({"json_object": True}, ("json_object", True)),
    ({"regex": "[0-9]+"}, ("regex", "[0-9]+")),
    ({"choice": ["yes", "no"]}, ("choice", ["yes", "no"])),
    ({"choice": []}, ("choice", [])),  # set, for the decoder to refuse naming it
    ({"grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
    ({}, (None, None)),
    ({"json_object": False}, (None, None)),
])
def test_each_keyword_sets_the_constraint_it_names(fields, expected):
    sampling = convert.sampling_params(tc.SamplingParams(**fields))
    assert _constraint(sampling) == expected
    assert not sampling.any_whitespace
    assert convert.sampling_params(tc.SamplingParams(any_whitespace=True, **fields)).any_whitespace


@pytest.mark.parametrize("fields, match", [
    ({"json_schema": SCHEMA, "regex": "a"}, "json_schema, regex"),
    ({"json_object": True, "choice": ["a"]}, "json_object, choice"),
    ({"choice": "yes"}, "list of strings"),
])
def test_two_constraints_or_a_choice_string_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        tc.SamplingParams(**fields)


class _Gateway(gateway_pb2_grpc.GatewayServicer):
    """Records each Generate request; answers `{"ok":true}`, or refuses a regex "(" as the decoder does."""

    def __init__(self):
        self.requests: list = []

    def Generate(self, request, context):
        self.requests.append(request)
        if request.sampling.regex == "(":
            message = "sampling.regex cannot be compiled: the parenthesis is not closed"
            info = ErrorInfo(reason="INVALID_ARGUMENT", metadata={FIELD_METADATA: "sampling.regex"})
            context.set_trailing_metadata(status_metadata(grpc.StatusCode.INVALID_ARGUMENT, message, info))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        yield decoder_pb2.GenerateResponse(index=0, text='{"ok":true}', token_ids=[1], finish_reason="stop",
                                           usage=tensor_pb2.Usage(prompt_tokens=1, completion_tokens=1,
                                                                  total_tokens=2))


@pytest.fixture
def gateway():
    servicer = _Gateway()
    server = grpc.server(ThreadPoolExecutor(2))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_chat_and_generate_send_the_constraint_and_a_refusal_names_its_field(gateway):
    address, servicer = gateway
    with tc.Client(address, timeout=10, retry=tc.NO_RETRY) as client:
        result = client.chat([{"role": "user", "content": "ok?"}], json_schema=SCHEMA, any_whitespace=True)
        assert json.loads(result.text) == {"ok": True}
        sent = servicer.requests[-1].sampling
        assert _constraint(sent) == ("json_schema", json.dumps(SCHEMA)) and sent.any_whitespace
        client.generate("x", tc.SamplingParams(max_tokens=8), choice=["yes", "no"])
        assert _constraint(servicer.requests[-1].sampling) == ("choice", ["yes", "no"])
        with pytest.raises(tc.InvalidArgument) as refused:
            client.generate("x", regex="(")
    assert refused.value.field == "sampling.regex" and "cannot be compiled" in refused.value.details
