"""Model runners: one padded forward over a list of `Sequence`s, one output row per sequence.

Every runner right-pads and passes the attention mask, so the result for a sequence does not
depend on what else is in the batch: an encoder masks padding out of every key; a causal decoder
never looks right, so its visible tokens cannot see the padding after them. Collation:

    sequences  [5 7 9] [4 2]      input_ids      [[5 7 9], [4 2 P]]
                                  attention_mask [[1 1 1], [1 1 0]]

Weights stay fp32: pooled vectors must match sentence-transformers to cosine 0.99999.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from services.pooling.config import CROSS_ENCODER, EMBEDDING, LLM_JUDGE, ModelConfig
from services.pooling.pooling import pool
from services.pooling.tokens import ModelTokenizer, Sequence

log = logging.getLogger(__name__)


def collate(sequences: list[Sequence], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad to the longest: `input_ids`, `attention_mask` (and `token_type_ids`), each [B, T] int64."""
    num_rows, max_len = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.full((num_rows, max_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((num_rows, max_len), dtype=torch.long)
    with_types = sequences[0].token_type_ids is not None
    types = torch.zeros((num_rows, max_len), dtype=torch.long) if with_types else None
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq.input_ids)
        mask[row, : len(seq)] = 1
        if types is not None:
            types[row, : len(seq)] = torch.tensor(seq.token_type_ids)
    batch = {"input_ids": input_ids, "attention_mask": mask}
    if types is not None:
        batch["token_type_ids"] = types
    return {k: v.to(device) for k, v in batch.items()}


class PoolingRunner(ABC):
    """Contract: `forward(sequences)` runs one forward (blocking; called from a worker thread, one at
    a time per device) and returns float32 CPU rows in input order: [B, D] pooled embeddings for
    "embedding" runners, [B] scalar logits for rerank runners. No row depends on the other rows."""

    kind: str
    method: str  # the rerank method this runner implies
    dimension: int = 0  # embedding width; 0 for score heads

    @abstractmethod
    def forward(self, sequences: list[Sequence]) -> torch.Tensor: ...


class EmbeddingRunner(PoolingRunner):
    """`AutoModel` (BERT-family encoder or causal decoder) + pooling ("mean", "cls" or "last")."""

    kind, method = EMBEDDING, "bi-encoder"

    def __init__(self, model_dir: Path, pooling_mode: str, pad_token_id: int, device: torch.device):
        self.model = AutoModel.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
        self.model.to(device).eval()
        self.pooling_mode, self.pad_token_id, self.device = pooling_mode, pad_token_id, device
        self.dimension = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def forward(self, sequences: list[Sequence]) -> torch.Tensor:
        batch = collate(sequences, self.pad_token_id, self.device)
        hidden = self.model(**batch).last_hidden_state  # [B, T, H]
        return pool(hidden, batch["attention_mask"], self.pooling_mode).cpu()  # [B, H] fp32


class CrossEncoderRunner(PoolingRunner):
    """`AutoModelForSequenceClassification` with one label: its trained head scores a (query, document) pair.

    Raises:
        ValueError: the head has more than one label (no single relevance score).
    """

    kind, method = CROSS_ENCODER, "cross-encoder"

    def __init__(self, model_dir: Path, pad_token_id: int, device: torch.device):
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir), local_files_only=True, dtype=torch.float32)
        if self.model.config.num_labels != 1:
            raise ValueError(f"{model_dir}: a cross-encoder needs one label (a relevance logit), "
                             f"got num_labels {self.model.config.num_labels}")
        self.model.to(device).eval()
        self.pad_token_id, self.device = pad_token_id, device

    @torch.inference_mode()
    def forward(self, sequences: list[Sequence]) -> torch.Tensor:
        batch = collate(sequences, self.pad_token_id, self.device)
        return self.model(**batch).logits[:, 0].float().cpu()  # [B]


class JudgeRunner(PoolingRunner):
    """A causal LM as a yes/no judge (the Qwen3-Reranker convention).

    The score head is w = lm_head[yes] - lm_head[no] (+ the bias difference), applied to the last
    visible hidden state: log P(yes) - log P(no) restricted to those two tokens, whose sigmoid is
    Qwen3-Reranker's softmax-over-{no, yes} probability.

    Raises:
        ValueError: the tokenizer has no single token for "yes" or "no".
    """

    kind, method = LLM_JUDGE, "llm-judge"

    def __init__(self, model_dir: Path, tokenizer: ModelTokenizer, tokens: tuple[str, str], device: torch.device):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
        yes_id, no_id = (_single_token_id(tokenizer, t, model_dir) for t in tokens)
        head = model.get_output_embeddings()
        self.score_weight = (head.weight[yes_id] - head.weight[no_id]).detach().float().to(device)  # [H]
        bias = getattr(head, "bias", None)
        self.score_bias = float(bias[yes_id] - bias[no_id]) if bias is not None else 0.0
        self.model = model.base_model.to(device).eval()  # the decoder stack, final norm included
        self.pad_token_id, self.device = tokenizer.pad_token_id, device

    @torch.inference_mode()
    def forward(self, sequences: list[Sequence]) -> torch.Tensor:
        batch = collate(sequences, self.pad_token_id, self.device)
        batch.pop("token_type_ids", None)
        hidden = self.model(**batch).last_hidden_state  # [B, T, H]
        last = pool(hidden, batch["attention_mask"], "last")  # [B, H]
        return (last @ self.score_weight + self.score_bias).cpu()  # [B]


def load_runner(config: ModelConfig, tokenizer: ModelTokenizer, device: str) -> PoolingRunner:
    """The runner for `config.kind`, weights loaded from its directory (seconds; blocking)."""
    torch_device = torch.device(device)
    if config.kind == EMBEDDING:
        runner = EmbeddingRunner(config.model_dir, config.pooling_mode, tokenizer.pad_token_id, torch_device)
    elif config.kind == CROSS_ENCODER:
        runner = CrossEncoderRunner(config.model_dir, tokenizer.pad_token_id, torch_device)
    else:
        runner = JudgeRunner(config.model_dir, tokenizer, config.judge_tokens, torch_device)
    log.info("loaded %s model %s (%s) from %s on %s", config.kind, config.model_name,
             type(runner).__name__, config.model_dir, device)
    return runner


def _single_token_id(tokenizer: ModelTokenizer, text: str, model_dir: Path) -> int:
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{model_dir}: the judge token {text!r} is {len(ids)} tokens {ids}; it must be exactly one")
    return ids[0]
