"""build(): a config's `_target_` node -> the object it names (Hydra's instantiate, our errors).

The ground floor: policy, data, rewards, rm and the commands all build components from config
nodes, so this module imports nothing of grpo_cli but errors.
"""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from grpo_cli.errors import ConfigError


def build(node: Any, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate(node)` with plain containers, re-raising our ConfigError unwrapped.

    Hydra wraps anything a constructor raises in InstantiationException; a bad `data.path` must
    still reach the user as our one-line error, not a traceback.
    """
    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise

