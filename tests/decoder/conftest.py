"""Fixtures for the decoder tests. Helpers live in `decoder_testing` (import them from there:
several test folders have a conftest.py, so `from decoder_testing import ...` can bind the wrong one)."""

from decoder_testing import (  # noqa: F401 - fixtures, re-exported for pytest
    attention_backend,
    hf_model,
    tiny_llama,
    tokenizer,
)
