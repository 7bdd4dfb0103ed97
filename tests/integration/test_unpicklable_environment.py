"""An `env=class` environment that cannot be pickled (it holds an open file), scored by reward functions in worker
processes (`reward=custom`, `reward.worker=process`): the environments column cannot reach them, which `train`,
`eval` and `sample` say on one line naming the fix before the model loads, not at step 1's first reward call."""

from __future__ import annotations

import pytest

from grpo_cli import recipe
from grpo_cli.commands import evaluate, sample
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import EVAL_TINY, TINY

MY_ENV = '''
class Logbook:
    """A game that keeps its log file open."""

    def __init__(self):
        self.log = None

    def reset(self, **row):
        self.log = open(__file__)  # an open file: the instance does not pickle from here on

    def note(self, text: str) -> str:
        """Write a note.

        Args:
            text: the note
        """
        return "noted"


def wrote_a_note(prompts, completions, environments=None, **kwargs):
    return [1.0] * len(completions)
'''


@pytest.mark.parametrize("command", ["train", "eval", "sample"])
def test_an_environment_that_cannot_reach_a_reward_worker_stops_before_the_model_loads(tmp_path, monkeypatch,
                                                                                       command):
    (tmp_path / "my_env.py").write_text(MY_ENV)
    for module, name in ((recipe, "build_policy"), (evaluate, "inference_policy"), (sample, "inference_policy")):
        monkeypatch.setattr(module, name, lambda *_: pytest.fail("the model loaded"))
    base = [*TINY[:-2], "trainer.max_steps=1"] if command == "train" else [*EVAL_TINY, "eval.limit=1"] \
        if command == "eval" else [*EVAL_TINY, "sample.num_prompts=1"]
    line = one_line_error(run_cli([command, *base, "env=class", "env.factory=my_env.Logbook", "reward=custom",
                                   "reward.funcs=[my_env.wrote_a_note]", "reward.worker=process",
                                   f"hydra.run.dir={tmp_path / 'out'}"], cwd=tmp_path))
    assert "'environments'" in line and "Logbook" in line, line
    assert line.endswith("set reward.worker=thread to run the reward functions in this process"), line
