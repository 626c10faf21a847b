"""What `tessera up` starts for a decoder checkpoint: refused before any process, or which vision
encoder (if any) pairs with it.

A Qwen2-VL or Qwen2.5-VL checkpoint brings its own tower and M-RoPE sections ("qwen2-vl"); the built-in SmolLM2
(the default decoder dir, which `tessera models prepare` writes) pairs with the demo encoder at
DEFAULT_MROPE_SECTION; any other decoder, a user's Llama or Qwen, starts text-only (no vision
service; the gateway refuses image parts) unless M-RoPE sections given for it pair it with the demo
encoder. Needs no torch: `up` decides before it starts anything.
"""

from __future__ import annotations

from pathlib import Path

from services.common.checkpoint import CheckpointConfig, check_decoder_dir
from services.common.errors import InvalidArgument
from services.common.mrope import DEFAULT_MROPE_SECTION, QWEN_VL_MODEL_TYPES, check_mrope_section, parse_mrope_section
from tessera.paths import default_decoder_dir, default_embedding_dir

PREPARE_ADVICE = "; run `tessera models prepare` first"


def check_model_dirs(decoder_dir: str | Path, embedding_dir: str | Path) -> CheckpointConfig:
    """The decoder checkpoint's config once both directories can serve.

    Raises:
        InvalidArgument: one line: a decoder dir `check_decoder_dir` refuses, or an embedding dir
            without config.json. Only the default dirs, which `tessera models prepare` writes, get
            the advice to run it.
    """
    decoder, embedding = Path(decoder_dir).expanduser(), Path(embedding_dir).expanduser()
    if decoder == default_decoder_dir() and not (decoder / "config.json").exists():
        raise InvalidArgument(f"decoder model dir {str(decoder)!r} has no config.json{PREPARE_ADVICE}")
    checkpoint = check_decoder_dir(decoder)
    if not (embedding / "config.json").is_file():
        advice = PREPARE_ADVICE if embedding == default_embedding_dir() else " (a sentence-transformers checkpoint)"
        raise InvalidArgument(f"embedding model dir {str(embedding)!r} has no config.json{advice}")
    return checkpoint


def pick_encoder(checkpoint: CheckpointConfig, mrope_section: str = "") -> tuple[str | None, str]:
    """(encoder, sections): the vision encoder that fits the decoder ("qwen2-vl", "demo", or None:
    the decoder starts text-only) and, for "demo", the M-RoPE sections as "t,h,w" ("" otherwise).

    The demo encoder needs sections covering the decoder's head_dim / 2 rotary pairs:
    `mrope_section` when given, else DEFAULT_MROPE_SECTION for the built-in SmolLM2.

    Raises:
        InvalidArgument: `mrope_section` malformed, or not covering the decoder's rotary pairs.
    """
    if checkpoint.model_type in QWEN_VL_MODEL_TYPES:
        return "qwen2-vl", ""
    builtin = checkpoint.model_dir.resolve() == default_decoder_dir().resolve()
    if not mrope_section and not builtin:
        return None, ""
    try:
        section = parse_mrope_section(mrope_section) or DEFAULT_MROPE_SECTION
        check_mrope_section(section, checkpoint.head_dim, minimum=1)
    except ValueError as error:
        raise InvalidArgument(f"{error} (decoder model dir {str(checkpoint.model_dir)!r})") from None
    return "demo", ",".join(map(str, section))
