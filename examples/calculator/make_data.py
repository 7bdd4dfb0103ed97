"""Write the example's data: 3-digit x 2-digit products, `train.jsonl` (400 rows) and `heldout.jsonl` (50 rows,
no product of train), seeded, in TRL's format (a `prompt` and the `answer` column the reward reads).

    python make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
QUESTION = "What is {a} * {b}? Give the final answer as a number."


def rows(seed: int = 0, train: int = 400, heldout: int = 50) -> tuple[list[dict], list[dict]]:
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < train + heldout:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        if (a, b) not in seen:
            seen.add((a, b))
            out.append({"prompt": QUESTION.format(a=a, b=b), "answer": str(a * b)})
    return out[:train], out[train:]


def main() -> None:
    for name, part in zip(("train", "heldout"), rows()):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
