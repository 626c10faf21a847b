"""Shapes every HTTP route family shares: the bounded integer and list types of request bodies,
`Usage`, and OpenAI's error object (`ErrorResponse`, answered for every status in ERROR_RESPONSES).

Each family's own bodies and answers are in its `protocol.py` (chat/, pooling/, tokenize/, models/,
tei/); the rule every body follows (each field honoured, accepted or refused by name) is fields.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

# protobuf's int32 fields: a larger number is refused here (400), not by the message setter
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Count = Annotated[int, Field(ge=1, le=2**31 - 1)]
NonNegativeInt32 = Annotated[int, Field(ge=0, le=2**31 - 1)]  # a bound beside Int32's would be overridden by it

# Lists stop at their first bad item (pydantic's fail_fast): a body of millions of bad items would
# otherwise build an error for each, gigabytes and seconds of the gateway's one event loop.
TokenIds = Annotated[list[Int32], Field(fail_fast=True)]
TokenIdLists = Annotated[list[TokenIds], Field(fail_fast=True)]
Texts = Annotated[list[str], Field(fail_fast=True)]

# TEI's bodies as its router (serde) takes them: no `true` for 1 or "yes" for true
StrictInt32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1, strict=True)]
StrictTokenIds = Annotated[list[StrictInt32], Field(fail_fast=True)]
StrictTokenIdLists = Annotated[list[StrictTokenIds], Field(fail_fast=True)]
Direction = Literal["right", "left", "Right", "Left"]  # TEI's truncation_direction (it takes both spellings)
Logprobs = Annotated[int, Field(ge=0, le=20)]
CACHE_HINT = "the decoder's prefix cache finds shared prefixes by itself"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


ERROR_RESPONSES = {status: {"model": ErrorResponse}
                   for status in (400, 401, 403, 404, 408, 413, 429, 500, 503, 504)}
