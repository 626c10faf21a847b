"""Client commands against the gateway: generate, embed, rerank, tokenize, adapters, info.

Each command is one call of `tessera.client.Client` and prints its typed result; errors raise
tessera.client.TesseraError, which `tessera` prints reworded for a command-line user
(`explain`: which flag or variable to set) with exit status 1. This module imports only the
public client (no torch, transformers or service code): client commands start fast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from argparse import Namespace
from pathlib import Path

import grpc
import numpy as np

from tessera.cli.endpoints import metrics_table
from tessera.client import (
    DEFAULT_ADDRESS,
    Client,
    ClusterInfo,
    GenerateResult,
    RetryPolicy,
    SamplingParams,
    TesseraError,
    TokenizeResult,
)
from tessera.protocol import (
    ADDRESS_ENV,
    ADMIN_TOKEN_ENV,
    API_KEY_INVALID,
    API_TOKEN_ENV,
    DECODE_STEP_TEXT,
    INTERNAL_TOKEN_MISSING,
    INTERNAL_TOKEN_WRONG,
    MODEL_IMPL_TEXT,
)

# gRPC's own details when no connection could be made: read only for an error no tessera service
# answered (it carries no reason; a relayed one names the service).
NOT_CONNECTED = ("failed to connect to all addresses",)
RESOLVE_FAILED = ("errors resolving", "DNS resolution failed")  # gRPC's words for a host that does not resolve
# The server's advice names a request field; the CLI user sets a flag.
FIELD_TO_FLAG = {"replace=true": "--replace", "drain=true": "--drain"}
SAMPLING_FLAGS = {"top_logprobs": "--logprobs"}  # `generate`'s flags whose name is not the field's
# One retry: a gateway restarting is still ridden out, and a command typed at a host with no
# cluster answers in a fraction of a second rather than after the library's ~2 s of backoff.
CLI_RETRY = RetryPolicy(max_attempts=2, initial_backoff_s=0.25)
URI_SCHEMES = ("ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")  # gRPC targets with their own syntax


def address_source(address: str) -> str:
    """Where the CLI's `address` came from, for messages: $TESSERA_ADDRESS when it holds that value,
    else --address (given, or its default)."""
    return f"${ADDRESS_ENV}" if os.environ.get(ADDRESS_ENV) == address else "--address"


def check_address(address: str) -> str:
    """`address` when it names a port; gRPC would read "localhost" as localhost:443.

    host:port, [v6]:port and dns:[//authority/]host:port are checked; ipv4:/ipv6:/unix: targets pass.

    Raises:
        ValueError: no port, a port outside 1..65535, or a bare IPv6 host.
    """
    if address.startswith(URI_SCHEMES):
        return address
    hostport = address.rpartition("/")[2] if address.startswith("dns:") else address
    host, sep, port = hostport.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536) or (":" in host and host[0] != "["):
        example = DEFAULT_ADDRESS.rpartition(":")[2]
        raise ValueError(f"{address_source(address)} {address!r} needs host:port (e.g. localhost:{example}); "
                         "gRPC would take a missing port as 443")
    return address


def read_token_file(path: str | os.PathLike) -> str:
    """The token a file holds, surrounding whitespace stripped (`echo` adds a newline).

    Raises:
        ValueError: the file cannot be read or holds nothing.
    """
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as error:
        raise ValueError(f"token file {path}: {error.strerror or error}") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def connect(address: str, admin_token: str | None = None) -> Client:
    """A client for `address` (checked: host:port); tokens and TLS root certificate default to the
    environment ($TESSERA_API_TOKEN, $TESSERA_ADMIN_TOKEN, $TESSERA_TLS_ROOT_CERT).

    Raises:
        ValueError: `address` has no port.
    """
    return Client(check_address(address), admin_token=admin_token, retry=CLI_RETRY)


def explain(error: TesseraError, args: Namespace) -> str:
    """One line for a CLI user: what to set or run, rather than gRPC's terms."""
    details, address = error.details, getattr(args, "address", DEFAULT_ADDRESS)
    admin = getattr(args, "action", "") in ("load", "unload")
    code = error.code
    unreached = code == grpc.StatusCode.UNAVAILABLE and not error.reason  # no tessera service answered
    if unreached and any(words in details for words in RESOLVE_FAILED):
        return f"the host in {address} ({address_source(address)}) does not resolve: {details}"
    if unreached and details.startswith(NOT_CONNECTED):
        return f"no tessera cluster is running at {address} (start one with `tessera up`)"
    if error.reason in (INTERNAL_TOKEN_MISSING, INTERNAL_TOKEN_WRONG):
        return f"{address} is one of a cluster's internal ports; --address names the gateway's"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) and admin:
        refused = code == grpc.StatusCode.PERMISSION_DENIED
        return (f"the adapter registry {'refused the admin token' if refused else 'needs an admin token'}: "
                f"set {ADMIN_TOKEN_ENV} or pass --admin-token-file PATH (the token `tessera up` was given)")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        what = "refused the API key in" if error.reason == API_KEY_INVALID else "needs an API key: set"
        return f"the gateway at {address} {what} {API_TOKEN_ENV}"
    for field_text, flag in FIELD_TO_FLAG.items():
        details = details.replace(f"pass {field_text}", f"pass {flag}")
    if getattr(args, "command", "") == "generate":
        details = re.sub(r"\bsampling\.(\w+)", lambda m: SAMPLING_FLAGS.get(m[1], "--" + m[1].replace("_", "-")),
                         details)
    return f"{code.name}: {details}"


def generate(client: Client, prompt: str, *, chat: bool, sampling: SamplingParams, system: str = "",
             lora: str = "", images: list[Path] = (), as_json: bool = False, out=sys.stdout) -> GenerateResult:
    """Stream the answer (text deltas as they arrive) or print it as one JSON object.

    Images come before the text, as one user turn (chat, after the `system` turn if any) or one raw
    prompt. With n > 1 choices, each is printed once finished under a "[choice i]" label; with
    logprobs, a table of each choice's tokens follows its text. The JSON's usage is the request's:
    completion_tokens summed over the choices, the prompt counted once.
    """
    if chat:
        content = [Path(p) for p in images] + [prompt]
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        stream = client.chat_stream(messages, sampling, lora=lora)
    else:
        stream = client.generate_stream(prompt, sampling, images=[Path(p) for p in images], lora=lora)
    streaming = not as_json and sampling.n == 1
    try:
        for delta in stream:
            if streaming and delta.text:
                out.write(delta.text)
                out.flush()
    except KeyboardInterrupt:
        if streaming:
            out.write("\n")  # the next line (the shell's prompt) starts on its own line
        raise
    result = stream.result
    if as_json:
        out.write(json.dumps({"request_id": result.request_id, "token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason,  # choice 0's, as GenerateResult has them
                              "choices": [dataclasses.asdict(c) for c in result.choices],
                              "usage": dataclasses.asdict(result.usage)},  # every choice's completion tokens
                             default=_byte_list) + "\n")
        return result
    if streaming:
        out.write("\n")
    for choice in result.choices:
        if not streaming:
            out.write(f"[choice {choice.index}] ({choice.finish_reason})\n{choice.text}\n")
        if sampling.logprobs:
            out.write(logprob_table(client, choice, model=lora or _decoder_model(client)))
    return result


def _byte_list(value):
    """JSON for a logprob's token_bytes: a list of byte values, as OpenAI's `bytes`."""
    if isinstance(value, bytes):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _decoder_model(client: Client) -> str:
    decoder = client.info().decoder
    return decoder.model if decoder is not None else ""


def logprob_table(client: Client, choice, model: str) -> str:
    """One line per generated token: its text and id, log-probability (natural log) and alternatives.

    Token texts are the ones the decoder sent with each logprob; where it sent none, they come from
    its tokenizer (Detokenize, once per distinct id); without either (the decoder did not answer
    GetInfo) ids stand alone.
    """
    texts: dict[int, str] = {}

    def text(entry) -> str:
        if entry.token:
            texts[entry.token_id] = entry.token
        elif model and entry.token_id not in texts:
            texts[entry.token_id] = client.detokenize([entry.token_id], model=model)
        return f"{texts[entry.token_id]!r}({entry.token_id})" if entry.token_id in texts else str(entry.token_id)

    lines = [f"{'token':<24} {'logprob':>9}  alternatives"]
    for entry in choice.logprobs:
        alternatives = "  ".join(f"{text(t)} {t.logprob:.3f}" for t in entry.top)
        lines.append(f"{text(entry):<24} {entry.logprob:>9.4f}  {alternatives}".rstrip())
    return "\n".join(lines) + "\n"


def embed(client: Client, texts: list[str], as_json: bool, out=sys.stdout, truncate: bool = False) -> np.ndarray:
    result = client.embed(texts, truncate=truncate)
    vectors = result.embeddings  # [N, D] float32
    if as_json:
        out.write(json.dumps({"model": result.model, "embeddings": vectors.tolist(),
                              "usage": {"prompt_tokens": result.prompt_tokens}}) + "\n")
        return vectors
    out.write(f"{result.model}: {len(texts)} x {vectors.shape[1]} embeddings, {result.prompt_tokens} tokens\n")
    if len(texts) > 1:
        similarity = vectors @ vectors.T
        labels = [t if len(t) <= 28 else t[:25] + "..." for t in texts]
        out.write("cosine similarity\n" + " " * 30 + "".join(f"{i:>8}" for i in range(len(texts))) + "\n")
        for i, label in enumerate(labels):
            out.write(f"{i:>2} {label:<27}" + "".join(f"{v:>8.3f}" for v in similarity[i].tolist()) + "\n")
    return vectors


def rerank(client: Client, query: str, documents: list[str], top_n: int | None, as_json: bool, out=sys.stdout,
           truncate: bool = False):
    result = client.rerank(query, documents, top_n=top_n, return_documents=True, truncate=truncate)
    rows = [dataclasses.asdict(r) for r in result.results]
    if as_json:
        out.write(json.dumps({"model": result.model, "method": result.method, "results": rows}) + "\n")
    else:
        out.write(f"{result.model} ({result.method})\n")
        for rank, r in enumerate(rows, 1):
            out.write(f"{rank:>2}. [{r['index']}] {r['score']:.4f}  {r['document']}\n")
    return result


def tokenize(client: Client, texts: list[str], as_json: bool, out=sys.stdout, model: str = ""):
    """`model` "" = the decoder's model (the default embedding model's when the cluster has no
    decoder), as `Client.tokenize`; a decoder model (or adapter) takes one text per request, so each
    text is sent alone."""
    parts = [client.tokenize(text, model=model) for text in texts]
    result = TokenizeResult(model=parts[0].model, tokens=[p.tokens[0] for p in parts],
                            max_model_len=parts[0].max_model_len)
    if as_json:
        out.write(json.dumps({"model": result.model,
                              "tokens": [[dataclasses.asdict(t) for t in tokens] for tokens in result.tokens]}) + "\n")
    else:
        for tokens in result.tokens:
            out.write(f"{len(tokens)} tokens: " + " ".join(f"{t.text}({t.id})" for t in tokens) + "\n")
    return result


def adapters(client: Client, action: str, name: str = "", path: str = "", replace: bool = False,
             drain: bool = False, as_json: bool = False, out=sys.stdout):
    if action == "load":
        info = client.load_adapter(name, path, replace=replace, drain=drain)
        out.write(f"loaded {info.name} rank={info.rank} digest={info.digest[:16]} "
                  f"targets={len(info.target_modules)}\n")
        return info
    if action == "unload":
        client.unload_adapter(name, drain=drain)
        out.write(f"unloaded {name}\n")
        return None
    listing = client.list_adapters()
    rows = [{"name": a.name, "digest": a.digest, "rank": a.rank, "state": a.state, "generation": a.generation,
             "target_modules": a.target_modules, "path": a.path, "base_model": a.base_model,
             "base_model_name": a.base_model_name} for a in listing]
    if as_json:
        out.write(json.dumps(rows) + "\n")
    else:
        for row in rows:
            base = row["base_model_name"] or "unknown base"
            out.write(f"{row['name']:<20} rank={row['rank']:<3} {row['state']:<13} {row['digest'][:16]}  "
                      f"{row['path']}  base: {base}\n")
        if not rows:
            out.write("no adapters loaded\n")
        elif any(row["state"] in ("base_mismatch", "base_unknown") for row in rows):
            out.write("base_mismatch/base_unknown: not servable on this cluster's base model; "
                      "load again with --replace on this base\n")
    return listing


def info(client: Client, as_json: bool = False, out=sys.stdout) -> ClusterInfo:
    """The cluster's models, limits and registered adapters as a table, then its replicas and (for a
    cluster this machine's `tessera up` runs) the metrics URLs; `as_json`: the ClusterInfo as one
    JSON object in protobuf's JSON mapping (lowerCamelCase names; unset and zero fields left out),
    as grpcurl prints GetInfo."""
    result = client.info()
    if as_json:
        out.write(json.dumps(_json_names(result)) + "\n")
        return result
    names = [a.name for a in client.list_adapters()] if "adapters" not in result.unavailable else None
    rows = cluster_rows(result, names)
    width = max(len(key) for key, _ in rows)
    out.write("".join(f"{key:<{width}}  {value}\n" for key, value in rows) + "\n")
    out.write(replica_table(result))
    out.write(metrics_table(client.settings.address))
    return result


def _json_names(value):
    """protobuf's JSON mapping of a result dataclass: lowerCamelCase field names, empty and zero
    fields left out; a map field's keys as they are and every entry kept, as protobuf writes maps."""
    if dataclasses.is_dataclass(value):
        fields = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
        return {_camel(k): _json_names(v) for k, v in fields if v not in (None, 0, "", False, [], {})}
    if isinstance(value, dict):
        return {k: _json_names(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_names(v) for v in value]
    return value


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def cluster_rows(info: ClusterInfo, adapters: list[str] | None) -> list[tuple[str, str]]:
    """(label, value) rows of the cluster's models and limits; `adapters` None: the registry did not answer."""
    d, p, v = info.decoder, info.pooling, info.vision
    rows = []
    if d is not None:
        rows.append(("model", f"{d.model} ({d.architecture})"))
        if d.model_impl:
            rows.append(("model impl", MODEL_IMPL_TEXT.get(d.model_impl, d.model_impl)))
        if d.decode_step:
            rows.append(("decode step", DECODE_STEP_TEXT.get(d.decode_step, d.decode_step)))
        if getattr(d, "quantization", ""):
            rows.append(("quantized", f"{d.quantization} (GGUF blocks, --quant-mode)"))
        if len(d.served_model_names) > 1:
            rows.append(("aliases", ", ".join(d.served_model_names[1:])))
        if d.generation_config:
            rows.append(("sampling", generation_defaults_text(d.generation_config, d.generation_defaults)))
        rows += [("dtype", d.dtype),
                 ("context", f"{d.max_model_len} tokens"), ("vocabulary", f"{d.vocab_size} tokens"),
                 ("KV cache", f"{d.num_blocks} blocks x {d.block_size} tokens")]
    for m in p.models if p is not None else ():
        aliases = f", also {', '.join(m.aliases)}" if m.aliases else ""
        rows.append((f"{m.kind}", f"{m.model} ({m.dimension} dims, {m.max_input_length} tokens max, "
                                  f"rerank {m.rerank_method or '-'}{aliases})"))
    rows.append(("vision", f"{v.encoder} ({v.max_images_per_request} images per request max)" if v
                 else "not answering" if "vision" in info.unavailable else "off"))
    rows.append(("replicas", ", ".join(f"{sum(r.service == s for r in info.replicas)} {s}"
                                       for s in ("decoder", "pooling"))))
    rows.append(("adapters", "unknown (the registry did not answer)" if adapters is None
                 else ", ".join(adapters) or "none"))
    if info.unavailable:
        rows.append(("unavailable", ", ".join(info.unavailable)))
    return rows


def generation_defaults_text(source: str, defaults: dict[str, float]) -> str:
    """The decoder's sampling defaults for fields a request leaves unset, and where they come from:
    "auto: temperature=0.6 top_p=0.9 (generation_config.json)", "vllm: neutral defaults" (none
    from the model: each field's own default, tessera/v1/decoder.proto)."""
    if not defaults:
        return f"{source}: neutral defaults"
    values = " ".join(f"{k}={v:g}" for k, v in sorted(defaults.items()))
    return f"{source}: {values} (generation_config.json)"


def replica_table(info: ClusterInfo) -> str:
    """One line per replica: service, address, health, requests, queue, KV usage, resident adapters."""
    lines = [f"{'replica':<8} {'address':<22} {'health':<18} {'sent':>6} {'now':>4} {'run':>4} {'wait':>4} "
             f"{'kv':>5}  adapters"]
    for r in info.replicas:
        health = "SERVING" if r.ready else f"not ready ({r.state})"
        d = r.decoder
        known = r.service == "decoder" and d is not None and d.num_blocks > 0
        kv = f"{1 - d.num_free_blocks / d.num_blocks:5.0%}" if known else f"{'-':>5}"
        queue = f"{d.num_running:>4} {d.num_waiting:>4}" if known else f"{'-':>4} {'-':>4}"
        resident = ",".join(d.resident_adapters) if known else ""
        lines.append(f"{r.service:<8} {r.address:<22} {health:<18} {r.num_requests:>6} {r.num_outstanding:>4} "
                     f"{queue} {kv}  {resident or '-'}")
    return "\n".join(lines) + "\n"
