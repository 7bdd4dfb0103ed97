"""Reward-model training (grpo_cli.rm) and `grpo rm` on the tiny random model.

Replay shares and held-out splits against hand-worked counts, Math-Shepherd labels against a hand
count (stub sampler) and a recount (tiny model), AUC against pair enumeration, save/load through
reward=orm|prm, the bad-input errors, and the command end to end.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from grpo_cli import rm as T
from grpo_cli.commands import rm
from grpo_cli.config import compose
from grpo_cli.errors import ConfigError, DataError
from grpo_cli.instantiate import build
from grpo_cli.rewards import answers_match, extract_answer, split_steps
from tests.helpers.runs import EVAL_TINY, letters, sampler_settings, write_jsonl

TINY = EVAL_TINY


def rows(n: int, prefix: str = "q", label: float = 1.0) -> list[dict]:
    return [{"prompt": f"{prefix}{i}", "completion": "c", "label": label} for i in range(n)]


# ---- replay ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_new,share,expected", [
    (90, 0.1, 10),    # 90 * 0.1 / 0.9 = 10 exactly -> 10 / 100 = 10%
    (100, 0.1, 11),   # 11.11 -> 11 (11 / 111 = 9.9%)
    (4, 0.1, 0),      # 0.44 -> 0
    (5, 0.1, 1),      # 0.56 -> 1
    (2, 0.2, 1),      # 2 * 0.25 = 0.5: a half rounds up
    (6, 0.2, 2),      # 1.5 -> 2
    (7, 0.5, 7),      # 7 * 0.5 / 0.5 = 7
    (50, 0.0, 0),
])
def test_replay_count_is_the_documented_rounding(n_new, share, expected):
    assert T.replay_count(n_new, share) == expected


def fill(buffer: T.ReplayBuffer, sizes: dict[int, int]) -> None:
    for iteration, n in sizes.items():
        buffer.add(iteration, rows(n, prefix=f"it{iteration}-"))


def test_replay_mix_takes_the_share_from_earlier_iterations_only(tmp_path):
    buffer = T.ReplayBuffer(tmp_path, share=0.1, seed=3)
    # iterations 0 and 1 are earlier; 2 is being mixed; 3 exists too (as after resuming from an
    # older checkpoint) and must never be drawn for iteration 2
    fill(buffer, {0: 30, 1: 50, 3: 40})
    new = rows(90, prefix="new-")
    mixed, info = buffer.mix(2, new)
    # 90 new -> 10 replayed: 10 / 100 = 0.1 exactly
    assert len(mixed) == 100 and info["replay"] == 10 and info["share"] == pytest.approx(0.1)
    replayed = mixed[90:]
    assert mixed[:90] == new
    assert all(r["iteration"] in (0, 1) for r in replayed)
    assert len({r["prompt"] for r in replayed}) == 10  # drawn without replacement
    assert info["earlier_available"] == 80  # 30 + 50, not the 40 of iteration 3
    # a pure function of (seed, iteration, earlier files): a resumed run draws the same rows
    assert T.ReplayBuffer(tmp_path, share=0.1, seed=3).mix(2, new)[0] == mixed
    assert T.ReplayBuffer(tmp_path, share=0.1, seed=4).mix(2, new)[0] != mixed


def test_replay_shares_across_sizes(tmp_path):
    buffer = T.ReplayBuffer(tmp_path, share=0.25, seed=0)
    fill(buffer, {0: 200})
    for n_new in (3, 10, 30, 61):
        mixed, info = buffer.mix(1, rows(n_new, prefix="new-"))
        r = info["replay"]
        assert r == T.replay_count(n_new, 0.25) == int(n_new / 3 + 0.5)  # 0.25 / 0.75 = 1/3
        # the realised share is within half a row of 0.25: |r - n/3| <= 1/2 -> |r/(n+r) - 1/4| <= 1/(2(n+r))
        assert abs(r / len(mixed) - 0.25) <= 0.5 / len(mixed) + 1e-12


def test_replay_edges(tmp_path):
    buffer = T.ReplayBuffer(tmp_path, share=0.1, seed=0)
    # iteration 0 has nothing earlier: the mix is the new rows
    assert buffer.mix(0, rows(9))[1]["replay"] == 0
    fill(buffer, {0: 30})
    # 900 new want 100 earlier rows but only 30 exist: all 30, share 30 / 930
    mixed, info = buffer.mix(1, rows(900))
    assert (info["replay"], info["replay_wanted"]) == (30, 100)
    assert info["share"] == pytest.approx(30 / 930)
    # share 1: all earlier rows and none of the new
    mixed, info = T.ReplayBuffer(tmp_path, share=1.0).mix(1, rows(9))
    assert len(mixed) == 30 and all(r["iteration"] == 0 for r in mixed) and info["share"] == 1.0
    # share 0: no replay
    assert T.ReplayBuffer(tmp_path, share=0.0).mix(1, rows(9))[1]["replay"] == 0


def test_replay_state_dict_round_trip_and_mismatch(tmp_path):
    buffer = T.ReplayBuffer(tmp_path, share=0.2, seed=5)
    fill(buffer, {0: 3, 1: 4})
    state = json.loads(json.dumps(buffer.state_dict()))  # what a checkpoint stores as JSON
    assert state["rows"] == {"0": 3, "1": 4} and buffer.next_iteration() == 2
    other = T.ReplayBuffer(tmp_path)
    other.load_state_dict(state)
    assert (other.share, other.seed) == (0.2, 5)
    buffer.add(1, rows(2))  # the folder no longer matches the checkpoint
    with pytest.raises(ConfigError, match="iteration 1 holds 2 rows but the checkpoint recorded 4"):
        other.load_state_dict(state)


@pytest.mark.parametrize("share", [-0.1, 1.5, "half", True])
def test_replay_share_outside_0_1_is_refused(tmp_path, share):
    with pytest.raises(ConfigError, match=r"rm.replay.share .* must be in \[0, 1\].*set rm.replay.share=0.1"):
        T.ReplayBuffer(tmp_path, share=share)


def test_mix_of_two_kinds_is_refused(tmp_path):
    buffer = T.ReplayBuffer(tmp_path, share=0.5)
    buffer.add(0, [{"prompt": "p", "completion": "ab", "steps": [[1, 1.0]]}])
    with pytest.raises(DataError, match="one reward model trains on one kind"):
        buffer.mix(1, rows(1))


# ---- held-out split ----------------------------------------------------------------------------

@pytest.mark.parametrize("fraction,held", [(0.2, 2), (0.25, 3), (0.01, 1), (0.0, 0), (0.99, 9)])
def test_heldout_split_is_by_prompt(fraction, held):
    # 10 prompts x 2 rows: 0.2 * 10 = 2; 0.25 * 10 = 2.5 -> 3 (half up); 0.01 -> 0.1 -> at least 1;
    # 0.99 -> 9.9 -> 10 -> at most 9, so something is left to train on
    data = [{"prompt": f"p{i}", "completion": str(j), "label": 1.0} for i in range(10) for j in range(2)]
    train, heldout = T.split_heldout(data, fraction, seed=0)
    assert len({r["prompt"] for r in heldout}) == held and len(heldout) == 2 * held
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert len(train) + len(heldout) == 20


# ---- labelers ----------------------------------------------------------------------------------

class StubSampler:
    """Gives fixed continuations per prefix (keyed by the prompt's text after PROMPT), k at a time."""

    def __init__(self, continuations: dict[str, list[str]]):
        self.continuations, self.calls = continuations, []

    def generate(self, policy, tokenizer, prompts, n, **kwargs):
        self.calls.append((list(prompts), n))
        texts = []
        for prompt in prompts:
            assert prompt.startswith(PROMPT)
            texts += self.continuations[prompt[len(PROMPT):]][:n]
        return type("Out", (), {"texts": texts})()


PROMPT = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
COMPLETION = "3 + 4 = 7\n7 * 2 = 15\n#### 15"  # steps end at 9, 20, 28; its answer 15 is wrong (ref 14)
CONTINUATIONS = {
    "3 + 4 = 7": ["\n7 * 2 = 14\n#### 14",  # 14: right
                  "\n#### 13",               # 13: wrong
                  "\nso #### 14",            # 14: right
                  "\nnope"],                 # last number 7: wrong
    "3 + 4 = 7\n7 * 2 = 15": ["\n#### 15", "\n#### 15", "\n#### 16", "\nso 15"],  # none right
    COMPLETION: ["\nno, #### 14", "", "", ""],  # only asked for when the completion was truncated
}


@pytest.mark.parametrize("estimate", ["hard", "soft"])
def test_monte_carlo_labels_match_a_hand_count(estimate):
    sampler = StubSampler(CONTINUATIONS)
    sample = {"prompt": PROMPT, "question": "Q", "answer": "14", "completion": COMPLETION, "truncated": False}
    labeler = T.MonteCarloLabeler(k=4, estimate=estimate, pattern=None, prompts_per_batch=1, max_new_tokens=None)
    [row] = labeler([sample], policy=None, tokenizer=None, sampler=sampler)
    # step 1: 2 of 4 continuations reach 14 -> hard 1, soft 0.5; step 2: 0 of 4 -> 0;
    # step 3 ends a finished completion: its own answer 15 != 14 -> 0, no continuations drawn
    step1 = {"hard": 1.0, "soft": 0.5}[estimate]
    assert row == {"prompt": "Q", "completion": COMPLETION, "answer": "14",
                   "steps": [[9, step1], [20, 0.0], [28, 0.0]]}
    assert [calls for calls in sampler.calls] == [([PROMPT + "3 + 4 = 7"], 4), ([PROMPT + "3 + 4 = 7\n7 * 2 = 15"], 4)]

    # a truncated completion did not end: its last step is continued too (1 of 4 reaches 14)
    sampler = StubSampler(CONTINUATIONS)
    [row] = T.MonteCarloLabeler(k=4, estimate=estimate, pattern=None, prompts_per_batch=16,
                                 max_new_tokens=None)([{**sample, "truncated": True}], sampler=sampler)
    assert row["steps"][2] == [28, {"hard": 1.0, "soft": 0.25}[estimate]]
    assert len(sampler.calls) == 1 and len(sampler.calls[0][0]) == 3  # 3 prefixes in one batch


def test_monte_carlo_labels_on_the_tiny_model_match_a_recount(tiny):
    """Real continuations from the tiny model: each label equals a count over the continuations
    the sampler returned; hard = (soft > 0) on the same draws."""
    from grpo_cli.rollout.hf import HFSampler

    model, tokenizer = tiny

    class Recording(HFSampler):
        def generate(self, *args, **kwargs):
            out = super().generate(*args, **kwargs)
            self.seen.append(out.texts)
            return out

    # the prefixes end in the reference 5, so a continuation without digits keeps it right
    samples = [{"prompt": PROMPT, "question": "Q", "answer": "5", "completion": c, "truncated": True}
               for c in ("x = 5\nso 5", "a\nb 5\nc")]
    labels = {}
    for estimate in ("hard", "soft"):
        sampler = Recording(**sampler_settings(max_new_tokens=3))
        sampler.seen = []
        torch.manual_seed(0)
        out = T.MonteCarloLabeler(k=6, estimate=estimate, pattern=None, prompts_per_batch=8, max_new_tokens=None)(
            samples, policy=model, tokenizer=tokenizer, sampler=sampler)
        labels[estimate] = [label for row in out for _, label in row["steps"]]
        [texts] = sampler.seen  # one batch: 2 + 3 prefixes x 6 continuations
        assert len(texts) == 5 * 6
        prefixes = [s["completion"][:end] for s in samples for _, end in split_steps(s["completion"])]
        for p, (prefix, label) in enumerate(zip(prefixes, labels[estimate])):
            right = sum(answers_match(extract_answer(prefix + t), "5") for t in texts[6 * p:6 * p + 6])
            assert label == (right / 6 if estimate == "soft" else float(right > 0))
    assert labels["hard"] == [float(s > 0) for s in labels["soft"]]
    assert 0 < sum(labels["soft"]) < len(labels["soft"])  # some continuations kept the 5, some did not


def test_outcome_and_verifier_labelers():
    samples = [{"prompt": PROMPT, "question": "Q", "answer": "14", "completion": c, "truncated": False}
               for c in ("3 + 4 = 7\n7 * 2 = 14\n#### 14", COMPLETION)]
    outcome = T.OutcomeLabeler()(samples)
    assert [r["label"] for r in outcome] == [1.0, 0.0]
    assert T.OutcomeLabeler()([{**samples[0], "answer": None}]) == []  # no reference, no row
    verifier = T.VerifierLabeler(pattern=None)(samples)
    # first: all claims right (+1 each), last step "#### 14" neutral 0 + outcome +1 -> 1;
    # second: 7 * 2 = 15 is wrong (-1 -> 0), "#### 15" is 0 - 1 -> 0
    assert [r["steps"] for r in verifier] == [[[9, 1.0], [20, 1.0], [28, 1.0]], [[9, 1.0], [20, 0.0], [28, 0.0]]]
    # a step with no claim and no outcome to add (reward 0) gets no label
    [row] = T.VerifierLabeler(pattern=None)([{**samples[0], "completion": "hello\n2 + 2 = 4", "answer": None}])
    assert row["steps"] == [[15, 1.0]]


# ---- metrics -----------------------------------------------------------------------------------

def test_auc_equals_pair_enumeration():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(2, 12)
        scores = [rng.choice([0.1, 0.2, 0.5, 0.7, rng.random()]) for _ in range(n)]  # with ties
        positive = [rng.random() < 0.5 for _ in range(n)]
        pairs = [(s, t) for (s, p), (t, q) in itertools.product(zip(scores, positive), repeat=2) if p and not q]
        expected = (sum((s > t) + 0.5 * (s == t) for s, t in pairs) / len(pairs)) if pairs else None
        got = T.binary_auc(scores, positive)
        assert got == pytest.approx(expected) if expected is not None else got is None


def test_metrics_by_hand():
    # scores .9 .6 .4 .2 vs labels 1 0 1 0: accuracy at 0.5 = (1 + 0 + 0 + 1) / 4 = 0.5;
    # positive pairs (.9,.6) (.9,.2) (.4,.6) (.4,.2): 3 of 4 ordered -> AUC 0.75; a soft 0.5 label is positive
    m = T.classification_metrics([0.9, 0.6, 0.4, 0.2], [1.0, 0.0, 0.5, 0.0], ["a", "a", "b", "b"])
    assert (m["labels"], m["positives"], m["accuracy"], m["auc"]) == (4, 2, 0.5, 0.75)


# ---- the model ---------------------------------------------------------------------------------

def step_rows(n: int) -> list[dict]:
    """Two-step completions; a step ending in A is good, in B bad (ends as split_steps gives them)."""
    out = []
    for i in range(n):
        a, b = "AB"[i % 2], "AB"[(i // 2) % 2]
        completion = f"{i} {a}\n{i + 1} {b}"
        ends = [end for _, end in split_steps(completion)]
        out.append({"prompt": f"Q{i}", "completion": completion,
                    "steps": [[ends[0], float(a == "A")], [ends[1], float(b == "A")]]})
    return out


def trained(kind: str, data: list[dict], tiny, epochs: int = 1, lr: float = 1e-3):
    base, tokenizer = tiny
    model = T.add_lora(T.new_classifier(kind, base, tokenizer, seed=0), r=4, alpha=8, dropout=0.0,
                       target_modules="all-linear")
    losses = T.train_classifier(model, tokenizer, data, kind=kind, template="{prompt}{completion}", epochs=epochs,
                                batch_size=4, lr=lr, seed=0)
    return model, tokenizer, losses


def test_class_weight_balances_a_hand_built_row_set():
    # 2 right of 8: pos_weight = 6 negatives / 2 positives = 3, so each class weighs 2 x 3 = 6 x 1 = 6 in the loss
    outcome = rows(2, label=1.0) + rows(6, prefix="w", label=0.0)
    assert T.class_weight(outcome, "outcome") == 3.0
    # a PRM counts labeled steps, not rows: steps 1, 0, 0.5 (>= 0.5 is positive, as the metrics count it), 0, 0
    # -> 2 positive, 3 negative -> 3 / 2 = 1.5
    steps = [{"prompt": "a", "completion": "xxxx", "steps": [[1, 1.0], [2, 0.0], [3, 0.5]]},
             {"prompt": "b", "completion": "xx", "steps": [[1, 0.0], [2, 0.0]]}]
    assert T.class_weight(steps, "process") == 1.5
    # one class only: nothing to balance, weight 1 (0 would erase the only class there is)
    assert T.class_weight(rows(5, label=0.0), "outcome") == 1.0 and T.class_weight(rows(5), "outcome") == 1.0


def test_balanced_loss_weighs_each_positive_by_the_counts(tiny):
    """The first batch's loss is the hand-written weighted BCE of the model's own logits, and retrain uses it
    exactly when rm.balance is on."""
    base, tokenizer = tiny
    data = [{"prompt": f"q{i}", "completion": f"{i} c", "label": float(i < 2)} for i in range(8)]  # 2 right, 6 wrong
    model = T.add_lora(T.new_classifier("outcome", base, tokenizer, seed=0), r=4, alpha=8, dropout=0.0,
                       target_modules="all-linear")
    inputs, where, targets = T.classifier.encode(tokenizer, data, "outcome", "{prompt}{completion}", "cpu")
    with torch.no_grad():
        x = T.classifier.logits_at(model, inputs, where)  # [8]
    # -(w y log σ(x) + (1 - y) log σ(-x)), mean over 8 rows, w = 6 / 2 = 3
    expected = -(3 * targets * torch.nn.functional.logsigmoid(x)
                 + (1 - targets) * torch.nn.functional.logsigmoid(-x)).mean()
    losses = T.train_classifier(model, tokenizer, data, kind="outcome", template="{prompt}{completion}", epochs=1,
                                batch_size=8, lr=1e-3, seed=0, pos_weight=T.class_weight(data, "outcome"))
    assert losses[0] == pytest.approx(float(expected), rel=1e-5)
    unweighted = -(targets * torch.nn.functional.logsigmoid(x) + (1 - targets) * torch.nn.functional.logsigmoid(-x))
    assert losses[0] != pytest.approx(float(unweighted.mean()), rel=1e-3)  # the weight changed the loss

    settings = compose("train", ["model=tiny"]).rm
    for balance, expected_weight in ((True, 3.0), (False, None)):
        settings.balance, settings.epochs, settings.lora.r, settings.lora.alpha = balance, 1, 4, 8
        fresh = T.new_classifier("outcome", base, tokenizer, seed=0)
        _, report = T.retrain(fresh, tokenizer, data, [], settings, "outcome", seed=0)
        assert report["pos_weight"] == expected_weight


def test_new_classifier_copies_the_base_and_lora_leaves_it_alone(tiny):
    base, tokenizer = tiny
    model = T.new_classifier("outcome", base, tokenizer)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    peft_model, _, losses = trained("outcome", letters(8), tiny)
    # the base LM the policy shares is untouched; the RM's adapter and head moved
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in before.items())
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in peft_model.named_parameters())
    assert len(losses) == 2  # 8 rows / batch 4, one epoch


def test_a_reward_model_learns_a_separable_label(tiny):
    heldout = letters(40)[30:]
    model, tokenizer, _ = trained("outcome", letters(30), tiny, epochs=8, lr=1e-2)
    after = T.evaluate(model, tokenizer, heldout, kind="outcome", template="{prompt}{completion}")
    assert after["accuracy"] == 1.0 and after["auc"] == 1.0
    prm, tokenizer, _ = trained("process", step_rows(30), tiny, epochs=8, lr=1e-2)
    after = T.evaluate(prm, tokenizer, step_rows(40)[30:], kind="process", template="{prompt}{completion}")
    assert after["labels"] == 20 and after["accuracy"] == 1.0 and after["auc"] == 1.0
    # a step's prompt is its row's: rows 30, 33, 34, 37 and 38 hold one right and one wrong step (A B or B A),
    # the other five two of a kind, so the within-prompt AUC rests on those 5 prompts
    assert (after["auc_within_prompt"], after["auc_prompts"]) == (1.0, 5)


@pytest.mark.parametrize("kind", ["outcome", "process"])
def test_checkpoint_scores_identically_after_save_and_load(kind, tiny, tmp_path):
    data = letters(8) if kind == "outcome" else step_rows(8)
    model, tokenizer, _ = trained(kind, data, tiny)
    unmerged, _ = T.predict(model, tokenizer, data, kind=kind, template="{prompt}{completion}")
    merged = model.merge_and_unload()
    scores, _ = T.predict(merged, tokenizer, data, kind=kind, template="{prompt}{completion}")
    assert scores == pytest.approx(unmerged, abs=1e-5)  # merging changes rounding only
    T.save_reward_model(merged, tokenizer, tmp_path / "model", {"kind": kind})

    # loaded as the reward config loads it: reward=orm|prm reward.name_or_path=DIR
    option = "orm" if kind == "outcome" else "prm"
    cfg = compose("train", ["model=tiny", f"reward={option}", f"reward.name_or_path={tmp_path / 'model'}",
                            "reward.device=cpu", "reward.batch_size=3"])
    reward = build(cfg.reward)
    result = reward([r["prompt"] for r in data], [r["completion"] for r in data], {"answer": ["0"] * len(data)})
    if kind == "outcome":
        assert result.rewards == pytest.approx(scores, abs=1e-6)
    else:  # the PRM's steps (split_steps ends) are the rows' steps, in order
        assert [[e for e, _ in s] for s in result.steps] == [[e for e, _ in r["steps"]] for r in data]
        assert [v for s in result.steps for _, v in s] == pytest.approx(scores, abs=1e-6)
    # and the trainer's own loader continues from it with the same scores
    again, tok = T.load_classifier(tmp_path / "model", kind, torch.device("cpu"), torch.float32)
    reloaded, _ = T.predict(again, tok, data, kind=kind, template="{prompt}{completion}")
    assert reloaded == pytest.approx(scores, abs=1e-6)


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,message", [
    ({"prompt": "p", "completion": "abc"}, r"line 2: no label; an outcome row needs \"label\""),
    ({"prompt": "p", "completion": "abc", "label": 2}, r"line 2: label 2 must be a number in \[0, 1\]"),
    ({"prompt": "p", "completion": "abc", "label": 1, "steps": [[1, 1]]}, r"line 2: both"),
    ({"completion": "abc", "label": 1}, r"line 2: 'prompt' is missing"),
    ("{not json", r"line 2 is not JSON"),
])
def test_bad_outcome_rows(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p", "completion": "abc", "label": 1}, bad])
    with pytest.raises(DataError, match=message):
        T.read_labeled(path)


@pytest.mark.parametrize("steps,message", [
    ([[3, 1.0], [13, 0.0]], r"line 1: step end 13 is outside the completion \(12 characters\).*in 1\.\.12"),
    ([[0, 1.0]], r"step end 0 is outside the completion"),
    ([[5, 1.0], [3, 0.0]], r"step ends must increase"),
    ([[3, 1.5]], r"step label 1.5 must be a number in \[0, 1\]"),
    ([], r"non-empty list"),
])
def test_bad_process_rows(tmp_path, steps, message):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p", "completion": "3 + 4 = 7\nok", "steps": steps}])
    with pytest.raises(DataError, match=message):
        T.read_labeled(path)


def test_mixed_kinds_in_one_file(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p", "completion": "ab", "label": 1},
                                            {"prompt": "p", "completion": "ab", "steps": [[2, 1]]}])
    with pytest.raises(DataError, match="line 2 is a process row but line 1 is a outcome row"):
        T.read_labeled(path)


@pytest.fixture(scope="module")
def causal_folder(tmp_path_factory, tiny):
    """The tiny causal LM saved as a model folder: not a reward model."""
    path = tmp_path_factory.mktemp("causal")
    model, tokenizer = tiny
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_causal_lm_is_not_a_reward_model(causal_folder, tmp_path):
    # reward=orm / reward=prm refuse it when the reward is built, before any scoring
    for option, what in (("orm", "sequence-classification"), ("prm", "token-classification")):
        cfg = compose("train", ["model=tiny", f"reward={option}", f"reward.name_or_path={causal_folder}"])
        with pytest.raises(ConfigError, match=f"holds a LlamaForCausalLM, not a {what} model, which reward={option}"):
            build(cfg.reward)
    # the trainer's loader refuses it too
    with pytest.raises(ConfigError, match="not a sequence-classification model"):
        T.load_classifier(causal_folder, "outcome", torch.device("cpu"), torch.float32)


def test_grpo_rm_refuses_a_causal_lm_as_init(causal_folder, tmp_path):
    # before sampling or loading anything
    labeled = write_jsonl(tmp_path / "rows.jsonl", letters(4))
    cfg = compose("rm", [*TINY, f"rm.labeled={labeled}", f"rm.init={causal_folder}"])
    with pytest.raises(ConfigError, match="not a sequence-classification model"):
        rm.run(cfg, tmp_path / "run")


def test_a_reward_model_of_the_other_kind_is_refused(tiny, tmp_path):
    model, tokenizer, _ = trained("outcome", letters(4), tiny)
    T.save_reward_model(model.merge_and_unload(), tokenizer, tmp_path / "orm")
    cfg = compose("train", ["model=tiny", "reward=prm", f"reward.name_or_path={tmp_path / 'orm'}"])
    with pytest.raises(ConfigError, match="holds a LlamaForSequenceClassification, not a token-classification"):
        build(cfg.reward)


# ---- grpo rm end to end ------------------------------------------------------------------------
