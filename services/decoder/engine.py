"""The engine: owns model, cache, scheduler and adapter bank; a background thread steps it.

Lifecycle: `LLMEngine(config, adapters)` builds nothing; `await start()` loads the model on the
engine thread and starts the adapter source (adapter_source.py) on the caller's loop; `await
stop()` closes the source and ends the thread. `health()` and `info()` report on it. The engine
knows no transport: the servicer converts protobuf to the domain types (types.py) and back.

`generate(...)` (asyncio) validates and submits a request and yields `RequestOutput`s that the
engine thread hands over with `loop.call_soon_threadsafe`, once per step. Leaving the iterator
early (client cancel, deadline, disconnect) aborts the request: its blocks and adapter lease are
freed before the next step.

Request lifecycle points: arrival (`_admit`), each token (`_append_token`), finish or abort
(`_finish` / `_retire`); preemption is the scheduler's (scheduler.py).

The whole step is guarded: an error in scheduling, the forward, the scheduler's update or token
bookkeeping fails that step's requests (their blocks and leases come back) and the loop goes on.
Should the thread stop anyway, every pending and later request fails at once with UNAVAILABLE
naming the cause, and `health()` says so (as it does when steps stop completing: `Liveness`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoTokenizer

from services.common.compute import claim_intra_op_threads
from services.common.errors import InvalidArgument, Unavailable
from services.common.liveness import Liveness
from services.decoder.adapter_source import AdapterSource, InMemoryAdapterSource
from services.decoder.block_manager import BlockManager
from services.decoder.config import DecoderConfig
from services.decoder.detokenizer import IncrementalDetokenizer
from services.decoder.kv_cache import KVCache
from services.decoder.lora import AdapterSlots, LoRAContext, target_shapes
from services.decoder.lora.registry import make_backend
from services.decoder.model_qwen2_vl import VisionTokens, is_qwen2_vl, text_config
from services.decoder.model_runner import ModelRunner
from services.decoder.models import load_model
from services.decoder.multimodal import PromptBuilder
from services.decoder.prefix_cache import BlockHasher
from services.decoder.request import PromptLogprobs, Request, RequestStatus
from services.decoder.sampler import make_generator
from services.decoder.scheduler import Scheduler
from services.decoder.stats import DecoderStats
from services.decoder.token_text import TokenTexts
from services.decoder.tokens import check_chat_template, detokenize, tokenize
from services.decoder.types import (
    DecoderInfo,
    EngineStats,
    GenerateInput,
    RequestOutput,
    Sample,
    SamplingParams,
    Tokenization,
    TokenizeInput,
    Usage,
)
from services.decoder.warmup import warm_up

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Where a request's outputs go: an asyncio queue on the caller's loop. `request` and
    `prompt_text` (None = the prompt is not returned) fill the choice's first output."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer
    request: Request
    prompt_text: str | None = None
    started: bool = False  # the first output has been emitted


class LLMEngine:
    """Continuous batching over one model. `adapters` resolves the LoRA adapter a request names
    (default: an empty `InMemoryAdapterSource`, so every name is NotFound)."""

    def __init__(self, config: DecoderConfig, adapters: AdapterSource | None = None) -> None:
        self.config = config
        self.adapters = adapters if adapters is not None else InMemoryAdapterSource()
        self.dtype = getattr(torch, config.dtype)
        self.device = config.torch_device  # weights, KV cache, adapter slots, sampling generators
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._requests: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # engine thread only
        self._stopped = False
        self.liveness = Liveness("the decoder engine", config.wedged_after_s)
        self.metrics = DecoderStats(config.served_model_names[0])
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.started = False  # the model is loaded and the engine thread steps

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Load the model on the engine thread (the process's one multi-threaded torch thread, see
        services/common/compute.py) and run one warm-up step through every configured backend
        (`_warm_up`), then start the adapter source on the running loop. Returns once both are
        ready; load and warm-up errors are raised here (ValueError: a configuration that cannot run)."""
        # read on the loop's thread: the worker waiting for the load never touches torch threading
        num_threads = torch.get_num_threads()
        await asyncio.to_thread(self._launch, num_threads)
        await self.adapters.start(self.bank)
        self.started = True

    async def stop(self) -> None:
        """Close the adapter source and end the engine thread."""
        await self.adapters.close()
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """End the engine thread (blocks up to 10 s); the adapter source stays open."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _launch(self, num_threads: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(num_threads,), name="decoder-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def _build(self) -> None:
        config = self.config
        self.model_config = dict(config.checkpoint.raw)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
        self.token_texts = TokenTexts(self.tokenizer)
        check_chat_template(self.tokenizer)  # before the weights: a template that never finishes is refused
        self.eos_token_ids = self._eos_token_ids()
        self.model = load_model(config.checkpoint, self.dtype, config.mrope_section).to(self.device)
        self.model.rotary.to(self.device)  # a plain table, not a module buffer: model.to() leaves it
        spec = self.model.spec
        self.cache = KVCache(spec.num_layers, config.num_blocks, config.block_size, spec.num_kv_heads,
                             spec.head_dim, self.dtype, self.device)
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_waiting)
        self.bank = AdapterSlots(config.adapter_slots, config.max_lora_rank, target_shapes(self.model), self.dtype,
                                 self.device)
        self.image_token_id = self._image_token_id()
        vision = VisionTokens.from_config(self.model_config) if is_qwen2_vl(self.model_config) else None
        self.prompts = PromptBuilder(self.tokenizer, spec.vocab_size, spec.hidden_size,
                                     config.mrope_section, self.image_token_id,
                                     vision.start if vision else None, vision.end if vision else None,
                                     compute_dtype=self.dtype)
        self.runner = ModelRunner(self.model, self.cache, self.block_manager,
                                  LoRAContext(self.bank, make_backend(config.lora_backend)),
                                  config.mrope_section is not None, config.attention_backend,
                                  config.linear_backend)
        self._warm_up()

    def _warm_up(self) -> None:
        """One real prefill and decode step through the configured backends (warmup.py), before
        `start` returns and health says SERVING.

        Raises:
            ValueError: the step failed: this configuration cannot run here. One line naming the
                device, both backends and the cause; the traceback is logged.
        """
        config = self.config
        try:
            warm_up(self.scheduler, self.runner, self.bank,
                    min(config.num_blocks * config.block_size, config.max_model_len), self.device)
        except Exception as error:  # noqa: BLE001 - whatever a backend raises means it cannot serve
            log.error("the decoder's warm-up step failed", exc_info=error)
            cause = next(iter(str(error).strip().splitlines()), "")
            raise ValueError(f"the warm-up step failed on --device {config.device} ({self.device}) with "
                             f"--attention-backend {config.attention_backend}, --lora-backend "
                             f"{config.lora_backend} and --linear-backend {config.linear_backend}: "
                             f"{type(error).__name__}: {cause}") from error

    # ---- setup helpers -------------------------------------------------------------------
    def _image_token_id(self) -> int | None:
        if self.config.mrope_section is None:
            return None
        if self.config.image_token is None:
            return int(self.model_config["image_token_id"])
        token_id = self.tokenizer.convert_tokens_to_ids(self.config.image_token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"image_token {self.config.image_token!r} is not in the vocabulary")
        return int(token_id)

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        sources = [text_config(self.model_config).get("eos_token_id")]
        gen_path = Path(self.config.model_dir) / "generation_config.json"
        if gen_path.is_file():
            sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
        for value in sources:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
        return ids

    # ---- public API ----------------------------------------------------------------------
    async def generate(self, request_input: GenerateInput) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs; the last one carries finish_reason and usage.

        `request_input.lora` names an adapter, leased from the adapter source for the request's
        life. Raises (before the first output): InvalidArgument (bad prompt, too long, a stop token
        id outside the vocabulary, min_tokens past what an unset max_tokens allows), NotFound /
        FailedPrecondition / Unavailable (adapter), ResourceExhausted (waiting queue full),
        Unavailable (still loading, or the engine thread has stopped; also raised mid-stream when
        it stops). With every adapter slot leased the admission waits for one to free.
        """
        self._check_serving()
        vocab_size = self.prompts.vocab_size
        bad = [t for t in request_input.sampling.stop_token_ids if not 0 <= t < vocab_size]
        if bad:  # a stop that can never be sampled is a caller's mistake, as a prompt id past the vocabulary is
            raise InvalidArgument(f"sampling.stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size})")
        prompt = await asyncio.to_thread(self.prompts.build, request_input)
        request_input = replace(request_input, sampling=self._resolve_sampling(len(prompt.token_ids),
                                                                               request_input.sampling))
        prompt_text = None
        if request_input.return_prompt:  # as vLLM's echo of token prompts: special tokens kept
            prompt_text = await asyncio.to_thread(self.tokenizer.decode, prompt.token_ids, skip_special_tokens=False)
        slot = await self.adapters.acquire(request_input.lora) if request_input.lora else None
        requests = self._make_requests(request_input, prompt, slot, request_input.lora)
        queue: asyncio.Queue = asyncio.Queue()
        self._admit(requests, prompt.token_ids, queue, prompt_text)
        num_finished = 0
        try:
            while num_finished < len(requests):
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                num_finished += output.finish_reason is not None
                yield output
        finally:
            if num_finished < len(requests):
                for request in requests:
                    self.abort(request.key)

    def _admit(self, requests: list[Request], prompt_ids: list[int], queue: asyncio.Queue,
               prompt_text: str | None = None) -> None:
        """Hand `requests` to the scheduler; their outputs go to `queue` on the running loop (each
        choice's first with `prompt_text` and the prompt's ids, unless None). On a refusal (queue
        full, dead engine) their leases are given back and the error raised."""
        loop = asyncio.get_running_loop()
        try:
            with self._cond:
                self.liveness.raise_if_dead()  # under the lock: a dying engine fails what it holds, or we see it
                self.scheduler.add(*requests)
                self.metrics.on_arrival(requests)
                for request in requests:
                    self._requests[request.key] = request
                    self._streams[request.key] = _Stream(loop, queue, IncrementalDetokenizer(
                        self.tokenizer, prompt_ids, request.sampling), request, prompt_text)
                self._cond.notify()
        except BaseException:
            for request in requests:
                if request.lora_slot is not None:
                    self.adapters.release(request.lora_slot, request.lora_name)
            raise

    def _make_requests(self, request_input: GenerateInput, prompt, slot: int | None, lease_name: str) -> list[Request]:
        """The n choices: choice i samples with seed + i and holds its own adapter lease on `slot`
        (taken as `lease_name`); choices after the first wait for it to compute the prompt, then
        share its blocks and its prompt logprobs (one record for all)."""
        params, requests = request_input.sampling, []
        digest = None if slot is None else self.bank.digest_of(slot)
        record = (None if params.prompt_logprobs is None
                  else PromptLogprobs(params.prompt_logprobs, len(prompt.token_ids)))
        for index in range(params.n):
            key = uuid.uuid4().hex
            lease = slot if index == 0 or slot is None else self.bank.acquire(digest, lease_name)
            seed = None if params.seed is None else params.seed + index
            requests.append(Request(key, request_input.request_id or key, prompt, params, lease,
                                    None if params.greedy else make_generator(seed, self.device), self._hasher(prompt, slot),
                                    index=index, parent=requests[0] if requests else None, lora_name=lease_name,
                                    prompt_logprobs=record))
        return requests

    def abort(self, key: str) -> None:
        """Abort a request by its engine key (its caller is gone: nothing more is sent to it).

        A waiting request leaves the queue at once, so it never holds a place that admission
        control (max_waiting) refuses others for; a running one is finished, its blocks and
        lease freed, before the next step.
        """
        with self._cond:
            request = self._requests.get(key)
            if request is not None and request.status is RequestStatus.WAITING:
                self._retire(request, "abort")
            else:
                self._aborts.add(key)
            self._cond.notify()

    def health(self) -> str | None:
        """None while the engine thread runs and completes steps (or is still loading: a service
        says NOT_SERVING until `start` returns anyway); else why not (see `Liveness`)."""
        if not self.started:
            return None
        return self.liveness.check(bool(self._aborts) or self.scheduler.has_work())

    def info(self) -> DecoderInfo:
        """The served model and the engine's load now. Raises Unavailable while still loading."""
        self._check_serving(dead_ok=True)
        spec = self.model.spec
        names = self.config.served_model_names
        return DecoderInfo(model=names[0], architecture=spec.architecture,
                           dtype=self.config.dtype, max_model_len=self.config.max_model_len,
                           vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, block_size=self.config.block_size,
                           mrope_section=tuple(self.config.mrope_section or ()), image_token_id=self.image_token_id,
                           stats=self.stats(), resident_adapters=self.adapters.resident_names(),
                           served_model_names=names, generation_config=self.config.generation_config,
                           generation_defaults=self.config.generation_defaults.as_dict())

    async def tokenize(self, request: TokenizeInput) -> Tokenization:
        """`request` tokenized by the model's tokenizer (services/decoder/tokens.py). Raises
        InvalidArgument (see `tokens.tokenize`), Unavailable while still loading."""
        self._check_serving(dead_ok=True)
        ids = await asyncio.to_thread(tokenize, self.tokenizer, request)
        special_ids = set(self.tokenizer.all_special_ids)
        return Tokenization(model=self.config.served_model_names[0], token_ids=ids,
                            tokens=self.tokenizer.convert_ids_to_tokens(ids), special=[i in special_ids for i in ids],
                            max_model_len=self.config.max_model_len)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`. Raises InvalidArgument (an id out of vocabulary), Unavailable
        while still loading."""
        self._check_serving(dead_ok=True)
        return await asyncio.to_thread(detokenize, self.tokenizer, token_ids, skip_special_tokens)

    def _check_serving(self, dead_ok: bool = False) -> None:
        """Raises Unavailable while the model is loading, or (unless `dead_ok`) once the engine died."""
        if not self.started:
            raise Unavailable("the decoder is still loading its model")
        if not dead_ok:
            self.liveness.raise_if_dead()

    def stats(self) -> EngineStats:
        with self._cond:
            bm = self.block_manager
            return EngineStats(bm.num_blocks, bm.num_free_blocks, len(self.scheduler.running),
                               len(self.scheduler.waiting), bm.num_cached_blocks, bm.stats.num_queries,
                               bm.stats.num_hits, bm.stats.num_hit_tokens)

    def _hasher(self, prompt, lora_slot: int | None) -> BlockHasher | None:
        """Prefix-cache hasher salted with the adapter's weight digest and the prompt's images."""
        if not self.config.enable_prefix_caching:
            return None
        digest = None if lora_slot is None else self.bank.digest_of(lora_slot)
        return BlockHasher.for_prompt(self.config.block_size, prompt, digest, self.config.mrope_section)

    def _resolve_sampling(self, num_prompt: int, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with max_tokens resolved (`_max_tokens`) and the model's EOS ids (those in the
        vocabulary, for the min_tokens mask and the stop check). Raises InvalidArgument as
        `_max_tokens`, or when min_tokens exceeds an unset max_tokens' resolved value."""
        max_tokens = self._max_tokens(num_prompt, sampling.max_tokens)
        if sampling.min_tokens > max_tokens:
            raise InvalidArgument(f"min_tokens is {sampling.min_tokens}, but max_tokens is unset and this request "
                                  f"may generate at most {max_tokens} tokens (the model's default or the rest of "
                                  "its context)")
        vocab_size = self.prompts.vocab_size
        eos_ids = tuple(sorted(t for t in self.eos_token_ids if 0 <= t < vocab_size))
        return replace(sampling, max_tokens=max_tokens, eos_token_ids=eos_ids)

    def _max_tokens(self, num_prompt: int, max_tokens: int | None) -> int:
        """`max_tokens`, or when None the served model's default (generation_config.json's
        max_new_tokens, --generation-config) capped by the rest of the context, else the rest of
        the context: max_model_len less the prompt (as vLLM), bounded by what the KV cache holds.
        Raises InvalidArgument when the prompt and max_tokens do not fit, or an unset max_tokens
        leaves no room for one generated token."""
        limit = self.config.max_model_len
        capacity = self.config.num_blocks * self.config.block_size
        if max_tokens is None:
            if num_prompt >= min(limit, capacity):
                raise InvalidArgument(f"prompt has {num_prompt} tokens; the model's context is {limit} (the KV cache "
                                      f"holds {capacity}), which leaves no room to generate a token")
            room = min(limit, capacity) - num_prompt
            default = self.config.generation_defaults.max_tokens
            return room if default is None else min(default, room)
        if num_prompt + max_tokens > limit:
            raise InvalidArgument(f"prompt has {num_prompt} tokens and max_tokens {max_tokens}; "
                                  f"the model's context is {limit}")
        if num_prompt + max_tokens > capacity:
            raise InvalidArgument(f"prompt has {num_prompt} tokens and max_tokens {max_tokens}; the KV cache "
                                  f"holds {capacity} tokens ({self.config.num_blocks} blocks of {self.config.block_size})")
        return max_tokens

    # ---- engine thread -------------------------------------------------------------------
    def _run(self, num_threads: int) -> None:
        try:
            claim_intra_op_threads(num_threads)
            self._build()
        except BaseException as error:  # noqa: BLE001 - re-raised by __init__
            self._start_error = error
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        except BaseException as cause:  # noqa: BLE001 - the thread ends here; its callers must hear why
            log.critical("the decoder engine thread stopped; failing every request", exc_info=cause)
            self._die(cause)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self._aborts and not self.scheduler.has_work():
                    self._cond.wait()
                if self._stopped:
                    return
            self._step()
            self.liveness.num_steps += 1
            self._flush()

    def _step(self) -> None:
        """Schedule and run one batch; an error fails the requests it touched, never the loop."""
        try:
            with self._cond:
                self._process_aborts()
                out = self.scheduler.schedule()
                self.metrics.on_schedule(out, self.scheduler)
        except Exception as error:  # noqa: BLE001 - fail what scheduling was working on, keep serving
            log.exception("engine step failed while scheduling")
            with self._cond:
                # admission takes waiting requests in order and moves each to running, so the request
                # being handled is running or the head of the queue; aborts pending are of running ones
                suspects = [*self.scheduler.running, *list(self.scheduler.waiting)[:1]]
                self._aborts.clear()
            self._fail(suspects, error)
            return
        self._flush()
        if not out.scheduled:
            return
        try:
            result = self.runner.execute(out)
            with self._cond:
                self.scheduler.update(out)
                for item in out.scheduled:
                    chunk = result.prompt_logprobs.get(item.request.key)
                    if chunk is not None:
                        item.request.prompt_logprobs.record(chunk.start, chunk.entries)
                    token = result.samples.get(item.request.key)
                    if isinstance(token, Exception):  # its logits were not finite
                        self._finish(item.request, "abort", error=token)
                    elif token is not None:
                        self._append_token(item.request, token)
        except Exception as error:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("engine step failed")
            self._fail([item.request for item in out.scheduled], error)

    def _fail(self, requests: list[Request], error: Exception) -> None:
        """End `requests` with `error` (those a step has not finished already), freeing their blocks
        and leases. An error here means the engine's state is broken: it ends the thread."""
        with self._cond:
            for request in requests:
                if request.key in self._requests:
                    self._finish(request, "abort", error=error)

    def _die(self, cause: BaseException) -> None:
        """Fail every request the engine holds, now and later, with Unavailable naming `cause`."""
        self.liveness.die(cause)
        error = self.liveness.dead_error()
        with self._cond:
            streams = list(self._streams.values())
            for request in list(self._requests.values()):
                try:
                    self._retire(request, "abort")  # frees blocks and the adapter lease where it still can
                except Exception:  # noqa: BLE001 - the state that killed the thread may be broken
                    log.debug("could not retire %s", request.key, exc_info=True)
            for stream in streams:
                self._emit(stream, error)
            self._requests.clear()
            self._streams.clear()
            self._aborts.clear()
            self.scheduler.running.clear()
            self.scheduler.waiting.clear()
        self._flush()

    def _process_aborts(self) -> None:
        for key in self._aborts:
            request = self._requests.get(key)
            if request is not None:
                self._finish(request, "abort")
        self._aborts.clear()

    def _append_token(self, request: Request, sample: Sample) -> None:
        token = sample.token_id
        request.output_token_ids.append(token)
        self.metrics.on_token(request)
        stream = self._streams[request.key]
        params = request.sampling
        num_output = len(request.output_token_ids)
        # the first min_tokens tokens end nothing (vLLM's check_stop); the sampler masked stop ids there
        stop_token = num_output > params.min_tokens and (
            token in params.stop_token_ids or (not params.ignore_eos and token in params.eos_token_ids))
        reason = None
        if stop_token:
            if params.include_stop_str_in_output:  # vLLM keeps the stop token's text then
                stream.detokenizer.add(token)
            reason = "stop"
        elif stream.detokenizer.add(token):
            reason = "stop"
        elif num_output >= params.max_tokens:
            reason = "length"
        logprobs = [sample] if params.logprobs else []
        if reason is not None:
            self._finish(request, reason, new_tokens=[token], logprobs=logprobs)
        else:
            self._emit(stream, RequestOutput(request.request_id, [token], stream.detokenizer.delta(final=False),
                                              logprobs=logprobs, index=request.index))

    def _finish(self, request: Request, reason: str, new_tokens: list[int] | None = None,
                error: BaseException | None = None, logprobs: list[Sample] | None = None) -> None:
        stream = self._retire(request, reason)
        if error is not None:
            self._emit(stream, error)
        else:
            usage = Usage(request.num_prompt_tokens, len(request.output_token_ids), request.prompt.num_image_tokens,
                          request.num_cached_tokens)
            self._emit(stream, RequestOutput(request.request_id, new_tokens or [], stream.detokenizer.delta(final=True),
                                             reason, usage, logprobs or [], request.index))

    def _retire(self, request: Request, reason: str) -> _Stream:
        """Take `request` out of the engine (its queue, blocks and adapter lease); returns its stream."""
        self.scheduler.finish(request, reason)
        self.metrics.on_finish(request, reason)
        if request.lora_slot is not None:
            self.adapters.release(request.lora_slot, request.lora_name)
        self._requests.pop(request.key, None)
        return self._streams.pop(request.key)

    def _emit(self, stream: _Stream, output: RequestOutput | BaseException) -> None:
        """Queue `output` for `stream`; `_flush` (engine thread) hands a step's outputs over at once.
        A choice's first output gets the prompt's fields; an output with logprobs their token texts."""
        if isinstance(output, RequestOutput):
            if not stream.started:
                stream.started = True
                record = stream.request.prompt_logprobs
                if record is not None:
                    output.prompt_logprobs = list(record.entries)
                if stream.prompt_text is not None:
                    output.prompt_token_ids = list(stream.request.prompt.token_ids)
                    output.prompt_text = stream.prompt_text
            if output.logprobs or output.prompt_logprobs:
                output.token_texts = self.token_texts.of(_logprob_ids(output))
        self._outbox.setdefault(stream.loop, []).append((stream.queue, output))

    def _flush(self) -> None:
        """One wake-up per caller loop per step (not one per request: the loop's thread competes
        with this one for the GIL and the CPU)."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's loop is closed; nobody is listening
                pass


def start_engine(config: DecoderConfig, adapters: AdapterSource | None = None) -> LLMEngine:
    """An engine started outside any event loop (scripts, benchmarks, tests); `shutdown()` ends it.

    The source's loop-bound work (a registry's residency reports and channel) is closed with the
    loop `start` ran on; the registry source resumes it on the loop of its next acquire.
    """
    engine = LLMEngine(config, adapters)

    async def start() -> None:
        await engine.start()
        await engine.adapters.close()

    asyncio.run(start())
    return engine


def _logprob_ids(output: RequestOutput):
    """Every token id of `output`'s logprobs and prompt logprobs, chosen and alternatives."""
    for sample in (*output.logprobs, *(output.prompt_logprobs or ())):
        yield sample.token_id
        for token_id, _ in sample.top:
            yield token_id


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)
