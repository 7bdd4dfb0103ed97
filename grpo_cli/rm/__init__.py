"""Training reward models: labeled rows, labelers, a replay buffer, and the ORM/PRM trainer.

    rows.py        labeled rows: checks, JSONL read/write, the held-out split, the replay buffer
    auc.py         the pooled and the within-prompt AUC (the ranking GRPO's groups see)
    labelers.py    problems -> policy samples -> labeled rows (the `labeler` config group)
    classifier.py  the ORM/PRM: build, load, LoRA, training, scoring, metrics, save; the `rm` settings check

    rows = OutcomeLabeler()(samples)                           # or MonteCarloLabeler / VerifierLabeler
    train, heldout = split_heldout(rows, 0.2, seed=0)
    mix, info = ReplayBuffer(folder, share=0.1).mix(iteration, train)
    model, tokenizer = new_classifier("outcome", base, tokenizer)   # or load_classifier(folder, kind)
    model = add_lora(model, r=16, alpha=32, dropout=0.0, target_modules="all-linear")
    train_classifier(model, tokenizer, mix, kind="outcome", ...)
    save_reward_model(model.merge_and_unload(), tokenizer, folder)   # reward=orm reward.name_or_path=folder

A labeled row is one JSON object (one JSONL line):

    {"prompt": "What is 3 + 4?", "completion": "7", "label": 1.0}                         # outcome (ORM)
    {"prompt": "...", "completion": "3 + 4 = 7\\n#### 7", "steps": [[9, 1.0], [16, 1.0]]}   # process (PRM)

`prompt` is the text the reward model reads before the completion: the problem's question, as
`grpo_cli.rewards.call.score` hands it to reward functions (not the chat-templated prompt). Labels are in
[0, 1] (soft labels train as soft targets). A step is `[char_end, label]`, char_end the exclusive
end of the step in the completion, as `split_steps` and `ProcessReward` give it. Other keys
(`answer`, `split`, ...) are kept and ignored.

The models are what `grpo_cli.rewards.models` loads: an ORM is an AutoModelForSequenceClassification
with one logit (score = sigmoid, read at the last token), a PRM an AutoModelForTokenClassification
with one logit per token (a step's score is read at the token holding its last character, the token
`models.TokenClassifierPRM` reads). Both are trained with binary cross-entropy, through a LoRA
adapter on the base LM plus the whole new head, and merged before saving, so the folder is a plain
transformers model (safetensors) with its tokenizer.

Labelers (the `labeler` config group) turn policy samples into rows:
  - `OutcomeLabeler`: 1 when the completion's final answer matches the reference
    (`grpo_cli.rewards.outcome.accuracy`), else 0.
  - `MonteCarloLabeler`: Math-Shepherd (Wang et al. 2023, arXiv 2312.08935): from the prefix that
    ends each step, k continuations by the policy; hard estimate = 1 if any reaches the right
    answer, soft = the fraction that do. Departure: the last step of a finished (not truncated)
    completion is labeled by the completion's own answer, with no continuations (there is nothing
    left to continue); Math-Shepherd's final step is checked against the answer the same way.
  - `VerifierLabeler`: the rule-based step verifier (`verify_steps`): a step rewarded > 0 is 1,
    < 0 is 0, and a step with reward 0 (no checkable claim, or right arithmetic cancelled by a wrong
    final answer) gets no label.

Replay (DeepSeekMath §4.2 / Algorithm 1: "continuously train the reward model with a replay mechanism
that incorporates 10% of historical data"): `ReplayBuffer` keeps each iteration's new rows in
`iteration_NNN.jsonl` and mixes a training set as the new rows plus r rows drawn, seeded, without
replacement, from the rows of earlier iterations only, where r is the whole number nearest to
n_new * share / (1 - share), halves rounded up, so that r / (n_new + r) is as close to `share` as a
whole r allows (n_new = 90, share 0.1 -> r = 10, exactly 10%; n_new = 100 -> 11.1 -> 11, 9.9%).
When earlier iterations hold fewer rows than r, all of them are used and the share is lower (the
mix reports the share it reached). share = 1 trains on all earlier rows and none of the new ones.
"""

from grpo_cli.rm.auc import PromptAUC, binary_auc, within_prompt_auc
from grpo_cli.rm.classifier import (
    AUTO_CLASS,
    KINDS,
    add_lora,
    check_settings,
    class_weight,
    classification_metrics,
    evaluate,
    load_classifier,
    new_classifier,
    predict,
    retrain,
    save_reward_model,
    starting_classifier,
    train_classifier,
)
from grpo_cli.rm.labelers import MonteCarloLabeler, OutcomeLabeler, VerifierLabeler, draw_samples, pick_problems
from grpo_cli.rm.rows import (
    ReplayBuffer,
    Row,
    check_rows,
    check_share,
    read_labeled,
    replay_count,
    split_heldout,
    write_jsonl,
)

__all__ = [
    "AUTO_CLASS", "KINDS", "MonteCarloLabeler", "OutcomeLabeler", "PromptAUC", "ReplayBuffer", "Row",
    "VerifierLabeler", "add_lora",
    "binary_auc", "check_rows", "check_settings", "check_share", "class_weight", "classification_metrics",
    "draw_samples", "evaluate", "load_classifier", "new_classifier", "pick_problems", "predict", "read_labeled",
    "replay_count", "retrain",
    "save_reward_model", "split_heldout", "starting_classifier", "train_classifier", "within_prompt_auc",
    "write_jsonl",
]
