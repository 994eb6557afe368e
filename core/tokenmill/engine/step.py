"""Running one planned step: its forward pass in one backend call, then each sequence's token sampled
and handed on. After a step that failed, where the backend can run any part of a step alone, each
prefill chunk runs alone and the decoding sequences together, so that a failure pinned to one request
(its prompt, its prompt logits) fails only that request; a step that fails as a whole fails its
sequences."""

from __future__ import annotations

import logging

from tokenmill.engine.health import probe
from tokenmill.engine.plan import StepPlan
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.timing import StepClock, StepTiming
from tokenmill.interfaces import StepOutput

log = logging.getLogger(__name__)


class StepExecution:
    """Runs the forward of a planned step and hands its output to the scheduler's update."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def run(self, plan: StepPlan) -> StepTiming:
        """Run ``plan`` (not empty) to its sampled tokens; its timing says whether it failed."""
        clock = StepClock(plan.method, len(plan.prefill))
        try:
            out = self.forward(plan)
        except Exception as error:  # noqa: BLE001 - the step's sequences fail, the engine goes on
            log.exception("engine step failed")
            self.scheduler.kv.drop_drafts(plan.decode)
            isolated = self.isolate(plan)
            if isolated is None:
                message = f"generation failed: {type(error).__name__}: {error}"
                self.scheduler.fail(list(plan.prefill + plan.decode), message)
            return clock.timing(ok=bool(isolated) or probe(self.scheduler.runner, self.scheduler.kv))
        clock.forwarded()
        try:
            speculated = self.scheduler.update_from_output(plan, out)
        except Exception as error:  # noqa: BLE001 - the forward ran: only this step's sequences fail
            log.exception("handing on the step's tokens failed")
            self.scheduler.fail(list(plan.prefill + plan.decode), f"generation failed: {type(error).__name__}: {error}")
            return clock.timing(ok=True)
        # A prefill the backend failed alone (the transformers runner's own isolation) is the engine's
        # failure only if the device fails a probe too; decoding rows that ran in the same step show it works.
        ok = out.prefill_error is None or bool(plan.decode) or probe(self.scheduler.runner, self.scheduler.kv)
        return clock.timing(ok=ok, speculated=speculated)

    def forward(self, plan: StepPlan) -> StepOutput:
        runner = self.scheduler.runner
        args = (list(plan.prefill), list(plan.chunks), [s.wants_prompt_logits for s in plan.prefill], list(plan.decode))
        return runner.step(*args, drafts=list(plan.drafts)) if plan.drafts else runner.step(*args)

    def isolate(self, plan: StepPlan) -> bool | None:
        """After a failed step, where the backend can run any subset of it: run each prefill chunk
        alone and the decoding sequences together, without drafts, so that a failure pinned to one
        request (its prompt, its prompt logits) fails only that request, and one in verifying drafts
        none. True when some part ran (the step did not fail as a whole), False when none did (each
        part failed its sequences); None when the step cannot be split (nothing was done)."""
        cached = plan.cached or (0,) * len(plan.prefill)
        parts = [(StepPlan((seq,), (chunk,), ()), hit) for seq, chunk, hit in zip(plan.prefill, plan.chunks, cached)]
        if plan.decode:
            parts.append((StepPlan((), (), plan.decode), 0))  # without drafts: they may be what failed
        if not self.scheduler.runner.pausable or (len(parts) < 2 and not plan.drafts):
            return None
        ran = failed = False
        for part, hit in parts:  # in the plan's order: a prompt may share blocks only those before it computed
            if hit and failed:
                self.scheduler.restart(part.prefill[0])  # its cached blocks may be ones a failed part was to fill
            elif self._run_part(part):
                ran = True
            else:
                failed = True
        return ran

    def _run_part(self, part: StepPlan) -> bool:
        """Run one part of a failed step to its sampled tokens; False when it failed (its sequences were told)."""
        try:
            self.scheduler.update_from_output(part, self.forward(part))
        except Exception as error:  # noqa: BLE001 - this part's sequences fail
            log.error("step part of sequences %s failed: %s: %s",
                      [s.id for s in part.prefill + part.decode], type(error).__name__, error)
            self.scheduler.fail(list(part.prefill + part.decode), f"generation failed: {type(error).__name__}: {error}")
            return False
        return True
