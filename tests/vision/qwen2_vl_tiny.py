"""A tiny Qwen2-VL checkpoint with seeded random weights, built offline with transformers' config classes.

The directory also holds a character-level tokenizer (ids < 256) whose special tokens sit at the
config's ids: <|endoftext|> 0, <|im_end|> 1 (EOS), <|im_start|> 2, <|image_pad|> 250, <|video_pad|> 251,
<|vision_start|> 252, <|vision_end|> 253, and a Qwen2-VL style chat template.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.vision.vision_images import encode

MROPE_SECTION = [2, 3, 3]  # sums to head_dim / 2 = (64 / 4) / 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64  # small images keep the tests fast


def tiny_config() -> Qwen2VLConfig:
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                rope_parameters={"rope_type": "default", "mrope_section": MROPE_SECTION, "rope_theta": 10000.0})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, spatial_merge_size=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                         vision_start_token_id=252, vision_end_token_id=253)


def reference_processor() -> Qwen2VLImageProcessorPil:
    """transformers' slow (PIL) Qwen2-VL image processor; the fast one needs torchvision, not installed."""
    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def build_tiny_qwen2_vl(directory: Path, seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """Save a seeded tiny Qwen2-VL (config.json, model.safetensors, preprocessor_config.json) to `directory`."""
    return save_seeded(Qwen2VLForConditionalGeneration, tiny_config(), directory, seed)


def save_seeded(model_class, config, directory: Path, seed: int):
    """`model_class(config)` with seeded weights spread for sharp tests, saved to `directory` with the
    reference image processor and the tiny tokenizer; returns the model (eval mode)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).eval()
        with torch.no_grad():  # the default init (std 0.02) gives rows ~0.02; larger weights make 1e-5 a sharp test
            for parameter in model.model.visual.parameters():
                parameter.normal_(0.0, 0.2)
            for name, parameter in model.named_parameters():  # decisive text logits: no near-ties in argmax
                if "visual" not in name and parameter.ndim == 2:
                    parameter.normal_(0.0, 0.15)
                elif "visual" not in name and name.endswith("bias"):
                    parameter.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    reference_processor().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return model


SPECIALS = {0: "<|endoftext|>", 1: "<|im_end|>", 2: "<|im_start|>", 250: "<|image_pad|>", 251: "<|video_pad|>",
            252: "<|vision_start|>", 253: "<|vision_end|>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII and newline (ids 3..98), fillers up to 255."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {c: 3 + i for i, c in enumerate(chars)}
    vocab.update({f"<|extra_{i}|>": i for i in range(3 + len(chars), 256) if i not in SPECIALS})
    vocab.update({token: i for i, token in SPECIALS.items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=None, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", additional_special_tokens=list(SPECIALS.values()))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def hf_inputs(tokenizer, image_processor, content: list) -> dict:
    """transformers' inputs for one user turn; `content` items are image bytes or text.

    The chat template renders one <|image_pad|> per image; Qwen2VLProcessor's rule
    (`grid.prod() // merge_size**2` copies) expands it. The processor class itself is not used:
    its video half needs torchvision, which is not installed.
    """
    import io

    from PIL import Image

    message = [{"role": "user", "content": [{"type": "image"} if isinstance(c, bytes) else {"type": "text", "text": c}
                                            for c in content]}]
    text = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    batch = {}
    images = [Image.open(io.BytesIO(c)) for c in content if isinstance(c, bytes)]
    if images:
        batch = dict(image_processor(images=images, return_tensors="pt"))
        pieces = text.split("<|image_pad|>")
        counts = [int(g.prod()) // image_processor.merge_size ** 2 for g in batch["image_grid_thw"]]
        text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
    ids = tokenizer([text], add_special_tokens=False, return_tensors="pt")["input_ids"]
    image_token_id = tiny_config().image_token_id
    batch.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_token_id).int())
    return batch


def hf_greedy(model, batch: dict, max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """generate(do_sample=False): new ids (cut after EOS) and per-step fp32 logits [n, vocab]."""
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
    eos = model.config.text_config.eos_token_id
    n = new.index(eos) + 1 if eos in new else len(new)
    return new[:n], torch.cat(out.logits).float()[:n]


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of seeded uniform noise, `width` x `height` RGB (the seed mixes in the size)."""
    rng = np.random.default_rng(seed + 1000 * width + height)
    return encode(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))


def visual_reference(model, images: list[bytes]):
    """transformers' answer for `images` (encoded bytes): (pixel_values, image_grid_thw, the visual
    model's merged rows), from the reference processor and `model.model.visual`."""
    batch = reference_processor()(images=[Image.open(io.BytesIO(data)) for data in images], return_tensors="pt")
    with torch.no_grad():
        rows = model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
    return batch["pixel_values"], batch["image_grid_thw"], rows
