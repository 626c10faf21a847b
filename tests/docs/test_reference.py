"""The generated pages in docs/ are fresh (each equals what docs/generate.py renders from its source
now) and cover their sources: every public RPC and field, every HTTP route, every flag of every
service and of `tessera up`, every benchmark results file."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

from services.common.launch import REPO
from tessera.v1 import gateway_pb2


def test_generated_pages_are_fresh():
    result = subprocess.run([sys.executable, "docs/generate.py", "--check"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_grpc_reference_lists_every_gateway_rpc_and_request_field():
    text = (REPO / "docs" / "reference" / "grpc.md").read_text()
    service = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
    for method in service.methods:
        assert f"| `{method.name}` | " in text, method.name
        for field in method.input_type.fields:
            assert f"| `{field.name}` | " in text, f"{method.input_type.name}.{field.name}"
    assert "`sampling` | [SamplingParams](#samplingparams) | 5 |" in text
    assert ("| `max_tokens` | int32 | 1 | >= 1; prompt + max_tokens must fit the context. 0 (unset) = the served "
            "model's default (generation_config.json's max_new_tokens under --generation-config auto), else the rest "
            "of the context: max_model_len - prompt tokens, as vLLM. |") in text


def test_http_reference_lists_every_route_and_request_field():
    from services.gateway.http.app import create_app
    from services.gateway.http.backend import Backend

    document = create_app(Backend(None, {}), max_body_bytes=1).openapi()  # the routes' shapes need no core
    text = (REPO / "docs" / "reference" / "http.md").read_text()
    for path, item in document["paths"].items():
        for method in item:
            assert f"### {method.upper()} {path}\n" in text, (method, path)
    request = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for field in request:
        assert f"| `{field}` | " in text, field
    assert "| `encoding_format` | `\"float\"` \\| `\"base64\"` \\| null |  | `float` |" in text  # null: the default


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[0] for a in parser._actions
            if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS]  # SUPPRESS: a refused flag


def test_configuration_reference_lists_every_flag_of_every_service_and_up():
    text = (REPO / "docs" / "reference" / "configuration.md").read_text()
    for service in ("gateway", "vision", "decoder", "pooling", "adapters"):
        section = text.split(f"## {service}: ", 1)[1].split("\n## ", 1)[0]
        for option in _options(importlib.import_module(f"services.{service}.__main__").build_parser()):
            assert f"| `{option}`" in section, (service, option)
    from tessera.cli.main import build_parser

    up = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["up"]
    section = text.split("## `tessera up`", 1)[1]
    for option in _options(up):
        assert f"| `{option}`" in section, option
    assert "| `--http-port` | int | `0` | `TESSERA_HTTP_PORT` |" in text
    assert "| `--lora-backend` | str | `auto` |  | `auto`, `torch`, `triton`, `cpu` |" in text
    for variable in ("TESSERA_HOME", "TESSERA_INTERNAL_TOKEN_FILE", "TESSERA_API_TOKEN", "GOMP_SPINCOUNT"):
        assert f"| `{variable}` | " in text, variable


def test_benchmarks_page_holds_every_results_table():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    for path in sorted((REPO / "bench" / "results").glob("*.md")):
        assert f"## {path.stem}\n" in text, path.name
        for line in path.read_text().splitlines():
            if line.startswith("|"):
                assert line in text, (path.name, line)


def test_guide_links_resolve_and_the_readme_links_the_guide():
    import re

    pages = sorted((REPO / "docs").rglob("*.md"))
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links {target}"
    index = (REPO / "docs" / "README.md").read_text()
    for page in pages:
        name = page.relative_to(REPO / "docs").as_posix()
        if name != "README.md":
            assert f"]({name})" in index, f"docs/README.md does not link {name}"
    assert "](docs/README.md)" in (REPO / "README.md").read_text()
