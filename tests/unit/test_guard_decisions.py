"""The guard's decisions (grpo_cli.guard) on hand-worked numbers: each tripwire on a history, which checkpoint a
rewind goes back to, what a remedy changes, which decisions a resume applies, and the settings refused before the
model loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_cli import guard
from grpo_cli.commands import train
from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.guard import GuardState, after, decide, pending, rewind_target, stop_target
from grpo_cli.metrics.stats import wilson_interval
from grpo_cli.trainer_state import TrainerState


def _eval(step: int, correct: int, n: int = 200) -> dict:
    """A step record with an in-run eval of `correct` of `n` problems, its interval as the run logs it."""
    low, high = wilson_interval(correct, n)
    return {"step": step, "eval/accuracy": correct / n, "eval/accuracy_low": low, "eval/accuracy_high": high}


# ---- the held-out gate --------------------------------------------------------------------------------------------

def test_the_held_out_gate_fires_when_the_interval_lies_wholly_below_the_best():
    # the default job measured: 0.480, 0.655, 0.590, 0.625 at steps 10-40 on 200 problems
    history = [_eval(10, 96), _eval(20, 131), _eval(30, 118)]
    # best 131/200 = 0.655: Wilson centre (0.655 + 1.96²/400) / (1 + 1.96²/200) = 0.6521, half-width
    # 1.96 x sqrt(0.655 x 0.345 / 200 + 1.96²/160000) / 1.0192 = 0.0653 -> 0.587-0.717
    assert wilson_interval(131, 200) == pytest.approx((0.5867, 0.7174), abs=1e-4)
    # 0.590 (118/200): 0.521-0.656; its high 0.656 > 0.587: it overlaps the best's interval, no drop the eval can see
    assert guard.heldout_drop(history) is None
    # 0.520 (104/200): centre 0.5196, half 0.0686 -> high 0.588 > 0.587: still overlaps (by 0.001)
    assert guard.heldout_drop([*history, _eval(40, 104)]) is None
    # 0.515 (103/200): high 0.5833 < 0.587: fires, against step 20's best
    trip = guard.heldout_drop([*history, _eval(40, 103)])
    assert trip.tripwire == "heldout_drop" and trip.step == 40
    assert trip.values["best_step"] == 20 and trip.values["accuracy"] == 0.515
    assert trip.values["high"] == pytest.approx(0.5833, abs=1e-4)
    assert trip.why == "held-out accuracy 0.515 (0.45-0.58) below the best, 0.655 at step 20 (0.59-0.72)"


def test_the_held_out_gate_reads_only_a_step_with_an_eval_and_an_earlier_best():
    assert guard.heldout_drop([_eval(10, 190)]) is None  # nothing earlier to compare with
    assert guard.heldout_drop([_eval(10, 190), {"step": 11}]) is None  # step 11 has no eval
    # two evals tie for the best: the earliest is the best (step 10), as best.json keeps it
    trip = guard.heldout_drop([_eval(10, 190), _eval(20, 190), _eval(30, 10)])
    assert trip.values["best_step"] == 10


# ---- the heuristic tripwires --------------------------------------------------------------------------------------

def test_logp_gap_fires_above_its_max_and_never_without_the_sampler_s_log_probs():
    assert guard.logp_gap([{"step": 1, "sampler/logp_gap": 0.25}], max=0.2).values == {"logp_gap": 0.25, "max": 0.2}
    assert guard.logp_gap([{"step": 1, "sampler/logp_gap": 0.2}], max=0.2) is None  # at it: not above
    assert guard.logp_gap([{"step": 1}], max=0.2) is None  # HF generate: no sampler log-probs, no gap logged


def _steps(key: str, values: list[float], **more) -> list[dict]:
    return [{"step": i + 1, key: v, **more} for i, v in enumerate(values)]


def test_entropy_fires_below_a_share_of_its_early_mean():
    # early mean of the first 2 steps (2.0, 1.0) = 1.5; 0.1 x 1.5 = 0.15
    assert guard.entropy(_steps("entropy", [2.0, 1.0, 0.2]), min_ratio=0.1, window=2) is None  # 0.2 >= 0.15
    trip = guard.entropy(_steps("entropy", [2.0, 1.0, 0.2, 0.14]), min_ratio=0.1, window=2)
    assert trip.step == 4 and trip.values == {"entropy": 0.14, "early": 1.5, "min_ratio": 0.1}
    assert guard.entropy(_steps("entropy", [2.0, 0.1]), min_ratio=0.1, window=2) is None  # still in its window


def test_entropy_leaves_out_steps_that_updated_no_token():
    # β = 0 and every group tied: no row updated, entropy 0 is no measurement (counts/backward_seqs = 0)
    history = _steps("entropy", [2.0, 1.0, 0.0], **{"counts/backward_seqs": 8})
    history[2]["counts/backward_seqs"] = 0
    assert guard.entropy(history, min_ratio=0.1, window=2) is None
    # nor does such a step count in the early mean: steps 1 and 3 make it, (2.0 + 1.0) / 2 = 1.5
    history = _steps("entropy", [2.0, 0.0, 1.0, 0.1], **{"counts/backward_seqs": 8})
    history[1]["counts/backward_seqs"] = 0
    assert guard.entropy(history, min_ratio=0.1, window=2).values["early"] == 1.5


def _lengths(lengths: list[float], truncated: list[float]) -> list[dict]:
    return [{"step": i + 1, "completions/mean_length": n, "completions/clipped_ratio": t}
            for i, (n, t) in enumerate(zip(lengths, truncated))]


def test_length_fires_on_a_jump_in_mean_length_or_truncated_share_against_its_running_mean():
    # running mean of the previous 2 steps: lengths (10 + 12) / 2 = 11, truncated (0.1 + 0.2) / 2 = 0.15
    assert guard.length(_lengths([10, 12, 16.5], [0.1, 0.2, 0.45]), 1.5, 0.3, 2) is None  # 16.5 = 1.5 x 11; 0.45
    trip = guard.length(_lengths([10, 12, 16.6], [0.1, 0.2, 0.1]), 1.5, 0.3, 2)
    assert trip.why == "mean length 16.6 above 1.5 x its running mean 11.0"
    trip = guard.length(_lengths([10, 12, 11], [0.1, 0.2, 0.46]), 1.5, 0.3, 2)  # 0.46 > 0.15 + 0.3
    assert trip.why == "truncated share 0.46 above its running mean 0.15 + 0.3"
    # the window reads the steps just before: steps 2-3 (12, 30 -> 21), not step 1; 31 < 1.5 x 21
    assert guard.length(_lengths([10, 12, 30, 31], [0] * 4), 1.5, 0.3, 2) is None
    assert guard.length(_lengths([10, 30], [0, 0]), 1.5, 0.3, 2) is None  # before `window` earlier steps


def test_either_half_of_length_can_be_off():
    # the same two jumps as above, 16.6 against 11.0 and 0.46 against 0.15 + 0.3, each with its own half off
    assert guard.length(_lengths([10, 12, 16.6], [0.1, 0.2, 0.1]), None, 0.3, 2) is None
    assert guard.length(_lengths([10, 12, 11], [0.1, 0.2, 0.46]), None, 0.3, 2).why.startswith("truncated share 0.46")
    assert guard.length(_lengths([10, 12, 11], [0.1, 0.2, 0.46]), 1.5, None, 2) is None
    assert guard.length(_lengths([10, 12, 16.6], [0.1, 0.2, 0.1]), 1.5, None, 2).why.startswith("mean length 16.6")


def test_nonfinite_fires_on_steps_in_a_row():
    history = _steps("nonfinite_skipped", [1, 0, 1, 1])
    assert guard.nonfinite(history, steps=3) is None  # the streak is 2: step 2 broke it
    assert guard.nonfinite(history, steps=2).values == {"steps_in_a_row": 2}
    assert guard.nonfinite(history[:3], steps=2) is None  # one skipped step: the update's own undo


def test_check_reads_the_gate_first_and_skips_tripwires_that_are_off_or_whose_correction_is_in_force():
    cfg = compose("train", ["trainer.guard.nonfinite.steps=1", "trainer.guard.logp_gap.max=0.1"])
    history = [{**_eval(10, 150), "nonfinite_skipped": 0},
               {**_eval(20, 10), "nonfinite_skipped": 1, "sampler/logp_gap": 0.5}]
    assert guard.check(cfg.trainer.guard, history, GuardState()).tripwire == "heldout_drop"
    cfg.trainer.guard.heldout_drop = None
    assert guard.check(cfg.trainer.guard, history, GuardState()).tripwire == "nonfinite"
    cfg.trainer.guard.nonfinite = None
    assert guard.check(cfg.trainer.guard, history, GuardState()).tripwire == "logp_gap"
    # the logp_gap tripwire's remedy (sequence_mask) is in force: firing again would change nothing
    assert guard.check(cfg.trainer.guard, history, GuardState(is_correction="sequence_mask")) is None


# ---- where a rewind goes, what it changes -------------------------------------------------------------------------

def test_a_rewind_goes_to_the_newest_checkpoint_that_passed():
    history = [{"step": s} for s in range(1, 40)] + [_eval(10, 100)]
    history = [_eval(s, 100) if s in (10, 20, 30) else {"step": s} for s in range(1, 41)]
    # checkpoints at 10, 20, 30 (evals) and 35 (save_every=5); the held-out gate fires at 40
    assert rewind_target([10, 20, 30, 35], history, 40, gated=True) == 30  # 35 has not been through an eval
    # without the gate (no held-out tripwire, or no evals) every earlier checkpoint passed: 35
    assert rewind_target([10, 20, 30, 35], history, 40, gated=False) == 35
    # a heuristic at step 33: the newest eval before it is 30
    assert rewind_target([10, 20, 30], history, 33, gated=True) == 30
    # the newest passed checkpoint was deleted (keep_last): the newest one left that passed
    assert rewind_target([10, 20, 35], history, 40, gated=True) == 20
    # before the first eval every checkpoint counts; none written yet: nothing to rewind to
    assert rewind_target([5], history, 7, gated=True) == 5
    assert rewind_target([], history, 7, gated=True) is None


def test_a_stop_goes_to_the_best_evaluated_checkpoint_that_passed():
    # the planted fault's seed 0: step 10 scored 0.480 (0.41-0.55); after two rewinds the redone step 20 scored
    # 0.390 (0.33-0.46), which overlaps and so passed; step 30 fell to 0.045 and the rewinds were spent
    history = [{"step": s} for s in range(1, 31)]
    history[9] |= {"eval/accuracy": 0.480, "eval/accuracy_low": 0.41, "eval/accuracy_high": 0.55}
    history[19] |= {"eval/accuracy": 0.390, "eval/accuracy_low": 0.33, "eval/accuracy_high": 0.46}
    # a rewind that trains on goes to the newest that passed (20); a stop to the best of those (10)
    assert rewind_target([10, 20], history, 30, gated=True) == 20
    assert stop_target([10, 20], history, 30, gated=True) == 10
    # only checkpoints on disk count: with step 10's gone, step 20's
    assert stop_target([20], history, 30, gated=True) == 20
    # a checkpoint past the newest eval has not passed the gate, whatever it would score: still 10
    assert stop_target([10, 20, 25], history, 30, gated=True) == 10
    # equal scores: the earliest, as best.json picks
    history[19]["eval/accuracy"] = 0.480
    assert stop_target([10, 20], history, 30, gated=True) == 10
    # no evaluated checkpoint passed: the newest that did; none at all: None
    plain = [{"step": s} for s in range(1, 8)]
    assert stop_target([3, 5], plain, 7, gated=True) == 5
    assert stop_target([], plain, 7, gated=True) is None


def test_a_decision_that_stops_goes_to_the_best_and_one_that_trains_on_to_the_newest():
    trip = guard.Trip("heldout_drop", 30, {"accuracy": 0.045}, "why")
    lr = _node(remedy="lr", lr_factor=0.5)
    assert decide(trip, lr, GuardState(), 2, target=20, algo_cap=None, best=10).rewound_to == 20
    spent = decide(trip, lr, GuardState(decisions=2, rewinds=2), 2, target=20, algo_cap=None, best=10)
    assert (spent.remedy, spent.rewound_to) == ("stop", 10)
    stop = decide(trip, _node(remedy="stop"), GuardState(), 2, target=20, algo_cap=None, best=10)
    assert (stop.remedy, stop.rewound_to) == ("stop", 10)


def _node(**settings):
    return settings


def test_a_decision_takes_the_tripwire_s_remedy_until_the_rewinds_are_spent():
    trip = guard.Trip("heldout_drop", 40, {"accuracy": 0.5}, "why")
    lr = _node(remedy="lr", lr_factor=0.5)
    first = decide(trip, lr, GuardState(), max_rewinds=2, target=30, algo_cap=None)
    assert (first.remedy, first.rewind, first.rewound_to, first.changes) == ("lr", 1, 30, {"lr_factor": 0.5})
    # two rewinds done of 2: the next firing stops the run at its checkpoint, changing nothing
    spent = decide(trip, lr, GuardState(decisions=2, rewinds=2), max_rewinds=2, target=30, algo_cap=None)
    assert (spent.remedy, spent.rewind, spent.changes) == ("stop", 2, {})
    line = guard.said(dataclasses.asdict(spent))
    assert line == "rewound to step 30 and stopped (trainer.guard.max_rewinds=2 spent)"
    # no checkpoint passed: stop
    assert decide(trip, lr, GuardState(), 2, None, None).remedy == "stop"
    # is_correction: the tripwire's cap where algo.is_correction_cap is null, else algo's
    fix = _node(remedy="is_correction", is_correction="sequence_mask", is_correction_cap=3)
    assert decide(trip, fix, GuardState(), 2, 30, None).changes == {"is_correction": "sequence_mask",
                                                                     "is_correction_cap": 3.0}
    assert decide(trip, fix, GuardState(), 2, 30, 2.0).changes["is_correction_cap"] == 2.0


def test_decisions_compound_the_learning_rate_and_count_rewinds():
    state = GuardState()
    lr = dataclasses.asdict(decide(guard.Trip("entropy", 5, {}, ""), _node(remedy="lr", lr_factor=0.5), state, 2,
                                   4, None))
    state = after(state, lr)
    state = after(state, {**lr, "rewind": 2})
    # 0.5 x 0.5 = 0.25 of the configured rate; two lines, two rewinds
    assert state == GuardState(decisions=2, rewinds=2, lr_scale=0.25)
    stop = {**lr, "remedy": "stop", "rewind": 2, "changes": {}}
    assert after(state, stop) == GuardState(decisions=3, rewinds=2, lr_scale=0.25)


def test_a_resume_applies_the_decisions_made_after_its_checkpoint_that_rewound_to_it():
    lines = [{"rewound_to": 10}, {"rewound_to": 30}, {"rewound_to": 30}, {"rewound_to": 20}]
    # checkpoint 30 was written after line 1 (its state: 1 decision); lines 2-3 rewound to it: a run killed after them
    assert pending(lines, done=1, step=30) == lines[1:3]
    # its state holds all 4: nothing pending
    assert pending(lines, done=4, step=30) == []
    # resume=RUN/checkpoints/step_000010 with 1 decision: line 2 rewound elsewhere, an abandoned branch from there
    assert pending(lines, done=1, step=10) == []


def test_apply_scales_the_learning_rate_by_the_state_s_scale_over_the_checkpoint_s(tmp_path):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    class Run:  # what `apply` reads of a recipe.Run
        def __init__(self):
            self.optimizer, self.scheduler, self.state = optimizer, scheduler, TrainerState(step=0, history=[])

    run = Run()
    # the checkpoint was written with scale 0.5 (its files hold lr 0.1 as written then); the run goes on at 0.25
    out = guard.apply(run, GuardState(lr_scale=0.5), GuardState(decisions=2, rewinds=2, lr_scale=0.25))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05) and scheduler.get_last_lr() == [pytest.approx(0.05)]
    optimizer.step()
    scheduler.step()  # the schedule goes on from the scaled base: 0.05 x lambda 1.0
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert out is run and run.state.guard["lr_scale"] == 0.25


def test_apply_rebuilds_the_loss_with_the_correction_in_force():
    from grpo_cli.algo import build_loss

    cfg = compose("train")
    run = dataclasses.make_dataclass("R", ["cfg", "loss", "optimizer", "scheduler", "state"])(
        cfg, build_loss(cfg.algo), None, None, TrainerState(step=0, history=[]))
    out = guard.apply(run, GuardState(), GuardState(decisions=1, rewinds=1, is_correction="sequence_mask",
                                                    is_correction_cap=3.0))
    assert (out.loss.settings.is_correction, out.loss.settings.is_correction_cap) == ("sequence_mask", 3.0)
    assert cfg.algo.is_correction == "token_truncate"  # the run's config says what was declared


# ---- settings refused before the model loads ----------------------------------------------------------------------

@pytest.mark.parametrize("overrides, line", [
    (["+trainer.guard.reward_hack={remedy:stop}"],
     "trainer.guard.reward_hack is not a tripwire; the tripwires are heldout_drop, nonfinite, logp_gap, entropy or "
     "length: drop it"),
    (["trainer.guard.heldout_drop.lr_factor=null"],
     "trainer.guard.heldout_drop.remedy=lr needs its factor: trainer.guard.heldout_drop.lr_factor (None) must be a "
     "number > 0; set trainer.guard.heldout_drop.lr_factor=0.5"),
    # both of the remedy's parameters missing: a line each
    (["trainer.guard.entropy.remedy=is_correction"],
     "trainer.guard.entropy.remedy=is_correction needs its mode: trainer.guard.entropy.is_correction (None) must be "
     "token_truncate, token_mask, sequence_truncate or sequence_mask; set "
     "+trainer.guard.entropy.is_correction=sequence_mask\n"
     "trainer.guard.entropy.remedy=is_correction needs a cap, and algo.is_correction_cap is null: "
     "trainer.guard.entropy.is_correction_cap (None) must be >= 1; set +trainer.guard.entropy.is_correction_cap=3"),
    (["trainer.guard.logp_gap.is_correction_cap=null"],
     "trainer.guard.logp_gap.remedy=is_correction needs a cap, and algo.is_correction_cap is null: "
     "trainer.guard.logp_gap.is_correction_cap (None) must be >= 1; set trainer.guard.logp_gap.is_correction_cap=3"),
    (["trainer.guard.length.remedy=rollback"],
     "trainer.guard.length.remedy ('rollback') must be lr, is_correction or stop; set trainer.guard.length.remedy=lr"),
    (["trainer.guard.length.window=0"],
     "trainer.guard.length.window (0) must be an integer >= 1; set trainer.guard.length.window as conf/train.yaml "
     "does"),
    (["trainer.guard.length.max_ratio=null", "trainer.guard.length.max_truncated_rise=null"],
     "trainer.guard.length.max_ratio and trainer.guard.length.max_truncated_rise are all null, so it never fires; set "
     "trainer.guard.length=null to turn it off, or one of them as conf/train.yaml does"),
    (["trainer.guard.length.max_ratio=0"],
     "trainer.guard.length.max_ratio (0) must be a number > 0 or null (off); set trainer.guard.length.max_ratio as "
     "conf/train.yaml does"),
    (["+trainer.guard.entropy.max=1"],
     "trainer.guard.entropy.max is not a setting of this tripwire; its settings are min_ratio, window, remedy, "
     "lr_factor, is_correction or is_correction_cap"),
    (["trainer.guard.nonfinite.steps=4"],
     "trainer.guard.nonfinite.steps (4) is more than trainer.max_nonfinite_steps (3), which stops the run first; "
     "set trainer.guard.nonfinite.steps=3"),
    (["trainer.guard.max_rewinds=-1"], "trainer.guard.max_rewinds (-1) must be an integer >= 0; set "
     "trainer.guard.max_rewinds=2"),
])
def test_bad_guard_settings_are_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        validate(compose("train", overrides), *train.CHECKS)
    assert str(err.value) == line


def test_the_default_guard_and_no_guard_pass_the_checks():
    validate(compose("train"), *train.CHECKS)
    validate(compose("train", ["trainer.guard=null"]), *train.CHECKS)
    validate(compose("train", ["trainer.guard.entropy=null", "trainer.guard.logp_gap.remedy=stop"]), *train.CHECKS)
    validate(compose("train", ["trainer.guard.length.max_ratio=1.5", "trainer.guard.length.max_truncated_rise=null"]),
             *train.CHECKS)
