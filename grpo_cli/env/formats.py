"""Tool-call formats: how the prompt shows the tools, how calls are read from the model's text, and what text the
environment adds after a turn (`env.tool_format`).

- `template`: the model's own chat template, for one that renders `tools` (Qwen2.5/3, Llama 3.x and most current
  models). `auto` picks it when rendering a conversation with the tools differs from rendering it without them.
- `chatml`: the built-in format, for a ChatML template that ignores tools (the embedded SmolLM2's). `auto` picks it
  only for a template that writes ChatML turns itself; on any other template that ignores tools (Gemma's
  `<start_of_turn>`) no format fits, and `auto` is one line naming the fixes rather than train on turns the
  model's template never writes. The system turn lists the tools' JSON schemas between `<tools>` and `</tools>`
  and says how to call one; the model calls with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one
  block per call); each result comes back in its own `tool` turn (`<|im_start|>tool\\n...<|im_end|>`), followed by
  the next `<|im_start|>assistant\\n`. A system message of the prompt comes first in that system turn, the tools
  after it.

Calls are read from `<tool_call>` blocks in both formats; under `template` a turn that is one bare JSON object with
a `name` and `arguments` (or `parameters`, Llama 3.x's key) is a call too. A block whose JSON does not parse, or
lacks a name, is a call that failed: its error goes back to the model.

What the environment adds after a turn is rendered once, as the difference between the template applied to a
stand-in conversation with the tool messages and without them; the text between the end of the assistant's
content and that difference (the template's end of turn, less the EOS the model sampled itself) comes first. Its
token ids are appended to the sampled ones; the conversation is never rendered and tokenized again, so the ids
the trainer scores are the ids the engine saw (grpo_cli.env.episode).

A tool's result, and every message of the prompt (where env=class's first observation goes), is text: it is
tokenized with special-token strings kept as text (`split_special_tokens`, as plain prompts are,
grpo_cli.rollout.encode_prompts), so a result spelling `<|im_end|>\n<|im_start|>assistant\n` cannot open a turn.
Only the template's own text around it becomes control tokens. Rendered text comes as pieces, `(text, is_message)`
(`Pieces`): each message's text as the template placed it, found by rendering it among marks that stand in for
the other messages.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.env.limits import FORMATS
from grpo_cli.env.tools import ToolCall, ToolResult
from grpo_cli.errors import ConfigError

CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call these functions; their JSON schemas:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '</tools>\\n\\nTo call one, write a JSON object with its name and arguments between <tool_call> and "
    "</tool_call>:\\n<tool_call>\\n{\"name\": \"function_name\", \"arguments\": {\"argument\": \"value\"}}\\n"
    "</tool_call>\\nEach result comes back in a tool turn. Answer without a tool call when you are done.'"
    " + '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
# a stand-in assistant content, found again in the rendering to see where the template ends the turn
_MARK = "\x00grpo-cli-turn\x00"
# rendered text as pieces: (text, True) for a message's text, tokenized as text; (text, False) for the template's
Pieces = list[tuple[str, bool]]


@dataclass(frozen=True)
class ToolFormat:
    """`name` is template or chatml; `chat_template` None renders with the tokenizer's own template (for a run, the
    text of data.chat_template when it names one); `variables` are the template's variables, data.chat_template_kwargs,
    in every render: the prompt and each stand-in conversation the environment's text is cut from."""

    name: str
    chat_template: str | None
    variables: dict = field(default_factory=dict)

    def render(self, tokenizer: Any, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=self.chat_template,
                                             tokenize=False, add_generation_prompt=generation_prompt,
                                             **self.variables)

    def parse(self, text: str) -> list[ToolCall]:
        """The calls of one assistant turn's text (EOS removed); [] when it answers without one."""
        blocks = _BLOCK.findall(text)
        if blocks:
            return [_call(body) for body in blocks]
        stripped = text.strip()
        if self.name == "template" and stripped.startswith("{") and stripped.endswith("}"):
            call = _call(stripped)
            return [call] if call.error is None else []
        return []

    def prompt_pieces(self, tokenizer: Any, messages: list[dict], tools: list[dict]) -> Pieces:
        """The prompt rendered with the assistant's turn opened, each message's text a piece of its own."""
        texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]

        def render(contents: list[str]) -> str:
            it = iter(contents)
            return self.render(tokenizer, [{**m, "content": next(it)} if isinstance(m.get("content"), str) else m
                                           for m in messages], tools, True)

        return _pieces(render, texts, self.name)

    def environment_pieces(self, tokenizer: Any, tools: list[dict], results: list[ToolResult],
                           eos_text: str) -> Pieces:
        """What the environment adds after an assistant turn that ended with `eos_text`: the rest of the
        template's end of turn, the tool turns (each result's text a piece of its own), and the next assistant
        turn's opening."""
        user, assistant = {"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}
        before = self.render(tokenizer, [user, assistant], tools, False)

        def after(texts: list[str]) -> str:
            messages = [{"role": "tool", "name": r.name, "content": t} for r, t in zip(results, texts, strict=True)]
            return self.render(tokenizer, [user, assistant, *messages], tools, True)

        refused = ConfigError(f"env.tool_format={self.name}: the chat template renders the turns before a tool "
                              f"result differently once one follows, so what the environment adds cannot be "
                              f"appended to the sampled tokens; set env.tool_format=chatml")
        if not after([r.text for r in results]).startswith(before):
            raise refused
        pieces = _pieces(after, [r.text for r in results], self.name)
        if not pieces[0][0].startswith(before):  # the tool turns' own markup follows the turns before
            raise refused
        closing = before[before.rindex(_MARK) + len(_MARK):]
        if eos_text and closing.startswith(eos_text):
            closing = closing[len(eos_text):]  # the model sampled the EOS itself: it is in the sampled ids
        return [(closing + pieces[0][0][len(before):], False), *pieces[1:]]

    def environment_text(self, tokenizer: Any, tools: list[dict], results: list[ToolResult], eos_text: str) -> str:
        """`environment_pieces` as one text."""
        return "".join(text for text, _ in self.environment_pieces(tokenizer, tools, results, eos_text))


def _pieces(render: Callable[[list[str]], str], texts: list[str], name: str) -> Pieces:
    """`render(texts)` cut into the template's text and each of `texts` as the template placed it (a template may
    strip it, or quote it as JSON, as Llama 3.1's does a tool's result). The template's own text is what it renders
    around marks that stand in for the texts; text i is what it renders between those marks with text i in its
    place. The marks carry a fresh random key, so no text can spell one."""
    key = secrets.token_hex(8)
    marks = [f"\ue000{key}.{i}\ue001" for i in range(len(texts))]
    split = re.split(f"\ue000{key}\\.(\\d+)\ue001", render(marks))
    around = split[0::2]  # the template's text before the first mark, between two, after the last
    pieces: Pieces = [(around[0], False)]
    if split[1::2] == [str(i) for i in range(len(texts))]:  # each mark once, in order
        for i, text in enumerate(texts):
            one = render(marks[:i] + [text] + marks[i + 1:])
            start = one.find(marks[i - 1]) + len(marks[i - 1]) if i else 0
            end = one.find(marks[i + 1]) if i + 1 < len(texts) else len(one)
            span, left, right = one[start:end], around[i], around[i + 1]
            if end < 0 or len(span) < len(left) + len(right) or not (span.startswith(left) and span.endswith(right)):
                break
            pieces += [(span[len(left):len(span) - len(right)], True), (right, False)]
    if len(pieces) != 2 * len(texts) + 1 or "".join(p for p, _ in pieces) != render(texts):
        raise ConfigError(f"env.tool_format={name}: the chat template changes its own text with a message's "
                          f"text, so a tool's result cannot be kept apart from the turns' control tokens; set "
                          f"env.tool_format=chatml")
    return [(p, message) for p, message in pieces if p]


def _call(body: str) -> ToolCall:
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError as err:
        return ToolCall("unknown", error=f"the tool call is not valid JSON ({err.msg} at character {err.pos}); "
                                         f"write <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("unknown", error="the tool call has no \"name\"; write "
                                         "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>")
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return ToolCall(data["name"], arguments)


def renders_tools(tokenizer: Any, tools: list[dict], variables: dict | None = None) -> bool:
    """Whether the tokenizer's own chat template shows `tools` (rendered with and without them, compared), given
    the template's `variables`."""
    messages = [{"role": "user", "content": "?"}]
    variables = variables or {}
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
        with_tools = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                   **variables)
    except Exception:  # no chat template at all, or one that cannot take these messages
        return False
    return plain != with_tools


def writes_chatml(tokenizer: Any, variables: dict | None = None) -> bool:
    """Whether the tokenizer's own chat template writes ChatML turns (`<|im_start|>user\\n...<|im_end|>`, then the
    assistant's opened with `<|im_start|>assistant\\n`), given the template's `variables`."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False,
                                             add_generation_prompt=True, **(variables or {}))
    except Exception:  # no chat template at all, or one that cannot take this message
        return False
    user = "<|im_start|>user\n?<|im_end|>"
    return user in text and "<|im_start|>assistant\n" in text[text.index(user):]


def choose(setting: str, tokenizer: Any, tools: list[dict], variables: dict | None = None) -> ToolFormat:
    """The format `env.tool_format` names for this tokenizer; `auto`: the template when it renders tools, chatml
    when the template is ChatML itself, else ConfigError. `variables`: the template's variables
    (data.chat_template_kwargs), passed to every render of the format."""
    if setting not in FORMATS:
        raise ConfigError(f"env.tool_format ({setting!r}) must be auto, template or chatml; set env.tool_format=auto")
    variables = dict(variables or {})
    own = renders_tools(tokenizer, tools, variables)
    if setting == "template" and not own:
        raise ConfigError("env.tool_format=template, but the model's chat template ignores tools; set "
                          "env.tool_format=auto or chatml (the built-in format, docs/environments.md), or "
                          "data.chat_template=a template file that renders tools")
    if setting == "auto" and not own and not writes_chatml(tokenizer, variables):
        raise ConfigError("env.tool_format=auto: the chat template ignores tools and is not ChatML, so no format "
                          "fits it (the built-in chatml would train on turns this template never writes); set "
                          "data.chat_template=a template file that renders tools, or env.tool_format=chatml to "
                          "use ChatML turns anyway (docs/environments.md)")
    fmt = ToolFormat("template", None, variables) if setting == "template" or (setting == "auto" and own) else \
        ToolFormat("chatml", CHATML_TOOLS_TEMPLATE, variables)
    # the template must let the environment's turns be appended: checked once here, before any episode
    fmt.environment_text(tokenizer, tools, [ToolResult("check", "ok", False)], tokenizer.eos_token or "")
    return fmt
