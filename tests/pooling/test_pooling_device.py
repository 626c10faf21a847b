"""The pooling service's `--device` (resolved and refused like the decoder's) and its warm-up:
`load` runs one tiny batch through every model, so a model that cannot compute fails the start."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from services.pooling.config import ModelConfig, PoolingConfig
from services.pooling.engine import PoolingEngine


def _tiny_encoder(path, minilm_dir, poison: bool = False):
    """A random 2-layer BERT encoder with the MiniLM vocabulary; `poison` sets one weight to NaN."""
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=128)).eval()
    if poison:
        with torch.no_grad():
            model.encoder.layer[0].attention.output.dense.weight[0, 0] = float("nan")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(str(minilm_dir)).save_pretrained(path)
    return path


def test_device_is_resolved_at_config_and_refused_naming_the_flag(minilm_model_config):
    assert PoolingConfig(models=[minilm_model_config]).device == "auto"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"--device cuda:{count}"):  # one past the last device, on any machine
        PoolingConfig(models=[minilm_model_config], device=f"cuda:{count}")
    with pytest.raises(ValueError, match="--device 'gpu' is not a device"):
        PoolingConfig(models=[minilm_model_config], device="gpu")


def test_load_warms_every_model_up_and_refuses_one_that_cannot_compute(tmp_path, minilm_dir):
    healthy = ModelConfig(model_dir=_tiny_encoder(tmp_path / "healthy", minilm_dir))
    engine = PoolingEngine(PoolingConfig(models=[healthy], device="cpu"))
    engine.load()
    assert next(iter(engine.models.values())).runner.model.device == torch.device("cpu")
    poisoned = ModelConfig(model_dir=_tiny_encoder(tmp_path / "poisoned", minilm_dir, poison=True))
    with pytest.raises(ValueError, match="the warm-up forward of model 'poisoned' failed on --device cpu .*not finite"):
        PoolingEngine(PoolingConfig(models=[healthy, poisoned], device="cpu")).load()
