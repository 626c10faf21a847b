"""Rotary position embedding: ordinary RoPE and M-RoPE (split-half / rotate_half pairing).

Conventions follow transformers: `inv_freq = 1 / theta ** (arange(0, d, 2) / d)`, the angle
table is duplicated across both halves of the head (`cat(freqs, freqs)`), and
`x * cos + rotate_half(x) * sin`. M-RoPE (transformers' Qwen2-VL
`apply_multimodal_rotary_pos_emb`) gives frequency pair j the position of axis(j), where
`mrope_section = (t, h, w)` counts pairs per axis; the selected angles are repeated for both
halves. With equal coordinates on all axes it is ordinary RoPE.

Scaled RoPE (`linear`, `dynamic`, `yarn`, `llama3`) takes its inverse frequencies and the factor
that multiplies cos and sin (yarn's attention factor; 1 for the others) from transformers' own
`ROPE_INIT_FUNCTIONS`, called on transformers' reading of config.json, as its Llama, Qwen2 and
Qwen3 rotary embeddings do at init. `dynamic` (NTK) recomputes its frequencies only for a
sequence longer than max_position_embeddings, which the decoder's max_model_len never exceeds, so
the init-time table is the one transformers uses for every position the decoder serves.

A partial rotary factor (Phi-3's `partial_rotary_factor`) makes the table narrower than the head:
`head_dim` here is the number of dims rotated, int(head_dim * factor), and the family rotates the
first that many dims of each head and passes the rest through (transformers' Phi-3
`apply_rotary_pos_emb`).

longrope (`LongRope`) has two sets of frequencies, from the short and the long factors. Its rows
carry the choice in their positions: a row on the long factors has position + `position_offset`
(the model's max_position_embeddings, past every served position), so the angles are one table
of short, then long ones, as vLLM's Phi-3 long-RoPE embedding indexes its cos/sin cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from services.common.mrope import check_mrope_section


@dataclass(frozen=True)
class LongRope:
    """Which of longrope's two sets of frequencies a request's rows use, by transformers' Phi-3 rule.

    transformers' longrope (`dynamic_rope_update`) takes the long factors for a forward pass whose
    longest position + 1 exceeds original_max_position_embeddings, the short ones otherwise, and
    Phi3ForCausalLM's `prepare_inputs_for_generation` drops the cache on the step where a sequence
    first grows past that length, so generate recomputes every earlier key with the long factors.
    For one request, then, every key and query uses the long factors iff its tokens (prompt and
    generated so far) number more than original_max_position_embeddings: a prompt longer than
    that runs long from its first chunk; a shorter one runs short until the step that feeds
    position original_max_position_embeddings, whose K/V cache is recomputed first (scheduler.py).
    The choice depends on the request alone, not on its batch or chunks.
    """

    original_max_position_embeddings: int
    position_offset: int  # a long row's position + this is what the rotary table is indexed with

    def uses_long(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens runs on the long factors."""
        return num_tokens > self.original_max_position_embeddings


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE as transformers computes it: `inv_freq` (rotary_dim / 2 float32 values, as floats)
    and `attention_scaling`, the factor on cos and sin. longrope adds `long_inv_freq` (the long
    factors' frequencies; `inv_freq` holds the short ones) and `long_rope`, the rule choosing them."""

    rope_type: str
    inv_freq: tuple[float, ...]
    attention_scaling: float
    long_inv_freq: tuple[float, ...] | None = None
    long_rope: LongRope | None = None

    @classmethod
    def from_config(cls, cfg: dict, rope_type: str) -> RopeScaling:
        """transformers' `ROPE_INIT_FUNCTIONS[rope_type]` on its config class for cfg's model_type
        (read with `from_dict`, as `from_pretrained` reads config.json: rope_parameters, a legacy
        rope_scaling, a top-level rope_theta).

        Raises:
            ValueError: a rope_type transformers does not define, or parameters it cannot compute with
                (a missing factor, ...), naming the type and the missing key.
        """
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"RoPE scaling {rope_type!r} is not one transformers computes")
        config = CONFIG_MAPPING[cfg.get("model_type", "llama")].from_dict(dict(cfg))
        try:
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        except (KeyError, TypeError) as error:
            raise ValueError(f"RoPE scaling {rope_type!r}: config.json's rope parameters lack or mistype "
                             f"{error}") from None
        scaling = cls(rope_type, tuple(inv_freq.float().tolist()), float(attention_scaling))
        if rope_type != "longrope":
            return scaling
        # as longrope_frequency_update asks for the long set: a sequence one past the original length
        original = int(config.rope_parameters["original_max_position_embeddings"])
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=original + 1)
        return replace(scaling, long_inv_freq=tuple(long_inv_freq.float().tolist()),
                       long_rope=LongRope(original, int(config.max_position_embeddings)))


class RotaryEmbedding:
    """Cos/sin tables for positions [num_tokens] (RoPE) or [3, num_tokens] (M-RoPE)."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, int, int] | None = None,
                 scaling: RopeScaling | None = None) -> None:
        """`head_dim`: the dims rotated (the head's, or its first head_dim * partial_rotary_factor).

        Raises ValueError for an odd head_dim, bad M-RoPE sections, or a `scaling` whose table is
        not head_dim / 2 long."""
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        if mrope_section is not None:
            check_mrope_section(mrope_section, head_dim)
        self.head_dim = head_dim
        self.mrope_section = tuple(mrope_section) if mrope_section is not None else None
        self.attention_scaling = 1.0
        self.long_rope = scaling.long_rope if scaling is not None else None
        self.long_inv_freq = None  # [head_dim / 2] float32: longrope's long factors' frequencies
        if self.long_rope is not None:
            self.long_inv_freq = torch.tensor(scaling.long_inv_freq, dtype=torch.float32, device="cpu")
        if scaling is None:
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
            self.inv_freq = 1.0 / (theta ** exponent)  # [head_dim / 2] float32
        else:
            if len(scaling.inv_freq) != head_dim // 2:
                raise ValueError(f"RoPE scaling {scaling.rope_type!r} gives {len(scaling.inv_freq)} frequencies; "
                                 f"head_dim {head_dim} rotates {head_dim // 2} pairs")
            self.inv_freq = torch.tensor(scaling.inv_freq, dtype=torch.float32, device="cpu")  # [head_dim / 2]
            self.attention_scaling = scaling.attention_scaling
        self.table_positions = 0  # 1-D positions below this come from `_tables` (`use_table`)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # cos, sin [table_positions, head_dim]

    def to(self, device: torch.device | str) -> RotaryEmbedding:
        """Keep the frequency table on `device`, where the positions arrive (this is no nn.Module,
        so the model's `.to()` does not move it). Returns self."""
        self.inv_freq = self.inv_freq.to(device)
        if self.long_inv_freq is not None:
            self.long_inv_freq = self.long_inv_freq.to(device)
        self._tables.clear()
        return self

    def use_table(self, num_positions: int) -> None:
        """Serve RoPE positions [N] below `num_positions` (the decoder's max_model_len, which bounds
        every position it computes) from cos and sin tables per dtype, built on their first use with this
        class's own arithmetic over arange(num_positions): two index ops a step where the angles took
        seven (vLLM's cos_sin_cache). After the weights stream through the caches each op runs cold
        (10-70 us on a 2-core AMD EPYC at batch 1); the table's rows are the values `cos_sin`
        computes for those positions. The cos and sin tables hold num_positions x head_dim values each:
        4 MB for SmolLM2's 8192 x 64 in float32, 64 MB for 131072 x 128 in bfloat16. longrope (its long
        rows sit past max_position_embeddings) and M-RoPE models (their positions are [3, N]) keep
        computing and build no table; so does every position with `num_positions` 0."""
        computes = self.long_rope is not None or self.mrope_section is not None
        self.table_positions = 0 if computes else num_positions
        self._tables.clear()

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos and sin tables [table_positions, head_dim] of `dtype` that `cos_sin` indexes (built
        now if this is their first use), or None without `use_table`."""
        if not self.table_positions:
            return None
        tables = self._tables.get(dtype)
        if tables is None:
            every = torch.arange(self.table_positions, device=self.inv_freq.device)
            tables = self._tables[dtype] = self._computed(every, dtype)  # [table_positions, head_dim] each
        return tables

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (cos, sin), each [num_tokens, head_dim] in `dtype` (angles in float32). With
        longrope, a position >= `long_rope.position_offset` is a row on the long factors at
        position - offset (see the module docstring).

        Raises:
            ValueError: [3, N] positions on a model without M-RoPE sections, or bad rank.
            IndexError: with `use_table`, a position at or past its `num_positions`.
        """
        if positions.ndim == 1 and self.table_positions:
            cos, sin = self.tables(dtype)
            return cos[positions], sin[positions]  # contiguous, as the C kernels read them
        return self._computed(positions, dtype)

    def _computed(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.ndim == 1 and self.long_rope is not None:
            long = positions >= self.long_rope.position_offset  # [N] bool
            positions = positions - long * self.long_rope.position_offset  # int64: exact
            inv_freq = torch.where(long[:, None], self.long_inv_freq, self.inv_freq)  # [N, head_dim/2]
            freqs = positions[:, None].float() * inv_freq
        elif positions.ndim == 1:
            freqs = positions[:, None].float() * self.inv_freq[None, :]  # [N, head_dim/2]
        elif positions.ndim == 2 and positions.shape[0] == 3:
            if self.mrope_section is None:
                raise ValueError("[3, N] M-RoPE positions need mrope_section")
            per_axis = positions[:, :, None].float() * self.inv_freq  # [3, N, head_dim/2]
            chunks, start = [], 0
            for axis, count in enumerate(self.mrope_section):
                chunks.append(per_axis[axis, :, start:start + count])
                start += count
            freqs = torch.cat(chunks, dim=-1)  # [N, head_dim/2]
        else:
            raise ValueError(f"positions must be [N] or [3, N], got shape {tuple(positions.shape)}")
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # yarn: transformers scales both in float32, then casts
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [num_tokens, heads, head_dim] by cos/sin [num_tokens, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin
