"""Chat about an image: a PNG drawn here with pillow, sent with a question, the answer streamed.

    python docs/examples/chat_image.py [--address localhost:50051]

The default vision encoder has seeded random weights (README, Models): the answer shows the
image reaching the decoder (its rows count in `usage.image_tokens`), not image understanding;
a Qwen2-VL checkpoint (`tessera up --decoder-model-dir DIR`) answers about the picture.
"""

from __future__ import annotations

import argparse
import io
import os

from PIL import Image, ImageDraw

from tessera.client import Client, Message


def picture() -> bytes:
    """A 96x96 PNG: a red circle on white."""
    image = Image.new("RGB", (96, 96), "white")
    ImageDraw.Draw(image).ellipse((16, 16, 80, 80), fill="red")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("TESSERA_ADDRESS", "localhost:50051"))
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    with Client(args.address, timeout=120) as client:
        stream = client.chat_stream([Message("user", [picture(), "What shape is in this picture?"])],
                                    max_tokens=args.max_tokens)
        for delta in stream:
            print(delta.text, end="", flush=True)
        result = stream.result
        print()
        print(f"finish_reason={result.finish_reason} prompt_tokens={result.usage.prompt_tokens} "
              f"image_tokens={result.usage.image_tokens} completion_tokens={result.usage.completion_tokens}")


if __name__ == "__main__":
    main()
