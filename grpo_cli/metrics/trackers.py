"""The experiment trackers of `trainer.report_to` (TensorBoard, W&B, trackio, MLflow): each one
takes the run's config once as hyper-parameters and every step's numbers as scalars. Each tracker's
package is imported only when that tracker is opened.

Each one runs offline / on local files unless the tracker's own environment variable says otherwise
(WANDB_MODE=online, TRACKIO_SPACE_ID, MLFLOW_TRACKING_URI), so a run never needs the network and never
waits on it. A resumed run starts a new tracker run of the same name.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from grpo_cli.errors import ConfigError


def run_name(run_dir: Path) -> str:
    """The tracker run name: the last two parts of the run folder (`DATE/TIME`, or `TIME/N` in a sweep)."""
    return "/".join(Path(run_dir).parts[-2:])


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """{"algo": {"beta": 0.04}} -> {"algo.beta": 0.04}; lists and None become strings (hparams take scalars)."""
    out: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


class _TensorBoard:
    """Event files in RUN/tensorboard: scalars per step, the config in the HPARAMS tab."""

    def __init__(self, run_dir: Path, project: str, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        for summary in hparams(flatten(config), {}):  # the experiment, session-start and -end summaries
            self.writer.file_writer.add_summary(summary)

    def log(self, scalars: dict, step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """An offline W&B run in RUN/wandb (`wandb sync RUN/wandb/offline-run-*` uploads it later)."""

    def __init__(self, run_dir: Path, project: str, name: str, config: dict):
        import wandb

        # console="off": wandb would otherwise wrap stdout/stderr, under the rich progress bar
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"),
                              settings=wandb.Settings(console="off", quiet=True))

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    """A run in trackio's local store ($TRACKIO_DIR, default ~/.cache/huggingface/trackio): `trackio show`."""

    def __init__(self, run_dir: Path, project: str, name: str, config: dict):
        import trackio

        self.run = trackio.init(project=project, name=name, config=config)

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    """An MLflow run in RUN/mlflow.db (SQLite; artifacts in RUN/mlflow-artifacts), unless
    $MLFLOW_TRACKING_URI names another store. `mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db`.

    Not MLflow's file store: MLflow >= 3.13 refuses it unless MLFLOW_ALLOW_FILE_STORE=true.
    """

    def __init__(self, run_dir: Path, project: str, name: str, config: dict):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            project, artifact_location=(run_dir / "mlflow-artifacts").as_uri())
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]  # 6000: MLflow's value limit
        for start in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, scalars: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# `trainer.report_to` name -> tracker, and the package it needs (the pip extra has the tracker's name)
TRACKERS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio, "mlflow": _MLflow}
PACKAGES = {"tensorboard": ["tensorboard"], "wandb": ["wandb"], "trackio": ["trackio"],
            "mlflow": ["mlflow", "sqlalchemy", "alembic"]}  # mlflow's SQLite store needs SQLAlchemy + alembic


def resolve_report_to(report_to) -> list[str]:
    """`trainer.report_to` as a list of tracker names: `auto` (tensorboard when installed, else none),
    one name, or a list. An unknown name or a tracker whose package is missing is a ConfigError
    naming the fix; call it before the model loads."""
    if report_to == "auto":
        return ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"trainer.report_to: {name!r} is not a tracker; use any of "
                              f"{', '.join(TRACKERS)} (or auto, or [] for none)")
        missing = [package for package in PACKAGES[name] if importlib.util.find_spec(package) is None]
        if missing:
            raise ConfigError(f"trainer.report_to includes {name} but the {missing[0]} package is not installed: "
                              f"pip install 'grpo-cli[{name}]', or leave {name} out of trainer.report_to")
    return list(dict.fromkeys(names))
