"""`tessera bench structured`: structured output's cost in the decoder engine, constrained vs free
requests side by side in one run.

The engine runs in process (services.decoder.engine.start_engine, default settings, greedy), in a
child process with a decoder service's environment (services/common/launch.py) and, as a served
engine, every thread but the engine's computing single-threaded (services/common/compute.py). In
that one run:
  1. compile on a cache miss: one request for each JSON schema of bench/_grammar_cases.py, each the
     first with its schema: the compile's seconds (the engine's on_grammar_compile) and its TTFT;
  2. time to first token, one request alone (max_tokens 1, prompt already in the prefix cache): free
     vs constrained by a schema already compiled (a cache hit), --ttft-repeats pairs, the order
     flipped each pair: the median of the pairs' differences and the difference of the medians (both
     within this machine's noise), and the work the hit adds, from its parts (step 4);
  3. throughput at batch --batch (16): "same", every request constrained by one schema, vs the same
     prompts free; "mix", half constrained by different schemas and half free, vs all free. A free
     request generates exactly as many tokens as its constrained twin did (ignore_eos and max_tokens
     set to that count, learnt in a warm-up round that also fills the prefix cache), so both sides run
     the same steps. Rounds alternate same-constrained, same-free, mix-constrained, mix-free, --rounds
     times; reported: medians of output tokens/s, of the per-round ratios, and of the engine's step
     time while every row of the batch decodes;
  4. where a constrained step's time goes: the sampler's time per full-batch step beside the free
     step's (services/decoder/sampler.sample, the masks' apply included), mask fill per step (xgrammar,
     on the mask worker thread during the forward: services/decoder/grammar.fill_bitmask), applying the
     masks (grammar.apply_bitmask), advancing the matchers (GrammarState.accept, engine thread); and
     the work a cache hit adds to a request's first token, from its parts (lookup, matcher, fill, apply).
Targets: constrained tokens/s >= 0.9x free at batch 16; a cache hit adds < 1 ms to the first token.
Prints one table and rewrites bench/results/structured.md. Never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import RESULTS, machine
from _grammar_cases import SCHEMAS


class Probe:
    """Timings recorded inside the engine by wrapping its grammar and scheduling hooks, under `tag`
    (the regime or phase being measured; None: nothing is recorded but compiles): `records[tag][kind]`
    holds "lookup" (the compiled-grammar lookup a request awaits), "matcher" (a GrammarState made),
    "fill" ([constrained rows, seconds] per step), "apply" (seconds per step), "sample" (seconds of the
    sampler in a step of `batch` rows, the masks' apply included), "accept" (seconds per token) and
    "step" ([step index, start] of each step whose `batch` rows all decode)."""

    def __init__(self, engine, batch: int) -> None:
        import services.decoder.model_runner as runner_module
        import services.decoder.sampler as sampler_module
        from services.decoder.grammar import GrammarState

        self.tag: str | None = None
        self.records: dict[str, dict[str, list]] = {}
        self.compiles: list[float] = []
        self._num_steps = 0
        grammars, scheduler = engine.parts.grammars, engine.parts.scheduler
        observer, get, schedule = grammars.observer, grammars.get, scheduler.schedule
        fill, apply, sample = runner_module.fill_bitmask, sampler_module.apply_bitmask, runner_module.sample
        accept, make_state = GrammarState.accept, GrammarState.__init__
        probe = self

        class CompileObserver:  # the engine's own observer still gets every call
            def __getattr__(self, name):
                return getattr(observer, name)

            def on_grammar_compile(self, seconds: float) -> None:
                probe.compiles.append(seconds)
                observer.on_grammar_compile(seconds)

        async def timed_get(constraint):
            start = time.perf_counter()
            compiled = await get(constraint)
            self.record("lookup", time.perf_counter() - start)
            return compiled

        def timed_schedule():
            out = schedule()
            self._num_steps += 1
            if len(out.scheduled) == batch and all(s.num_new_tokens == 1 for s in out.scheduled):
                self.record("step", (self._num_steps, time.perf_counter()))
            return out

        def timed_fill(states, vocab_size):
            result = fill(states, vocab_size)
            if result is not None:
                self.record("fill", (len(result[1]), result[2]))
            return result

        def timed_sample(logits, rows, grammar_mask=None):
            start = time.perf_counter()
            result = sample(logits, rows, grammar_mask)
            if len(rows) == batch:
                self.record("sample", time.perf_counter() - start)
            return result

        def timed(kind, fn):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                result = fn(*args, **kwargs)
                self.record(kind, time.perf_counter() - start)
                return result
            return wrapper

        grammars.observer, grammars.get, scheduler.schedule = CompileObserver(), timed_get, timed_schedule
        runner_module.fill_bitmask, runner_module.sample = timed_fill, timed_sample
        sampler_module.apply_bitmask = timed("apply", apply)
        GrammarState.accept, GrammarState.__init__ = timed("accept", accept), timed("matcher", make_state)

    def record(self, kind: str, value) -> None:
        if self.tag is not None:
            self.records.setdefault(self.tag, {}).setdefault(kind, []).append(value)

    def step_seconds(self, tag: str) -> list[float]:
        """Wall time of each full-batch decode step of `tag` followed by another one."""
        stamps = self.records.get(tag, {}).get("step", [])
        return [b - a for (i, a), (j, b) in zip(stamps, stamps[1:]) if j == i + 1]


def _prompts(tokenizer, subjects: list[str], seed: int) -> list[tuple[int, ...]]:
    """Chat prompts asking for one JSON object each, token ids."""
    return [tuple(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a JSON object describing a {subject} (record {seed}-{i}). "
                                     "Answer with the JSON only."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)) for i, subject in enumerate(subjects)]


async def _generate(engine, request) -> tuple[float, int]:
    """Seconds to the first output with a token, and the tokens generated."""
    start, first, count = time.perf_counter(), None, 0
    async for output in engine.generate(request):
        if output.token_ids and first is None:
            first = time.perf_counter() - start
        count += len(output.token_ids)
    return first, count


def _request(prompt, max_tokens: int, constraint=None):
    from services.decoder.types import GenerateInput, SamplingParams

    return GenerateInput(SamplingParams(max_tokens=max_tokens, ignore_eos=constraint is None, constraint=constraint),
                         prompt_token_ids=prompt)


async def _gather(engine, requests) -> list[tuple[float, int]]:
    return await asyncio.gather(*(_generate(engine, r) for r in requests))


def _run_batch(engine, requests) -> tuple[float, list[int]]:
    """Output tokens/s of `requests` sent together, and each one's token count."""
    start = time.perf_counter()
    counts = [count for _, count in asyncio.run(_gather(engine, requests))]
    return sum(counts) / (time.perf_counter() - start), counts


def measure_ttft(engine, probe: Probe, tokenizer, repeats: int) -> dict:
    """Steps 1 and 2 of the module docstring (recorded under the probe's tags "miss", "free" and "hit")."""
    from services.decoder.constraints import Constraint

    def ttft(tag: str, prompt, constraint) -> float:
        probe.tag = tag
        (first, _), = asyncio.run(_gather(engine, [_request(prompt, 1, constraint)]))
        probe.tag = None
        return first

    misses = []
    for index, case in enumerate(SCHEMAS):
        before = len(probe.compiles)
        first = ttft("miss", _prompts(tokenizer, ["thing"], 100 + index)[0], Constraint(case.kind, case.spec))
        misses.append({"schema": case.name, "ttft": first, "compile": sum(probe.compiles[before:])})
    prompt = _prompts(tokenizer, ["person"], 200)[0]
    hit = Constraint(SCHEMAS[0].kind, SCHEMAS[0].spec)
    ttft("warm-up", prompt, None)  # the prompt's full blocks into the prefix cache
    times: dict[str, list[float]] = {"free": [], "hit": []}
    for r in range(repeats):
        for tag, constraint in [("free", None), ("hit", hit)][:: 1 if r % 2 == 0 else -1]:
            times[tag].append(ttft(tag, prompt, constraint))
    return {"misses": misses, **times}


def measure_throughput(engine, probe: Probe, tokenizer, batch: int, max_tokens: int, rounds: int,
                       schema_index: int) -> dict:
    """Step 3 of the module docstring; step 4's timings are recorded by `probe` meanwhile."""
    from services.decoder.constraints import Constraint

    same_case = SCHEMAS[schema_index]
    same = Constraint(same_case.kind, same_case.spec)
    half = batch // 2
    mix_cases = [SCHEMAS[i % len(SCHEMAS)] for i in range(half)]
    subject = lambda case: case.name.split(" (")[0]  # noqa: E731
    same_prompts = _prompts(tokenizer, [subject(same_case)] * batch, 1)
    mix_prompts = _prompts(tokenizer, [subject(c) for c in mix_cases] + ["person"] * (batch - half), 2)
    mix_constraints = [Constraint(c.kind, c.spec) for c in mix_cases] + [None] * (batch - half)
    # warm-up: learns each constrained request's length and puts every prompt in the prefix cache
    _, same_counts = _run_batch(engine, [_request(p, max_tokens, same) for p in same_prompts])
    _, mix_counts = _run_batch(engine, [_request(p, max_tokens, c) for p, c in zip(mix_prompts, mix_constraints)])
    regimes = {
        "same, constrained": [_request(p, max_tokens, same) for p in same_prompts],
        "same, free": [_request(p, n) for p, n in zip(same_prompts, same_counts)],
        "mix, constrained": [_request(p, max_tokens, c) for p, c in zip(mix_prompts, mix_constraints)],
        "mix, free": [_request(p, n) for p, n in zip(mix_prompts, mix_counts)],
    }
    rates: dict[str, list[float]] = {tag: [] for tag in regimes}
    tokens: dict[str, list[int]] = {tag: [] for tag in regimes}
    for _ in range(rounds):
        for tag, requests in regimes.items():
            probe.tag = tag
            rate, counts = _run_batch(engine, requests)
            probe.tag = None
            rates[tag].append(rate)
            tokens[tag].append(sum(counts))
    return {"rates": rates, "tokens": {tag: statistics.median(n) for tag, n in tokens.items()},
            "steps": {tag: probe.step_seconds(tag) for tag in regimes}, "schema": same_case.name}


def child(args: argparse.Namespace) -> dict:
    """The measurement, in the process `main` starts: returns what `report` formats."""
    from transformers import AutoTokenizer

    from services.common.compute import confine_other_threads
    from services.decoder.config import DecoderConfig
    from services.decoder.engine import start_engine

    engine = start_engine(DecoderConfig(model_dir=str(args.model_dir), max_model_len=args.max_model_len))
    confine_other_threads()  # as a served engine: only the engine thread computes multi-threaded
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    probe = Probe(engine, args.batch)
    try:
        asyncio.run(_gather(engine, [_request(_prompts(tokenizer, ["cat"], 0)[0], 4)]))  # warm-up
        ttft = measure_ttft(engine, probe, tokenizer, args.ttft_repeats)
        throughput = measure_throughput(engine, probe, tokenizer, args.batch, args.max_tokens, args.rounds,
                                        args.schema)
    finally:
        engine.shutdown()
    backends = engine.parts.backends
    return {"ttft": ttft, "throughput": throughput, "records": probe.records,
            "backends": f"attention {backends.attention}, linear {backends.linear}"}


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f}"


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def report(args: argparse.Namespace, result: dict) -> str:
    """The results page: throughput by regime, then structured output's costs."""
    med = statistics.median
    ttft, tp, records = result["ttft"], result["throughput"], result["records"]
    rates, steps = tp["rates"], tp["steps"]
    lines = ["# bench structured\n", f"machine: {machine()}",
             f"model: {args.model_dir.name}, float32, engine in process ({result['backends']}; other settings: "
             "defaults), greedy",
             f"workload: batch {args.batch}, chat prompts of ~50 tokens (in the prefix cache), max_tokens "
             f"{args.max_tokens}; \"same\": every request constrained by \"{tp['schema']}\"; \"mix\": "
             f"{args.batch // 2} constrained by {args.batch // 2} schemas + {args.batch - args.batch // 2} free "
             f"(bench/_grammar_cases.py); each free twin generates as many tokens (ignore_eos); {args.rounds} "
             "rounds, the regimes alternated\n",
             "| regime | output tokens per round | tokens/s, median (rounds) | full-batch decode step ms, median "
             "| sampler ms per full-batch step, median | constrained / free, median of rounds | target |",
             "|---|---|---|---|---|---|---|"]
    for kind in ("same", "mix"):
        ratio = med(a / b for a, b in zip(rates[f"{kind}, constrained"], rates[f"{kind}, free"]))
        for tag in (f"{kind}, constrained", f"{kind}, free"):
            constrained, sampler = tag.endswith("constrained"), records.get(tag, {}).get("sample")
            lines.append(f"| {tag} | {tp['tokens'][tag]:.0f} | {med(rates[tag]):.1f} "
                         f"({', '.join(f'{r:.1f}' for r in rates[tag])}) | {_ms(med(steps[tag])) if steps[tag] else '-'} "
                         f"| {_ms(med(sampler)) if sampler else '-'} | {f'{ratio:.2f}' if constrained else ''} "
                         f"| {'>= 0.90' if tag == 'same, constrained' else ''} |")
    misses, hit = ttft["misses"], records.get("hit", {})
    diffs = [h - f for h, f in zip(ttft["hit"], ttft["free"])]
    parts = {kind: med(v if kind != "fill" else [s for _, s in v]) for kind, v in hit.items()
             if kind in ("lookup", "matcher", "fill", "apply")}
    same = records.get("same, constrained", {})
    fills = [s for rows, s in same.get("fill", []) if rows == args.batch]
    mix_fills = [s for _, s in records.get("mix, constrained", {}).get("fill", [])]
    lines += ["", "| structured output's costs | ms | target |", "|---|---|---|",
              f"| schema compile, cache miss: median over {len(misses)} schemas (max) "
              f"| {_ms(med(m['compile'] for m in misses))} ({_ms(max(m['compile'] for m in misses))}) | |",
              f"| TTFT, the first request of a schema (its compile included), median | {_ms(med(m['ttft'] for m in misses))} | |",
              f"| TTFT, free, median of {len(ttft['free'])} | {_ms(med(ttft['free']))} | |",
              f"| TTFT, constrained by a compiled schema (cache hit), median of {len(ttft['hit'])} | {_ms(med(ttft['hit']))} | |",
              f"| a cache hit's added TTFT: median of the pairs' differences; difference of the medians "
              f"(this machine's noise included) | {_ms(med(diffs))}; {_ms(med(ttft['hit']) - med(ttft['free']))} "
              "| < 1 ms |",
              "| a cache hit's added work, from its parts (medians): " + " + ".join(
                  f"{kind} {_ms(v)}" for kind, v in parts.items()) + " (the fill overlaps the forward) "
              f"| {_ms(sum(parts.values()))} | < 1 ms |",
              f"| mask fill per step, {args.batch} constrained rows (worker thread, during the forward), median (p99) "
              f"| {_ms(med(fills)) if fills else '-'} ({_ms(_p99(fills)) if fills else '-'}) | |",
              f"| mask fill per step, mix ({args.batch // 2} constrained rows), median "
              f"| {_ms(med(mix_fills)) if mix_fills else '-'} | |",
              f"| applying the masks per step, {args.batch} rows (sampler: grammar.apply_bitmask), median "
              f"| {_ms(med(same['apply'])) if same.get('apply') else '-'} | |",
              f"| advancing a matcher by its token (GrammarState.accept, engine thread), median "
              f"| {1e3 * med(same['accept']):.4f} | |" if same.get("accept") else "| advancing a matcher | - | |"]
    lines += ["", "compile per schema, ms: " + "; ".join(f"{m['schema']} {_ms(m['compile'])}" for m in misses)]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests per round")
    parser.add_argument("--max-tokens", type=int, default=24, help="a constrained request's max_tokens")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four regimes")
    parser.add_argument("--ttft-repeats", type=int, default=10, help="free / cache-hit TTFT pairs")
    parser.add_argument("--schema", type=int, default=0, choices=range(len(SCHEMAS)),
                        help="index of the schema of the \"same\" regime in bench/_grammar_cases.SCHEMAS")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results/structured.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from services.common.launch import service_env

    args = parse_args(argv)
    env = service_env({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))})
    done = subprocess.run([sys.executable, __file__, "--child", *(argv or [])], env=env, stdout=subprocess.PIPE,
                          text=True)
    if done.returncode != 0:
        print(f"bench structured: the measuring process failed (exit {done.returncode})", file=sys.stderr)
        return 1
    text = report(args, json.loads(done.stdout.strip().splitlines()[-1]))
    print(text)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "structured.md").write_text(text)
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        print(json.dumps(child(parse_args(sys.argv[1:]))))
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
