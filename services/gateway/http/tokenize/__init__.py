"""Tokenize and detokenize: router.py, protocol.py, serving.py."""
