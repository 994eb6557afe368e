"""The engine thread: continuous batching over a backend's runner.

``tokenmill.engine.Engine`` is the loop; see :mod:`tokenmill.engine.engine`.
"""

from tokenmill.engine.engine import Engine, eos_ids_of, eos_token_ids

__all__ = ["Engine", "eos_ids_of", "eos_token_ids"]
