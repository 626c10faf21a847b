import pytest

from tessera.decoder.config import DecoderConfig


def test_defaults_derive_from_the_model(tiny_llama):
    config = DecoderConfig(model_dir=str(tiny_llama))
    assert config.max_model_len == 512                      # min(max_position_embeddings, 8192)
    assert config.num_blocks == 32 * 512 // 4 // 16         # max_num_seqs * max_model_len / 4 tokens


@pytest.mark.parametrize("overrides, message", [
    (dict(block_size=0), "block_size must be >= 1, got 0"),
    (dict(max_model_len=1024), "max_model_len 1024 exceeds the model's max_position_embeddings 512"),
    (dict(mrope_section=(2, 2, 2), image_token="<repo_name>"), "needs 8"),
    (dict(mrope_section=(2, 3, 3)), "needs image_token"),
    (dict(dtype="int8"), "dtype must be one of"),
])
def test_invalid_values_name_the_limit(tiny_llama, overrides, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(model_dir=str(tiny_llama), **overrides)
