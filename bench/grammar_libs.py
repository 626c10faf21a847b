"""`tessera bench grammar_libs`: xgrammar (tessera's structured-output library) vs llguidance, with the
served model's tokenizer (default SmolLM2-135M-Instruct, 49152 tokens).

In one run on one machine, for each workload of bench/_grammar_cases.py (10 JSON schemas of varied
shapes, a regex, a choice, a small EBNF grammar):
  1. compile (a cache miss): xgrammar through tessera's own path (services/decoder/grammar.py's
     GrammarCompiler.compile_now: strict JSON, compact separators, one thread); llguidance as vLLM's
     guidance backend does it (grammar_from_* + a new LLMatcher, compact JSON). Median of --repeats,
     the two libraries alternated;
  2. the token walk: the workload's text tokenized by the model's tokenizer, then EOS; at each position
     the library fills the next-token bitmask [1, ceil(vocab / 32)] (timed: xgrammar's
     fill_next_token_bitmask, llguidance.torch.fill_next_token_bitmask), the mask is checked to allow
     the walk's token, and the matcher advances by it (timed apart). The first walk after a compile
     (cold: llguidance builds its lexer states lazily, xgrammar fills its caches) is reported as a
     total; then --repeats walks, each on a fresh matcher of the same compiled grammar (xgrammar: a new
     GrammarMatcher; llguidance: a deep_copy of the compiled LLMatcher, whose lexer cache the copies
     share), give the per-token median and p99;
  3. memory per compiled grammar: xgrammar's own count (CompiledGrammar.memory_size_bytes), and for both
     libraries the process's resident-set growth while --copies compiled grammars (each walked once)
     are held, divided by --copies (approximate: the allocator's reuse blurs small grammars).
llguidance is not a tessera dependency: install it beside the run (`pip install llguidance==1.9.1`,
or `pip install --no-deps --target DIR llguidance==1.9.1` and `--llguidance-path DIR`). Without it
the run measures xgrammar alone and leaves bench/results/grammar_libs.md as it is. Prints one table
and rewrites that file. Never a test assertion.
"""

from __future__ import annotations

import abc
import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import RESULTS, machine
from _grammar_cases import CASES, Case

LLGUIDANCE_PIN = "llguidance==1.9.1"


class Library(abc.ABC):
    """One grammar library behind the walk: `compile` returns a compiled grammar (raises on one it
    refuses), `matcher` a fresh matcher at its start, `fill` writes row 0 of an int32 bitmask
    [1, ceil(vocab / 32)] (bit j of word w: token 32 w + j allowed), `advance` takes one token (False:
    refused), `done` says the matcher has taken a stop token on a complete text."""

    name: str
    version: str
    setup_s: float  # building the library's view of the tokenizer, once

    @abc.abstractmethod
    def compile(self, case: Case): ...

    @abc.abstractmethod
    def matcher(self, compiled): ...

    @abc.abstractmethod
    def fill(self, matcher, bitmask) -> None: ...

    @abc.abstractmethod
    def advance(self, matcher, token_id: int) -> bool: ...

    @abc.abstractmethod
    def done(self, matcher) -> bool: ...

    def memory_bytes(self, compiled) -> int | None:
        """The library's own count of a compiled grammar's bytes (None: it keeps none)."""
        return None


class Xgrammar(Library):
    """xgrammar as tessera compiles and matches it (services/decoder/grammar.py)."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        from importlib.metadata import version

        from services.decoder.grammar import GrammarCompiler

        self.version = version("xgrammar")
        start = time.perf_counter()
        self._compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.setup_s = time.perf_counter() - start

    def compile(self, case: Case):
        from services.decoder.constraints import Constraint

        return self._compiler.compile_now(Constraint(case.kind, case.spec))

    def matcher(self, compiled):
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def advance(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()

    def memory_bytes(self, compiled) -> int | None:
        return compiled.memory_size_bytes


class Llguidance(Library):
    """llguidance as vLLM's guidance backend uses it: one LLTokenizer, an LLMatcher per grammar."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg, self._fill = llguidance, llguidance.torch.fill_next_token_bitmask
        self.version = llguidance.__version__
        start = time.perf_counter()
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)
        self.setup_s = time.perf_counter() - start

    def grammar(self, case: Case) -> str:
        LLMatcher = self._llg.LLMatcher
        if case.lark is not None:
            return LLMatcher.grammar_from_lark(case.lark)
        if case.kind == "json_schema":  # compact, as tessera's json kinds
            return LLMatcher.grammar_from_json_schema(case.spec, defaults={
                "whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        return self._llg.grammar_from(case.kind, case.spec)

    def compile(self, case: Case):
        matcher = self._llg.LLMatcher(self._tokenizer, self.grammar(case), log_level=0)
        if matcher.is_error():
            raise ValueError(f"llguidance refuses {case.name}: {matcher.get_error()}")
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask) -> None:
        self._fill(matcher, bitmask, 0)

    def advance(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def done(self, matcher) -> bool:
        return matcher.is_stopped() and not matcher.is_error()


def load_llguidance(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> Library | None:
    """The llguidance side, or None (printing how to install it) where the package is missing."""
    try:
        return Llguidance(tokenizer, vocab_size, stop_token_ids)
    except ImportError as error:
        print(f"llguidance not installed: pip install {LLGUIDANCE_PIN} ({error}); measuring xgrammar alone")
        return None


def walk(library: Library, compiled, token_ids: list[int], vocab_size: int) -> tuple[list[float], list[float]]:
    """Seconds of each position's mask fill and of each advance over `token_ids` (the last a stop
    token), on a fresh matcher. Raises RuntimeError where the library's mask or matcher refuses the walk."""
    import torch

    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)  # [1, words]
    matcher = library.matcher(compiled)
    fills, advances = [], []
    for position, token in enumerate(token_ids):
        start = time.perf_counter()
        library.fill(matcher, bitmask)
        fills.append(time.perf_counter() - start)
        if not (int(bitmask[0, token // 32]) >> (token % 32)) & 1:
            raise RuntimeError(f"{library.name}: the mask at position {position} refuses token {token}")
        start = time.perf_counter()
        accepted = library.advance(matcher, token)
        advances.append(time.perf_counter() - start)
        if not accepted:
            raise RuntimeError(f"{library.name}: the matcher refuses token {token} at position {position}")
    if not library.done(matcher):
        raise RuntimeError(f"{library.name}: the walk ends on an incomplete text")
    return fills, advances


def _rss_bytes() -> int:
    import psutil

    try:  # hand freed arenas back first, so the growth is what the held grammars keep
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return psutil.Process().memory_info().rss


def rss_per_grammar(library: Library, case: Case, token_ids: list[int], vocab_size: int, copies: int) -> float:
    """Resident bytes per compiled grammar while `copies` of it are held, each walked once."""
    before = _rss_bytes()
    held = []
    for _ in range(copies):
        compiled = library.compile(case)
        walk(library, compiled, token_ids, vocab_size)
        held.append(compiled)
    grown = _rss_bytes() - before
    del held
    return max(grown, 0) / copies


def measure(libraries: list[Library], cases: list[Case], tokenizer, eos_id: int, vocab_size: int,
            repeats: int, copies: int) -> dict:
    """Per library and case: compile seconds (each repeat), the first walk's summed fill seconds, the
    warm walks' fill and advance seconds (pooled), library-counted and resident bytes per grammar."""
    walks = {case.name: [*tokenizer.encode(case.text, add_special_tokens=False), eos_id] for case in cases}
    out = {lib.name: {case.name: {"compile": [], "fill": [], "advance": []} for case in cases} for lib in libraries}
    compiled = {}
    for r in range(repeats):  # compiles, the libraries alternated (and their order flipped each repeat)
        for case in cases:
            for lib in (libraries if r % 2 == 0 else libraries[::-1]):
                start = time.perf_counter()
                grammar = lib.compile(case)
                out[lib.name][case.name]["compile"].append(time.perf_counter() - start)
                if r == 0:
                    compiled[lib.name, case.name] = grammar
                    fills, _ = walk(lib, grammar, walks[case.name], vocab_size)
                    out[lib.name][case.name]["first"] = sum(fills)
                    out[lib.name][case.name]["memory"] = lib.memory_bytes(grammar)
    for r in range(repeats):  # warm walks on fresh matchers, alternated
        for case in cases:
            for lib in (libraries if r % 2 == 0 else libraries[::-1]):
                fills, advances = walk(lib, compiled[lib.name, case.name], walks[case.name], vocab_size)
                out[lib.name][case.name]["fill"] += fills
                out[lib.name][case.name]["advance"] += advances
    for case in cases:
        for lib in libraries:
            out[lib.name][case.name]["rss"] = rss_per_grammar(lib, case, walks[case.name], vocab_size, copies)
    return {"cases": out, "tokens": {name: len(ids) for name, ids in walks.items()}}


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _pair(values: list[float | None], fmt: str) -> str:
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


def report(args, libraries: list[Library], result: dict, vocab_size: int) -> str:
    """The results page: a summary row per library, then one row per workload."""
    data, names = result["cases"], [lib.name for lib in libraries]
    lines = ["# bench grammar_libs\n", f"machine: {machine()}",
             "libraries: " + ", ".join(f"{lib.name} {lib.version}" for lib in libraries),
             f"tokenizer: {args.model_dir.name} ({vocab_size} tokens); {len(CASES)} workloads "
             f"(bench/_grammar_cases.py), {sum(result['tokens'].values())} tokens walked per repeat; "
             f"compile: median of {args.repeats}; masks: {args.repeats} warm walks per workload, pooled; "
             f"resident memory: {args.copies} copies held\n",
             "| library | tokenizer setup ms | compile ms, median over workloads (max) | mask fill us, median "
             "| mask fill us, p99 | advance us, median | first walk after a compile, masks ms (median over "
             "workloads) | memory per grammar KiB, library's count (median) | resident KiB per grammar (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lib in libraries:
        cases = data[lib.name].values()
        compiles = [statistics.median(c["compile"]) for c in cases]
        fills = [f for c in cases for f in c["fill"]]
        memory = [c["memory"] for c in cases if c["memory"] is not None]
        lines.append(f"| {lib.name} {lib.version} | {1e3 * lib.setup_s:.0f} | {1e3 * statistics.median(compiles):.2f} "
                     f"({1e3 * max(compiles):.1f}) | {1e6 * statistics.median(fills):.1f} | {1e6 * _p(fills, 0.99):.1f} "
                     f"| {1e6 * statistics.median(f for c in cases for f in c['advance']):.1f} "
                     f"| {1e3 * statistics.median(c['first'] for c in cases):.2f} "
                     f"| {f'{statistics.median(memory) / 1024:.0f}' if memory else '-'} "
                     f"| {statistics.median(c['rss'] for c in cases) / 1024:.0f} |")
    if len(libraries) > 1:
        x, g = (data[n].values() for n in names)
        ratio = (statistics.median(f for c in g for f in c["fill"])
                 / statistics.median(f for c in x for f in c["fill"]))
        lines += ["", f"mask fill, median: llguidance / xgrammar = {ratio:.1f}x"]
    head = " / ".join(names)
    lines += ["", f"| workload | tokens | compile ms ({head}) | mask fill us, median ({head}) | mask fill us, p99 "
              f"({head}) | first walk's masks ms ({head}) | KiB, library's count | resident KiB ({head}) |",
              "|---|---|---|---|---|---|---|---|"]
    for case in CASES:
        per = [data[n][case.name] for n in names]
        memory = per[0]["memory"]
        lines.append(f"| {case.name} | {result['tokens'][case.name]} "
                     f"| {_pair([1e3 * statistics.median(c['compile']) for c in per], '.2f')} "
                     f"| {_pair([1e6 * statistics.median(c['fill']) for c in per], '.1f')} "
                     f"| {_pair([1e6 * _p(c['fill'], 0.99) for c in per], '.1f')} "
                     f"| {_pair([1e3 * c['first'] for c in per], '.2f')} "
                     f"| {'-' if memory is None else f'{memory / 1024:.0f}'} "
                     f"| {_pair([c['rss'] / 1024 for c in per], '.0f')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench grammar_libs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir(), help="the tokenizer's model")
    parser.add_argument("--repeats", type=int, default=10, help="compiles and warm walks per workload and library")
    parser.add_argument("--copies", type=int, default=8, help="compiled grammars held for the resident-memory count")
    parser.add_argument("--llguidance-path", type=Path, default=None,
                        help="a directory holding the llguidance package (pip install --target DIR), searched last")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    if args.llguidance_path is not None:
        sys.path.append(str(args.llguidance_path))
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    config = json.loads((args.model_dir / "config.json").read_text())
    vocab_size, eos_id = config["vocab_size"], tokenizer.eos_token_id
    libraries: list[Library] = [Xgrammar(tokenizer, vocab_size, [eos_id])]
    anchor = load_llguidance(tokenizer, vocab_size, [eos_id])
    if anchor is not None:
        libraries.append(anchor)
    result = measure(libraries, CASES, tokenizer, eos_id, vocab_size, args.repeats, args.copies)
    text = report(args, libraries, result, vocab_size)
    print(text)
    if anchor is None:
        print(f"{RESULTS / 'grammar_libs.md'} left as it is: it holds the comparison with llguidance")
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grammar_libs.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
