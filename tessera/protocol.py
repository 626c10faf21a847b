"""The facts the client and the services share, written once: environment variables, metadata keys,
message limits, and the table of refusal reasons with the gRPC and HTTP statuses they answer.

Standard library only: the light client (`tessera.client`) and every service import it, and the
services take these names from here rather than keeping their own. A refusal carries its reason
as grpc's rich status (google.rpc.Status with one `google.rpc.ErrorInfo` of domain ERROR_DOMAIN;
tessera/rich_status.py reads and writes it), so no side ever reads meaning out of a message's
text: the messages stay for people.
"""

from __future__ import annotations

# ---- environment variables ----------------------------------------------------------------------

HOME_ENV = "TESSERA_HOME"                        # where models, clusters and logs live
ADDRESS_ENV = "TESSERA_ADDRESS"                  # the CLI's default gateway address
API_TOKEN_ENV = "TESSERA_API_TOKEN"              # the client's bearer token for the gateway
ADMIN_TOKEN_ENV = "TESSERA_ADMIN_TOKEN"          # the registry's admin token (adapter load/unload)
ADMIN_TOKEN_FILE_ENV = "TESSERA_ADMIN_TOKEN_FILE"
TLS_ROOT_CERT_ENV = "TESSERA_TLS_ROOT_CERT"      # PEM roots the client verifies the gateway with
INTERNAL_TOKEN_FILE_ENV = "TESSERA_INTERNAL_TOKEN_FILE"  # the cluster's internal token (services/common/auth.py)
EXIT_UNHEALTHY_ENV = "TESSERA_EXIT_UNHEALTHY_AFTER_S"    # services/common/server.py
CLUSTER_ENV = "TESSERA_CLUSTER"
LOG_FORMAT_ENV = "TESSERA_LOG_FORMAT"
LOG_LEVEL_ENV = "TESSERA_LOG_LEVEL"
METRICS_PORT_ENV = "TESSERA_METRICS_PORT"
HTTP_PORT_ENV = "TESSERA_HTTP_PORT"
API_KEY_FILE_ENV = "TESSERA_API_KEY_FILE"
DECODER_DEVICE_ENV = "TESSERA_DECODER_DEVICE"
POOLING_DEVICE_ENV = "TESSERA_POOLING_DEVICE"

# ---- call metadata ------------------------------------------------------------------------------

REQUEST_ID_METADATA = "x-request-id"                  # taken or made per call, sent on, answered in the trailer
REPLICA_METADATA = "tessera-replica"                  # a Generate's initial metadata: the decoder replica serving it
INTERNAL_TOKEN_METADATA = "x-tessera-internal-token"  # the cluster's internal token on internal hops
AUTHORIZATION_METADATA = "authorization"              # "Bearer <key>": API keys, the registry's admin token
API_KEYS_METADATA = "x-tessera-api-keys"              # "on": an admin call relayed by a gateway that has API keys

# ---- message limits -----------------------------------------------------------------------------

# Large enough for the biggest allowed image and for adapter weights pulled by decoders; anything
# past it is refused with RESOURCE_EXHAUSTED by grpc itself, never a hang. Each service's server
# takes a smaller receive limit from its own caps (services/common/message_limits.py).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_STATUS_MESSAGE_CHARS = 1024  # status messages travel in a trailer (gRPC's metadata limit is 16 KiB)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted peer is found again within ~2 s (grpc's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

# ---- how the decoder runs its model ---------------------------------------------------------------

# DecoderInfo.model_impl -> what it means, as `tessera up` and `tessera info` say it
MODEL_IMPL_TEXT = {"native": "native (tessera's model file for its family)",
                   "transformers": "transformers (transformers' own modeling code on tessera's paged KV cache)"}

# DecoderInfo.decode_step -> what it means, as `tessera info` says it
DECODE_STEP_TEXT = {"fused": "fused (every layer of an all-decode step in one C call)",
                    "modules": "modules (layer by layer through the model's modules)"}

# ---- refusal reasons ----------------------------------------------------------------------------

ERROR_DOMAIN = "tessera"  # ErrorInfo.domain of every reason below

# A refusal with no more specific reason carries its status's name (INVALID_ARGUMENT, NOT_FOUND, ...).
UNKNOWN_ADAPTER = "UNKNOWN_ADAPTER"              # no adapter of that name is loaded
OVER_LIMIT = "OVER_LIMIT"                        # a request field past its cap (ErrorInfo.metadata "field")
MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"          # a whole message past a receive limit
INTERNAL_TOKEN_MISSING = "INTERNAL_TOKEN_MISSING"  # an internal port called without the cluster's token
INTERNAL_TOKEN_WRONG = "INTERNAL_TOKEN_WRONG"
API_KEY_MISSING = "API_KEY_MISSING"              # the gateway needs an API key and the call sent none
API_KEY_INVALID = "API_KEY_INVALID"
ADMIN_TOKEN_MISSING = "ADMIN_TOKEN_MISSING"      # the registry's admin RPCs
ADMIN_TOKEN_INVALID = "ADMIN_TOKEN_INVALID"
ADMIN_TOKEN_UNSET = "ADMIN_TOKEN_UNSET"          # an admin call from a keyed gateway to a registry with no admin token
CATALOG_FULL = "CATALOG_FULL"                    # the registry's SQLite catalog: database or disk is full
CATALOG_UNAVAILABLE = "CATALOG_UNAVAILABLE"      # the catalog cannot be read or written (I/O error, read-only, locked)

FIELD_METADATA = "field"  # ErrorInfo.metadata key: the request field a refusal is about ("lora", "sampling.n")

# reason -> the gRPC status it is answered with
REASON_TO_STATUS: dict[str, str] = {
    UNKNOWN_ADAPTER: "NOT_FOUND",
    OVER_LIMIT: "INVALID_ARGUMENT",
    MESSAGE_TOO_LARGE: "RESOURCE_EXHAUSTED",
    INTERNAL_TOKEN_MISSING: "UNAUTHENTICATED",
    INTERNAL_TOKEN_WRONG: "UNAUTHENTICATED",
    API_KEY_MISSING: "UNAUTHENTICATED",
    API_KEY_INVALID: "UNAUTHENTICATED",
    ADMIN_TOKEN_MISSING: "UNAUTHENTICATED",
    ADMIN_TOKEN_INVALID: "PERMISSION_DENIED",
    ADMIN_TOKEN_UNSET: "PERMISSION_DENIED",
    CATALOG_FULL: "RESOURCE_EXHAUSTED",
    CATALOG_UNAVAILABLE: "UNAVAILABLE",
}

# gRPC status -> (HTTP status, OpenAI error type); a status not listed is a 500 server_error.
STATUS_TO_HTTP: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "ALREADY_EXISTS": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}
# reasons whose HTTP answer is not their status's: a message too large is no rate limit
REASON_TO_HTTP: dict[str, tuple[int, str]] = {
    MESSAGE_TOO_LARGE: (413, "invalid_request_error"),
    CATALOG_FULL: (507, "server_error"),  # WebDAV's Insufficient Storage: the server's disk, not the caller's rate
}
SERVER_ERROR = (500, "server_error")


def http_status(status: str, reason: str = "") -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a refusal with gRPC status name `status` and `reason`."""
    return REASON_TO_HTTP.get(reason) or STATUS_TO_HTTP.get(status, SERVER_ERROR)
