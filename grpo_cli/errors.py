"""Errors a user can fix from the command line; the CLI prints them on one line and exits 2."""


class ConfigError(ValueError):
    """A bad setting or input. The message names the field and the fix."""


class DataError(ConfigError):
    """Bad input data. The message names the file and the line."""
