"""scripts/update_speed.py's split of a profile by class, against events worked by hand."""

from __future__ import annotations

import pytest

from tests.helpers.scripts import load_script

update_speed = load_script("update_speed")


def test_profile_events_split_by_class_by_hand():
    # (name, input shapes, self µs) as torch.profiler groups them by input shape; vocab 100, LoRA rank 4
    events = [("aten::mm", [[8, 32], [32, 64]], 3_000_000),       # a base projection
              ("aten::mm", [[8, 32], [32, 100]], 1_000_000),      # the LM head's forward
              ("aten::bmm", [[8, 1, 100], [8, 100, 1]], 250_000),  # the head's per-row dot
              ("aten::mm", [[8, 32], [32, 4]], 200_000),          # LoRA's A
              ("aten::addmm", [[8, 64], [8, 4], [4, 64]], 300_000),  # LoRA's B, added by the matmul
              ("aten::_scaled_dot_product_flash_attention_for_cpu", [[1, 2, 8, 16], [], []], 400_000),
              ("aten::mul", [[8, 64], []], 500_000),
              ("aten::mul", [[8, 4], []], 50_000)]                # elementwise: "other" whatever its shape
    split = update_speed.classes(events, vocab=100, rank=4)
    # base 3.0; head 1.0 + 0.25; LoRA 0.2 + 0.3; attention 0.4; other 0.5 + 0.05; total 5.7
    assert split == pytest.approx({"base": 3.0, "head": 1.25, "lora": 0.5, "attention": 0.4, "other": 0.55,
                                   "total": 5.7})
