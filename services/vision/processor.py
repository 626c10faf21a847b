"""Image processor: client bytes -> normalized RGB pixels for the demo or the Qwen2-VL encoder.

Every cap is checked before the expensive step it protects:

    request  --count cap-->  per image: compressed-byte cap  --(decode base64)-->  byte cap again
             --PIL header (size is lazy)-->  pixel cap, frame count
             (every image's header first: the request's pixel and token budgets, see engine.py)
             --load()-->  EXIF orientation
             --> RGB (alpha composited on the background)  --> bicubic resize S x S  --> [-1, 1]

Remote URLs are never fetched (ARCHITECTURE invariant 6): only raw bytes or a base64
`data:image/<fmt>;base64,` URI are accepted. Pixels are float32 [3, S, S], channels RGB,
value = byte / 127.5 - 1, the SigLIP/"mean 0.5, std 0.5" normalization.

With `ProcessorConfig.qwen2_vl` set, the last two steps are Qwen2-VL's instead (see
`qwen2_vl_pixels`): smart_resize to multiples of 28 within min/max pixels, bicubic, rescale
1/255, CLIP mean/std -> float32 [3, H, W]; images smaller than one patch or with an aspect ratio
past 200 are refused from the header, before decoding.

EXIF orientation: the pixels are the image as a viewer shows it (`ImageOps.exif_transpose`),
so a phone photo stored sideways with Orientation=6 reaches the encoder upright. The content
hash is over the stored bytes, which include the EXIF tag.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch
from PIL import Image, ImageColor, ImageOps, UnidentifiedImageError

from services.common.errors import InvalidArgument, TesseraError
from services.common.message_limits import DEFAULT_MAX_IMAGE_BYTES
from services.vision import qwen2_vl_pixels
from services.vision.qwen2_vl_pixels import Qwen2VLPixelConfig

_DATA_URI = re.compile(r"data:image/([A-Za-z0-9.+-]+);base64,", re.ASCII)
_REMOTE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def parse_color(value: str) -> tuple[int, int, int]:
    """Parse "white", "#RRGGBB" or "R,G,B" into (r, g, b) in 0..255. Raises ValueError naming the value."""
    parts = value.split(",")
    try:
        if len(parts) == 3:
            rgb = tuple(int(p) for p in parts)
        else:
            rgb = ImageColor.getrgb(value)[:3]
    except ValueError as error:
        raise ValueError(f"background must be a colour name, #RRGGBB or R,G,B, got {value!r}") from error
    if any(not 0 <= c <= 255 for c in rgb):
        raise ValueError(f"background channels must be in 0..255, got {value!r}")
    return rgb  # type: ignore[return-value]


@dataclass(frozen=True)
class ProcessorConfig:
    """Preprocessing recipe and input caps. Every field is part of the content hash."""

    image_size: int = 64
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # compressed bytes, after base64 decoding
    max_image_pixels: int = 40_000_000         # width * height from the header
    max_images: int = 8                        # per request
    max_request_pixels: int = 80_000_000       # width * height over a request's images that need decoding
    background: tuple[int, int, int] = (255, 255, 255)  # RGB under transparent pixels
    qwen2_vl: Qwen2VLPixelConfig | None = None  # None: fixed image_size, [-1, 1]; set: Qwen2-VL's recipe

    def __post_init__(self) -> None:
        if not 1 <= self.image_size <= 4096:
            raise ValueError(f"image_size must be in 1..4096, got {self.image_size}")
        if self.max_image_bytes < 1:
            raise ValueError(f"max_image_bytes must be >= 1, got {self.max_image_bytes}")
        # PIL refuses images past 2 * MAX_IMAGE_PIXELS on its own; a larger cap could never be honoured.
        pil_limit = Image.MAX_IMAGE_PIXELS or 2**62  # None when a host disabled PIL's guard
        if not 1 <= self.max_image_pixels <= pil_limit:
            raise ValueError(f"max_image_pixels must be in 1..{pil_limit} (PIL's bomb limit), "
                             f"got {self.max_image_pixels}")
        if self.max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {self.max_images}")
        if self.max_request_pixels < self.max_image_pixels:
            raise ValueError(f"max_request_pixels ({self.max_request_pixels}) must hold one image of "
                             f"max_image_pixels ({self.max_image_pixels})")
        if len(self.background) != 3 or any(not 0 <= int(c) <= 255 for c in self.background):
            raise ValueError(f"background must be 3 channels in 0..255, got {self.background}")

    def fingerprint(self) -> bytes:
        """Canonical bytes of the recipe, for content hashes."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ImageSource:
    """One client image: exactly one of raw encoded bytes or a data URI string."""

    data: bytes | None = None
    data_uri: str | None = None


@dataclass(frozen=True)
class ProcessedImage:
    """`image_bytes` are the encoded bytes the pixels came from (the content-hash input)."""

    image_bytes: bytes
    pixels: torch.Tensor       # [3, S, S] float32 in [-1, 1]; Qwen2-VL: [3, H, W] CLIP-normalized
    original_size: tuple[int, int]  # (width, height) after EXIF orientation


class ImageProcessor:
    """Turns `ImageSource`s into `ProcessedImage`s; every refusal is `InvalidArgument` with its reason."""

    def __init__(self, config: ProcessorConfig | None = None) -> None:
        self.config = config or ProcessorConfig()

    def check_count(self, num_images: int) -> None:
        """Raises InvalidArgument when a request carries more images than `max_images`."""
        if num_images > self.config.max_images:
            raise InvalidArgument(f"request has {num_images} images; at most {self.config.max_images} are allowed "
                                  "(--max-images)")

    def image_bytes(self, source: ImageSource) -> bytes:
        """The encoded bytes of `source`, byte cap checked before any base64 decoding."""
        cap = self.config.max_image_bytes
        if source.data is not None:
            if len(source.data) > cap:
                raise InvalidArgument(f"image has {len(source.data)} bytes; the limit is {cap}")
            return bytes(source.data)
        uri = (source.data_uri or "").strip()
        if not uri:
            raise InvalidArgument("image has neither bytes nor a data URI")
        if _REMOTE.match(uri):
            raise InvalidArgument("remote URLs are not fetched; send the image bytes or a data:image/...;base64, URI")
        match = _DATA_URI.match(uri)
        if match is None:
            raise InvalidArgument(f"image URI must start with data:image/<format>;base64, got {uri[:40]!r}")
        payload = uri[match.end():]
        if len(payload) // 4 * 3 > cap:  # decoded size, known before decoding
            raise InvalidArgument(f"image data URI decodes to about {len(payload) // 4 * 3} bytes; the limit is {cap}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise InvalidArgument(f"image data URI is not valid base64: {error}") from error
        if len(data) > cap:
            raise InvalidArgument(f"image has {len(data)} bytes; the limit is {cap}")
        return data

    def header_size(self, data: bytes) -> tuple[int, int]:
        """(width, height) read from the header (nothing decoded), after the pixel, frame and
        Qwen2-VL patch / aspect checks. Raises InvalidArgument."""
        return self._open_checked(data).size

    def check_request_pixels(self, sizes: list[tuple[int, int]]) -> None:
        """Raises InvalidArgument when images of these (width, height) pass max_request_pixels together."""
        total = sum(w * h for w, h in sizes)
        if total > self.config.max_request_pixels:
            shown = ", ".join(f"{w}x{h}" for w, h in sizes[:8]) + (", ..." if len(sizes) > 8 else "")
            raise InvalidArgument(f"images hold {total} pixels together ({shown}); the limit is "
                                  f"{self.config.max_request_pixels} per request (--max-request-pixels)")

    def process(self, source: ImageSource) -> ProcessedImage:
        """Decode, check, orient, convert and normalize one image. Raises InvalidArgument."""
        data = self.image_bytes(source)
        image = self._open_checked(data)
        with self._decoding(data):
            image.load()
            image = ImageOps.exif_transpose(image)
            rgb = to_rgb(image, self.config.background)
        if self.config.qwen2_vl is not None:
            pixels = qwen2_vl_pixels.normalize(rgb, self.config.qwen2_vl)  # [3, H, W]
            return ProcessedImage(image_bytes=data, pixels=pixels, original_size=rgb.size)
        size = self.config.image_size
        resized = rgb.resize((size, size), Image.Resampling.BICUBIC)
        array = np.asarray(resized, dtype=np.float32) / 127.5 - 1.0   # [S, S, 3]
        pixels = torch.from_numpy(array).permute(2, 0, 1).contiguous()  # [3, S, S]
        return ProcessedImage(image_bytes=data, pixels=pixels, original_size=rgb.size)

    def _open_checked(self, data: bytes) -> Image.Image:
        """Open lazily (header only) and apply the pixel and frame checks before any pixel is decoded."""
        with self._decoding(data):
            image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width < 1 or height < 1:
            raise InvalidArgument(f"image is {width}x{height}; it must be at least 1x1")
        if width * height > self.config.max_image_pixels:
            raise InvalidArgument(f"image is {width}x{height} = {width * height} pixels; "
                                  f"the limit is {self.config.max_image_pixels}")
        if self.config.qwen2_vl is not None:  # one-patch minimum and aspect ratio, before decoding
            qwen2_vl_pixels.check_source_size(width, height, self.config.qwen2_vl)
        with self._decoding(data):
            num_frames = getattr(image, "n_frames", 1)  # some formats parse further to count frames
        if num_frames > 1:
            raise InvalidArgument(f"animated images are not accepted; this one has {num_frames} frames")
        return image


    @contextmanager
    def _decoding(self, data: bytes):
        """Pillow's decoders on untrusted bytes: every failure is the client's image, INVALID_ARGUMENT.

        Corrupt streams surface as OSError, ValueError and SyntaxError, but also as TypeError,
        IndexError, struct.error and others depending on the format's plugin (a mutated TIFF raises
        TypeError "Missing dimensions"), so anything but our own errors maps to "could not be decoded".
        """
        try:
            yield
        except TesseraError:
            raise
        except Image.DecompressionBombError as error:
            raise InvalidArgument(f"image refused as a decompression bomb: {error}; "
                                  f"the limit is {self.config.max_image_pixels} pixels") from error
        except UnidentifiedImageError as error:
            raise InvalidArgument(f"image could not be decoded ({len(data)} bytes): "
                                  "not a recognized image format") from error
        except Exception as error:  # see the docstring
            raise InvalidArgument(f"image could not be decoded ({len(data)} bytes): "
                                  f"{type(error).__name__}: {error}") from error


def to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Any PIL mode -> RGB. Transparency (RGBA, LA, PA, P/L/RGB with tRNS) is composited on `background`;
    16-bit greyscale is scaled to 8 bits rather than clipped; CMYK uses PIL's conversion."""
    if image.mode.startswith("I;16") and not image.has_transparency_data:
        grey = np.asarray(image, dtype=np.float64)  # [H, W] in 0..65535
        image = Image.fromarray((grey / 257.0 + 0.5).astype(np.uint8))  # mode L
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*background, 255))
        canvas.alpha_composite(rgba)
        return canvas.convert("RGB")
    return image.convert("RGB")


def content_hash(image_bytes: bytes, config: ProcessorConfig, encoder_revision: str) -> str:
    """sha256 hex over the encoded image bytes, the preprocessing recipe and the encoder revision.

    Fields are length-prefixed so no two different triples share a preimage. The caller cannot
    choose this value; the decoder salts KV block hashes with it (ARCHITECTURE invariant 2).
    """
    digest = hashlib.sha256(b"services.vision.content.v1")
    for field in (image_bytes, config.fingerprint(), encoder_revision.encode()):
        digest.update(len(field).to_bytes(8, "little"))
        digest.update(field)
    return digest.hexdigest()
