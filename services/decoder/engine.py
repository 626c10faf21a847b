"""The decoder engine's async client: admission, request streams, and the engine's public API.

Lifecycle: `LLMEngine(config, adapters)` builds nothing; `await start()` starts the engine core
(engine_core.py: it chooses the backends, builds the C kernels they need, loads the model and runs
a warm-up step, all on the engine thread) and then the adapter source (adapter_source.py) on the
caller's loop; `await stop()` closes the source and ends the thread. `health()`, `info()` and
`stats()` report on it. The engine knows no transport: the servicer converts protobuf to the domain
types (types.py) and back.

`generate(...)` (asyncio) validates a request, resolves its sampling, leases its adapter from the
source (every lease, the n choices' too, is the source's: `acquire`, `share`, `release`), hands it
to the core and yields the `RequestOutput`s that the core delivers to its queue once per step
(output_processor.py). Leaving the iterator early (client cancel, deadline, disconnect) aborts the
request: its blocks and adapter lease are freed before the next step.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import torch

from services.common.errors import InvalidArgument, Unavailable
from services.decoder.adapter_source import AdapterSource, InMemoryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.detokenizer import IncrementalDetokenizer
from services.decoder.engine_core import EngineCore
from services.decoder.engine_parts import EngineParts
from services.decoder.grammar import GrammarState
from services.decoder.output_processor import RequestStream
from services.decoder.prefix_cache import BlockHasher
from services.decoder.request import PromptLogprobs, Request
from services.decoder.sampler import make_generator
from services.decoder.stats import CacheInfo, DecoderCollector
from services.decoder.tokens import bad_words_token_ids, detokenize, tokenize
from services.decoder.tools import choose_tool_call_parser, template_takes_tools
from services.decoder.types import (
    DecoderInfo,
    EngineStats,
    GenerateInput,
    PromptTokenCount,
    RequestOutput,
    SamplingParams,
    TextPart,
    Tokenization,
    TokenizeInput,
)


class LLMEngine:
    """Continuous batching over one model. `adapters` resolves the LoRA adapter a request names
    (default: an empty `InMemoryAdapterSource`, so every name is NotFound)."""

    def __init__(self, config: DecoderConfig, adapters: AdapterSource | None = None,
                 prestart_grammar_workers: bool = False) -> None:
        """`prestart_grammar_workers`: spawn the structured-output compile processes at start (the
        service does), not on the first constrained request (scripts and tests)."""
        self.config = config
        self.prestart_grammar_workers = prestart_grammar_workers
        self.adapters = adapters if adapters is not None else InMemoryAdapterSource()
        self.device = config.torch_device  # weights, KV cache, adapter slots, sampling generators
        self.core = EngineCore(config, self.adapters)
        self.metrics = self.core.metrics  # the request counters and histograms (stats.py)
        self.started = False  # the model is loaded and the engine thread steps

    @property
    def parts(self) -> EngineParts:
        """The built model, cache, scheduler, adapter slots, tokenizer, ... (engine_parts.py)."""
        return self.core.parts

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine core (the process's one multi-threaded torch thread, see
        services/common/compute.py: backends chosen, model loaded, one warm-up step through every
        configured backend), then the adapter source on the running loop. Returns once both are
        ready; build and warm-up errors are raised here (ValueError: a configuration that cannot run)."""
        # read on the loop's thread: the worker waiting for the load never touches torch threading
        num_threads = torch.get_num_threads()
        await asyncio.to_thread(self.core.start, num_threads)
        await self.adapters.start(self.parts.bank)
        if self.prestart_grammar_workers:
            self.parts.grammars.prestart()
        self.started = True

    async def stop(self) -> None:
        """Close the adapter source and end the engine thread."""
        await self.adapters.close()
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """End the engine thread (blocks up to 10 s) and the grammar compile processes; the adapter
        source stays open."""
        self.core.shutdown()
        if self.core.parts is not None:
            self.core.parts.grammars.close()

    # ---- public API ----------------------------------------------------------------------
    async def generate(self, request_input: GenerateInput) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs; the last one carries finish_reason and usage.

        `request_input.lora` names an adapter, leased from the adapter source for the request's
        life. Raises (before the first output): InvalidArgument (bad prompt, too long, a
        stop_token_ids, logit_bias or allowed_token_ids id outside the vocabulary, a bad word whose
        tokens are, min_tokens past what an unset max_tokens allows, a structured-output constraint
        that does not compile or compiles past --structured-outputs-compile-timeout), NotFound /
        FailedPrecondition / Unavailable (adapter), ResourceExhausted (waiting queue full),
        Unavailable (still loading, or the engine thread has stopped; also raised mid-stream when
        it stops). With every adapter slot leased the admission waits for one to free.
        """
        self._check_serving()
        parts = self.parts
        sampling = request_input.sampling
        vocab_size = parts.prompts.vocab_size
        # an id that can never be sampled is a caller's mistake, as a prompt id past the vocabulary is
        for name, ids in (("stop_token_ids", sampling.stop_token_ids), ("logit_bias", sampling.logit_bias),
                          ("allowed_token_ids", sampling.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidArgument(f"sampling.{name} holds {bad[0]}, outside the vocabulary [0, {vocab_size})",
                                      field=f"sampling.{name}")
        bad_words_ids = ()
        if sampling.bad_words:  # tokenized once, off the loop as the prompt is
            bad_words_ids = await asyncio.to_thread(bad_words_token_ids, parts.tokenizer, sampling.bad_words)
            bad = [t for ids in bad_words_ids for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidArgument(f"sampling.bad_words tokenize to id {bad[0]}, outside the model's vocabulary "
                                      f"[0, {vocab_size})", field="sampling.bad_words")
        prompt = await asyncio.to_thread(parts.prompts.build, request_input)
        request_input = replace(request_input, sampling=self._resolve_sampling(len(prompt.token_ids), sampling,
                                                                               bad_words_ids))
        prompt_text = None
        if request_input.return_prompt:  # as vLLM's echo of token prompts: special tokens kept
            prompt_text = await asyncio.to_thread(parts.tokenizer.decode, prompt.token_ids, skip_special_tokens=False)
        compiled = None
        if sampling.constraint is not None:  # compiled off the loop and the engine thread; the batch never waits
            compiled = await parts.grammars.get(sampling.constraint)
            self.metrics.on_constrained(sampling.constraint.kind)
        slot = await self.adapters.acquire(request_input.lora) if request_input.lora else None
        requests = self._make_requests(request_input, prompt, slot, request_input.lora, compiled)
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
                    self.core.abort(request.key)

    def _admit(self, requests: list[Request], prompt_ids: list[int], queue: asyncio.Queue,
               prompt_text: str | None = None) -> None:
        """Hand `requests` to the core; their outputs go to `queue` on the running loop (each
        choice's first with `prompt_text` and the prompt's ids, unless None). On a refusal (queue
        full, dead engine) their leases are given back and the error raised."""
        loop, tokenizer = asyncio.get_running_loop(), self.parts.tokenizer
        try:
            self.core.add([RequestStream(loop, queue, IncrementalDetokenizer(tokenizer, prompt_ids, request.sampling),
                                         request, prompt_text) for request in requests])
        except BaseException:
            for request in requests:
                if request.lora_slot is not None:
                    self.adapters.release(request.lora_slot, request.lora_name)
            raise

    def _make_requests(self, request_input: GenerateInput, prompt, slot: int | None, lease_name: str,
                       compiled=None) -> list[Request]:
        """The n choices: choice i samples with seed + i and holds its own adapter lease on `slot`
        (taken as `lease_name`; the first's by `generate`, the others' shared from it); choices after
        the first wait for it to compute the prompt, then share its blocks and its prompt logprobs
        (one record for all). With a `compiled` grammar each choice has its own matcher."""
        params, requests = request_input.sampling, []
        record = (None if params.prompt_logprobs is None
                  else PromptLogprobs(params.prompt_logprobs, len(prompt.token_ids)))
        for index in range(params.n):
            key = uuid.uuid4().hex
            lease = slot if index == 0 or slot is None else self.adapters.share(slot, lease_name)
            seed = None if params.seed is None else params.seed + index
            requests.append(Request(key, request_input.request_id or key, prompt, params, lease,
                                    None if params.greedy else make_generator(seed, self.device), self._hasher(prompt, slot),
                                    index=index, parent=requests[0] if requests else None, lora_name=lease_name,
                                    prompt_logprobs=record,
                                    grammar=None if compiled is None else GrammarState(compiled, params.stop_token_ids),
                                    long_rope=getattr(self.parts.model.rotary, "long_rope", None)))
        return requests

    def abort(self, key: str) -> None:
        """Abort a request by its engine key (see `EngineCore.abort`)."""
        self.core.abort(key)

    def health(self) -> str | None:
        """None while the engine thread runs and completes steps (or is still loading: a service
        says NOT_SERVING until `start` returns anyway); else why not (see `Liveness`)."""
        if not self.started:
            return None
        return self.core.health()

    def info(self) -> DecoderInfo:
        """The served model and the engine's load now. Raises Unavailable while still loading."""
        self._check_serving(dead_ok=True)
        spec, config = self.parts.model.spec, self.config
        names = config.served_model_names
        template = getattr(self.parts.tokenizer, "chat_template", None)
        return DecoderInfo(model=names[0], architecture=spec.architecture,
                           dtype=config.dtype, max_model_len=config.max_model_len,
                           vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, block_size=config.block_size,
                           mrope_section=tuple(config.mrope_section or ()), image_token_id=self.parts.image_token_id,
                           stats=self.stats(), resident_adapters=self.adapters.resident_names(),
                           served_model_names=names, generation_config=config.generation_config,
                           generation_defaults=config.generation_defaults.as_dict(),
                           chat_template_takes_tools=template_takes_tools(template),
                           tool_call_parser=choose_tool_call_parser(template, config.tool_call_parser),
                           model_impl=config.model_impl, decode_step=self.parts.runner.decode_step,
                           quantization=self.parts.quantization)

    async def count_prompt_tokens(self, request_input: GenerateInput) -> PromptTokenCount:
        """The tokens `generate` would build for `request_input`'s prompt besides its images'
        placeholders (`PromptBuilder.count_text_tokens`), its images not encoded. Raises
        InvalidArgument as `generate` refuses the prompt, Unavailable while still loading."""
        self._check_serving(dead_ok=True)
        num_text = await asyncio.to_thread(self.parts.prompts.count_text_tokens, request_input)
        num_images = sum(not isinstance(part, TextPart) for part in request_input.prompt) + sum(
            not isinstance(part, TextPart) for message in request_input.messages for part in message.content)
        return PromptTokenCount(num_text, num_images, self.config.max_model_len)

    async def tokenize(self, request: TokenizeInput) -> Tokenization:
        """`request` tokenized by the model's tokenizer (services/decoder/tokens.py). Raises
        InvalidArgument (see `tokens.tokenize`), Unavailable while still loading."""
        self._check_serving(dead_ok=True)
        tokenizer = self.parts.tokenizer
        ids = await asyncio.to_thread(tokenize, tokenizer, request)
        special_ids = set(tokenizer.all_special_ids)
        return Tokenization(model=self.config.served_model_names[0], token_ids=ids,
                            tokens=tokenizer.convert_ids_to_tokens(ids), special=[i in special_ids for i in ids],
                            max_model_len=self.config.max_model_len)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`. Raises InvalidArgument (an id out of vocabulary), Unavailable
        while still loading."""
        self._check_serving(dead_ok=True)
        return await asyncio.to_thread(detokenize, self.parts.tokenizer, token_ids, skip_special_tokens)

    def _check_serving(self, dead_ok: bool = False) -> None:
        """Raises Unavailable while the model is loading, or (unless `dead_ok`) once the engine died."""
        if not self.started:
            raise Unavailable("the decoder is still loading its model")
        if not dead_ok:
            self.core.liveness.raise_if_dead()

    def stats(self) -> EngineStats:
        """One snapshot of the engine's load (`EngineCore.stats`): GetInfo's and the metrics'."""
        return self.core.stats()

    def collector(self) -> DecoderCollector:
        """The Prometheus collector of this engine's metrics (stats.py); silent while it loads."""
        config = self.config
        cache = CacheInfo(config.block_size, config.num_blocks, config.enable_prefix_caching,
                          str(config.kv_cache_torch_dtype).removeprefix("torch."), config.adapter_slots)
        return DecoderCollector(config.served_model_names[0], self.metrics, cache,
                                lambda: self.stats() if self.started else None)

    def _hasher(self, prompt, lora_slot: int | None) -> BlockHasher | None:
        """Prefix-cache hasher salted with the adapter's weight digest and the prompt's images."""
        if not self.config.enable_prefix_caching:
            return None
        digest = None if lora_slot is None else self.parts.bank.digest_of(lora_slot)
        return BlockHasher.for_prompt(self.config.block_size, prompt, digest, self.config.mrope_section,
                                      self.parts.quantization)

    def _resolve_sampling(self, num_prompt: int, sampling: SamplingParams,
                          bad_words_ids: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
        """`sampling` with max_tokens resolved (`_max_tokens`), the model's EOS ids (those in the
        vocabulary, for the min_tokens mask and the stop check) and its bad words' token sequences
        (`bad_words_ids`). Raises InvalidArgument as
        `_max_tokens`, or when min_tokens exceeds an unset max_tokens' resolved value."""
        max_tokens = self._max_tokens(num_prompt, sampling.max_tokens)
        if sampling.min_tokens > max_tokens:
            raise InvalidArgument(f"min_tokens is {sampling.min_tokens}, but max_tokens is unset and this request "
                                  f"may generate at most {max_tokens} tokens (the model's default or the rest of "
                                  "its context)", field="sampling.min_tokens")
        vocab_size = self.parts.prompts.vocab_size
        eos_ids = tuple(sorted(t for t in self.parts.eos_token_ids if 0 <= t < vocab_size))
        return replace(sampling, max_tokens=max_tokens, eos_token_ids=eos_ids, bad_words_token_ids=bad_words_ids)

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
