"""grpo_cli.config: the recipes are stored in Hydra's ConfigStore once a process, and again when a file changes."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

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
