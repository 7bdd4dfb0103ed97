"""A user's tool file for the tests of tool-calling runs: `multiply`, a typed and documented tool (what env.tools
needs), and an HF generate sampler whose first turn calls it.

The tiny random model never writes a tool call, so `FirstTurnCalls` continues a sequence that has no call yet with
`call` and EOS (its ids enter the episode as if sampled); every later turn is HF generate's own. A test in this
process patches it in (tests.helpers.tools.first_turn_calls: every episode calls). A run in processes of its own
(torchrun) gets this file copied into its folder as scripted_tools.py (`sampler._target_=scripted_tools.Sampler`,
`env.tools=[scripted_tools.multiply]`), where only an episode whose prompt ids sum to an even number calls, so some
episodes call and some answer. It imports nothing but grpo_cli, as a user's file would.
"""

from __future__ import annotations

from grpo_cli.rollout.hf import HFEngine, HFSampler

TOOL_CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 4, "b": 3}}</tool_call>'


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class FirstTurnCalls(HFEngine):
    call = TOOL_CALL

    def scripted(self, sequence: list[int]) -> bool:
        return True

    def continue_batch(self, sequences, max_new):
        new = super().continue_batch(sequences, max_new)
        call = (self.tokenizer(self.call, add_special_tokens=False)["input_ids"] + [self.eos_token_id])[:max_new]
        return [call if self.call not in self.tokenizer.decode(seq) and self.scripted(seq) else ids
                for seq, ids in zip(sequences, new)]


class EvenEpisodesCall(FirstTurnCalls):
    def scripted(self, sequence: list[int]) -> bool:
        return sum(sequence) % 2 == 0


class Sampler(HFSampler):
    def engine(self, policy, tokenizer, *, greedy, generator, temperature=None):
        return EvenEpisodesCall(self, policy, tokenizer, greedy, generator, temperature)
