"""Data parallelism (grpo_cli.distributed) on 2 gloo ranks: N ranks take the 1-rank step on the same batch."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import credit, update
from grpo_cli.distributed import SINGLE, World
from grpo_cli.objective import GRPOLoss, LossSettings
from tests.helpers.batches import MICRO, OPTIONS, G, _batch, _local, _name, _policy, _save_step, _step
from tests.helpers.ranks import gloo_rank, two_ranks

CASES = [(loss, beta, mu, scale, "mixed")
         for loss, beta, mu, scale in itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], [0.0, 0.04], [1, 2],
                                                         ["group", "batch"])]
# rank 1's groups all have equal rewards: with β = 0 it has no active row and runs no backward at all
CASES += [(loss, 0.0, mu, scale, "dead_rank")
          for loss, mu, scale in itertools.product(["grpo", "dapo"], [1, 2], ["group", "batch"])]
CASES += [(loss, 0.04, mu, "group", option)
          for loss, mu, option in itertools.product(["grpo", "dapo"], [1, 2], list(OPTIONS))]


def _worker(rank: int, size: int, init_method: str, out: str) -> None:
    with gloo_rank(rank, size, init_method) as world:
        for case in CASES:
            _save_step(out, case, rank, *_step(case, world))
        _collectives(world, out)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """Run every case on 2 gloo ranks (fresh processes, tests.helpers.ranks.two_ranks); the folder of their results."""
    out = tmp_path_factory.mktemp("dp")
    two_ranks(_worker, out)
    return out


@pytest.mark.slow  # 2 gloo rank processes, every case: make test-ci
@pytest.mark.ci
@pytest.mark.parametrize("case", CASES, ids=_name)
def test_two_ranks_take_the_one_rank_step(steps, case):
    one, one_stats = _step(case, SINGLE)
    ranks = [load_file(str(steps / f"{_name(case)}_r{r}.safetensors")) for r in range(2)]
    for name, w in one.items():
        # the ranks agree exactly (the same summed gradient, the same step) and with the 1-rank step
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.allclose(ranks[0][name], w, atol=1e-6, rtol=0), (name, (ranks[0][name] - w).abs().max())
    # the step moved the weights (a step that changes nothing would pass the comparison above)
    policy, _ = _policy()
    start = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert any(not torch.allclose(start[n], w, atol=1e-4) for n, w in one.items())
    stats = load_file(str(steps / f"{_name(case)}_stats_r0.safetensors"))
    for key in ("loss", "kl", "ratio_mean", "entropy", "grad_norm", "counts/backward_seqs"):
        assert stats[key].item() == pytest.approx(float(one_stats[key]), rel=1e-5, abs=1e-7), key


def test_dead_rank_case_really_has_no_active_row_on_rank_1():
    rollout, result = _local(*_batch("dead_rank"), World(1, 2, 1))
    adv = credit.advantages(credit.token_rewards(result, rollout, None), G, "group", "population")
    loss = GRPOLoss(LossSettings(beta=0.0, epsilon_low=0.2, epsilon_high=None, kl_estimator="k3", loss_type="grpo"))
    policy, _ = _policy()
    assert update.prepare(policy, rollout, adv, loss, 1, MICRO, True).active == []
    rollout, result = _local(*_batch("dead_rank"), World(0, 2, 0))
    adv = credit.advantages(credit.token_rewards(result, rollout, None), G, "group", "population")
    assert update.prepare(policy, rollout, adv, loss, 1, MICRO, True).active != []


def test_world_slice_covers_the_batch_once():
    shares = [list(range(16))[World(r, 4, r).slice(16)] for r in range(4)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def _own_world(monkeypatch):
    """init_world as under torchrun, in this one process: a 1-rank gloo group over env://."""
    import socket

    import grpo_cli.distributed as distributed

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)  # as a launcher's, so init_world joins a group
    return distributed.init_world()


def test_close_world_leaves_the_group_init_world_made(monkeypatch):
    import torch.distributed as dist

    from grpo_cli.distributed import close_world

    _own_world(monkeypatch)
    assert dist.is_initialized()
    close_world()
    assert not dist.is_initialized()
    close_world()  # again: nothing to do
    assert not dist.is_initialized()


def test_close_world_leaves_a_group_it_did_not_make_alone(tmp_path):
    """An in-process vLLM engine makes its own one-process group: vLLM's shutdown at exit destroys it."""
    import torch.distributed as dist

    from grpo_cli.distributed import close_world

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        close_world()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_close_world_leaves_the_group_to_vllm_while_its_groups_live(monkeypatch):
    import sys
    import types

    import torch.distributed as dist

    from grpo_cli.distributed import close_world

    _own_world(monkeypatch)
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.model_parallel_is_initialized = lambda: True
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    try:
        close_world()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fails", [False, True])
def test_a_command_closes_the_world_when_it_ends_normally_only(fails, monkeypatch):
    """A command (app.hydra_app) leaves the process group when it returns, not when it fails: a failing rank
    must not wait for peers that may be inside a collective."""
    import hydra

    from grpo_cli import app

    closed = []

    def command(cfg):
        if fails:
            raise SystemExit(1)

    # Hydra's main stands in as a plain call; the checks before it have nothing to check here
    monkeypatch.setattr(hydra, "main", lambda **kwargs: (lambda task: (lambda: task(None))))
    for name in ("_precompose", "_check_output_dir", "_check_not_in_a_run"):
        monkeypatch.setattr(app, name, lambda *args: None)
    monkeypatch.setattr(app, "rank_overrides", lambda *args: [])
    monkeypatch.setattr(app, "close_world", lambda: closed.append(True))
    entry = app.hydra_app("eval")(command)
    if fails:
        with pytest.raises(SystemExit):
            entry()
    else:
        entry()
    assert closed == ([] if fails else [True])


# ---- end to end: torchrun, 2 ranks, the tiny model -------------------------------------------


def _collectives(world: World, out: str) -> None:
    """Each collective of World and agreed_stop on this rank (the ranks of `steps`, so no 2 more processes)."""
    import json

    from grpo_cli.commands.train import agreed_stop

    rank = world.rank
    got = {
        # SIGTERM reached rank 1 only: both ranks stop after this step
        "stop": agreed_stop(world, "SIGTERM" if rank == 1 else None),
        "no_stop": agreed_stop(world, None),
        "cat": world.cat(torch.tensor([rank, 10 + rank])).tolist(),
        "gather": world.gather({"rank": rank}),
        "broadcast": world.broadcast(f"from {rank}"),
        "sum": world.sum(torch.tensor([1.0, rank])).tolist(),
        "max": world.max(torch.tensor([rank])).tolist(),
    }
    Path(out, f"collectives_r{rank}.json").write_text(json.dumps(got))


@pytest.mark.slow  # 2 gloo rank processes: make test-ci
@pytest.mark.ci
def test_collectives_and_agreed_stop_on_two_ranks(steps):
    import json

    got = [json.loads((steps / f"collectives_r{r}.json").read_text()) for r in range(2)]
    assert got[0]["stop"] == "a stop request on another rank" and got[1]["stop"] == "SIGTERM"
    assert got[0]["no_stop"] is None and got[1]["no_stop"] is None
    for g in got:
        assert g["cat"] == [0, 10, 1, 11]
        assert g["gather"] == [{"rank": 0}, {"rank": 1}]
        assert g["broadcast"] == "from 0"
        assert g["sum"] == [2.0, 1.0] and g["max"] == [1]


def test_config_errors_name_the_fix_before_the_model_loads(monkeypatch):
    from grpo_cli.commands import train
    from grpo_cli.config import compose, validate
    from grpo_cli.errors import ConfigError

    cfg = compose("train", ["model=tiny", "trainer.prompts_per_step=4"])
    assert train.check_world(cfg, 2) == []  # 4 prompts on 2 ranks: 2 each
    monkeypatch.setenv("WORLD_SIZE", "3")  # what torchrun sets: validate reads it with the trainer's checks
    with pytest.raises(ConfigError, match=r"prompts_per_step \(4\) must divide by the number of ranks \(3\).*"
                                          r"set trainer.prompts_per_step=6"):
        validate(cfg, *train.CHECKS)
    iterative = train.check_world(compose("train", ["+recipe=iterative"]), 2)
    assert any("iterative.iterations=0" in line for line in iterative)


# ---- a rank that dies: the others end with one line naming it --------------------------------------------------


def _join_as_torchrun(rank: int, size: int, init_method: str) -> None:
    """The environment torchrun gives a rank, so init_world (and a command) joins the group as under torchrun."""
    import os

    host, port = init_method.removeprefix("tcp://").split(":")
    os.environ.update(WORLD_SIZE=str(size), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR=host, MASTER_PORT=port)
    torch.set_num_threads(1)


def _die_slowly() -> None:
    """Stop as a crashing rank does: its connections close first, the process ends a moment later."""
    import os
    import time

    torch.distributed.destroy_process_group()
    time.sleep(1.0)
    os._exit(0)


def _slow_death_worker(rank: int, size: int, init_method: str, out: str) -> None:
    import time

    from grpo_cli.distributed import init_world
    from grpo_cli.errors import RunError

    _join_as_torchrun(rank, size, init_method)
    world = init_world()
    if rank == 1:
        time.sleep(0.5)
        _die_slowly()
    try:
        world.sum(torch.tensor([1.0]))
    except RunError as err:
        Path(out, "rank0.txt").write_text(str(err))


@pytest.mark.slow  # 2 gloo rank processes: make test-ci
@pytest.mark.ci
def test_a_rank_that_dies_slowly_is_named_not_another_rank(tmp_path):
    two_ranks(_slow_death_worker, tmp_path)
    line = (tmp_path / "rank0.txt").read_text()
    # the collective breaks while rank 1's process still exists: it is named once it is gone
    assert re.match(r"rank 1 \(pid \d+\) stopped \(killed or crashed\), so rank 0 cannot go on \(", line), line


def _fsdp_death_worker(rank: int, size: int, init_method: str, out: str) -> None:
    from grpo_cli import fsdp
    from grpo_cli.commands import train
    from grpo_cli.errors import RunError
    from tests.helpers.runs import tiny_cfg

    _join_as_torchrun(rank, size, init_method)
    if rank == 1:
        # rank 1 dies as step 1 starts; rank 0 goes on into FSDP's all-gather of the base for sampling
        fsdp.whole = lambda policy: _die_slowly()
    try:
        train.run(tiny_cfg("trainer.fsdp=true", "trainer.max_steps=1"), Path(out, "run"))
    except RunError as err:
        Path(out, "rank0.txt").write_text(str(err))


@pytest.mark.slow  # 2 gloo rank processes: make test-ci
@pytest.mark.ci
def test_fsdp_a_dead_rank_is_one_line_naming_it(tmp_path):
    two_ranks(_fsdp_death_worker, tmp_path)
    line = (tmp_path / "rank0.txt").read_text()
    assert "\n" not in line and re.match(r"rank 1 \(pid \d+\) stopped \(killed or crashed\), so rank 0 cannot go on "
                                         r"\(.*\); every rank stops", line), line


def _environment_worker(rank: int, size: int, init_method: str, out: str) -> None:
    import os

    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    Path(out, f"rank{rank}.txt").write_text(f"{os.environ.get('GRPO_TWO_RANKS_MARK')} {threads}")


@pytest.mark.slow  # 2 rank processes: make test-ci
@pytest.mark.ci
def test_two_ranks_run_fresh_under_the_callers_environment_of_the_call(tmp_path, monkeypatch):
    # a variable set after the fork server may have started (an earlier two_ranks call) still reaches the ranks
    monkeypatch.setenv("GRPO_TWO_RANKS_MARK", f"set-{tmp_path.name}")
    two_ranks(_environment_worker, tmp_path)
    # and each rank holds one thread: nothing of the test process's thread pools was forked into it
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == [f"set-{tmp_path.name} 1"] * 2
