"""TEI's answers from the pooling service's messages.
"""

from __future__ import annotations

from services.gateway.http.tei.protocol import TeiClassifierModel, TeiEmbeddingModel, TeiInfo
from tessera.v1 import pooling_pb2


def tei_ranks(reply: pooling_pb2.RerankResponse) -> list[dict]:
    """TEI's answer: [{index, score, text?}], highest score first (`text` only when asked for)."""
    return [{"index": r.index, "text": r.document, "score": r.score} if r.document else {"index": r.index, "score": r.score}
            for r in reply.results]


def tei_info(info: pooling_pb2.PoolingInfo, version: str) -> TeiInfo:
    """TEI's /info for the pooling service's default model."""
    entry = next((m for m in info.models if m.model == info.model), None)
    kind = entry.kind if entry else "embedding"
    model_type = ({"embedding": TeiEmbeddingModel(pooling=info.pooling_mode)} if kind == "embedding"
                  else {"reranker": TeiClassifierModel(id2label={}, label2id={})})
    return TeiInfo(model_id=info.model, served_model_name=info.model, model_type=model_type,
                          max_concurrent_requests=info.max_queue_size, max_input_length=info.max_input_length,
                          max_batch_tokens=info.max_batch_tokens, max_client_batch_size=info.max_batch_size,
                          version=version)
