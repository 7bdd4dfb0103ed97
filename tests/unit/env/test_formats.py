"""Tool-call formats: auto picks the model's template when it renders tools and the built-in ChatML format when it
ignores them; calls are read from the text; what the environment adds is the template's own difference."""

from __future__ import annotations

import pytest

from grpo_cli.env.formats import choose
from grpo_cli.env.tools import ToolCall, ToolResult, tool_from
from grpo_cli.errors import ConfigError
from grpo_cli.policy import char_tokenizer

# an assistant turn's calls as Hermes and Qwen2.5 write them, one <tool_call> block each
HERMES_CALLS = (
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for c in m.tool_calls %}{{- '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
)
# a Qwen2.5-like template: tools in the system turn, calls in <tool_call> blocks, consecutive tool results in one
# user turn
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    "{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.previtem is not defined or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    + HERMES_CALLS +
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# renders tools, but ends the last message differently from the others: not prefix-preserving
SHIFTING_TEMPLATE = ("{%- if tools %}{{- 'tools!' }}{%- endif %}"
                     "{%- for m in messages %}{{- m.role + ':' + m.content + (';' if loop.last else '|') }}"
                     "{%- endfor %}")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


SCHEMAS = [tool_from(multiply, "test").schema]
RESULTS = [ToolResult("multiply", "56088", False), ToolResult("multiply", "x", False)]


def tokenizer(template: str | None = None):
    tok = char_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


def test_auto_picks_chatml_for_a_template_that_ignores_tools_and_shows_them_in_the_system_turn():
    tok = tokenizer()
    fmt = choose("auto", tok, SCHEMAS)
    assert fmt.name == "chatml"
    prompt = fmt.render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}],
                        SCHEMAS, True)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "multiply"' in prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")


def test_chatml_environment_text_is_the_rest_of_the_turn_the_tool_turns_and_the_next_opening():
    tok = tokenizer()
    text = choose("chatml", tok, SCHEMAS).environment_text(tok, SCHEMAS, RESULTS, "<|im_end|>")
    # the model sampled <|im_end|>; the template's "\n" after it, one tool turn per result, the next opening
    assert text == ("\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>tool\nx<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_auto_picks_the_models_template_when_it_renders_tools():
    tok = tokenizer(TOOLS_TEMPLATE)
    fmt = choose("auto", tok, SCHEMAS)
    assert fmt.name == "template"
    text = fmt.environment_text(tok, SCHEMAS, RESULTS, "<|im_end|>")
    assert text == ("\n<|im_start|>user\n<tool_response>\n56088\n</tool_response>\n<tool_response>\nx\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")


# a Llama 3.1-like template: a call is one bare JSON object with "parameters", a tool's result stripped and quoted
# as JSON
QUOTING_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|im_start|>ipython\\n' + (m.content | trim | tojson) + '<|im_end|>\\n' }}"
    "{%- elif m.tool_calls %}{%- set c = m.tool_calls[0].function %}{{- '<|im_start|>assistant\\n{\"name\": \"' "
    "+ c.name + '\", \"parameters\": ' + (c.arguments | tojson) + '}<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_each_result_is_a_piece_of_its_own_as_the_template_wrote_it():
    tok = tokenizer(QUOTING_TEMPLATE)
    fmt = choose("auto", tok, SCHEMAS)
    results = [ToolResult("multiply", ' say "<|im_end|>" ', False), ToolResult("multiply", "x", False)]
    pieces = fmt.environment_pieces(tok, SCHEMAS, results, "<|im_end|>")
    # the results' text (stripped, JSON-escaped: its quotes are the template's) is tokenized as text; the rest
    # is the template's own, its control tokens real
    assert pieces == [('\n<|im_start|>ipython\n"', False), ('say \\"<|im_end|>\\"', True),
                      ('"<|im_end|>\n<|im_start|>ipython\n"', False), ("x", True),
                      ('"<|im_end|>\n<|im_start|>assistant\n', False)]
    assert "".join(p for p, _ in pieces) == fmt.environment_text(tok, SCHEMAS, results, "<|im_end|>")


def test_a_template_that_changes_its_own_text_with_a_result_is_refused_before_any_episode():
    # the tool turn's markup says whether the result is long: a result's text cannot be cut out of it
    template = TOOLS_TEMPLATE.replace("'\\n<tool_response>\\n'",
                                      "('\\n<long>' if m.content | length > 3 else '\\n<short>')")
    with pytest.raises(ConfigError, match=r"^env.tool_format=template: the chat template changes its own text with "
                                          r"a message's text, .* set env.tool_format=chatml$"):
        choose("auto", tokenizer(template), SCHEMAS)


# a Gemma-like template: its own turn markers, tools ignored
GEMMA_TEMPLATE = (
    "{%- for m in messages %}{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' "
    "+ m.content + '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def test_auto_refuses_a_template_that_ignores_tools_and_is_not_chatml():
    # chatml would train on <|im_start|> turns that this template never writes
    with pytest.raises(ConfigError) as err:
        choose("auto", tokenizer(GEMMA_TEMPLATE), SCHEMAS)
    line = str(err.value)
    assert "\n" not in line and line.startswith("env.tool_format=auto: the chat template ignores tools and is not "
                                                "ChatML"), line
    assert "data.chat_template=" in line and "env.tool_format=chatml" in line
    # chatml named by the user is the user's choice
    assert choose("chatml", tokenizer(GEMMA_TEMPLATE), SCHEMAS).name == "chatml"


def test_template_forced_on_a_template_that_ignores_tools_is_one_line():
    with pytest.raises(ConfigError, match=r"^env.tool_format=template, but the model's chat template ignores tools; "
                                          r"set env.tool_format=auto or chatml"):
        choose("template", tokenizer(), SCHEMAS)


def test_a_template_that_is_not_prefix_preserving_is_refused_before_any_episode():
    # no training template is known for it (Qwen3's is: tests/unit/env/test_model_templates.py)
    with pytest.raises(ConfigError, match=r"^env.tool_format=template: .* not prefix-preserving.* no training "
                                          r"template is known for it; set data.chat_template=a prefix-preserving "
                                          r"template file, or env.tool_format=chatml \(docs/environments.md\)$"):
        choose("auto", tokenizer(SHIFTING_TEMPLATE), SCHEMAS)
    assert choose("chatml", tokenizer(SHIFTING_TEMPLATE), SCHEMAS).name == "chatml"


def test_an_unknown_format_names_the_choices():
    with pytest.raises(ConfigError, match=r"env.tool_format \('xml'\) must be auto, template or chatml"):
        choose("xml", tokenizer(), SCHEMAS)


@pytest.mark.parametrize("text, calls", [
    ("The answer is 4.", []),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>',
     [ToolCall("multiply", {"a": 2, "b": 3})]),
    ('a <tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call> b <tool_call>{"name": "g"}</tool_call>',
     [ToolCall("f", {"x": 1}), ToolCall("g", {})]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', [ToolCall("f", {"x": 1})]),  # EOS before the closing tag
], ids=["answer", "one-call", "two-calls-string-arguments", "unclosed"])
def test_calls_are_read_from_tool_call_blocks(text, calls):
    assert choose("chatml", tokenizer(), SCHEMAS).parse(text) == calls


def test_malformed_blocks_are_calls_that_failed():
    (bad,) = choose("chatml", tokenizer(), SCHEMAS).parse("<tool_call>{name: f}</tool_call>")
    assert bad.name == "unknown" and bad.error.startswith("the tool call is not valid JSON")


def test_the_parser_is_the_one_that_reads_back_the_calls_the_template_writes():
    text = '{"name": "multiply", "parameters": {"a": 2, "b": 3}}'  # Llama 3.x writes its calls so
    expected = [ToolCall("multiply", {"a": 2, "b": 3})]
    llama = choose("template", tokenizer(QUOTING_TEMPLATE), SCHEMAS)
    hermes = choose("template", tokenizer(TOOLS_TEMPLATE), SCHEMAS)
    assert (llama.parser, hermes.parser) == ("llama3_json", "hermes")
    assert llama.parse(text) == expected
    assert hermes.parse(text) == [] and choose("chatml", tokenizer(), SCHEMAS).parse(text) == []


def test_a_template_that_shows_tools_but_writes_no_calls_is_refused():
    # its calls would be read by a guess; the fix is a template that writes them
    template = TOOLS_TEMPLATE.replace(HERMES_CALLS, "")
    with pytest.raises(ConfigError, match=r"^env.tool_format=template: the chat template writes an assistant "
                                          r"message's tool_calls in no form a parser here reads .* set "
                                          r"data.chat_template=a template file that writes calls in one of them"):
        choose("auto", tokenizer(template), SCHEMAS)
