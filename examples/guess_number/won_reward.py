"""The guess-the-number reward: 1.0 when the episode's game was won within its guesses, else 0.0. It reads the
environment instance (`environments`, one per completion, as TRL passes them), not the text."""


def won(prompts, completions, environments, **kwargs):
    return [1.0 if env.won else 0.0 for env in environments]
