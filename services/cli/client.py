"""Client commands against the gateway: generate, embed, rerank, adapters, info.

Synchronous grpc stubs; errors print `error: CODE: details` to stderr and exit with status 1.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import uuid
from pathlib import Path

import grpc
import torch

from services.common.server import CHANNEL_OPTIONS
from services.common.tensor import from_pb
from tessera.v1 import (
    adapters_pb2,
    decoder_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    pooling_pb2,
    vision_pb2,
)


def connect(address: str) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address, options=CHANNEL_OPTIONS))


def build_generate_request(prompt: str, *, chat: bool, max_tokens: int, temperature: float, top_p: float,
                           top_k: int, seed: int | None, lora: str, images: list[Path],
                           stop: list[str]) -> decoder_pb2.GenerateRequest:
    """Images come before the text, as one user turn (chat) or one raw prompt."""
    parts = [decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data=Path(p).read_bytes())) for p in images]
    parts.append(decoder_pb2.ContentPart(text=prompt))
    sampling = decoder_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                          top_k=top_k, stop=stop)
    if seed is not None:
        sampling.seed = seed
    request = decoder_pb2.GenerateRequest(request_id=uuid.uuid4().hex, sampling=sampling, lora=lora)
    if chat:
        request.messages.append(decoder_pb2.ChatMessage(role="user", content=parts))
    else:
        request.prompt.extend(parts)
    return request


def generate(stub, request: decoder_pb2.GenerateRequest, as_json: bool, out=sys.stdout) -> dict:
    """Stream the answer (text deltas as they arrive) or collect it into one JSON object."""
    token_ids, texts, finish, usage = [], [], "", None
    for response in stub.Generate(request):
        token_ids.extend(response.token_ids)
        texts.append(response.text)
        if not as_json and response.text:
            out.write(response.text)
            out.flush()
        if response.finish_reason:
            finish, usage = response.finish_reason, response.usage
    result = {
        "request_id": request.request_id, "token_ids": token_ids, "text": "".join(texts), "finish_reason": finish,
        "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                  "total_tokens": usage.total_tokens, "image_tokens": usage.image_tokens,
                  "cached_prompt_tokens": usage.cached_prompt_tokens} if usage else {},
    }
    out.write(json.dumps(result) + "\n" if as_json else "\n")
    return result


def embed(stub, texts: list[str], as_json: bool, out=sys.stdout) -> torch.Tensor:
    response = stub.Embed(pooling_pb2.EmbedRequest(inputs=texts))
    vectors = from_pb(response.embeddings)
    if as_json:
        out.write(json.dumps({"model": response.model, "embeddings": vectors.tolist(),
                              "usage": {"prompt_tokens": response.usage.prompt_tokens}}) + "\n")
        return vectors
    out.write(f"{response.model}: {len(texts)} x {vectors.shape[1]} embeddings, "
              f"{response.usage.prompt_tokens} tokens\n")
    if len(texts) > 1:
        similarity = vectors @ vectors.T
        labels = [t if len(t) <= 28 else t[:25] + "..." for t in texts]
        out.write("cosine similarity\n" + " " * 30 + "".join(f"{i:>8}" for i in range(len(texts))) + "\n")
        for i, label in enumerate(labels):
            out.write(f"{i:>2} {label:<27}" + "".join(f"{v:>8.3f}" for v in similarity[i].tolist()) + "\n")
    return vectors


def rerank(stub, query: str, documents: list[str], top_n: int | None, as_json: bool, out=sys.stdout):
    request = pooling_pb2.RerankRequest(query=query, documents=documents, return_documents=True)
    if top_n is not None:
        request.top_n = top_n
    response = stub.Rerank(request)
    results = [{"index": r.index, "score": r.score, "document": r.document} for r in response.results]
    if as_json:
        out.write(json.dumps({"model": response.model, "method": response.method, "results": results}) + "\n")
    else:
        out.write(f"{response.model} ({response.method})\n")
        for rank, r in enumerate(results, 1):
            out.write(f"{rank:>2}. [{r['index']}] {r['score']:.4f}  {r['document']}\n")
    return response


def _admin_metadata(token: str | None) -> list[tuple[str, str]]:
    token = token if token is not None else os.environ.get("TESSERA_ADMIN_TOKEN", "")
    return [("authorization", f"Bearer {token}")] if token else []


def adapters(stub, action: str, name: str = "", path: str = "", replace: bool = False,
             admin_token: str | None = None, as_json: bool = False, out=sys.stdout):
    metadata = _admin_metadata(admin_token)
    if action == "load":
        info = stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name=name, path=path, replace=replace),
                                metadata=metadata)
        out.write(f"loaded {info.name} rank={info.rank} digest={info.digest[:16]} "
                  f"targets={len(info.target_modules)}\n")
        return info
    if action == "unload":
        stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name=name), metadata=metadata)
        out.write(f"unloaded {name}\n")
        return None
    listing = stub.ListAdapters(adapters_pb2.ListAdaptersRequest())
    rows = [{"name": a.name, "digest": a.digest, "rank": a.rank, "state": a.state, "generation": a.generation,
             "target_modules": list(a.target_modules), "path": a.path} for a in listing.adapters]
    if as_json:
        out.write(json.dumps(rows) + "\n")
    else:
        for row in rows or []:
            out.write(f"{row['name']:<20} rank={row['rank']:<3} {row['state']:<8} {row['digest'][:16]}  "
                      f"{row['path']}\n")
        if not rows:
            out.write("no adapters loaded\n")
    return listing


def info(stub, out=sys.stdout) -> gateway_pb2.ClusterInfo:
    from google.protobuf import json_format

    response = stub.GetInfo(gateway_pb2.ClusterInfoRequest())
    out.write(json_format.MessageToJson(response, indent=2) + "\n")
    out.write(replica_table(response))
    return response


def replica_table(info: gateway_pb2.ClusterInfo) -> str:
    """One line per replica: service, address, health, requests, queue, KV usage, resident adapters."""
    lines = [f"{'replica':<8} {'address':<22} {'health':<18} {'sent':>6} {'now':>4} {'run':>4} {'wait':>4} "
             f"{'kv':>5}  adapters"]
    for r in info.replicas:
        health = "SERVING" if r.ready else f"not ready ({r.state})"
        d = r.decoder
        known = r.service == "decoder" and d.num_blocks > 0
        kv = f"{1 - d.num_free_blocks / d.num_blocks:5.0%}" if known else f"{'-':>5}"
        queue = f"{d.num_running:>4} {d.num_waiting:>4}" if known else f"{'-':>4} {'-':>4}"
        adapters = ",".join(d.resident_adapters) if known else ""
        lines.append(f"{r.service:<8} {r.address:<22} {health:<18} {r.num_requests:>6} {r.num_outstanding:>4} "
                     f"{queue} {kv}  {adapters or '-'}")
    return "\n".join(lines) + "\n"


def b64_to_vector(text: str) -> torch.Tensor:
    """Decode one base64 little-endian float32 embedding."""
    import numpy as np

    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<f4").copy())
