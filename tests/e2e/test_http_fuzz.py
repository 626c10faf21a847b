"""Schema-driven fuzz of the HTTP API: schemathesis generates requests from the gateway's own
/openapi.json (valid and invalid bodies); no generated input may get a 5xx."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation.modes import GenerationMode

MAX_EXAMPLES = 6           # per operation and mode: the whole run stays near half a minute
MAX_GENERATED_TOKENS = 2   # generation is the slow part on CPU: every sampled request stays short
MAX_CHOICES = 2


def _bound_generation(body) -> None:
    """Shorten what a generated body would have the decoder produce (its validity is untouched:
    a bad value stays bad, a good one stays good)."""
    if not isinstance(body, dict) or "messages" not in body and "prompt" not in body:
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_GENERATED_TOKENS:
            body[key] = MAX_GENERATED_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_GENERATED_TOKENS
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > MAX_CHOICES:
        body["n"] = MAX_CHOICES


def _operations(http_url: str):
    schema = schemathesis.openapi.from_url(f"{http_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx(http_url, mode):
    operations = _operations(http_url)
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize"}
    session = requests.Session()
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and not operation.body:
            continue  # nothing to make invalid (GET /health, /v1/models)

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def no_5xx(case):
            _bound_generation(case.body)
            response = case.call(base_url=http_url, session=session, timeout=120)
            assert response.status_code < 500, (f"{case.method} {case.path} {str(case.body)[:500]} -> "
                                                 f"{response.status_code} {response.text[:500]}")
            if response.status_code >= 400 and response.headers.get("content-type") == "application/json":
                assert set(response.json()["error"]) >= {"message", "type", "param", "code"}, response.text[:500]

        no_5xx()
