"""`tessera up` refuses what it can see is wrong before any process starts: one line on stderr,
exit status 2, nothing written under $TESSERA_HOME or outside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.cli.main import main
from tessera.paths import default_decoder_dir, default_embedding_dir

BASE_PORT = 21500
BUILT_IN_DECODER = default_decoder_dir()  # before the fixture points $TESSERA_HOME elsewhere


@pytest.fixture
def up(tmp_path, monkeypatch):
    """`tessera up ARGS` in this process, returning (status, the specs it would have started): the
    cluster is never started, a configuration that passes is only recorded."""
    models = ["--decoder-model-dir", str(default_decoder_dir()), "--embedding-model-dir", str(default_embedding_dir())]
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TESSERA_CLUSTER", raising=False)
    started = []
    monkeypatch.setattr("tessera.cli.up.run_until_signalled", lambda spec: started.append(spec) or 0)

    def run(*argv: str) -> tuple[int, list]:
        return main(["up", *models, "--adapter-root", str(tmp_path / "adapters"), "--base-port", str(BASE_PORT),
                     *argv]), started

    return run


def _written(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


@pytest.mark.parametrize("name", ["../../etc", "..", ".", "a/b", "/tmp/x", "-x", ".hidden", "a b", "x" * 65])
def test_a_cluster_name_that_is_not_a_plain_name_is_refused(up, tmp_path, capsys, name):
    code, started = up(f"--cluster={name}")
    assert (code, started) == (2, [])
    assert capsys.readouterr().err == (f"error: cluster must be a plain name ([A-Za-z0-9][A-Za-z0-9._-]{{0,63}}: it "
                                       f"names a directory under $TESSERA_HOME/clusters), got {name!r}\n")
    assert _written(tmp_path) == []


def test_a_plain_cluster_name_from_the_flag_or_the_environment_is_taken(up, monkeypatch, capsys):
    code, started = up("--cluster", "prod-1.eu_west")
    assert code == 0 and started[0].cluster == "prod-1.eu_west"
    assert started[0].log_dir.parts[-3:] == ("clusters", "prod-1.eu_west", "logs")
    monkeypatch.setenv("TESSERA_CLUSTER", "../up")
    code, started = up()
    assert (code, len(started)) == (2, 1)
    assert capsys.readouterr().err.endswith("got '../up'\n")


@pytest.mark.parametrize(("flag", "value", "error"), [
    ("--http-port", "-1", "http_port must be 0 (off) or a TCP port in 1..65535, got -1"),
    ("--http-port", "70000", "http_port must be 0 (off) or a TCP port in 1..65535, got 70000"),
    ("--http-port", str(BASE_PORT + 2), f"http_port {BASE_PORT + 2} is taken by the cluster's gRPC ports "
                                        f"{BASE_PORT}..{BASE_PORT + 4} or their metrics ports (+100)"),
    ("--http-port", str(BASE_PORT + 100), f"http_port {BASE_PORT + 100} is taken by the cluster's gRPC ports "
                                          f"{BASE_PORT}..{BASE_PORT + 4} or their metrics ports (+100)"),
    ("--base-port", "0", "base_port must leave room for 5 ports and their metrics ports (+100) below 65536, got 0"),
    ("--base-port", "65500", "base_port must leave room for 5 ports and their metrics ports (+100) below 65536, "
                             "got 65500"),
])
def test_a_port_out_of_range_or_taken_is_refused(up, tmp_path, capsys, flag, value, error):
    code, started = up(flag, value)
    assert (code, started) == (2, [])
    assert capsys.readouterr().err == f"error: {error}\n"
    assert _written(tmp_path) == []


def test_a_service_flag_its_service_cannot_parse_is_refused(up, tmp_path, capsys):
    code, started = up("--service-args", "gateway=--no-such-flag 1 --max-path-chars 64")
    assert (code, started) == (2, [])
    assert capsys.readouterr().err == ("error: --service-args gateway: python -m services.gateway: error: "
                                       "unrecognized arguments: --no-such-flag 1\n")
    code, started = up("--service-args", "gateway=--max-path-chars many")
    assert (code, started) == (2, [])
    assert capsys.readouterr().err == ("error: --service-args gateway: python -m services.gateway: error: argument "
                                       "--max-path-chars: invalid int value: 'many'\n")
    assert _written(tmp_path) == []
    code, started = up("--service-args", "gateway=--max-path-chars 64", "--service-args", "vision=--no-such-flag")
    assert code == 0 and started[0].extra_args["gateway"] == ["--max-path-chars", "64"]  # vision: not started


def test_served_names_and_generation_config_reach_the_decoder_and_pooling(up, capsys):
    code, started = up("--served-model-name", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2",
                       "--generation-config", "vllm",
                       "--embedding-served-model-name", "sentence-transformers/all-MiniLM-L6-v2")
    assert code == 0, capsys.readouterr().err
    [spec] = started
    decoder, pooling = spec.command("decoder"), spec.command("pooling")
    names = decoder.index("--served-model-name")
    assert decoder[names:names + 3] == ["--served-model-name", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"]
    assert decoder[decoder.index("--generation-config") + 1] == "vllm"
    assert pooling[pooling.index("--served-model-name") + 1:][:1] == ["sentence-transformers/all-MiniLM-L6-v2"]
    assert spec.services_given_flags() == {"decoder", "pooling"}  # parsed by their own parsers before the start
    code, started = up()
    assert code == 0 and "--served-model-name" not in started[-1].command("decoder")
    assert "--generation-config" not in started[-1].command("decoder") and not started[-1].services_given_flags()


def test_api_keys_without_an_admin_token_are_refused(up, tmp_path, monkeypatch, capsys):
    """Keys for the gateway (its flag through --service-args, or the environment every service
    inherits) and no admin token: adapter load/unload would be open to anyone; refused first."""
    monkeypatch.delenv("TESSERA_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("TESSERA_ADMIN_TOKEN_FILE", raising=False)
    monkeypatch.delenv("TESSERA_API_KEY_FILE", raising=False)
    keys, token = tmp_path / "keys", tmp_path / "admin-token"
    keys.write_text("key-1\n")
    token.write_text("admin-1\n")
    refused = ("error: the gateway has API keys ({}) but the registry has no admin token: adapter load/unload "
               "would be open to anonymous callers; pass --admin-token-file PATH (or set $TESSERA_ADMIN_TOKEN)\n")
    code, started = up("--service-args", f"gateway=--api-key-file {keys}")
    assert (code, started) == (2, [])
    assert capsys.readouterr().err == refused.format(keys)
    monkeypatch.setenv("TESSERA_API_KEY_FILE", str(keys))
    code, started = up()
    assert (code, started) == (2, [])
    assert capsys.readouterr().err == refused.format(keys)
    assert _written(tmp_path) == [token, keys]  # nothing else written
    code, started = up("--admin-token-file", str(token))
    assert code == 0 and started[0].admin_token == "admin-1"


def test_what_the_checkpoints_family_refuses_is_one_line_before_any_service_starts(up, tmp_path, capsys):
    """A Mistral checkpoint whose config.json carries `layer_types` (the decoder's family file
    refuses it; `check_decoder_dir` reads no family's fields): refused by `up` itself, exit 2."""
    source, model_dir = BUILT_IN_DECODER, tmp_path / "mistral"
    model_dir.mkdir()
    for path in source.iterdir():
        if path.is_file() and path.name != "config.json":
            (model_dir / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None,
                  layer_types=["full_attention"] * config["num_hidden_layers"])
    (model_dir / "config.json").write_text(json.dumps(config))
    code, started = up("--decoder-model-dir", str(model_dir))
    assert (code, started) == (2, [])
    err = capsys.readouterr().err
    assert err.startswith("error: --service-args decoder: ") and "layer_types is not a MistralConfig field" in err
    assert err.count("\n") == 1
