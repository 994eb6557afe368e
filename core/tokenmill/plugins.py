"""Deprecated: the hooks 1.0 path of ``tokenmill.plugin_manager``; import from there."""

import warnings

from tokenmill.plugin_manager import *  # noqa: F403

warnings.warn("tokenmill.plugins is deprecated: import tokenmill.plugin_manager", DeprecationWarning, stacklevel=2)
