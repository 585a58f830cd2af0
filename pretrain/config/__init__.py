"""Typed experiment configuration: YAML files with ``base:`` inheritance and ``a.b=c`` overrides.

Every key is checked against the dataclass schema (``schema.py``). An unknown key, a value of the
wrong type or an impossible combination raises :class:`ConfigError` whose message names the key,
the file it came from and, for unknown keys, the closest valid key (``load.py``, ``checks.py``).
CLIs turn that into one line on stderr and exit code 2 (:func:`cli_errors`). This package's
public API is the names below; ``vit-config`` is ``cli.py``.
"""
from data_pipeline.config import AugmentConfig, DataConfig
from data_pipeline.errors import ConfigError, cli_errors
from pretrain.config.checks import (
    check_world_size,
    checkpoint_count,
    compile_mode,
    image_size,
    selective_checkpointing,
    target_check,
)
from pretrain.config.load import from_dict, load_config, raw_tree, save_config, to_dict
from pretrain.config.schema import Config

__all__ = ["Config", "ConfigError", "cli_errors", "load_config", "raw_tree", "to_dict", "from_dict",
           "save_config", "image_size", "check_world_size", "checkpoint_count", "selective_checkpointing",
           "compile_mode", "target_check", "DataConfig", "AugmentConfig"]
