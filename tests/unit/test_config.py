"""grpo_cli.config: the recipes are stored in Hydra's ConfigStore once a process, and the files of the plain sections
parsed once, each again when its file changes."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from grpo_cli import config


def test_recipes_are_stored_once_and_again_when_a_recipe_file_changes(tmp_path, monkeypatch):
    recipe = tmp_path / "only_here.yaml"
    recipe.write_text("trainer:\n  max_steps: 3\n")
    monkeypatch.setattr(config, "RECIPES_DIR", tmp_path)
    monkeypatch.setattr(config, "_registered", (), raising=False)
    store = ConfigStore.instance()
    stored, real = [], store.store
    monkeypatch.setattr(store, "store", lambda **kw: (kw.get("group") == "recipe" and stored.append(kw["name"]),
                                                     real(**kw)))
    try:
        assert config.compose("train", ["model=tiny", "+recipe=only_here"]).trainer.max_steps == 3
        config.register_recipes()  # as a command does at import, then before each compose
        assert config.compose("train", ["model=tiny", "+recipe=only_here"]).trainer.max_steps == 3
        assert stored == ["only_here"]
        # an edit, of the same size and likely within the file clock's tick: the recipe is read and stored anew
        recipe.write_text("trainer:\n  max_steps: 4\n")
        assert config.compose("train", ["model=tiny", "+recipe=only_here"]).trainer.max_steps == 4
        assert stored == ["only_here", "only_here"]
    finally:
        store.repo["recipe"].pop("only_here.yaml", None)  # no recipe of this test left to the next


def test_each_plain_sections_file_is_parsed_once_and_again_when_it_changes(tmp_path, monkeypatch):
    cfg = config.compose("train", ["model=tiny"])
    for file in set(config.PLAIN_SECTIONS.values()):
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_text((config.CONF_DIR / file).read_text())
    monkeypatch.setattr(config, "CONF_DIR", tmp_path)
    monkeypatch.setattr(config, "_FILE_KEYS", {}, raising=False)  # none parsed yet in this test
    parsed, create = [], OmegaConf.create
    monkeypatch.setattr(OmegaConf, "create", lambda *a, **kw: (parsed.append(a[0]), create(*a, **kw))[1])
    assert config._unknown_keys(cfg) == [] and config._unknown_keys(cfg) == []
    # train.yaml (trainer and iterative) and algo/grpo.yaml, once each
    assert len([p for p in parsed if isinstance(p, str)]) == 2
    train = tmp_path / "train.yaml"
    train.write_text(train.read_text().replace("\n  max_steps:", "\n  max_stepz:", 1))  # same size
    assert config._unknown_keys(cfg) == ["trainer.max_steps is not a setting; did you mean trainer.max_stepz?"]
