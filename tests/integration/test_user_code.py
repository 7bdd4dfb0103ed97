"""The working folder: its files stand in for no library module, and the user's own modules named by a setting
still import from it (grpo_cli/user_code.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import metrics

# the tiny model, one prompt x G=2 for 2 steps: enough to call a reward twice
TINY = ["model=tiny", "sampler.max_new_tokens=8", "algo.group_size=2", "trainer.prompts_per_step=1",
        "trainer.micro_batch_size=2", "trainer.warmup_steps=0", "trainer.report_to=[]", "trainer.max_steps=2",
        "trainer.eval_every=null"]

# a file that leaves a mark and breaks whatever imports it in place of the library module of its name
IMPOSTOR = ("import pathlib\npathlib.Path('{name}.RAN').touch()\n"
            "raise RuntimeError('{name}.py of the working folder ran')\n")

# a user's reward file that uses the two library modules the impostors are named after
MY_REWARDS = '''
import json
import statistics

def spread(prompts, completions, **kwargs):
    json.dumps(completions)
    mean = statistics.mean(len(c) for c in completions)
    return [float(len(c) > mean) for c in completions]
'''


@pytest.fixture()
def folder(tmp_path: Path, monkeypatch) -> Path:
    """A working folder with json.py and statistics.py beside the user's reward file; both library modules are made
    to import afresh, as in a new `grpo` process, where the working folder's files would come first."""
    for name in ("json", "statistics"):
        (tmp_path / f"{name}.py").write_text(IMPOSTOR.format(name=name))
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    return tmp_path


def test_files_named_like_library_modules_neither_break_nor_run_under_train(folder):
    out = run_cli(["train", *TINY, "reward=custom", "reward.funcs=[my_rewards.spread]", "hydra.run.dir=run"],
                  cwd=folder)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list(folder.glob("*.RAN"))
    # the user's module from the working folder scored both steps
    assert [m["step"] for m in metrics(folder / "run") if "rewards/spread/mean" in m] == [1, 2]


def test_a_user_module_named_like_a_library_module_is_refused_with_one_line(folder):
    (folder / "statistics.py").write_text("def score(prompts, completions, **kwargs):\n    return [1.0] * "
                                          "len(completions)\n")
    out = run_cli(["train", *TINY, "reward=custom", "reward.funcs=[statistics.score]", "hydra.run.dir=run"],
                  cwd=folder)
    line = one_line_error(out)
    assert "reward.funcs[0]: statistics.py in the working folder" in line
    assert "has the name of the installed module 'statistics'" in line and "rename it" in line
