"""Models, adapters, health and version: router.py, protocol.py, serving.py."""
