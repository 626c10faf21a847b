"""A user's own checkpoint through `tessera up --decoder-model-dir DIR`: a text-only Llama or Qwen2
with head size 128 (as Llama-3 and Qwen2.5 have) starts text-only and answers as transformers does;
a directory that is not a decoder is refused in one line before any service starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.checkpoint import DECODER_ARCHITECTURES
from services.common.server import CHANNEL_OPTIONS
from tessera.cli.up.launch import Cluster
from tessera.cli.up.spec import ClusterSpec
from tessera.paths import default_decoder_dir, default_embedding_dir
from tessera.v1 import gateway_pb2, gateway_pb2_grpc
from tests.decoder.decoder_testing import make_tiny_llama

from .conftest import _free_base_port
from .test_generate import chat_request, collect, hf_greedy
from .test_images import image_request, png_bytes

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.")
MAX_TOKENS = 12
HEAD_SIZE_128 = dict(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=128, num_hidden_layers=2, tie_word_embeddings=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def own_cluster(request, tmp_path_factory):
    """A seeded tiny checkpoint of the family with head size 128 and SmolLM2's tokenizer, served by a
    cluster started as `tessera up --decoder-model-dir DIR` with no other decoder flag (HTTP off)."""
    directory = make_tiny_llama(tmp_path_factory.mktemp(f"own-{request.param}"), seed=7, family=request.param,
                                **HEAD_SIZE_128)
    spec = ClusterSpec(base_port=_free_base_port(), decoder_model_dir=directory,
                       adapter_root=tmp_path_factory.mktemp("adapters"), log_dir=tmp_path_factory.mktemp("logs"))
    reference = (AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(),
                 AutoTokenizer.from_pretrained(directory))
    with Cluster(spec) as cluster, \
            grpc.insecure_channel(cluster.spec.address("gateway"), options=CHANNEL_OPTIONS) as channel:
        yield cluster, reference, gateway_pb2_grpc.GatewayStub(channel)


def test_text_only_checkpoint_starts_without_vision_and_answers_as_transformers(own_cluster):
    cluster, reference, gateway = own_cluster
    assert cluster.spec.checkpoint.head_dim == 128
    assert cluster.spec.encoder is None and "vision" not in cluster.spec.services()
    info = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30)
    assert not info.HasField("vision") and list(info.decoder.mrope_section) == []
    for prompt in PROMPTS:
        expected = hf_greedy(reference, prompt, MAX_TOKENS)
        assert collect(gateway, chat_request(prompt, MAX_TOKENS))["ids"] == expected, prompt


def test_image_parts_are_refused_naming_the_text_only_model(own_cluster):
    cluster, _, gateway = own_cluster
    with pytest.raises(grpc.RpcError) as error:
        collect(gateway, image_request(png_bytes(32, 32)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("image parts are not accepted: ")
    assert "text-only" in error.value.details()
    assert collect(gateway, chat_request(PROMPTS[0], 2))["finish"]  # the refusal cost the cluster nothing


def _bert_dir(tmp_path):
    return default_embedding_dir()  # all-MiniLM-L6-v2: a real BERT checkpoint, weights and tokenizer included


def _config_only_dir(tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text((default_decoder_dir() / "config.json").read_text())
    return tmp_path


def _missing_dir(tmp_path):
    return tmp_path / "no-such-model"


@pytest.mark.parametrize("make_dir, message", [
    (_bert_dir, "holds architecture BertModel (model_type 'bert'), not a supported decoder; supported: "
                + ", ".join(f"{arch} ({kind})" for kind, arch in DECODER_ARCHITECTURES.items())
                + ", or a causal LM transformers builds (its MODEL_FOR_CAUSAL_LM_MAPPING; encoders and seq2seq "
                  "models are not)"),
    (_config_only_dir, "has no weights: neither model.safetensors nor model.safetensors.index.json"),
    (_missing_dir, "does not exist"),
])
def test_tessera_up_refuses_a_non_decoder_dir_in_one_line_before_any_service_starts(tmp_path, make_dir, message):
    directory = make_dir(tmp_path / "model")
    home = tmp_path / "home"
    env = {**os.environ, "TESSERA_HOME": str(home)}
    result = subprocess.run([sys.executable, "-m", "tessera.cli.main", "up", "--decoder-model-dir", str(directory),
                             "--embedding-model-dir", str(default_embedding_dir()), "--cluster", "own",
                             "--base-port", str(_free_base_port())],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"error: decoder model dir {str(directory)!r} {message}"]
    assert "prepare" not in result.stderr  # that advice is for the default model dirs only
    assert result.stdout == "" and not (home / "clusters").exists()  # no log dir: no process was started


def test_the_decoder_refuses_the_same_way_at_its_own_start(tmp_path):
    directory = _config_only_dir(tmp_path)
    result = subprocess.run([sys.executable, "-m", "services.decoder", "--model-dir", str(directory),
                             "--address", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"python -m services.decoder: error: decoder model dir {str(directory)!r} "
                                          "has no weights: neither model.safetensors nor model.safetensors.index.json"]


def test_damaged_weights_are_refused_in_one_line_naming_the_file(tmp_path):
    """A checkpoint that passes the directory check but whose weights are not safetensors (a
    truncated download): the decoder exits 1 at load with one line, not a safetensors traceback."""
    directory = tmp_path / "damaged"
    shutil.copytree(default_decoder_dir(), directory, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = directory / "model.safetensors"
    weights.write_bytes(b"garbage")
    result = subprocess.run([sys.executable, "-m", "services.decoder", "--model-dir", str(directory),
                             "--address", "127.0.0.1:1"], capture_output=True, text=True, timeout=180)
    lines = result.stderr.strip().splitlines()  # the config's INFO lines (its automatic choices), then why
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith(f"decoder: {weights} is not a readable safetensors file ("), lines


def test_demo_pairing_and_explicit_sections(tmp_path):
    """The built-in SmolLM2 keeps the demo encoder (image chat, sections 8,12,12); a user's text-only
    model gets it only with sections that cover its rotary pairs, refused in one line otherwise."""
    builtin = ClusterSpec(base_port=40000)
    assert (builtin.encoder, builtin.mrope_section) == ("demo", "8,12,12") and "vision" in builtin.services()
    assert ClusterSpec(base_port=40000, vision=False).encoder is None
    own = make_tiny_llama(tmp_path / "own", **HEAD_SIZE_128)
    paired = ClusterSpec(base_port=40000, decoder_model_dir=own, mrope_section="16,24,24")
    decoder = paired.command("decoder")
    assert paired.encoder == "demo" and decoder[decoder.index("--mrope-section") + 1] == "16,24,24"
    with pytest.raises(ValueError, match=r"^mrope_section \(8, 12, 12\) sums to 32 rotary pairs; the model's "
                                         r"head_dim 128 needs 64 \(decoder model dir '.*'\)$"):
        ClusterSpec(base_port=40000, decoder_model_dir=own, mrope_section="8,12,12")


def test_the_checkpoint_check_names_every_family_the_decoder_loads():
    from services.common.mrope import QWEN_VL_MODEL_TYPES
    from services.decoder.models import MODEL_FAMILIES

    assert set(DECODER_ARCHITECTURES) == {*MODEL_FAMILIES, *QWEN_VL_MODEL_TYPES}
