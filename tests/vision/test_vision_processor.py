"""Processor: real PNG/JPEG/GIF bytes made with PIL, every conversion and every refusal."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image
from vision_images import encode, png_header_claiming, solid, two_halves

from services.common.errors import InvalidArgument
from services.vision.processor import ImageProcessor, ImageSource, ProcessorConfig, content_hash

RED, BLUE = (255, 0, 0), (0, 0, 255)


def process(data: bytes, **config) -> torch.Tensor:
    return ImageProcessor(ProcessorConfig(**config)).process(ImageSource(data=data)).pixels


def refusal(source: ImageSource, **config) -> str:
    with pytest.raises(InvalidArgument) as caught:
        ImageProcessor(ProcessorConfig(**config)).process(source)
    return str(caught.value)


def test_png_shape_range_and_channel_order():
    pixels = process(solid(RED, size=(40, 30)))
    assert pixels.shape == (3, 64, 64) and pixels.dtype == torch.float32
    assert torch.equal(pixels[0], torch.ones(64, 64)) and torch.equal(pixels[1:], -torch.ones(2, 64, 64))
    noise = Image.frombytes("RGB", (50, 70), torch.randint(0, 256, (50 * 70 * 3,), dtype=torch.uint8).numpy().tobytes())
    pixels = process(encode(noise), image_size=32)
    assert pixels.shape == (3, 32, 32) and pixels.min() >= -1.0 and pixels.max() <= 1.0
    edges = process(two_halves((0, 0, 0), (255, 255, 255), size=(6, 6)))  # bicubic overshoot is clamped
    assert edges.min() == -1.0 and edges.max() == 1.0


def test_jpeg_and_greyscale_and_cmyk_become_rgb():
    jpeg = process(solid(BLUE, fmt="JPEG"))
    assert torch.allclose(jpeg.mean(dim=(1, 2)), torch.tensor([-1.0, -1.0, 1.0]), atol=0.05)
    grey = process(solid(200, mode="L"))
    assert torch.allclose(grey, torch.full((3, 64, 64), 200 / 127.5 - 1))
    grey16 = process(solid(65535, mode="I;16"))
    assert torch.allclose(grey16, torch.ones(3, 64, 64))
    cmyk = process(solid((0, 255, 255, 0), mode="CMYK", fmt="JPEG"))  # pure red in CMYK
    assert torch.allclose(cmyk.mean(dim=(1, 2)), torch.tensor([1.0, -1.0, -1.0]), atol=0.05)


def test_transparency_is_composited_on_the_background():
    clear = solid((255, 0, 0, 0), mode="RGBA")
    assert torch.equal(process(clear), torch.ones(3, 64, 64))                          # default white
    assert torch.equal(process(clear, background=(0, 0, 0)), -torch.ones(3, 64, 64))
    half = process(solid((255, 0, 0, 128), mode="RGBA"), background=(0, 0, 255))
    assert torch.allclose(half.mean(dim=(1, 2)), torch.tensor([128, 0, 127]) / 127.5 - 1, atol=0.02)
    la = process(solid((0, 0), mode="LA"), background=(0, 255, 0))
    assert torch.equal(la[1], torch.ones(64, 64)) and torch.equal(la[0], -torch.ones(64, 64))
    palette = Image.new("P", (16, 16), 1)
    palette.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    palette.info["transparency"] = 1  # index 1 (blue) is transparent
    assert torch.equal(process(encode(palette)), torch.ones(3, 64, 64))


def test_exif_orientation_is_applied():
    plain = process(two_halves(RED, BLUE, fmt="JPEG", quality=95))
    assert plain[0, 32, 5] > 0.9 and plain[2, 32, 58] > 0.9                           # red left, blue right
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display after a 90 degree clockwise turn
    data = two_halves(RED, BLUE, fmt="JPEG", quality=95, exif=exif.tobytes())
    processed = ImageProcessor().process(ImageSource(data=data))
    assert processed.original_size == (20, 40)
    top, bottom = processed.pixels[:, 5, 32], processed.pixels[:, 58, 32]
    assert top[0] > 0.9 and top[2] < -0.9 and bottom[2] > 0.9 and bottom[0] < -0.9     # red top, blue bottom


def test_data_uri_equals_raw_bytes():
    data = two_halves(RED, BLUE)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    processor = ImageProcessor()
    from_uri, from_bytes = processor.process(ImageSource(data_uri=uri)), processor.process(ImageSource(data=data))
    assert from_uri.image_bytes == data and torch.equal(from_uri.pixels, from_bytes.pixels)


def test_byte_cap_is_checked_before_decoding():
    garbage = b"\x00" * 5000  # undecodable: the message proves the cap fired first
    message = refusal(ImageSource(data=garbage), max_image_bytes=4096)
    assert "5000 bytes" in message and "4096" in message
    uri = "data:image/png;base64," + base64.b64encode(garbage).decode()
    assert "4096" in refusal(ImageSource(data_uri=uri), max_image_bytes=4096)
    assert process(solid(RED), max_image_bytes=4096).shape == (3, 64, 64)  # a small PNG still passes


def test_pixel_cap_from_the_header_and_from_a_real_image():
    message = refusal(ImageSource(data=png_header_claiming(8000, 8000)))  # 64 MP, data is a few bytes
    assert "8000x8000" in message and "40000000" in message
    message = refusal(ImageSource(data=png_header_claiming(30000, 30000)))  # PIL's own bomb guard fires
    assert "decompression bomb" in message
    message = refusal(ImageSource(data=solid(RED, size=(100, 100))), max_image_pixels=5000)
    assert "10000 pixels" in message and "5000" in message


def test_undecodable_truncated_empty_and_animated_images_are_refused():
    assert "could not be decoded" in refusal(ImageSource(data=b"definitely not an image"))
    truncated = encode(Image.effect_noise((64, 64), 50))[:200]
    assert "could not be decoded" in refusal(ImageSource(data=truncated))
    assert "could not be decoded" in refusal(ImageSource(data=png_header_claiming(0, 5)))  # a 0x5 image
    assert "neither" in refusal(ImageSource())
    frames = [Image.new("RGB", (8, 8), color) for color in (RED, BLUE)]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    assert "2 frames" in refusal(ImageSource(data=gif.getvalue()))
    single = io.BytesIO()
    frames[0].save(single, format="GIF")
    assert process(single.getvalue()).shape == (3, 64, 64)


def test_mutated_images_are_refused_whatever_pillow_raises():
    """Pillow's format plugins fail on corrupt bytes with TypeError, IndexError, struct.error and
    more, not only OSError: every one is the client's image (INVALID_ARGUMENT), never INTERNAL."""
    import random

    from PIL import ImageDraw

    image = Image.new("RGB", (40, 30))
    ImageDraw.Draw(image).rectangle([5, 5, 20, 20], fill=RED)
    rng = random.Random(2)
    for fmt, options in [("TIFF", {"compression": "tiff_lzw"}), ("PNG", {}), ("GIF", {}), ("BMP", {}), ("WEBP", {})]:
        clean = io.BytesIO()
        image.save(clean, fmt, **options)
        for _ in range(300):
            data = bytearray(clean.getvalue())
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            try:
                ImageProcessor(ProcessorConfig()).process(ImageSource(data=bytes(data)))
            except InvalidArgument:
                pass


@pytest.mark.parametrize("uri", ["https://example.com/cat.png", "http://10.0.0.1/x.jpg", "file:///etc/passwd"])
def test_remote_urls_are_not_fetched(uri):
    assert "remote URLs are not fetched" in refusal(ImageSource(data_uri=uri))


def test_malformed_data_uris_are_refused():
    assert "data:image/" in refusal(ImageSource(data_uri="data:text/plain;base64,aGVsbG8="))
    assert "base64" in refusal(ImageSource(data_uri="data:image/png;base64,***not base64***"))


def test_image_count_cap():
    processor = ImageProcessor(ProcessorConfig(max_images=8))
    processor.check_count(8)
    with pytest.raises(InvalidArgument, match="9 images; at most 8"):
        processor.check_count(9)


def test_content_hash_covers_bytes_config_and_revision():
    red, blue = solid(RED), solid(BLUE)
    config = ProcessorConfig()
    assert content_hash(red, config, "r1") == content_hash(red, ProcessorConfig(), "r1")
    assert content_hash(red, config, "r1") != content_hash(blue, config, "r1")
    assert content_hash(red, config, "r1") != content_hash(red, config, "r2")
    assert content_hash(red, config, "r1") != content_hash(red, ProcessorConfig(background=(0, 0, 0)), "r1")
    raw = bytes(range(96))  # the same 32 RGB pixels laid out as 8x4 and as 4x8
    wide, tall = (encode(Image.frombytes("RGB", size, raw)) for size in [(8, 4), (4, 8)])
    assert content_hash(wide, config, "r1") != content_hash(tall, config, "r1")


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_image_pixels"):
        ProcessorConfig(max_image_pixels=10**10)
    with pytest.raises(ValueError, match="max_images"):
        ProcessorConfig(max_images=0)
