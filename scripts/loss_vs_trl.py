"""`make loss-vs-trl`: our loss types against TRL's own code (verl's for GMPO, which TRL lacks); RLOO against verl's.

    .venv/bin/python scripts/loss_vs_trl.py                  # 50 random batches per row
    .venv/bin/python scripts/loss_vs_trl.py --batches 200 --json outputs/loss_vs_trl.json

TRL is not a dependency: this script re-runs itself in TRL's scratch venv (--trl-venv, made by
../shared/bench/setup_trl_venv.sh when missing; verl and the few packages its loss module imports are added there
with --no-deps, never to this project's venv), with this checkout on PYTHONPATH, so one process imports both.

How each side is called, on the same float64 random batch (ragged masks, some empty rows, ratios spread so that
every clip, cap and gate binds somewhere; outcome advantages [N] or per-token [N, T]; beta 0 or 0.04):
  - ours: `grpo_cli.objective.grpo_loss(logp, old, ref, advantages, mask, LossSettings(loss_type=..., ...))`;
  - TRL: `GRPOTrainer._compute_loss(stand_in, model=None, inputs)`, the unbound method on a SimpleNamespace
    holding just the attributes it reads (no trainer, no model): its `_get_per_token_logps_and_entropies` returns
    our logp leaf, `inputs` holds old, ref, advantages, mask and `num_items_in_batch`; one process, no gradient
    accumulation (TRL's normalizers then reduce to the batch's). TRL's cispo cap is its epsilon_high;
  - verl (gmpo, TRL has none): `verl.trainer.ppo.core_algos.compute_policy_loss_geo_mean` ("geo_mean", GMPO's
    definition in verl) plus beta x its k3 (`kl_penalty(..., "low_var_kl")`) aggregated by its `agg_loss`
    "seq-mean-token-mean" over all N sequences, as our gmpo aggregates the KL. verl's module imports ray for its
    data protocol only; a stub module stands in for it (the loss functions never touch it).
Each row: the largest |loss_ours - loss_theirs| and |grad_ours - grad_theirs| (w.r.t. logp, elementwise) over the
batches. Pass: both <= --tol (1e-6). Then RLOO's advantages (algo.advantage=rloo) against verl's
`compute_rloo_outcome_advantage` on as many random batches of groups (G 2-8; every reward scored, verl has no
"no score").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "grpo-bench"
# verl's loss module imports these at the top; its own pins (ray, vLLM, ...) are not needed for the losses
VERL_EXTRAS = ["omegaconf", "tensordict", "orjson", "codetiming"]

# row -> (our loss_type, reference, importance_sampling_level, per-token advantages allowed)
ROWS = {
    "grpo": ("grpo", "trl", "token", True), "bnpo": ("bnpo", "trl", "token", True),
    "dr_grpo": ("dr_grpo", "trl", "token", True), "dapo": ("dapo", "trl", "token", True),
    "cispo": ("cispo", "trl", "token", True), "sapo": ("sapo", "trl", "token", True),
    # TRL's sequence ratio carries its gradient through the mean, ours through each token (GSPO-token): the same
    # gradient with one advantage per sequence
    "sapo (sequence level)": ("sapo", "trl", "sequence", False),
    "gmpo": ("gmpo", "verl", "token", True),
}


def outside(a: argparse.Namespace) -> None:
    """In this project's venv: make the scratch venv if needed, then run the comparison inside it."""
    python = a.trl_venv / "bin" / "python"
    if not python.exists():
        print(f"making TRL's scratch venv {a.trl_venv} (once) ...", flush=True)
        subprocess.run(["bash", str(a.trl_setup), str(a.trl_venv), str(a.model_dir)], check=True)
    has_verl = subprocess.run([str(python), "-c", "import verl, tensordict, omegaconf, orjson, codetiming"],
                              capture_output=True).returncode == 0
    if not has_verl:
        pip = [str(a.trl_venv / "bin" / "pip"), "install", "-q"]
        subprocess.run([*pip, "--no-deps", "verl"], check=True)
        constraints = a.trl_venv / "constraints.txt"   # setup_trl_venv.sh's: its torch stays
        subprocess.run([*pip, *(["-c", str(constraints)] if constraints.exists() else []), *VERL_EXTRAS], check=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sys.exit(subprocess.run([str(python), __file__, "--inside", *sys.argv[1:]], env=env).returncode)


def random_batch(g, per_token: bool):
    import torch

    n, t = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(3, 13, (1,), generator=g))
    f64 = {"generator": g, "dtype": torch.float64}
    old = torch.randn(n, t, **f64) * 0.5 - 1.5
    logp = old + torch.randn(n, t, **f64) * 0.7               # ratios e^±0.7 and beyond: clips, caps, gates bind
    ref = logp + torch.randn(n, t, **f64) * 0.4
    mask = (torch.rand(n, t, generator=g) < 0.75).to(torch.float64)
    if torch.rand(1, generator=g) < 0.3:
        mask[0] = 0.0                                           # an empty sequence
    adv = torch.randn(n, t, **f64) if per_token and torch.rand(1, generator=g) < 0.5 else torch.randn(n, **f64)
    beta = 0.04 if torch.rand(1, generator=g) < 0.5 else 0.0
    return logp, old, ref, adv, mask, beta


def trl_loss(loss_type, level, logp, old, ref, adv, mask, beta, s):
    """TRL's GRPOTrainer._compute_loss, unbound, on a stand-in holding what it reads."""
    from collections import defaultdict
    from types import SimpleNamespace

    import torch
    from trl import GRPOTrainer

    leaf = logp.clone().requires_grad_()
    n, t = leaf.shape
    args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1,
                           sapo_temperature_pos=s["sapo_temperature_pos"],
                           sapo_temperature_neg=s["sapo_temperature_neg"])
    accelerator = SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                                  gather_for_metrics=lambda x: x)
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.zeros_like(leaf), None),
        args=args, accelerator=accelerator, model=SimpleNamespace(training=True), loss_type=loss_type, beta=beta,
        epsilon_low=s["epsilon_low"], epsilon_high=s["cispo_cap"] if loss_type == "cispo" else s["epsilon_high"],
        importance_sampling_level=level, top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)}, max_completion_length=t)
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    return loss, torch.autograd.grad(loss, leaf)[0]


def verl_loss(loss_type, level, logp, old, ref, adv, mask, beta, s):
    """verl's GMPO ("geo_mean") and its k3 KL, aggregated over all N sequences."""
    from types import SimpleNamespace

    import torch
    from verl.trainer.ppo import core_algos

    leaf = logp.clone().requires_grad_()
    per_token = adv if adv.dim() == 2 else adv[:, None].expand_as(leaf)
    config = SimpleNamespace(clip_ratio=s["epsilon_low"], clip_ratio_low=s["epsilon_low"],
                             clip_ratio_high=s["epsilon_high"])
    pg_loss, _ = core_algos.compute_policy_loss_geo_mean(old, leaf, per_token, mask, config=config)
    kl = core_algos.kl_penalty(leaf, ref, "low_var_kl")
    loss = pg_loss + beta * core_algos.agg_loss(kl, mask, "seq-mean-token-mean", global_batch_size=leaf.shape[0])
    return loss, torch.autograd.grad(loss, leaf)[0]


def ours(loss_type, level, logp, old, ref, adv, mask, beta, s):
    import torch

    from grpo_cli.objective import LossSettings, grpo_loss

    leaf = logp.clone().requires_grad_()
    settings = LossSettings(beta=beta, loss_type=loss_type, importance_sampling_level=level, **s)
    loss, _ = grpo_loss(leaf, old, ref, adv, mask, settings, max_completion_length=leaf.shape[1])
    return loss, torch.autograd.grad(loss, leaf)[0]


def rloo_row(a: argparse.Namespace) -> dict:
    """Our RLOO advantages against verl's, the largest |ΔA| over the batches."""
    import numpy as np
    import torch
    import verl
    from verl.trainer.ppo import core_algos

    from grpo_cli.objective import outcome_advantages

    g, worst = torch.Generator().manual_seed(a.seed), 0.0
    for _ in range(a.batches):
        size, groups = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        rewards = torch.randn(size * groups, generator=g, dtype=torch.float64)
        index = np.repeat(np.arange(groups), size)                 # verl's prompt uid of each completion
        # verl's rewards are per token, summed over the response: one token each
        theirs, _ = core_algos.compute_rloo_outcome_advantage(rewards[:, None].clone(),
                                                              torch.ones_like(rewards)[:, None], index)
        mine = outcome_advantages(rewards, size, scale="none", estimator="rloo")
        worst = max(worst, (mine - theirs[:, 0]).abs().max().item())
    return {"reference": f"verl {verl.__version__}", "batches": a.batches, "max_abs_dadv": worst,
            "pass": worst <= a.tol}


def inside(a: argparse.Namespace) -> None:
    """In TRL's venv: the table."""
    import types

    import torch

    sys.modules.setdefault("ray", types.ModuleType("ray"))
    sys.modules["ray"].ObjectRef = type("ObjectRef", (), {})   # verl's protocol names ray.ObjectRef in a type hint
    import trl
    import verl

    results = {}
    for row, (loss_type, reference, level, per_token) in ROWS.items():
        g = torch.Generator().manual_seed(a.seed)
        worst_loss = worst_grad = 0.0
        # GMPO's log-space range (the paper's 0.4) or PPO's clip-higher; a CISPO cap that binds often; SAPO's τ
        clip = (0.4, 0.4) if loss_type == "gmpo" else (0.2, 0.28)
        s = {"epsilon_low": clip[0], "epsilon_high": clip[1], "cispo_cap": 1.5, "sapo_temperature_pos": 1.0,
             "sapo_temperature_neg": 1.05}
        for _ in range(a.batches):
            batch = random_batch(g, per_token)
            theirs = (trl_loss if reference == "trl" else verl_loss)(loss_type, level, *batch, s)
            mine = ours(loss_type, level, *batch, s)
            worst_loss = max(worst_loss, (mine[0] - theirs[0]).abs().item())
            worst_grad = max(worst_grad, (mine[1] - theirs[1]).abs().max().item())
        version = trl.__version__ if reference == "trl" else verl.__version__
        results[row] = {"reference": f"{reference} {version}", "batches": a.batches, "max_abs_dloss": worst_loss,
                        "max_abs_dgrad": worst_grad, "pass": worst_loss <= a.tol and worst_grad <= a.tol}
    print(f"float64, {a.batches} random batches per row (seed {a.seed}); pass: both <= {a.tol:g}\n")
    print("| loss_type | reference | max abs Δloss | max abs Δgrad | pass |")
    print("|---|---|---|---|---|")
    for row, r in results.items():
        print(f"| {row} | {r['reference']} | {r['max_abs_dloss']:.1e} | {r['max_abs_dgrad']:.1e} | "
              f"{'yes' if r['pass'] else 'NO'} |")
    rloo = rloo_row(a)
    print(f"\n| advantage | reference | max abs ΔA | pass |\n|---|---|---|---|\n| rloo | {rloo['reference']} | "
          f"{rloo['max_abs_dadv']:.1e} | {'yes' if rloo['pass'] else 'NO'} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"losses": results, "advantages": {"rloo": rloo}}, indent=2) + "\n")
    sys.exit(0 if all(r["pass"] for r in (*results.values(), rloo)) else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=50, help="random batches per row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-6)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--trl-venv", type=Path, default=CACHE / "trlvenv")
    ap.add_argument("--model-dir", type=Path, default=CACHE / "smollm2-135m", help="setup_trl_venv.sh's model folder")
    ap.add_argument("--trl-setup", type=Path, default=REPO.parent / "shared" / "bench" / "setup_trl_venv.sh")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    inside(a) if a.inside else outside(a)


if __name__ == "__main__":
    main()
