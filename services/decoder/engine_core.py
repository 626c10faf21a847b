"""The engine core: a background thread that steps the scheduler and the model runner.

`EngineCore(config, adapters)` builds nothing; `start(num_threads)` (blocking) builds the parts on
the engine thread (engine_parts.py: backends, model, cache, warm-up) and returns once it steps.
`add` hands it admitted requests with their output streams; each step then schedules a batch,
runs it, records each request's new token and emits the outputs (output_processor.py). Request
lifecycle points here: each token (`_append_token`), finish or abort (`_finish` / `_retire`: the
request's blocks are freed and its adapter lease given back to the source that leased it);
preemption is the scheduler's (scheduler.py). The core has no asyncio-facing API: the async
client (engine.py) admits requests and reads the streams.

The whole step is guarded: an error in scheduling, the forward, the scheduler's update or token
bookkeeping fails that step's requests (their blocks and leases come back) and the loop goes on.
Should the thread stop anyway, every pending and later request fails at once with UNAVAILABLE
naming the cause, and `health()` says so (as it does when steps stop completing: `Liveness`).
"""

from __future__ import annotations

import logging
import threading

from services.common.compute import claim_intra_op_threads
from services.common.errors import TesseraError
from services.common.liveness import Liveness
from services.decoder.adapter_source import AdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine_parts import EngineParts, build_parts
from services.decoder.output_processor import OutputProcessor, RequestStream
from services.decoder.request import Request, RequestStatus
from services.decoder.stats import DecoderStats
from services.decoder.types import EngineStats, RequestOutput, Sample, Usage

log = logging.getLogger(__name__)


class EngineCore:
    """Continuous batching over one model, stepped by one thread. `lock` (a re-entrant condition)
    guards `requests` (engine key -> Request), the streams, the aborts and the scheduler."""

    def __init__(self, config: DecoderConfig, adapters: AdapterSource) -> None:
        self.config, self.adapters = config, adapters
        self.lock = threading.Condition()
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, RequestStream] = {}
        self._aborts: set[str] = set()
        self._stopped = False
        self.liveness = Liveness("the decoder engine", config.wedged_after_s)
        self.metrics = DecoderStats(config.served_model_names[0], max_model_len=config.max_model_len)
        self.parts: EngineParts | None = None  # built by `start`
        self.output: OutputProcessor | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self, num_threads: int) -> None:
        """Build the parts on a new engine thread (claiming `num_threads` intra-op threads there,
        services/common/compute.py) and start stepping; blocks until built. Raises what the build
        raises (ValueError: a configuration that cannot run)."""
        self._thread = threading.Thread(target=self._run, args=(num_threads,), name="decoder-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def shutdown(self) -> None:
        """End the engine thread (blocks up to 10 s)."""
        with self.lock:
            self._stopped = True
            self.lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ------------------------------------------------------------------------
    def add(self, streams: list[RequestStream]) -> None:
        """Queue each stream's request for scheduling. Raises Unavailable once the engine died,
        ResourceExhausted when the waiting queue is full (nothing is added then)."""
        with self.lock:
            self.liveness.raise_if_dead()  # under the lock: a dying engine fails what it holds, or we see it
            requests = [stream.request for stream in streams]
            self.parts.scheduler.add(*requests)
            self.metrics.on_arrival(requests)
            for stream in streams:
                self.requests[stream.request.key] = stream.request
                self._streams[stream.request.key] = stream
            self.lock.notify()

    def abort(self, key: str) -> None:
        """Abort a request by its engine key (its caller is gone: nothing more is sent to it).

        A waiting request leaves the queue at once, so it never holds a place that admission
        control (max_waiting) refuses others for; a running one is finished, its blocks and
        lease freed, before the next step.
        """
        with self.lock:
            request = self.requests.get(key)
            if request is not None and request.status is RequestStatus.WAITING:
                self._retire(request, "abort")
            else:
                self._aborts.add(key)
            self.lock.notify()

    def health(self) -> str | None:
        """None while the thread runs and completes steps; else why not (see `Liveness`)."""
        return self.liveness.check(bool(self._aborts) or self.parts.scheduler.has_work())

    def stats(self) -> EngineStats:
        """One snapshot of the scheduler, the KV cache, the prefix cache and the adapters."""
        with self.lock:
            parts, lora = self.parts, self.metrics.lora
            bm, prefix = parts.block_manager, parts.block_manager.stats
            return EngineStats(
                bm.num_blocks, bm.num_free_blocks, len(parts.scheduler.running), len(parts.scheduler.waiting),
                bm.num_cached_blocks, prefix.num_queries, prefix.num_hits, prefix.num_hit_tokens,
                prefix_cache_query_tokens=prefix.num_query_tokens, num_adapter_swaps=parts.bank.num_swaps,
                num_adapter_host_cache_hits=self.adapters.num_host_cache_hits,
                num_adapter_weight_fetches=self.adapters.num_weight_fetches, running_lora_adapters=lora.running,
                waiting_lora_adapters=lora.waiting, lora_updated_s=lora.updated_s)

    # ---- engine thread -------------------------------------------------------------------
    def _run(self, num_threads: int) -> None:
        try:
            claim_intra_op_threads(num_threads)
            self.parts = build_parts(self.config)
            self.output = OutputProcessor(self.parts.token_texts)
            self.parts.grammars.observer = self.metrics
        except BaseException as error:  # re-raised by start
            self._start_error = error
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        except BaseException as cause:  # the thread ends here; its callers must hear why
            log.critical("the decoder engine thread stopped; failing every request", exc_info=cause)
            self._die(cause)

    def _loop(self) -> None:
        scheduler = self.parts.scheduler
        while True:
            with self.lock:
                while not self._stopped and not self._aborts and not scheduler.has_work():
                    self.lock.wait()
                if self._stopped:
                    return
            self._step()
            self.liveness.num_steps += 1
            self.output.flush()

    def _step(self) -> None:
        """Schedule and run one batch; an error fails the requests it touched, never the loop."""
        scheduler = self.parts.scheduler
        try:
            with self.lock:
                self._process_aborts()
                out = scheduler.schedule()
                self.metrics.on_schedule(out, scheduler)
        except Exception as error:  # fail what scheduling was working on, keep serving
            log.exception("engine step failed while scheduling")
            with self.lock:
                # admission takes waiting requests in order and moves each to running, so the request
                # being handled is running or the head of the queue; aborts pending are of running ones
                suspects = [*scheduler.running, *list(scheduler.waiting)[:1]]
                self._aborts.clear()
            self._fail(suspects, error)
            return
        self.output.flush()
        if not out.scheduled:
            return
        try:
            result = self.parts.runner.execute(out)
            if result.mask_seconds is not None:
                self.metrics.on_grammar_mask(result.mask_seconds)
            with self.lock:
                scheduler.update(out)
                for item in out.scheduled:
                    chunk = result.prompt_logprobs.get(item.request.key)
                    if chunk is not None:
                        item.request.prompt_logprobs.record(chunk.start, chunk.entries)
                    token = result.samples.get(item.request.key)
                    if isinstance(token, Exception):  # non-finite logits, or its controls left no token
                        self._finish(item.request, "abort", error=token)
                    elif token is not None:
                        self._append_token(item.request, token)
        except Exception as error:  # fail this step's requests, keep serving
            log.exception("engine step failed")
            self._fail([item.request for item in out.scheduled], error)

    def _fail(self, requests: list[Request], error: Exception) -> None:
        """End `requests` with `error` (those a step has not finished already), freeing their blocks
        and leases. An error here means the engine's state is broken: it ends the thread."""
        with self.lock:
            for request in requests:
                if request.key in self.requests:
                    self._finish(request, "abort", error=error)

    def _die(self, cause: BaseException) -> None:
        """Fail every request the engine holds, now and later, with Unavailable naming `cause`."""
        self.liveness.die(cause)
        error = self.liveness.dead_error()
        with self.lock:
            streams = list(self._streams.values())
            for request in list(self.requests.values()):
                try:
                    self._retire(request, "abort")  # frees blocks and the adapter lease where it still can
                except Exception:  # the state that killed the thread may be broken
                    log.debug("could not retire %s", request.key, exc_info=True)
            for stream in streams:
                self.output.emit(stream, error)
            self.requests.clear()
            self._streams.clear()
            self._aborts.clear()
            self.parts.scheduler.running.clear()
            self.parts.scheduler.waiting.clear()
        self.output.flush()

    def _process_aborts(self) -> None:
        for key in self._aborts:
            request = self.requests.get(key)
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
        grammar = request.grammar
        if grammar is not None and not grammar.accept(token):  # the mask allowed only what it accepts
            self._finish(request, "abort", error=TesseraError(
                f"token {token} was sampled outside the structured-output grammar of {request.request_id!r}"))
            return
        if stop_token:
            if params.include_stop_str_in_output:  # vLLM keeps the stop token's text then
                stream.detokenizer.add(token)
            reason = "stop"
        elif stream.detokenizer.add(token) or (grammar is not None and grammar.terminated):
            reason = "stop"  # a stop string, or the grammar complete with its stop token taken (ignore_eos or not)
        elif num_output >= params.max_tokens:
            reason = "length"
        logprobs = [sample] if params.logprobs else []
        if reason is not None:
            self._finish(request, reason, new_tokens=[token], logprobs=logprobs)
        else:
            self.output.emit(stream, RequestOutput(request.request_id, [token], stream.detokenizer.delta(final=False),
                                                   logprobs=logprobs, index=request.index))

    def _finish(self, request: Request, reason: str, new_tokens: list[int] | None = None,
                error: BaseException | None = None, logprobs: list[Sample] | None = None) -> None:
        stream = self._retire(request, reason)
        if error is not None:
            self.output.emit(stream, error)
        else:
            usage = Usage(request.num_prompt_tokens, len(request.output_token_ids), request.prompt.num_image_tokens,
                          request.num_cached_tokens)
            self.output.emit(stream, RequestOutput(request.request_id, new_tokens or [],
                                                   stream.detokenizer.delta(final=True), reason, usage,
                                                   logprobs or [], request.index))

    def _retire(self, request: Request, reason: str) -> RequestStream:
        """Take `request` out of the engine (its queue, blocks and adapter lease); returns its stream."""
        self.parts.scheduler.finish(request, reason)
        self.metrics.on_finish(request, reason)
        if request.lora_slot is not None:
            self.adapters.release(request.lora_slot, request.lora_name)
        self.requests.pop(request.key, None)
        return self._streams.pop(request.key)
