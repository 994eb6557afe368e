"""Deprecated: the hooks 1.0 path of ``tokenmill.model.quant_linears``; import from there."""

import warnings

from tokenmill.model.quant_linears import *  # noqa: F403

warnings.warn("tokenmill.quant_linears is deprecated: import tokenmill.model.quant_linears", DeprecationWarning,
              stacklevel=2)
