"""Deprecated: the hooks 1.0 path of ``tokenmill.model.adapters`` (which re-exports the layers of
``tokenmill.model.lora``); import from there."""

import warnings

from tokenmill.model.adapters import *  # noqa: F403

warnings.warn("tokenmill.lora is deprecated: import tokenmill.model.adapters", DeprecationWarning, stacklevel=2)
