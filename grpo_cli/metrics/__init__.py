"""What the user sees and what a run leaves behind, one module per job:

    console.py    the console (stderr), quiet() for ranks other than 0, the progress bar
    run_files.py  RUN/metrics.jsonl (MetricsLog), RUN/completions.jsonl (CompletionsLog), truncation on
                  resume, and the check of the `trainer` logging settings
    trackers.py   the experiment trackers of `trainer.report_to` (TensorBoard, W&B, trackio, MLflow), each
                  offline or on local files by default
    stats.py      a step's reward and completion statistics, named as TRL names them
    memory.py     peak memory of a step, and waiting for the device before a timer or a memory probe is read
    plots.py      RUN/training.png from metrics.jsonl

Callers import each name from the module that holds it; this file is the map only.
"""
