"""The suite's YAML parse cache (tests.helpers.cli.parse_each_yaml_text_once, installed by conftest) gives what a fresh
parse gives: the same config, a new object each load, a changed file read anew, a bad one refused each time."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf

from grpo_cli.config import compose


def test_conftest_installed_it():
    assert getattr(OmegaConf.load, "parses_once", False)


def test_a_load_is_a_fresh_parse_and_a_new_object(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("a: 1\nb: ${a}\nc: ???\nd: [1, 2.5, x]\ne: null\n")
    first = OmegaConf.load(path)
    first.a = 5  # a caller's edit reaches no later load
    second = OmegaConf.load(path)
    with open(path) as f:  # a file object, as Hydra passes it
        third = OmegaConf.load(f)
    for cfg in (second, third):
        assert cfg.a == 1 and cfg.b == 1 and OmegaConf.is_missing(cfg, "c") and list(cfg.d) == [1, 2.5, "x"]
        assert cfg.e is None and OmegaConf.to_yaml(cfg, resolve=False) == OmegaConf.to_yaml(second, resolve=False)
    assert first is not second and first.a == 5


def test_an_edited_file_is_read_anew_and_a_bad_one_refused_every_time(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("a: 1\n")
    assert OmegaConf.load(path).a == 1
    path.write_text("a: 2\n")
    assert OmegaConf.load(path).a == 2
    path.write_text("a: 1\na: 2\n")  # OmegaConf's loader refuses a duplicate key
    for _ in range(2):
        with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key"):
            OmegaConf.load(path)


def test_composed_configs_are_the_ones_a_fresh_parse_composes(monkeypatch):
    cached = OmegaConf.to_yaml(compose("train", ["model=tiny", "+recipe=gsm8k"]))
    monkeypatch.setattr(OmegaConf, "load", staticmethod(OmegaConf.load.original))  # every file parsed again
    assert OmegaConf.to_yaml(compose("train", ["model=tiny", "+recipe=gsm8k"])) == cached
