"""text-embeddings-inference's native routes: router.py, protocol.py, serving.py."""
