"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE) over a flat token batch.

As transformers 5's `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock` / `Qwen2MoeSparseMoeBlock`:

    router_logits = x @ gate.weight^T                      # [n, experts], x's dtype
    probs = softmax(float32(router_logits))                # [n, experts]
    weights, expert_ids = topk(probs, k)                   # [n, k] (torch.topk's order and ties)
    weights /= weights.sum(-1)        if norm_topk_prob    # Mixtral always; Qwen per config
    weights = weights.to(x.dtype)     if the family rounds them (Qwen; Mixtral keeps float32)
    out[t] = sum_j down_e(silu(gate_e(x_t)) * up_e(x_t)) * weights[t, j]    e = expert_ids[t, j]; the sum
             in float32, rounded once to x's dtype (transformers' default "grouped_mm" experts)
    out += sigmoid(x @ shared_expert_gate^T) * shared_expert(x)   where the config has a shared expert

The experts run grouped, not per token: the n * k (token, expert) assignments are sorted by expert
(stable, so each expert's rows keep token order), the token rows are gathered into one [n * k, hidden]
matrix whose rows for expert e are contiguous, each projection is one GEMM per expert that received
rows (`GroupedGemm`), and the weighted results are scatter-added back to their tokens:

    assignments (token, expert), k = 2:   (0,2) (0,0) (1,2) (1,3) (2,0) (2,2)
    sorted by expert:    rows  0 1 | 2 3 4 | 5        expert_offsets = [0, 2, 2, 5, 6]
                         expert 0 0 |  2 2 2 | 3       (expert 1: no rows, no GEMM)
                         token  0 2 |  0 1 2 | 1       (`ExpertGroups.token_ids`)

Expert weights are held as transformers 5 holds them: `experts.gate_up_proj` [experts, 2 * moe_inter,
hidden] (gate rows, then up rows) and `experts.down_proj` [experts, hidden, moe_inter];
`convert_expert_weights` builds them from the per-expert names save_pretrained writes
(`experts.{e}.w1/w3/w2` for Mixtral under `block_sparse_moe`, `experts.{e}.gate_proj/up_proj/down_proj`
for Qwen).

LoRA on the experts (PEFT's `target_parameters` = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
read per expert by the registry): expert e of slot s adds (rows_e A_{s,e}^T) B_{s,e}^T to its
gate_up (or down) product, before the activation (or the routing weight), as PEFT's parametrized
weight W_e + scale * B_e A_e does. The step's (token, expert) rows carry the "slot" s * E + e of
the stacked part's buffer (lora/slots.py), so one batched shrink/expand per part covers every
adapter and expert of the step.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch
from torch import nn

from services.common.checkpoint import moe_layout
from services.common.lora_names import EXPERT_PARTS
from services.decoder.lora import BASE_SLOT, LoRABatch, LoRATargets
from services.decoder.model_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaSpec


@dataclass(frozen=True)
class MoeSpec(LlamaSpec):
    """A Llama spec plus the expert facts of config.json.

    Attributes:
        num_experts: routed experts per sparse layer (`num_local_experts` / `num_experts`).
        num_experts_per_tok: k of the top-k routing.
        moe_intermediate_size: each routed expert's intermediate size.
        norm_topk_prob: renormalize the k routing weights to sum to 1.
        round_routing_weights: cast the routing weights to the activations' dtype before weighting
            (Qwen's router does; Mixtral's keeps them float32).
        shared_expert_intermediate_size: 0 for none (Qwen2-MoE's shared expert and its sigmoid gate).
        sparse_layers: the layers whose MLP is the sparse block; the others are dense (`intermediate_size`).
    """

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    round_routing_weights: bool = False
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.sparse_layers and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be between 1 and num_experts "
                             f"{self.num_experts}")
        if self.sparse_layers and self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size {self.moe_intermediate_size} must be at least 1")


@dataclass(frozen=True)
class ExpertGroups:
    """One step's (token, expert) assignments sorted by expert (see the module docstring).

    Attributes:
        token_ids: int64 [n * k], the token row of each assignment, grouped by expert.
        weights: [n * k] the routing weight of each assignment (float32, or the activations' dtype).
        expert_offsets: int64 [experts + 1]; expert e's assignments are rows
            expert_offsets[e]:expert_offsets[e + 1].
    """

    token_ids: torch.Tensor
    weights: torch.Tensor
    expert_offsets: torch.Tensor


def route(router_logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype | None) -> ExpertGroups:
    """Top-k routing of `router_logits` [n, experts] as transformers' MixtralTopKRouter /
    Qwen3MoeTopKRouter (softmax in float32, torch.topk, optional renormalization, optional cast to
    `dtype`), grouped by expert."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [n, experts]
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)  # [n, k] each
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if dtype is not None:
        weights = weights.to(dtype)
    flat = expert_ids.flatten()  # [n * k]
    order = torch.argsort(flat, stable=True)  # [n * k]: assignment index, grouped by expert
    counts = torch.bincount(flat, minlength=router_logits.shape[-1])  # [experts]
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.long, device=counts.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return ExpertGroups(token_ids=order // top_k, weights=weights.flatten()[order], expert_offsets=offsets)


class GroupedGemm(ABC):
    """out[rows of expert e] = x[rows of expert e] @ weight[e]^T for every expert at once.

    Contract: `x` [m, in] (rows grouped by expert, `expert_offsets` int64 [experts + 1] as in
    `ExpertGroups`), `weight` [experts, out, in] of x's dtype and device; returns [m, out] in x's
    dtype with float32 accumulation (torch's matmul on the CPU, a Triton kernel on CUDA). An expert
    with no rows costs no GEMM. Implementations agree within float rounding.
    """

    @abstractmethod
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor: ...


class TorchGroupedGemm(GroupedGemm):
    """One torch matmul per expert with rows (the offsets are read on the host)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], weight.shape[1])  # [m, out]
        bounds = expert_offsets.tolist()
        for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end > start:  # contiguous row ranges: the product is written in place
                torch.mm(x[start:end], weight[expert].t(), out=out[start:end])
        return out


def default_grouped_gemm(device: torch.device) -> GroupedGemm:
    """The Triton kernel on CUDA, torch's matmul elsewhere."""
    if device.type == "cuda":
        from services.decoder.kernels.moe_triton import TritonGroupedGemm  # Triton only where it runs

        GroupedGemm.register(TritonGroupedGemm)
        return TritonGroupedGemm()
    return TorchGroupedGemm()


class MoeExperts(nn.Module, LoRATargets):
    """The routed experts of one layer, in transformers 5's fused 3-D layout, named `prefix`
    ("model.layers.{i}.mlp.experts"; module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, prefix: str = "") -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.prefix = prefix
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.grouped_gemm: GroupedGemm | None = None  # None: `default_grouped_gemm` of the input's device

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        shapes = {"gate_up_proj": (self.hidden_size, 2 * self.intermediate_size),
                  "down_proj": (self.intermediate_size, self.hidden_size)}
        return {f"{self.prefix}.{e}.{part}": shapes[part] for e in range(self.num_experts) for part in EXPERT_PARTS}

    def lora_parts(self) -> dict[str, int]:
        return {f"{self.prefix}.{part}": self.num_experts for part in EXPERT_PARTS}

    def forward(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """x [n, hidden] -> the routed experts' weighted sum [n, hidden], x's dtype."""
        gemm = self.grouped_gemm or default_grouped_gemm(x.device)
        rows = x[groups.token_ids]  # [n * k, hidden], grouped by expert
        lora = self._lora_batch(x, groups)
        gate_up = gemm(rows, self.gate_up_proj, groups.expert_offsets)  # [n * k, 2 * inter]
        if lora is not None:
            self.lora_context.apply(f"{self.prefix}.gate_up_proj", rows, gate_up, lora)
        gate, up = gate_up.split(self.intermediate_size, -1)
        hidden = nn.functional.silu(gate).mul_(up)  # [n * k, inter]
        y = gemm(hidden, self.down_proj, groups.expert_offsets)  # [n * k, hidden]
        if lora is not None:
            self.lora_context.apply(f"{self.prefix}.down_proj", hidden, y, lora)
        # as transformers' grouped_mm experts: the product in the weights' dtype (float32 weights
        # promote), each token's k products summed in float32, rounded once to x's dtype
        y = (y * groups.weights[:, None]).float()  # [n * k, hidden]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, groups.token_ids, y)
        return out.to(x.dtype)

    def _lora_batch(self, x: torch.Tensor, groups: ExpertGroups) -> LoRABatch | None:
        """The (token, expert) rows' LoRA metadata: row r of expert e for a token of slot s gets
        "slot" s * E + e of the stacked parts (slots.py); None when no adapter row of the step has
        expert factors (an adapter on attention alone costs the experts nothing)."""
        context = self.lora_context
        if context is None or context.batch is None or not any(
                context.slots.factors(f"{self.prefix}.{part}") for part in EXPERT_PARTS):
            return None
        token_slots = context.batch.token_slots  # [n]
        if token_slots.numel() != x.shape[0]:
            raise ValueError(f"the step has {token_slots.numel()} LoRA rows but the MoE block {x.shape[0]} tokens")
        counts = groups.expert_offsets.diff()  # [experts]
        experts = torch.repeat_interleave(torch.arange(self.num_experts, device=x.device), counts)  # [n * k]
        slots = token_slots[groups.token_ids]  # [n * k]
        return LoRABatch.build(torch.where(slots == BASE_SLOT, BASE_SLOT, slots * self.num_experts + experts))


class SparseMoeBlock(nn.Module, LoRATargets):
    """The sparse MLP of one layer (module docstring); named as transformers names it, so
    "model.layers.{i}.mlp.gate.weight" and "model.layers.{i}.mlp.experts.gate_up_proj" load by name.
    LoRA on the router (PEFT's target_parameters "gate.weight") adds its delta to the router logits
    before the softmax, as PEFT's parametrized weight does; on Qwen2-MoE's shared-expert gate (a
    linear PEFT's all-linear targets), to its logit before the sigmoid."""

    def __init__(self, spec: MoeSpec, layer: int) -> None:
        super().__init__()
        self.router_name = f"model.layers.{layer}.mlp.gate"
        self.shared_gate_name = f"model.layers.{layer}.mlp.shared_expert_gate"
        self.top_k, self.normalize = spec.num_experts_per_tok, spec.norm_topk_prob
        self.round_weights = spec.round_routing_weights
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)  # torch's GEMM: routing stays exact
        self.experts = MoeExperts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size,
                                  prefix=f"model.layers.{layer}.mlp.experts")
        if spec.shared_expert_intermediate_size:
            shared = replace(spec, intermediate_size=spec.shared_expert_intermediate_size, mlp_bias=False)
            self.shared_expert = LlamaMLP(shared, layer, prefix=f"model.layers.{layer}.mlp.shared_expert")
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        shapes = {self.router_name: (self.gate.in_features, self.gate.out_features)}
        if self.shared_expert_gate is not None:
            shapes[self.shared_gate_name] = (self.shared_expert_gate.in_features, 1)
        return shapes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden], x's dtype."""
        router_logits = nn.functional.linear(x, self.gate.weight)  # [n, experts]
        if self.lora_context is not None and self.lora_context.active:
            self.lora_context.apply(self.router_name, x, router_logits)
        groups = route(router_logits, self.top_k, self.normalize, x.dtype if self.round_weights else None)
        out = self.experts(x, groups)
        if self.shared_expert is not None:
            shared_gate = self.shared_expert_gate(x)  # [n, 1]
            if self.lora_context is not None and self.lora_context.active:
                self.lora_context.apply(self.shared_gate_name, x, shared_gate)
            out = out + torch.sigmoid(shared_gate) * self.shared_expert(x)
        return out


_MIXTRAL_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_QWEN_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


def convert_expert_weights(state: dict[str, torch.Tensor], num_experts: int) -> None:
    """Rewrite `state` (HF names) in place into `SparseMoeBlock`'s names: Mixtral's `block_sparse_moe`
    prefix becomes `mlp` (transformers 5's name), per-expert w1/w3/w2 or gate_proj/up_proj/down_proj
    become the stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, and a shared expert's
    gate_proj/up_proj become its fused `gate_up_proj`. Checkpoints already in the 3-D layout pass
    through.

    Raises:
        ValueError: a layer holds some per-expert weights but not all (naming the first missing
            one), or one expert's weights of a layer differ in shape from another's.
    """
    for name in [n for n in state if ".block_sparse_moe." in n]:
        state[name.replace(".block_sparse_moe.", ".mlp.")] = state.pop(name)
    per_layer: dict[str, dict[tuple[str, int], str]] = {}
    for name in state:
        match = _MIXTRAL_EXPERT.match(name) or _QWEN_EXPERT.match(name)
        if match:
            per_layer.setdefault(match[1], {})[(_PARTS[match[3]], int(match[2]))] = name
    for layer, names in per_layer.items():
        missing = [(part, e) for e in range(num_experts) for part in ("gate", "up", "down") if (part, e) not in names]
        if missing:
            part, e = missing[0]
            mixtral = any(".w1." in n or ".w2." in n or ".w3." in n for n in names.values())
            name = (f"{layer}.block_sparse_moe.experts.{e}.{_MIXTRAL_NAMES[part]}.weight" if mixtral
                    else f"{layer}.mlp.experts.{e}.{part}_proj.weight")
            raise ValueError(f"the checkpoint has no {name} ({len(missing)} expert weight(s) of {layer} missing)")
        if len(names) != 3 * num_experts:
            continue
        try:
            stacked = {part: torch.stack([state[names[(part, e)]] for e in range(num_experts)])
                       for part in ("gate", "up", "down")}
        except RuntimeError:
            raise ValueError(f"the experts of {layer} have weights of different shapes") from None
        for name in names.values():
            del state[name]
        state[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stacked["gate"], stacked["up"]], dim=1)
        state[f"{layer}.mlp.experts.down_proj"] = stacked["down"]
    for name in [n for n in state if n.endswith(".mlp.shared_expert.gate_proj.weight")]:
        up = name.replace(".gate_proj.", ".up_proj.")
        if up in state:
            fused = name.replace(".gate_proj.", ".gate_up_proj.")
            state[fused] = torch.cat([state.pop(name), state.pop(up)])


def moe_spec(base: LlamaSpec, cfg: dict, *, norm_topk_prob: bool, round_routing_weights: bool) -> MoeSpec:
    """`base` extended by config.json's expert fields (`checkpoint.moe_layout`: the expert count,
    size and which layers are sparse, as transformers' Mixtral / Qwen3-MoE decoder layers decide).

    Raises:
        ValueError: no expert count, or sizes MoeSpec refuses.
    """
    layout = moe_layout(cfg, base.num_layers, base.intermediate_size)
    if layout is None:
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not a mixture-of-experts family")
    return base.extended(MoeSpec,
                         num_experts=layout.num_experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                         moe_intermediate_size=layout.moe_intermediate_size, norm_topk_prob=norm_topk_prob,
                         round_routing_weights=round_routing_weights,
                         shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
                         sparse_layers=layout.sparse_layers)


class MoeDecoderLayer(LlamaDecoderLayer):
    """The Llama layer whose MLP is the `SparseMoeBlock` on `spec.sparse_layers` (dense elsewhere)."""

    def __init__(self, spec: MoeSpec, layer: int, attention_cls: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__(spec, layer, attention_cls)
        if layer in spec.sparse_layers:
            self.mlp = SparseMoeBlock(spec, layer)


def convert_moe_checkpoint(spec: MoeSpec, state: dict[str, torch.Tensor]) -> None:
    """`LlamaForCausalLM.convert_checkpoint` for the MoE families (`convert_expert_weights`)."""
    convert_expert_weights(state, spec.num_experts)
