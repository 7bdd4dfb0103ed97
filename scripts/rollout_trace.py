"""The rollout's path through the code in one training step: which of grpo_cli's modules it enters, in order.

    .venv/bin/python scripts/rollout_trace.py OUT [--repo PATH]     # PATH: another checkout, to compare

One step of the tiny model's job (HF generate, 2 prompts x 4 completions) runs in this process under a profile
hook (`sys.setprofile`). Every call of a grpo_cli function that receives a `Rollout` as an argument (its methods
included: `self` is one) is a visit to that function's module; the path is those modules in call order, each
run of visits to one module written once. A return into rollout/ is a visit to grpo_cli/rollout/ after the path has
left it. A record's own methods (take, lengths, loss_mask: `self` is the Rollout) are visits too, so the path shows
where the record is read. Separately, every call from another module into a grpo_cli.rollout function once the step's
rollout exists, the record's own methods left out: the code downstream of the sampler reaching back into the
sampler's package (for something the record could carry, or for a helper that lives there). Prints the path, the
functions visited in each module, and those calls by caller and callee.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

JOB = ["train", "model=tiny", "sampler=short", "sampler.max_new_tokens=8", "algo.group_size=4",
       "trainer.prompts_per_step=2", "trainer.micro_batch_size=4", "trainer.max_steps=1", "trainer.eval_every=null",
       "trainer.report_to=[]", "trainer.log_completions_every=null"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args()
    repo = args.repo.resolve()
    sys.path.insert(0, str(repo))
    os.chdir(repo)
    from grpo_cli import cli

    visits: list[tuple[str, str]] = []   # (module, function) that received a Rollout, in call order
    reaches: list[tuple[str, str]] = []  # (caller's module, rollout/ function) once the step's rollout exists
    born = False

    def hook(frame, event, _arg):
        nonlocal born
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("grpo_cli"):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(type(frame.f_locals.get(n)).__name__ == "Rollout" for n in names):
            visits.append((module, code.co_name))
        own = type(frame.f_locals.get("self")).__name__ == "Rollout"  # the record's own methods
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if born and not own and module.startswith("grpo_cli.rollout") and caller.startswith("grpo_cli") \
                and not caller.startswith("grpo_cli.rollout"):
            reaches.append((caller, f"{module}.{code.co_name}"))
        born = born or (own and code.co_name == "__init__")

    sys.argv = ["grpo", *JOB, f"hydra.run.dir={args.out.resolve()}"]
    sys.setprofile(hook)
    try:
        cli.main()
    except SystemExit as done:
        if done.code:
            raise
    finally:
        sys.setprofile(None)

    path: list[tuple[str, list[str]]] = []
    for module, fn in visits:
        if path and path[-1][0] == module:
            if fn not in path[-1][1]:
                path[-1][1].append(fn)
        else:
            path.append((module, [fn]))
    returns = sum(1 for i, (module, _) in enumerate(path)
                  if module.startswith("grpo_cli.rollout") and any(not m.startswith("grpo_cli.rollout")
                                                                 for m, _ in path[:i]))
    print(f"checkout: {repo}\nthe rollout's path ({len(path)} module visits):")
    for i, (module, fns) in enumerate(path, 1):
        print(f"  {i:2d}. {module}: {', '.join(fns)}")
    print(f"visits to grpo_cli.rollout after the path left it: {returns}")
    counts: dict[tuple[str, str], int] = {}
    for pair in reaches:
        counts[pair] = counts.get(pair, 0) + 1
    print(f"calls into grpo_cli.rollout from other modules once the rollout exists, the record's own methods left "
          f"out ({sum(counts.values())} calls, {len(counts)} distinct):")
    for (caller, callee), n in sorted(counts.items()):
        print(f"  {caller} -> {callee}: {n}")

if __name__ == "__main__":
    main()
