"""grpo_cli.rm.classifier.save_reward_model: the old model stays in place until the new one is whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.runs import digests


def test_save_reward_model_keeps_the_old_model_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from grpo_cli.rm.classifier import save_reward_model

    def writer(name: str, text: str):
        return SimpleNamespace(config=SimpleNamespace(pad_token_id=None), pad_token_id=0,
                               save_pretrained=lambda folder, **_: (Path(folder) / name).write_text(text))

    folder = tmp_path / "rm"
    save_reward_model(writer("model.safetensors", "old"), writer("tokenizer.json", "old"), folder, {"v": 1})
    before = digests(folder)
    real = Path.rename

    def renames(self, target):  # the old model has been moved aside; putting the new one in place fails
        if ".tmp" in self.name:
            raise OSError(28, "No space left on device")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", renames)
    with pytest.raises(OSError):
        save_reward_model(writer("model.safetensors", "new"), writer("tokenizer.json", "new"), folder, {"v": 2})
    assert digests(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["rm"]
    monkeypatch.setattr(Path, "rename", real)
    save_reward_model(writer("model.safetensors", "new"), writer("tokenizer.json", "new"), folder, {"v": 2})
    assert (folder / "model.safetensors").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["rm"]
