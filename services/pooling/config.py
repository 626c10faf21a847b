"""`ModelConfig` (one served model) and `PoolingConfig` (the service and its batching limits), validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.common.checkpoint import CheckpointConfig
from services.common.device import DEVICE_HELP, resolve_device
from services.common.limits import PoolingLimits
from services.common.liveness import DEFAULT_WEDGED_AFTER_S, check_wedged_after_s
from services.common.metrics import check_metrics_port
from services.common.server import default_address
from services.pooling.st_config import POOLING_MODES, read_st_config
from tessera.paths import default_embedding_dir
from tessera.protocol import POOLING_DEVICE_ENV

# Tokenizers without a real limit report a huge sentinel (transformers' VERY_LARGE_INTEGER).
_NO_TOKENIZER_LIMIT = 10**9

EMBEDDING = "embedding"
CROSS_ENCODER = "cross-encoder"
LLM_JUDGE = "llm-judge"
MODEL_KINDS = (EMBEDDING, CROSS_ENCODER, LLM_JUDGE)

# The Qwen3-Reranker prompt (its model card's format_instruction + prefix/suffix); a model's
# config.json may replace it with "judge_template" / "judge_instruction".
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass
class ModelConfig:
    """One served model; `None` fields are resolved from the model directory.

    Attributes:
        model_dir: a local transformers / sentence-transformers directory (never a hub id).
        kind: "embedding" (AutoModel + pooling), "cross-encoder" (AutoModelForSequenceClassification,
            one logit) or "llm-judge" (AutoModelForCausalLM scored by its "yes"/"no" LM-head rows).
            Default: "cross-encoder" when config.json names a *ForSequenceClassification architecture,
            else "embedding"; "llm-judge" is never guessed.
        model_name: the name requests address and answers carry; default the directory name.
        aliases: further names requests may address it by (answers carry `model_name`), as vLLM's
            --served-model-name NAME [ALIAS ...]; none by default.
        max_input_length: most tokens per input (a rerank pair or judge prompt counts whole), special
            tokens included. Default: sentence-transformers' `max_seq_length`, else the tokenizer's
            `model_max_length` capped by `max_position_embeddings`.
        pooling_mode: "mean", "cls" or "last"; default `1_Pooling/config.json`, else "last" for a
            causal decoder and "mean" otherwise (as sentence-transformers wraps a plain encoder).
        normalize: default unit-normalization (True when `modules.json` has a Normalize module).
        matryoshka_dimensions: the `dimensions` a request may ask for. Default from config.json as
            vLLM reads it: `matryoshka_dimensions` (a list), or any width when `is_matryoshka` is true.
        prompts: prompt name -> prefix, default `config_sentence_transformers.json`.
        judge_instruction / judge_template: the llm-judge prompt; default config.json's
            `judge_instruction` / `judge_template`, else Qwen3-Reranker's. The template holds
            `{instruction}`, `{query}` and `{document}`.
        judge_tokens: the ("yes", "no") tokens whose LM-head rows make the score head; default
            config.json's `classifier_from_token` ([no, yes], vLLM's convention), else ("yes", "no").

    Raises:
        ValueError: a missing model directory, an unknown kind or pooling mode, a limit below 1 or past
            the model's position embeddings, a Matryoshka width outside 1..hidden size, a template
            without its fields, an empty alias or one repeating a name.
    """

    model_dir: Path
    kind: str | None = None
    model_name: str | None = None
    aliases: tuple[str, ...] = ()
    max_input_length: int | None = None
    pooling_mode: str | None = None
    normalize: bool | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None
    prompts: dict[str, str] | None = None
    judge_instruction: str | None = None
    judge_template: str | None = None
    judge_tokens: tuple[str, str] | None = None
    do_lower_case: bool = field(default=False, init=False)
    default_prompt_name: str | None = field(default=None, init=False)
    is_matryoshka: bool = field(default=False, init=False)
    checkpoint: CheckpointConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir).expanduser()
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"model_dir {str(self.model_dir)!r} has no config.json; expected a local transformers model directory")
        hf = self.checkpoint = CheckpointConfig.read(self.model_dir)
        architectures = hf.architectures
        if self.kind is None:
            self.kind = CROSS_ENCODER if any(a.endswith("ForSequenceClassification") for a in architectures) else EMBEDDING
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        st = read_st_config(self.model_dir)
        self.do_lower_case = st.do_lower_case
        causal = any(a.endswith("ForCausalLM") for a in architectures)
        if self.pooling_mode is None:
            self.pooling_mode = st.pooling_mode if st.pooling_declared or not causal else "last"
        if self.pooling_mode not in POOLING_MODES:
            raise ValueError(f"pooling_mode must be one of {POOLING_MODES}, got {self.pooling_mode!r}")
        if self.normalize is None:
            self.normalize = st.normalize
        if self.prompts is None:
            self.prompts = dict(st.prompts)
            self.default_prompt_name = st.default_prompt_name
        if self.model_name is None:
            self.model_name = self.model_dir.name
        if not self.model_name:
            raise ValueError("model_name must be non-empty")
        self.aliases = tuple(self.aliases)
        names = [self.model_name, *self.aliases]
        if not all(names) or len(set(names)) != len(names):
            raise ValueError(f"served model names must be non-empty and distinct, got {names}")
        self.max_input_length = self._resolve_max_input_length(st.max_seq_length, hf)
        self._resolve_matryoshka(hf)
        self._resolve_judge(hf)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name requests may address this model by: `model_name`, then the aliases."""
        return (self.model_name, *self.aliases)

    def _resolve_max_input_length(self, st_max_seq_length: int | None, hf: CheckpointConfig) -> int:
        max_positions = hf.max_position_embeddings
        if self.max_input_length is not None:
            if self.max_input_length < 1:
                raise ValueError(f"max_input_length must be >= 1, got {self.max_input_length}")
            if max_positions is not None and self.max_input_length > max_positions:
                raise ValueError(f"max_input_length {self.max_input_length} exceeds the model's "
                                 f"max_position_embeddings {max_positions}")
            return self.max_input_length
        if st_max_seq_length is not None:
            return st_max_seq_length
        limits = [n for n in (_tokenizer_max_length(self.model_dir), max_positions) if n is not None]
        if not limits:
            raise ValueError(f"{self.model_dir}: neither the tokenizer nor the model states a maximum length; "
                             "set max_input_length")
        return min(limits)

    def _resolve_matryoshka(self, hf: CheckpointConfig) -> None:
        hidden = hf.hidden_size or None
        if self.matryoshka_dimensions is None:
            declared = hf.get("matryoshka_dimensions")
            self.is_matryoshka = bool(declared) or bool(hf.get("is_matryoshka", False))
            self.matryoshka_dimensions = tuple(int(d) for d in declared) if declared else ()
        else:
            self.matryoshka_dimensions = tuple(int(d) for d in self.matryoshka_dimensions)
            self.is_matryoshka = bool(self.matryoshka_dimensions)
        for width in self.matryoshka_dimensions:
            if not 1 <= width <= (hidden or width):
                raise ValueError(f"matryoshka dimension {width} is outside 1..{hidden} (the model's hidden size)")

    def _resolve_judge(self, hf: CheckpointConfig) -> None:
        if self.judge_tokens is None:
            no_yes = hf.get("classifier_from_token")
            self.judge_tokens = (no_yes[1], no_yes[0]) if no_yes and len(no_yes) == 2 else ("yes", "no")
        self.judge_instruction = self.judge_instruction or hf.get("judge_instruction") or QWEN3_RERANKER_INSTRUCTION
        self.judge_template = self.judge_template or hf.get("judge_template") or QWEN3_RERANKER_TEMPLATE
        if self.kind == LLM_JUDGE:
            for name in ("{query}", "{document}"):
                if name not in self.judge_template:
                    raise ValueError(f"judge_template must contain {name}, got {self.judge_template!r}")


@dataclass
class PoolingConfig:
    """Pooling service settings.

    Attributes:
        address: host:port the service binds.
        models: the served models; the first embedding model answers Embed requests that name no
            model, the first reranker (else the first model) Rerank requests that name none.
        max_batch_size: most inputs (or rerank documents) one request may carry (the client cap).
        device: where every model computes: auto (CUDA when torch sees a GPU, else cpu), cpu, cuda or
            cuda:N (services/common/device.py); refused here when this machine has no such device.
        dynamic_batching: gather sequences from concurrent requests into one forward (True), or run
            each request as its own forward under a lock (False, the per-call lock baseline).
        max_batch_tokens: token budget of one forward, padded length x rows (TEI's max_batch_tokens).
        max_wait_ms: longest a first queued sequence waits for company before its forward starts.
        max_queue_size: most sequences waiting per model; a request that would pass it is refused
            with RESOURCE_EXHAUSTED.
        max_request_chars: most characters of text one request may carry, all inputs (or query and
            documents) together, checked before tokenizing (tokenizing is linear in it and runs
            before truncation: bench/results/settings.md). TEI's --payload-limit, 2 MB, in spirit.
        metrics_port: Prometheus /metrics port (services/common/metrics.py); 0 = off.
        wedged_after_s: seconds with sequences queued and no forward completed before health says
            NOT_SERVING (services/common/liveness.py); it must exceed the longest forward.
        max_name_chars: characters of a request's model, prompt_name and method.
        max_request_token_ids: token ids over every input_ids list of one Embed request.
        The request caps together are `limits`, checked on the protobuf before conversion
        (services/common/limits.py); the gateway checks the same caps by the same flags.

    Raises:
        ValueError: no models, duplicate model names, an address without a port, a device this machine
            lacks, a limit below 1,
            a token budget below a model's max_input_length, a queue smaller than one full request.
    """

    models: list[ModelConfig]
    address: str = field(default=default_address("pooling"), metadata={"help": "bind host:port"})
    max_batch_size: int = field(default=PoolingLimits.max_batch_size, metadata={"help": "most inputs per request"})
    device: str = field(default="auto", metadata={"help": DEVICE_HELP, "env": POOLING_DEVICE_ENV})
    dynamic_batching: bool = field(default=True, metadata={
        "help": "gather concurrent requests into shared forwards; --no-dynamic-batching = one forward per "
                "request under a lock"})
    max_batch_tokens: int = field(default=16384, metadata={"help": "token budget of one forward, padded length x rows"})
    max_wait_ms: float = field(default=2.0, metadata={"help": "longest hold for more requests before a forward"})
    max_queue_size: int = field(default=4096, metadata={
        "help": "most sequences queued per model before RESOURCE_EXHAUSTED"})
    metrics_port: int = field(default=0, metadata={
        "help": "serve Prometheus /metrics on this port, same host as --address; 0 = off"})
    wedged_after_s: float = field(default=DEFAULT_WEDGED_AFTER_S, metadata={
        "help": "health turns NOT_SERVING when sequences are queued and no forward completes for this long "
                "(seconds; must exceed the longest forward)"})
    max_request_chars: int = field(default=PoolingLimits.max_request_chars, metadata={
        "help": "most characters of text per request, checked before tokenizing"})
    max_name_chars: int = field(default=PoolingLimits.max_name_chars, metadata={
        "help": "characters of a request's model, prompt_name and method"})
    max_request_token_ids: int = field(default=PoolingLimits.max_request_token_ids, metadata={
        "help": "token ids over one Embed request's input_ids"})

    def __post_init__(self) -> None:
        check_metrics_port(self.metrics_port)
        check_wedged_after_s(self.wedged_after_s)
        resolve_device(self.device)  # ValueError naming --device; the engine resolves it again to load
        if ":" not in self.address:
            raise ValueError(f"address must be host:port, got {self.address!r}")
        if not self.models:
            raise ValueError("models must name at least one model")
        names = [name for m in self.models for name in m.names]
        if len(set(names)) != len(names):
            raise ValueError(f"model names (and aliases) must be unique, got {names}")
        if self.max_batch_size < 1 or self.max_request_chars < 1:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) and max_request_chars "
                             f"({self.max_request_chars}) must be >= 1")
        self.limits  # noqa: B018 - validates the request caps (ValueError naming the first below 1)
        longest = max(m.max_input_length for m in self.models)
        if self.max_batch_tokens < longest:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} is below the longest max_input_length "
                             f"{longest}; one full-length input must fit a forward")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.max_queue_size < self.max_batch_size + 1:
            raise ValueError(f"max_queue_size {self.max_queue_size} must hold one full request "
                             f"(max_batch_size + 1 = {self.max_batch_size + 1})")

    def model_names(self) -> dict[str, str]:
        """Every name a request may give (each model's name and aliases) -> that model's name."""
        return {name: m.model_name for m in self.models for name in m.names}

    @property
    def limits(self) -> PoolingLimits:
        """The caps on one Embed / Rerank / Tokenize request."""
        return PoolingLimits(max_name_chars=self.max_name_chars, max_batch_size=self.max_batch_size,
                             max_request_chars=self.max_request_chars,
                             max_request_token_ids=self.max_request_token_ids)

    @property
    def default_model(self) -> ModelConfig:
        return self.models[0]


def _widths(text: str) -> tuple[int, ...]:
    """"64,128" -> (64, 128)."""
    return tuple(int(width) for width in text.split(","))


@dataclass
class ModelFlags:
    """The command line's model settings, one set for every served model of a kind.

    Attributes mirror `ModelConfig`'s; `model_dir`, `reranker_dir` and `judge_dir` list the
    embedding, cross-encoder and LLM-judge directories. With no directory at all, the prepared
    all-MiniLM-L6-v2 is served.
    """

    model_dir: list[Path] = field(default_factory=list, metadata={
        "help": "embedding model directory, repeatable; the first is the default", "append": True,
        "default_help": "the prepared all-MiniLM-L6-v2 when no model is given at all"})
    reranker_dir: list[Path] = field(default_factory=list, metadata={
        "help": "cross-encoder directory (a *ForSequenceClassification checkpoint), repeatable", "append": True})
    judge_dir: list[Path] = field(default_factory=list, metadata={
        "help": "causal LM directory served as an LLM-judge reranker (Qwen3-Reranker convention), repeatable",
        "append": True})
    max_input_length: int | None = field(default=None, metadata={
        "help": "most tokens per input, every model", "default_help": "each model's max_seq_length"})
    pooling_mode: str | None = field(default=None, metadata={
        "help": "embedding models' pooling", "choices": POOLING_MODES,
        "default_help": "each model's 1_Pooling/config.json"})
    normalize: bool | None = field(default=None, metadata={
        "help": "unit-normalize embeddings by default", "default_help": "the model's Normalize module"})
    matryoshka_dimensions: tuple[int, ...] | None = field(default=None, metadata={
        "help": "comma-separated widths `dimensions` may take, embedding models", "type": _widths,
        "default_help": "config.json"})
    judge_instruction: str | None = field(default=None, metadata={
        "help": "LLM-judge instruction", "default_help": "the model's / Qwen3-Reranker's"})
    served_model_name: list[str] = field(default_factory=list, metadata={
        "help": "names of the first model (the default embedding model; the first reranker when none is "
                "served): requests and answers use NAME, requests may also give each ALIAS, and the directory "
                "name is then not accepted (vLLM's --served-model-name)",
        "nargs": "+", "metavar": ("NAME", "ALIAS"), "default_help": "the directory name"})

    def models(self) -> list[ModelConfig]:
        """Validated `ModelConfig`s: embedding models first, then rerankers, then judges; the first
        one named `served_model_name` when given.

        Raises:
            ValueError: from `ModelConfig`.
        """
        embedding_dirs = self.model_dir or ([] if self.reranker_dir or self.judge_dir else [default_embedding_dir()])
        embedding = {"kind": EMBEDDING, "max_input_length": self.max_input_length, "pooling_mode": self.pooling_mode,
                     "normalize": self.normalize, "matryoshka_dimensions": self.matryoshka_dimensions}
        reranker = {"kind": CROSS_ENCODER, "max_input_length": self.max_input_length}
        judge = {"kind": LLM_JUDGE, "max_input_length": self.max_input_length,
                 "judge_instruction": self.judge_instruction}
        served = [(d, embedding) for d in embedding_dirs] + [(d, reranker) for d in self.reranker_dir] + \
            [(d, judge) for d in self.judge_dir]
        names = ({"model_name": self.served_model_name[0], "aliases": tuple(self.served_model_name[1:])}
                 if self.served_model_name else {})
        return [ModelConfig(model_dir=d, **settings, **(names if i == 0 else {}))
                for i, (d, settings) in enumerate(served)]


def _tokenizer_max_length(model_dir: Path) -> int | None:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("model_max_length")
    if value is None or value >= _NO_TOKENIZER_LIMIT:
        return None
    return int(value)
