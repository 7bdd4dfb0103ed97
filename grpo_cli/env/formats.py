"""Tool-call formats: how the prompt shows the tools, how calls are read from the model's text, and what text the
environment adds after a turn (`env.tool_format`).

- `template`: the model's own chat template, for one that renders `tools` (Qwen2.5/3/3.5, Llama 3.x, Mistral and
  most current models). `auto` picks it when rendering a conversation with the tools differs from rendering it
  without them. Its parser is the model family's (grpo_cli.env.parsers): the one that reads back a call the
  template itself writes (an assistant message's `tool_calls`, rendered once when the format is chosen); a template
  that writes calls in no form a parser reads is refused. A template that is not prefix-preserving (an earlier turn
  renders differently once a tool result follows) gets TRL's training change swapped in where one is known
  (Qwen3's: every assistant turn after the question keeps its thinking block), else it is refused.
- `chatml`: the built-in format, for a ChatML template that ignores tools (the embedded SmolLM2's). `auto` picks it
  only for a template that writes ChatML turns itself, and either setting needs a tokenizer with ChatML's tokens
  (`<|im_start|>`, `<|im_end|>`): on any other template or tokenizer that ignores tools (Llama 3's, Gemma's) no
  format fits, and the refusal is one line naming the fix rather than train on turns the model never saw. The
  system turn lists the tools' JSON schemas between `<tools>` and `</tools>` and says how to call one; the model
  calls with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one block per call; SmolLM2's own list,
  `<tool_call>[{...}, {...}]</tool_call>`, reads too); each result comes back in its own `tool` turn
  (`<|im_start|>tool\\n...<|im_end|>`), followed by the next `<|im_start|>assistant\\n`. A system message of the
  prompt comes first in that system turn, the tools after it.

A call that cannot be read (bad JSON, no name) is a call that failed: its error goes back to the model.

What the environment adds after a turn is rendered once, as the difference between the template applied to a
stand-in conversation with the tool messages and without them; the text between the end of the assistant's
content and that difference (the template's end of turn, less the EOS the model sampled itself) comes first. Its
token ids are appended to the sampled ones; the conversation is never rendered and tokenized again, so the ids
the trainer scores are the ids the engine saw (grpo_cli.env.episode). The tool messages carry ids numbered within
the turn (`tool_call_id`), for templates that render them (Mistral's).

A tool's result, and every message of the prompt (where env=class's first observation goes), is text: it is
tokenized with special-token strings kept as text (`split_special_tokens`, as plain prompts are,
grpo_cli.rollout.encode_prompts), so a result spelling `<|im_end|>\n<|im_start|>assistant\n` cannot open a turn.
Only the template's own text around it becomes control tokens. Rendered text comes as pieces, `(text, is_message)`
(`Pieces`): each message's text as the template placed it, found by rendering it among marks that stand in for
the other messages.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.env.limits import FORMATS
from grpo_cli.env.parsers import PARSERS, Types, parse, types_of
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

# a stand-in assistant content, found again in the rendering to see where the template ends the turn
_MARK = "\x00grpo-cli-turn\x00"
# rendered text as pieces: (text, True) for a message's text, tokenized as text; (text, False) for the template's
Pieces = list[tuple[str, bool]]
# the call the template is asked to write when the format is chosen, to find the parser that reads it back
_PROBE = ToolCall("grpo_cli_probe", {"x": 1, "y": "a b"})
_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


class NotPrefixPreserving(ConfigError):
    """The template renders the turns before a tool result differently once one follows."""


def tool_call_id(i: int) -> str:
    """The id of the i-th call of a turn, on its result's tool message: 9 letters and digits, the form Mistral's
    template requires."""
    return f"call{i:05d}"


@dataclass(frozen=True)
class ToolFormat:
    """`name` is template or chatml; `chat_template` None renders with the tokenizer's own template (for a run, the
    text of data.chat_template when it names one), else this text (the built-in format's, or a training template
    swapped in); `variables` are the template's variables, data.chat_template_kwargs, in every render: the prompt
    and each stand-in conversation the environment's text is cut from. `parser` names the family's parser
    (grpo_cli.env.parsers.PARSERS; the built-in format reads SmolLM2's list form too); `types` are the tools'
    declared argument types, for a parser whose values are text; `note` says what was changed, when anything was."""

    name: str
    chat_template: str | None
    variables: dict = field(default_factory=dict)
    parser: str = "smollm2"
    types: Types = field(default_factory=dict)
    note: str = ""

    def render(self, tokenizer: Any, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=self.chat_template,
                                             tokenize=False, add_generation_prompt=generation_prompt,
                                             **self.variables)

    def parse(self, text: str) -> list[ToolCall]:
        """The calls of one assistant turn's text (EOS removed); [] when it answers without one."""
        return parse(self.parser, text, self.types)

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
            messages = [{"role": "tool", "name": r.name, "content": t, "tool_call_id": tool_call_id(i)}
                        for i, (r, t) in enumerate(zip(results, texts, strict=True))]
            return self.render(tokenizer, [user, assistant, *messages], tools, True)

        refused = NotPrefixPreserving(
            f"env.tool_format={self.name}: the chat template renders the turns before a tool result differently "
            f"once one follows (it is not prefix-preserving), so what the environment adds cannot be appended to "
            f"the sampled tokens, and no training template is known for it; "
            f"{_fixes(tokenizer, 'a prefix-preserving template file')}")
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


def chatml_tokenizer(tokenizer: Any) -> bool:
    """Whether the tokenizer has ChatML's turn tokens (`<|im_start|>`, `<|im_end|>`) as tokens of their own."""
    try:
        added = tokenizer.get_added_vocab()
    except Exception:  # a tokenizer without added tokens
        return False
    return all(token in added for token in _CHATML_TOKENS)


def _fixes(tokenizer: Any, template: str = "a template file that renders tools") -> str:
    """The fixes a refusal names: another template, and the built-in format where the tokenizer is ChatML."""
    fixes = f"set data.chat_template={template}"
    return fixes + (", or env.tool_format=chatml" if chatml_tokenizer(tokenizer) else "") + " (docs/environments.md)"


# TRL's training change for Qwen3's template (trl/chat_templates/qwen3_training.jinja, its README): the thinking
# block of an assistant turn after the question is written whether or not the turn is the last, so a tool result
# that follows no longer takes it away; and reasoning is split out only when both tags are present
_QWEN3_THINKING = re.compile(
    r"\{%-?\s*if loop\.index0 > ns\.last_query_index\s*-?%\}\s*"
    r"\{%-?\s*if loop\.last or \(not loop\.last and reasoning_content\)\s*-?%\}\s*(\{\{.*?\}\})\s*"
    r"\{%-?\s*else\s*-?%\}.*?\{%-?\s*endif\s*-?%\}\s*\{%-?\s*else\s*-?%\}.*?\{%-?\s*endif\s*-?%\}", re.S)
_QWEN3_SPLIT = ("if '</think>' in content %}", "if '<think>' in content and '</think>' in content %}")


def training_template(template: Any) -> tuple[str, str] | None:
    """(template, what changed): the training version of a chat template that is not prefix-preserving, where one
    is known (Qwen3's and the templates that share its thinking-block rule); None otherwise."""
    if not isinstance(template, str) or _QWEN3_THINKING.search(template) is None:
        return None
    patched = _QWEN3_THINKING.sub(lambda m: m.group(1), template).replace(*_QWEN3_SPLIT)
    return patched, ("the chat template is not prefix-preserving (the last assistant turn's thinking block goes "
                     "once a tool result follows), so TRL's Qwen3 training template change is used: every assistant "
                     "turn after the question keeps its thinking block")


def family_parser(fmt: ToolFormat, tokenizer: Any, tools: list[dict]) -> str:
    """The parser (a key of PARSERS) that reads back the call the template writes for an assistant message's
    `tool_calls`; ConfigError when none does (or the template writes no call)."""
    user = {"role": "user", "content": "?"}
    call = {"type": "function", "id": tool_call_id(0),
            "function": {"name": _PROBE.name, "arguments": _PROBE.arguments}}
    try:
        prompt = fmt.render(tokenizer, [user], tools, True)
        written = fmt.render(tokenizer, [user, {"role": "assistant", "content": "", "tool_calls": [call]}], tools,
                             False)
    except Exception:  # a template that cannot render a call: none is read back
        prompt = written = ""
    cut = len(os.path.commonprefix([prompt, written]))
    if cut < len(prompt):  # the turn as rendered drops part of the opening (an empty thinking block): the call
        cut = max(prompt.rfind("\n", 0, cut), prompt.rfind(">", 0, cut)) + 1  # starts after a whole line or tag
    turn = written[cut:]
    eos = tokenizer.eos_token or ""
    if eos and eos in turn:
        turn = turn[:turn.rindex(eos)]  # the model's EOS ends its sampled text
    for name in PARSERS:
        if _PROBE.name in turn and parse(name, turn) == [_PROBE]:
            return name
    raise ConfigError(f"env.tool_format=template: the chat template writes an assistant message's tool_calls in "
                      f"no form a parser here reads ({', '.join(PARSERS)}), or not at all, so the model's calls "
                      f"could not be read; {_fixes(tokenizer, 'a template file that writes calls in one of them')}")


def _checked(fmt: ToolFormat, tokenizer: Any, tools: list[dict]) -> ToolFormat:
    """`fmt` once the environment's turns can be appended with it (ConfigError else): checked once, before any
    episode, as a one-line error rather than a template's exception in the middle of a run."""
    try:
        fmt.environment_text(tokenizer, tools, [ToolResult("check", "ok", False)], tokenizer.eos_token or "")
    except ConfigError:
        raise
    except Exception as err:  # the template raises on a tool turn (jinja2's TemplateError, a missing variable)
        raise ConfigError(f"env.tool_format={fmt.name}: the chat template fails on a tool turn ({err}); "
                          f"{_fixes(tokenizer)}") from None
    return fmt


def _template(tokenizer: Any, tools: list[dict], variables: dict, types: Types) -> ToolFormat:
    """The model's own template as the format, its training version swapped in where it is not prefix-preserving,
    with the parser that reads its calls."""
    fmt = ToolFormat("template", None, variables, types=types)
    try:
        _checked(fmt, tokenizer, tools)
    except NotPrefixPreserving:
        swap = training_template(tokenizer.chat_template)
        if swap is None:
            raise
        fmt = _checked(ToolFormat("template", swap[0], variables, types=types, note=swap[1]), tokenizer, tools)
    return ToolFormat(fmt.name, fmt.chat_template, variables, family_parser(fmt, tokenizer, tools), types, fmt.note)


def choose(setting: str, tokenizer: Any, tools: list[dict], variables: dict | None = None) -> ToolFormat:
    """The format `env.tool_format` names for this tokenizer; `auto`: the template when it renders tools, chatml
    when the template is ChatML itself, else ConfigError. chatml needs a tokenizer with ChatML's tokens.
    `variables`: the template's variables (data.chat_template_kwargs), passed to every render of the format."""
    if setting not in FORMATS:
        raise ConfigError(f"env.tool_format ({setting!r}) must be auto, template or chatml; set env.tool_format=auto")
    variables, types = dict(variables or {}), types_of(tools)
    own = renders_tools(tokenizer, tools, variables)
    if setting == "template" and not own:
        raise ConfigError("env.tool_format=template, but the model's chat template ignores tools; set "
                          "env.tool_format=auto or chatml (the built-in format, docs/environments.md), or "
                          "data.chat_template=a template file that renders tools")
    if setting == "template" or (setting == "auto" and own):
        return _template(tokenizer, tools, variables, types)
    if not chatml_tokenizer(tokenizer):
        fix = "set env.tool_format=auto: the model's chat template renders tools" if own else _fixes(tokenizer)
        raise ConfigError(f"env.tool_format={setting}: the tokenizer is not ChatML (no <|im_start|> and <|im_end|> "
                          f"tokens), so the built-in chatml format would train on turns this model never saw; {fix}")
    if setting == "auto" and not writes_chatml(tokenizer, variables):
        raise ConfigError("env.tool_format=auto: the chat template ignores tools and is not ChatML, so no format "
                          "fits it (the built-in chatml would train on turns this template never writes); set "
                          "data.chat_template=a template file that renders tools, or env.tool_format=chatml to "
                          "use ChatML turns anyway (docs/environments.md)")
    return _checked(ToolFormat("chatml", CHATML_TOOLS_TEMPLATE, variables, "smollm2", types), tokenizer, tools)
