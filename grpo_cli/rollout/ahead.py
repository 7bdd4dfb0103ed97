"""Rollouts one step ahead (`algo.max_staleness=K`, K >= 1): while the trainer updates on step t's rollouts, the
vLLM server samples steps t+1 ... t+K's from the weights it holds, so sampling and the update overlap.

    grpo serve &
    grpo train sampler=vllm_server algo.max_staleness=1

At step t (its prompts drawn, its rollouts taken), `launch` sends the requests of every step up to t+K not yet in
flight: their prompts are the stream's next draws (peeked, the stream does not move), their seeds are drawn from a
generator seeded for that step exactly as the synchronous loop seeds `run.generator`, and they name the version the
server holds then, the policy after step t-1's update. So with K = 1 the rollouts a step trains on are one update
old (`sampler/staleness` 1), never older than K; everything else (prompts, seeds, the update) is the synchronous
loop's, and only the weights they were sampled from differ. The trainer's old log-probs are the current policy's,
so the PPO ratio and the KL are as in the paper; the importance-sampling correction (`algo.is_correction_cap`)
weighs each token by π_trainer / π_server with the server's own log-probs, which now also carry the staleness.

Resume. A checkpoint waits for the rollouts in flight and keeps them (`state_dict`: their prompts' and
completions' token ids and the server's log-probs, in trainer_state.json), so a resumed run trains on exactly the
rollouts the uninterrupted run would have, neither lost nor sampled twice.

Where it departs from the paper: GRPO samples each step's groups from π_θold, the policy being updated; here they
come from the policy up to K updates older.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

import torch

from grpo_cli.rollout import Rollout
from grpo_cli.rollout.vllm_server import Call, Pending

# hosts that mean "this machine" in sampler.url
LOCAL = {"127.0.0.1", "localhost", "0.0.0.0", "::1"}


def shared_cores(k: int, url: str | None, device: str, usable: int | None = None,
                 cores: int | None = None) -> str | None:
    """The line for a run whose rollouts go ahead (k >= 1) from a server on this machine while the trainer computes on
    its CPU free to use every core (`usable`: the cores this process may run on, `cores`: the machine's): the server
    decodes the next step's rollouts during the update on the same cores, which made a step 5x slower on 2 cores
    (docs/speed.md). None when the trainer is pinned, the server is elsewhere, or the loop is synchronous."""
    usable = len(os.sched_getaffinity(0)) if usable is None and hasattr(os, "sched_getaffinity") else usable
    cores = cores or os.cpu_count()
    if k < 1 or device != "cpu" or urlparse(url or "").hostname not in LOCAL or usable is None or usable < cores:
        return None
    return (f"rollouts ahead (algo.max_staleness={k}) from a server on this machine, which shares all {cores} cores "
            f"with this trainer: pin each to its own (taskset); sharing 2, a step took 5x as long (docs/speed.md)")


@dataclass
class Ahead:
    """The rollouts in flight, by the step that will train on them; `k`: algo.max_staleness."""

    k: int
    pending: dict = field(default_factory=dict)  # step -> (vllm_server.Pending, policy version that sampled it)
    pool: ThreadPoolExecutor | None = None  # the HTTP calls in flight, started by the first launch
    staleness: int = 0  # of the rollout `take` gave last

    def take(self, step: int) -> Rollout | None:
        """Step `step`'s rollout, or None when none is in flight (the first step): then the step samples as usual.
        `staleness`: the updates between the policy that sampled it and the one step `step` updates (0: none)."""
        entry = self.pending.pop(step, None)
        self.staleness = 0
        if entry is None:
            return None
        pending, version = entry
        self.staleness = step - 1 - version
        return pending.result()

    def launch(self, step: int, last: int, sampler, policy, tokenizer, draw, group_size: int, seed_of) -> None:
        """Send the requests of steps step+1 ... step+k (none after `last`, the run's last step) not yet in flight.
        `draw(j)`: the examples of the j-th draw after the current one (0: the next step's); `seed_of(s)`: step s's
        sampling seed on this rank."""
        for ahead in range(1, self.k + 1):
            target = step + ahead
            if target in self.pending or target > last:
                continue
            generator = torch.Generator().manual_seed(seed_of(target))
            self.pool = self.pool or ThreadPoolExecutor(max_workers=64)
            pending = sampler.submit(policy, tokenizer, draw(ahead - 1), group_size, generator, self.pool)
            self.pending[target] = (pending, step - 1)  # sampled from the policy after step-1 updates

    def metrics(self) -> dict:
        """The step's `sampler/staleness` (none in the synchronous loop)."""
        return {"sampler/staleness": self.staleness} if self.k else {}

    def saved(self) -> dict:
        """What a checkpoint's trainer_state holds of this: {"ahead": state_dict()}; nothing when synchronous."""
        return {"ahead": self.state_dict()} if self.k else {}

    def state_dict(self) -> dict:
        """The rollouts in flight, waited for: {step: {version, rows: prompt ids, n, answers}} (JSON)."""
        out = {}
        for target, (pending, version) in sorted(self.pending.items()):
            out[str(target)] = {"version": version, "calls": [{"rows": c.rows, "n": c.n, "answers": a}
                                                               for c, a in zip(pending.calls, pending.answers())]}
        return out

    def load_state_dict(self, state: dict | None, sampler, tokenizer, device) -> None:
        """The rollouts a checkpoint kept, ready for `take` at their steps (and for the next checkpoint, if it comes
        first: with K > 1 a kept rollout can outlive one)."""
        self.pending = {}
        for target, entry in (state or {}).items():
            calls, futures = [], []
            for c in entry["calls"]:
                calls.append(Call([list(map(int, r)) for r in c["rows"]], int(c["n"]), [], tokenizer, device))
                futures.append(Future())
                futures[-1].set_result([[(list(map(int, t)), [float(x) for x in lp]) for t, lp in out]
                                        for out in c["answers"]])
            self.pending[int(target)] = (Pending(sampler, calls, futures, version=""), int(entry["version"]))
