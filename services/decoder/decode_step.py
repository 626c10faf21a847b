"""The fused decode step: every layer of a Llama-family model for a small all-decode batch in one C call.

At batch 1 a decode step is bound by reading the weights once, yet the module path (model_llama.py)
spent as long again dispatching its ~120 small kernels per step from Python. `FusedDecode` hands
the whole stack of layers to `tessera_decode_step_*` (kernels/decode_step.c), which calls the same
kernels in the same order with no Python between them: the C RMSNorm, rotary, SiLU gate, KV write,
paged decode attention and BGMV of the cpu backends, and for each projection the packed GEMM
(gemm.c), the quantized GEMM for GGUF blocks (quant_gemm.c; a projection whose parts mix GGML types
keeps the module path) or, for weights kept row-major, its own GEMV. Results equal the module path up to the
order of each projection's sum (the conformance tests run both: tests/decoder/test_decode_step.py).

It runs a step when every row decodes one token on the cpu attention backend and there are at most
`MAX_ROWS` rows (`row_major_max_rows` with row-major weights: past it torch's GEMM beats the GEMV);
any other step (prefill, mixed, larger) takes the module path, which stays the reference. LoRA rows
get their BGMV corrections inside the call (every adapter row of a decode step is a BGMV row);
image rows are replaced in the embeddings before it, as on the module path. Where the model has a
plain embedding and RoPE tables (rotary.py `use_table`, which the engine turns on), the call takes
the step's token ids and positions and copies the embedding and cos/sin rows itself (`run_ids`):
at batch 1 every torch op between the C calls runs cold, the weights having just streamed through
the caches, so each one the step need not make is 10-70 us a token saved.

Families: the Llama block as model_llama.py builds it (Llama with any RoPE scaling, Mistral and
Qwen2 with their windows and biases, Qwen2-VL's M-RoPE, whose cos/sin are computed per row
before the call) and Qwen3's per-head q/k norm. Others (Gemma, Phi-3, SmolLM3, Granite, OLMo 2,
MoE, the transformers path) keep the module path; `why_not` says why.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from services.decoder.attention.cpu_backend import CpuAttentionMetadata
from services.decoder.kv_cache import KVCache
from services.decoder.linear import PANEL_WIDTH, Linear, PackedWeight
from services.decoder.lora import LoRAContext
from services.decoder.model_llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RMSNorm
from services.decoder.model_qwen3 import Qwen3Attention
from services.decoder.quant import GGUF_QTYPES, QuantizedWeight
from services.decoder.quantized_model import QuantizedParts
from services.decoder.rotary import RotaryEmbedding

log = logging.getLogger(__name__)

MAX_ROWS = 32  # kernels/decode_step.c MAX_ROWS: the scratch buffers' rows
# with row-major weights (the torch linear backend) the C GEMV runs up to this many rows per dtype;
# past it torch's GEMM (MKL; oneDNN for bf16, on AMX tiles where the CPU has them) is faster than
# re-reading each weight row from L1 per four rows. SmolLM2-135M's 30 layers of projections,
# interleaved medians, ms GEMV / torch. 2-core Intel AVX-512 + AMX host: float32 1: 16 / 17,
# 4: 16 / 41, 8: 21 / 39, 16: 32 / 39, 24: 58 / 47; bfloat16 1: 9 / 17, 8: 14 / 17, 12: 21 / 18,
# 32: 53 / 22. 2-core AMD EPYC with AVX512-BF16, no AMX: bfloat16 4: 8.8 / 27.5, 8: 10.8 / 21.6,
# 12: 14.0 / 22.1, 16: 17.9 / 25.0, 24: 26.2 / 28.9, 32: 40.9 / 33.7 (float32 16: 37 / 52, 24: 58 / 63);
# with the bf16 GEMV's tiles of four W rows (kernels/decode_step.c GEMV_COLS): 8: 10.2 / 23.3,
# 16: 15.6 / 27.1, 24: 21.1 / 31.3, 32: 26.9 / 34.9, so there bfloat16 runs every fused row count.
ROW_MAJOR_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 8}  # on a CPU with AMX (`row_major_max_rows`)
ROW_MAJOR_MAX_ROWS_BF16_NO_AMX = MAX_ROWS


def row_major_max_rows(dtype: torch.dtype, cpu_flags: frozenset[str]) -> int:
    """The most rows the C GEMV takes over row-major weights of `dtype` (float32 or bfloat16) on a
    CPU with `cpu_flags` (native.cpu_flags()): bfloat16 runs to `MAX_ROWS` where torch's bf16 GEMM has
    no AMX tiles to run on, else the `ROW_MAJOR_MAX_ROWS` crossover."""
    if dtype == torch.bfloat16 and "amx_bf16" not in cpu_flags:
        return ROW_MAJOR_MAX_ROWS_BF16_NO_AMX
    return ROW_MAJOR_MAX_ROWS[dtype]
DECODE_STEPS = ("fused", "modules")
_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
LORA_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")  # decode_step.c's layer_t.lora order


class Projection(ctypes.Structure):
    """decode_step.c's projection_t."""

    _fields_ = [("weight", _P), ("bias", _P), ("packed", _I64), ("in_features", _I64), ("out_features", _I64),
                ("qtype", _I64), ("fast", _I64)]


class LoRAPart(ctypes.Structure):
    """decode_step.c's lora_part_t (a = NULL: no resident adapter has targeted the module)."""

    _fields_ = [("a", _P), ("bt", _P), ("start", _I64), ("out_features", _I64), ("rank", _I64), ("tiled", _I64)]


class Layer(ctypes.Structure):
    """decode_step.c's layer_t."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("qkv", Projection), ("o", Projection), ("gate_up", Projection), ("down", Projection),
                ("k_cache", _P), ("v_cache", _P), ("window", _I64), ("soft_cap", _F32),
                ("lora", LoRAPart * len(LORA_PARTS))]


class Step(ctypes.Structure):
    """decode_step.c's step_t."""

    _fields_ = [("rows", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("num_slots", _I64), ("block_size", _I64), ("max_context", _I64),
                ("table_width", _I64), ("eps", _F32), ("scale", _F32), ("x", _P), ("cos", _P), ("sin", _P),
                ("slot_mapping", _P), ("attention_rows", _P), ("block_tables", _P), ("context_lens", _P),
                ("lora_groups", _I64), ("lora_rows", _P), ("lora_starts", _P), ("lora_slots", _P), ("lora_bf16", _I64),
                ("kv_bf16", _I64),
                ("h", _P), ("qkv", _P), ("qk", _P), ("q", _P), ("k", _P), ("attention", _P), ("out", _P),
                ("gate_up", _P), ("act", _P), ("widened", _P), ("shrunk", _P), ("num_threads", ctypes.c_int),
                ("ids", _P), ("positions", _P), ("embedding", _P), ("cos_table", _P), ("sin_table", _P),
                ("vocab", _I64), ("table_positions", _I64)]


def why_not(model: torch.nn.Module, attention_backend: str) -> str | None:
    """None when `FusedDecode` can run `model`'s decode steps; else why not, in a few words."""
    if attention_backend != "cpu":
        return f"it needs the cpu attention backend, not {attention_backend}"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model file"
    gemms = [m.gemm for m in model.modules() if isinstance(m, Linear) and m.gemm is not None]
    if any(isinstance(gemm, QuantizedParts) for gemm in gemms):
        return "a projection mixes GGUF types among its parts (the quantized GEMM runs them layer by layer)"
    if foreign := next((gemm for gemm in gemms if not isinstance(gemm, QuantizedWeight | PackedWeight)), None):
        return f"a projection multiplies through {type(foreign).__name__}, which the C step cannot call"
    dtype, device = _embedding_dtype_device(model)
    if dtype not in (torch.float32, torch.bfloat16) or device != "cpu":
        return f"it computes float32 or bfloat16 on the CPU, not {dtype}"
    if model.rotary_dtype is not None or type(model.model.norm) is not RMSNorm:
        return f"{type(model).__name__}'s blocks differ from Llama's"
    for layer in model.model.layers:
        attention = type(layer.self_attn)
        if (type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP
                or attention.rotate_qk is not LlamaAttention.rotate_qk
                or attention.normalize_qk not in (LlamaAttention.normalize_qk, Qwen3Attention.normalize_qk)
                or any(type(norm) is not RMSNorm for norm in (layer.input_layernorm, layer.post_attention_layernorm))):
            return f"{type(model).__name__}'s blocks differ from Llama's"
    return None


class FusedDecode:
    """One model's fused decode step over its KV cache; see the module docstring.

    Build with `FusedDecode(model, cache, lora)` after the linear backend packed the weights (or
    left them row-major): the layer table holds pointers to the model's weights, norms and cache,
    which stay where they are for the model's life. Used from the engine thread only.

    Raises (constructor): ValueError when `why_not` names a reason (pass the attention backend's
    name through it first); RuntimeError as `native.load`.
    """

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, lora: LoRAContext | None) -> None:
        from services.decoder.kernels import native

        reason = why_not(model, "cpu")
        if reason is not None:
            raise ValueError(f"the fused decode step cannot run this model: {reason}")
        library = native.load()
        if library.tessera_decode_max_rows() != MAX_ROWS:
            raise RuntimeError(f"kernels/decode_step.c holds {library.tessera_decode_max_rows()} rows, "
                               f"decode_step.py {MAX_ROWS}")
        spec = model.spec
        self.dtype = _embedding_dtype_device(model)[0]
        if cache.dtype != self.dtype and (self.dtype, cache.dtype) != (torch.float32, torch.bfloat16):
            raise ValueError(f"the fused decode step takes a KV cache of the model's dtype, or bfloat16 under a "
                             f"float32 model; got {cache.dtype} under {self.dtype}")
        self._kernel = (library.tessera_decode_step_f32 if self.dtype == torch.float32
                        else library.tessera_decode_step_bf16)
        self._gemv = library.tessera_gemv_f32 if self.dtype == torch.float32 else library.tessera_gemv_bf16
        self._logits = (library.tessera_decode_logits_f32 if self.dtype == torch.float32
                        else library.tessera_decode_logits_bf16)
        self._lora = lora
        self._layers = (Layer * spec.num_layers)()
        packed = []
        for i, module in enumerate(model.model.layers):
            layer = self._layers[i]
            attention, mlp = module.self_attn, module.mlp
            layer.input_norm = module.input_layernorm.weight.data_ptr()
            layer.post_norm = module.post_attention_layernorm.weight.data_ptr()
            if isinstance(attention, Qwen3Attention):
                layer.q_norm, layer.k_norm = attention.q_norm.weight.data_ptr(), attention.k_norm.weight.data_ptr()
            for name, linear in (("qkv", attention.qkv_proj), ("o", attention.o_proj),
                                 ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
                setattr(layer, name, _projection(linear, self.dtype))
                packed.append(linear.gemm is not None)
            k_cache, v_cache = cache.layer(i)
            layer.k_cache, layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            layer.window = attention.sliding_window or 0
            layer.soft_cap = attention.logits_soft_cap or 0.0
            for part, name in zip(layer.lora, LORA_PARTS):
                part.start, part.out_features = _columns(module, i, name)
        # packed weights: the C GEMM at any row count; row-major: the GEMV up to its crossover with torch's GEMM
        self._row_major_rows = row_major_max_rows(self.dtype, native.cpu_flags())
        self.max_rows = MAX_ROWS if all(packed) else self._row_major_rows
        # the head for `logits` (None: adapted, or of a kind the step does not project), and its row limit
        self._head, head = None, model.lm_head
        if not getattr(head, "lora_slices", ()) and model.model.norm.weight.dtype == self.dtype:
            try:
                self._head = _projection(head, self.dtype)
            except ValueError:
                pass
        self._head_rows = self._row_major_rows if head.gemm is None else MAX_ROWS
        self._head_out: torch.Tensor | None = None  # bf16 [head_rows, vocab]: `logits`' head output, made on first use
        self._finite = (ctypes.c_uint8 * MAX_ROWS)()  # `logits`' per-row flags
        self._greedy = (ctypes.c_int64 * MAX_ROWS)()  # and each row's argmax
        self._resolved: set[int] = set()  # LoRA parts (index into layers x parts) whose factors are set
        self._resolved_buffers = 0  # the slots' num_buffers when the parts were last looked up
        self._cache, self._norm_eps = cache, model.model.layers[0].input_layernorm.eps
        h, kv, d, hidden, inter = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size, spec.intermediate_size
        self._step = Step(hidden=hidden, num_heads=h, num_kv_heads=kv, head_dim=d, intermediate=inter,
                          num_slots=cache.num_slots, block_size=cache.block_size, eps=self._norm_eps,
                          scale=model.model.layers[0].self_attn.scale, num_threads=1,
                          lora_bf16=int(lora is not None and lora.slots.dtype != self.dtype),  # --lora-dtype
                          kv_bf16=int(cache.dtype != self.dtype))  # --kv-cache-dtype bfloat16
        widths = {"h": hidden, "qkv": (h + 2 * kv) * d, "qk": (h + kv) * d, "q": h * d, "k": kv * d,
                  "attention": h * d, "out": hidden, "gate_up": 2 * inter, "act": inter}
        self._scratch = {name: torch.empty(MAX_ROWS, width, dtype=self.dtype) for name, width in widths.items()}
        self._scratch["widened"] = torch.empty(MAX_ROWS, max(hidden, h * d, inter), dtype=torch.float32)
        rank = lora.slots.max_rank if lora is not None else 1
        self._scratch["shrunk"] = torch.empty(3 * MAX_ROWS, rank, dtype=torch.float32)  # q, k, v in one call
        for name, tensor in self._scratch.items():
            setattr(self._step, name, tensor.data_ptr())
        self.gathers = self._gather_from(model)

    def _gather_from(self, model: LlamaForCausalLM) -> bool:
        """Point the step at the embedding and the RoPE tables `run_ids` gathers from; whether it can:
        a plain embedding of the model's dtype, the family's own `embed`, RoPE served from tables as
        wide as the head (rotary.py `use_table`: the engine turns it on)."""
        embedding, rotary = model.model.embed_tokens, model.rotary
        tables = rotary.tables(self.dtype) if isinstance(rotary, RotaryEmbedding) else None
        if (tables is None or type(embedding) is not torch.nn.Embedding or type(model).embed is not LlamaForCausalLM.embed
                or embedding.weight.dtype != self.dtype or not embedding.weight.is_contiguous()
                or tables[0].shape[1] != model.spec.head_dim or tables[0].device.type != "cpu"):
            return False
        self._tables = tables  # alive while the step points at them
        step = self._step
        step.embedding, step.vocab = embedding.weight.data_ptr(), embedding.weight.shape[0]
        step.cos_table, step.sin_table, step.table_positions = tables[0].data_ptr(), tables[1].data_ptr(), tables[0].shape[0]
        width = model.spec.head_dim
        self._angles = torch.empty(2, MAX_ROWS, width, dtype=self.dtype)  # the gathered cos and sin rows
        return True

    def accepts(self, meta, num_tokens: int) -> bool:
        """Whether this step is one the fused call runs: all `num_tokens` rows decode (cpu attention
        metadata with no prefill span), at most `max_rows` of them, and every adapter row among them
        is one the step's LoRA batch decodes (BGMV: the only LoRA the fused call applies)."""
        if not (isinstance(meta, CpuAttentionMetadata) and not meta.prefills and meta.decode is not None
                and 0 < num_tokens <= self.max_rows and meta.decode.rows.numel() == num_tokens):
            return False
        batch = None if self._lora is None else self._lora.batch
        return batch is None or not batch.prefill_perm.numel()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: CpuAttentionMetadata) -> torch.Tensor:
        """Every layer over x [rows, hidden] (the embeddings, updated in place and returned): the
        residual stream after the last layer. cos/sin [rows, head_dim] of the model's dtype; `meta`
        a step `accepts` took. K/V of this step are written to the cache.

        Raises:
            RuntimeError: the attention kernel could not allocate its score buffers.
        """
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        step = self._step
        step.ids = step.positions = None
        step.x, step.cos, step.sin = x.data_ptr(), cos.data_ptr(), sin.data_ptr()
        return self._run(x, meta)

    def run_ids(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: CpuAttentionMetadata) -> torch.Tensor:
        """`__call__` from the step's token ids and RoPE positions, int64 [rows] each (where `gathers`):
        the embedding rows and the cos/sin table rows are copied in the same C call (kernels/decode_step.c
        `gather_inputs`), the bits of the module path's lookups. Returns the residual stream [rows, hidden].

        Raises:
            ValueError: ids or positions not int64 [rows] of one length (the C call reads them so).
            RuntimeError: an id outside the embedding or a position outside the RoPE table (-3), or as
                `__call__`.
        """
        if (input_ids.dtype != torch.long or positions.dtype != torch.long or input_ids.dim() != 1
                or positions.shape != input_ids.shape):
            raise ValueError(f"run_ids takes int64 ids and positions [rows] of one length, got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)} and {positions.dtype} {tuple(positions.shape)}")
        x = torch.empty(input_ids.shape[0], self._step.hidden, dtype=self.dtype)
        input_ids, positions = input_ids.contiguous(), positions.contiguous()
        step = self._step
        step.ids, step.positions = input_ids.data_ptr(), positions.data_ptr()
        step.x, step.cos, step.sin = x.data_ptr(), self._angles[0].data_ptr(), self._angles[1].data_ptr()
        return self._run(x, meta)

    def _run(self, x: torch.Tensor, meta: CpuAttentionMetadata) -> torch.Tensor:
        decode, step = meta.decode, self._step
        step.rows = x.shape[0]
        step.slot_mapping, step.attention_rows = meta.slot_mapping.data_ptr(), decode.rows.data_ptr()
        step.block_tables, step.context_lens = decode.block_tables.data_ptr(), decode.context_lens.data_ptr()
        step.table_width, step.max_context = decode.block_tables.shape[1], decode.max_context
        step.num_threads = torch.get_num_threads()
        groups = self._lora_groups()
        step.lora_groups = 0 if groups is None else groups[2].numel()
        if groups is not None:
            step.lora_rows, step.lora_starts, step.lora_slots = (t.data_ptr() for t in groups)
        rc = self._kernel(self._layers, len(self._layers), ctypes.byref(step))
        if rc == -3:
            raise RuntimeError(f"the fused decode step was given a token id outside the {step.vocab} embeddings or a "
                               f"position outside the {step.table_positions} RoPE table rows")
        if rc != 0:
            raise RuntimeError("the fused decode step could not allocate the attention's score buffers"
                               if rc == -1 else f"the fused decode step failed ({rc})")
        return x

    def project(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """`linear(x)` for x [rows, in]: the C GEMV for at most `row_major_max_rows` rows (per dtype) of a
        row-major weight of the model's dtype without LoRA targets (the lm_head: torch's GEMV reached
        13 GB/s on a bf16 head where this one streams at the machine's read bandwidth), else the
        module itself."""
        rows = x.shape[0]
        if (linear.gemm is not None or getattr(linear, "lora_slices", ()) or not 0 < rows <= self._row_major_rows
                or x.dtype != self.dtype or linear.weight.dtype != self.dtype or not linear.weight.is_contiguous()):
            return linear(x)
        x = x.contiguous()
        y = torch.empty(x.shape[0], linear.out_features, dtype=self.dtype)
        self._gemv(x.data_ptr(), x.shape[0], linear.in_features, linear.weight.data_ptr(),
                   None if linear.bias is None else linear.bias.data_ptr(), y.data_ptr(), linear.out_features,
                   torch.get_num_threads())
        return y

    def logits(self, model: LlamaForCausalLM,
               hidden: torch.Tensor) -> tuple[torch.Tensor, list[bool], list[int]] | None:
        """`model.compute_logits(hidden)` for residual rows [rows, hidden] in one C call (the final norm,
        the head as the step projects (GEMV, packed panels or GGUF blocks), widening to float32;
        kernels/decode_step.c `decode_logits`) with `model_runner.ModelRunner.logits`'s rule applied
        (a row whose float32 statistic sum(x^2) / hidden is not finite is NaN throughout), each
        row's finiteness and its greedy token (the first index of its largest logit, torch.max's;
        -1 for a row not finite): float32 logits [rows, vocab], a bool and an int per row. None where
        it does not apply (a family with its own compute_logits, an adapted head, more rows than the
        head's kernel takes here): the caller computes them itself."""
        rows = hidden.shape[0]
        if (self._head is None or type(model).compute_logits is not LlamaForCausalLM.compute_logits
                or not 0 < rows <= self._head_rows or hidden.dtype != self.dtype):
            return None
        norm = model.model.norm
        hidden = hidden.contiguous()
        logits = torch.empty(rows, model.lm_head.out_features, dtype=torch.float32)
        # the flags in a ctypes array and the bf16 head's output in a buffer kept for the model's life: the
        # torch ops that allocated and read them ran cold after the weights streamed (~10-30 us each)
        finite, greedy = self._finite, self._greedy
        normed = self._scratch["h"].data_ptr()
        if self.dtype == torch.float32:
            self._logits(ctypes.byref(self._head), hidden.data_ptr(), rows, norm.weight.data_ptr(), norm.eps, normed,
                         logits.data_ptr(), ctypes.addressof(finite), ctypes.addressof(greedy), torch.get_num_threads())
        else:
            if self._head_out is None:
                self._head_out = torch.empty(self._head_rows, model.lm_head.out_features, dtype=self.dtype)
            self._logits(ctypes.byref(self._head), hidden.data_ptr(), rows, norm.weight.data_ptr(), norm.eps, normed,
                         self._head_out.data_ptr(), logits.data_ptr(), ctypes.addressof(finite),
                         ctypes.addressof(greedy), self._scratch["widened"].data_ptr(), torch.get_num_threads())
        return logits, [bool(f) for f in finite[:rows]], greedy[:rows]

    def _lora_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """This step's adapter rows grouped by slot (rows, group starts, group slots), or None; the
        factors of modules an adapter first targets are looked up now (their buffers never move)."""
        batch = None if self._lora is None else self._lora.batch
        if batch is None:
            return None
        slots = self._lora.slots
        buffers = slots.num_buffers  # read first: a buffer added during the look is looked up next step
        if buffers == self._resolved_buffers:  # no module gained buffers since the last look
            return batch.decode_groups
        for i, layer in enumerate(self._layers):
            for j, part in enumerate(layer.lora):
                key = i * len(LORA_PARTS) + j
                if key in self._resolved:
                    continue
                factors = slots.factors(f"model.layers.{i}.{LORA_PARTS[j]}")
                if factors is not None:
                    a, b = factors
                    bt = b if b.dim() == 2 else b.transpose(1, 2)  # tiled B^T (slots.py b_views), or [rank, out] rows
                    if not (a.is_contiguous() and bt.is_contiguous()):
                        raise RuntimeError("adapter slots no longer store A [slots, rank, in] and B^T contiguous")
                    part.a, part.bt, part.rank, part.tiled = a.data_ptr(), bt.data_ptr(), a.shape[1], b.dim() == 2
                    self._resolved.add(key)
        self._resolved_buffers = buffers
        return batch.decode_groups


def _embedding_dtype_device(model: LlamaForCausalLM) -> tuple[torch.dtype, str]:
    """The model's dtype and device type, read off its embeddings (GGUF blocks: float32 on the CPU)."""
    weight = model.model.embed_tokens.weight
    if isinstance(weight, QuantizedWeight):
        return weight.dtype, "cpu"
    return weight.dtype, weight.device.type


def _projection(linear: Linear, dtype: torch.dtype) -> Projection:
    """The C view of one projection: its GGUF blocks (quant.py; float32 models), the packed panels
    when the cpu linear backend packed it, else its row-major weight (contiguous, of the model's dtype)."""
    bias = None if linear.bias is None else linear.bias.data_ptr()
    if isinstance(linear.gemm, QuantizedWeight):
        if dtype != torch.float32 or (linear.bias is not None and linear.bias.dtype != torch.float32):
            raise ValueError("GGUF blocks multiply float32 activations only")
        return Projection(linear.gemm.data.data_ptr(), bias, 0, linear.in_features, linear.out_features,
                          GGUF_QTYPES[linear.gemm.qtype], int(linear.gemm.mode == "fast"))
    if linear.gemm is not None:
        if linear.gemm.panels.shape[-1] != PANEL_WIDTH or linear.gemm.dtype != dtype:
            raise ValueError("packed weights of another layout or dtype")
        return Projection(linear.gemm.panels.data_ptr(), bias, 1, linear.in_features, linear.out_features)
    weight = linear.weight
    if not weight.is_contiguous() or weight.dtype != dtype or weight.shape != (linear.out_features, linear.in_features):
        raise ValueError(f"row-major weights [out, in] of {dtype} expected, got {tuple(weight.shape)} {weight.dtype}")
    return Projection(weight.data_ptr(), bias, 0, linear.in_features, linear.out_features)


def _columns(layer: LlamaDecoderLayer, index: int, part: str) -> tuple[int, int]:
    """(first column, width) of checkpoint module `part` of layer `index` in its fused projection's output."""
    name = f"model.layers.{index}.{part}"
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        for module, start, end in linear.lora_slices:
            if module == name:
                return start, end - start
    raise ValueError(f"{name} is not a projection of this layer")


def attach_decode_step(choice: str, model: torch.nn.Module, cache: KVCache, attention_backend: str,
                       lora: LoRAContext | None) -> str:
    """Resolve `--decode-step` (`choice`: "auto", "fused" or "modules") for `model` and give a
    LlamaForCausalLM its `fused_decode` (or None); returns "fused" or "modules". Call after the
    linear backend packed the weights (the layer table points at them). "auto" is logged with its reason.

    Raises:
        ValueError: "fused" where `why_not` names a reason, or another choice.
    """
    if choice not in ("auto", *DECODE_STEPS):
        raise ValueError(f"decode_step must be one of {('auto', *DECODE_STEPS)}, got {choice!r}")
    reason = None if choice == "modules" else why_not(model, attention_backend)
    if choice == "fused" and reason is not None:
        raise ValueError(f"--decode-step fused cannot run here: {reason}")
    resolved = "fused" if choice != "modules" and reason is None else "modules"
    if isinstance(model, LlamaForCausalLM):
        model.fused_decode = FusedDecode(model, cache, lora) if resolved == "fused" else None
    if choice == "auto":
        log.info("decode_step auto: %s%s", resolved, f" ({reason})" if reason else "")
    return resolved
