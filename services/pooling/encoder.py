"""`HFEncoder`: a transformers encoder and its tokenizer, loaded from a local directory.

Texts become one padded batch; the attention mask goes to the model (bidirectional attention,
padding masked out of every key) and comes back for pooling. Weights stay fp32: pooled vectors
must equal sentence-transformers' to cosine 0.99999, whatever else is in the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

from services.common.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizedBatch:
    """A padded batch ready for the encoder.

    Attributes:
        model_inputs: tokenizer outputs the model accepts: `input_ids` [B, T] int64,
            `attention_mask` [B, T] int64 (1 = visible), and `token_type_ids` [B, T] where used.
        num_tokens: visible tokens per input (special tokens included, padding excluded).
    """

    model_inputs: dict[str, torch.Tensor]
    num_tokens: list[int]

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.model_inputs["attention_mask"]


class HFEncoder:
    """`AutoModel` + `AutoTokenizer` from `model_dir` (local files only), fp32, eval mode.

    Args:
        model_dir: local transformers directory.
        max_input_length: most tokens per input; longer inputs are refused, never truncated.
        device: torch device string.
        do_lower_case: lower-case texts first (sentence-transformers' Transformer option).
    """

    def __init__(self, model_dir: Path, max_input_length: int, device: str = "cpu", do_lower_case: bool = False):
        self.max_input_length = max_input_length
        self.device = torch.device(device)
        self.do_lower_case = do_lower_case
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
        self.model.to(self.device).eval()
        log.info("loaded encoder %s (%s, hidden %d) on %s", model_dir, type(self.model).__name__,
                 self.dimension, self.device)

    @property
    def dimension(self) -> int:
        """Width of the final hidden states, hence of every pooled embedding."""
        return int(self.model.config.hidden_size)

    def tokenize(self, texts: list[str], labels: list[str] | None = None) -> TokenizedBatch:
        """Tokenize and pad `texts` (the tokenizer's padding side) without truncation.

        Args:
            labels: how error messages name each text (default "input 3").

        Raises:
            InvalidArgument: an input has more than `max_input_length` tokens; the message quotes
                its label, its token count and the limit.
        """
        if self.do_lower_case:
            texts = [text.lower() for text in texts]
        encoded = self.tokenizer(texts, padding=True, truncation=False, return_tensors="pt")
        num_tokens = encoded["attention_mask"].sum(dim=1).tolist()
        for index, count in enumerate(num_tokens):
            if count > self.max_input_length:
                label = labels[index] if labels is not None else f"input {index}"
                raise InvalidArgument(f"{label} has {count} tokens; the maximum input length is "
                                      f"{self.max_input_length} (inputs are never truncated)")
        names = self.tokenizer.model_input_names
        return TokenizedBatch(model_inputs={k: v for k, v in encoded.items() if k in names}, num_tokens=num_tokens)

    @torch.inference_mode()
    def hidden_states(self, batch: TokenizedBatch) -> torch.Tensor:
        """One forward: [B, T, H] float32 final hidden states on the encoder's device."""
        inputs = {k: v.to(self.device) for k, v in batch.model_inputs.items()}
        return self.model(**inputs).last_hidden_state.float()
