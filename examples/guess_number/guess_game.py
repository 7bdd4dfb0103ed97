"""Guess the number: an environment class for `grpo train env=class` (TRL's environment_factory contract), whose
prompt it writes itself (`data=env`: the rows hold only the secret).

    reset(secret, **row)   the row's secret (1-15 by default; `top` in the row sets another range, `demos` the
                           number of demonstrated games, `misses` their wrong guesses before the hit): returns the
                           conversation, the demonstrated game(s) on another range and then the question
    guess(n)               the tool: "higher" (the secret is larger), "lower" or "correct"; at most 4 guesses count

Three kinds of feedback, one class each, so a run picks its game with env.factory alone:
  - GuessNumber: the true hint;
  - Uninformative: "wrong" for every wrong guess (control 1: the same training without the information);
  - Swapped: "higher" and "lower" exchanged (control 2, at eval only: a policy that reads the hint falls).
`won_reward.won` reads the instance (`won`) as the reward. Nothing here is part of grpo_cli.
"""

from __future__ import annotations

# guesses that count per game: binary search over 1..15 (2^4 - 1) needs exactly 4; a policy that ignores the
# feedback wins at most 4 of the 15 secrets whatever it guesses
MAX_GUESSES = 4
# the demonstrated games: another range than the real one, each won at the first guess, so they show how a call is
# written and what comes back, and nothing about where to guess next (the number guessed is not the middle); with
# misses (the row's `misses`), that many wrong guesses come first, in a game that answers only wrong or correct, so
# they show that a miss is followed by another guess and still nothing about which way to go
DEMO_GAMES = [(20, 24, 23, [21, 24]), (30, 36, 31, [34, 36]), (40, 44, 41, [43, 40])]


def question(low: int, high: int, hints: bool = True) -> str:
    answers = "higher (my number is larger), lower (my number is smaller) or correct" if hints else "wrong or correct"
    return (f"I am thinking of a whole number from {low} to {high}. Find it with the guess tool: it answers "
            f"{answers}. You have at most {MAX_GUESSES} guesses.")


def call(n: int) -> str:
    """A guess call as the built-in ChatML tool format writes one (grpo_cli.env.formats.CHATML_TOOLS_TEMPLATE)."""
    return f'<tool_call>\n{{"name": "guess", "arguments": {{"n": {n}}}}}\n</tool_call>'


def demonstrated(games: int, misses: int = 0) -> list[dict]:
    """`games` demonstrated games as turns: the question, the assistant's calls (`misses` wrong ones first, answered
    "wrong"), the tool's answers, its reply."""
    turns = []
    for low, high, secret, wrong in DEMO_GAMES[:games]:
        turns.append({"role": "user", "content": question(low, high, hints=not misses)})
        for n, answer in [*((m, "wrong") for m in wrong[:misses]), (secret, "correct")]:
            turns += [{"role": "assistant", "content": call(n)}, {"role": "tool", "content": answer}]
        turns.append({"role": "assistant", "content": f"It is {secret}."})
    return turns


class GuessNumber:
    """One game: the secret from the row, up to MAX_GUESSES guesses, won at the first correct one."""

    def reset(self, secret, top=15, demos=1, misses=0, **row):
        self.secret, self.top = int(secret), int(top)
        self.guesses: list[int] = []
        self.won = False
        return [*demonstrated(int(demos), int(misses)), {"role": "user", "content": question(1, self.top)}]

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: the number you guess
        """
        if self.won or len(self.guesses) >= MAX_GUESSES:
            return "the game is over"
        n = int(n)
        self.guesses.append(n)
        if n == self.secret:
            self.won = True
            return "correct"
        return self._hint("higher" if n < self.secret else "lower")

    def _hint(self, direction: str) -> str:
        return direction


class Uninformative(GuessNumber):
    """Control 1: a wrong guess is only "wrong"."""

    def _hint(self, direction: str) -> str:
        return "wrong"


class Swapped(GuessNumber):
    """Control 2: "higher" where the secret is smaller, "lower" where it is larger."""

    def _hint(self, direction: str) -> str:
        return {"higher": "lower", "lower": "higher"}[direction]
