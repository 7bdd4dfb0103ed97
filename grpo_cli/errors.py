"""Errors a user can fix from the command line; the CLI prints them on one line and exits 2."""


class ConfigError(ValueError):
    """A bad setting or input. The message names the field and the fix."""


class DataError(ConfigError):
    """Bad input data. The message names the file and the line."""


class CheckpointError(ConfigError):
    """A checkpoint or run folder that cannot be used. The message names the file and what to do."""


class RunError(RuntimeError):
    """The run cannot go on (for example: too many non-finite steps in a row). The CLI prints one line, exit 1."""
