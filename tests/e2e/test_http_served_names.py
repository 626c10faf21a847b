"""`--served-model-name NAME [ALIAS ...]` over HTTP (vLLM's flag), on a cluster of its own (the
session's serves the models under their directories' names): /v1/models lists the first name,
every alias is accepted as `model` and answered under the first name, the directory's name is 404."""

from __future__ import annotations

import openai
import pytest
import requests

from tessera.cli.up.launch import Cluster
from tessera.cli.up.spec import ClusterSpec
from tessera.paths import default_decoder_dir, default_embedding_dir

from .conftest import _free_base_port, free_port

NAME, ALIAS = "a", "b"
EMBEDDER, EMBEDDER_ALIAS = "emb", "emb-alias"


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    """A text-only cluster whose decoder serves as `a` (alias `b`) and pooler as `emb` (alias `emb-alias`)."""
    spec = ClusterSpec(base_port=_free_base_port(), adapter_root=tmp_path_factory.mktemp("named-adapters"),
                       log_dir=tmp_path_factory.mktemp("named-logs"), vision=False, http_port=free_port(),
                       served_model_name=(NAME, ALIAS), embedding_served_model_name=(EMBEDDER, EMBEDDER_ALIAS),
                       extra_args={"adapters": ["--db", str(tmp_path_factory.mktemp("named-db") / "catalog.sqlite3")],
                                   "decoder": ["--max-model-len", "512"]})
    with Cluster(spec):
        yield f"http://{spec.host}:{spec.http_port}"


def test_served_names_and_aliases(named):
    with openai.OpenAI(base_url=f"{named}/v1", api_key="unused", max_retries=0, timeout=300) as sdk:
        ids = [m.id for m in sdk.models.list().data]
        assert NAME in ids and EMBEDDER in ids
        assert not {ALIAS, EMBEDDER_ALIAS, default_decoder_dir().name, default_embedding_dir().name} & set(ids)
        messages = [{"role": "user", "content": "hi"}]
        reply = sdk.chat.completions.create(model=ALIAS, messages=messages, max_tokens=2, temperature=0)
        assert reply.model == NAME and reply.choices[0].message.content is not None
        assert sdk.completions.create(model=NAME, prompt="1, 2,", max_tokens=2).model == NAME
        with pytest.raises(openai.NotFoundError) as unknown:
            sdk.chat.completions.create(model=default_decoder_dir().name, messages=messages, max_tokens=2)
        assert unknown.value.body["param"] == "model"
        embedded = sdk.embeddings.create(model=EMBEDDER_ALIAS, input="a cat", encoding_format="float")
        assert embedded.model == EMBEDDER and len(embedded.data[0].embedding) == 384
    tokenized = requests.post(f"{named}/tokenize", json={"model": ALIAS, "prompt": "hello"}, timeout=60).json()
    assert tokenized["model"] == NAME and tokenized["max_model_len"] == 512
