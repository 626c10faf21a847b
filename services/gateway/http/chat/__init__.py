"""Chat and text completions: router.py (routes), protocol.py (bodies, answers), serving.py (bodies -> Generate), generate.py (whole and streamed answers), logprobs.py."""
