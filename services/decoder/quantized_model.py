"""A native model whose matrices stay GGUF block-quantized: what `build_model` does with the tensors
a `tessera models import --keep-quantized` checkpoint stores as blocks.

The checkpoint's safetensors header names them (`QUANTIZATION_METADATA`: HF name -> GGML type);
each is uint8 [rows, row bytes] in transformers' row order. At load:

- a projection's weight (a `Linear`, LoRA-capable or the lm_head) becomes its `gemm`: a
  `QuantizedWeight` (services/decoder/quant.py, the C kernels of kernels/quant_gemm.c), and its
  row-major weight an empty tensor. Parts fused at load (q/k/v -> qkv_proj, gate/up -> gate_up_proj)
  concatenate their blocks when they share a type; a file that mixes types among them (Q4_K_M
  keeps some v / down projections in Q6_K) gets `QuantizedParts`, one product per part written
  into its columns. A LoRA delta is then added to that output like to any other (lora/layers.py).
- the embeddings become a `QuantizedEmbedding` whose lookup dequantizes only the rows asked for;
  a tied lm_head multiplies by the same blocks.
- any other quantized tensor (none in the served families today) is dequantized at load.

On the triton linear backend (CUDA, or the CPU under TRITON_INTERPRET=1) `to_triton` then moves
every such weight's blocks to the device as a `TritonQuantizedWeight` (kernels/quant_triton.py, the
dequantize-in-the-GEMM kernels): the same blocks, the same exact-mode numbers.

`quantization(model)` names what a model serves ("Q4_1", "Q4_K+Q6_K", "" when dense): the decoder
reports it, and the prefix cache salts every block hash with it (an fp32 and a Q4 base never share
KV, prefix_cache.py).
"""

from __future__ import annotations

import torch
from torch import nn

from services.common.memory import release_file_pages
from services.decoder.linear import Linear
from services.decoder.quant import GGUF_QTYPES, QuantizedWeight, row_bytes


class QuantizedParts:
    """Projections of different quantized types computed side by side: y[:, start:end] = part(x).

    `parts`: ((QuantizedWeight or TritonQuantizedWeight, start, end), ...) covering the output
    columns in order. Callable as `Linear.gemm`: x [rows, in] -> y [rows, out] (+ bias [out]) of
    the parts' output dtype (float32 from the C kernels, x's from the Triton ones).
    """

    def __init__(self, parts) -> None:
        self.parts = tuple(parts)
        self.out_features = self.parts[-1][2]
        self.in_features = self.parts[0][0].in_features
        self.qtype = "+".join(dict.fromkeys(weight.qtype for weight, _, _ in self.parts))
        self.nbytes = sum(weight.nbytes for weight, _, _ in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([weight(x) for weight, _, _ in self.parts], dim=1)
        return y if bias is None else y.add_(bias.to(y.dtype))


class QuantizedEmbedding(nn.Module):
    """The token embeddings kept quantized: forward(ids int64 [n]) -> float32 [n, hidden], the
    looked-up rows dequantized (`QuantizedWeight.rows`); `weight` is the QuantizedWeight itself."""

    def __init__(self, weight) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(input_ids.reshape(-1)).view(*input_ids.shape, self.embedding_dim)


def split_quantized(state: dict[str, torch.Tensor], types: dict[str, str], shapes: dict[str, tuple[int, ...]],
                    mismatch: str) -> dict[str, tuple[str, torch.Tensor]]:
    """Take the quantized tensors out of `state` (HF names), checked against `shapes` (what
    config.json's sizes need, `checkpoint_shapes`): name -> (GGML type, uint8 [rows, row bytes]).

    Raises:
        ValueError: `mismatch` and the tensor, when a named tensor is absent, not uint8, of a type not
            in GGUF_QTYPES, or not [rows, row bytes] for the shape config.json gives it.
    """
    quantized = {}
    for name, qtype in types.items():
        tensor = state.pop(name, None)
        if tensor is None:
            raise ValueError(f"{mismatch}: the header names {name} as {qtype} but the file has no such tensor")
        if qtype not in GGUF_QTYPES:
            raise ValueError(f"{mismatch}: {name} is {qtype}; served quantized types are {', '.join(GGUF_QTYPES)}")
        want = shapes.get(name)
        if want is None or len(want) != 2:
            raise ValueError(f"{mismatch}: {name} is quantized ({qtype}) but the model has no matrix of that name")
        need = (want[0], row_bytes(qtype, want[1]))
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != need:
            raise ValueError(f"{mismatch}: {name} ({qtype}) is {tensor.dtype} {list(tensor.shape)}; config.json's "
                             f"sizes {list(want)} need uint8 {list(need)}")
        quantized[name] = (qtype, tensor)
    return quantized


def attach_quantized(model: nn.Module, quantized: dict[str, tuple[str, torch.Tensor]], mode: str,
                     tied: bool) -> None:
    """Give `model` (built on the meta device, its dense weights assigned) its quantized weights:
    see the module docstring. `quantized`: from `split_quantized`; `mode`: the kernels' "exact" or
    "fast" (quant.QUANT_MODES); `tied`: lm_head is the embeddings.

    Raises:
        ValueError: a quantized tensor no projection or embedding of `model` takes.
    """
    def weight(name: str, in_features: int):
        qtype, data = quantized.pop(name)
        return QuantizedWeight(qtype, data, in_features, mode)

    for module_name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        slices = getattr(module, "lora_slices", None) or ((module_name, 0, module.out_features),)
        names = [f"{name}.weight" for name, _, _ in slices]
        if not all(name in quantized for name in names):
            continue
        types = {quantized[name][0] for name in names}
        if len(names) == 1:
            module.gemm = weight(names[0], module.in_features)
        elif len(types) == 1:  # one type: the parts' rows concatenate into one weight
            qtype = types.pop()
            parts = [quantized.pop(name)[1] for name in names]
            module.gemm = QuantizedWeight(qtype, torch.cat(parts), module.in_features, mode)
            release_file_pages(parts)
        else:
            module.gemm = QuantizedParts((weight(name, module.in_features), start, end)
                                         for name, (_, start, end) in zip(names, slices))
        module.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    embeddings = "model.embed_tokens.weight"
    if embeddings in quantized:
        table = weight(embeddings, model.model.embed_tokens.embedding_dim)
        model.model.embed_tokens = QuantizedEmbedding(table)
        if tied:
            model.lm_head.gemm = table
            model.lm_head.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    if quantized:
        raise ValueError(f"quantized tensors no projection of {type(model).__name__} takes: {sorted(quantized)[:5]}")


def to_triton(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Swap each `QuantizedWeight` of `model` (a projection's gemm, a part of `QuantizedParts`, the
    embeddings' table) for a `TritonQuantizedWeight` of the same blocks on `device` computing
    `dtype`; a weight shared by two modules (a tied lm_head) stays shared. Raises ValueError as
    `TritonQuantizedWeight` (a dtype it does not compute)."""
    from services.decoder.kernels.quant_triton import TritonQuantizedWeight

    moved: dict[int, TritonQuantizedWeight] = {}

    def move(weight: QuantizedWeight) -> TritonQuantizedWeight:
        if id(weight) not in moved:
            moved[id(weight)] = TritonQuantizedWeight(weight.qtype, weight.data.to(device), weight.in_features, dtype)
        return moved[id(weight)]

    for module in model.modules():
        if isinstance(module, QuantizedEmbedding) and isinstance(module.weight, QuantizedWeight):
            module.weight = move(module.weight)
        gemm = getattr(module, "gemm", None)
        if isinstance(gemm, QuantizedWeight):
            module.gemm = move(gemm)
        elif isinstance(gemm, QuantizedParts):
            module.gemm = QuantizedParts((move(weight), start, end) for weight, start, end in gemm.parts)


def dequantize_into(state: dict[str, torch.Tensor], quantized: dict[str, tuple[str, torch.Tensor]],
                    shapes: dict[str, tuple[int, ...]]) -> None:
    """Put every quantized tensor back into `state` dequantized (float32 [rows, in]), for a model
    that cannot take them as blocks."""
    for name, (qtype, data) in list(quantized.items()):
        state[name] = QuantizedWeight(qtype, data, shapes[name][1]).dequantize()
        del quantized[name]


def quantization(model: nn.Module) -> str:
    """The GGML types `model`'s weights are served in, "+"-joined in first-use order ("Q4_K+Q6_K"),
    or "" when every weight is dense."""
    types = []
    for module in model.modules():
        gemm = getattr(module, "gemm", None)
        if isinstance(module, QuantizedEmbedding):
            gemm = module.weight
        for qtype in (getattr(gemm, "qtype", "") or "").split("+"):
            if qtype and qtype not in types:
                types.append(qtype)
    return "+".join(types)
