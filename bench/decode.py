"""`tessera bench decode`: decoder throughput over gRPC vs transformers generate in process, and
engine overhead per decode step.

In one run on one machine:
  1. N requests (prompt lengths and max_tokens drawn uniformly from the given ranges, EOS ignored)
     sent concurrently over gRPC to `python -m services.decoder --attention-backend cpu` (the C
     decode kernel; `--attention-backend` chooses); generated tokens/s;
  2. the anchor: transformers `generate` in process on the same prompts, sequentially and in
     left-padded batches of 16 (greedy, same max_tokens per request). The machine's speed drifts,
     so step 1 runs before, between and after the two anchors (same lengths, new token ids: no
     prefix-cache hits) and each anchor is compared with the mean of the two runs around it;
  3. engine overhead: wall time per engine step while 16 requests all decode, over a bare
     transformers forward of the same shapes (16 rows x 1 token on a KV cache of the same length),
     and over the engine's own forward + lm_head; measured in a child process with a decoder
     service's environment, engine and bare forward alternated three times;
  4. for comparison, one more run of step 1 on a decoder with the default torch attention backend;
     and the step breakdown: engine step and forward + lm_head times with 1, 4, 16 and 32 rows all
     decoding, through the fused decode step (decode_step.py, where it takes that many rows) and
     layer by layer;
  5. the share of the machine's limit: each run's achieved GFLOP/s (the workload's flops over its
     wall time) and the engine step's (one decode step's flops over its time) beside the matmul
     rate torch reaches here in the model's dtype (`_flops.matmul_peak`: [M, hidden] @ [hidden,
     intermediate], M = 32..512, measured before the decoder starts; the floor is the best of
     those shapes; for bf16 also float32's, and the floor is the better of the two: bf16 arithmetic
     can always run as widened float32 FMAs, and torch's bf16 matmul is far slower than that on a
     CPU without bf16 dot products). Flops = 2 * linear params * forwarded tokens + 4 * layers * heads * head_dim *
     (p + 1) per token at position p (attention) + 2 * hidden * vocab per sampled token (lm_head);
     see bench/_flops.py. Beside them, the workload's roofline (`_flops.roofline_s`): the engine's
     schedule of steps, each taking at least its flops at the floor or its bytes (weights, KV) at
     the read bandwidth measured here, whichever is longer (and, for contrast, their sum): the share
     of the floor a perfect implementation could reach on this machine's memory. Then one stream's
     limits per precision (float32, bfloat16 and the GGUF block types the decoder serves as stored):
     the batch-1 roofline (weight bytes per token over that bandwidth) and floor (`batch1_limits`).
`--linear-backend` (default auto: the C GEMM on packed weights on a CPU without AVX-512) applies to the runs
and the engine step. `--dtype bfloat16` runs the decoder, the engine step and the transformers anchors in bf16;
`--decoder-only` skips the anchors and the comparison backend (steps 2 and 4), for before/after
measurements. Targets: >= 1.5x batched, >= 6x sequential, overhead <= 1.10. Prints one
table and rewrites bench/results/decode.md (decode-DTYPE.md for another dtype; decoder-only runs
print only). Never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _decoder_proc import RESULTS, machine, start_decoder, stop
from _flops import ModelShape, matmul_peak, read_bandwidth, roofline_s


def workload(num: int, prompt_range: tuple[int, int], tokens_range: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(*prompt_range))], rng.randint(*tokens_range))
            for _ in range(num)]


def fresh_tokens(work, seed: int = 1):
    """The same prompt lengths and max_tokens with new token ids: a second run of `work` would hit
    the decoder's prefix cache and skip most prefill."""
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in prompt], max_tokens) for prompt, max_tokens in work]


async def _grpc_run(address: str, work) -> float:
    import grpc

    from tessera.v1 import decoder_pb2, decoder_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderStub(channel)

        async def one(prompt, max_tokens):
            request = decoder_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=decoder_pb2.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True))
            return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=3600)])

        await one(work[0][0][:8], 2)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, n) for p, n in work))
        wall = time.perf_counter() - start
    return sum(counts) / wall


def _warm_up(model) -> None:
    with torch.no_grad():
        model.generate(torch.tensor([[100, 200, 300]]), max_new_tokens=4, do_sample=False, pad_token_id=0)


def hf_sequential(model, work) -> float:
    _warm_up(model)
    tokens, start = 0, time.perf_counter()
    for prompt, max_tokens in work:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        tokens += out.shape[1] - len(prompt)
    return tokens / (time.perf_counter() - start)


def hf_batched(model, work, batch: int = 16) -> float:
    """Padded batches: each batch runs to its longest max_tokens; only requested tokens count."""
    _warm_up(model)
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):
            ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
        longest = max(n for _, n in chunk)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0)
        tokens += sum(n for _, n in chunk)
    return tokens / (time.perf_counter() - start)


def engine_overhead(model_dir: Path, backend: str, dtype: str, linear: str = "auto", batch: int = 16,
                    context: int = 128, steps: int = 32, decode_step: str = "auto") -> tuple[list, list]:
    """Seconds per engine step at `batch` x `context` while all rows decode, and seconds of the engine's
    own model forward + lm_head inside those steps (one sample per step)."""
    from services.decoder.config import DecoderConfig
    from services.decoder.engine import start_engine
    from services.decoder.types import GenerateInput, SamplingParams

    engine = start_engine(DecoderConfig(model_dir=str(model_dir), max_model_len=1024, num_blocks=512,
                                        attention_backend=backend, linear_backend=linear, dtype=dtype,
                                        decode_step=decode_step))
    stamps, forwards = [], []
    schedule, logits = engine.parts.scheduler.schedule, engine.parts.runner.logits

    def timed():
        out = schedule()
        if len(out.scheduled) == batch and all(s.num_new_tokens == 1 for s in out.scheduled):
            stamps.append(time.perf_counter())
        return out

    runner = engine.parts.runner
    hidden = runner.hidden

    def timed_forward(inputs):  # the model forward (hidden) up to the lm_head (logits)
        started = time.perf_counter()
        result = hidden(inputs)
        if inputs.input_ids.numel() == batch:
            pending.append(started)
        return result

    def timed_logits(inputs, states):
        result = logits(inputs, states)
        if pending:
            forwards.append(time.perf_counter() - pending.pop())
        return result

    pending: list[float] = []
    engine.parts.scheduler.schedule = timed
    runner.hidden, runner.logits = timed_forward, timed_logits
    work = [GenerateInput(SamplingParams(max_tokens=steps + 8, ignore_eos=True), prompt_token_ids=tuple(
        random.Random(i).randrange(100, 40000) for _ in range(context))) for i in range(batch)]

    async def run():
        async def one(r):
            async for _ in engine.generate(r):
                pass
        await asyncio.gather(*(one(r) for r in work))

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    return [b - a for a, b in zip(stamps, stamps[1:])], forwards


BREAKDOWN_BATCHES = (1, 4, 16, 32)  # decode rows of the step breakdown


def overhead_child(model_dir: Path, backend: str, dtype: str, linear: str, rounds: int = 3) -> dict:
    """Engine steps and bare transformers forwards, alternated `rounds` times (the machine's speed
    drifts; both sides see the same drift). Each side computes on a thread of its own that ends
    with it, so only one OpenMP team is alive at a time, as in a decoder process (services/common/
    compute.py). Runs in its own process (see `overhead`)."""
    import threading

    from transformers import AutoModelForCausalLM

    def on_own_thread(fn, *args):
        box = []
        thread = threading.Thread(target=lambda: box.append(fn(*args)))
        thread.start()
        thread.join()
        return box[0]

    steps, forwards, bares = [], [], []
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    for _ in range(rounds):
        step, forward = engine_overhead(model_dir, backend, dtype, linear)  # the engine computes on its own thread
        steps += step
        forwards += forward
        bares += on_own_thread(bare_forward, model)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    breakdown = {}
    for batch in BREAKDOWN_BATCHES:
        for decode_step in ("fused", "modules"):
            try:
                step, forward = engine_overhead(model_dir, backend, dtype, linear, batch=batch, decode_step=decode_step)
            except ValueError:  # --decode-step fused cannot run this model or backend
                continue
            breakdown[f"{batch} {decode_step}"] = (median(step), median(forward))
    return {"step": median(steps), "forward": median(forwards), "bare": median(bares), "breakdown": breakdown}


def overhead(model_dir: Path, backend: str, dtype: str, linear: str) -> dict:
    """`overhead_child` in a fresh process with a decoder service's environment (services/common/
    launch.py), as the engine runs in production; the bare forward shares that process."""
    import json
    import subprocess

    from services.common.launch import service_env

    done = subprocess.run([sys.executable, __file__, "--overhead-child", str(model_dir), backend, dtype,
                           linear], env=service_env(),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"engine overhead measurement failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bare_forward(model, batch: int = 16, context: int = 128, steps: int = 32) -> list:
    """Seconds of bare transformers forwards: `batch` rows x 1 token over a `context` KV cache."""
    ids = torch.randint(100, 40000, (batch, context))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        times = []
        for _ in range(steps):
            next_ids = torch.randint(100, 40000, (batch, 1))
            t0 = time.perf_counter()
            model(next_ids, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-1)  # drop the token just added: same shapes every step
    return times


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(16, 512))
    parser.add_argument("--tokens-range", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--attention-backend", default="cpu", choices=("cpu", "torch", "triton"),
                        help="the decoder's attention backend for the measured runs and the engine overhead "
                             "(default cpu, the C decode kernel); with cpu or triton the default torch "
                             "backend is also measured once, for comparison")
    parser.add_argument("--linear-backend", default="auto", choices=("auto", "cpu", "torch"),
                        help="the decoder's linear backend for the measured runs and the engine overhead "
                             "(default auto: the C GEMM on the CPU where it builds)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model dtype of the decoder, the engine step, the anchors and the matmul probe")
    parser.add_argument("--decoder-only", action="store_true",
                        help="skip the transformers anchors and the comparison backend: decoder runs, the engine "
                             "step and the matmul floor only; prints, writes no results file")
    parser.add_argument("--decoder-flags", default="", help="extra flags for python -m services.decoder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = workload(args.num_requests, tuple(args.prompt_range), tuple(args.tokens_range))
    shape = ModelShape.read(args.model_dir)
    peaks = matmul_peak(shape, getattr(torch, args.dtype))  # before any decoder competes for the cores
    # bf16 arithmetic can always run as float32 FMAs after widening (exact), as the C kernels do on a
    # CPU without bf16 dot products: there torch's own bf16 matmul is far below float32's
    # (1.3 GFLOP/s on an AVX2 EPYC), so the machine's bf16 limit is the better of the two
    peaks32 = matmul_peak(shape, torch.float32) if args.dtype != "float32" else None
    bandwidth = read_bandwidth()
    flags = ["--max-model-len", "2048", "--dtype", args.dtype, "--linear-backend", args.linear_backend,
             *args.decoder_flags.split()]
    process, address = start_decoder(args.model_dir, [*flags, "--attention-backend", args.attention_backend],
                                     RESULTS / "decode-server.log")
    # This machine's speed drifts by 10-25% over minutes: each anchor is bracketed by a decoder run
    # just before and one just after it (each run new token ids of the same lengths: no prefix-cache
    # hits), and is compared with the mean of those two.
    anchors = {}
    try:
        runs = [asyncio.run(_grpc_run(address, work))]
        cost = overhead(args.model_dir, args.attention_backend, args.dtype, args.linear_backend)
        if not args.decoder_only:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
            anchors["batched"] = hf_batched(model, work)
        runs.append(asyncio.run(_grpc_run(address, fresh_tokens(work, seed=1))))
        if not args.decoder_only:
            anchors["sequential"] = hf_sequential(model, work)
            del model
        runs.append(asyncio.run(_grpc_run(address, fresh_tokens(work, seed=2))))
    finally:
        stop(process)
    if args.attention_backend != "torch" and not args.decoder_only:
        process, address = start_decoder(args.model_dir, flags, RESULTS / "decode-server-torch.log")
        try:
            anchors["torch"] = asyncio.run(_grpc_run(address, fresh_tokens(work, seed=3)))
        finally:
            stop(process)
    text = report(args, work, shape, peaks, runs, cost, anchors, flags, peaks32, bandwidth)
    print(text)
    if not args.decoder_only:
        RESULTS.mkdir(parents=True, exist_ok=True)
        name = "decode.md" if args.dtype == "float32" else f"decode-{args.dtype}.md"
        (RESULTS / name).write_text(text)
    return 0


# bytes per weight of each precision the decoder serves (ggml blocks for the quantized ones: a scale per block)
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "Q8_0": 34 / 32, "Q6_K": 210 / 256, "Q4_1": 20 / 32, "Q4_K": 144 / 256,
                "Q4_0": 18 / 32}


def batch1_limits(shape: ModelShape, peak_gflops: float, bandwidth_gbs: float) -> str:
    """A table of one stream's limits per precision: every token reads each projection and the
    lm_head once (the roofline: those bytes over `bandwidth_gbs`) and computes 2 flops per weight
    (the floor: at `peak_gflops`, the matmul floor measured in this run)."""
    weights = shape.linear_params + shape.hidden * shape.vocab
    floor = peak_gflops * 1e9 / (2 * weights)
    lines = [f"| batch 1, per precision: the weights every token reads ({weights / 1e6:.0f}M) | MB per token | "
             f"roofline tok/s (at {bandwidth_gbs:.1f} GB/s) | floor tok/s (2 flops a weight at {peak_gflops:.0f} "
             "GFLOP/s) |", "|---|---|---|---|"]
    for name, size in WEIGHT_BYTES.items():
        megabytes = weights * size / 1e6
        lines.append(f"| {name} | {megabytes:.0f} | {bandwidth_gbs * 1e3 / megabytes:.0f} | {floor:.0f} |")
    return "\n".join(lines)


def report(args, work, shape: ModelShape, peaks: dict[int, float], runs: list[float], cost: dict,
           anchors: dict[str, float], flags: list[str], peaks32: dict[int, float] | None = None,
           bandwidth: float | None = None) -> str:
    """The results page: throughput rows, the share of the matmul floor, engine overhead. `peaks32`:
    torch's float32 rates, for a bf16 run (its floor is the better of the two dtypes' best);
    `bandwidth`: GB/s read from memory, for the workload's roofline (`_flops.roofline_s`)."""
    tokens = sum(n for _, n in work)
    gflop = sum(shape.request_flops(len(p), n) for p, n in work) / 1e9
    peak = max(peaks.values()) if peaks32 is None else max(*peaks.values(), *peaks32.values())
    ours = sum(runs) / len(runs)
    gflops = ours * gflop / tokens  # tok/s * flop/token
    around_batched, around_sequential = (runs[0] + runs[1]) / 2, (runs[1] + runs[2]) / 2
    rows = [(f"tessera decoder over gRPC, attention backend {args.attention_backend} (continuous batching; "
             f"runs {', '.join(f'{r:.1f}' for r in runs)})", ours, ours)]
    if "torch" in anchors:
        rows.append(("tessera decoder over gRPC, attention backend torch (one run, last)",
                     anchors["torch"], runs[-1]))
    if "batched" in anchors:
        rows += [("transformers generate, padded batches of 16", anchors["batched"], around_batched),
                 ("transformers generate, sequential", anchors["sequential"], around_sequential)]
    step, own_forward, bare = cost["step"], cost["forward"], cost["bare"]
    step_gflops = shape.decode_step_flops(16, 128 + 20) / step / 1e9  # 16 rows, context 128 -> 168 over the steps
    lines = ["# bench decode\n", f"machine: {machine()}", f"model: {args.model_dir.name}, {args.dtype}",
             f"workload: {len(work)} requests, prompts {args.prompt_range[0]}-{args.prompt_range[1]} tokens, "
             f"max_tokens {args.tokens_range[0]}-{args.tokens_range[1]} (EOS ignored); {gflop:.0f} GFLOP for "
             f"{tokens} generated tokens (bench/_flops.py)",
             f"decoder flags: {' '.join(flags)} --attention-backend {args.attention_backend} "
             "(other settings: defaults)\n",
             "| mode | tokens/s | ours: the runs around it | ours / this |", "|---|---|---|---|"]
    lines += [f"| {name} | {tps:.1f} | {near:.1f} | {near / tps:.2f} |" for name, tps, near in rows]
    lines += ["", f"| the machine's limit, {args.dtype} | GFLOP/s | share of the matmul floor |", "|---|---|---|",
              "| torch.matmul [M, hidden] @ [hidden, intermediate], M = "
              f"{', '.join(f'{m}: {r:.0f}' for m, r in peaks.items())} ({'floor: ' if peaks32 is None else ''}the best) "
              f"| {max(peaks.values()):.0f} "
              f"| {max(peaks.values()) / peak:.2f} |",
              *([] if peaks32 is None else [
                  "| the same in float32 (bf16 widened exactly to float32 FMAs, as the C kernels do without bf16 "
                  f"dot products; the floor is the better dtype's best), M = {', '.join(f'{m}: {r:.0f}' for m, r in peaks32.items())} "
                  f"| {max(peaks32.values()):.0f} | {max(peaks32.values()) / peak:.2f} |"]),
              f"| tessera decoder, the workload (mean of the runs; floor {tokens * peak / gflop:.0f} tok/s) "
              f"| {gflops:.0f} | {gflops / peak:.2f} |",
              f"| tessera engine decode step, 16 rows x context 128-168 | {step_gflops:.0f} | {step_gflops / peak:.2f} |"]
    if bandwidth is not None:
        overlapped, summed = roofline_s(shape, work, peak, bandwidth, torch.tensor([], dtype=getattr(torch, args.dtype))
                                        .element_size())
        lines += [f"| the workload's roofline: each step at least its flops at the floor or its bytes (weights once, "
                  f"each row's KV) at this machine's read bandwidth, {bandwidth:.1f} GB/s, whichever is longer "
                  f"({tokens / overlapped:.0f} tok/s) | {gflop / overlapped:.0f} | {gflop / overlapped / peak:.2f} |",
                  f"| the same with each step's compute and memory one after the other ({tokens / summed:.0f} tok/s) "
                  f"| {gflop / summed:.0f} | {gflop / summed / peak:.2f} |"]
    if bandwidth is not None:
        lines += ["", batch1_limits(shape, peak, bandwidth)]
    lines += ["", f"| engine overhead at batch 16 x context 128 (attention backend {args.attention_backend}) "
              "| ms | target |", "|---|---|---|",
              f"| engine decode step (schedule + inputs + forward + sample + bookkeeping) | {1000 * step:.1f} | |",
              f"| the engine's model forward + lm_head alone, same step | {1000 * own_forward:.1f} | |",
              f"| bare transformers forward, same shapes | {1000 * bare:.1f} | |",
              f"| step / bare transformers forward | {step / bare:.2f} | <= 1.10 |",
              f"| step / own forward | {step / own_forward:.2f} | |",
              ""]
    lines += ["| step breakdown: all rows decoding, context 128, --decode-step (fused: every layer in one C call "
              "where it runs that many rows; modules: layer by layer) | step ms | forward + lm_head ms | "
              "the rest of the step ms | tok/s |", "|---|---|---|---|---|"]
    for key, (step_s, forward_s) in cost.get("breakdown", {}).items():
        batch, decode_step = key.split()
        lines.append(f"| batch {batch}, {decode_step} | {1000 * step_s:.1f} | {1000 * forward_s:.1f} | "
                     f"{1000 * (step_s - forward_s):.1f} | {int(batch) / step_s:.1f} |")
    lines += ["", "targets: >= 1.5x batched, >= 6x sequential"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--overhead-child"]:
        import json

        print(json.dumps(overhead_child(Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])))
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
