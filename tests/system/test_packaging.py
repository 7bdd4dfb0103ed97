"""The built wheel carries conf/ and recipes/: `grpo train --cfg job +recipe=gsm8k` works from /tmp."""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO


@pytest.mark.slow
@pytest.mark.ci
def test_wheel_in_a_fresh_venv_composes_a_recipe(tmp_path):
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(dist.glob("grpo_cli-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # the new venv borrows this venv's dependencies (torch & co.) through a .pth line, appended after
    # its own site-packages; .pth files inside that folder (our editable install) are not processed
    own = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       text=True).strip())
    (own / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    out = subprocess.run([str(venv / "bin" / "grpo"), "train", "--cfg", "job", "+recipe=gsm8k"], cwd="/tmp",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GSM8KTask" in out.stdout and "algo:" in out.stdout
    where = subprocess.check_output([str(py), "-c", "import grpo_cli; print(grpo_cli.__file__)"], cwd="/tmp",
                                    text=True)
    assert str(own) in where  # the wheel's copy, not the source tree
