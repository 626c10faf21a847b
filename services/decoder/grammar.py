"""Structured output on xgrammar: compiled grammars cached per constraint, one matcher per choice,
token bitmasks filled while the forward runs.

Why xgrammar (vLLM's and SGLang's default): on this project's hosts with SmolLM2's 49k vocabulary
it fills a mask in ~1.7 us median, p99 ~22 us (llguidance: ~10 us, p99 ~190 us) and compiles a schema in ~6-10 ms;
bench/results/grammar_libs.md has the table (`python bench/grammar_libs.py`).

- `GrammarCompiler` owns the tokenizer's `xgrammar.TokenizerInfo` (the model's logits width as the
  vocabulary, the served EOS ids as stop tokens) and a bounded LRU cache of compiled grammars keyed
  by `Constraint` (services/decoder/constraints.py). Compiles run in worker processes
  (`CompileWorker`, two, spawned on first use), never on the engine thread: a request waits for
  its grammar, the batch does not. A compile past `compile_timeout_s` (counted from its start, not
  from its wait for a free worker) ends its process, so a hostile schema's CPU and memory come back
  at once, and is refused (InvalidArgument), and so is every later request with the same
  constraint (the refusal is cached), so it costs a worker once. Two requests with one constraint
  share one compile.
- `GrammarState` is one choice's matcher: it advances with each accepted token; the engine ends the
  choice with "stop" once it is terminated (its grammar complete and a stop token taken). Recompute
  preemption keeps a request's generated tokens, so a preempted matcher keeps its state.
- `fill_bitmask` fills the int32 bitmask [rows, ceil(vocab / 32)] of a step's constrained rows;
  `apply_bitmask` sets the logits of disallowed tokens to -inf (one numpy putmask on the CPU).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import multiprocessing
import queue
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from services.common.errors import InvalidArgument, Unavailable
from services.decoder.constraints import Constraint, choice_grammar

log = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 5.0
DEFAULT_CACHE_SIZE = 256
DEFAULT_CACHE_BYTES = 512 * 1024 * 1024
COMPILE_THREADS = 2  # concurrent compiles; each compile is single-threaded (xgrammar max_threads=1)


@dataclass
class CompileStats:
    """Counts of the compile cache (tests and `tessera info` read them)."""

    hits: int = 0
    misses: int = 0
    refused: int = 0  # constraints the library refused or that compiled too slowly
    workers_killed: int = 0  # compile processes ended for running past the timeout


class _TooSlow(Exception):
    pass


class GrammarCompiler:
    """Compiled grammars for one tokenizer, cached (module docstring).

    Compiles run in `COMPILE_THREADS` worker processes (`CompileWorker`, spawned on first use), each
    driven by one compile thread: a compile past `compile_timeout_s` ends its process, so its CPU
    and memory come back at once, and the next compile gets a fresh process. The timeout counts the
    compile alone, not the wait for a free worker.

    Args:
        tokenizer: the served model's Hugging Face tokenizer.
        vocab_size: the model's logits width (>= the tokenizer's size: padded rows are never allowed).
        stop_token_ids: the served EOS ids, the tokens that end a complete grammar.
        compile_timeout_s: the longest a compile may take before its request is refused.
        cache_size / cache_bytes: the most compiled grammars (and their summed memory) kept.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, cache_size: int = DEFAULT_CACHE_SIZE,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.compile_timeout_s = compile_timeout_s
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self._cache: collections.OrderedDict[Constraint, concurrent.futures.Future] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._tokenizer_json: str | None = None  # the tokenizer info the workers load, serialized once
        self._workers: queue.Queue[CompileWorker | None] = queue.Queue()
        for _ in range(COMPILE_THREADS):
            self._workers.put(None)  # started on first use
        self._started: list[CompileWorker] = []
        self._closed = False
        self.stats = CompileStats()
        self.observer = None  # stats.DecoderStats (its on_grammar_lookup and on_grammar_compile), set by the engine

    async def get(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar of `constraint`, from the cache or compiled off the event loop.

        Raises:
            InvalidArgument: the library refuses it (a regex that does not parse, a grammar with an
                undefined rule, an unsatisfiable schema: its message, naming the field), or its
                compile takes longer than compile_timeout_s (remembered: the same constraint is
                refused at once later).
            Unavailable: a compile process could not start.
        """
        future, fresh = self._future(constraint)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except _TooSlow:
            if fresh:
                with self._lock:
                    self.stats.refused += 1
            raise self._too_slow(constraint) from None
        except InvalidArgument:
            if fresh:
                with self._lock:
                    self.stats.refused += 1
            raise

    def compile_now(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """Compile `constraint` on this thread, uncached and unbounded (bench and tests). Raises
        InvalidArgument as `get`."""
        return compile_constraint(self._compiler, constraint)

    def _too_slow(self, constraint: Constraint) -> InvalidArgument:
        return InvalidArgument(f"sampling.{constraint.field}: compiling this constraint takes longer than "
                               f"{self.compile_timeout_s:g} s (--structured-outputs-compile-timeout); "
                               "simplify it", field=f"sampling.{constraint.field}")

    def _future(self, constraint: Constraint) -> tuple[concurrent.futures.Future, bool]:
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                self.stats.hits += 1
                if self.observer is not None:
                    self.observer.on_grammar_lookup(hit=True)
                return future, False
            self.stats.misses += 1
            if self.observer is not None:
                self.observer.on_grammar_lookup(hit=False)
            future = self._pool.submit(self._compile_in_worker, constraint)
            self._cache[constraint] = future
        # outside the lock: a compile already done runs the callback here, and _settle takes the lock
        future.add_done_callback(lambda done: self._settle(constraint, done))
        return future, True

    def _compile_in_worker(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """On a compile thread: compile in a free worker process (waiting for one), end the process
        when the compile runs past the timeout (raising _TooSlow)."""
        worker = self._workers.get()
        try:
            if worker is None or not worker.alive():
                worker = self._new_worker()
            worker.wait_ready()
            start = time.perf_counter()
            try:
                payload = worker.compile(constraint, self.compile_timeout_s)
            except _TooSlow:
                worker.kill()
                with self._lock:
                    self.stats.workers_killed += 1
                worker = None  # the next compile starts a fresh process
                raise
            finally:
                if self.observer is not None:
                    self.observer.on_grammar_compile(time.perf_counter() - start)
            return xgr.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)
        except BaseException:
            if worker is not None and not worker.alive():
                worker = None
            raise
        finally:
            self._workers.put(worker)

    def prestart(self) -> None:
        """Spawn the compile processes now rather than on first use (the decoder service at start),
        so the first constrained request pays no process start (seconds: imports and tokenizer info)."""
        idle = []
        while True:
            try:
                idle.append(self._workers.get_nowait())
            except queue.Empty:
                break
        for worker in idle:
            self._workers.put(self._new_worker() if worker is None or not worker.alive() else worker)

    def _new_worker(self) -> CompileWorker:
        if self._closed:
            raise Unavailable("the structured-output compiler is closed")
        if self._tokenizer_json is None:
            self._tokenizer_json = self.tokenizer_info.serialize_json()
        worker = CompileWorker(self._tokenizer_json)
        with self._lock:
            self._started = [w for w in self._started if w.alive()] + [worker]
        return worker

    def _settle(self, constraint: Constraint, future: concurrent.futures.Future) -> None:
        """A compile ended: keep its grammar within the cache's bounds, keep a too-slow refusal (so
        the same constraint costs a worker once), or drop another error (cheap to find again)."""
        with self._lock:
            if self._cache.get(constraint) is not future:
                return
            if future.exception() is not None:
                if not isinstance(future.exception(), _TooSlow):
                    del self._cache[constraint]
                return
            self._bytes += future.result().memory_size_bytes
            while len(self._cache) > self.cache_size or (self._bytes > self.cache_bytes and len(self._cache) > 1):
                _, old = self._cache.popitem(last=False)
                if old.done() and old.exception() is None:
                    self._bytes -= old.result().memory_size_bytes

    def num_cached(self) -> int:
        with self._lock:
            return sum(1 for f in self._cache.values() if f.done() and f.exception() is None)

    def num_workers(self) -> int:
        """Compile processes running now (started on first use, at most COMPILE_THREADS)."""
        with self._lock:
            return sum(1 for w in self._started if w.alive())

    def close(self) -> None:
        """End the compile threads' queue and every compile process."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._started = self._started, []
        for worker in workers:
            worker.kill()


def compile_constraint(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    """`constraint` compiled by `compiler` (JSON kinds compact unless any_whitespace).

    Raises:
        InvalidArgument: naming sampling.<kind>, with xgrammar's message (a parse or conversion error).
    """
    kind, spec = constraint.kind, constraint.spec
    json_format = {"any_whitespace": constraint.any_whitespace,
                   "separators": None if constraint.any_whitespace else (",", ":")}
    try:
        if kind == "json_schema":
            return compiler.compile_grammar(json_schema_grammar(spec, **json_format))
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **json_format)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(constraint.choices))
        return compiler.compile_grammar(spec)
    except (RuntimeError, ValueError) as error:  # xgrammar's parse and conversion errors
        raise InvalidArgument(f"sampling.{constraint.field} cannot be compiled: {_library_message(error)}",
                              field=f"sampling.{constraint.field}") from None


WORKER_START_TIMEOUT_S = 120.0  # a compile process's start (imports, the tokenizer info): not the compile's time


class CompileWorker:
    """One compile process (multiprocessing's spawn: no copy of the decoder's threads or model):
    xgrammar's compiler over the served tokenizer, compiling one constraint at a time and sending
    back the compiled grammar serialized (CompiledGrammar.serialize_json). The parent kills it
    when a compile runs past its timeout; it exits by itself when the parent's end of the pipe
    closes (the decoder ended, even by kill -9)."""

    def __init__(self, tokenizer_json: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_compiles, args=(child, tokenizer_json),
                                        name="grammar-compile", daemon=True)
        self._process.start()
        child.close()
        self._ready = False

    def alive(self) -> bool:
        return self._process.is_alive()

    def wait_ready(self) -> None:
        """Block until the process has loaded the tokenizer info. Raises Unavailable (and kills it)
        past WORKER_START_TIMEOUT_S or when it died."""
        if self._ready:
            return
        try:
            ready = self._conn.poll(WORKER_START_TIMEOUT_S) and self._conn.recv() == ("ready", None)
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise Unavailable("a structured-output compile process did not start; see the decoder's log")
        self._ready = True

    def compile(self, constraint: Constraint, timeout_s: float) -> str:
        """The serialized compiled grammar of `constraint`. Raises InvalidArgument (the library's
        refusal), _TooSlow (no answer within timeout_s: the caller kills the process), Unavailable
        (the process died)."""
        try:
            self._conn.send((constraint.kind, constraint.spec, constraint.any_whitespace))
            if not self._conn.poll(timeout_s):
                raise _TooSlow()
            status, payload = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.kill()
            raise Unavailable("the structured-output compile process ended; see the decoder's log") from None
        if status == "ok":
            return payload
        raise InvalidArgument(payload, field=f"sampling.{constraint.field}")

    def kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
        self._process.join(timeout=5)
        self._conn.close()


def _serve_compiles(conn, tokenizer_json: str) -> None:
    """A compile process's loop (CompileWorker): compile each constraint received, answer
    ("ok", serialized grammar) or ("error", message) until the pipe closes."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_json), max_threads=1,
                                   cache_enabled=False)
    conn.send(("ready", None))
    while True:
        try:
            kind, spec, any_whitespace = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = ("ok", compile_constraint(compiler, Constraint(kind, spec, any_whitespace)).serialize_json())
        except InvalidArgument as error:
            answer = ("error", str(error))
        conn.send(answer)


# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as [^"\\\r\n], which lets a
# raw control character (a tab) into the text: invalid JSON (RFC 8259 section 7; json.loads and pydantic
# refuse it). Its unbounded strings exclude \0-\x1f; bounded ones are given the same class.
_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(schema: str, any_whitespace: bool, separators: tuple[str, str] | None) -> xgr.Grammar:
    """xgrammar's grammar of JSON text valid under `schema` (strict: no properties or items beyond
    those the schema names), its strings free of raw control characters.

    Raises RuntimeError / ValueError (xgrammar's) for a schema it cannot convert."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, separators=separators,
                                           strict_mode=True)
    text = str(grammar)
    if _BOUNDED_STRING_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER))


def _library_message(error: Exception) -> str:
    """xgrammar's message without its '[hh:mm:ss] /path/file.cc:line: ' prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(": ", 1)[0]:
            text = text.split(": ", 1)[1] if ": " in text else text
    return text


class GrammarState:
    """One choice's matcher over a compiled grammar (module docstring).

    `stop_token_ids`: besides the served EOS ids, the request's own stop ids also end a complete
    grammar (xgrammar's override_stop_tokens).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int] = ()) -> None:
        override = sorted(set(compiled.tokenizer_info.stop_token_ids) | set(stop_token_ids)) if stop_token_ids else None
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=override)

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False when the grammar does not allow it (the mask should have)."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask [num_rows, ceil(vocab_size / 32)] (bit j of word w: token 32 w + j allowed)."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def fill_bitmask(states: Sequence[GrammarState | None],
                 vocab_size: int) -> tuple[torch.Tensor, list[int], float] | None:
    """The bitmask of the rows whose state is not None, those rows' indices and the seconds the
    fill took (None: no row has a state).

    Rows are filled in order into a [len(states), words] tensor whose unconstrained rows stay all
    ones; xgrammar's fill releases the GIL, so this runs on a worker thread during the forward.
    """
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return None
    start = time.perf_counter()
    bitmask = allocate_bitmask(len(states), vocab_size)
    for i in rows:
        states[i].matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask, rows, time.perf_counter() - start


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], copy: bool = True) -> torch.Tensor:
    """Float32 `logits` [num_rows, vocab] with the disallowed tokens of `rows` at -inf: a copy, or
    `logits` itself changed in place when not `copy`.

    On the CPU the rows' bits are unpacked at once (numpy's unpackbits: bit j of int32 word w is
    token 32 w + j on a little-endian host) into one write (numpy's putmask for a whole batch, on
    this thread): xgrammar's CPU kernel writes each disallowed token apart, 3-4x slower where most
    tokens are disallowed (a JSON value's start; bench/results/structured.md). Elsewhere
    xgrammar's own kernel applies it.
    """
    if copy:
        logits = logits.clone()
    if logits.device.type != "cpu" or sys.byteorder != "little":
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        return logits
    vocab = logits.shape[-1]
    whole = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
    words = bitmask if whole and bitmask.shape[0] == len(rows) else bitmask[rows]
    bits = np.unpackbits(words.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    if whole and logits.is_contiguous():
        # numpy writes on this thread: no wake of torch's intra-op pool for a few hundred KB
        np.putmask(logits.numpy(), bits == 0, -np.inf)
    else:
        blocked = torch.from_numpy(bits).view(torch.bool).logical_not_()  # [len(rows), vocab]
        logits[rows] = logits[rows].masked_fill_(blocked, float("-inf"))
    return logits
