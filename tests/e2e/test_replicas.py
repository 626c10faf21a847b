"""Two decoders and two poolers behind one gateway, started by `tessera up`'s code (--decoders 2
--poolers 2): balancing, conversation and adapter affinity, greedy equality, a decoder killed
mid-stream and restarted, and the gateway's health while the registry is frozen and decoders die."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import INTERNAL_TOKEN_METADATA
from services.common.server import CHANNEL_OPTIONS
from services.gateway.servicer import REPLICA_METADATA
from tessera.cli.up.launch import Cluster
from tessera.cli.up.spec import ClusterSpec
from tessera.v1 import adapters_pb2, decoder_pb2, decoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc, pooling_pb2
from tests.deploy.prom import Samples

from .conftest import free_port, internal_token, run_cli
from .test_generate import CHAT_PROMPTS, chat_request, hf_greedy
from .test_lora import peft_adapter  # noqa: F401 - the session's PEFT adapter under adapter_root

SYSTEM = ("You are a patient tutor for first-year students. Answer every question with one short, "
          "plain sentence, and never use lists.")
NUM_PORTS = 7  # five services, one more decoder, one more pooler
STREAM_TOKENS = 32


def _free_base_port() -> int:
    for attempt in range(200):
        base = 20000 + (os.getpid() * 104729 + attempt * 7 + int(time.time() * 1000)) % 30000
        sockets = []
        try:
            for offset in range(NUM_PORTS):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port range")


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, adapter_root, peft_adapter):  # noqa: F811 - the adapter exists before `up`
    # two running sequences per decoder: of 8 streams, some wait in a decoder's queue (not started)
    spec = ClusterSpec(base_port=_free_base_port(), adapter_root=adapter_root, vision=False,
                       log_dir=tmp_path_factory.mktemp("replica-logs"), num_decoders=2, num_poolers=2,
                       extra_args={"decoder": ["--max-model-len", "2048", "--max-num-seqs", "2",
                                               "--num-blocks", "512"],
                                   "adapters": ["--db", str(tmp_path_factory.mktemp("registry") / "catalog.sqlite3")]},
                       http_port=free_port())
    assert spec.target("decoder").startswith("ipv4:")
    with Cluster(spec) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def stub(replicated):
    with grpc.insecure_channel(replicated.spec.address("gateway"), options=CHANNEL_OPTIONS) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def decoder_info(cluster: Cluster, address: str) -> decoder_pb2.DecoderInfo:
    """One replica's own GetInfo, asked on its internal port with the cluster's token."""
    with grpc.insecure_channel(address) as channel:
        return decoder_pb2_grpc.DecoderStub(channel).GetInfo(
            decoder_pb2.DecoderInfoRequest(), timeout=10,
            metadata=((INTERNAL_TOKEN_METADATA, internal_token(cluster)),))


def replica_counts(stub, service: str) -> dict[str, int]:
    info = stub.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=10)
    return {r.address: r.num_requests for r in info.replicas if r.service == service}


def generate(stub, request) -> tuple[str, list[int], str]:
    """(replica address, token ids, text) of one Generate through the gateway."""
    call = stub.Generate(request, timeout=120)
    ids, text = [], []
    for response in call:
        ids.extend(response.token_ids)
        text.append(response.text)
    return dict(call.initial_metadata())[REPLICA_METADATA], ids, "".join(text)


def conversation_request(turns: list[tuple[str, str]], max_tokens: int = 6,
                         lora: str = "") -> decoder_pb2.GenerateRequest:
    return decoder_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex, lora=lora, sampling=decoder_pb2.SamplingParams(max_tokens=max_tokens),
        messages=[decoder_pb2.ChatMessage(role=role, content=[decoder_pb2.ContentPart(text=text)])
                  for role, text in turns])


def test_embed_spreads_over_both_poolers(replicated, stub):
    before = replica_counts(stub, "pooling")
    assert len(before) == 2
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: stub.Embed(pooling_pb2.EmbedRequest(inputs=[f"sentence number {i}"]),
                                                     timeout=60), range(40)))
    assert all(list(r.embeddings.shape)[0] == 1 for r in replies)
    after = replica_counts(stub, "pooling")
    served = {address: after[address] - before[address] for address in after}
    # how many each gets depends on their speeds on this machine now: the split the policy makes
    # under controlled service times is tests/gateway/test_router.py's
    assert sum(served.values()) == 40 and all(n >= 1 for n in served.values()), served


def test_conversation_turns_land_where_their_prefix_is(replicated, stub):
    def converse(c: int) -> list[str]:
        notes = " ".join(f"Sample {c}-{k} weighs {(k * 37 + c * 11) % 97} grams." for k in range(20))
        turns = [("system", SYSTEM), ("user", f"My lab notes: {notes} Which sample is the heaviest?")]
        homes = []
        for follow_up in ("Why is that so?", "Give one everyday example."):
            replica, _, text = generate(stub, conversation_request(turns))
            homes.append(replica)
            turns += [("assistant", text), ("user", follow_up)]
        homes.append(generate(stub, conversation_request(turns))[0])
        return homes

    with ThreadPoolExecutor(3) as pool:
        conversations = list(pool.map(converse, range(20)))
    later = [home == turns[0] for turns in conversations for home in turns[1:]]
    assert sum(later) >= 0.9 * len(later), conversations
    first_homes = {turns[0] for turns in conversations}
    assert len(first_homes) == 2, "first turns of concurrent conversations use both decoders"
    for address in first_homes:
        assert decoder_info(replicated, address).prefix_cache_hit_tokens > 0


def test_adapter_requests_stick_to_the_replica_holding_it(replicated, stub):
    stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="hot", path="qv-adapter"), timeout=60)
    homes = {generate(stub, conversation_request([("user", f"Adapter question {i}: name a colour.")], 4,
                                                 lora="hot"))[0] for i in range(6)}
    assert len(homes) == 1, homes
    [home] = homes
    for spec_name in replicated.spec.replicas("decoder"):
        address = replicated.spec.address(spec_name)
        assert ("hot" in decoder_info(replicated, address).resident_adapters) == (address == home)
    info = stub.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=10)
    [listed] = [r for r in info.replicas if r.address == home]
    assert "hot" in listed.decoder.resident_adapters and listed.ready
    # `tessera info` ends with one line per replica: health, queue, KV usage, resident adapters
    result = run_cli(replicated.spec.address("gateway"), "info")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[1]: line for line in result.stdout.splitlines()
            if line.startswith(("decoder ", "pooling "))}
    assert len(rows) == 4 and all("SERVING" in row for row in rows.values())
    assert rows[home].rstrip().endswith("hot")


def test_greedy_through_two_replicas_equals_transformers(replicated, stub, hf_decoder):
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: generate(stub, chat_request(p, 16)), CHAT_PROMPTS * 2))
    assert len({replica for replica, _, _ in results}) == 2
    for prompt, (_, ids, _) in zip(CHAT_PROMPTS * 2, results):
        assert ids == hf_greedy(hf_decoder, prompt, 16)


def test_killed_decoder_fails_fast_retries_and_rejoins(replicated, stub):
    spec = replicated.spec
    outcomes: dict[int, dict] = {}
    first_token = threading.Event()

    def stream(i: int) -> None:
        outcome = outcomes[i] = {"tokens": 0, "replica": None, "error": None, "ended": None}
        try:
            request = chat_request(f"Tell me a long story about lighthouse keeper number {i}.", STREAM_TOKENS,
                                   ignore_eos=True)
            call = stub.Generate(request, timeout=300)
            for response in call:
                if not outcome["tokens"]:
                    outcome["replica"] = dict(call.initial_metadata())[REPLICA_METADATA]
                    first_token.set()
                outcome["tokens"] += len(response.token_ids)
        except grpc.RpcError as error:
            outcome["error"] = error
        outcome["ended"] = time.monotonic()

    counts_before = sum(replica_counts(stub, "decoder").values())
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    assert first_token.wait(60)
    time.sleep(0.3)
    victim_address = next(o["replica"] for o in outcomes.values() if o["replica"])
    [victim] = [name for name in spec.replicas("decoder") if spec.address(name) == victim_address]
    started_there = [i for i, o in outcomes.items() if o["replica"] == victim_address]
    os.kill(replicated.processes[victim].pid, signal.SIGKILL)
    replicated.processes[victim].wait(30)  # reaped: the kernel has closed its sockets
    killed_at = time.monotonic()
    # a new request right away succeeds on the other replica
    replica, ids, _ = generate(stub, chat_request(CHAT_PROMPTS[0], 4))
    assert replica != victim_address and len(ids) == 4
    for thread in threads:
        thread.join(300)
    failed = {i: o for i, o in outcomes.items() if o["error"] is not None}
    assert set(started_there) <= set(failed)
    for outcome in failed.values():  # only streams already streaming from the victim fail, and fast
        assert outcome["replica"] == victim_address and outcome["tokens"] > 0, outcome
        assert outcome["error"].code() == grpc.StatusCode.UNAVAILABLE, outcome
        assert victim_address in outcome["error"].details()
        assert outcome["ended"] - killed_at < 1.0, outcome
    # every other stream, those waiting in the victim's queue included, completes on the survivor
    completed = [o for i, o in outcomes.items() if i not in failed]
    assert len(failed) <= 2 < 8 - len(failed) == len(completed)
    assert all(o["tokens"] == STREAM_TOKENS and o["replica"] != victim_address for o in completed), outcomes
    counts = replica_counts(stub, "decoder")
    assert sum(counts.values()) - counts_before >= 8 + 1 + 1  # the 8 streams, the retries, the new request

    replicated.restart(victim)
    deadline = time.monotonic() + 20
    served = set()
    for attempt in range(1000):
        if victim_address in served or time.monotonic() > deadline:
            break
        served.add(generate(stub, chat_request(f"Name a river, please ({attempt}).", 2))[0])
    assert victim_address in served, "the restarted replica serves again without any other step"
    with grpc.insecure_channel(victim_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _health(spec: ClusterSpec, path: str = "/health") -> tuple[int, dict]:
    response = requests.get(f"http://{spec.host}:{spec.http_port}{path}", timeout=30)
    return response.status_code, response.json()


def _health_until(spec: ClusterSpec, done, what: str, timeout_s: float = 30.0) -> tuple[int, dict]:
    """/health's (status, body) once `done(status, body)`; fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = _health(spec)
        if done(status, body):
            return status, body
        assert time.monotonic() < deadline, f"/health not {what} within {timeout_s} s: {status} {body}"
        time.sleep(0.25)


def _gateway_health(spec: ClusterSpec, service: str) -> int:
    with grpc.insecure_channel(spec.address("gateway")) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def test_health_stays_200_with_the_registry_frozen(replicated, stub):
    """A frozen registry costs adapter loads, not chat or embeddings: /health 200, naming it."""
    spec = replicated.spec
    registry = replicated.processes["adapters"]
    registry.send_signal(signal.SIGSTOP)
    try:
        status, body = _health_until(spec, lambda _, b: any(p.startswith("adapters:") for p in b["not_serving"]),
                                     "naming the frozen registry")
        assert (status, body["status"], body["serving"]) == (200, "degraded", {"generate": True, "embed": True}), body
        assert spec.address("adapters") in body["not_serving"][0]
        assert _health(spec, "/health/generate")[0] == _health(spec, "/health/embed")[0] == 200
        assert _gateway_health(spec, "tessera.v1.Gateway/ready") == health_pb2.HealthCheckResponse.SERVING
        assert len(generate(stub, chat_request(CHAT_PROMPTS[0], 2))[1]) == 2  # chat on the base model still answers
    finally:
        registry.send_signal(signal.SIGCONT)
    _health_until(spec, lambda s, b: b["status"] == "ok", "ok again after SIGCONT")


def test_health_names_a_dead_decoder_and_is_503_with_none_left(replicated):
    """One of two decoders killed: 200, `degraded` names it; both: 503 (this deployment's core is
    generation), while /health/embed stays 200 and the gateway's own health SERVING (no restart).
    The decoders are restarted afterwards."""
    spec = replicated.spec
    first, second = spec.replicas("decoder")
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        replicated.processes[second].kill()
        replicated.processes[second].wait(30)
        status, body = _health_until(spec, lambda _, b: b["degraded"], "naming the dead decoder")
        assert (status, body["status"]) == (200, "degraded"), body
        assert [d.split(": ")[0] for d in body["degraded"]] == [f"decoder replica {spec.address(second)}"], body
        assert not any(p.startswith("decoder") for p in body["not_serving"]), body
        # the API port's /metrics relays the survivor's vLLM series; the dead one is skipped and counted
        scrape = Samples.parse(requests.get(f"http://{spec.host}:{spec.http_port}/metrics", timeout=30).text)
        assert {labels["replica"] for labels in scrape.labels("vllm:num_requests_running")} == {spec.address(first)}
        assert scrape.get("tessera_gateway_replica_metrics_up", replica=spec.address(first)) == 1
        assert scrape.get("tessera_gateway_replica_metrics_up", replica=spec.address(second)) == 0
        assert scrape.get("tessera_gateway_replica_metrics_skipped_total", replica=spec.address(second)) >= 1
        replicated.processes[first].kill()
        replicated.processes[first].wait(30)
        status, body = _health_until(spec, lambda s, _: s == 503, "503 with no decoder left")
        assert body["status"] == "unavailable" and body["serving"] == {"generate": False, "embed": True}, body
        assert any(p.startswith("decoder: ") for p in body["not_serving"]), body
        assert _health(spec, "/health/generate")[0] == 503
        assert _health(spec, "/health/embed")[0] == 200
        assert _health(spec, "/health/live")[0] == 200
        deadline = time.monotonic() + 10  # the gRPC statuses follow the replica channels every 0.5 s
        while _gateway_health(spec, "tessera.v1.Gateway/generate") != NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [_gateway_health(spec, name) for name in ("tessera.v1.Gateway/generate", "tessera.v1.Gateway/ready",
                                                          "tessera.v1.Gateway/embed", "tessera.v1.Gateway", "")] == \
            [NOT_SERVING, NOT_SERVING, SERVING, SERVING, SERVING]
    finally:
        for name in (first, second):
            if replicated.processes[name].poll() is not None:
                replicated.restart(name)
    _health_until(spec, lambda s, b: s == 200 and not b["degraded"], "back to both decoders")
