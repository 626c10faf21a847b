"""Property test over every public RPC: messages generated from the protobuf descriptors, sent through
the gateway and straight to each service's port. No message may end with INTERNAL or UNKNOWN; after
each RPC's examples every service is healthy, the decoder holds no KV block and the registry counts
no lease.

Strategies follow each field's descriptor (type, label, oneof, enum), with values chosen to find
edges: empty and unicode strings, ints at the int32/int64 bounds, NaN and infinities, random bytes
and real or header-only images, enum numbers outside the enum. A few fields get narrower
strategies (OVERRIDES), each for a stated reason. Examples are derandomized, so a failure
reproduces, and bounded (MAX_EXAMPLES per RPC, CALL_TIMEOUT_S per call).
"""

from __future__ import annotations

import io
import struct
import time
import zlib

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from services.common.server import CHANNEL_OPTIONS
from tessera.v1 import adapters_pb2, decoder_pb2, gateway_pb2, pooling_pb2, tensor_pb2, vision_pb2

from .conftest import internal_channel

MAX_EXAMPLES = 50
DECODER_HIDDEN = 576  # SmolLM2-135M, the cluster's decoder
CALL_TIMEOUT_S = 5.0
IDLE_WAIT_S = 10.0
FORBIDDEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def _png(size=(24, 16)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _header_only_png(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height over a few bytes of pixel data."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")


INT32 = st.one_of(st.integers(-3, 70), st.sampled_from([2**31 - 1, -(2**31), 5000, 65536]))
INT64 = st.one_of(st.integers(-3, 70), st.sampled_from([2**63 - 1, -(2**63), 2**31, 2**40]))
FLOAT = st.one_of(st.floats(width=32), st.sampled_from([0.0, 0.5, 1.0, 2.0]))
DOUBLE = st.floats()
BYTES = st.one_of(st.binary(max_size=64), st.sampled_from([_png(), _png((3, 200)), _header_only_png(4000, 4000),
                                                           _header_only_png(60000, 1)]))
TEXT = st.text(max_size=30)
SCALARS = {
    FieldDescriptor.TYPE_INT32: INT32, FieldDescriptor.TYPE_SINT32: INT32, FieldDescriptor.TYPE_SFIXED32: INT32,
    FieldDescriptor.TYPE_INT64: INT64, FieldDescriptor.TYPE_SINT64: INT64, FieldDescriptor.TYPE_SFIXED64: INT64,
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1), FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FLOAT: FLOAT, FieldDescriptor.TYPE_DOUBLE: DOUBLE, FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: TEXT, FieldDescriptor.TYPE_BYTES: BYTES,
}
DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"]
OVERRIDES = {
    # generation that is accepted runs on CPU: a few tokens keep each example short
    "tessera.v1.SamplingParams.max_tokens": st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 2**31 - 1, -(2**31), 5000])),
    # floats near their accepted ranges too, so that some generations run rather than all being refused
    **{f"tessera.v1.SamplingParams.{name}": st.one_of(st.sampled_from([0.0, 0.5, 1.0]), FLOAT)
       for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")},
    # names an earlier test may have loaded must not be unloaded or replaced under it
    "tessera.v1.LoadAdapterRequest.name": TEXT.map(lambda s: "fuzz" + s),
    "tessera.v1.UnloadAdapterRequest.name": TEXT.map(lambda s: "fuzz" + s),
    # the real decoder's residency report must not be overwritten
    "tessera.v1.ResidencyReport.decoder_id": TEXT.map(lambda s: "fuzz" + s),
    # images that decode: rows of the decoder's width under a grid and sections it accepts, values
    # anything float32 holds (NaN included) -- random tensors almost never get that far
    "tessera.v1.EncodedImage.rows": st.one_of(st.builds(
        lambda rows, width, value: tensor_pb2.Tensor(shape=[rows, width], dtype="float32",
                                                     data=struct.pack("<f", value) * (rows * width)),
        st.sampled_from([1, 2, 4]), st.sampled_from([DECODER_HIDDEN, 8]), st.floats(width=32)), st.deferred(
        lambda: message_strategy(tensor_pb2.Tensor.DESCRIPTOR))),
    "tessera.v1.EncodedImage.mrope_section": st.one_of(st.just([8, 12, 12]), st.lists(st.integers(-1, 40), max_size=4)),
    "tessera.v1.Tensor.dtype": st.one_of(st.sampled_from(DTYPES), TEXT),
    "tessera.v1.Tensor.shape": st.lists(st.one_of(st.integers(-2, 600), st.sampled_from([2**40, -(2**40)])), max_size=3),
    "tessera.v1.ChatMessage.role": st.one_of(st.sampled_from(["system", "user", "assistant"]), TEXT),
    "tessera.v1.EncodedImage.grid_thw": st.one_of(st.sampled_from([[1, 1, 1], [1, 1, 2], [1, 2, 2]]),
                                                  st.lists(st.integers(-2, 8), max_size=4)),
}


def _field(field: FieldDescriptor) -> st.SearchStrategy:
    override = OVERRIDES.get(field.full_name)
    if override is not None:
        return override
    if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        entry = field.message_type.fields_by_name  # a map<K, V> (logit_bias): a dict of its key and value
        return st.dictionaries(_field(entry["key"]), _field(entry["value"]), max_size=3)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        value = message_strategy(field.message_type)
    elif field.type == FieldDescriptor.TYPE_ENUM:
        value = st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-2, 9))
    else:
        value = SCALARS[field.type]
    if field.is_repeated:
        return st.lists(value, max_size=3)
    return value


_MESSAGES: dict[str, st.SearchStrategy] = {}


def message_strategy(descriptor) -> st.SearchStrategy:
    """Messages of `descriptor`'s type: each field set or left unset, one member per oneof at most."""
    if descriptor.full_name not in _MESSAGES:
        plain = {f.name: st.one_of(st.none(), _field(f)) for f in descriptor.fields
                 if f.containing_oneof is None or f.containing_oneof.name.startswith("_")}
        oneofs = [st.one_of(st.none(), *(st.tuples(st.just(f.name), _field(f)) for f in oneof.fields))
                  for oneof in descriptor.oneofs if not oneof.name.startswith("_")]
        _MESSAGES[descriptor.full_name] = st.builds(_build, st.just(descriptor), st.fixed_dictionaries(plain),
                                                    st.tuples(*oneofs))
    return _MESSAGES[descriptor.full_name]


def _build(descriptor, plain: dict, chosen: tuple):
    fields = {name: value for name, value in plain.items() if value is not None}
    fields.update(dict(c for c in chosen if c is not None))
    return message_factory.GetMessageClass(descriptor)(**fields)


SERVICES = {"gateway": gateway_pb2.DESCRIPTOR.services_by_name["Gateway"],
            "decoder": decoder_pb2.DESCRIPTOR.services_by_name["Decoder"],
            "pooling": pooling_pb2.DESCRIPTOR.services_by_name["Pooling"],
            "vision": vision_pb2.DESCRIPTOR.services_by_name["Vision"],
            "adapters": adapters_pb2.DESCRIPTOR.services_by_name["Adapters"]}
RPCS = [(service, method) for service, descriptor in SERVICES.items() for method in descriptor.methods]


def _call(channel: grpc.Channel, method, request) -> None:
    """One call of any shape; a client-streaming method gets `request` as its one-message stream."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    out = message_factory.GetMessageClass(method.output_type).FromString
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    call = kind(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=out)
    reply = call(iter([request, request]) if method.client_streaming else request, timeout=CALL_TIMEOUT_S)
    if method.server_streaming:
        list(reply)


@pytest.fixture(scope="module")
def channels(cluster):
    opened = {name: grpc.insecure_channel(cluster.spec.address(name), options=CHANNEL_OPTIONS) if name == "gateway"
              else internal_channel(cluster, name) for name in SERVICES}
    yield opened
    for channel in opened.values():
        channel.close()


def _assert_idle(cluster, channels) -> None:
    """Every service SERVING, the decoder back to all blocks free, no adapter lease counted."""
    for service in cluster.spec.services():
        assert cluster.processes[service].poll() is None, f"{service} died:\n{cluster.log_tail(service)}"
        reply = health_pb2_grpc.HealthStub(channels[service]).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    get_info = channels["decoder"].unary_unary("/tessera.v1.Decoder/GetInfo",
                                               request_serializer=lambda m: m.SerializeToString(),
                                               response_deserializer=decoder_pb2.DecoderInfo.FromString)
    list_adapters = channels["adapters"].unary_unary(
        "/tessera.v1.Adapters/ListAdapters", request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=adapters_pb2.ListAdaptersResponse.FromString)
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        info = get_info(decoder_pb2.DecoderInfoRequest(), timeout=10)
        leases = {a.name: a.leases for a in list_adapters(adapters_pb2.ListAdaptersRequest(), timeout=10).adapters}
        idle = (info.num_free_blocks == info.num_blocks and info.num_running == 0 and info.num_waiting == 0
                and not any(leases.values()))
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (info.num_free_blocks, info.num_running, info.num_waiting) == (info.num_blocks, 0, 0)
    assert not any(leases.values()), leases


@pytest.mark.parametrize("service, method", RPCS, ids=[f"{s}-{m.name}" for s, m in RPCS])
def test_no_generated_message_is_an_internal_error(cluster, channels, service, method):
    failures: list[str] = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(message_strategy(method.input_type))
    def check(request):
        try:
            _call(channels[service], method, request)
        except grpc.RpcError as error:
            if error.code() in FORBIDDEN:
                failures.append(f"{error.code().name}: {error.details()} for {request!r:.600}")
            assert error.code() not in FORBIDDEN, failures[-1]

    check()
    _assert_idle(cluster, channels)
