"""Rollouts: the `Rollout` record every sampler returns and the sampler contract.

A sampler (the `sampler` config group, one `_target_`) is a `Sampler`: the shared `SamplerSettings`,
the batching loop, and an engine's `_generate`; it offers

    generate(policy, tokenizer, prompts, n, *, greedy=False, max_new_tokens=None, temperature=None,
             generator=None) -> Rollout
    sync(policy) -> None     # engines that hold their own copy of the weights refresh it here
    start(policy, section, job=None) -> section   # the engine started (sized for sizing.Job); what samples

Randomness comes from the caller's `torch.Generator` (the training loop owns one, seeded per step), never
from reseeding torch's global generator.

The trainer calls `sync` once per step before `generate` and never asks which engine it has.
Engines: `hf.HFSampler` (transformers `generate` with a shared prompt prefill) and `vllm.VLLMSampler`
(vLLM with its own copy of the weights, refreshed by `sync`; `sampler=vllm`); `engine.choose` picks one of
them for `sampler=auto`, the default, before the model loads.

Prompts are left-padded (every completion starts at the same column); position ids follow HF
generate (cumsum of the attention mask - 1, `position_ids`), and the trainer's forward
(grpo_cli.logprobs) uses the same ones, so it scores exactly the tokens the sampler produced.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from grpo_cli import fsdp
from grpo_cli.checks import Check, Rule, get, is_int, is_num
from grpo_cli.errors import ConfigError, DataError
from grpo_cli.lengths import length_fix
from grpo_cli.policy import context_length, pad_id
from grpo_cli.records import PAD, Rows, row


@dataclass
class Rollout(Rows):
    """N = B * G sequences; row i belongs to prompt i // G. Rows are picked, joined and moved by the fields'
    declarations (grpo_cli.records: take, cat with the tokenizer's pad id, to)."""

    prompt_ids: torch.Tensor = row(pad=PAD, side="left")  # [N, P] left-padded
    prompt_mask: torch.Tensor = row(side="left")  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor = row(pad=PAD)  # [N, T] right-padded with pad_token_id
    completion_mask: torch.Tensor = row()  # [N, T] 1 up to and including the EOS token
    texts: list[str] = row()  # N decoded completions, special tokens skipped
    truncated: list[bool] = row()  # N: no EOS within max_new_tokens
    # [N, T] the engine's log-prob of each sampled token under the policy's plain softmax (temperature 1,
    # no top-p/top-k: what the trainer scores), 0 on pad; engines with their own copy of the weights
    # return it (vLLM); None for HF generate, which samples from the trainer's own policy (joined with a part
    # without it: None)
    sampling_logp: torch.Tensor | None = row(default=None)
    # [N, T] 1 where the model sampled the id, 0 where an environment added it (a tool result, the template's turn
    # markers: context for attention and positions, never scored); None for plain completions, every id sampled
    sampled_mask: torch.Tensor | None = row(absent=lambda part: part.completion_mask, default=None)
    # N episode records (grpo_cli.env.Episode: messages, tool calls and failures, turns, the env=class instance),
    # one per row, when the rows are multi-turn episodes; None for plain completions
    episodes: list | None = row(absent=lambda part: [None] * len(part.texts), default=None)

    @property
    def loss_mask(self) -> torch.Tensor:
        """[N, T] the completion tokens the model sampled: what the loss, the KL, the entropy and lengths count."""
        if self.sampled_mask is None:
            return self.completion_mask
        return self.completion_mask * self.sampled_mask.to(self.completion_mask.dtype)

    @property
    def lengths(self) -> list[int]:
        """N sampled tokens per completion (an episode's environment tokens are not its length)."""
        return self.loss_mask.sum(1).tolist()

    @property
    def sampled_width(self) -> int:
        """The padded completion width in sampled tokens (dr_grpo's divisor): T, or for episodes the most sampled
        tokens of any row, so the tokens an environment added do not dilute the loss."""
        if self.sampled_mask is None:
            return self.completion_mask.shape[1]
        return int(self.loss_mask.sum(1).max()) if self.loss_mask.shape[0] else 0

    def tally(self) -> Tally:
        """What the step's metrics read of these rows, without tensors or environments: it pickles, so every rank's
        can be gathered (an env=class instance need not pickle)."""
        episodes = None if self.episodes is None else [e.counts() for e in self.episodes]
        return Tally(self.lengths, list(self.truncated), episodes)


@dataclass
class Tally(Rows):
    """A rollout's rows as the step's metrics read them (grpo_cli.metrics.stats.rollout_metrics)."""

    lengths: list[int] = row()  # N sampled tokens per completion
    truncated: list[bool] = row()  # N
    episodes: list | None = row(default=None)  # N episodes' counts (grpo_cli.env.EpisodeCounts); None: plain


@dataclass
class SamplerSettings:
    """What every engine samples with: the `sampler` group's shared keys (their values and comments live in
    conf/sampler/default.yaml, their one home: code that builds a sampler by hand composes that section)."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    max_prompt_tokens: int
    batch_size: int | None

    def settings(self) -> SamplerSettings:
        """The shared settings alone (for a fallback engine built from another's)."""
        return SamplerSettings(**{f.name: getattr(self, f.name) for f in fields(SamplerSettings)})


class Sampler(SamplerSettings):
    """The contract the trainer, eval and sample use; engines implement `_generate` (and `sync` if they hold
    their own weights)."""

    def sync(self, policy) -> None:
        """Nothing to push by default: the engine samples from the policy's own weights."""

    def gathered(self, policy) -> contextlib.AbstractContextManager:
        """The context a rollout runs in: the policy's base whole on every rank where trainer.fsdp shards it
        (fsdp.whole), as an engine that samples from the policy's own weights needs; an engine with its own copy
        of the weights (a server) needs nothing, and the ranks keep their shards."""
        return fsdp.whole(policy)

    def start(self, policy, section, job=None):
        """Start the engine before the first rollout (`job`: a `sizing.Job`, what one call will hold, for engines
        that size themselves); returns the `sampler` config section that builds what samples (`section` itself,
        unless the engine falls back to another), for the run's saved config."""
        return section

    def generate(self, policy, tokenizer, prompts: list[str], n: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, temperature: float | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """`n` completions for each prompt string (already chat-templated), rows grouped by prompt.

        At most `batch_size` sequences go through one engine call, cut at whole groups (at least one
        prompt's n completions per call), so a large step does not hold every KV cache at once.
        """
        per_call = len(prompts) if self.batch_size is None else max(1, self.batch_size // n)
        parts = [self._generate(policy, tokenizer, prompts[i:i + per_call], n, greedy=greedy,
                                max_new_tokens=max_new_tokens or self.max_new_tokens,
                                temperature=temperature or self.temperature, generator=generator)
                 for i in range(0, len(prompts), per_call)]
        return Rollout.cat(parts, pad=pad_id(tokenizer))

    def _generate(self, policy, tokenizer, prompts: list[str], n: int, *, greedy: bool, max_new_tokens: int,
                  temperature: float, generator: torch.Generator | None) -> Rollout:
        raise NotImplementedError

    def sample(self, policy, tokenizer, examples: list[dict], n: int, *, greedy: bool = False,
               generator: torch.Generator | None = None, temperature: float | None = None,
               max_new_tokens: int | None = None) -> Rollout:
        """`n` completions for each example (its chat `messages`), rows grouped by example: what a training step,
        eval and sample draw; `episodes.EpisodeSampler` answers the same call with multi-turn episodes."""
        return self.generate(policy, tokenizer, render_prompts(tokenizer, [e["messages"] for e in examples]), n,
                             greedy=greedy, generator=generator, temperature=temperature,
                             max_new_tokens=max_new_tokens)

    def rest(self) -> None:
        """Nothing to free between rollouts by default (vLLM's sleep mode frees its GPU memory here)."""

    def engine(self, policy, tokenizer, *, greedy: bool, generator: torch.Generator | None,
               temperature: float | None = None):
        """An engine that continues token-id sequences (grpo_cli.env.Engine), for multi-turn episodes."""
        raise ConfigError(f"{type(self).__name__} cannot run multi-turn episodes yet (env=tools or class); set "
                          f"sampler=default (HF generate)")


@contextlib.contextmanager
def drawing_from(generator: torch.Generator | None) -> Iterator[None]:
    """Run code that samples from torch's global generator (HF `generate` takes no generator) as if it drew
    from `generator`: the global state is restored afterwards and `generator` moves on by what was drawn.

    On CUDA the device generator is seeded from one draw of `generator`, so sampling there is a function of
    `generator` too (bit-exact replay on a GPU also needs deterministic kernels).
    """
    if generator is None:
        yield
        return
    cuda = torch.cuda.is_available()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        torch.set_rng_state(generator.get_state())
        if cuda:
            torch.cuda.manual_seed(int(torch.randint(0, 2**62, (1,))))
        try:
            yield
        finally:
            generator.set_state(torch.get_rng_state())


def request_seeds(generator: torch.Generator | None, count: int, n: int = 1) -> list[int]:
    """`count` vLLM request seeds drawn from `generator` (in process or on a server): vLLM gives the i-th of a
    request's n samples seed + i, so each seed stays below 2**31 - n."""
    with drawing_from(generator):
        return torch.randint(0, 2**31 - n, (count,)).tolist()


class ChatPrompt(str):
    """A chat-templated prompt that remembers which of its spans are message text.

    `parts` are (text, is_message_text) pairs that join to the string itself. `encode_prompts`
    tokenizes message text with special-token strings split into ordinary tokens, so "<|im_end|>"
    typed in a question stays text; only the template's own markup becomes control tokens.
    """

    parts: tuple[tuple[str, bool], ...]

    def __new__(cls, parts: list[tuple[str, bool]]) -> ChatPrompt:
        prompt = super().__new__(cls, "".join(text for text, _ in parts))
        prompt.parts = tuple(parts)
        return prompt


# stands in for message i while the template renders: private-use characters no template or tokenizer reads
_MARK = re.compile("\ue000(\\d+)\ue001")


# data.chat_template_kwargs of each tokenizer `use_chat_template` saw, kept here rather than set on transformers'
# object; weak, so a tokenizer's entry goes with it. Here and not passed along: every caller of render_prompts (each
# sampler engine, eval, the reward model's labelers, the prompt-length checks) holds the tokenizer and not the config
_TEMPLATE_KWARGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def use_chat_template(tokenizer, template: str | None, kwargs: dict | None) -> None:
    """Make `tokenizer` render prompts (`render_prompts`) with `template`, the text of data.chat_template, in place
    of its own (None: keep its own; transformers' own `chat_template` attribute holds it), and `kwargs`,
    data.chat_template_kwargs, as the template's variables."""
    if template is not None:
        tokenizer.chat_template = template
    _TEMPLATE_KWARGS[tokenizer] = dict(kwargs or {})


def template_kwargs(tokenizer) -> dict:
    """The variables `use_chat_template` gave `tokenizer`'s template; none for a tokenizer it never saw (a test's, a
    reward model's)."""
    return _TEMPLATE_KWARGS.get(tokenizer, {})


def render_prompts(tokenizer, conversations: list[list[dict]]) -> list[str]:
    """Chat-template each conversation, ending with the assistant's turn opened: the one place prompts are
    rendered (train's samplers, HF and vLLM alike, eval, sample, the prompt-length checks), with the template and
    variables `use_chat_template` gave the tokenizer.

    A conversation whose message text holds a special-token string comes back as a ChatPrompt; every
    other prompt is a plain string, tokenized exactly as before.
    """
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    extra = template_kwargs(tokenizer)
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **extra)
        if any(s in str(m["content"]) for m in conversation for s in specials):
            text = _mark_messages(tokenizer, conversation, text)
        prompts.append(text)
    return prompts


def _mark_messages(tokenizer, conversation: list[dict], text: str) -> ChatPrompt:
    """`text` split into template markup and message text: the template rendered once more with a mark
    in place of each message's text shows where the messages go."""
    marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(conversation)]
    skeleton = _MARK.split(tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False,
                                                         **template_kwargs(tokenizer)))
    for shape in (str, str.strip):  # some templates strip message text (Llama 3's does)
        # split() alternates markup and the captured message index
        parts = [(shape(str(conversation[int(piece)]["content"])), True) if k % 2 else (piece, False)
                 for k, piece in enumerate(skeleton) if piece]
        if "".join(t for t, _ in parts) == text:
            return ChatPrompt(parts)
    raise DataError(f"a prompt holds a special token string ({text[:100]!r}...) and this tokenizer's chat "
                    f"template rewrites message text, so it cannot be kept as plain text; remove it from the data")


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, P] and attention mask [B, P] of chat-templated prompts, left-padded.

    The message text of a ChatPrompt is tokenized with special-token strings kept as text.
    """
    rows = []
    for prompt in prompts:
        ids: list[int] = []
        for text, is_message in getattr(prompt, "parts", None) or ((prompt, False),):
            ids += tokenizer(text, add_special_tokens=False, split_special_tokens=is_message).input_ids
        rows.append(ids)
    pad = pad_id(tokenizer)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, prompt_row in enumerate(rows):
        ids[i, width - len(prompt_row):] = torch.tensor(prompt_row, dtype=torch.long)
        mask[i, width - len(prompt_row):] = 1
    return ids, mask


def finish(tokenizer, prompt_ids, prompt_mask, completion, eos: int, pad: int) -> Rollout:
    """A Rollout from raw completions: everything after the first EOS masked; no EOS = truncated."""
    is_eos = completion == eos
    has_eos = is_eos.any(1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(1), completion.shape[1])  # [N]
    cols = torch.arange(completion.shape[1], device=completion.device)
    mask = (cols[None, :] <= first_eos[:, None]).long()  # [N, T], EOS itself included
    completion = completion.masked_fill(mask == 0, pad)
    # one copy to the host for decoding, not a device sync per row
    ids, keep = completion.cpu(), mask.cpu().bool()
    texts = tokenizer.batch_decode([row[m] for row, m in zip(ids, keep)], skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, completion, mask, texts, (~has_eos).tolist())


# ---- config checks: this module's settings, collected by config.validate --------------------------------

def check_lengths(cfg) -> list[str]:
    """The longest prompt plus the longest completion (an episode's: env.max_episode_tokens) must fit what the
    engine holds: vLLM's
    sampler.max_model_len when set, else the model's context, when its config says it without loading the
    weights (else lengths.check_prompts checks it once the model is loaded). An engine that held fewer
    would cut completions short without a word (vLLM does) or fail mid-run."""
    prompt, new = get(cfg, "sampler.max_prompt_tokens")[1], get(cfg, "sampler.max_new_tokens")[1]
    eval_new = get(cfg, "eval.max_new_tokens")[1]  # eval's own generation length, when it sets one
    new, key = (eval_new, "eval.max_new_tokens") if is_int(eval_new) else (new, "sampler.max_new_tokens")
    episode = get(cfg, "env.max_episode_tokens")[1]  # episodes (env=tools or class): every token after the prompt
    if get(cfg, "env._target_")[1] and is_int(episode):
        new, key = episode, "env.max_episode_tokens"
    if not (is_int(prompt) and is_int(new) and prompt >= 1 and new >= 1) or get(cfg, "model")[1] is None:
        return []  # the rules above report a bad value
    context, model_len = context_length(cfg.model), get(cfg, "sampler.max_model_len")[1]
    errors = []
    if is_int(model_len) and context is not None and model_len > context:
        errors.append(f"sampler.max_model_len ({model_len}) is longer than the model's context of {context} "
                      f"tokens; set sampler.max_model_len={context} or null")
    limit, what = ((model_len, "sampler.max_model_len") if is_int(model_len) and model_len >= 1
                   else (context, "the model's context"))
    if limit is not None and prompt + new > limit:
        errors.append(f"sampler.max_prompt_tokens ({prompt}) + {key} ({new}) exceed {what} "
                      + (f"({limit} tokens)" if what.startswith("sampler") else f"of {limit} tokens")
                      + f": completions would be cut short; {length_fix(prompt, new, limit, key)}")
    return errors


CHECKS: list[Check] = [
    Rule("sampler.temperature", lambda v: is_num(v) and v > 0,
         "must be > 0 (for greedy decoding use a small value such as 1e-5 or eval's greedy pass); "
         "set sampler.temperature=1.0"),
    Rule("sampler.top_p", lambda v: is_num(v) and 0 < v <= 1, "must be in (0, 1]; set sampler.top_p=1.0"),
    Rule("sampler.top_k", lambda v: is_int(v) and v >= 0, "must be an integer >= 0 (0: off); set sampler.top_k=0"),
    Rule("sampler.max_new_tokens", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1; set sampler.max_new_tokens=64"),
    Rule("sampler.batch_size", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 or null (one call per step); set sampler.batch_size=null"),
    Rule("sampler.max_prompt_tokens", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1; set sampler.max_prompt_tokens=1024"),
    check_lengths,
]
