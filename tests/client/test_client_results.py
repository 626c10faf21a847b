"""The typed results and requests carry the fields issue 18 added: an adapter's base model, and
max_tokens None (the rest of the context: 0 on the wire)."""

from __future__ import annotations

from tessera.client import convert
from tessera.client.types import AdapterInfo, SamplingParams
from tessera.v1 import adapters_pb2


def test_adapter_info_carries_its_base_model():
    message = adapters_pb2.AdapterInfo(name="support", state="base_mismatch", base_model="ab" * 32,
                                       base_model_name="SmolLM2-135M (LlamaForCausalLM, 30 layers, hidden 576)")
    info = convert.from_pb(AdapterInfo, message)
    assert (info.name, info.state, info.base_model) == ("support", "base_mismatch", "ab" * 32)
    assert info.base_model_name == message.base_model_name


def test_max_tokens_none_asks_for_the_rest_of_the_context():
    assert convert.sampling_params(SamplingParams(max_tokens=None)).max_tokens == 0
    assert convert.sampling_params(SamplingParams()).max_tokens == 64
    assert convert.sampling_params(SamplingParams(max_tokens=5)).max_tokens == 5
