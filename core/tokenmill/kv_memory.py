"""Deprecated: the hooks 1.0 path of ``tokenmill.model.kv_memory``; import from there."""

import warnings

from tokenmill.model.kv_memory import *  # noqa: F403

warnings.warn("tokenmill.kv_memory is deprecated: import tokenmill.model.kv_memory", DeprecationWarning, stacklevel=2)
