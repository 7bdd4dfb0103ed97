"""scripts/credit_diagnostics.py on hand-made completions.jsonl lines: the EOS advantage recomputed from the logged
steps, P(EOS | k-th claim line) and what fills truncated tails."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def cd():
    return load_script("credit_diagnostics")


def line(text, steps=None, accuracy=0.0, truncated=False, step=1, prompt_id=0, advantage=0.0):
    out = {"step": step, "prompt_id": prompt_id, "completion": text, "rewards": {"accuracy": accuracy},
           "advantage": advantage, "truncated": truncated}
    return out if steps is None else {**out, "steps": steps}


def test_eos_advantage_by_hand(cd):
    # tests/unit/test_process_credit.py's test_the_stop_token_by_hand, as completions.jsonl logs it: S stops after one
    # right line (its two unwritten slots at char 9, its answer with the completion at 10), W goes on wrongly. Eight
    # steps, two +1 and six -1: +1 -> 1.731852, -1 -> -0.577284; each EOS carries its answer alone
    group = [line("6 - 3 = 3", [[9, 1.0], [9, -1.0], [9, -1.0], [10, -1.0]]),
             line("6 - 3 = 3\n3 + 8 = 12\n12 - 7 = 5", [[9, 1.0], [20, -1.0], [31, -1.0], [32, -1.0]])]
    down = -0.5 / (0.75 ** 0.5 + 1e-4)
    assert cd.eos_advantages(group, None) == pytest.approx([down, down], abs=1e-5)
    # with process_weight 1 and both wrong, the outcome half is 0
    assert cd.eos_advantages(group, 1.0) == pytest.approx([down, down], abs=1e-5)
    # an outcome run: the logged advantage is every token's
    assert cd.eos_advantages([line("5", advantage=0.7), line("4", advantage=-0.7)], None) == [0.7, -0.7]


def test_stop_after_and_tails(cd):
    rows = [line("6 - 3 = 3"),                                              # stopped after claim line 1
            line("6 - 3 = 3\n3 + 8 = 11"),                                  # stopped after 2
            line("6 - 3 = 3\n3 + 8 = 11\nLet me check.\n3 + 8 = 11\n3 + 8 =", truncated=True)]
    # k=1: 3 reached, 1 stopped there; k=2: 2 reached, 1 stopped; k=3: the truncated one's repeat is its third claim
    # line, and it did not stop (it ran to the cap)
    assert cd.stop_after(rows) == {1: pytest.approx(1 / 3), 2: 0.5, 3: 0.0}
    # the truncated one's tail after its last new claim line: a claim-free line, the same claim again, a cut-off line
    assert cd.tail_kinds(rows) == {"claim-free": 1, "repeated claim": 1, "cut off": 1}


def test_diagnose_a_run_folder(cd, tmp_path):
    rows = [line("6 - 3 = 3", [[9, 1.0], [10, -1.0]], step=s, prompt_id=0) for s in (1, 2)] + [
        line("6 - 3 = 4", [[9, -1.0], [10, -1.0]], step=s, prompt_id=0) for s in (1, 2)]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = cd.diagnose(tmp_path)
    assert sorted(found["steps"]) == [1, 2] and found["process_weight"] is None
    assert "| 1 |" in cd.render(found)
