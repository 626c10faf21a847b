"""M-RoPE sections (rotary pairs per t, h, w axis), parsed and checked once for vision and decoder.

Qwen2-VL's M-RoPE splits a head's head_dim / 2 rotary pairs into three runs, one per position axis
(as in transformers' Qwen2-VL `apply_multimodal_rotary_pos_emb`); both services must agree on them.
"""

from __future__ import annotations

from collections.abc import Sequence

# model_types of the Qwen2-VL family: a language model on M-RoPE positions (transformers' get_rope_index,
# the same rule for images in both) whose vision tower the vision service runs
QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# the demo vision encoder's sections: pairs per (t, h, w) axis for head_dim 64, as the built-in SmolLM2-135M has
DEFAULT_MROPE_SECTION = (8, 12, 12)


def parse_mrope_section(text: str) -> tuple[int, int, int] | None:
    """"8,12,12" -> (8, 12, 12); "" (or blanks) -> None, no sections given.

    Raises:
        ValueError: not three comma-separated integers (the message names the value).
    """
    if not text.strip():
        return None
    try:
        section = tuple(int(part) for part in text.split(","))
    except ValueError as error:
        raise ValueError(f"mrope_section must be three comma-separated integers, got {text!r}") from error
    if len(section) != 3:
        raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {text!r}")
    return section  # type: ignore[return-value]


def check_mrope_section(section: Sequence[int], head_dim: int | None = None, minimum: int = 0) -> tuple[int, int, int]:
    """`section` as a tuple, checked: three pair counts >= `minimum`, and, when `head_dim` is given,
    summing to head_dim / 2.

    Raises:
        ValueError: naming the section, and the head_dim it must cover.
    """
    values = tuple(int(s) for s in section)
    if len(values) != 3 or min(values) < minimum:
        raise ValueError(f"mrope_section must be 3 pair counts >= {minimum} (t, h, w), got {tuple(section)}")
    if head_dim is not None and 2 * sum(values) != head_dim:
        raise ValueError(f"mrope_section {values} sums to {sum(values)} rotary pairs; "
                         f"the model's head_dim {head_dim} needs {head_dim // 2}")
    return values  # type: ignore[return-value]


def check_checkpoint_section(given: Sequence[int] | None, own: tuple[int, int, int],
                             as_flag: bool = False) -> tuple[int, int, int]:
    """The checkpoint's sections `own`, once the configured `given` (None: take the checkpoint's) is
    found equal to them.

    Raises:
        ValueError: `given` differs (named as the config field, or with `as_flag` as the flag).
    """
    if given is not None and tuple(given) != tuple(own):
        shown = f"--mrope-section {','.join(map(str, given))}" if as_flag else f"mrope_section {tuple(given)}"
        raise ValueError(f"{shown} differs from the checkpoint's {tuple(own)}")
    return tuple(own)  # type: ignore[return-value]
