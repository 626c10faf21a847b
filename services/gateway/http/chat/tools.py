"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat body: what the decoder is asked
(the tools for its chat template, a JSON-schema constraint) and how each choice's text is read
back (tool_parsers.py), as vLLM's OpenAI server (serving_chat.py) does.

- "none": no call is parsed; the tools are still rendered by a template that takes them (vLLM's
  default, without --exclude-tools-when-tool-choice-none).
- "auto" (the default with tools): the text is parsed by the decoder's tool-call parser
  (DecoderInfo.tool_call_parser, "hermes"); refused 400 when the template renders no tools or
  the decoder has no parser, since the model was never told of the tools or its calls cannot be read.
- "required": the output is constrained (SamplingParams.json_schema) to a JSON array of at least
  one `{"name": <a tool's name>, "parameters": <its parameters>}` object (at most one with
  parallel_tool_calls false): vLLM's `_get_json_schema_from_tool`.
- a named function: the output is constrained to that function's parameters schema, and is its
  arguments. An unknown name is refused 400.
`required` and a named function need no parser: tools are rendered only where the template takes
them. parallel_tool_calls false keeps a choice's first call only (vLLM's
maybe_filter_parallel_tool_calls). A choice that made calls and stopped ends with finish_reason
"tool_calls".
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.gateway.http.chat.protocol import ChatCompletionRequest, NamedToolChoice
from services.gateway.http.chat.tool_parsers import HermesParser, NamedParser, RequiredParser, ToolCallParser
from services.gateway.http.errors import ApiError

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
PARSERS = {"hermes": HermesParser}
NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class DecoderTools:
    """What the served model does with tools (DecoderInfo's chat_template_takes_tools and
    tool_call_parser)."""

    takes_tools: bool
    parser: str

    @classmethod
    def of(cls, info) -> DecoderTools:
        return cls(info.chat_template_takes_tools, info.tool_call_parser)


@dataclass(frozen=True)
class ToolPlan:
    """How one request's choices are read: `mode` (NONE, AUTO, REQUIRED, NAMED), the parser
    name for AUTO, the function for NAMED, and at most one call per choice unless `parallel`."""

    mode: str
    parser: str = ""
    function: str = ""
    parallel: bool = True

    def new_parser(self) -> ToolCallParser | None:
        """A parser for one choice; None under NONE (the text is content as it is)."""
        if self.mode == AUTO:
            return PARSERS[self.parser]()
        if self.mode == REQUIRED:
            return RequiredParser()
        if self.mode == NAMED:
            return NamedParser(self.function)
        return None


def tool_plan(body: ChatCompletionRequest, decoder: DecoderTools | None) -> ToolPlan | None:
    """The plan for `body` (None: no tools, nothing parsed). `decoder` is needed only when the body
    has tools.

    Raises:
        ApiError: 400 for a tool_choice other than "none"/"auto" without tools, a named function the
            tools do not hold, or "auto" on a model whose template takes no tools or that has no
            tool-call parser (naming why).
    """
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice not in (NONE, AUTO):
            what = "a named function" if isinstance(choice, NamedToolChoice) else repr(choice)
            raise ApiError(400, f"tool_choice {what} needs tools: the request has none", param="tool_choice")
        return None
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == AUTO:
        if not decoder.takes_tools:
            raise ApiError(400, 'tool_choice "auto" needs a chat template that renders tools: the served model\'s '
                                'template takes no `tools`, so the model is never shown them (tool_choice '
                                '"required" or a named function still work, through a constraint)',
                           param="tool_choice")
        if not decoder.parser:
            raise ApiError(400, 'tool_choice "auto" needs a tool-call parser: the decoder has none for this model\'s '
                                'format (its --tool-call-parser is "none", or the chat template\'s format is not one '
                                'it knows: hermes); tool_choice "required" or a named function still work',
                           param="tool_choice")
        return ToolPlan(AUTO, parser=decoder.parser, parallel=parallel)
    if choice == NONE:
        return ToolPlan(NONE)
    if choice == REQUIRED:
        return ToolPlan(REQUIRED, parallel=parallel)
    names = [tool.function.name for tool in body.tools]
    if choice.function.name not in names:
        raise ApiError(400, f"tool_choice names function {choice.function.name!r}, which tools do not hold "
                            f"(they hold {', '.join(map(repr, names))})", param="tool_choice.function.name")
    return ToolPlan(NAMED, function=choice.function.name, parallel=parallel)


def constraint(body: ChatCompletionRequest, plan: ToolPlan) -> str | None:
    """The JSON schema (as text) the output is held to under `plan`: None for NONE and AUTO.

    Raises:
        ApiError: 400 for two tools whose parameters define one `$defs` name differently (the
            required schema lifts them to its root, as vLLM's).
    """
    if plan.mode == NAMED:
        tool = next(t for t in body.tools if t.function.name == plan.function)
        return json.dumps(tool.function.parameters or NO_ARGUMENTS)
    if plan.mode != REQUIRED:
        return None
    defs: dict = {}
    variants = []
    for index, tool in enumerate(body.tools):
        parameters = dict(tool.function.parameters or NO_ARGUMENTS)
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != definition:
                raise ApiError(400, f"tools define $defs {name!r} twice, differently: tool_choice \"required\" "
                                    "puts every tool's $defs in one schema", param=f"tools.{index}.function.parameters")
            defs[name] = definition
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not plan.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return json.dumps(schema)


def schema_field(body: ChatCompletionRequest) -> str | None:
    """The body's field a refusal of the constraint names: the named function's parameters, or
    `tools` for "required" (None: the tools constrain nothing)."""
    choice = body.tool_choice
    if not body.tools or choice is None or choice in (NONE, AUTO):
        return None
    if choice == REQUIRED:
        return "tools"
    index = next((i for i, tool in enumerate(body.tools) if tool.function.name == choice.function.name), None)
    return None if index is None else f"tools.{index}.function.parameters"


def tools_text(body) -> str:
    """The body's tools as the decoder's `tools` field (a JSON array, as sent; "" for none)."""
    return json.dumps(body.sent_tools, ensure_ascii=False) if body.tools else ""
