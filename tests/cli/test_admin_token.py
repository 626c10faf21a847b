"""Where the registry's admin token comes from: a file (`--admin-token-file`,
$TESSERA_ADMIN_TOKEN_FILE) or $TESSERA_ADMIN_TOKEN, never a flag's value; and what `tessera up`
hands the processes it starts."""

from __future__ import annotations

import pytest

from services.adapters.__main__ import parse_args
from services.adapters.config import RegistryConfig
from tessera.cli.up.launch import Cluster
from tessera.cli.up.spec import ClusterSpec


def test_the_token_file_is_read_and_stripped(tmp_path, monkeypatch):
    monkeypatch.delenv("TESSERA_ADMIN_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret\n")
    assert RegistryConfig(root=tmp_path, admin_token_file=token_file).admin_token == "s3cret"
    monkeypatch.setenv("TESSERA_ADMIN_TOKEN_FILE", str(token_file))
    config = parse_args(["--root", str(tmp_path)])
    assert config.admin_token == "s3cret"
    assert "s3cret" not in repr(config)


def test_the_environment_alone_still_works_and_both_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_ADMIN_TOKEN", "from-env")
    assert RegistryConfig(root=tmp_path).admin_token == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file")
    with pytest.raises(ValueError, match="given twice"):
        RegistryConfig(root=tmp_path, admin_token_file=token_file)


@pytest.mark.parametrize("content", [None, "\n"])
def test_a_missing_or_empty_token_file_is_refused(tmp_path, monkeypatch, content):
    monkeypatch.delenv("TESSERA_ADMIN_TOKEN", raising=False)
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content)
    with pytest.raises(ValueError, match="admin token file"):
        RegistryConfig(root=tmp_path, admin_token_file=token_file)


def test_up_gives_the_token_to_the_registry_alone_and_never_in_argv(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_ADMIN_TOKEN_FILE", str(tmp_path / "the-users-file"))  # `up` read it already
    cluster = Cluster(ClusterSpec(admin_token="s3cret", log_dir=tmp_path, adapter_root=tmp_path))
    for service in cluster.spec.services():
        assert "s3cret" not in " ".join(cluster.spec.command(service))
        env = cluster.process_environment(service)
        assert env.get("TESSERA_ADMIN_TOKEN") == ("s3cret" if service == "adapters" else None), service
        assert "TESSERA_ADMIN_TOKEN_FILE" not in env


def test_the_registry_refuses_to_start_without_a_token_where_the_gateway_has_api_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("TESSERA_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("TESSERA_API_KEY_FILE", str(tmp_path / "keys"))
    with pytest.raises(ValueError, match=r"^\$TESSERA_API_KEY_FILE is set \(the gateway has API keys\) but the "
                                         r"registry has no admin token: adapter load/unload would be open to "
                                         r"anonymous callers; give one with --admin-token-file PATH or "
                                         r"\$TESSERA_ADMIN_TOKEN$"):
        RegistryConfig(root=tmp_path)
    monkeypatch.setenv("TESSERA_ADMIN_TOKEN", "s3cret")
    assert RegistryConfig(root=tmp_path).admin_token == "s3cret"
