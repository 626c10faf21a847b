"""GGUF block-quantized weights served as stored (services/decoder/quant.py, quantized_model.py,
kernels/quant_gemm.c; `tessera models import --keep-quantized`), against transformers running the
same GGUF (its dequantized load) on tiny seeded checkpoints.

- Each format (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and a Q4_K_M-style mix of Q4_K and Q6_K), exact mode:
  greedy ids for 64 new tokens = transformers' and fp32 logits within 1e-4 relative, alone and concurrent;
  Q4_1 (the built-in model's type) and the mix in every regime (chunked prefill, prefix hit,
  recompute preemption).
- What is held: every projection and the embeddings keep their blocks (no float32 copy), a tied
  lm_head multiplies by the embeddings' blocks, and `DecoderInfo.quantization` names the types.
- The fast mode (int8 activations) within its rule on the first step's logits.
- The triton linear backend (`--linear-backend triton`, kernels/quant_triton.py's dequantize-in-the-GEMM
  kernels; CUDA, here the CPU under TRITON_INTERPRET=1): the Q4_K_M mix served from the same blocks
  equals transformers (ids and logits), embeddings looked up from the blocks on the device.
- Two PEFT adapters and base rows over a quantized base in one batch = PEFT over transformers'
  dequantized model.
- The prefix cache's block hashes differ between a quantized and a dense base.
- Refusals: a quantized checkpoint with dtype bfloat16; through transformers' path; a tensor whose
  bytes do not fit its type.
- The built-in SmolLM2 straight from its Q4_1 file (`tessera up --quantized`): greedy ids =
  transformers on the float32 checkpoint `models prepare` dequantizes from the same file; loading
  its blocks adds at most 0.4x what loading the float32 weights adds to the decoder's RSS.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from decoder_testing import make_tiny_llama
from family_conformance import PROMPTS, check_lora, check_regime, references
from quantized_cases import FORMATS, write_gguf

from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.quant import QuantizedWeight
from services.decoder.quantized_model import QuantizedEmbedding, QuantizedParts, quantization
from tessera.cli.models import import_gguf

# logits within 1e-4 of the step's largest |logit| (plus 1e-4) of transformers': prefill chunks decode each
# weight and run MKL's GEMM, decode steps the blocked kernel, each in its own summation order
RTOL = 1e-4
# hidden 256 / intermediate 512: rows of whole K-quant blocks (256 weights)
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The tiny float32 checkpoints: one tying its head to the embeddings (as SmolLM2), one not."""
    root = tmp_path_factory.mktemp("quantized-sources")
    return {"tied": make_tiny_llama(root / "tied", seed=3, tie_word_embeddings=True, **SIZES),
            "untied": make_tiny_llama(root / "untied", seed=4, **SIZES)}


_served: dict = {}


def served(fmt: str, sources, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the GGUF, its --keep-quantized import, transformers' references on the GGUF), built once per format."""
    if fmt not in _served:
        root = tmp_path_factory.mktemp(f"quantized-{fmt}")
        source = sources["untied" if fmt == "Q4_K_M" else "tied"]
        gguf_path = write_gguf(source, fmt, root / f"tiny-{fmt}.gguf")
        model_dir = import_gguf(gguf_path, name="tiny", root=root / "models", keep_quantized=True)
        refs = references(gguf_path.parent, gguf_file=gguf_path.name)
        _served[fmt] = (gguf_path, model_dir, refs)
    return _served[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_alone_and_concurrent_equals_transformers_on_the_gguf(fmt, sources, tmp_path_factory):
    _, model_dir, refs = served(fmt, sources, tmp_path_factory)
    for regime in ("alone", "concurrent"):
        check_regime(model_dir, refs, regime, rtol=RTOL)


@pytest.mark.parametrize("regime", ("chunked", "prefix", "preempt"))
@pytest.mark.parametrize("fmt", ("Q4_1", "Q4_K_M"))
def test_every_regime(fmt, regime, sources, tmp_path_factory):
    _, model_dir, refs = served(fmt, sources, tmp_path_factory)
    check_regime(model_dir, refs, regime, rtol=RTOL)


def test_the_blocks_are_what_the_model_holds(sources, tmp_path_factory):
    _, model_dir, _ = served("Q4_K_M", sources, tmp_path_factory)
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), num_blocks=32))
    try:
        model = engine.parts.model
        layer = model.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj.gemm, QuantizedParts)  # q, k Q4_K beside v Q6_K
        assert layer.self_attn.qkv_proj.gemm.qtype == "Q4_K+Q6_K"
        assert isinstance(layer.mlp.gate_up_proj.gemm, QuantizedWeight) and layer.mlp.gate_up_proj.gemm.qtype == "Q4_K"
        assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
        dense = sum(p.numel() for p in model.parameters())
        assert dense < 10_000, f"{dense} float weights beside the blocks"  # norms only
        assert engine.info().quantization == "Q4_K+Q6_K exact"
        assert engine.info().decode_step == "modules"  # mixed types in qkv: layer by layer
    finally:
        engine.shutdown()
    _, tied_dir, _ = served("Q4_1", sources, tmp_path_factory)
    engine = start_engine(DecoderConfig(model_dir=str(tied_dir), num_blocks=32))
    try:
        model = engine.parts.model
        assert model.lm_head.gemm is model.model.embed_tokens.weight  # one copy of the tied blocks
        assert quantization(model) == "Q4_1"
        assert engine.info().decode_step == "fused"  # the regimes above ran the fused step's quantized GEMM
    finally:
        engine.shutdown()


def test_fast_mode_within_its_rule(sources, tmp_path_factory):
    """Fast mode quantizes activations to int8 per 32 values (llama.cpp's arithmetic): the kernels'
    per-output bound is checked in test_quant_kernels.py; the whole model's rule here is that the
    first step's logits differ from exact mode's (transformers') by at most 5% in relative L2 norm
    and pick the same token."""
    from decoder_testing import capture_logits, run_requests

    from services.decoder.types import GenerateInput, SamplingParams

    _, model_dir, refs = served("Q8_0", sources, tmp_path_factory)
    prompt = PROMPTS[2]
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), num_blocks=32, quant_mode="fast"))
    try:
        assert engine.info().quantization == "Q8_0 fast"
        logits = capture_logits(engine)
        run_requests(engine, [GenerateInput(SamplingParams(max_tokens=1), request_id="r0",
                                            prompt_token_ids=tuple(prompt))])
    finally:
        engine.shutdown()
    exact = refs[tuple(prompt)][1][0]
    fast = logits["r0"][0]
    assert not torch.equal(fast, exact)  # the mode changes the arithmetic
    print("fast-mode relative L2", float((fast - exact).norm() / exact.norm()))
    assert (fast - exact).norm() <= 0.05 * exact.norm()
    assert int(fast.argmax()) == int(exact.argmax())


_TRITON_SCRIPT = """
import sys
import torch
sys.path[:0] = sys.argv[4:]
from decoder_testing import check_greedy
from family_conformance import _requests
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.kernels.quant_triton import TritonQuantizedWeight
from services.decoder.quantized_model import QuantizedEmbedding, QuantizedParts

refs, device = torch.load(sys.argv[2]), sys.argv[3]
backends = dict(attention_backend="torch", lora_backend="torch") if device == "cpu" else {}
engine = start_engine(DecoderConfig(model_dir=sys.argv[1], device=device, linear_backend="triton", num_blocks=32,
                                    **backends))
try:
    model = engine.parts.model
    qkv = model.model.layers[0].self_attn.qkv_proj.gemm
    assert isinstance(qkv, QuantizedParts) and all(isinstance(w, TritonQuantizedWeight) for w, _, _ in qkv.parts)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj.gemm, TritonQuantizedWeight)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.model.embed_tokens.weight, TritonQuantizedWeight)
    assert model.lm_head.gemm.data.device.type == device
    assert engine.info().quantization == "Q4_K+Q6_K exact" and engine.info().decode_step == "modules"
    check_greedy(engine, refs, _requests([list(p) for p in refs], len(next(iter(refs.values()))[0])), rtol=float(sys.argv[5]))
    assert engine.stats().num_free_blocks == 32
finally:
    engine.shutdown()
print("TRITON_OK", flush=True)
"""


def test_triton_linear_backend_serves_the_blocks_equal_to_transformers(sources, tmp_path_factory, tmp_path):
    """`--linear-backend triton`: the GGUF blocks moved to the device and multiplied by the Triton
    kernels; two prompts, 6 new tokens (the interpreter runs each kernel program as numpy)."""
    import os
    import subprocess
    import sys

    _, model_dir, refs = served("Q4_K_M", sources, tmp_path_factory)
    refs_path = tmp_path / "refs.pt"
    torch.save({prompt: (ids[:6], logits[:6]) for prompt, (ids, logits) in list(refs.items())[:2]}, refs_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {}))
    here = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, str(model_dir), str(refs_path), device,
                          str(here), str(RTOL)], cwd=here.parents[1], env=env, capture_output=True, text=True,
                         timeout=600)
    assert "TRITON_OK" in out.stdout, out.stderr[-4000:]


def test_lora_on_a_quantized_base_equals_peft_on_the_dequantized_model(sources, tmp_path_factory):
    gguf_path, model_dir, _ = served("Q4_K_M", sources, tmp_path_factory)
    check_lora(model_dir, "all-linear", reference=gguf_path.parent, reference_load={"gguf_file": gguf_path.name})


def test_prefix_cache_salts_blocks_with_the_quantization(sources, tmp_path_factory):
    from services.decoder.prefix_cache import BlockHasher

    tokens = list(range(40))
    dense, quantized = BlockHasher(16).update(tokens), BlockHasher(16, base_key="Q4_1 exact").update(tokens)
    assert len(dense) == 2 and not set(dense) & set(quantized)
    assert BlockHasher(16, base_key="Q4_1 exact").update(tokens) == quantized
    assert not set(BlockHasher(16, base_key="Q4_1 fast").update(tokens)) & set(quantized)


def test_refusals(sources, tmp_path_factory, monkeypatch):
    _, model_dir, _ = served("Q4_0", sources, tmp_path_factory)
    with pytest.raises(ValueError, match="GGUF-quantized matrices.*bfloat16.*--linear-backend auto"):
        DecoderConfig(model_dir=str(model_dir), dtype="bfloat16")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton backend may run on this CPU
    with pytest.raises(ValueError, match="--quant-mode fast is the CPU kernels'"):
        DecoderConfig(model_dir=str(model_dir), linear_backend="triton", quant_mode="fast")
    with pytest.raises(ValueError, match="not dtype 'float64'"):
        DecoderConfig(model_dir=str(model_dir), linear_backend="triton", dtype="float64")
    assert DecoderConfig(model_dir=str(model_dir), linear_backend="triton", dtype="bfloat16").quantized
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="only tessera's native"):
        start_engine(DecoderConfig(model_dir=str(model_dir), model_impl="transformers", num_blocks=32))
    # a header naming a tensor whose bytes do not fit its type is refused at load, naming it
    from safetensors.torch import load_file, save_file

    broken = tmp_path_factory.mktemp("broken")
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (broken / item.name).write_bytes(item.read_bytes())
    state = load_file(model_dir / "model.safetensors")
    types = {name: "Q4_0" for name, t in state.items() if t.dtype == torch.uint8}
    types["model.layers.0.mlp.down_proj.weight"] = "Q8_0"
    save_file(state, broken / "model.safetensors", metadata={"format": "pt", "tessera.gguf_types": json.dumps(types)})
    with pytest.raises(ValueError, match=r"down_proj.weight \(Q8_0\) is torch.uint8"):
        start_engine(DecoderConfig(model_dir=str(broken), num_blocks=32))


# -- the built-in SmolLM2 from its Q4_1 file (`tessera up --quantized`) ------------------------------

_RSS_SCRIPT = """
import sys
from pathlib import Path
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine

def rss_kb():
    return int([line for line in open("/proc/self/status") if line.startswith("VmRSS:")][0].split()[1])

def file_mappings():
    # {path: [[start, end, Rss KiB]]} of this process's file mappings (/proc/self/smaps)
    spans, current = {}, None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            start, end = (int(a, 16) for a in fields[0].split("-"))
            current = [start, end, 0] if len(fields) == 6 and fields[5].startswith("/") else None
            if current:
                spans.setdefault(fields[5], []).append(current)
        elif current and fields[0] == "Rss:":
            current[2] = int(fields[1])
    return spans

def weight_tensors(model):
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        gemm = getattr(module, "gemm", None)
        for weight in ([w for w, _, _ in gemm.parts] if hasattr(gemm, "parts") else [gemm]):
            if hasattr(weight, "qtype"):
                yield weight.data
        if hasattr(getattr(module, "weight", None), "qtype"):  # QuantizedEmbedding
            yield module.weight.data

# torch's linear backend on every host: the weights stay the checkpoint's tensors (the cpu backend, auto's
# choice on some hosts, packs them into panels and a tied lm_head into a second copy)
engine = start_engine(DecoderConfig(model_dir=sys.argv[1], num_blocks=64, max_num_seqs=8, decode_step="modules",
                                    linear_backend="torch"))
model, spans = engine.parts.model, file_mappings()
checkpoint = [s for path, runs in spans.items() if Path(path).parent == Path(sys.argv[1]).resolve() for s in runs]
file_kb = sum(rss for _, _, rss in checkpoint)
anonymous = {t.data_ptr(): t.nbytes for t in weight_tensors(model) if t.numel()
             and not any(start <= t.data_ptr() < end for start, end, _ in checkpoint)}
print("RSS_KB", rss_kb(), file_kb + sum(anonymous.values()) // 1024, engine.info().quantization, flush=True)
engine.shutdown()
"""


def _decoder_rss_kb(model_dir: Path) -> tuple[int, int, str]:
    """(the decoder's RSS once started, the part of it its weights hold, its quantization), in a
    process of its own. The weights' part: the resident pages of the checkpoint file's mappings (the
    tensors served as views of it) plus the bytes of every weight tensor outside them (fused,
    converted copies); the warm-up step has read every weight by then."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(model_dir)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    _, rss, grown, *types = next(line for line in out.splitlines() if line.startswith("RSS_KB")).split(" ", 3)
    return int(rss), int(grown), " ".join(types)


@pytest.fixture(scope="module")
def builtin_q4_1():
    """The built-in decoder kept as its Q4_1 blocks (`make models` prepares it), and its float32
    checkpoint: transformers' dequantization of the same file."""
    from tessera.cli.models import prepare_quantized
    from tessera.paths import default_decoder_dir

    return prepare_quantized(), default_decoder_dir()


def test_builtin_smollm2_served_from_its_q4_1_file_equals_transformers(builtin_q4_1):
    quantized_dir, dense_dir = builtin_q4_1
    prompts = PROMPTS[:3]
    refs = references(dense_dir, prompts, new_tokens=32)
    check_regime(quantized_dir, refs, "concurrent", prompts=prompts, new_tokens=32, rtol=RTOL)


def test_builtin_q4_1_weights_take_at_most_0_4x_the_float32_decoders(builtin_q4_1):
    """The decoder's RSS held by its weights: the Q4_1 blocks (and the file's Q8_0 embeddings)
    against the float32 weights, each held once (the file pages of the parts fused at load are
    released, services/common/memory.py). The whole process's ratio is printed beside it: with a
    135M model the runtime (torch, tokenizer, grammar engine, KV cache, ~0.6 GB) dominates both
    (bench/results/memory.md)."""
    quantized_dir, dense_dir = builtin_q4_1
    dense, dense_weights, dense_types = _decoder_rss_kb(dense_dir)
    quantized, quantized_weights, types = _decoder_rss_kb(quantized_dir)
    assert dense_types == "" and types == "Q8_0+Q4_1 exact"  # the file keeps its embeddings in Q8_0
    print(f"decoder RSS {quantized / 1024:.0f} MiB Q4_1 against {dense / 1024:.0f} MiB float32 "
          f"({quantized / dense:.2f}x); its weights {quantized_weights / 1024:.0f} against "
          f"{dense_weights / 1024:.0f} MiB ({quantized_weights / dense_weights:.2f}x)")
    float32_bytes = sum(f.stat().st_size for f in dense_dir.glob("*.safetensors"))
    assert 0.95 * float32_bytes <= dense_weights * 1024 <= 1.05 * float32_bytes  # every weight resident, once
    assert quantized_weights <= 0.4 * dense_weights
    assert quantized < dense


def test_models_list_shows_the_blocks_and_a_gguf_path_is_imported_once(sources, tmp_path_factory, capsys):
    """`tessera models list` names the types kept; `tessera up --decoder-model-dir FILE.gguf` imports
    the file with its blocks once (`serve_gguf`) and reuses that import."""
    from tessera.cli.models import format_models, list_models, serve_gguf

    gguf_path, model_dir, _ = served("Q4_0", sources, tmp_path_factory)
    [listed] = [m for m in list_models(model_dir.parent) if m.name == model_dir.name]
    assert (listed.kind, listed.dtype, listed.gguf_type) == ("decoder", "Q4_0 blocks", "Q4_0")
    assert "Q4_0 blocks" in format_models([listed])
    root = tmp_path_factory.mktemp("served-gguf")
    first = serve_gguf(gguf_path, root=root)
    assert first.name == "tiny-q4_0-gguf" and quantized_types_of(first) == quantized_types_of(model_dir)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert serve_gguf(gguf_path, root=root) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert "ready at" in capsys.readouterr().out


def quantized_types_of(model_dir: Path) -> dict[str, str]:
    from services.decoder.model_llama import quantized_types

    return quantized_types(model_dir)


def test_quantized_projections_beside_dense_tied_embeddings(tmp_path):
    """A file whose projections are blocks but whose embeddings are float (llama.cpp keeps some
    token_embd tensors F16/F32): the tied head is the dense embeddings, the projections blocks, and
    greedy ids and logits equal transformers on the dequantized weights."""
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file

    from services.decoder.models import load_model

    dense_dir = make_tiny_llama(tmp_path / "dense", seed=5, tie_word_embeddings=True)
    state = load_file(dense_dir / "model.safetensors")
    blocks_dir, types = tmp_path / "blocks", {}
    blocks_dir.mkdir()
    for name, tensor in list(state.items()):
        if tensor.dim() == 2 and "embed_tokens" not in name:
            raw = gguf.quants.quantize(tensor.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            state[name], types[name] = torch.from_numpy(raw), "Q8_0"
    for item in dense_dir.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, blocks_dir / item.name)
    save_file(state, blocks_dir / "model.safetensors", metadata={"format": "pt", "tessera.gguf_types": json.dumps(types)})
    dequantized = load_file(dense_dir / "model.safetensors")
    for name in types:
        dequantized[name] = torch.from_numpy(gguf.quants.dequantize(state[name].numpy(), gguf.GGMLQuantizationType.Q8_0))
    save_file(dequantized, dense_dir / "model.safetensors", metadata={"format": "pt"})
    model = load_model(blocks_dir, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.gemm is None
    assert quantization(model) == "Q8_0"
    prompts = PROMPTS[:2]
    check_regime(blocks_dir, references(dense_dir, prompts, new_tokens=24), "concurrent", prompts=prompts,
                 new_tokens=24, rtol=RTOL)
