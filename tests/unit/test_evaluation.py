"""grpo_cli.evaluation: pass@k and maj@k against hand-made cases, and which held-out problems an in-run eval scores."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest

from grpo_cli import evaluation
from grpo_cli.distributed import World
from grpo_cli.errors import ConfigError


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that hold at least one correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_equals_enumeration(n, c, k):
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_large_n_is_finite():
    # C(1000, 500) overflows a float; the product form does not: 1 - C(900,10)/C(1000,10)
    expected = 1 - math.comb(900, 10) / math.comb(1000, 10)
    assert evaluation.pass_at_k(1000, 100, 10) == pytest.approx(expected, rel=1e-9)


def test_majority_vote():
    # "7" twice beats "5" once; None votes are ignored
    assert evaluation.majority_correct(["7", "5", "7", None], "7")
    assert not evaluation.majority_correct(["5", "5", "7"], "7")
    # "7.0" and "7" are different strings, so 2 votes each; ties go to the first seen ("7.0" = 7: correct)
    assert evaluation.majority_correct(["7.0", "3", "3", "7.0"], "7")
    assert not evaluation.majority_correct([None, None], "7")


def test_an_in_run_eval_scores_the_first_eval_size_held_out_problems():
    data = SimpleNamespace(heldout=[{"question": str(i)} for i in range(20)])
    assert [p["question"] for p in evaluation.eval_problems(data, 10, 3)] == ["0", "1", "2"]
    assert evaluation.eval_problems(data, None, 30) == []  # eval off: nothing to check, nothing to score


@pytest.mark.parametrize("data, line", [
    (SimpleNamespace(heldout=[{}] * 20),
     "trainer.eval_size (30) is larger than the data's held-out split (20 problems); set trainer.eval_size=20 "
     "(or auto), or hold out more (data.heldout_size)"),
    (SimpleNamespace(heldout=[]),
     "trainer.eval_every (10) scores held-out problems and the data (SimpleNamespace) has none; set "
     "trainer.eval_every=null, or give the data a held-out split (data.heldout_size)"),
    (SimpleNamespace(),  # a task of the user's own without a held-out split
     "trainer.eval_every (10) scores held-out problems and the data (SimpleNamespace) has none; set "
     "trainer.eval_every=null, or give the data a held-out split (data.heldout_size)"),
])
def test_held_out_problems_an_in_run_eval_cannot_have_are_one_line(data, line):
    with pytest.raises(ConfigError) as err:
        evaluation.eval_problems(data, 10, 30)
    assert str(err.value).splitlines() == [line]


def test_an_in_run_evals_record_and_line():
    rows = [{"reference": "7", "correct": c, "greedy": {"reward": r, "length": n, "truncated": False},
             "samples": [], "index": i} for i, (c, r, n) in enumerate([(True, 1.0, 10), (False, 0.5, 20)] * 2)]
    metrics = evaluation.eval_metrics(rows)
    # 2 of 4 right: Wilson (z = 1.96) 0.15-0.85; rewards (1 + 0.5) / 2; lengths (10 + 20) / 2
    assert metrics == {"eval/accuracy": 0.5, "eval/accuracy_low": pytest.approx(0.15004, abs=1e-5),
                       "eval/accuracy_high": pytest.approx(0.84996, abs=1e-5), "eval/reward": 0.75,
                       "eval/mean_length": 15.0}
    assert evaluation.eval_line(10, metrics, 4) == ("step 10: held-out accuracy 0.500 (0.15-0.85, 4 problems), "
                                                    "reward 0.75, length 15")
    # open prompts (no reference answers): no accuracy to give, the mean reward alone
    open_rows = [{**r, "reference": None, "correct": None} for r in rows]
    assert evaluation.eval_metrics(open_rows) == {"eval/reward": 0.75, "eval/mean_length": 15.0}
    assert evaluation.eval_line(10, evaluation.eval_metrics(open_rows), 4) == (
        "step 10: held-out reward 0.75, length 15 (4 problems, no reference answers)")


def test_each_rank_scores_every_nth_problem_in_batches_and_every_rank_gets_all_rows(monkeypatch):
    batches = []

    def score_batch(policy, tokenizer, sampler, reward_fn, batch):
        batches.append([p["question"] for p in batch])
        return [{"question": p["question"]} for p in batch]

    class SecondOfTwo(World):  # rank 1 of 2; the other rank's rows as its gather would bring them
        def gather(self, obj):
            return [[{"question": "0", "index": 0}, {"question": "2", "index": 2}, {"question": "4", "index": 4}], obj]

    monkeypatch.setattr(evaluation, "score_batch", score_batch)
    problems = [{"question": str(i)} for i in range(7)]
    rows = evaluation.greedy_rows(None, None, None, None, problems, SecondOfTwo(rank=1, size=2), batch_size=2)
    assert batches == [["1", "3"], ["5"]]  # problems 1, 3, 5 (every 2nd from 1), 2 a batch
    assert [(r["question"], r["index"]) for r in rows] == [(q, int(q)) for q in "024135"]  # rank 0's, then rank 1's


def test_eval_size_auto_fits_the_data_a_user_brings(capsys):
    """The default (auto): up to AUTO_EVAL_SIZE problems, all of a smaller split, and no eval (one line) without
    one, so the default job's eval never refuses a small dataset; an integer the user sets is held to it."""
    small = SimpleNamespace(heldout=[{"question": str(i)} for i in range(12)])
    assert len(evaluation.eval_problems(small, 10, "auto")) == 12  # 12 < 200: the whole split
    large = SimpleNamespace(heldout=[{"question": str(i)} for i in range(500)])
    assert len(evaluation.eval_problems(large, 10, "auto")) == evaluation.AUTO_EVAL_SIZE == 200
    assert evaluation.eval_problems(SimpleNamespace(heldout=[]), 10, "auto") == []
    assert "no held-out split: no in-run eval" in capsys.readouterr().err


def test_a_run_with_no_problems_to_score_has_no_eval_step():
    """eval_size=auto on data without a held-out split leaves run.heldout empty: no step evaluates, even with
    eval_every set (an eval of no problems would have no accuracy to log or rank)."""
    from grpo_cli.commands.train import evaluates

    trainer = SimpleNamespace(eval_every=2, max_steps=5)
    with_problems = SimpleNamespace(cfg=SimpleNamespace(trainer=trainer), heldout=[{"question": "1"}])
    assert [n for n in range(1, 6) if evaluates(with_problems, n)] == [2, 4, 5]  # every 2nd, and the last
    assert not any(evaluates(SimpleNamespace(cfg=SimpleNamespace(trainer=trainer), heldout=[]), n) for n in range(6))
