import pytest

from services.common.sizes import parse_bytes
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


def test_a_kv_cache_memory_budget_sizes_the_cache(tiny_llama):
    """tiny_llama: 2 layers, 2 kv heads, head_dim 16, float32; a 16-token block is
    2 x 2 (K, V) x 16 x 2 x 16 x 4 = 8192 bytes."""
    config = DecoderConfig(model_dir=str(tiny_llama), kv_cache_memory_bytes=parse_bytes("1MiB"), dtype="float32")
    assert config.kv_block_layout().bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4 == 8192
    assert config.num_blocks == 2**20 // 8192 == 128
    half = DecoderConfig(model_dir=str(tiny_llama), kv_cache_memory_bytes=2**20, dtype="bfloat16")
    assert half.num_blocks == 256   # 2-byte elements: twice the blocks
    assert DecoderConfig(model_dir=str(tiny_llama), kv_cache_memory_bytes=2**20 + 8191, dtype="float32").num_blocks == 128


def test_a_kv_cache_memory_budget_too_small_for_one_sequence_is_refused(tiny_llama):
    # max_model_len 512 = 32 blocks of 8192 bytes = 262144 bytes; 31 blocks' worth is refused
    with pytest.raises(ValueError, match=r"--kv-cache-memory-bytes 253952 bytes \(248.0 KiB\) holds 31 KV blocks of 8192 "
                                         r"bytes .*max_model_len 512 tokens needs 32 blocks, 262144 bytes"):
        DecoderConfig(model_dir=str(tiny_llama), kv_cache_memory_bytes=31 * 8192, dtype="float32")
    assert DecoderConfig(model_dir=str(tiny_llama), kv_cache_memory_bytes=32 * 8192, dtype="float32").num_blocks == 32


def test_num_blocks_and_kv_cache_memory_together_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="--num-blocks 64 and --kv-cache-memory-bytes 1048576 both size the KV cache"):
        DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, kv_cache_memory_bytes=2**20)


def test_the_kv_cache_memory_flag_takes_sizes_and_refuses_a_bad_one(tiny_llama, capsys):
    from services.decoder.__main__ import parse_args

    assert parse_args(["--model-dir", str(tiny_llama), "--kv-cache-memory-bytes", "1MiB", "--dtype", "float32"]).num_blocks == 128
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model-dir", str(tiny_llama), "--kv-cache-memory-bytes", "1 parsec"])
    assert exit_info.value.code == 2 and "--kv-cache-memory-bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model-dir", str(tiny_llama), "--kv-cache-memory-bytes", "8KiB", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "needs 32 blocks, 262144 bytes" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("text, count", [("1073741824", 2**30), ("2GiB", 2 * 2**30), ("2Gi", 2 * 2**30),
                                         ("512MB", 512 * 10**6), ("1.5 KiB", 1536), ("64kib", 65536)])
def test_parse_bytes(text, count):
    assert parse_bytes(text) == count


@pytest.mark.parametrize("text", ["", "GiB", "2 parsecs", "-1GiB", "1e9"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="is not a size in bytes"):
        parse_bytes(text)
