import pytest

from services.decoder.config import DecoderConfig


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


@pytest.mark.parametrize("names, message", [(("a", "a"), "names one model twice"), (("a", " "), "an empty name")])
def test_served_model_names_are_checked(tiny_llama, names, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(model_dir=str(tiny_llama), served_model_name=names)
    assert DecoderConfig(model_dir=str(tiny_llama)).served_model_names == (tiny_llama.name,)


@pytest.mark.parametrize("content, message", [
    ('{"top_p": 1.5}', r"generation_config.json: top_p must be in \[0, 1\], got 1.5"),
    ('{"temperature": "hot"}', "generation_config.json: temperature must be a number, got 'hot'"),
    ('{"max_new_tokens": 0}', "generation_config.json: max_tokens must be >= 1"),
    ('{"top_k": 2.5}', "top_k must be an integer"),
    ("[1]", "holds a JSON list, not an object"),
    (None, "no readable"),
])
def test_generation_config_is_read_once_and_checked(tiny_llama, tmp_path, content, message):
    if content is not None:
        (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        DecoderConfig(model_dir=str(tiny_llama), generation_config=str(tmp_path))
