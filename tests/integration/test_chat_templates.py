"""data.chat_template (a .jinja file in place of the tokenizer's template) and data.chat_template_kwargs (variables the
template reads): the run keeps the template's text, so its resume and its eval render the prompts it trained on."""

from __future__ import annotations

import json

from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import EVAL_TINY, TINY

# prints the kwarg it is given, then the messages as the tiny model's own template does
TEMPLATE = ("[{{ mode }}|thinking={{ enable_thinking }}]{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_template_and_its_kwargs_round_trip_through_a_saved_run(tmp_path):
    template = tmp_path / "mine.jinja"
    template.write_text(TEMPLATE.replace("{{ mode }}", "A"))
    run = tmp_path / "run"
    code, _, err = run_cli(["train", *TINY, "trainer.max_steps=1", "trainer.save_every=1", "sampler=default",
                            f"data.chat_template={template}", "+data.chat_template_kwargs.enable_thinking=false",
                            f"hydra.run.dir={run}"], cwd=tmp_path)
    assert code == 0, err
    # the file changes, then moves away: the run renders with the text it trained with
    template.write_text(TEMPLATE.replace("{{ mode }}", "B"))
    template.rename(tmp_path / "moved.jinja")
    code, _, err = run_cli(["train", f"resume={run}", "trainer.max_steps=2"], cwd=tmp_path)
    assert code == 0, err
    out = tmp_path / "eval"
    code, _, err = run_cli(["eval", f"checkpoint={run}/checkpoints/step_000002", "eval.limit=2",
                            f"hydra.run.dir={out}"], cwd=tmp_path)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert rows and all(r["prompt"].startswith("[A|thinking=False]<|im_start|>user\n") for r in rows)


def test_kwargs_reach_the_template_in_eval(tmp_path):
    # the kwargs are the variables the template prints
    template = tmp_path / "kw.jinja"
    template.write_text(TEMPLATE)
    out = tmp_path / "eval"
    code, _, err = run_cli(["eval", *EVAL_TINY, "eval.limit=1", f"data.chat_template={template}",
                            "+data.chat_template_kwargs.mode=K", "+data.chat_template_kwargs.enable_thinking=true",
                            f"hydra.run.dir={out}"], cwd=tmp_path)
    assert code == 0, err
    row = json.loads((out / "eval_samples.jsonl").read_text().splitlines()[0])
    assert row["prompt"].startswith("[K|thinking=True]<|im_start|>user\n")


def test_a_missing_template_file_stops_before_the_model_loads(tmp_path, no_model):
    line = one_line_error(run_cli(["train", *TINY, f"data.chat_template={tmp_path}/nowhere.jinja",
                                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path))
    assert line == (f"error: data.chat_template ({tmp_path}/nowhere.jinja) is not a file: give the path of a .jinja "
                    f"chat template, or set data.chat_template=null for the tokenizer's own")
