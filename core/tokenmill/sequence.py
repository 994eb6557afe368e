"""Deprecated: the hooks 1.0 path of ``tokenmill.engine.sequence``; import from there."""

import warnings

from tokenmill.engine.sequence import *  # noqa: F403

warnings.warn("tokenmill.sequence is deprecated: import tokenmill.engine.sequence", DeprecationWarning, stacklevel=2)
