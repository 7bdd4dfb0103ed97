"""Tool-call parsers, one per model family: each reads the calls in one assistant turn's text (its EOS removed) as
that family's models write them, and returns [] for a turn that answers without one.

- `hermes` (Hermes, Qwen2.5, Qwen3): one JSON object `{"name": ..., "arguments": {...}}` per
  `<tool_call>...</tool_call>` block.
- `smollm2` (SmolLM2, and the built-in chatml format): a `<tool_call>` block holding a JSON list of such objects,
  SmolLM2's own form (`<tool_call>[{...}, {...}]</tool_call>`), or one object.
- `llama3_json` (Llama 3.1 to 3.3): the turn is one bare JSON object `{"name": ..., "parameters": {...}}` (or
  `arguments`), after an optional `<|python_tag|>`; several are separated by `;` (as vLLM's llama3_json reads them).
- `qwen3_xml` (Qwen3.5, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>`; a value is text, JSON for a list or an object, and takes the type the tool's schema
  declares for it (`types`), else its JSON reading when it has one.
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls (v0.3 tokenizers, ids optional), or `name[ARGS]{...}` per
  call, `[CALL_ID]id` optionally between (later tokenizers).

A call that cannot be read (bad JSON, no name) is a call that failed: its error, which shows the family's way of
writing a call, goes back to the model. An id the model wrote is not kept: the environment numbers the results of a
turn itself (grpo_cli.env.formats.tool_call_id). Which parser a chat template gets is decided by reading back a call
the template writes (grpo_cli.env.formats.choose).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from grpo_cli.env.tools import ToolCall

# each family's way of writing a call, the end of every error a call that cannot be read gets
HINTS = {
    "hermes": '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
    "smollm2": '<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>',
    "llama3_json": '{"name": ..., "parameters": {...}}',
    "qwen3_xml": "<tool_call>\n<function=name>\n<parameter=argument>\nvalue\n</parameter>\n</function>\n</tool_call>",
    "mistral": '[TOOL_CALLS] [{"name": ..., "arguments": {...}}]',
}
# a tool's JSON-schema type per argument, per tool name: {"multiply": {"a": "integer"}}
Types = dict[str, dict[str, Any]]

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)  # an EOS may come before the closing tag
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def failed(family: str, why: str) -> ToolCall:
    """A call that could not be read: `why`, then how the family writes one."""
    return ToolCall("unknown", error=f"the tool call {why}; write {HINTS[family]}")


def from_json(data: Any, family: str) -> ToolCall:
    """A call from a decoded JSON object with a name and its arguments (or Llama's parameters); arguments written
    as a JSON string (some models do) are decoded."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return failed(family, 'has no "name"')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return ToolCall(data["name"], arguments)


def _decode(text: str, family: str) -> tuple[Any, ToolCall | None]:
    """(JSON value, None), or (None, the failed call) when `text` is not JSON."""
    try:
        return json.loads(text.strip()), None
    except json.JSONDecodeError as err:
        return None, failed(family, f"is not valid JSON ({err.msg} at character {err.pos})")


def hermes(text: str, types: Types | None = None) -> list[ToolCall]:
    calls = []
    for body in _BLOCK.findall(text):
        data, error = _decode(body, "hermes")
        calls.append(error or from_json(data, "hermes"))
    return calls


def smollm2(text: str, types: Types | None = None) -> list[ToolCall]:
    calls = []
    for body in _BLOCK.findall(text):
        data, error = _decode(body, "smollm2")
        if error is not None:
            calls.append(error)
        else:
            calls.extend(from_json(one, "smollm2") for one in (data if isinstance(data, list) else [data]))
    return calls


def llama3_json(text: str, types: Types | None = None) -> list[ToolCall]:
    stripped = text.strip()
    tagged = stripped.startswith(_PYTHON_TAG)
    rest = stripped.removeprefix(_PYTHON_TAG).lstrip()
    if not rest.startswith("{"):
        return [failed("llama3_json", "is not a JSON object")] if tagged else []
    calls: list[ToolCall] = []
    while rest:
        try:
            data, end = _DECODER.raw_decode(rest)
        except json.JSONDecodeError as err:
            # prose that opens with a brace is an answer; after the python tag, or a call, a broken call
            return calls + [failed("llama3_json", f"is not valid JSON ({err.msg} at character {err.pos})")] \
                if tagged or calls else []
        call = from_json(data, "llama3_json")
        if call.error is not None and not (tagged or calls):
            return []  # a JSON object without a name, written as the answer
        calls.append(call)
        rest = rest[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            break  # text after the calls: the turn's calls end there
    return calls


def _value(raw: str, declared: Any) -> Any:
    """An XML argument's value: text for a declared string, else its JSON reading when it has one."""
    if declared == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def qwen3_xml(text: str, types: Types | None = None) -> list[ToolCall]:
    calls = []
    for body in _BLOCK.findall(text):
        function = _FUNCTION.search(body)
        if function is None:
            calls.append(failed("qwen3_xml", "has no <function=...> block"))
            continue
        name = function.group(1).strip()
        declared = (types or {}).get(name, {})
        arguments = {key.strip(): _value(value, declared.get(key.strip()))
                     for key, value in _PARAMETER.findall(function.group(2))}
        calls.append(ToolCall(name, arguments))
    return calls


def _mistral_one(chunk: str) -> list[ToolCall]:
    """The calls after one [TOOL_CALLS]: a JSON list (v0.3), or name[CALL_ID]id[ARGS]{...} (later tokenizers)."""
    if chunk.startswith("[") and not chunk.startswith("[ARGS]"):
        try:
            data, _ = _DECODER.raw_decode(chunk)
        except json.JSONDecodeError as err:
            return [failed("mistral", f"is not valid JSON ({err.msg} at character {err.pos})")]
        return [from_json(one, "mistral") for one in (data if isinstance(data, list) else [data])]
    if "[ARGS]" not in chunk:
        return [failed("mistral", "has neither a JSON list nor [ARGS]")]
    name, arguments = chunk.split("[ARGS]", 1)
    name = name.split("[CALL_ID]", 1)[0].strip()
    try:
        data, _ = _DECODER.raw_decode(arguments.strip())
    except json.JSONDecodeError as err:
        return [failed("mistral", f"arguments are not valid JSON ({err.msg} at character {err.pos})")]
    return [from_json({"name": name, "arguments": data}, "mistral")]


def mistral(text: str, types: Types | None = None) -> list[ToolCall]:
    return [call for chunk in text.split("[TOOL_CALLS]")[1:] for call in _mistral_one(chunk.strip())]


PARSERS: dict[str, Callable[[str, Types | None], list[ToolCall]]] = {
    "hermes": hermes, "smollm2": smollm2, "llama3_json": llama3_json, "qwen3_xml": qwen3_xml, "mistral": mistral}


def parse(family: str, text: str, types: Types | None = None) -> list[ToolCall]:
    """The calls of one assistant turn's text, read by `family`'s parser (a key of PARSERS)."""
    return PARSERS[family](text, types)


def types_of(schemas: list[dict]) -> Types:
    """Each tool's declared JSON-schema type per argument, from the tools' schemas (transformers' get_json_schema
    shape: {"type": "function", "function": {"name", "parameters": {"properties": {...}}}})."""
    out: Types = {}
    for schema in schemas:
        function = schema.get("function", schema)
        properties = (function.get("parameters") or {}).get("properties") or {}
        out[function.get("name", "")] = {key: spec.get("type") for key, spec in properties.items()
                                         if isinstance(spec, dict)}
    return out
