"""Retrieval with embed + rerank: embed a small corpus, take the nearest documents to a question,
rerank them, and answer from the best one.

    python docs/examples/retrieval.py [--address localhost:50051] [--question "..."]
"""

from __future__ import annotations

import argparse
import os

from tessera.client import Client

CORPUS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889.",
    "Bananas are rich in potassium and grow in tropical climates.",
    "The Great Wall of China stretches for thousands of kilometres across northern China.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "Mount Everest, on the border of Nepal and China, is the highest mountain above sea level.",
    "A paged KV cache stores attention keys and values in fixed-size blocks.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("TESSERA_ADDRESS", "localhost:50051"))
    parser.add_argument("--question", default="When was the Eiffel Tower built?")
    parser.add_argument("--candidates", type=int, default=3, help="documents kept by the embedding search")
    args = parser.parse_args()
    with Client(args.address, timeout=120) as client:
        # 1. Embedding search: unit-length vectors, so the dot product is the cosine.
        corpus = client.embed(CORPUS).embeddings            # [len(CORPUS), dim] float32
        query = client.embed(args.question).embeddings[0]   # [dim]
        nearest = (corpus @ query).argsort()[::-1][:args.candidates]
        candidates = [CORPUS[i] for i in nearest]
        # 2. Rerank the candidates against the question (a cross-encoder when one is configured).
        ranked = client.rerank(args.question, candidates, return_documents=True)
        print(f"rerank method: {ranked.method}")
        for item in ranked.results:
            print(f"{item.score:+.3f}  {candidates[item.index]}")
        best = candidates[ranked.results[0].index]
        # 3. Answer from the best document.
        answer = client.chat([{"role": "system", "content": f"Answer from this text: {best}"},
                              {"role": "user", "content": args.question}], max_tokens=16)
        print(f"top: {best}")
        print(f"answer: {answer.text.strip()}")


if __name__ == "__main__":
    main()
