"""The tool-call parsers, one per model family, on the text each family's models write: calls read with their
arguments, answers read as no call, and a call that cannot be read is a call that failed (its error goes back to
the model). tests/unit/env/test_model_templates.py runs them on the families' real chat templates."""

from __future__ import annotations

import pytest

from grpo_cli.env.parsers import PARSERS, parse
from grpo_cli.env.tools import ToolCall

MUL = ToolCall("multiply", {"a": 2, "b": 3})
ADD = ToolCall("add", {"x": "1", "y": [1, 2]})


@pytest.mark.parametrize("parser, text, calls", [
    # Hermes / Qwen2.5 / Qwen3: one JSON object per <tool_call> block
    ("hermes", '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>', [MUL]),
    ("hermes", 'Let me. <tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
               '<tool_call>{"name": "add", "arguments": "{\\"x\\": \\"1\\", \\"y\\": [1, 2]}"}</tool_call>',
     [MUL, ADD]),
    ("hermes", '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}', [MUL]),  # EOS before the closing tag
    ("hermes", "<think>\nmultiply\n</think>\n\nIt is 6.", []),
    # SmolLM2: a JSON list of calls in one <tool_call> block (one object is read too)
    ("smollm2", '<tool_call>[{"name": "multiply", "arguments": {"a": 2, "b": 3}}, '
                '{"name": "add", "arguments": {"x": "1", "y": [1, 2]}}]</tool_call>', [MUL, ADD]),
    ("smollm2", '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>', [MUL]),
    ("smollm2", "<tool_call>[]</tool_call>", []),  # SmolLM2's way of calling nothing
    # Llama 3.x: the turn is one bare JSON object with "parameters" (or "arguments"), after an optional python tag,
    # several separated by ";"
    ("llama3_json", '{"name": "multiply", "parameters": {"a": 2, "b": 3}}', [MUL]),
    ("llama3_json", '<|python_tag|>{"name": "multiply", "parameters": {"a": 2, "b": 3}}; '
                    '{"name": "add", "arguments": {"x": "1", "y": [1, 2]}}', [MUL, ADD]),
    ("llama3_json", "It is 6, as {2 * 3} shows.", []),
    # Qwen3.5 / Qwen3-Coder: XML, one <parameter=...> per argument, the value as text (JSON for a list or object)
    ("qwen3_xml", "<tool_call>\n<function=multiply>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
                  "</function>\n</tool_call>", [MUL]),
    ("qwen3_xml", "I will add.\n\n<tool_call>\n<function=add>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\n"
                  "[1, 2]\n</parameter>\n</function>\n</tool_call>", [ToolCall("add", {"x": 1, "y": [1, 2]})]),
    ("qwen3_xml", "It is 6.", []),
    # Mistral: [TOOL_CALLS] then a JSON list (v0.3), or name[ARGS]{...} per call (later tokenizers)
    ("mistral", '[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 2, "b": 3}, "id": "abcdefghi"}, '
                '{"name": "add", "arguments": {"x": "1", "y": [1, 2]}}]', [MUL, ADD]),
    ("mistral", '[TOOL_CALLS]multiply[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]add[CALL_ID]abcdefghi[ARGS]'
                '{"x": "1", "y": [1, 2]}', [MUL, ADD]),
    ("mistral", "It is 6.", []),
])
def test_each_family_reads_its_calls(parser, text, calls):
    assert parse(parser, text) == calls


def test_xml_values_take_the_type_the_tools_schema_declares():
    text = "<tool_call>\n<function=add>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\n[1, 2]\n</parameter>\n" \
           "</function>\n</tool_call>"
    # x is declared a string: "1" stays text; without a schema it reads as JSON when it parses (1)
    types = {"add": {"x": "string", "y": "array"}}
    assert parse("qwen3_xml", text, types) == [ADD]
    assert parse("qwen3_xml", text) == [ToolCall("add", {"x": 1, "y": [1, 2]})]


@pytest.mark.parametrize("parser, text, hint", [
    ("hermes", "<tool_call>{name: f}</tool_call>", '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'),
    ("smollm2", "<tool_call>[{name: f}]</tool_call>", '<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": ', '{"name": ..., "parameters": {...}}'),
    ("qwen3_xml", "<tool_call>\n<parameter=a>\n2\n</parameter>\n</tool_call>",
     "<tool_call>\n<function=name>\n<parameter=argument>\nvalue\n</parameter>\n</function>\n</tool_call>"),
    ("mistral", "[TOOL_CALLS] [{name: f}]", '[TOOL_CALLS] [{"name": ..., "arguments": {...}}]'),
])
def test_a_call_that_cannot_be_read_fails_and_says_how_to_write_one(parser, text, hint):
    (bad,) = parse(parser, text)
    assert bad.name == "unknown" and bad.error is not None and bad.error.endswith(hint), bad


def test_every_family_has_a_parser():
    assert set(PARSERS) == {"hermes", "smollm2", "llama3_json", "qwen3_xml", "mistral"}
