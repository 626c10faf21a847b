"""A PEFT LoRA through the registry and decoder equals PeftModel in process."""

from __future__ import annotations

import copy

import grpc
import pytest
import requests
import torch

from services.common.checkpoint import CheckpointConfig, base_model_digest, base_model_name
from tessera.v1 import adapters_pb2, gateway_pb2

from .conftest import once_back, run_cli
from .test_generate import CHAT_PROMPTS, chat_request, collect, hf_greedy


@pytest.fixture(scope="session")
def peft_adapter(hf_decoder, adapter_root):
    """Random non-zero B on q_proj and v_proj, saved in PEFT's format under the adapter root."""
    from peft import LoraConfig, get_peft_model

    model, _ = hf_decoder
    torch.manual_seed(7)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with torch.no_grad():  # keep the correction visible but small, so answers stay readable
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
    peft_model.save_pretrained(adapter_root / "qv-adapter")
    return peft_model.eval()


def peft_greedy(peft_model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = peft_model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_lora_through_cluster_equals_peft(gateway, gateway_address, peft_adapter, hf_decoder, cluster):
    _, tokenizer = hf_decoder
    result = run_cli(gateway_address, "adapters", "load", "qv", "qv-adapter")
    assert result.returncode == 0, result.stderr
    listing = gateway.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=30)
    [info] = [a for a in listing.adapters if a.name == "qv"]
    assert len(info.digest) == 64 and info.rank == 8
    # recorded against the cluster's base model, and listed with it
    base = CheckpointConfig.read(cluster.spec.decoder_model_dir)
    assert info.base_model == base_model_digest(base) and info.base_model_name == base_model_name(base)
    listed = run_cli(gateway_address, "adapters", "list")
    assert [line for line in listed.stdout.splitlines() if line.startswith("qv ")][0].endswith(
        f"base: {info.base_model_name}"), listed.stdout

    prompt = CHAT_PROMPTS[1]
    expected = peft_greedy(peft_adapter, tokenizer, prompt, 24)
    base_expected = hf_greedy(hf_decoder, prompt, 24)
    assert expected != base_expected, "the adapter must change the answer for this test to mean anything"

    request = chat_request(prompt, 24)
    request.lora = "qv"
    assert collect(gateway, request)["ids"] == expected
    # The base model is unchanged for other requests, before and after.
    assert collect(gateway, chat_request(prompt, 24))["ids"] == base_expected
    # Right after its requests finished the adapter unloads: a lease count still in flight from the
    # decoder's periodic report is confirmed before it could refuse.
    request.request_id = "again"
    assert collect(gateway, request)["ids"] == expected
    gateway.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="qv"), timeout=30)
    assert "qv" not in [a.name for a in gateway.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=30).adapters]


def test_unknown_adapter_is_not_found(gateway, assert_healthy):
    request = chat_request(CHAT_PROMPTS[0], 4)
    request.lora = "no-such-adapter"
    with pytest.raises(grpc.RpcError) as error:
        collect(gateway, request)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-adapter" in error.value.details()
    assert_healthy()


def test_adapter_path_outside_root_is_refused(gateway, assert_healthy, tmp_path):
    for path in ("../outside", str(tmp_path)):
        with pytest.raises(grpc.RpcError) as error:
            gateway.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="escape", path=path), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
        assert "root" in error.value.details()
    assert_healthy()


def test_registry_down_is_unavailable_naming_the_registry(cluster, gateway, http_url, assert_healthy):
    """With the registry down, a LoRA request the decoder cannot resolve is UNAVAILABLE: the
    message names the registry (the decoder answered it), not the decoder as down; GET /v1/models
    still lists the served models, saying the adapters are missing."""
    import signal

    process = cluster.processes["adapters"]
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    try:
        request = chat_request(CHAT_PROMPTS[0], 4)
        request.lora = "never-resolved"
        with pytest.raises(grpc.RpcError) as error:
            collect(gateway, request)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        details = error.value.details()
        assert details.startswith("adapter registry at") and "answered by the decoder service" in details, details
        assert collect(gateway, chat_request(CHAT_PROMPTS[0], 4))["finish"]  # the base model still serves
        listed = requests.get(f"{http_url}/v1/models", timeout=60)
        info = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30)
        assert listed.status_code == 200, listed.text
        assert {m["id"] for m in listed.json()["data"]} == {info.decoder.model, info.pooling.model}
        [missing] = listed.json()["unavailable"]
        assert missing.startswith("adapters service at") and "unavailable" in missing, missing
        retrieved = requests.get(f"{http_url}/v1/models/some-adapter", timeout=60)
        assert retrieved.status_code == 503 and "adapters cannot be listed" in retrieved.json()["error"]["message"]
        assert requests.get(f"{http_url}/v1/models/{info.decoder.model}", timeout=60).status_code == 200
    finally:
        cluster.restart("adapters")
    once_back(lambda: gateway.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=10), timeout_s=30)
    assert "unavailable" not in requests.get(f"{http_url}/v1/models", timeout=60).json()
    assert_healthy()
