"""Rewards for examples/own_task, written as for TRL's GRPOTrainer: one score per completion."""


def uses_word(prompts, completions, word, **kwargs):
    """1.0 when the completion contains the row's `word` column (any case), else 0.0."""
    return [float(w.lower() in c.lower()) for c, w in zip(completions, word)]


def short(prompts, completions, max_words, **kwargs):
    """1.0 up to the row's `max_words` words, falling linearly to 0.0 at twice as many."""
    return [max(0.0, min(1.0, 2 - len(c.split()) / m)) for c, m in zip(completions, max_words)]
