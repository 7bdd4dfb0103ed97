"""build(): a config's `_target_` node -> the object it names (Hydra's instantiate, our errors).

The ground floor: policy, data, rewards, rm and the commands all build components from config
nodes, so this module imports nothing of grpo_cli but errors and user_code (a leaf too).
"""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from grpo_cli.errors import ConfigError
from grpo_cli.user_code import import_targets


def build(node: Any, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate(node)` with plain containers, re-raising our ConfigError unwrapped.

    Hydra wraps anything a constructor raises in InstantiationException; a bad `data.path` must
    still reach the user as our one-line error, not a traceback.
    """
    # a `_target_` of the user's own module (model.loader._target_=my_loader.load) from the working folder
    import_targets(OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node)
    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise

