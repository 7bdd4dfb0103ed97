"""Iterative RL in `grpo train` (grpo_cli/iterative.py) on the tiny random model: the reference is the
policy at each boundary, the KL is 0 at each iteration's first step, two adapters whatever the number
of iterations, exact resume mid-iteration and at a boundary, replay counts by hand, config errors.

The tiny model's random completions are never right, so every label is 0; the reward model's scores
still differ between completions, so the policy moves within an iteration (checked below).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import checkpoint, components, iterative
from grpo_cli import rm as T
from grpo_cli.commands import train
from grpo_cli.config import compose, validate
from grpo_cli.errors import CheckpointError, ConfigError
from grpo_cli.instantiate import build
from grpo_cli.policy import reference
from grpo_cli.rm import OutcomeLabeler
from tests.helpers.cli import run_cli
from tests.helpers.runs import TINY, copy_run, deterministic, metrics

# 3 iterations x 2 steps; per boundary 4 problems x 2 samples = 8 rows, 0.25 x 4 prompts = 1 held out (2 rows).
# No gate: the tiny model is never right, so no held-out prompt has both labels and the gate would keep iteration
# 0's model at every boundary (the gate's own test sets rm.min_auc)
ITERATIVE = [o for o in TINY if "digit" not in o] + [
    "reward=orm", "reward.name_or_path=null", "reward.device=cpu", "iterative.iterations=3", "iterative.steps=2",
    "trainer.max_steps=6", "rm.num_problems=4", "rm.samples_per_problem=2", "rm.heldout_fraction=0.25",
    "rm.epochs=1", "rm.batch_size=4", "rm.lora.r=4", "rm.lora.alpha=8", "rm.lr=1e-2", "algo.beta=0.04",
    "trainer.keep_last=null", "rm.min_auc=null"]


def cfg(*overrides: str):
    return compose("train", [*ITERATIVE, *overrides])


def schedule(config, run_dir: Path) -> iterative.IterativeRL:
    """The reward schedule `grpo train` builds for an iterative config."""
    return components.reward_schedule(config, run_dir, build(config.data))


def iterations(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "iterations.jsonl").read_text().splitlines()]


def logprobs(policy, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(policy(input_ids=ids).logits, -1)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The uninterrupted run (3 iterations x 2 steps, a checkpoint at every step), made once for the tests that read
    it (they copy it before they change it); with what the policy and its reference were at each boundary."""
    seen = []
    real = iterative.set_reference

    def checked(policy):
        ids = torch.tensor([[5, 17, 30, 41, 9, 60]])
        moved = None
        if "reference" in policy.peft_config:  # boundaries 1 and 2: the policy trained since the last reset
            with reference(policy):
                old = logprobs(policy, ids)
            moved = not torch.equal(old, logprobs(policy, ids))
        real(policy)
        with reference(policy):
            ref = logprobs(policy, ids)
        seen.append({"moved": moved, "equal": torch.equal(ref, logprobs(policy, ids)),
                     "adapters": sorted(policy.peft_config),
                     "trainable": sorted(n for n, p in policy.named_parameters() if p.requires_grad)})

    run = tmp_path_factory.mktemp("iterative") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(iterative, "set_reference", checked)
        train.run(cfg("trainer.save_every=1"), run)
    return run, seen


def test_reference_is_the_policy_at_each_boundary_kl_0_and_two_adapters(straight, tmp_path):
    run, seen = straight
    assert [s["equal"] for s in seen] == [True, True, True]  # log-probs identical, bit for bit
    assert [s["moved"] for s in seen] == [None, True, True]  # ... and not because nothing trains
    # memory stays bounded: the reference adapter is made once and overwritten, 2 adapters after 3 iterations
    assert all(s["adapters"] == ["default", "reference"] for s in seen)
    assert all(s["trainable"] and all(".default." in n for n in s["trainable"]) for s in seen)
    assert sorted(p.name for p in (run / "checkpoints" / "step_000006").iterdir() if p.is_dir()) == ["reference"]

    records = metrics(run)
    assert [r["iteration"] for r in records] == [0, 0, 1, 1, 2, 2]
    # the first step of each iteration compares the policy with an identical reference: k3 = e^0 - 0 - 1 = 0
    assert [records[i]["kl"] for i in (0, 2, 4)] == [0.0, 0.0, 0.0]
    assert all(records[i]["kl"] > 0 for i in (1, 3, 5))

    history = iterations(run)
    assert [h["iteration"] for h in history] == [0, 1, 2] and [h["step"] for h in history] == [1, 3, 5]
    # 8 rows, 2 held out, 6 new; replay round(6 x 0.1 / 0.9 = 0.67) = 1 row, from earlier iterations only
    assert [(h["rows"], h["heldout"], h["train_new"], h["train_replay"]) for h in history] == \
        [(8, 2, 6, 0), (8, 2, 6, 1), (8, 2, 6, 1)]
    assert [h["rm_start"] for h in history] == [None, str(run / "rm/iteration_000"),
                                                str(run / "rm/iteration_001")]
    assert sorted(p.name for p in (run / "rm").iterdir()) == ["iteration_000", "iteration_001",
                                                                   "iteration_002", "replay"]
    assert sorted(p.name for p in (run / "rm" / "replay").iterdir()) == [
        "iteration_000.jsonl", "iteration_001.jsonl", "iteration_002.jsonl"]
    state = json.loads((run / "checkpoints/step_000006/trainer_state.json").read_text())["iterative"]
    assert state["done"] == 3 and state["rm"] == "rm/iteration_002" and state["replay"]["rows"] == {
        "0": 8, "1": 8, "2": 8}

    # a corrupt reference adapter is named by verify, and resolve falls back to the checkpoint before
    damaged = copy_run(run, tmp_path / "run")
    (damaged / "checkpoints/step_000006/reference/adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="reference/adapter_model.safetensors cannot be read"):
        checkpoint.verify(damaged / "checkpoints/step_000006")
    assert checkpoint.resolve(damaged) == damaged / "checkpoints/step_000005"


def test_resume_at_a_boundary_and_mid_iteration_is_exact(straight, tmp_path):
    source = straight[0]
    run = copy_run(source, tmp_path / "run")

    def history() -> list[dict]:
        """The copy's iterations.jsonl without wall-clock times; the reward models it names read as the copy's
        (the lines copied from the source name the source's folder)."""
        lines = [{k: v for k, v in h.items() if not k.startswith("time/")} for h in iterations(run)]
        return json.loads(json.dumps(lines).replace(str(source), str(run)))

    want = {"metrics": [deterministic(r) for r in metrics(run)],
                "adapter": load_file(run / "checkpoints/step_000006/adapter_model.safetensors"),
                "reference": load_file(run / "checkpoints/step_000006/reference/adapter_model.safetensors"),
                "rm": load_file(run / "rm/iteration_002/model.safetensors"),
                "history": history()}
    shutil.copytree(run, tmp_path / "first")
    # step 2 ends iteration 0 (the next step is a boundary); step 3 is inside iteration 1
    for at in (2, 3):
        train.run(cfg("trainer.save_every=1", f"resume={run / 'checkpoints' / f'step_{at:06d}'}"), run)
        assert [deterministic(r) for r in metrics(run)] == want["metrics"], at
        for name, path in (("adapter", "checkpoints/step_000006/adapter_model.safetensors"),
                           ("reference", "checkpoints/step_000006/reference/adapter_model.safetensors"),
                           ("rm", "rm/iteration_002/model.safetensors")):
            again = load_file(run / path)
            assert again.keys() == want[name].keys(), (at, name)
            assert all(torch.equal(again[k], want[name][k]) for k in again), (at, name)
        assert history() == want["history"], at
        shutil.rmtree(run / "checkpoints")  # the next resume starts from the uninterrupted run's checkpoints
        shutil.copytree(tmp_path / "first" / "checkpoints", run / "checkpoints")


def test_the_gate_keeps_the_previous_model_when_the_new_one_ranks_below_the_bar(tmp_path, monkeypatch, capsys):
    """rm.min_auc=0.5: iteration 0's new head measures 0.3 (nothing earlier to keep: used, and said), iteration
    1's retrained model 0.25 (iteration 0's model scores iteration 1, and trains on at iteration 2), iteration 2's
    held-out rows are all wrong (no within-prompt AUC: unvalidated, so iteration 0's model goes on scoring)."""
    real, seen = iterative.rm.retrain, []

    def measured(*args, **kwargs):  # the tiny model's labels are all 0 (no AUC): set the measured AUC here
        model, report = real(*args, **kwargs)
        seen.append(report)
        if len(seen) <= 2:
            report["heldout_after"] = {**report["heldout_after"], "auc_within_prompt": (0.3, 0.25)[len(seen) - 1]}
        return model, report

    monkeypatch.setattr(iterative.rm, "retrain", measured)
    train.run(cfg("rm.min_auc=0.5", "iterative.steps=1", "trainer.max_steps=3", "trainer.save_every=1"), tmp_path)
    said = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "iteration 0: the retrained reward model's held-out within-prompt AUC 0.300 is below rm.min_auc=0.5; " \
           "there is no previous model to keep (a new head): it scores steps 1-1" in said
    assert said.count("keeping the previous one") == 2
    assert f"iteration 1: the retrained reward model's held-out within-prompt AUC 0.250 is below rm.min_auc=0.5: " \
           f"keeping the previous one ({tmp_path / 'rm/iteration_000'}) for steps 2-2" in said
    assert f"iteration 2: no held-out prompt's samples hold both labels, so the retrained reward model has no " \
           f"within-prompt AUC and rm.min_auc=0.5 cannot validate it: keeping the previous one " \
           f"({tmp_path / 'rm/iteration_000'}) for steps 3-3" in said

    history = iterations(tmp_path)
    assert [h["kept_previous"] for h in history] == [False, True, True]
    assert [h["rm"] for h in history] == ["rm/iteration_000"] * 3
    assert [h["rm_trained"] for h in history] == ["rm/iteration_000", "rm/rejected/iteration_001",
                                                  "rm/rejected/iteration_002"]
    assert history[2]["rm_start"] == str(tmp_path / "rm/iteration_000")  # the rejected model is not trained on
    # eval reads rm/iteration_* as the run's reward models: the rejected ones are kept apart
    assert sorted(p.name for p in (tmp_path / "rm").iterdir()) == ["iteration_000", "rejected", "replay"]
    assert (tmp_path / "rm/rejected/iteration_001/config.json").is_file()
    state = json.loads((tmp_path / "checkpoints/step_000002/trainer_state.json").read_text())["iterative"]
    assert state["rm"] == "rm/iteration_000"  # what a resume at step 3 restarts from



class AlternatingLabeler(OutcomeLabeler):
    """Right, wrong, right, ... in sample order: both classes among each prompt's samples (the tiny model is never
    right), so the held-out rows have an AUC."""

    def __call__(self, samples, **_):
        return [{"prompt": s["question"], "completion": s["completion"], "label": float(j % 2 == 0),
                 "answer": s["answer"]} for j, s in enumerate(samples)]


def pair_count(scores: list[float], labels: list[float]) -> float:
    """AUC by hand: the share of (right, wrong) pairs the scores order right, a tie counting 1/2."""
    pairs = [(p, n) for p, y in zip(scores, labels) if y == 1 for n, z in zip(scores, labels) if z == 0]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)


def test_auc_on_the_current_policy_before_and_after_retraining_matches_a_pair_count(tmp_path):
    """Iteration 1's boundary: the held-out rows are samples of the policy at step 2 (in that boundary's replay file,
    not iteration 0's), scored by iteration 0's model (before) and the retrained one (after), AUC = pair count."""
    # 4 problems x 4 samples, half the prompts held out: 2 prompts x 4 samples = 8 rows, 4 right and 4 wrong,
    # so each AUC is a count of 16 (right, wrong) pairs
    train.run(cfg("labeler._target_=test_iterative.AlternatingLabeler", "rm.samples_per_problem=4",
                  "rm.heldout_fraction=0.5", "rm.min_auc=null", "iterative.iterations=2", "iterative.steps=1",
                  "trainer.max_steps=2"), tmp_path)
    record = iterations(tmp_path)[1]
    rows = [json.loads(line) for line in (tmp_path / "rm/iteration_001/labeled.jsonl").read_text().splitlines()]
    heldout = [r for r in rows if r["split"] == "heldout"]
    assert len(heldout) == 8 and sum(r["label"] for r in heldout) == 4
    fresh = {r["completion"] for r in heldout}
    replay = lambda i: {json.loads(line)["completion"]  # noqa: E731
                        for line in (tmp_path / f"rm/replay/iteration_{i:03d}.jsonl").read_text().splitlines()}
    assert fresh <= replay(1) and not fresh & replay(0)  # sampled at this boundary, from the policy as it is now

    counted, pooled = {}, {}
    prompts = sorted({r["prompt"] for r in heldout})
    for when, folder in (("before", "iteration_000"), ("after", "iteration_001")):
        model, tokenizer = T.load_classifier(tmp_path / "rm" / folder, "outcome", torch.device("cpu"), torch.float32)
        scores, labels = T.predict(model, tokenizer, heldout, kind="outcome", template="{prompt}{completion}")
        pooled[when] = pair_count(scores, labels)
        # within prompt: each prompt's 2 right x 2 wrong = 4 pairs counted alone, the 2 prompts' shares averaged
        mine = lambda p: [i for i, r in enumerate(heldout) if r["prompt"] == p]  # noqa: E731
        counted[when] = sum(pair_count([scores[i] for i in mine(p)], [labels[i] for i in mine(p)])
                            for p in prompts) / len(prompts)
    assert record["rm/auc_current_policy_before"] == pytest.approx(counted["before"])
    assert record["rm/auc_current_policy_after"] == pytest.approx(counted["after"])
    assert record["rm/auc_prompts"] == 2
    assert record["rm/pooled_auc_current_policy_before"] == pytest.approx(pooled["before"])
    assert record["rm/pooled_auc_current_policy_after"] == pytest.approx(pooled["after"])
    assert record["rm/auc_current_policy"] == record["rm/auc_current_policy_after"]  # no gate: the retrained one
    # the same numbers in metrics.jsonl, at the boundary's step only
    step2 = metrics(tmp_path)[1]
    assert (step2["rm/auc_current_policy_before"], step2["rm/auc_current_policy_after"], step2["rm/kept_previous"],
            step2["rm/pooled_auc_current_policy_after"]) == (record["rm/auc_current_policy_before"],
                                                             record["rm/auc_current_policy_after"], 0,
                                                             record["rm/pooled_auc_current_policy_after"])
    # iteration 0 from a new head: the head is scored before training too (a random ranking), then retrained
    step1, first = metrics(tmp_path)[0], iterations(tmp_path)[0]
    assert step1["rm/auc_current_policy_after"] == first["heldout_after"]["auc_within_prompt"] is not None


def test_truncated_completions_score_lowest_in_a_run(tmp_path):
    """iterative.truncated_reward=-1: every completion cut at the cap is rewarded -1, below every finished one
    (the reward model's sigmoid scores lie in (0, 1)); a finished one keeps the model's score."""
    train.run(cfg("iterative.truncated_reward=-1.0", "iterative.iterations=2", "iterative.steps=1",
                  "trainer.max_steps=2", "trainer.log_completions_every=1", "algo.group_size=8",
                  "trainer.prompts_per_step=4", "trainer.micro_batch_size=32"), tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    cut = [r for r in lines if r["truncated"]]
    finished = [r for r in lines if not r["truncated"]]
    assert cut and finished, (len(cut), len(finished))  # both kinds, or the test shows nothing
    assert all(r["reward"] == -1.0 and 0 < r["rewards"]["orm"] < 1 for r in cut)
    assert all(r["reward"] == r["rewards"]["orm"] for r in finished)
    assert max(r["reward"] for r in cut) < min(r["reward"] for r in finished)


def test_length_shift_alarm_against_the_iterations_first_step(tmp_path, capsys):
    rl = schedule(cfg("iterative.steps=3", "trainer.max_steps=9", "iterative.length_alarm=0.25"), tmp_path)
    history = []
    for step, length, cut in ((1, 20.0, 0.44), (2, 24.0, 0.60), (3, 28.0, 0.50), (4, 30.0, 0.97), (5, 31.0, 0.97)):
        record = {"step": step, "completions/mean_length": length, "completions/clipped_ratio": cut}
        record.update(rl.length_shift(record, history))
        history.append(record)
    shifts = [(r["iterative/length_shift"], r["iterative/truncated_shift"], r["iterative/length_alarm"])
              for r in history]
    # step 1 is iteration 0's first: no shift. Step 2: (24 - 20) / 20 = +0.20, 0.60 - 0.44 = +0.16: both within
    # 0.25. Step 3: (28 - 20) / 20 = +0.40 > 0.25: the alarm. Step 4 starts iteration 1 (its own baseline);
    # step 5: 1 / 30 = +0.033, truncated +0.
    assert [(round(a, 3), round(b, 3), c) for a, b, c in shifts] == [
        (0.0, 0.0, 0), (0.2, 0.16, 0), (0.4, 0.06, 1), (0.0, 0.0, 0), (0.033, 0.0, 0)]
    said = " ".join(capsys.readouterr().err.split())
    assert said.count("the completions moved") == 1
    assert "step 3: the completions moved within iteration 0: mean length 20.0 -> 28.0 (+40%), truncated 44% -> " \
           "50%, more than iterative.length_alarm=0.25" in said
    # off: no metrics
    off = schedule(cfg("iterative.length_alarm=null"), tmp_path)
    assert off.length_shift(history[2], history[:2]) == {}


def test_the_from_rm_recipe_needs_a_model_and_turns_the_guards_on():
    with pytest.raises(ConfigError, match=r"reward.name_or_path is required .*: reward.name_or_path=..."):
        validate(compose("train", ["+recipe=iterative_from_rm"]))
    config = validate(compose("train", ["+recipe=iterative_from_rm", "reward.name_or_path=some/model"]))
    assert (config.rm.balance, config.rm.min_auc, config.iterative.truncated_reward, config.algo.advantage_scale,
            config.iterative.length_alarm) == (True, 0.6, 0.0, "none", 0.25)
    # the same job as recipes/iterative.yaml otherwise: what differs is the start and the guards
    plain = compose("train", ["+recipe=iterative"])
    assert (config.iterative.iterations, config.iterative.steps, config.rm.num_problems) == \
        (plain.iterative.iterations, plain.iterative.steps, plain.rm.num_problems)


def test_iterations_off_is_an_ordinary_run(tmp_path):
    train.run(compose("train", [*TINY, "trainer.max_steps=1"]), tmp_path)
    assert "iteration" not in metrics(tmp_path)[0]
    assert not (tmp_path / "checkpoints/step_000001/reference").exists() and not (tmp_path / "rm").exists()
    assert "iterative" not in json.loads((tmp_path / "checkpoints/step_000001/trainer_state.json").read_text())


@pytest.mark.parametrize("overrides,message", [
    (["trainer.max_steps=5"], r"trainer.max_steps \(5\) must equal iterative.iterations x iterative.steps \(3 x 2\); "
                              r"set trainer.max_steps=6"),
    (["rm.replay.share=1.5"], r"rm.replay.share \(1.5\) must be in \[0, 1\]"),
    (["rm.replay.share=-0.1"], r"rm.replay.share \(-0.1\) must be in \[0, 1\]"),
    (["labeler=verifier"], r"the labeler gives process labels, so set reward=prm"),
    (["rm.epochs=0"], r"rm.epochs \(0\) must be an integer >= 1"),
    (["iterative.truncated_reward=low"], r"iterative.truncated_reward \('low'\) must be a number .*; "
                                         r"set iterative.truncated_reward=0.0"),
    (["iterative.length_alarm=0"], r"iterative.length_alarm \(0\) must be > 0 .*; set iterative.length_alarm=0.25"),
    (["rm.min_auc=1.5"], r"rm.min_auc \(1.5\) must be in \[0, 1\] \(0.5: chance\) or null \(no gate\); "
                         r"set rm.min_auc=0.6"),
])
def test_bad_iterative_settings(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg(*overrides))


def test_a_rule_reward_is_refused_and_off_checks_nothing():
    config = compose("train", ["iterative.iterations=1", "trainer.max_steps=10"])
    with pytest.raises(ConfigError, match="the labeler gives outcome labels, so set reward=orm"):
        iterative.check_settings(validate(config))
    iterative.check_settings(validate(compose("train", ["trainer.max_steps=7", "rm.replay.share=2"])))  # off


def test_cli_reports_every_iterative_problem_in_one_line_each(tmp_path):
    out = run_cli(["train", *ITERATIVE, "trainer.max_steps=7", "labeler=verifier", "iterative.steps=0",
                   f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 2, out.stderr[-2000:]
    # every problem at once: the bad count on its own line, and no max_steps product made from it
    assert out.stderr.strip().splitlines() == [
        "error: iterative.steps (0) must be an integer >= 1; set iterative.steps=10",
        "error: iterative RL retrains the reward model, so the reward must be one: the labeler gives process labels, "
        "so set reward=prm (reward.name_or_path=null starts from a new head)"]
    out = run_cli(["train", *ITERATIVE, "trainer.max_steps=7", "labeler=verifier", f"hydra.run.dir={tmp_path}"])
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 2 and all(line.startswith("error: ") for line in lines), out.stderr
    assert "set trainer.max_steps=6" in lines[0] and "set reward=prm" in lines[1]


def test_a_process_reward_model_iterates_too(tmp_path):
    """reward=prm with Math-Shepherd labels: each boundary trains a token-classification PRM on step rows."""
    # random characters have no newlines: split steps every 3 characters, the same for labeler and reward
    steps = "'(?s).{3}'"
    train.run(cfg("reward=prm", "reward.name_or_path=null", "labeler=mc", "labeler.k=2", f"labeler.pattern={steps}",
                  f"reward.pattern={steps}", "iterative.iterations=2", "trainer.max_steps=4"), tmp_path)
    history = iterations(tmp_path)
    assert [h["iteration"] for h in history] == [0, 1] and all(h["positives"] is None for h in history)
    assert all(h["heldout_after"]["labels"] > h["heldout"] for h in history)  # one label per step, several per row
    config = json.loads((tmp_path / "rm/iteration_001/config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"]
    assert [r["kl"] for r in metrics(tmp_path)][::2] == [0.0, 0.0]


def test_eval_of_an_iterative_run_scores_with_its_last_reward_model(straight, tmp_path, capsys):
    """An iterative run's saved reward is a reward model that changed every iteration (null in its config):
    eval scores with the last one the run saved and says so in one line (issue #23); reward= picks another."""
    from grpo_cli.commands import evaluate

    run = copy_run(straight[0], tmp_path / "run")  # 3 iterations: reward models 000, 001 and 002
    capsys.readouterr()
    eval_cfg = compose("eval", ["model=tiny", "sampler.max_new_tokens=8", f"checkpoint={run}", "eval.limit=3"])
    report = evaluate.run(eval_cfg, tmp_path / "eval", [f"checkpoint={run}"])
    assert report["config"]["reward"]["_target_"] == "grpo_cli.rewards.models.outcome_reward_model"
    assert report["config"]["reward"]["name_or_path"] == str(run / "rm" / "iteration_002")
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("reward:")]
    assert said == [f"reward: {run} retrained its reward model at each iteration; scoring with the last one, "
                    f"{run / 'rm' / 'iteration_002'} (pass reward=... to choose another)"]
    assert report["results"][0]["num_problems"] == 3
    # the command line's reward wins, silently: it was asked for
    ruled = compose("eval", ["model=tiny", "sampler.max_new_tokens=8", f"checkpoint={run}", "eval.limit=3",
                             "reward=arithmetic"])
    report = evaluate.run(ruled, tmp_path / "eval2", [f"checkpoint={run}", "reward=arithmetic"])
    assert report["config"]["reward"]["_target_"] == "grpo_cli.rewards.OutcomeReward"


def test_retrain_false_keeps_iteration_0s_model_and_measures_it_on_each_iterations_samples(tmp_path):
    # the fixed-RM control (scripts/iterative_vs_fixed.py): 3 iterations x 2 steps, one reward model
    train.run(cfg("iterative.retrain=false", "rm.min_auc=null"), tmp_path)
    records = iterations(tmp_path)
    assert [r["retrained"] for r in records] == [True, False, False]
    assert [r["rm"] for r in records] == ["rm/iteration_000"] * 3
    assert not (tmp_path / "rm" / "iteration_001").exists() and not (tmp_path / "rm" / "iteration_002").exists()
    for i in (1, 2):  # the fresh rows each later boundary labeled, kept beside the model they measured
        assert (tmp_path / "rm" / "measured" / f"iteration_{i:03d}" / "labeled.jsonl").exists()
        # measured before (iteration 0's model on this iteration's held-out rows), nothing trained after
        assert records[i]["heldout_before"] is not None and records[i]["heldout_after"] is None
        assert records[i]["rm/auc_current_policy_after"] is None and records[i]["kept_previous"]
    # the reference still resets at every boundary: the KL at each iteration's first step is 0
    assert [m["kl"] for m in metrics(tmp_path) if m["step"] in (1, 3, 5)] == pytest.approx([0.0] * 3, abs=1e-6)
