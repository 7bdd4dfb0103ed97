"""The vLLM-server sampler against the in-process engine and HF generate, on the embedded SmolLM2 (CPU or GPU).

    .venv/bin/python scripts/server_check.py run OUT [--url http://127.0.0.1:8000]   # everything below, resumable
    .venv/bin/python scripts/server_check.py report OUT                               # the tables again

1. A server: the one answering at --url, or `grpo serve` started here (its log: OUT/serve.log).
2. A 4-step run of the default job sampled by the server (OUT/run), which moves the adapter.
3. `grpo eval` of that run (the base model and the step-4 checkpoint, 50 held-out problems, greedy) three times:
   sampler=vllm_server, sampler=vllm (in process) and sampler=default (HF generate); each pair of engines must give the
   same completion on at least 49 of the 50 problems, for the base and for the checkpoint.
(Bytes and seconds per weight push, each way: scripts/push_cost.py.)
Each stage writes its files and is skipped when they are there, so the script can be stopped and run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GRPO = [sys.executable, "-m", "grpo_cli.cli"]
ENGINES = ("vllm_server", "vllm", "default")
PROBLEMS = 50


def up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


def start(url: str, log: Path, prefix: tuple[str, ...] = (), overrides: tuple[str, ...] = ()) -> subprocess.Popen:
    """`grpo serve` on `url` (its own process group: the server and its engine process), once it answers; `prefix`
    goes before the command (`taskset -c 0`: the server on core 0), `overrides` after it (the run's sampler)."""
    proc = subprocess.Popen([*prefix, *GRPO, "serve", *overrides, f"sampler.url={url}"], stdout=open(log, "a"),
                            stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    t = time.time()
    while not up(url):
        if proc.poll() is not None or time.time() - t > 900:
            sys.exit(f"grpo serve did not start (see {log})")
        time.sleep(3)
    print(f"server up after {time.time() - t:.0f} s", flush=True)
    return proc


def server(url: str, out: Path) -> subprocess.Popen | None:
    """The server at `url`, started here when none answers."""
    return None if up(url) else start(url, out / "serve.log")


def grpo(*args: str, log: Path) -> float:
    t = time.time()
    with open(log, "w") as f:
        code = subprocess.call([*GRPO, *args], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                               env={**os.environ, "GRPO_NO_VLLM": "0"})
    if code:
        sys.exit(f"grpo {args[0]} failed ({code}): {log}")
    return time.time() - t


def train(url: str, out: Path) -> None:
    if (out / "run" / "checkpoints" / "step_000004").is_dir():
        return
    s = grpo("train", "trainer.max_steps=4", "trainer.eval_every=null", "sampler=vllm_server", f"sampler.url={url}",
             f"hydra.run.dir={out / 'run'}", log=out / "train.log")
    print(f"train: 4 steps in {s:.0f} s", flush=True)


def evaluate(url: str, out: Path) -> None:
    for engine in ENGINES:
        folder = out / f"eval_{engine}"
        if (folder / "eval.json").exists():
            continue
        extra = [f"sampler.url={url}"] if engine == "vllm_server" else []
        s = grpo("eval", f"checkpoint={out / 'run'}", "eval.include_base=true", f"eval.limit={PROBLEMS}",
                 f"sampler={engine}", *extra, f"hydra.run.dir={folder}", log=out / f"eval_{engine}.log")
        print(f"eval with {engine}: {s:.0f} s", flush=True)


def completions(folder: Path) -> dict[tuple[str, str], str]:
    """{(checkpoint, problem): greedy completion} of one eval."""
    rows = [json.loads(line) for line in (folder / "eval_samples.jsonl").read_text().splitlines()]
    return {(str(r["checkpoint"]), str(r["index"])): r["greedy"]["text"] for r in rows}


def report(out: Path) -> None:
    found = {e: completions(out / f"eval_{e}") for e in ENGINES if (out / f"eval_{e}" / "eval.json").exists()}
    print("| pair | checkpoint | same greedy completion |\n|---|---|---|")
    names = list(found)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            keys = sorted(set(found[a]) & set(found[b]))
            for ckpt in sorted({k[0] for k in keys}):
                mine = [k for k in keys if k[0] == ckpt]
                same = sum(found[a][k] == found[b][k] for k in mine)
                print(f"| {a} vs {b} | {Path(ckpt).name or ckpt} | {same}/{len(mine)} |")
    for e in names:
        acc = json.loads((out / f"eval_{e}" / "eval.json").read_text())
        print(f"{e}: {json.dumps(acc)[:300]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["run", "report"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "run":
        proc = server(args.url, out)
        try:
            train(args.url, out)
            evaluate(args.url, out)
        finally:
            if proc is not None:
                proc.terminate()
    report(out)


if __name__ == "__main__":
    main()
