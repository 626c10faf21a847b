"""Client commands against the gateway: generate, embed, rerank, tokenize, adapters, info.

Each command is one call of `tessera.client.Client` and prints its typed result; errors raise
tessera.client.TesseraError, which `tessera` prints as `error: CODE: details` (exit status 1).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from tessera.client import Client, ClusterInfo, GenerateResult, SamplingParams, TokenizeResult


def connect(address: str, admin_token: str | None = None) -> Client:
    """A client for `address`; tokens and TLS root certificate default to the environment
    ($TESSERA_API_TOKEN, $TESSERA_ADMIN_TOKEN, $TESSERA_TLS_ROOT_CERT)."""
    return Client(address, admin_token=admin_token)


def generate(client: Client, prompt: str, *, chat: bool, sampling: SamplingParams, lora: str = "",
             images: list[Path] = (), as_json: bool = False, out=sys.stdout) -> GenerateResult:
    """Stream the answer (text deltas as they arrive) or print it as one JSON object.

    Images come before the text, as one user turn (chat) or one raw prompt.
    """
    if chat:
        content = [Path(p) for p in images] + [prompt]
        stream = client.chat_stream([{"role": "user", "content": content}], sampling, lora=lora)
    else:
        stream = client.generate_stream(prompt, sampling, images=[Path(p) for p in images], lora=lora)
    for delta in stream:
        if not as_json and delta.text:
            out.write(delta.text)
            out.flush()
    result = stream.result
    if as_json:
        out.write(json.dumps({"request_id": result.request_id, "token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason,
                              "usage": dataclasses.asdict(result.usage)}) + "\n")
    else:
        out.write("\n")
    return result


def embed(client: Client, texts: list[str], as_json: bool, out=sys.stdout) -> np.ndarray:
    result = client.embed(texts)
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


def rerank(client: Client, query: str, documents: list[str], top_n: int | None, as_json: bool, out=sys.stdout):
    result = client.rerank(query, documents, top_n=top_n, return_documents=True)
    rows = [dataclasses.asdict(r) for r in result.results]
    if as_json:
        out.write(json.dumps({"model": result.model, "method": result.method, "results": rows}) + "\n")
    else:
        out.write(f"{result.model} ({result.method})\n")
        for rank, r in enumerate(rows, 1):
            out.write(f"{rank:>2}. [{r['index']}] {r['score']:.4f}  {r['document']}\n")
    return result


def tokenize(client: Client, texts: list[str], as_json: bool, out=sys.stdout, model: str = ""):
    """`model` "" = the embedding model; a decoder model (or adapter) takes one text per request, so
    each text is sent alone."""
    if model:
        parts = [client.tokenize(text, model=model) for text in texts]
        result = TokenizeResult(model=parts[0].model, tokens=[p.tokens[0] for p in parts],
                                max_model_len=parts[0].max_model_len)
    else:
        result = client.tokenize(texts)
    if as_json:
        out.write(json.dumps({"model": result.model,
                              "tokens": [[dataclasses.asdict(t) for t in tokens] for tokens in result.tokens]}) + "\n")
    else:
        for tokens in result.tokens:
            out.write(f"{len(tokens)} tokens: " + " ".join(f"{t.text}({t.id})" for t in tokens) + "\n")
    return result


def adapters(client: Client, action: str, name: str = "", path: str = "", replace: bool = False,
             as_json: bool = False, out=sys.stdout):
    if action == "load":
        info = client.load_adapter(name, path, replace=replace)
        out.write(f"loaded {info.name} rank={info.rank} digest={info.digest[:16]} "
                  f"targets={len(info.target_modules)}\n")
        return info
    if action == "unload":
        client.unload_adapter(name)
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


def info(client: Client, out=sys.stdout) -> ClusterInfo:
    """The cluster's info as JSON (protobuf's JSON names; unset and zero fields left out), then
    the replica table."""
    result = client.info()
    out.write(json.dumps(_json_names(dataclasses.asdict(result)), indent=2) + "\n")
    out.write(replica_table(result))
    return result


def _json_names(value):
    """protobuf's JSON mapping of a result dict: lowerCamelCase keys, empty and zero values left out."""
    if isinstance(value, dict):
        return {_camel(k): _json_names(v) for k, v in value.items() if v not in (None, 0, "", False, [], {})}
    if isinstance(value, list):
        return [_json_names(v) for v in value]
    return value


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


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
