"""Output delivery: from the engine thread to each request's asyncio queue, once per step.

The engine core (engine_core.py) emits a choice's outputs into its `RequestStream` as it steps;
the `OutputProcessor` completes them (a choice's first output gets the prompt's fields, an output
with logprobs the text of each token id) and at the end of the step hands them to their callers'
event loops, one `call_soon_threadsafe` per loop per step, not one per request: the loops' threads
compete with the engine thread for the GIL and the CPU (vLLM keeps this apart as its
output_processor.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

from services.decoder.detokenizer import IncrementalDetokenizer
from services.decoder.request import Request
from services.decoder.token_text import TokenTexts
from services.decoder.types import RequestOutput


@dataclass
class RequestStream:
    """Where a request's outputs go: an asyncio queue on the caller's loop. `request` and
    `prompt_text` (None = the prompt is not returned) fill the choice's first output; the
    detokenizer turns its tokens into text deltas and finds its stop strings."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer
    request: Request
    prompt_text: str | None = None
    started: bool = False  # the first output has been emitted


class OutputProcessor:
    """Collects a step's outputs (`emit`, engine thread) and delivers them at once (`flush`)."""

    def __init__(self, token_texts: TokenTexts) -> None:
        self.token_texts = token_texts
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # engine thread only

    def emit(self, stream: RequestStream, output: RequestOutput | BaseException) -> None:
        """Queue `output` (or the error that ends the request) for `stream` until the next `flush`."""
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

    def flush(self) -> None:
        """Hand what was emitted since the last flush to the callers' loops, one wake-up per loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's loop is closed; nobody is listening
                pass


def _logprob_ids(output: RequestOutput) -> Iterator[int]:
    """Every token id of `output`'s logprobs and prompt logprobs, chosen and alternatives."""
    for sample in (*output.logprobs, *(output.prompt_logprobs or ())):
        yield sample.token_id
        for token_id, _ in sample.top:
            yield token_id


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)
