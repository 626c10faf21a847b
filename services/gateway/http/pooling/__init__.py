"""Embeddings, rerank and score: router.py, protocol.py, serving.py."""
