"""`tessera up` gives every process a Prometheus port of its own and lists them for `tessera info`."""

from __future__ import annotations

from tessera.cli.endpoints import metrics_table
from tessera.cli.up.launch import write_endpoints
from tessera.cli.up.spec import METRICS_PORT_OFFSET, ClusterSpec
from tessera.paths import HOME_ENV, default_decoder_dir, default_embedding_dir


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_every_process_gets_a_distinct_metrics_port_beside_its_grpc_port(tmp_path):
    spec = ClusterSpec(base_port=40000, num_decoders=3, num_poolers=2, log_dir=tmp_path)
    ports = {name: int(_flag(spec.command(name), "--metrics-port")) for name in spec.services()}
    grpc_ports = {int(spec.address(name).rpartition(":")[2]) for name in spec.services()}
    assert len(set(ports.values())) == len(ports) == 8  # five services, two more decoders, one more pooler
    assert not set(ports.values()) & grpc_ports
    assert ports["decoder-3"] == int(spec.address("decoder-3").rpartition(":")[2]) + METRICS_PORT_OFFSET
    assert spec.metrics_url("pooling-2") == f"http://127.0.0.1:{ports['pooling-2']}/metrics"
    # a flag the caller passes for the service comes later on the command line, so it wins
    spec = ClusterSpec(base_port=40000, extra_args={"decoder": ["--metrics-port", "0"]})
    assert spec.command("decoder")[-2:] == ["--metrics-port", "0"]


def test_info_lists_the_metrics_urls_of_the_cluster_up_started(tmp_path):
    spec = ClusterSpec(base_port=40000, num_decoders=2, vision=False, log_dir=tmp_path)
    write_endpoints(spec)
    table = metrics_table(spec.address("gateway"), tmp_path).splitlines()
    assert [line.split()[1:] for line in table] == [[name, spec.metrics_url(name)] for name in spec.services()]
    assert metrics_table("127.0.0.1:1", tmp_path) == ""  # another gateway: this machine's `up` says nothing of it
    assert metrics_table(spec.address("gateway"), tmp_path / "none") == ""


def test_info_finds_a_cluster_started_with_a_name(tmp_path, monkeypatch):
    """`up --cluster NAME` writes under $TESSERA_HOME/clusters/NAME, not under the gateway's port."""
    models = {"decoder_model_dir": default_decoder_dir(), "embedding_model_dir": default_embedding_dir()}
    monkeypatch.setenv(HOME_ENV, str(tmp_path))
    spec = ClusterSpec(base_port=40000, cluster="staging", vision=False, http_port=48000, **models)
    assert spec.log_dir == tmp_path / "clusters" / "staging" / "logs"
    spec.log_dir.mkdir(parents=True)
    write_endpoints(spec)
    table = metrics_table(spec.address("gateway")).splitlines()
    assert [line.split()[1:] for line in table[:-1]] == [[name, spec.metrics_url(name)] for name in spec.services()]
    assert table[-1].split()[1:4] == ["http", "api", "http://127.0.0.1:48000/metrics"]
    assert metrics_table("127.0.0.1:1") == ""
