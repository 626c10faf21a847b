"""Real encoded images for the vision tests, made with PIL (no fixtures on disk)."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def solid(color, size=(40, 30), mode="RGB", fmt="PNG") -> bytes:
    return encode(Image.new(mode, size, color), fmt)


def two_halves(left, right, size=(40, 20), fmt="PNG", **params) -> bytes:
    """Left half `left`, right half `right` (RGB)."""
    image = Image.new("RGB", size, left)
    image.paste(Image.new("RGB", (size[0] // 2, size[1]), right), (size[0] // 2, 0))
    return encode(image, fmt, **params)


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims width x height (8-bit RGB) but whose data is a few bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 16))
            + _chunk(b"IEND", b""))
