"""`tessera bench NAME [ARGS...]`: run `bench/NAME.py` from the source tree.

Benchmarks live in `bench/` (one file per benchmark, each with `main(argv) -> int`); they print
the anchor measured in the same run beside ours and rewrite their results file under
`bench/results/`. They are never test assertions.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def run(name: str, argv: list[str]) -> int:
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(available()) or 'none'}")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main(argv) or 0)
