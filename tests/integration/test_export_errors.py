"""`grpo export` of a damaged run names the checkpoint it skips; a full disk is one line and leaves no temporary
folder."""

from __future__ import annotations

import json

from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import copy_run, digests


def test_export_names_the_damaged_checkpoint_it_skips(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    adapter = run / "checkpoints" / "step_000002" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])  # cut short, as by a kill mid-write
    before = digests(run)
    out = run_cli(["export", f"checkpoint={run}", f"output={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'h'}"])
    assert out.returncode == 0, out.stderr[-2000:]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "skipping step_000002" in warnings[0] and str(adapter) in warnings[0]
    assert json.loads((tmp_path / "out" / "export.json").read_text())["step"] == 1
    assert digests(run) == before


def test_export_to_a_full_disk_is_one_line_and_leaves_no_temporary_folder(trained_run, tmp_path, tmpfs):
    disk = tmpfs("small", "size=64k")
    out = run_cli(["export", f"checkpoint={trained_run}", f"output={disk / 'out'}", f"hydra.run.dir={tmp_path / 'h'}"])
    line = one_line_error(out, code=1)
    assert "No space left on device" in line and f"export to {disk / 'out'} " in line
    assert list(disk.iterdir()) == []  # neither out/ nor out.tmpNNN/
