"""The pooling core: validated Embed / Rerank / Tokenize over several served models (no gRPC types here).

Each model has a tokenizer, a runner (one padded forward) and a `DynamicBatcher` that gathers
sequences from concurrent requests under a token budget; one device lock serializes forwards
across models. Tokenization runs in worker threads, outside that lock, so the event loop keeps
answering health checks meanwhile.

Rerank methods: "cross-encoder" (a trained classification head over the tokenizer's pair
encoding), "llm-judge" (a causal LM's yes/no LM-head rows on a Qwen3-Reranker prompt) and
"bi-encoder" (cosine of normalized embeddings, as vLLM's score API does for embedding models).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from services.common.compute import shared_compute_thread
from services.common.device import resolve_device
from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.pooling.batcher import DynamicBatcher
from services.pooling.config import EMBEDDING, ModelConfig, PoolingConfig
from services.pooling.pooling import normalize as unit_normalize
from services.pooling.runners import PoolingRunner, load_runner
from services.pooling.tokens import JUDGE_TRUNCATE_HINT, RERANK_TRUNCATE_HINT, ModelTokenizer, Sequence
from services.pooling.types import Embeddings, EmbedQuery, ModelInfo, PoolingInfo, RankedDocument, Ranking, Tokenization

log = logging.getLogger(__name__)

BI_ENCODER = "bi-encoder"
_STREAM_WINDOW = 64  # EmbedStream requests in flight per call


@dataclass
class ServedModel:
    """A loaded model: its config, tokenizer, runner and batcher."""

    config: ModelConfig
    tokenizer: ModelTokenizer
    runner: PoolingRunner
    batcher: DynamicBatcher | None = None

    @property
    def name(self) -> str:
        return self.config.model_name


def load_served_model(config: ModelConfig, device: str = "cpu") -> ServedModel:
    """Tokenizer + runner for one model (seconds; blocking)."""
    tokenizer = ModelTokenizer(config.model_dir, config.max_input_length, config.do_lower_case)
    return ServedModel(config=config, tokenizer=tokenizer, runner=load_runner(config, tokenizer, device))


class PoolingEngine:
    """Embeddings, reranking and tokenization for the models of a `PoolingConfig`.

    Await `start()` (the server does, before reporting SERVING: `load()` on `self.compute`, where the
    weights are touched first), call `load()` (blocking) or pass already loaded `models` (by name,
    e.g. shared between tests). Requests before that raise `Unavailable`.
    """

    def __init__(self, config: PoolingConfig, models: dict[str, ServedModel] | None = None):
        self.config = config
        self.compute = shared_compute_thread()
        self._models: dict[str, ServedModel] = {}
        self._name_to_model = config.model_names()  # every accepted name (aliases too) -> the model's name
        if models is not None:
            self._install(models)

    def load(self) -> None:
        """Load every configured model on the configured device and run one tiny batch through each
        (`warm_up`), so a model that cannot compute there fails the start, never a request
        (seconds per model; blocking).

        Raises:
            ValueError: the device is not on this machine, or a model's warm-up forward failed
                (one line naming the model, the device and the cause; the traceback is logged).
        """
        if not self._models:
            device = resolve_device(self.config.device)
            self._install({m.model_name: load_served_model(m, str(device)) for m in self.config.models})
            self.warm_up(device)

    async def start(self) -> None:
        """`load()` on the compute thread (raises as `load`)."""
        await self.compute.run(self.load)

    async def stop(self) -> None:
        """Nothing to release: the compute thread is the process's."""

    def warm_up(self, device: torch.device) -> None:
        """One forward of a one-text batch through every loaded model (`load` calls it)."""
        for served in self._models.values():
            try:
                rows = served.runner.forward(served.tokenizer.encode_texts(["warm-up"], truncate=True))
                if not bool(torch.isfinite(rows).all()):
                    raise RuntimeError(f"its output is not finite: {rows.flatten()[:4].tolist()}")
            except Exception as error:  # whatever the forward raises means it cannot serve
                log.error("pooling: the warm-up forward of %s failed", served.name, exc_info=error)
                cause = next(iter(str(error).strip().splitlines()), "")
                raise ValueError(f"the warm-up forward of model {served.name!r} failed on --device "
                                 f"{self.config.device} ({device}): {type(error).__name__}: {cause}") from error

    def _install(self, models: dict[str, ServedModel]) -> None:
        c = self.config
        for model_config in c.models:
            loaded = models[model_config.model_name]
            # a fresh batcher per service, with this service's limits; the loaded weights are shared
            batcher = DynamicBatcher(model_config.model_name, loaded.runner.forward, self.compute,
                                     c.max_batch_tokens, c.max_wait_ms / 1000.0, c.max_queue_size, c.dynamic_batching,
                                     c.wedged_after_s)
            self._models[model_config.model_name] = ServedModel(model_config, loaded.tokenizer, loaded.runner, batcher)

    def health(self) -> str | None:
        """None while every model's batcher works (or before loading); else the first reason why not."""
        return next((reason for served in self._models.values() if (reason := served.batcher.health())), None)

    # -- embed -------------------------------------------------------------------------------------

    async def embed(self, texts: list[str] | None = None, **fields) -> Embeddings:
        """`embed_query(EmbedQuery(texts=..., **fields))`."""
        return await self.embed_query(EmbedQuery(texts=tuple(texts or ()), **fields))

    async def embed_query(self, query: EmbedQuery) -> Embeddings:
        """Embed a request's inputs (gathered with other requests' inputs into shared forwards).

        Raises:
            NotFound: a model that is neither a served model's name nor an alias.
            InvalidArgument: the model is a reranker; no inputs or both texts and ids; an empty input;
                more than max_batch_size inputs; an input past max_input_length without truncate;
                `dimensions` on a model not trained for Matryoshka, or outside its widths; an unknown prompt.
            ResourceExhausted: the model's queue is full.
            Unavailable: the models are not loaded yet.
        """
        served = self._embedding_model(query.model)
        inputs = query.texts or query.token_ids
        if query.texts and query.token_ids:
            raise InvalidArgument("send either inputs (text) or input_ids, not both")
        self._check_inputs(list(inputs), "inputs" if query.texts or not query.token_ids else "input_ids")
        self._check_dimensions(served, query.dimensions)
        sequences = await asyncio.to_thread(self._tokenize_query, served, query)
        vectors = await served.batcher.submit(sequences)  # [N, H]
        if query.dimensions is not None:
            vectors = vectors[:, : query.dimensions]  # Matryoshka: the leading components, then normalize
        if served.config.normalize if query.normalize is None else query.normalize:
            vectors = unit_normalize(vectors)
        return Embeddings(model=served.name, vectors=vectors, num_prompt_tokens=sum(map(len, sequences)))

    async def embed_stream(self, queries: AsyncIterator[EmbedQuery]) -> AsyncIterator[Embeddings]:
        """One `Embeddings` per query, in query order; up to 64 queries are in flight at once, so a
        stream of single texts is batched like as many concurrent clients.

        Raises:
            the errors of `embed_query`, for the first failing query (the stream stops there).
        """
        pending: asyncio.Queue = asyncio.Queue(maxsize=_STREAM_WINDOW)
        read_error: list[BaseException] = []

        async def read() -> None:
            try:
                async for query in queries:
                    await pending.put(asyncio.ensure_future(self.embed_query(query)))
            except Exception as error:  # re-raised to the caller below
                read_error.append(error)
            finally:
                await pending.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (task := await pending.get()) is not None:
                yield await task
            if read_error:
                raise read_error[0]
        finally:
            reader.cancel()
            while not pending.empty():
                task = pending.get_nowait()
                if task is not None:
                    task.cancel()

    def _tokenize_query(self, served: ServedModel, query: EmbedQuery) -> list[Sequence]:
        if query.token_ids:
            return served.tokenizer.encode_ids([list(ids) for ids in query.token_ids], truncate=query.truncate,
                                               direction=query.truncation_direction)
        prefix = self._prompt(served, query.prompt_name)
        return served.tokenizer.encode_texts([prefix + t for t in query.texts], truncate=query.truncate,
                                             direction=query.truncation_direction)

    def _check_dimensions(self, served: ServedModel, dimensions: int | None) -> None:
        if dimensions is None:
            return
        c = served.config
        if not c.is_matryoshka:
            raise InvalidArgument(f"model {served.name!r} was not trained for Matryoshka truncation; leave dimensions "
                                  f"unset (it returns {served.runner.dimension} dimensions)")
        allowed = c.matryoshka_dimensions
        if allowed and dimensions not in allowed:
            raise InvalidArgument(f"dimensions {dimensions} is not one of model {served.name!r}'s trained widths {list(allowed)}")
        if not 1 <= dimensions <= served.runner.dimension:
            raise InvalidArgument(f"dimensions must be between 1 and {served.runner.dimension}, got {dimensions}")

    def _prompt(self, served: ServedModel, prompt_name: str) -> str:
        prompts = served.config.prompts
        name = prompt_name or served.config.default_prompt_name
        if not name:
            return ""
        if name not in prompts:
            raise InvalidArgument(f"model {served.name!r} has no prompt {name!r}; its prompts are {sorted(prompts)}")
        return prompts[name]

    # -- rerank ------------------------------------------------------------------------------------

    async def rerank(self, query: str, documents: list[str], top_n: int | None = None, return_documents: bool = False,
                     model: str = "", raw_scores: bool = False, method: str = "", truncate: bool = False,
                     truncation_direction: str = "right") -> Ranking:
        """Score each document against `query` with the model's method; sorted by descending score, ties by index.

        Args:
            top_n: results to return, >= 1; None or more than len(documents) = all (clamped, as TEI and vLLM do).
            raw_scores: cross-encoder / llm-judge: the logit instead of its sigmoid.
            method: "" or the method the request requires; a mismatch is refused (e.g. "cross-encoder"
                on an embedding-only model).
            truncate: cut what is past max_input_length instead of refusing it: a cross-encoder's
                (query, document) pair from the longer of the two first (CrossEncoder's "longest_first"),
                a bi-encoder's query and each document on their own; an llm-judge prompt is never cut
                (its template's end must stay), a long one is refused all the same.
            truncation_direction: "right" keeps the first tokens, "left" the last (TEI's).

        Raises:
            NotFound: a model that is neither a served model's name nor an alias.
            InvalidArgument: empty query, no documents, an empty document, more than max_batch_size
                documents, top_n < 1, an input (or pair) past max_input_length without `truncate`,
                a judge prompt past it, a method the model does not have, an unknown direction.
            ResourceExhausted: the model's queue is full.
        """
        served = self._rerank_model(model)
        if method and method != served.runner.method:
            raise InvalidArgument(f"model {served.name!r} is a {served.config.kind} model and reranks by "
                                  f"{served.runner.method!r}; {method!r} needs a model with that head")
        if not query:
            raise InvalidArgument("query must be a non-empty string")
        self._check_inputs(documents, "documents", extra_chars=len(query))
        if top_n is not None and top_n < 1:
            raise InvalidArgument(f"top_n must be >= 1 (or unset for all {len(documents)} documents), got {top_n}")
        scores, num_tokens = await self._scores(served, query, documents, raw_scores, truncate, truncation_direction)
        order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))
        results = [RankedDocument(index=i, score=scores[i], document=documents[i] if return_documents else None)
                   for i in order[:top_n]]
        return Ranking(model=served.name, results=results, method=served.runner.method, num_prompt_tokens=num_tokens)

    async def _scores(self, served: ServedModel, query: str, documents: list[str], raw: bool, truncate: bool,
                      direction: str) -> tuple[list[float], int]:
        labels = [f"document {i}" for i in range(len(documents))]
        cut = {"truncate": truncate, "direction": direction}
        if served.config.kind == EMBEDDING:
            prompts = served.config.prompts
            texts = [prompts.get("query", "") + query, *(prompts.get("document", "") + d for d in documents)]
            sequences = await asyncio.to_thread(served.tokenizer.encode_texts, texts, labels=["query", *labels],
                                                hint=RERANK_TRUNCATE_HINT, **cut)
            vectors = unit_normalize(await served.batcher.submit(sequences))  # [1 + N, D]
            return (vectors[1:] @ vectors[0]).tolist(), sum(map(len, sequences))
        if served.runner.method == "cross-encoder":
            pairs = [f"the pair (query, document {i})" for i in range(len(documents))]
            sequences = await asyncio.to_thread(served.tokenizer.encode_pairs, query, documents, pairs, **cut)
        else:
            c = served.config
            prompts = [c.judge_template.format(instruction=c.judge_instruction, query=query, document=d) for d in documents]
            judged = [f"the judge prompt of the query and document {i}" for i in range(len(documents))]
            sequences = await asyncio.to_thread(served.tokenizer.encode_texts, prompts, add_special_tokens=False,
                                                labels=judged, hint=JUDGE_TRUNCATE_HINT, direction=direction)
        logits = await served.batcher.submit(sequences)  # [N]
        scores = logits if raw else torch.sigmoid(logits)
        return scores.tolist(), sum(map(len, sequences))

    # -- tokenize, info ----------------------------------------------------------------------------

    async def tokenize(self, texts: list[str], model: str = "", add_special_tokens: bool = True,
                       prompt_name: str = "") -> Tokenization:
        """The model's tokens for each text (prompt prefix included when named).

        Raises:
            NotFound: neither a model's name nor an alias.
            InvalidArgument: no texts, an empty text, more than max_batch_size, an unknown prompt.
        """
        served = self._model(model, self._default_embedding_name())
        self._check_inputs(texts, "inputs")
        prefix = self._prompt(served, prompt_name)
        tokens = await asyncio.to_thread(served.tokenizer.tokens, [prefix + t for t in texts], add_special_tokens)
        return Tokenization(model=served.name, results=tokens)

    def info(self) -> PoolingInfo:
        models = [self._model_info(self._model(m.model_name, "")) for m in self.config.models]
        default = next(m for m in models if m.model == self._default_embedding_name())
        rerank_default = self._rerank_model("")
        c = self.config
        return PoolingInfo(
            model=default.model, pooling_mode=default.pooling_mode, normalize=default.normalize,
            dimension=default.dimension, max_input_length=default.max_input_length, max_batch_size=c.max_batch_size,
            rerank_method=rerank_default.runner.method, models=models, max_batch_tokens=c.max_batch_tokens,
            max_queue_size=c.max_queue_size, max_wait_ms=c.max_wait_ms, dynamic_batching=c.dynamic_batching)

    @property
    def models(self) -> Mapping[str, ServedModel]:
        """The loaded models by name (empty before `load()`), each with its config, tokenizer, runner
        and batcher; a read-only view."""
        return MappingProxyType(self._models)

    def queue_sizes(self) -> dict[str, int]:
        """Sequences accepted and not yet in a forward, by model name (empty before `load()`)."""
        return {name: served.batcher.num_waiting for name, served in self._models.items()}

    def batcher_stats(self) -> list:
        """Each model's `BatcherStats` (services/pooling/stats.py; empty before `load()`)."""
        return [served.batcher.stats for served in self._models.values()]

    @staticmethod
    def _model_info(served: ServedModel) -> ModelInfo:
        c = served.config
        pooling_mode = {"cross-encoder": "cls", "llm-judge": "last"}.get(c.kind, c.pooling_mode)
        return ModelInfo(model=c.model_name, kind=c.kind, pooling_mode=pooling_mode, normalize=c.normalize,
                         dimension=served.runner.dimension, max_input_length=c.max_input_length,
                         rerank_method=served.runner.method, matryoshka=c.is_matryoshka,
                         matryoshka_dimensions=c.matryoshka_dimensions, prompts=dict(c.prompts), aliases=c.aliases)

    # -- model lookup and input checks ---------------------------------------------------------------

    def _default_embedding_name(self) -> str:
        return next((m.model_name for m in self.config.models if m.kind == EMBEDDING), self.config.models[0].model_name)

    def _embedding_model(self, name: str) -> ServedModel:
        served = self._model(name, self._default_embedding_name())
        if served.config.kind != EMBEDDING:
            raise InvalidArgument(f"model {served.name!r} is a {served.config.kind} reranker; Embed needs an "
                                  f"embedding model ({self._names(EMBEDDING)})")
        return served

    def _rerank_model(self, name: str) -> ServedModel:
        default = next((m.model_name for m in self.config.models if m.kind != EMBEDDING), self.config.models[0].model_name)
        return self._model(name, default)

    def _model(self, name: str, default: str) -> ServedModel:
        """The model `name` (its name or an alias; "" = `default`) addresses."""
        if not self._models:
            raise Unavailable("the pooling models are still loading")
        served = self._models.get(self._name_to_model.get(name or default, ""))
        if served is None:
            raise NotFound(f"model {name!r} is not served here; this pooling service serves "
                           f"{sorted(self._name_to_model)}")
        return served

    def _names(self, kind: str) -> list[str]:
        return [m.model_name for m in self.config.models if m.kind == kind]

    def _check_inputs(self, inputs: list, what: str, extra_chars: int = 0) -> None:
        """Count, emptiness (an empty text or id list) and (texts) size checks; `extra_chars`: other text of the request (a rerank query)."""
        if not inputs:
            raise InvalidArgument(f"{what} is empty; send at least one text", field=what)
        if len(inputs) > self.config.max_batch_size:
            raise InvalidArgument(f"request has {len(inputs)} {what}; max_batch_size is {self.config.max_batch_size}",
                                  field=what)
        for index, item in enumerate(inputs):
            if not item and isinstance(item, str):
                raise InvalidArgument(f"{what}[{index}] is an empty string; every input must hold text",
                                      field=f"{what}[{index}]")
            if not item:
                raise InvalidArgument(f"{what}[{index}] is an empty id list; every input must hold at least one "
                                      "token id", field=f"{what}[{index}]")
        chars = extra_chars + sum(len(item) for item in inputs if isinstance(item, str))
        if chars > self.config.max_request_chars:
            raise InvalidArgument(f"request holds {chars} characters of text; the limit is "
                                  f"{self.config.max_request_chars} (max_request_chars)")

