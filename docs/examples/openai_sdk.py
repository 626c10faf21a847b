"""The OpenAI-compatible HTTP API through the official `openai` SDK, unchanged: models, chat (whole
and streamed), embeddings.

    python docs/examples/openai_sdk.py [--base-url http://127.0.0.1:8000/v1]

The API key is $OPENAI_API_KEY when the gateway has keys (`--api-key-file`); any text otherwise.
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("TESSERA_HTTP_URL", "http://127.0.0.1:8000") + "/v1")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))

    models = client.models.list().data
    decoder = models[0].id  # the decoder's base model comes first, then pooling models and adapters
    print("models:", ", ".join(m.id for m in models))

    reply = client.chat.completions.create(model=decoder, max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    print("chat:", reply.choices[0].message.content.strip())
    print("usage:", reply.usage.prompt_tokens, "prompt tokens,", reply.usage.completion_tokens, "completion tokens")

    stream = client.chat.completions.create(model=decoder, max_tokens=16, stream=True,
                                            messages=[{"role": "user", "content": "Name three colours."}])
    print("stream: ", end="")
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    embedder = next(m.id for m in models if m.id != decoder and getattr(m, "parent", None) is None)
    vectors = client.embeddings.create(model=embedder, input=["a cat", "a kitten"]).data
    print("embeddings:", len(vectors), "vectors of", len(vectors[0].embedding), "floats")


if __name__ == "__main__":
    main()
