"""The Qwen2-VL encoder: a Qwen2-VL or Qwen2.5-VL Hugging Face checkpoint directory's `visual.*` weights.

Reads, from the directory:
  config.json              model_type (which tower: `TOWERS`), vision_config (its shape),
                           text_config/top-level rope_parameters or rope_scaling `mrope_section`
                           (the LLM's M-RoPE sections)
  preprocessor_config.json min/max pixels, patch/merge/temporal sizes, mean/std (optional file)
  *.safetensors            only tensors named `visual.*` (or `model.visual.*`, the in-memory name
                           in transformers 5); the language model's weights are never read

Both families share the preprocessing (transformers maps qwen2_5_vl to Qwen2VLImageProcessor) and
the M-RoPE position rule for images; their towers differ (qwen2_vl_tower, qwen2_5_vl_tower).
Rows come out float32 on CPU in the order transformers' `model.visual(...)` returns them:
merged tokens of each image in (t, h/2, w/2) raster order, which is the order of its
`<|image_pad|>` placeholders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.checkpoint import CheckpointConfig
from services.common.mrope import check_mrope_section
from services.vision.encoder import EncoderOutput, ImageEncoder, state_dict_digest
from services.vision.qwen2_5_vl_tower import Qwen2_5_VLVisionConfig, Qwen2_5_VLVisionTower
from services.vision.qwen2_vl_pixels import Qwen2VLPixelConfig, patchify
from services.vision.qwen2_vl_tower import Qwen2VLVisionConfig, Qwen2VLVisionTower

_PREFIXES = ("visual.", "model.visual.")


@dataclass(frozen=True)
class TowerFamily:
    """One family's vision tower: its config class, its module, and the encoder name GetInfo reports."""

    config: type[Qwen2VLVisionConfig] | type[Qwen2_5_VLVisionConfig]
    tower: type[Qwen2VLVisionTower] | type[Qwen2_5_VLVisionTower]
    name: str


# config.json's model_type -> its tower; any other model_type is read as Qwen2-VL's (its visual.* weights
# must then fit that tower)
TOWERS = {
    "qwen2_vl": TowerFamily(Qwen2VLVisionConfig, Qwen2VLVisionTower, "qwen2-vl"),
    "qwen2_5_vl": TowerFamily(Qwen2_5_VLVisionConfig, Qwen2_5_VLVisionTower, "qwen2.5-vl"),
}


@dataclass(frozen=True)
class Qwen2VLEncoderConfig:
    """Where the checkpoint is, and optional min/max pixel overrides of its preprocessor config."""

    model_dir: str
    min_pixels: int | None = None
    max_pixels: int | None = None

    def __post_init__(self) -> None:
        if not (Path(self.model_dir).expanduser() / "config.json").is_file():
            raise ValueError(f"model_dir {self.model_dir!r} has no config.json (need a Qwen2-VL or Qwen2.5-VL checkpoint directory)")
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class Qwen2VLCheckpoint:
    """What the directory says: tower family and shape, M-RoPE sections, preprocessing recipe."""

    vision: Qwen2VLVisionConfig | Qwen2_5_VLVisionConfig
    mrope_section: tuple[int, int, int]
    pixels: Qwen2VLPixelConfig = field(default_factory=Qwen2VLPixelConfig)
    family: TowerFamily = TOWERS["qwen2_vl"]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error


def _vision_config(raw: dict, family: TowerFamily) -> Qwen2VLVisionConfig | Qwen2_5_VLVisionConfig:
    """Accepts both transformers 5 names and the original releases' (in_chans, spatial_patch_size)."""
    names = {f.name for f in fields(family.config)}
    values = {k: v for k, v in raw.items() if k in names}
    if "in_chans" in raw and "in_channels" not in raw:
        values["in_channels"] = raw["in_chans"]
    if "spatial_patch_size" in raw and "patch_size" not in raw:
        values["patch_size"] = raw["spatial_patch_size"]
    rope = raw.get("rope_parameters") or {}
    if "rope_theta" in rope:
        values["rope_theta"] = float(rope["rope_theta"])
    return family.config(**values)


def _mrope_section(config: dict) -> tuple[int, int, int]:
    text = config.get("text_config") or {}
    for holder in (text, config):
        for key in ("rope_scaling", "rope_parameters"):  # transformers 5's order: the legacy field wins
            section = (holder.get(key) or {}).get("mrope_section")
            if section is not None:
                return check_mrope_section(section)
    raise ValueError("config.json has no mrope_section in rope_parameters/rope_scaling; not a Qwen2-VL checkpoint")


def _pixel_config(raw: dict, vision: Qwen2VLVisionConfig | Qwen2_5_VLVisionConfig, encoder: Qwen2VLEncoderConfig) -> Qwen2VLPixelConfig:
    size = raw.get("size") or {}
    defaults = Qwen2VLPixelConfig()
    min_pixels = encoder.min_pixels or raw.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels
    max_pixels = encoder.max_pixels or raw.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels
    config = Qwen2VLPixelConfig(
        min_pixels=int(min_pixels), max_pixels=int(max_pixels),
        patch_size=int(raw.get("patch_size", vision.patch_size)),
        temporal_patch_size=int(raw.get("temporal_patch_size", vision.temporal_patch_size)),
        merge_size=int(raw.get("merge_size", vision.spatial_merge_size)),
        image_mean=tuple(raw.get("image_mean", defaults.image_mean)),
        image_std=tuple(raw.get("image_std", defaults.image_std)))
    tower = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
    recipe = (config.patch_size, config.temporal_patch_size, config.merge_size)
    if recipe != tower:
        raise ValueError(f"preprocessor patch/temporal/merge sizes {recipe} disagree with vision_config's {tower}")
    return config


def read_checkpoint(encoder: Qwen2VLEncoderConfig) -> Qwen2VLCheckpoint:
    """Parse config.json (+ preprocessor_config.json when present). Raises ValueError naming the problem."""
    checkpoint = CheckpointConfig.read(encoder.model_dir)
    root, config = checkpoint.model_dir, checkpoint.raw
    if "vision_config" not in config:
        raise ValueError(f"{root / 'config.json'} has no vision_config; not a Qwen2-VL or Qwen2.5-VL checkpoint")
    family = TOWERS.get(checkpoint.model_type, TOWERS["qwen2_vl"])
    vision = _vision_config(config["vision_config"], family)
    preprocessor = root / "preprocessor_config.json"
    raw_pixels = _read_json(preprocessor) if preprocessor.is_file() else {}
    return Qwen2VLCheckpoint(vision=vision, mrope_section=_mrope_section(config),
                             pixels=_pixel_config(raw_pixels, vision, encoder), family=family)


def load_visual_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Only the `visual.*` tensors of every *.safetensors file, names without the prefix, float32."""
    root = Path(model_dir).expanduser()
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    state[name[len(prefix):]] = handle.get_tensor(name).float()
    if not state:
        raise ValueError(f"no visual.* tensors in {', '.join(p.name for p in files)}")
    return state


class Qwen2VLEncoder(ImageEncoder):
    """The checkpoint's vision tower + PatchMerger (Qwen2-VL's, or Qwen2.5-VL's with window
    attention); pixels from the processor's Qwen2-VL recipe. `name` is "qwen2-vl" or "qwen2.5-vl"."""

    def __init__(self, config: Qwen2VLEncoderConfig) -> None:
        self.config = config
        self.checkpoint = read_checkpoint(config)
        self.name = self.checkpoint.family.name
        self.model = self.checkpoint.family.tower(self.checkpoint.vision).eval()
        state = load_visual_state(config.model_dir)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"visual.* weights do not fit the tower: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        self.output_width = self.checkpoint.vision.output_width
        self.revision = state_dict_digest(self.model)

    def encode(self, pixels: list[torch.Tensor]) -> list[EncoderOutput]:
        """pixels: list of float32 [3, H, W] (CLIP-normalized, H, W multiples of 28) -> per image
        rows [t * H/28 * W/28, hidden] float32 and grid (t, H/28, W/28) in LLM units.

        All images go through the tower in one packed batch; attention never crosses images.
        Raises ValueError for pixels of the wrong shape.
        """
        if not pixels:
            return []
        patches = [patchify(p, self.checkpoint.pixels) for p in pixels]
        grids = [grid for _, grid in patches]
        with torch.inference_mode():
            rows = self.model(torch.cat([values for values, _ in patches]), grids)  # [sum N/4, hidden]
        merge = self.checkpoint.vision.spatial_merge_size
        llm_grids = [(t, h // merge, w // merge) for t, h, w in grids]
        counts = [t * h * w for t, h, w in llm_grids]
        return [EncoderOutput(rows=r.contiguous().clone(), grid_thw=g)
                for r, g in zip(torch.split(rows, counts), llm_grids, strict=True)]
