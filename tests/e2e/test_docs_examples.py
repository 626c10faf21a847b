"""The user guide's worked examples (docs/examples/) run against the session's cluster and print
sane output: each script is run as a user would, as a subprocess given the cluster's addresses."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from services.common.launch import REPO
from tessera.paths import default_decoder_dir

EXAMPLES = REPO / "docs" / "examples"


def run_example(name: str, *args: str, timeout: float = 300) -> str:
    # This checkout's tessera package, as an installed one would be for a user.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=REPO, capture_output=True,
                            text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    return result.stdout


def test_chat_image_example(gateway_address):
    out = run_example("chat_image.py", "--address", gateway_address)
    usage = re.search(r"finish_reason=(\w+) prompt_tokens=(\d+) image_tokens=(\d+) completion_tokens=(\d+)", out)
    assert usage, out
    assert usage[1] in ("stop", "length") and int(usage[3]) > 0 and int(usage[2]) > int(usage[3])
    assert 0 < int(usage[4]) <= 16 and out.split("\nfinish_reason=")[0].strip(), out


def test_retrieval_example_ranks_the_relevant_document_first(gateway_address):
    out = run_example("retrieval.py", "--address", gateway_address)
    assert "top: The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889." in out, out
    scores = [float(s) for s in re.findall(r"^([+-]\d\.\d{3})  ", out, re.MULTILINE)]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True), out
    assert re.search(r"^answer: \S", out, re.MULTILINE), out


def test_three_adapters_example(gateway_address, adapter_root):
    out = run_example("three_adapters.py", "--address", gateway_address, "--adapter-root", str(adapter_root),
                      "--base-model-dir", str(default_decoder_dir()))
    for name in ("pirate", "poet", "terse"):
        assert re.search(rf"^loaded {name}: rank 4 on 60 modules, ", out, re.MULTILINE), out
    answers = dict(re.findall(r"^(base|pirate|poet|terse): '(.*)'$", out, re.MULTILINE))
    assert set(answers) == {"base", "pirate", "poet", "terse"} and all(answers.values()), out
    for name in ("pirate", "poet", "terse"):  # random adapters: each one's answer is its own
        assert answers[name] != answers["base"], answers


def test_openai_sdk_example(http_url):
    out = run_example("openai_sdk.py", "--base-url", f"{http_url}/v1")
    assert re.search(r"^chat: \S", out, re.MULTILINE) and re.search(r"^stream: \S", out, re.MULTILINE), out
    assert re.search(r"^embeddings: 2 vectors of 384 floats$", out, re.MULTILINE), out
