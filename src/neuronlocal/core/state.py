"""This process's configuration, instance profile and configuration error.

Read from the environment once, when this module is first imported (by
`neuronlocal/__init__.py`), never raising: a bad variable is kept in `config_error`.
Changed only by `set_config()` (`eager.set_policy`). Every layer reads them here, so none
has to import the top-level package; `neuronlocal.config`, `.profile` and `.config_error`
read the same values.
"""

from __future__ import annotations

from neuronlocal.core import hardware
from neuronlocal.core.config import Config, ConfigError

config: Config
profile: hardware.Profile
config_error: ConfigError | None
config, profile, config_error = hardware.load()


def set_config(new: Config) -> None:
    """Replaces the process's config (run-time policy changes)."""
    global config
    config = new
