"""Tools for the chat template: the request's tool list checked, assistant tool calls as the
template reads them, and what a checkpoint's template does with tools.

The tool list is OpenAI's (`[{"type": "function", "function": {"name", "description",
"parameters", "strict"}}]`), handed to the template as transformers' `apply_chat_template(tools=...)`
takes it. An assistant message's calls reach the template as transformers documents them
(`{"type": "function", "id", "function": {"name", "arguments": dict}}`: vLLM json.loads OpenAI's
arguments string for templates the same way).

The tool-call parser names the format the model writes its calls in, which the gateway parses:
"hermes" (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Hermes,
Qwen2.5, Qwen3 and SmolLM3) when the template mentions `<tool_call>`, else none; the decoder's
--tool-call-parser (vLLM's flag) overrides the choice.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.meta

from services.common.errors import InvalidArgument
from services.decoder.types import ToolCall

# OpenAI's cap on the tools of one request (its API reference: "A max of 128 functions are supported").
MAX_TOOLS = 128
HERMES = "hermes"
TOOL_CALL_PARSERS = (HERMES,)
PARSER_AUTO, PARSER_NONE = "auto", "none"
HERMES_START = "<tool_call>"
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON value")


def parse_tools(text: str, field: str = "tools") -> tuple[dict, ...]:
    """The tools of a request's `tools` field ("" = none): a JSON array of at most MAX_TOOLS
    objects {"type": "function", "function": {"name": non-empty string, "description"?: string,
    "parameters"?: object (a JSON Schema), "strict"?: bool}}, no other keys.

    Raises:
        InvalidArgument: text that is not such an array, naming `field` and the entry's path
            (e.g. "tools[1].function.name").
    """
    if not text:
        return ()
    try:
        tools = json.loads(text, parse_constant=_not_json)
    except ValueError as error:
        raise InvalidArgument(f"{field} is not JSON: {error}", field=field) from None
    if not isinstance(tools, list):
        raise InvalidArgument(f"{field} must be a JSON array of tools, got a JSON {type(tools).__name__}", field=field)
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"{field} has {len(tools)} tools; the limit is {MAX_TOOLS} (OpenAI's)", field=field)
    for index, tool in enumerate(tools):
        _check_tool(tool, f"{field}[{index}]")
    return tuple(tools)


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, dict):
        raise InvalidArgument(f"{where} must be an object {{type, function}}", field=where)
    if tool.get("type") != "function":
        raise InvalidArgument(f"{where}.type must be \"function\" (the only kind of tool), got {tool.get('type')!r}",
                              field=f"{where}.type")
    extra = sorted(set(tool) - {"type", "function"})
    if extra:
        raise InvalidArgument(f"{where} has unknown key {extra[0]!r}; a tool is {{type, function}}",
                              field=f"{where}.{extra[0]}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidArgument(f"{where}.function must be an object {{name, description, parameters}}",
                              field=f"{where}.function")
    extra = sorted(set(function) - _FUNCTION_KEYS)
    if extra:
        raise InvalidArgument(f"{where}.function has unknown key {extra[0]!r}; expected {sorted(_FUNCTION_KEYS)}",
                              field=f"{where}.function.{extra[0]}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}.function.name must be a non-empty string", field=f"{where}.function.name")
    if "description" in function and not isinstance(function["description"], str):
        raise InvalidArgument(f"{where}.function.description must be a string", field=f"{where}.function.description")
    if "parameters" in function and not isinstance(function["parameters"], dict):
        raise InvalidArgument(f"{where}.function.parameters must be a JSON Schema object",
                              field=f"{where}.function.parameters")
    if "strict" in function and not isinstance(function["strict"], bool):
        raise InvalidArgument(f"{where}.function.strict must be a boolean", field=f"{where}.function.strict")


def tool_call_from_parts(call_id: str, name: str, arguments: str, where: str) -> ToolCall:
    """One assistant tool call; `arguments` is a JSON object as text ("" = {}).

    Raises:
        InvalidArgument: an empty name, or arguments that are not a JSON object (naming `where`).
    """
    if not name:
        raise InvalidArgument(f"{where}.name must be the function's name", field=f"{where}.name")
    try:
        parsed = json.loads(arguments, parse_constant=_not_json) if arguments else {}
    except ValueError as error:
        raise InvalidArgument(f"{where}.arguments is not JSON: {error}", field=f"{where}.arguments") from None
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"{where}.arguments must be a JSON object, got a JSON {type(parsed).__name__}",
                              field=f"{where}.arguments")
    return ToolCall(call_id, name, parsed)


def template_tool_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
    """`calls` as a chat template reads an assistant message's tool_calls (transformers' form,
    the arguments a dict, as vLLM hands them)."""
    out = []
    for call in calls:
        entry: dict[str, Any] = {"type": "function", "function": {"name": call.name, "arguments": dict(call.arguments)}}
        if call.id:
            entry["id"] = call.id
        out.append(entry)
    return out


def _sources(template: str | Mapping[str, str] | None) -> tuple[str, ...]:
    if isinstance(template, str):
        return (template,)
    if isinstance(template, Mapping):  # named templates (transformers picks "tool_use" for tools)
        return tuple(t for t in template.values() if isinstance(t, str))
    return ()


@functools.lru_cache(maxsize=8)
def _uses_tools(source: str) -> bool:
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(tree)


def template_takes_tools(template: str | Mapping[str, str] | None) -> bool:
    """Whether the chat template reads a `tools` variable (its source names it undeclared)."""
    return any(_uses_tools(source) for source in _sources(template))


def choose_tool_call_parser(template: str | Mapping[str, str] | None, setting: str = PARSER_AUTO) -> str:
    """The parser of the model's tool calls: `setting` "hermes" or "none" ("" answered) decides;
    "auto" picks "hermes" for a template that mentions `<tool_call>`, else none ("")."""
    if setting == PARSER_NONE:
        return ""
    if setting != PARSER_AUTO:
        return setting
    return HERMES if any(HERMES_START in source for source in _sources(template)) else ""
