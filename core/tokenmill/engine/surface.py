"""What an engine-owning backend's engine (``Backend.owns_engine``) uses of :class:`~tokenmill.engine.Engine`:
the scheduler's runner, queue and running list, admission budgets, and starting, sampling and finishing
sequences (engine thread). :class:`~tokenmill.engine.Engine` is one; these only hand on to its scheduler
and output."""

from __future__ import annotations

from typing import Any

from tokenmill.engine.output import Output
from tokenmill.engine.runner_kv import RunnerKV
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.scheduling import Admission
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import BackendRunner, SchedulerQueue
from tokenmill.sampling import SequenceSampler


class BackendSurface:
    scheduler: Scheduler
    output: Output

    @property
    def runner(self) -> BackendRunner:
        return self.scheduler.runner

    @runner.setter
    def runner(self, runner: BackendRunner) -> None:
        self.scheduler.runner = runner  # e.g. a runner wrapped after start-up (over the same KV memory)
        if isinstance(self.scheduler.kv, RunnerKV):
            self.scheduler.kv.runner = runner

    @property
    def queue(self) -> Admission:
        """The scheduler plugin's queue as the engine admits from it: ``admit(holding, budget)``,
        ``requeue``, ``add``, ``remove``, ``pending()``, ``len()``."""
        return self.scheduler.waiting

    @queue.setter
    def queue(self, queue: SchedulerQueue | Admission) -> None:
        self.scheduler.waiting = Admission.of(queue, self.scheduler.waiting.limits)

    @property
    def running(self) -> list[Sequence]:
        """The sequences that decode (a list the engine-owning backend may append admitted ones to)."""
        return self.scheduler.running

    @property
    def prefill_budget(self) -> int:
        return self.scheduler.prefill_budget

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @preemptions.setter
    def preemptions(self, count: int) -> None:
        self.scheduler.preemptions = count  # an engine-owning backend reports its own engine's

    @property
    def suspensions(self) -> int:
        return self.scheduler.suspensions

    def step_budget(self, prefill_tokens: int | None = None) -> Any:
        """The :class:`StepBudget` the scheduler admits within (by default the whole prefill budget)."""
        return self.scheduler.step_budget(prefill_tokens)

    def start_sequence(self, seq: Sequence) -> bool:
        """Give an admitted sequence its sampler and detokenizer; False when that failed (told, released)."""
        return self.scheduler.start_sequence(seq)

    @staticmethod
    def sampler(seq: Sequence) -> SequenceSampler:  # a started sequence's: its processors, matcher, seed
        return seq.state.sampler

    def accept_token(self, seq: Sequence, token_id: int, logprob: float | None,
                     top: list[tuple[int, float]] | None = None) -> bool:
        """Append a chosen token to ``seq`` and send its event; True when it finished (release it then)."""
        finished = self.output.accept_token(seq, token_id, logprob, top)
        Scheduler.decoded([seq])
        return finished

    def prompt_token_infos(self, prompt_ids: list[int], logprobs: list[float | None]) -> list[Any]:
        return self.output.prompt_token_infos(prompt_ids, logprobs)  # as decoder_input_details reports them

