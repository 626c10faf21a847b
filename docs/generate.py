"""Render the generated pages of the user guide from their sources.

    python docs/generate.py          # rewrite every generated page
    python docs/generate.py --check  # exit 1 if one is stale (what tests/docs checks)

- docs/reference/grpc.md from protos/tessera/v1/*.proto: every service, RPC, message, field and
  enum with the comments written beside them in the protos (protoc's source info).
- docs/reference/http.md from the OpenAPI document of the gateway's FastAPI app (render_http.py),
  and docs/http.md's lists of honoured, accepted and refused request fields (between its markers).
- docs/reference/configuration.md from every service's flags and config dataclass metadata,
  `tessera up`'s parser and the environment variables the code reads (render_config.py).
- docs/benchmarks.md from bench/results/*.md (render_bench.py).
- the model families table in README.md and docs/models.md from the decoder's registry
  (render_families.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GRPC_REFERENCE = ROOT / "docs" / "reference" / "grpc.md"
sys.path[:0] = [str(ROOT), str(ROOT / "docs")]  # the services package and the render_* modules beside this file

# descriptor.proto field numbers, for SourceCodeInfo paths
_MESSAGE, _ENUM, _SERVICE = 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM, _METHOD, _VALUE = 2, 3, 4, 2, 2

_SCALARS = {v: k[len("TYPE_"):].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}


def load_descriptors() -> list[descriptor_pb2.FileDescriptorProto]:
    """The protos' descriptors with source info (comments), in file name order."""
    files = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "tessera" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = ["protoc", f"-I{PROTOS}", "--include_source_info", f"--descriptor_set_out={out}", *files]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed on " + ", ".join(files))
        descriptor_set = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return list(descriptor_set.file)


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Source path -> its leading and trailing comments, as one line of text."""
    found = {}
    for location in file.source_code_info.location:
        text = " ".join(" ".join(c.split()) for c in (location.leading_comments, location.trailing_comments) if c)
        if text:
            found[tuple(location.path)] = text
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _type_name(field: descriptor_pb2.FieldDescriptorProto, map_entries: dict) -> str:
    entry = map_entries.get(field.type_name.rsplit(".", 1)[-1])
    if entry is not None:
        key, value = entry.field
        return f"`map<{_type_name(key, {})}, {_type_name(value, {})}>`"
    if field.type_name:
        name = field.type_name.rsplit(".", 1)[-1]
        kind = f"[{name}](#{name.lower()})"
    else:
        kind = _SCALARS[field.type]
    if field.label == field.LABEL_REPEATED:
        return f"repeated {kind}"
    return f"optional {kind}" if field.proto3_optional else kind


def _render_message(message, path: tuple[int, ...], comments, lines: list[str], prefix: str = "") -> None:
    name = prefix + message.name
    if message.options.map_entry:
        return
    lines += [f"### {name}", ""]
    if path in comments:
        lines += [comments[path], ""]
    if message.field:
        lines += ["| field | type | number | description |", "|---|---|---|---|"]
        map_entries = {n.name: n for n in message.nested_type if n.options.map_entry}
        for i, field in enumerate(message.field):
            lines.append(f"| `{field.name}` | {_type_name(field, map_entries)} | {field.number} | "
                         f"{_cell(comments.get(path + (_FIELD, i), ''))} |")
        lines.append("")
    for i, nested in enumerate(message.nested_type):
        _render_message(nested, path + (_NESTED, i), comments, lines, prefix=f"{name}.")
    for i, enum in enumerate(message.enum_type):
        _render_enum(enum, path + (_NESTED_ENUM, i), comments, lines, prefix=f"{name}.")


def _render_enum(enum, path: tuple[int, ...], comments, lines: list[str], prefix: str = "") -> None:
    lines += [f"### {prefix}{enum.name}", ""]
    if path in comments:
        lines += [comments[path], ""]
    lines += ["| value | number | description |", "|---|---|---|"]
    for i, value in enumerate(enum.value):
        lines.append(f"| `{value.name}` | {value.number} | {_cell(comments.get(path + (_VALUE, i), ''))} |")
    lines.append("")


def _render_service(service, path: tuple[int, ...], comments, lines: list[str]) -> None:
    lines += [f"### service {service.name}", ""]
    if path in comments:
        lines += [comments[path], ""]
    lines += ["| rpc | request | response | description |", "|---|---|---|---|"]
    for i, method in enumerate(service.method):
        request, response = (t.rsplit(".", 1)[-1] for t in (method.input_type, method.output_type))
        request = f"{'stream ' if method.client_streaming else ''}[{request}](#{request.lower()})"
        response = f"{'stream ' if method.server_streaming else ''}[{response}](#{response.lower()})"
        lines.append(f"| `{method.name}` | {request} | {response} | {_cell(comments.get(path + (_METHOD, i), ''))} |")
    lines.append("")


def render_grpc_reference() -> str:
    lines = ["# gRPC reference", "",
             "Generated by `python docs/generate.py` from `protos/tessera/v1/*.proto`; edit the protos, not this file.",
             "`tessera.v1.Gateway` is the public service; the others are the cluster's internal hops.", ""]
    for file in load_descriptors():
        comments = _comments(file)
        lines += [f"## {file.name}", ""]
        for i, service in enumerate(file.service):
            _render_service(service, (_SERVICE, i), comments, lines)
        for i, message in enumerate(file.message_type):
            _render_message(message, (_MESSAGE, i), comments, lines)
        for i, enum in enumerate(file.enum_type):
            _render_enum(enum, (_ENUM, i), comments, lines)
    return "\n".join(lines).rstrip() + "\n"


def pages() -> dict[Path, object]:
    """Each generated page -> the function rendering its text (imported late: some need torch)."""
    import render_bench
    import render_config
    import render_families
    import render_http

    return {GRPC_REFERENCE: render_grpc_reference,
            ROOT / "docs" / "reference" / "http.md": render_http.render_http_reference,
            render_http.GUIDE: render_http.render_http_guide,
            ROOT / "docs" / "reference" / "configuration.md": render_config.render_configuration_reference,
            ROOT / "docs" / "benchmarks.md": render_bench.render_benchmarks,
            render_families.README: render_families.render_readme,
            render_families.GUIDE: render_families.render_models_guide}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, render in pages().items():
        text = render()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}: run python docs/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
