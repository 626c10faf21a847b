"""Configuration of the adapter registry, validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from services.common.auth import refuse_placeholder
from services.common.metrics import check_metrics_port
from services.common.server import default_address
from tessera.paths import default_adapter_root
from tessera.protocol import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, API_KEY_FILE_ENV, METRICS_PORT_ENV

RANK_LIMIT = 1024  # a sanity bound on max_rank itself


@dataclass
class RegistryConfig:
    """Settings of one registry process.

    Attributes:
        root: adapter root directory; clients may only name PEFT directories inside it.
        db_path: SQLite catalog file (default `<root>/registry.sqlite3`; `tessera up` gives each
            cluster its own, `cluster_home(NAME)/registry/catalog.sqlite3`).
        admin_token: bearer token for LoadAdapter/UnloadAdapter; "" disables auth. `None` reads
            `admin_token_file`, else `$TESSERA_ADMIN_TOKEN` (default ""). It has no flag: a secret in
            argv is readable by every local user in `ps`. In an environment that gives the gateway
            API keys (`$TESSERA_API_KEY_FILE` set) "" is refused (ValueError): the cluster's admin
            calls would be open to anonymous callers.
        admin_token_file: a file holding the admin token (surrounding whitespace stripped); default
            `$TESSERA_ADMIN_TOKEN_FILE`. Giving it and `$TESSERA_ADMIN_TOKEN` both is refused.
        base_model_dir: optional HF model dir; when set, target modules and LoRA shapes are
            checked against its config.json (Llama-family projection names), every load records
            its base-model digest, and adapters recorded against another base (or none) are listed
            but refused to decoders (FailedPrecondition) until loaded again.
        max_rank: largest LoRA rank accepted, per target module.
        report_ttl_s: a decoder whose last residency report is older than this is gone (its
            leases no longer count, nor block a drain).
        drain_poll_s: how often a draining unload/replace re-checks the decoders' reports.
        lease_confirm_s: reports are periodic, so a lease count may belong to a request that has
            just finished; a non-draining unload/replace waits up to this long for a count taken
            after the call from each decoder (its second report after the call: LeaseTable) still
            showing leases before it refuses.
        max_path_chars: characters of LoadAdapter's path (checked before it is resolved).
        max_name_chars: characters of a name, digest or decoder id in any request (adapter names
            have their own, tighter rule: services/common/names.py).
        max_report_entries: resident digests, names per digest and acknowledged drains in one
            ResidencyReport, each.
        address: host:port the registry binds.
    """

    root: Path = field(default_factory=default_adapter_root,
                       metadata={"help": "adapter root; clients may only name PEFT directories inside it"})
    db_path: Path | None = field(default=None, metadata={"help": "SQLite catalog", "flag": "--db",
                                                          "default_help": "<root>/registry.sqlite3"})
    admin_token: str | None = field(default=None, repr=False)
    admin_token_file: Path | None = field(default=None, metadata={
        "help": f"file holding the bearer token for Load/Unload (else ${ADMIN_TOKEN_ENV}; neither = no auth)",
        "env": ADMIN_TOKEN_FILE_ENV, "default_help": "none"})
    base_model_dir: Path | None = field(default=None,
                                        metadata={"help": "validate targets against this model's config.json and "
                                                          "serve only adapters registered against this base"})
    max_rank: int = field(default=64, metadata={"help": "largest LoRA rank accepted, per target module"})
    report_ttl_s: float = 10.0
    drain_poll_s: float = 0.05
    lease_confirm_s: float = 3.0  # decoders report every second; a fresh count takes two
    max_path_chars: int = field(default=4096, metadata={"help": "characters of LoadAdapter's path"})
    max_name_chars: int = field(default=256, metadata={"help": "characters of a name, digest or decoder id"})
    max_report_entries: int = field(default=4096, metadata={"help": "entries of each list of a ResidencyReport"})
    address: str = field(default=default_address("adapters"), metadata={"help": "bind host:port"})
    metrics_port: int = field(default=0, metadata={
        "help": "serve Prometheus /metrics (process gauges) on this port, same host as --address (0: off)",
        "env": METRICS_PORT_ENV})

    def __post_init__(self) -> None:
        check_metrics_port(self.metrics_port)
        self.root = Path(self.root).expanduser()
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"adapter root {self.root} exists and is not a directory")
        self.db_path = Path(self.db_path).expanduser() if self.db_path else self.root / "registry.sqlite3"
        if self.admin_token is None:
            self.admin_token = self._read_admin_token()
        if self.admin_token != self.admin_token.strip():
            raise ValueError("admin_token has leading or trailing whitespace; it could never match a header")
        if not self.admin_token and os.environ.get(API_KEY_FILE_ENV):
            raise ValueError(f"${API_KEY_FILE_ENV} is set (the gateway has API keys) but the registry has no admin "
                             f"token: adapter load/unload would be open to anonymous callers; give one with "
                             f"--admin-token-file PATH or ${ADMIN_TOKEN_ENV}")
        if self.base_model_dir is not None:
            self.base_model_dir = Path(self.base_model_dir).expanduser()
            if not (self.base_model_dir / "config.json").is_file():
                raise ValueError(f"base_model_dir {self.base_model_dir} has no config.json")
        if not 1 <= self.max_rank <= RANK_LIMIT:
            raise ValueError(f"max_rank={self.max_rank} must be in [1, {RANK_LIMIT}]")
        for name in ("max_path_chars", "max_name_chars", "max_report_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.lease_confirm_s < 0:
            raise ValueError(f"lease_confirm_s={self.lease_confirm_s} must be >= 0")
        if not self.report_ttl_s > 0 or not self.drain_poll_s > 0:
            raise ValueError(f"report_ttl_s={self.report_ttl_s} and drain_poll_s={self.drain_poll_s} must be > 0")

    def _read_admin_token(self) -> str:
        """The token of `admin_token_file`, else of $TESSERA_ADMIN_TOKEN, else "" (no auth).

        Raises:
            ValueError: the file is unreadable or empty, or the environment holds a token too, or the
                token is a placeholder (`services.common.auth.refuse_placeholder`).
        """
        if self.admin_token_file is None:
            token = os.environ.get(ADMIN_TOKEN_ENV, "")
            if token:
                refuse_placeholder(f"${ADMIN_TOKEN_ENV}", token)
            return token
        if os.environ.get(ADMIN_TOKEN_ENV):
            raise ValueError(f"admin token given twice: --admin-token-file and ${ADMIN_TOKEN_ENV}; keep one")
        path = Path(self.admin_token_file).expanduser()
        try:
            token = path.read_text().strip()
        except OSError as error:
            raise ValueError(f"admin token file {path}: {error.strerror or error}") from None
        if not token:
            raise ValueError(f"admin token file {path} is empty")
        refuse_placeholder(f"admin token file {path}", token)
        return token
