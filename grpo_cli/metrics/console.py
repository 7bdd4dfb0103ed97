"""The console the user reads (stderr, so stdout stays the command's own output): rich output, a
progress bar with ETA and the step's key numbers, and `quiet()` for the ranks other than 0 under torchrun."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)
if not console.is_terminal and "COLUMNS" not in os.environ:
    # piped to a file, rich would assume 80 columns and cut the progress bar's last columns ("eta 0:00:…");
    # lines are as long as their text instead (up to this width), as a log file wants them
    console.width = 200


@contextlib.contextmanager
def quiet(silent: bool = True) -> Iterator[None]:
    """Console output off (a rank other than 0 under torchrun) for the block, then as it was."""
    before = console.quiet
    console.quiet = silent or before
    try:
        yield
    finally:
        console.quiet = before


def progress(description: str) -> Progress:
    """A progress bar with ETA and a free-text field for the key numbers (`info`)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    console=console, transient=False)
