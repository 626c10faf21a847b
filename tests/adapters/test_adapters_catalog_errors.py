"""A failing SQLite catalog answers what failed, as the registry's domain errors: a full database or
disk RESOURCE_EXHAUSTED (CATALOG_FULL, HTTP 507), a write the disk refuses UNAVAILABLE
(CATALOG_UNAVAILABLE, 503), each in SQLite's own words; never INTERNAL "OperationalError"."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from services.adapters.catalog import Catalog
from services.adapters.config import RegistryConfig
from services.adapters.engine import AdapterRegistry
from services.common.errors import ResourceExhausted, rich_status_of
from tessera.protocol import http_status


def test_a_full_catalog_is_resource_exhausted_naming_it(root, adapter_in_root, base_model_dir):
    registry = AdapterRegistry(RegistryConfig(root=root, admin_token="", base_model_dir=base_model_dir))
    try:
        db = registry.catalog._db  # SQLite's own cap on the file: what a full disk answers (SQLITE_FULL)
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        with pytest.raises(ResourceExhausted) as filling:  # rows smaller than a real load's, until none fits
            for index in range(200):
                registry.catalog.put_ready(f"f{index}", "p", "d", 4, 8.0, False, ["q_proj"], 0)
        with pytest.raises(ResourceExhausted) as refused:
            registry.load("a", "plain")
    finally:
        registry.close()
    assert str(filling.value) == str(refused.value) == "adapter catalog: database or disk is full (SQLITE_FULL)"
    code, _, info = rich_status_of(refused.value)
    assert (code.name, info.reason) == ("RESOURCE_EXHAUSTED", "CATALOG_FULL")
    assert http_status(code.name, info.reason) == (507, "server_error")


_WRITE_PAST_THE_FILE_SIZE_LIMIT = textwrap.dedent("""
    import json, resource, signal, sys
    from pathlib import Path
    from services.adapters.catalog import Catalog
    from services.common.errors import TesseraError, rich_status_of
    catalog = Catalog(Path(sys.argv[1]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    try:
        for index in range(64):
            catalog.put_ready(f"a{index}", "x" * 4000, "d", 4, 8.0, False, ["q_proj"], 0)
    except TesseraError as error:
        code, _, info = rich_status_of(error)
        print(json.dumps([type(error).__name__, str(error), code.name, info.reason]))
""")


def test_a_write_the_disk_refuses_is_unavailable_naming_it(tmp_path):
    done = subprocess.run([sys.executable, "-c", _WRITE_PAST_THE_FILE_SIZE_LIMIT, str(tmp_path / "catalog.sqlite3")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout, done.stderr
    assert json.loads(done.stdout) == ["Unavailable", "adapter catalog: disk I/O error (SQLITE_IOERR_WRITE)",
                                       "UNAVAILABLE", "CATALOG_UNAVAILABLE"]


def test_sqlite_errors_of_the_callers_own_making_pass_unchanged(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite3")
    catalog.close()
    with pytest.raises(Exception) as failed:  # a closed connection is a bug here, not the disk's
        catalog.get("a")
    assert not isinstance(failed.value, ResourceExhausted)
