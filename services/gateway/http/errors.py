"""Domain error (its gRPC status) -> HTTP status and OpenAI's error object, in one table.

Every refusal of the HTTP API answers `{"error": {"message", "type", "param", "code"}}` (OpenAI's
shape, so the `openai` SDK raises its typed errors: BadRequestError, NotFoundError, ...), except on
TEI's native routes (`TEI_PATHS`, and /rerank with TEI's body), which answer TEI's shape
`{"error": message, "error_type": "validation" | "overloaded" | "unhealthy" | "backend"}` (what
huggingface_hub's InferenceClient and TEI's other clients read). The status the gateway's gRPC
API answers for the same refusal decides the HTTP status either way; a request body that does not parse or validate is 400, never FastAPI's
422, and never a 500.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from services.common.errors import TesseraError, clip_message, rich_status_of
from services.gateway.http.fields import NOT_UNICODE_ERROR, REFUSED_ERROR
from tessera.protocol import FIELD_METADATA, http_status

log = logging.getLogger(__name__)

# text-embeddings-inference's native routes (its router's http/server.rs): refusals in TEI's shape.
TEI_PATHS = frozenset({"/", "/embed", "/info"})
TEI_SHAPED = "tessera.tei_shaped"  # a scope key: set by a route shared with OpenAI's shapes (/rerank) for a TEI body
_TEI_ERROR_TYPES = {429: "overloaded", 503: "unhealthy"}  # else: 4xx "validation", 5xx "backend"


class ApiError(HTTPException):
    """A refusal with its HTTP status, OpenAI error type, and the offending parameter if known (an
    HTTPException, so FastAPI re-raises it as it is from wherever it is raised, body reading included)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: Mapping[str, str] | None = None):
        """`headers`: sent with the answer (e.g. Retry-After)."""
        super().__init__(status, message, dict(headers) if headers else None)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self, tei: bool = False) -> JSONResponse:
        """OpenAI's error object; with `tei`, TEI's `{"error", "error_type"}` (same status)."""
        if tei:
            kind = _TEI_ERROR_TYPES.get(self.status, "validation" if self.status < 500 else "backend")
            body = {"error": clip_message(self.message), "error_type": kind}
            return JSONResponse(body, status_code=self.status, headers=self.headers)
        return JSONResponse(error_body(self.message, self.type, self.param, self.status), status_code=self.status,
                            headers=self.headers)


def tei_shaped(scope, body: object = None) -> bool:
    """Whether a refusal of this request answers TEI's error shape (see the module's docstring):
    a TEI route, or /rerank marked by its route or with a parsed `body` that sends TEI's `texts`."""
    if scope.get("path") in TEI_PATHS or scope.get(TEI_SHAPED):
        return True
    return scope.get("path") == "/rerank" and isinstance(body, dict) and "texts" in body


def error_body(message: str, type_: str, param: str | None, code: int | str | None) -> dict:
    return {"error": {"message": clip_message(message), "type": type_, "param": param, "code": code}}


def from_error(error: Exception, fields: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP refusal for a core's domain error, by the status gRPC answers for it and its reason
    (tessera.protocol's table: Unavailable -> 503 naming the service, MESSAGE_TOO_LARGE -> 413,
    ...); anything else is a 500. An error that names the protobuf field to blame (its ErrorInfo's
    field, TesseraError.field) names the body's field instead, in `param` and its message, by
    `fields` (the route's table, `body_field`)."""
    code, details, info = rich_status_of(error)
    details = details or code.name
    status, type_ = http_status(code.name, info.reason)
    field = info.metadata.get(FIELD_METADATA)
    if not field or fields is None:
        return ApiError(status, details, type_)
    param = body_field(field, fields)
    return ApiError(status, _renamed(details, field, param), type_, param=param)


_INDEX = re.compile(r"\[(\d+)\]")


def body_field(field: str, fields: Mapping[str, str]) -> str:
    """A protobuf field path ("sampling.stop[3]") as the body's dotted path ("stop.3"): its longest
    prefix (dotted, "sampling.max_tokens", "inputs.0") that `fields` renames takes the body's name
    ("" drops it: "sampling" -> ""), the rest is kept."""
    parts = _INDEX.sub(r".\1", field).split(".")
    for end in range(len(parts), 0, -1):
        head = fields.get(".".join(parts[:end]))
        if head is not None:
            return ".".join(p for p in (head, *parts[end:]) if p)
    return ".".join(parts)


def _renamed(message: str, field: str, param: str) -> str:
    """`message` starting with `param` where it starts with `field` (or, for a check below a
    submessage, with the field's last part: "min_tokens must be ...")."""
    for name in dict.fromkeys((field, field.rsplit(".", 1)[-1])):
        if message.startswith(name) and message[len(name):len(name) + 1] in ("", " ", ":", ","):
            return param + message[len(name):]
    return message


async def api_error_handler(request: Request, error: ApiError) -> JSONResponse:
    return error.response(tei_shaped(request.scope))


async def tessera_error_handler(request: Request, error: TesseraError) -> JSONResponse:
    return from_error(error).response(tei_shaped(request.scope))


_MISSING = object()


def clean_location(location, body, names_field: bool = False) -> list[str]:
    """A pydantic error location as the body's path: "body" and union branch tags ("<parts>",
    "str", "list[int]") dropped, keeping each part that names a key or index of `body` along
    the way, and with `names_field` the last part (a missing or unknown field's name)."""
    path, value = [], body
    parts = [p for p in location if p != "body" and not (isinstance(p, str) and p.startswith("<"))]
    for i, part in enumerate(parts):
        if (isinstance(value, dict) and isinstance(part, str) and part in value
                or isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)):
            value = value[part]
        elif i < len(parts) - 1 or not names_field:
            continue  # a branch tag: not a key of the body here
        else:
            value = _MISSING
        path.append(str(part))
    return path


def _problem(error: dict, body) -> tuple[str, str]:
    """(param, message) for one pydantic error."""
    path = clean_location(error.get("loc", ()), body, error.get("type") in ("missing", "extra_forbidden"))
    if error.get("type") == REFUSED_ERROR:
        ctx = error.get("ctx") or {}
        param = ".".join([*path, ctx.get("field", "")]).strip(".")
        return param, f"{param} is not supported: {ctx.get('reason', '')}"
    if error.get("type") == NOT_UNICODE_ERROR:
        param = (error.get("ctx") or {}).get("field", "")
        return param, (f"{param or 'body'} holds text that is not valid Unicode (a lone UTF-16 surrogate, such as "
                       "\\ud800); every string must encode as UTF-8")
    param = ".".join(path)
    if error.get("type") == "extra_forbidden":
        return param, (f"{param} is not a field of this request (refused, never ignored: see the route's fields in "
                       "docs/http.md)")
    return param, f"{param or 'body'}: {error.get('msg')}"


# Text that is not Unicode, a refusal or an unknown field says what is wrong whatever else is: it comes first.
_FIRST = {NOT_UNICODE_ERROR: 0, REFUSED_ERROR: 1, "extra_forbidden": 2}


async def validation_error_handler(request: Request, error: RequestValidationError) -> JSONResponse:
    """Pydantic's errors as one 400 whose `param` is the dotted path of the first problem: a
    refused field (the bodies' tables in each family's protocol.py) or an unknown one before any other."""
    problems = sorted(error.errors(), key=lambda e: _FIRST.get(e.get("type"), len(_FIRST)))
    first = problems[0] if problems else {}
    if first.get("type") == "json_invalid":  # FastAPI's loc is the byte offset, its ctx json's reason
        reason = (first.get("ctx") or {}).get("error", "not JSON")
        return ApiError(400, f"the request body is not valid JSON: {reason} at byte {first['loc'][-1]}").response(
            tei_shaped(request.scope))
    described = [_problem(e, error.body) for e in problems[:5]]
    param = described[0][0] or None if described else None
    if first.get("type") in _FIRST:
        message = described[0][1]
    else:
        message = "; ".join(m for _, m in described)
    return ApiError(400, message or "the request body is not valid", param=param).response(
        tei_shaped(request.scope, error.body))


async def http_error_handler(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own refusals (404 route, 405 method, malformed JSON) in OpenAI's shape."""
    type_ = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return ApiError(error.status_code, str(error.detail), type_).response(tei_shaped(request.scope))


async def unicode_error_handler(request: Request, error: UnicodeError) -> JSONResponse:
    """Text protobuf cannot carry: JSON allows lone UTF-16 surrogates ("\\ud800"), UTF-8 does not."""
    return ApiError(400, f"the request holds text that is not valid Unicode ({error.reason}: a lone UTF-16 "
                         "surrogate?); every string must encode as UTF-8").response(tei_shaped(request.scope))


async def unexpected_error_handler(request: Request, error: Exception) -> JSONResponse:
    """Anything else: a 500 in OpenAI's shape (the cause is in the gateway's log, not the answer)."""
    log.exception("HTTP %s %s failed", request.method, request.url.path)
    return ApiError(500, f"internal error ({type(error).__name__}); see the gateway's log",
                    "server_error").response(tei_shaped(request.scope))


HANDLERS = {
    ApiError: api_error_handler,
    UnicodeError: unicode_error_handler,
    Exception: unexpected_error_handler,
    TesseraError: tessera_error_handler,
    RequestValidationError: validation_error_handler,
    HTTPException: http_error_handler,
}


@contextlib.contextmanager
def naming(fields: dict[str, str]):
    """A refusal of the core's that names a protobuf field names the body's (`fields`: the route's
    table in its family's serving.py) in `param` and its message."""
    try:
        yield
    except TesseraError as error:
        raise from_error(error, fields) from error
