"""Configuration: :class:`Config` (the settings, frozen) and :func:`parse_config` (flags and
environment variables into one), with TGI's launcher flags accepted (:mod:`.launcher`)."""

from tokenmill.config.flags import build_parser, env_name, parse_config
from tokenmill.config.settings import CPU_MIXED_PREFILL_TOKENS, Config, ConfigError

__all__ = ["CPU_MIXED_PREFILL_TOKENS", "Config", "ConfigError", "build_parser", "env_name", "parse_config"]
