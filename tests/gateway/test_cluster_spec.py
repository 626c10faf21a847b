"""`tessera up --decoders N --poolers M`: replica ports, the gateway's targets, CPU threads per replica."""

import pytest

from services.gateway.replicas import parse_target
from tessera.cli.up.spec import ClusterSpec


def test_replicas_get_their_own_ports_and_the_gateway_an_ipv4_list():
    spec = ClusterSpec(base_port=40000, num_decoders=3, num_poolers=2, vision=False)
    assert spec.services() == ["adapters", "pooling", "pooling-2", "decoder", "decoder-2", "decoder-3", "gateway"]
    ports = {name: int(spec.address(name).rpartition(":")[2]) for name in spec.services()}
    # the first replica keeps the usual port; the others follow the five, decoders first
    assert ports == {"gateway": 40000, "decoder": 40002, "pooling": 40003, "adapters": 40004,
                     "decoder-2": 40005, "decoder-3": 40006, "pooling-2": 40007}
    command = spec.command("gateway")
    decoder_target = command[command.index("--decoder") + 1]
    assert parse_target(decoder_target).addresses == tuple(spec.address(r) for r in spec.replicas("decoder"))
    assert command[command.index("--pooling") + 1] == "ipv4:127.0.0.1:40003,127.0.0.1:40007"
    assert spec.command("decoder-3")[spec.command("decoder-3").index("--address") + 1] == "127.0.0.1:40006"


def test_one_replica_each_is_the_plain_topology():
    spec = ClusterSpec(base_port=40000)
    command = spec.command("gateway")
    assert command[command.index("--decoder") + 1] == "127.0.0.1:40002"
    assert spec.environment("decoder") == {}


def test_replicas_split_the_cpus(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    spec = ClusterSpec(num_decoders=4, num_poolers=2)
    assert spec.environment("decoder-2") == {"OMP_NUM_THREADS": "2"}
    assert spec.environment("pooling") == {"OMP_NUM_THREADS": "4"}
    assert spec.environment("gateway") == {}


@pytest.mark.parametrize("kwargs,match", [({"num_decoders": 0}, "num_decoders"),
                                          ({"num_poolers": 2, "host": "localhost"}, "IP address"),
                                          ({"num_decoders": 3, "base_port": 65530}, "room for 7 ports")])
def test_bad_replica_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(**kwargs)
