"""Deprecated: the hooks 1.0 path of ``tokenmill.engine.prefix``; import from there."""

import warnings

from tokenmill.engine.prefix import *  # noqa: F403

warnings.warn("tokenmill.prefix is deprecated: import tokenmill.engine.prefix", DeprecationWarning, stacklevel=2)
