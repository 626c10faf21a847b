"""`tessera bench kernels`: the Triton kernels on a GPU beside the torch paths, in one run.

For a machine with a GPU, where the SGMV crossover is measured; on a machine without CUDA it says so
and exits, and `--interpret` runs a tiny version in Triton's CPU interpreter as a smoke test (its
timings mean nothing; no results file).

  1. Multi-LoRA, 8 adapters of rank 16, for each projection shape and m rows per adapter
     (1, 2, 4, ... 256): BGMV (one program per row), SGMV (tiled matmul per BLOCK_M rows of a
     segment) and the torch backend (grouped bmm). Every result is checked against a float64
     reference. Prints, per shape, the smallest m from which SGMV beats BGMV: the crossover
     that decides which kernel should take decode rows that share an adapter.
  2. Decode paged attention: the Triton kernel vs the torch path (gather + matmuls), batch x
     context grid, outputs compared.
Rewrites bench/results/kernels.md. Never a test assertion.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _decoder_proc import RESULTS, machine

SHAPES = {  # name -> (in_features, out_features)
    "llama-7b q_proj 4096->4096": (4096, 4096),
    "llama-7b down_proj 11008->4096": (11008, 4096),
    "smollm2 gate_proj 576->1536": (576, 1536),
}
ROWS_PER_ADAPTER = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ATTENTION_GRID = [(batch, context) for batch in (1, 16, 64) for context in (128, 1024, 4096)]


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call (synchronized on CUDA)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def lora_rows(shapes: dict, rows_per_adapter, device: torch.device, dtype: torch.dtype, repeats: int,
              adapters: int = 8, rank: int = 16) -> tuple[list[str], dict[str, int | None]]:
    """Table rows (ms per kernel) and, per shape, the smallest rows-per-adapter where SGMV < BGMV."""
    lines, crossover = [], {}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, (in_f, out_f) in shapes.items():
        a = (torch.randn(adapters, rank, in_f, generator=gen) / in_f ** 0.5).to(device, dtype)
        b = (torch.randn(adapters, out_f, rank, generator=gen) / rank ** 0.5).to(device, dtype)
        crossover[name] = None
        for m in rows_per_adapter:
            x = torch.randn(adapters * m, in_f, generator=gen).to(device, dtype)
            ms, error = _lora_case(x, a, b, m, device, repeats)
            if crossover[name] is None and ms["sgmv"] < ms["bgmv"]:
                crossover[name] = m
            lines.append(f"| {name} | {m} | {x.shape[0]} | {ms['bgmv']:.3f} | {ms['sgmv']:.3f} | {ms['torch']:.3f} | "
                         f"{error:.1e} |")
    return lines, crossover


def _lora_case(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: int, device: torch.device,
               repeats: int) -> tuple[dict[str, float], float]:
    """ms per call of each kernel on rows sorted by adapter, m per adapter; the largest error vs float64."""
    from services.decoder.lora.batch import LoRABatch
    from services.decoder.lora.torch_backend import TorchLoRABackend
    from services.decoder.lora.triton_backend import bgmv, sgmv

    adapters, n = a.shape[0], x.shape[0]
    slots = torch.arange(adapters).repeat_interleave(m).to(device)
    rows = torch.arange(n, device=device)
    batch = LoRABatch.build(slots, rows)
    seg_starts, seg_lens = torch.arange(0, n, m, device=device), torch.full((adapters,), m, device=device)
    ref = torch.einsum("nr,nor->no", torch.einsum("ni,nri->nr", x.double(), a[slots].double()), b[slots].double())
    y0 = torch.zeros(n, b.shape[1], device=device, dtype=x.dtype)
    torch_backend = TorchLoRABackend()
    runs = {
        "bgmv": lambda y: bgmv(y, x, a, b, rows, slots),
        "sgmv": lambda y: sgmv(y, x, a, b, rows, seg_starts, seg_lens, torch.arange(adapters, device=device), m),
        "torch": lambda y: torch_backend.add_lora(y, x, a, b, batch),
    }
    ms, error = {}, 0.0
    for kernel, run in runs.items():
        y = y0.clone()
        run(y)
        error = max(error, (y.double() - ref).abs().max().item())
        ms[kernel] = 1000 * _timed(lambda run=run: run(y0.clone()), device, repeats)
    return ms, error


def attention_rows(grid, device: torch.device, dtype: torch.dtype, repeats: int, heads: int = 32,
                   kv_heads: int = 8, head_dim: int = 128, block_size: int = 16) -> list[str]:
    """Decode attention (one query token per sequence) over a shuffled paged cache: ms and max diff."""
    lines = []
    gen = torch.Generator(device="cpu").manual_seed(1)
    for batch, context in grid:
        t_triton, t_torch, diff = _attention_case(batch, context, heads, kv_heads, head_dim, block_size, gen,
                                                  device, dtype, repeats)
        lines.append(f"| {batch} | {context} | {t_triton:.3f} | {t_torch:.3f} | {diff:.1e} |")
    return lines


def _attention_case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                    gen: torch.Generator, device: torch.device, dtype: torch.dtype,
                    repeats: int) -> tuple[float, float, float]:
    """(Triton ms, torch ms, max difference) for `batch` sequences of `context` positions."""
    from services.decoder.attention.triton_kernel import triton_paged_attention

    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(device, torch.int32)
    query = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    seq = torch.arange(batch, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    positions = (tables.long()[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
    positions = positions[:, :context]                                             # [batch, context] cache slots

    def torch_path():
        k = k_cache[:, positions].permute(1, 0, 2, 3)                             # [batch, kv, ctx, d]
        v = v_cache[:, positions].permute(1, 0, 2, 3)
        q = query.view(batch, kv_heads, heads // kv_heads, head_dim)
        p = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * scale, dim=-1)
        return (p @ v.float()).reshape(batch, heads, head_dim).to(dtype)

    def triton_path():
        return triton_paged_attention(query, k_cache, v_cache, tables, seq, lens, block_size, scale)

    diff = (triton_path().float() - torch_path().float()).abs().max().item()
    return 1000 * _timed(triton_path, device, repeats), 1000 * _timed(torch_path, device, repeats), diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true",
                        help="no GPU: tiny sizes in Triton's CPU interpreter (a smoke test; timings mean nothing)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the Triton kernel modules are imported
        device, dtype, repeats = torch.device("cpu"), torch.float32, 1
        shapes, rows_per_adapter = {"tiny 48->40": (48, 40)}, (1, 4)
        grid = [(2, 40)]
        attention_kwargs = {"heads": 4, "kv_heads": 2, "head_dim": 16}
    elif not torch.cuda.is_available():
        print("tessera bench kernels needs a CUDA GPU (this machine has none); --interpret runs a CPU smoke test")
        return 0
    else:
        device, dtype, repeats = torch.device("cuda"), getattr(torch, args.dtype), args.repeats
        shapes, rows_per_adapter, grid, attention_kwargs = SHAPES, ROWS_PER_ADAPTER, ATTENTION_GRID, {}

    lora, crossover = lora_rows(shapes, rows_per_adapter, device, dtype, repeats)
    attention = attention_rows(grid, device, dtype, repeats, **attention_kwargs)
    text = "\n".join([
        "# bench kernels", "",
        f"machine: {machine()}{' (Triton interpreter: timings mean nothing)' if args.interpret else ''}",
        f"dtype: {dtype}, median of {repeats} after a warm-up", "",
        "## Multi-LoRA: 8 adapters, rank 16, m rows per adapter (ms per call)", "",
        "| projection | m | rows | BGMV | SGMV (tiled) | torch (grouped bmm) | max error vs float64 |",
        "|---|---|---|---|---|---|---|", *lora, "",
        "SGMV beats BGMV from m = " + ", ".join(f"{m} ({name})" for name, m in crossover.items()), "",
        "## Decode paged attention (ms per call)", "",
        "| batch | context | Triton | torch (gather + matmul) | max difference |",
        "|---|---|---|---|---|", *attention, ""])
    print(text)
    if not args.interpret:  # a smoke test's timings are not results
        (RESULTS / "kernels.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
