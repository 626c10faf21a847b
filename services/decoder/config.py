"""Decoder configuration: one dataclass, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.common.metrics import check_metrics_port
from services.common.liveness import DEFAULT_WEDGED_AFTER_S, check_wedged_after_s
from services.common.limits import GenerateLimits
from services.common.paths import default_decoder_dir
from services.decoder.attention import ATTENTION_BACKENDS
from services.decoder.kernels import native
from services.decoder.kernels.backend import BACKENDS as LORA_BACKENDS
from services.decoder.model_qwen2_vl import is_qwen2_vl, text_config
from services.decoder.model_qwen2_vl import mrope_section as checkpoint_mrope_section

DTYPES = ("float32", "float16", "bfloat16", "float64")
DEFAULT_MAX_MODEL_LEN = 8192


def read_model_config(model_dir: str | Path) -> dict:
    """The HF `config.json` of `model_dir` as a dict.

    Raises:
        ValueError: the directory has no config.json.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model_dir {str(model_dir)!r} has no config.json")
    return json.loads(path.read_text())


@dataclass
class DecoderConfig:
    """Everything the decoder needs to start.

    `num_blocks` and `max_model_len` default from the model (0 = derive): max_model_len is
    min(max_position_embeddings, 8192); num_blocks holds max_num_seqs * max_model_len / 4 tokens
    capped at 2048 blocks. `mrope_section` (pairs per axis t, h, w summing to head_dim / 2) turns on
    image inputs (a Qwen2-VL checkpoint fixes it from config.json; a differing value is refused); `image_token` names the placeholder token (or config.json has image_token_id).
`enable_prefix_caching` shares the KV of full prompt blocks between requests (block hash chain).
`attention_backend`: a name in services/decoder/attention's registry: "torch" (CPU default),
"triton" (paged attention kernel; needs a GPU, or TRITON_INTERPRET=1 on CPU, and a power-of-two
block_size) or "cpu" (decode rows in a C kernel built with the C compiler when the engine starts;
float32 only; about 3x faster decode attention than the torch path on long contexts).
`wedged_after_s`: seconds with requests queued and no engine step completed before health says
NOT_SERVING (services/common/liveness.py); it must exceed the longest step.
`limits`: caps on each Generate request, checked on the protobuf before tokenizing
(services/common/limits.py); its prompt character cap defaults to 32 x max_model_len.
    """

    model_dir: str = str(default_decoder_dir())
    block_size: int = 16
    num_blocks: int = 0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    max_waiting: int = 256
    mrope_section: tuple[int, int, int] | None = None
    image_token: str | None = None
    adapters_address: str | None = None
    adapter_slots: int = 8
    max_lora_rank: int = 64
    lora_backend: str = "torch"  # "torch" (grouped shrink/expand), "triton" (BGMV/SGMV) or "cpu" (C BGMV for decode rows)
    adapter_host_cache_mb: int = 1024  # host-memory tier: adapter weights kept by digest for swap-ins
    dtype: str = "float32"
    enable_prefix_caching: bool = True
    attention_backend: str = field(default="torch", metadata={
        "help": "paged attention implementation; triton needs a GPU (or TRITON_INTERPRET=1); cpu: decode "
                "rows in a C kernel built at start (needs a C compiler with OpenMP, float32)",
        "choices": tuple(ATTENTION_BACKENDS)})
    metrics_port: int = 0  # Prometheus /metrics (services/common/metrics.py); 0 = off
    wedged_after_s: float = DEFAULT_WEDGED_AFTER_S
    limits: GenerateLimits = field(default_factory=GenerateLimits)

    def __post_init__(self) -> None:
        check_metrics_port(self.metrics_port)
        check_wedged_after_s(self.wedged_after_s)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting",
                     "adapter_slots", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size > 1024:
            raise ValueError(f"block_size must be <= 1024, got {self.block_size}")
        if self.num_blocks < 0 or self.max_model_len < 0:
            raise ValueError(f"num_blocks and max_model_len must be >= 0 (0 = derive), got "
                             f"{self.num_blocks} and {self.max_model_len}")
        if self.adapter_host_cache_mb < 0:
            raise ValueError(f"adapter_host_cache_mb must be >= 0, got {self.adapter_host_cache_mb}")
        if self.lora_backend not in LORA_BACKENDS:
            raise ValueError(f"lora_backend must be one of {LORA_BACKENDS}, got {self.lora_backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {tuple(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        ATTENTION_BACKENDS[self.attention_backend].check_config(self.block_size, self.dtype)
        if self.lora_backend == "cpu":
            if self.dtype != "float32":
                raise ValueError(f"the cpu LoRA backend computes float32 only, got dtype {self.dtype!r}")
            try:
                native.load()  # builds the kernels now: a missing compiler fails at start, not mid-request
            except RuntimeError as exc:
                raise ValueError(str(exc)) from exc
        outer = read_model_config(self.model_dir)
        model = text_config(outer)  # Qwen2-VL nests its language model's config
        if is_qwen2_vl(outer):  # sections fixed by the checkpoint; a differing flag is refused
            own = checkpoint_mrope_section(outer)
            if self.mrope_section is not None and tuple(self.mrope_section) != own:
                raise ValueError(f"mrope_section {tuple(self.mrope_section)} differs from the checkpoint's {own}")
            self.mrope_section = own
        limit = int(model.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
        if self.max_model_len == 0:
            self.max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        if self.num_blocks == 0:
            tokens = self.max_num_seqs * self.max_model_len // 4
            self.num_blocks = max(1, min(2048, -(-tokens // self.block_size)))
        if self.mrope_section is not None:
            self._check_mrope(model)

    def _check_mrope(self, model: dict) -> None:
        section = tuple(int(s) for s in self.mrope_section)
        if len(section) != 3 or min(section) < 0:
            raise ValueError(f"mrope_section must be three non-negative ints, got {self.mrope_section}")
        head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
        if 2 * sum(section) != head_dim:
            raise ValueError(f"mrope_section {section} sums to {sum(section)} pairs; the model's "
                             f"head_dim {head_dim} needs {head_dim // 2}")
        self.mrope_section = section
        if self.image_token is None and model.get("image_token_id") is None:
            raise ValueError("mrope_section needs image_token (a token in the vocabulary) "
                             "because config.json has no image_token_id")
