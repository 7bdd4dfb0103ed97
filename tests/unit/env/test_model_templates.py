"""Tool formats on the real chat templates of each model family (tests/data/chat_templates/README.md says where
each comes from and its licence): the format picks the family's parser; a call the template writes is read back;
the calls read render the same turn again; and prompt + the model's turn + what the environment adds is the
template's own rendering of the conversation with the tool's result. The tokenizers are character-level stand-ins
that carry each family's special tokens (no hub here); SmolLM2's is the real one, from the embedded model.

Qwen3's template as shipped is not prefix-preserving: TRL's training change is swapped in. Llama 3's template
ignores tools on a tokenizer without ChatML's tokens: no format fits, and the refusal names the fix."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from grpo_cli.env import Limits, Toolbox, run_episodes
from grpo_cli.env.formats import choose, tool_call_id
from grpo_cli.env.tools import ToolCall, ToolResult, tool_from
from grpo_cli.errors import ConfigError

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>"]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


@dataclass(frozen=True)
class Family:
    template: str  # a file in tests/data/chat_templates
    specials: list[str]
    bos: str | None
    eos: str
    parser: str  # the parser the format must pick for it


FAMILIES = {
    "qwen2.5": Family("qwen2_5_training.jinja", CHATML, None, "<|im_end|>", "hermes"),
    "qwen3": Family("qwen3.jinja", CHATML, None, "<|im_end|>", "hermes"),
    "qwen3.5": Family("qwen3_5_nothink.jinja", CHATML, None, "<|im_end|>", "qwen3_xml"),
    "llama3.1": Family("llama3_1.jinja", LLAMA, "<|begin_of_text|>", "<|eot_id|>", "llama3_json"),
    "mistral": Family("mistral.jinja", MISTRAL, "<s>", "</s>", "mistral"),
}


def family_tokenizer(specials: list[str], bos: str | None, eos: str, template: str) -> PreTrainedTokenizerFast:
    """One token per printable character plus the family's special tokens, with its real chat template."""
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(["<unk>", *specials, *chars])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = (TEMPLATES / template).read_text(encoding="utf-8")
    return tok


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


MULTIPLY = tool_from(multiply, "test")
SCHEMAS = [MULTIPLY.schema]
USER = {"role": "user", "content": "What is 2 * 3?"}


def calling(calls: list[ToolCall], ids: list[str]) -> dict:
    """An assistant message with `calls` as tool_calls, each with its id (Mistral's template renders them)."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": i, "function": {"name": c.name, "arguments": c.arguments}}
        for c, i in zip(calls, ids, strict=True)]}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_call_the_familys_template_writes_is_read_back_and_round_trips(name):
    family = FAMILIES[name]
    tok = family_tokenizer(family.specials, family.bos, family.eos, family.template)
    fmt = choose("auto", tok, SCHEMAS)
    assert (fmt.name, fmt.parser) == ("template", family.parser)

    call, ids = [ToolCall("multiply", {"a": 2, "b": 3})], [tool_call_id(0)]
    prompt = "".join(p for p, _ in fmt.prompt_pieces(tok, [USER], SCHEMAS))
    rendered = fmt.render(tok, [USER, calling(call, ids)], SCHEMAS, False)
    assert rendered.startswith(prompt)
    turn = rendered[len(prompt):]
    sampled = turn[:turn.rindex(family.eos)]  # what the model writes before its EOS
    read = fmt.parse(sampled)
    assert read == call, sampled
    # the calls read render the same turn again
    assert fmt.render(tok, [USER, calling(read, ids)], SCHEMAS, False) == rendered
    # the episode's text (prompt, the model's turn and EOS, what the environment adds) is the template's own
    # rendering of the conversation with the tool's result
    added = fmt.environment_text(tok, SCHEMAS, [ToolResult("multiply", "6", False)], family.eos)
    result = {"role": "tool", "name": "multiply", "content": "6", "tool_call_id": ids[0]}
    assert prompt + sampled + family.eos + added == fmt.render(tok, [USER, calling(call, ids), result], SCHEMAS, True)


class Replies:
    """An engine that answers each episode's turns from a script of texts, each ended by the EOS id."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.eos_token_id, self.texts = tokenizer, tokenizer.eos_token_id, list(texts)

    def continue_batch(self, sequences: list[list[int]], max_new: int) -> list[list[int]]:
        return [self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [self.eos_token_id]
                for _ in sequences]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_episode_runs_the_call_the_model_writes_in_its_familys_form(name):
    family = FAMILIES[name]
    tok = family_tokenizer(family.specials, family.bos, family.eos, family.template)
    fmt = choose("auto", tok, SCHEMAS)
    prompt = "".join(p for p, _ in fmt.prompt_pieces(tok, [USER], SCHEMAS))
    turn = fmt.render(tok, [USER, calling([ToolCall("multiply", {"a": 2, "b": 3})], [tool_call_id(0)])], SCHEMAS,
                      False)[len(prompt):]
    engine = Replies(tok, [turn[:turn.rindex(family.eos)], "It is 6."])  # the model's call, then its answer
    limits = Limits(max_turns=4, max_tool_calls=8, max_episode_tokens=2048, tool_timeout_s=5.0, max_result_chars=99)
    (ep,) = run_episodes(engine, tok, fmt, [[USER]], [Toolbox({MULTIPLY.name: MULTIPLY})], limits)
    assert (ep.tool_calls, ep.tool_failures, ep.stop) == (1, 0, "answer")
    assert ep.messages[1] == {"role": "tool", "name": "multiply", "content": "6"}


def test_two_calls_in_a_turn_round_trip_where_the_family_writes_several():
    for name in ("qwen2.5", "qwen3.5", "mistral"):  # Llama 3.1's template raises on more than one call per turn
        family = FAMILIES[name]
        tok = family_tokenizer(family.specials, family.bos, family.eos, family.template)
        fmt = choose("auto", tok, SCHEMAS)
        calls = [ToolCall("multiply", {"a": 2, "b": 3}), ToolCall("multiply", {"a": 4, "b": 5})]
        ids = [tool_call_id(0), tool_call_id(1)]
        prompt = "".join(p for p, _ in fmt.prompt_pieces(tok, [USER], SCHEMAS))
        turn = fmt.render(tok, [USER, calling(calls, ids)], SCHEMAS, False)[len(prompt):]
        assert fmt.parse(turn[:turn.rindex(family.eos)]) == calls, name


def test_qwen3s_template_is_not_prefix_preserving_so_trls_training_change_is_swapped_in():
    family = FAMILIES["qwen3"]
    tok = family_tokenizer(family.specials, family.bos, family.eos, family.template)
    shipped = tok.chat_template
    turn = {"role": "assistant", "content": "It is 6."}
    tool = {"role": "tool", "name": "multiply", "content": "6"}
    # as shipped: the last assistant turn gets an empty thinking block, which goes once a tool result follows
    alone = tok.apply_chat_template([USER, turn], tokenize=False)
    followed = tok.apply_chat_template([USER, turn, tool], tokenize=False)
    assert "<think>\n\n</think>\n\nIt is 6." in alone and not followed.startswith(alone)
    fmt = choose("auto", tok, SCHEMAS)
    assert fmt.chat_template is not None and fmt.chat_template != shipped and "training" in fmt.note
    # the training change keeps the thinking block on every assistant turn after the question
    alone = fmt.render(tok, [USER, turn], SCHEMAS, False)
    assert fmt.render(tok, [USER, turn, tool], SCHEMAS, True).startswith(alone)
    assert "<think>\n\n</think>\n\nIt is 6.<|im_end|>" in alone
    assert tok.chat_template == shipped  # the tokenizer itself is left as it was


def test_a_template_without_tools_on_a_tokenizer_that_is_not_chatml_is_refused_naming_the_fix():
    # Meta-Llama-3-8B-Instruct's template renders no tools; the tokenizer has no <|im_start|>
    tok = family_tokenizer(LLAMA, "<|begin_of_text|>", "<|eot_id|>", "llama3.jinja")
    for setting in ("auto", "chatml"):
        with pytest.raises(ConfigError) as err:
            choose(setting, tok, SCHEMAS)
        line = str(err.value)
        assert "\n" not in line and line.startswith(f"env.tool_format={setting}: "), line
        assert "data.chat_template=" in line, line
        assert "or env.tool_format=chatml" not in line, line  # chatml is no fix on this tokenizer
    # chatml named on a template that renders tools: the model's own template is the fix
    llama = FAMILIES["llama3.1"]
    with pytest.raises(ConfigError, match=r"^env.tool_format=chatml: the tokenizer is not ChatML .* set "
                                          r"env.tool_format=auto: the model's chat template renders tools$"):
        choose("chatml", family_tokenizer(llama.specials, llama.bos, llama.eos, llama.template), SCHEMAS)


def test_smollm2s_list_format_on_its_real_template_round_trips(smollm2_tokenizer):
    tok = smollm2_tokenizer
    fmt = choose("auto", tok, SCHEMAS)  # SmolLM2's template ignores tools and is ChatML: the built-in format
    assert (fmt.name, fmt.parser) == ("chatml", "smollm2")
    calls = [ToolCall("multiply", {"a": 2, "b": 3}), ToolCall("multiply", {"a": 4, "b": 5})]
    written = "<tool_call>" + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls]) + "</tool_call>"
    prompt = "".join(p for p, _ in fmt.prompt_pieces(tok, [USER], SCHEMAS))
    rendered = fmt.render(tok, [USER, {"role": "assistant", "content": written}], SCHEMAS, False)
    assert rendered.startswith(prompt)
    turn = rendered[len(prompt):]
    sampled = turn[:turn.rindex(tok.eos_token)]
    read = fmt.parse(sampled)
    assert read == calls
    again = "<tool_call>" + json.dumps([{"name": c.name, "arguments": c.arguments} for c in read]) + "</tool_call>"
    assert again == sampled


def test_the_swapped_template_is_said_in_one_line(monkeypatch):
    from grpo_cli.rollout import episodes

    family = FAMILIES["qwen3"]
    tok = family_tokenizer(family.specials, family.bos, family.eos, family.template)
    printed = []
    monkeypatch.setattr(episodes.console, "print", lambda text, **kw: printed.append(text))
    fmt = episodes.said(choose("auto", tok, SCHEMAS))
    assert printed == [f"tools: {fmt.note}"] and "\n" not in printed[0]
    episodes.said(choose("chatml", family_tokenizer(CHATML, None, "<|im_end|>", "qwen3.jinja"), SCHEMAS))
    assert len(printed) == 1  # nothing changed, nothing said
