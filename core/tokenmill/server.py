"""Deprecated: the hooks 1.0 path of ``tokenmill.http.app``; import from there."""

import warnings

from tokenmill.http.app import *  # noqa: F403
from tokenmill.http.state import *  # noqa: F403

warnings.warn("tokenmill.server is deprecated: import tokenmill.http.app", DeprecationWarning, stacklevel=2)
