"""The generated stubs in tessera/v1 must be what grpcio-tools makes from protos/ today."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *map(str, protos)], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*") if p.is_file())
    assert generated
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated from protos/ but not committed; run `make proto`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} is stale; run `make proto`"
    committed_stubs = {p.relative_to(ROOT) for p in (ROOT / "tessera").rglob("*_pb2*.py*")}
    assert committed_stubs == {r for r in generated if "_pb2" in r.name}, "stubs without a .proto; remove them"
