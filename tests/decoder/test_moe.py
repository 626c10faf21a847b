"""Mixture-of-experts families (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers 5.

Tiny seeded 2-layer checkpoints with 4 experts, top-2: Mixtral with head_dim 64, Qwen3-MoE with
head_dim 128, `norm_topk_prob` and a dense layer (`mlp_only_layers`), Qwen2-MoE with q/k/v biases and
a shared expert. Each serves greedy ids = transformers' generate and fp32 logits within 1e-4 in every
regime of family_conformance.py (Qwen2-MoE: every prompt concurrently). The sparse block equals
transformers' own block and a float64 per-token loop at odd token counts (1..40, experts that get
no token); the Triton grouped GEMM equals the torch path in Triton's interpreter; PEFT LoRAs on a
MoE model's attention, shared expert and routed experts (PEFT's target_parameters) equal PEFT, adapters
and base rows in one batch. Mixtral with a sliding window shorter than the prompts equals transformers too.
"""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from decoder_testing import capture_logits, hf_reference, make_tiny_llama
from family_conformance import REGIMES, check_regime, references
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from services.adapters.base_model import BaseModelShapes
from services.adapters.peft_format import read_peft_adapter
from services.common.errors import InvalidArgument
from services.decoder.adapter_source import InMemoryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.lora import LoRAWeights
from services.decoder.model_mixtral import MixtralForCausalLM
from services.decoder.model_qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from services.decoder.models import load_model
from services.decoder.moe import LlamaMLP, SparseMoeBlock, TorchGroupedGemm, route
from services.decoder.types import GenerateInput, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
SIZES = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
FAMILIES = {
    "mixtral": dict(family="mixtral", head_dim=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(family="qwen3_moe", head_dim=128, intermediate_size=160, moe_intermediate_size=48,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral-window": dict(family="mixtral", head_dim=64, intermediate_size=96, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=24),
    "qwen2_moe": dict(family="qwen2_moe", head_dim=64, intermediate_size=160, moe_intermediate_size=48,
                      num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=80),
}
CLASSES = {"mixtral": MixtralForCausalLM, "mixtral-window": MixtralForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM}


def tiny_moe(path: Path, name: str, seed: int = 3) -> Path:
    return make_tiny_llama(path, seed=seed, **{**SIZES, **FAMILIES[name]})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(family) -> (model dir, transformers' references, or None when `with_references` is
    false), each built on first use."""
    model_dirs, refs = {}, {}

    def get(name, with_references=True):
        if name not in model_dirs:
            model_dirs[name] = tiny_moe(tmp_path_factory.mktemp(name), name)
        if with_references and name not in refs:
            refs[name] = references(model_dirs[name])
        return model_dirs[name], refs.get(name)
    return get


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_family_equals_transformers(checkpoints, name, regime):
    check_regime(*checkpoints(name), regime)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_through_transformers_modeling_code_equals_transformers(checkpoints, name):
    """--model-impl transformers on a MoE model (as any MoE without a native file runs): its
    ForCausalLM reads the base model's router_logits, which the head-only pass does not have."""
    model_dir, refs = checkpoints(name)
    check_regime(model_dir, refs, "concurrent", model_impl="transformers")


def test_qwen2_moe_shared_expert_equals_transformers(checkpoints):
    check_regime(*checkpoints("qwen2_moe"), "concurrent")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_layers_are_sparse_or_dense_as_transformers_builds_them(tmp_path, name):
    model = load_model(tiny_moe(tmp_path, name), torch.float32)
    assert type(model) is CLASSES[name]
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == ([True, False] if name == "qwen3_moe" else [True, True])
    block = model.model.layers[0].mlp
    assert isinstance(block.shared_expert, LlamaMLP) == (name == "qwen2_moe")
    assert tuple(block.experts.gate_up_proj.shape) == (4, 2 * (96 if name == "mixtral" else 48), 128)


def test_stacked_expert_layout_loads_as_the_per_expert_one(tmp_path):
    """transformers 5's 3-D `mlp.experts.gate_up_proj/down_proj` (what its model holds) load like
    the per-expert names save_pretrained writes."""
    model_dir = tiny_moe(tmp_path / "m", "mixtral")
    state = load_file(model_dir / "model.safetensors")
    stacked = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in state.items() if ".experts." not in k}
    for layer in range(2):
        w = [[state[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{p}.weight"] for e in range(4)]
             for p in ("w1", "w3", "w2")]
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([torch.stack(w[0]), torch.stack(w[1])], 1)
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(w[2])
    save_file(stacked, model_dir / "model.safetensors")
    fused = load_model(model_dir, torch.float32)
    save_file(state, model_dir / "model.safetensors")
    per_expert = load_model(model_dir, torch.float32)
    for name, value in per_expert.state_dict().items():
        assert torch.equal(value, fused.state_dict()[name]), name
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"the checkpoint has no model.layers.1.block_sparse_moe.experts.3.w2.weight "
                                         r"\(1 expert weight\(s\) of model.layers.1 missing\)"):
        load_model(model_dir, torch.float32)


def _hf_block(name: str, seed: int):
    """transformers' sparse block of `name`'s tiny config, seeded non-trivial weights."""
    options = {**SIZES, **FAMILIES[name]}
    options.pop("family")
    config = AutoConfig.for_model(name, **options)
    block = {"mixtral": MixtralSparseMoeBlock, "qwen3_moe": Qwen3MoeSparseMoeBlock,
             "qwen2_moe": Qwen2MoeSparseMoeBlock}[name](config).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.15)
    return config, block


def _our_block(name: str, config, hf_block) -> SparseMoeBlock:
    spec = CLASSES[name].spec_from_config(config.to_dict())
    block = SparseMoeBlock(spec, 0)
    state = {k: v for k, v in hf_block.state_dict().items()}
    for part in ("gate_proj", "up_proj"):
        state.pop(f"shared_expert.{part}.weight", None)
    if "shared_expert.down_proj.weight" in state:
        state["shared_expert.gate_up_proj.weight"] = torch.cat([hf_block.shared_expert.gate_proj.weight,
                                                                 hf_block.shared_expert.up_proj.weight])
    block.load_state_dict(state)
    return block.eval()


def _float64_loop(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's math per token in float64 (the slow reference the grouped path replaces)."""
    x = x.double()
    gate_up, down = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    probs = torch.softmax(x @ block.gate.weight.double().t(), -1)
    out = torch.zeros_like(x)
    inter = block.experts.intermediate_size
    for t in range(x.shape[0]):
        weights, experts = torch.topk(probs[t], block.top_k)
        if block.normalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts.tolist()):
            h = gate_up[e] @ x[t]
            out[t] += w * (down[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_sparse_block_equals_transformers_and_a_float64_loop(name):
    config, hf_block = _hf_block(name, seed=11)
    block = _our_block(name, config, hf_block)
    assert block.shared_expert is None or name == "qwen2_moe"
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for num_tokens in (1, 2, 3, 7, 16, 29, 40):
            x = torch.randn(num_tokens, 128, generator=generator)
            ours = block(x)
            torch.testing.assert_close(ours, hf_block(x[None])[0], atol=1e-5, rtol=0)
            if name != "qwen2_moe":  # the float64 loop covers the routed experts only
                torch.testing.assert_close(ours.double(), _float64_loop(block, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_sparse_block_in_bfloat16_rounds_as_transformers(name):
    """bf16: Mixtral weights each expert's output by a float32 routing weight, Qwen by one rounded to
    bf16; transformers' default ("grouped_mm") experts sum each token's k products in float32 and
    round once. At top-4 of 4 the results agree but for float32 summation order (a bf16 sum of the
    4 products in order, transformers' eager experts, is off by up to 0.03 here)."""
    config, hf_block = _hf_block(name, seed=13)
    config.num_experts_per_tok = 4
    config._experts_implementation = "grouped_mm"
    hf_block.gate.top_k = hf_block.top_k = 4
    block = _our_block(name, config, hf_block).to(torch.bfloat16)
    hf_block = hf_block.to(torch.bfloat16)
    assert block.top_k == 4
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        assert (block(x).float() - hf_block(x[None])[0].float()).abs().max() <= 1e-6


def test_grouped_gemm_with_experts_that_get_no_rows():
    """Odd row counts per expert, zero for some (first, middle, last): each expert's rows are its
    own weight times them, in float64 terms."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 33, 19, generator=generator)  # [experts, out, in]
    for counts in ([0, 1, 0, 0, 0], [3, 0, 7, 0, 1], [0, 0, 0, 0, 40], [13, 11, 0, 9, 7], [1, 1, 1, 1, 1]):
        offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
        x = torch.randn(sum(counts), 19, generator=generator)
        out = TorchGroupedGemm()(x, weight, offsets)
        expected = torch.cat([x[offsets[e]:offsets[e + 1]].double() @ weight[e].double().t() for e in range(5)])
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_routing_groups_tokens_by_expert_in_token_order():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 4.0, 0.0], [0.0, 1.0, 0.0, 9.0]])
    groups = route(logits, 2, normalize=True, dtype=None)  # token 0: experts 1, 3; 1: 0, 2; 2: 3, 1
    assert groups.expert_offsets.tolist() == [0, 1, 3, 4, 6]
    assert groups.token_ids.tolist() == [1, 0, 2, 1, 0, 2]
    probs = torch.softmax(logits, -1)
    top = torch.topk(probs, 2).values
    torch.testing.assert_close(groups.weights.sum(), torch.tensor(3.0))
    torch.testing.assert_close(groups.weights[0], top[1, 0] / top[1].sum())


def test_triton_grouped_gemm_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    script = Path(__file__).with_name("moe_kernel_cases.py")
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("OK gemm") for line in lines) == 5 and "OK block" in lines, done.stdout


@pytest.mark.parametrize("regime", ["concurrent", "chunked"])
def test_mixtral_sliding_window_equals_transformers(checkpoints, regime):
    """A 24-token window: every prompt but the first and every continuation reach past it."""
    check_regime(*checkpoints("mixtral-window"), regime)


def test_mixtral_sliding_window_must_be_positive(tmp_path):
    model_dir = tiny_moe(tmp_path / "m", "mixtral")
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 0
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding_window must be a positive integer or null, got 0"):
        load_model(model_dir, torch.float32)


LORA_ADAPTERS = {"qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                 "shared8": dict(r=8, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj",
                                                                    "down_proj"])}
LORA_PROMPTS = [[1, 5, 77, 300, 12, 9], list(range(100, 123))]


def _save_lora(model_dir: Path, root: Path, name: str, seed: int, **options) -> None:
    """A PEFT directory root/NAME with random (decisive) A and B."""
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir).eval(),
                           LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "lora_" in param_name:
                p.normal_(0, 0.2)
    model.save_pretrained(root / name)


def _registry_weights(model_dir: Path, root: Path, name: str) -> LoRAWeights:
    adapter = read_peft_adapter(root / name, root, name, 8, BaseModelShapes.from_model_dir(model_dir))
    return LoRAWeights(adapter.digest, {m: (t.lora_a, t.lora_b) for m, t in adapter.targets.items()})


def _check_peft_equality(model_dir: Path, root: Path, adapters, max_rank: int = 8) -> None:
    """Each adapter of `adapters` (name -> LoraConfig options, saved here by PEFT; or names of
    directories under `root`), read by the registry and served with base rows in one batch: greedy
    ids equal PEFT's and fp32 logits within 1e-4; each adapter changes what the model says."""
    if isinstance(adapters, dict):
        for seed, (name, options) in enumerate(adapters.items()):
            _save_lora(model_dir, root, name, 100 + seed, **options)
    refs = {}
    for name in [None, *adapters]:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, root / name).eval()
        for i, prompt in enumerate(LORA_PROMPTS):
            refs[f"{name or 'base'}-{i}"] = hf_reference(model, prompt, 8)
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), num_blocks=64, max_model_len=256,
                                        adapter_slots=len(adapters), max_lora_rank=max_rank), InMemoryAdapterSource())
    try:
        for name in adapters:
            weights = _registry_weights(model_dir, root, name)
            engine.parts.bank.load(weights)
            engine.adapters.add(name, weights)
        logits = capture_logits(engine)
        requests = [GenerateInput(SamplingParams(max_tokens=8, ignore_eos=True), request_id=key,
                                  prompt_token_ids=tuple(LORA_PROMPTS[int(key[-1])]),
                                  lora="" if key.startswith("base") else key.rsplit("-", 1)[0]) for key in refs]

        async def collect(request):
            return [t async for out in engine.generate(request) for t in out.token_ids]

        async def everything():
            return await asyncio.gather(*(collect(r) for r in requests))

        ids = dict(zip(refs, asyncio.run(everything())))
        assert all(engine.parts.bank.num_leases(slot) == 0 for slot in range(len(adapters)))
    finally:
        engine.shutdown()
    for key, (ref_ids, ref_logits) in refs.items():
        assert ids[key] == ref_ids, key
        torch.testing.assert_close(torch.stack(logits[key]), ref_logits, atol=1e-4, rtol=0)
    for name in adapters:  # each adapter changes what the model says
        assert any(refs[f"{name}-{i}"][0] != refs[f"base-{i}"][0] for i in range(len(LORA_PROMPTS))), name


def test_peft_lora_on_moe_attention_and_shared_expert_equals_peft_two_adapters_in_one_batch(checkpoints, tmp_path):
    """Qwen2-MoE: one adapter on q/v, one on k/o and the shared expert's projections (what PEFT's
    gate_proj/up_proj/down_proj match in a sparse layer), PEFT's all-linear (the shared expert's
    gate too), base rows beside them."""
    model_dir = checkpoints("qwen2_moe", with_references=False)[0]
    _check_peft_equality(model_dir, tmp_path, {**LORA_ADAPTERS, "all": dict(r=2, lora_alpha=4, target_modules="all-linear")})
    shared = read_peft_adapter(tmp_path / "shared8", tmp_path, "shared8", 8, BaseModelShapes.from_model_dir(model_dir))
    assert "model.layers.0.mlp.shared_expert.gate_proj" in shared.targets


EXPERT_ADAPTERS = {  # PEFT's target_parameters on the 3-D expert weights, with and without attention targets
    "experts4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "down8": dict(r=8, lora_alpha=4, target_parameters=["mlp.experts.down_proj"]),
    "gate_up2": dict(r=2, lora_alpha=16, use_rslora=True, target_modules=["o_proj"],
                     target_parameters=["gate_up_proj"]),
    "router": dict(r=4, lora_alpha=8, target_parameters=["mlp.gate.weight"]),
    "all": dict(r=2, lora_alpha=4, target_modules="all-linear"),  # PEFT: attention, router and experts
}


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_peft_lora_on_routed_experts_and_router_equals_peft_adapters_in_one_batch(checkpoints, tmp_path, name):
    """LoRA on the routed experts (PEFT's target_parameters: gate_up_proj and/or down_proj, each
    expert its own A and B), on the router, beside attention targets, and PEFT's all-linear (which
    on transformers 5 targets all of them): five adapters and base rows in one batch equal PEFT;
    the registry reads expert e of layer i as its own target."""
    model_dir = checkpoints(name, with_references=False)[0]
    _check_peft_equality(model_dir, tmp_path, EXPERT_ADAPTERS)
    base = BaseModelShapes.from_model_dir(model_dir)
    adapter = read_peft_adapter(tmp_path / "experts4", tmp_path, "experts4", 8, base)
    assert {"model.layers.0.mlp.experts.3.gate_up_proj", "model.layers.0.mlp.experts.3.down_proj",
            "model.layers.0.self_attn.q_proj"} <= set(adapter.targets)
    every = read_peft_adapter(tmp_path / "all", tmp_path, "all", 8, base)
    assert {"model.layers.0.mlp.gate", "model.layers.0.mlp.experts.0.gate_up_proj",
            "model.layers.0.self_attn.o_proj"} <= set(every.targets)


def _save_transformers4_adapter(model_dir: Path, directory: Path, r: int, alpha: float) -> None:
    """A Mixtral adapter as PEFT wrote it under transformers 4 (per-expert linears w1/w3/w2 under
    `block_sparse_moe`, the router `block_sparse_moe.gate`, q_proj), random factors."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    torch.manual_seed(11)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{layer}"
        shapes = {"self_attn.q_proj": (hidden, config["num_attention_heads"] * config["head_dim"]),
                  "block_sparse_moe.gate": (hidden, config["num_local_experts"])}
        for e in range(config["num_local_experts"]):
            shapes |= {f"block_sparse_moe.experts.{e}.{w}": (hidden, inter) for w in ("w1", "w3")}
            shapes[f"block_sparse_moe.experts.{e}.w2"] = (inter, hidden)
        for module, (in_f, out_f) in shapes.items():
            tensors[f"{prefix}.{module}.lora_A.weight"] = torch.randn(r, in_f) * 0.2
            tensors[f"{prefix}.{module}.lora_B.weight"] = torch.randn(out_f, r) * 0.2
    directory.mkdir()
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "bias": "none",
         "target_modules": ["q_proj", "gate", "w1", "w2", "w3"]}))


def test_transformers4_mixtral_adapter_equals_peft(checkpoints, tmp_path):
    """An adapter trained before transformers 5 (per-expert w1/w3/w2 linears and the router under
    `block_sparse_moe`) is served as PEFT converts it for transformers 5's fused experts."""
    model_dir = checkpoints("mixtral", with_references=False)[0]
    _save_transformers4_adapter(model_dir, tmp_path / "v4", r=4, alpha=8)
    _check_peft_equality(model_dir, tmp_path, ["v4"])
    adapter = read_peft_adapter(tmp_path / "v4", tmp_path, "v4", 8, BaseModelShapes.from_model_dir(model_dir))
    assert adapter.targets["model.layers.1.mlp.experts.2.gate_up_proj"].rank == 8  # w1 and w3 side by side
    assert "model.layers.0.mlp.gate" in adapter.targets


def _edit_adapter(directory: Path, drop=(), config=None, add=None) -> None:
    """Rewrite a saved adapter: tensors whose key contains any of `drop` removed, `add` added,
    `config` merged into adapter_config.json."""
    tensors = load_file(directory / "adapter_model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not any(part in k for part in drop)} | (add or {})
    save_file(tensors, directory / "adapter_model.safetensors")
    path = directory / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | (config or {})))


@pytest.mark.parametrize(("edit", "message"), [
    (dict(drop=(".w3.",)), r"every expert of a layer the same parts, gate with up"),
    (dict(drop=("experts.3.",)), r"every expert of a layer the same parts"),
    (dict(config={"use_rslora": True}), r"with use_rslora is not served"),
    (dict(config={"alpha_pattern": {"w2": 32}}), r"rank_pattern / alpha_pattern on a transformers 4 per-expert module"),
    (dict(add={"base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(4, 128),
               "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight": torch.zeros(96, 4)},
          config={"target_modules": ["q_proj", "gate", "w1", "w2", "w3", "gate_proj"]}),
     r"adapts the weight model.layers.0.block_sparse_moe.experts.0.w1 adapts too"),
    (dict(add={"base_model.model.model.layers.0.mlp.gate.lora_A.weight": torch.zeros(4, 128),
               "base_model.model.model.layers.0.mlp.gate.lora_B.weight": torch.zeros(4, 4)},
          config={"target_parameters": ["mlp.gate.weight"]}), r"model.layers.0.mlp.gate: adapted twice"),
])
def test_transformers4_adapters_peft_would_not_convert_as_trained_are_refused(checkpoints, tmp_path, edit, message):
    """Served only where PEFT's conversion computes what the adapter computed under transformers 4
    (peft_format._legacy_expert_targets); two pairs for one weight are refused, never one dropped."""
    model_dir = checkpoints("mixtral", with_references=False)[0]
    _save_transformers4_adapter(model_dir, tmp_path / "v4", r=4, alpha=8)
    _edit_adapter(tmp_path / "v4", **edit)
    with pytest.raises(InvalidArgument, match=message):
        read_peft_adapter(tmp_path / "v4", tmp_path, "v4", 8, BaseModelShapes.from_model_dir(model_dir))


def test_transformers4_expert_adapters_on_a_family_peft_does_not_convert_are_refused(checkpoints, tmp_path):
    """Qwen2-MoE's transformers 4 per-expert factors: PEFT ignores them (it converts Mixtral and
    Qwen3-MoE), so they are refused; and expert factors with no base model to read them against."""
    model_dir = checkpoints("qwen2_moe", with_references=False)[0]
    _save_lora(model_dir, tmp_path, "shared", 3, r=4, target_modules=["down_proj"])
    tensors = {f"base_model.model.model.layers.{i}.mlp.experts.{e}.down_proj.lora_{p}.weight": torch.zeros(*shape)
               for i in range(2) for e in range(4) for p, shape in (("A", (4, 48)), ("B", (128, 4)))}
    _edit_adapter(tmp_path / "shared", add=tensors)
    with pytest.raises(InvalidArgument, match="transformers 4 per-expert LoRA on a 'qwen2_moe' base is not served"):
        read_peft_adapter(tmp_path / "shared", tmp_path, "shared", 8, BaseModelShapes.from_model_dir(model_dir))
    with pytest.raises(InvalidArgument, match="LoRA on MoE experts is read against the registry's base model"):
        read_peft_adapter(tmp_path / "shared", tmp_path, "shared", 8)


def test_expert_lora_refusals_name_the_field(checkpoints, tmp_path):
    """target_parameters naming a weight that is not a routed expert's, or an expert weight the base
    model lacks, and factors whose expert count differs from the base model's: one line each."""
    model_dir = checkpoints("qwen3_moe", with_references=False)[0]
    base = BaseModelShapes.from_model_dir(model_dir)
    _save_lora(model_dir, tmp_path, "experts", 7, r=4, target_parameters=["mlp.experts.gate_up_proj"])
    config_path = tmp_path / "experts" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    for value, message in ((["self_attn.q_proj.weight"], "target_parameters entry 'self_attn.q_proj.weight' is not supported"),
                           ("mlp.experts.gate_up_proj", "target_parameters='mlp.experts.gate_up_proj' must be a list"),
                           (["other.experts.down_proj"], "target_parameters entry 'other.experts.down_proj' matches no expert")):
        config_path.write_text(json.dumps({**config, "target_parameters": value}))
        with pytest.raises(InvalidArgument, match=message):
            read_peft_adapter(tmp_path / "experts", tmp_path, "experts", 8, base)
    config_path.write_text(json.dumps({**config, "r": 2}))  # [16, in] factors (4 experts of rank 4) read as 8 of rank 2
    with pytest.raises(InvalidArgument, match="the factors hold 8 experts of rank 2; the base model.s"):
        read_peft_adapter(tmp_path / "experts", tmp_path, "experts", 8, base)

