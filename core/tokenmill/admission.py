"""Deprecated: the hooks 1.0 path of ``tokenmill.engine.admission``; import from there."""

import warnings

from tokenmill.engine.admission import *  # noqa: F403

warnings.warn("tokenmill.admission is deprecated: import tokenmill.engine.admission", DeprecationWarning, stacklevel=2)
