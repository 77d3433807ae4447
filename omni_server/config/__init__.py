"""Pipeline configuration: the YAML schema and its loader."""

from .loader import ConfigError, apply_overrides, load_config, load_config_text, parse_override
from .schema import PipelineConfig, SamplingDefaults, ServerConfig, StageConfig

__all__ = [
    "ConfigError",
    "PipelineConfig",
    "SamplingDefaults",
    "ServerConfig",
    "StageConfig",
    "apply_overrides",
    "load_config",
    "load_config_text",
    "parse_override",
]
