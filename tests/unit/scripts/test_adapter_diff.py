"""scripts/adapter_diff.py on run folders written by hand: checkpoints matched in the order written, differences."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from tests.helpers.scripts import load_script

adapter_diff = load_script("adapter_diff")


def checkpoint(folder, value: float):
    folder.mkdir(parents=True)
    save_file({"a": torch.full((2, 2), 2.0), "b": torch.tensor([value])}, str(folder / "adapter_model.safetensors"))


def test_checkpoints_pair_in_the_order_written_and_differences_are_measured(tmp_path):
    for run, later in (("x", 1.0), ("y", 1.5)):
        checkpoint(tmp_path / run / "checkpoints" / "abandoned-20261207-010000" / "step_000010", 1.0)
        checkpoint(tmp_path / run / "checkpoints" / "step_000008", later)
    labels = [label for label, _ in adapter_diff.checkpoints(tmp_path / "x")]
    assert labels == ["pass1/step_000010", "kept/step_000008"]
    pairs = list(zip(adapter_diff.checkpoints(tmp_path / "x"), adapter_diff.checkpoints(tmp_path / "y")))
    assert adapter_diff.difference(pairs[0][0][1], pairs[0][1][1]) == (True, 0.0, 0.0)
    # b differs by 0.5; the largest value in x's adapter is 2.0: relative 0.25
    assert adapter_diff.difference(pairs[1][0][1], pairs[1][1][1]) == (False, 0.5, 0.25)
