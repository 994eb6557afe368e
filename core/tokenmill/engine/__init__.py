"""The engine thread: continuous batching over a backend's runner.

``tokenmill.engine.Engine`` is the loop (:mod:`tokenmill.engine.engine`); an engine-owning
backend subclasses it and uses the public surface its docstring lists, with
:class:`StepClock` / :class:`StepTiming` to report its steps.
"""

from tokenmill.engine.engine import Engine
from tokenmill.engine.output import SequenceState, eos_ids_of, eos_token_ids
from tokenmill.engine.timing import StepClock, StepTiming

__all__ = ["Engine", "SequenceState", "StepClock", "StepTiming", "eos_ids_of", "eos_token_ids"]
