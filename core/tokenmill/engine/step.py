"""Running one planned step: its forward pass in one backend call, then each sequence's token sampled
and handed on. After a step that failed, where the backend can run any part of a step alone, each
prefill chunk runs alone and the decoding sequences together, so that a failure pinned to one request
(its prompt, its prompt logits) fails only that request; a step that fails as a whole fails its
sequences."""

from __future__ import annotations

import logging

import torch

from tokenmill.engine.batching import Batch, Fail, Release, StepPlan
from tokenmill.engine.output import Output
from tokenmill.engine.sequence import GenerationRequest, Sequence
from tokenmill.engine.speculation import Speculator
from tokenmill.engine.timing import Speculated, StepClock, StepTiming
from tokenmill.interfaces import StepOutput
from tokenmill.sampling import SamplingParams

log = logging.getLogger(__name__)


class StepExecution:
    def __init__(self, batch: Batch, output: Output, release: Release, fail: Fail) -> None:
        self.batch = batch
        self.output = output
        self.release = release
        self.fail = fail
        """The engine's own ``release`` and ``fail``, as the batch has them."""

    def run(self, plan: StepPlan) -> StepTiming:
        """Run ``plan`` (not empty) to its sampled tokens; its timing says whether it failed."""
        clock = StepClock(plan.method, len(plan.prefill))
        try:
            out = self.forward(plan)
        except Exception as error:  # noqa: BLE001 - the step's sequences fail, the engine goes on
            log.exception("engine step failed")
            isolated = self.isolate(plan)
            if isolated is None:
                self.fail(list(plan.prefill + plan.decode), f"generation failed: {type(error).__name__}: {error}")
            return clock.timing(ok=bool(isolated) or self.probe())
        clock.forwarded()
        try:
            speculated = self.sample(plan, out)
        except Exception as error:  # noqa: BLE001 - the forward ran: only this step's sequences fail
            log.exception("handing on the step's tokens failed")
            self.fail(list(plan.prefill + plan.decode), f"generation failed: {type(error).__name__}: {error}")
            return clock.timing(ok=True)
        # A prefill the backend failed alone (the transformers runner's own isolation) is the engine's
        # failure only if the device fails a probe too; decoding rows that ran in the same step show it works.
        ok = out.prefill_error is None or bool(plan.decode) or self.probe()
        return clock.timing(ok=ok, speculated=speculated)

    def forward(self, plan: StepPlan) -> StepOutput:
        runner = self.batch.runner
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
        if not self.batch.runner.pausable or (len(parts) < 2 and not plan.drafts):
            return None
        ran = failed = False
        for part, hit in parts:  # in the plan's order: a prompt may share blocks only those before it computed
            if hit and failed:
                self.batch.restart(part.prefill[0])  # its cached blocks may be ones a failed part was to fill
            elif self._run_part(part):
                ran = True
            else:
                failed = True
        return ran

    def _run_part(self, part: StepPlan) -> bool:
        """Run one part of a failed step to its sampled tokens; False when it failed (its sequences were told)."""
        try:
            self.sample(part, self.forward(part))
        except Exception as error:  # noqa: BLE001 - this part's sequences fail
            log.error("step part of sequences %s failed: %s: %s",
                      [s.id for s in part.prefill + part.decode], type(error).__name__, error)
            self.fail(list(part.prefill + part.decode), f"generation failed: {type(error).__name__}: {error}")
            return False
        return True

    def probe(self) -> bool:
        """After a step whose every part failed: whether a made-up one-token prefill runs, that is,
        whether the failure was its requests' own and the engine can still serve."""
        runner = self.batch.runner
        probe = Sequence(GenerationRequest("", [0], 1, SamplingParams()), lambda event: None, None)
        try:
            return runner.step([probe], [1], [False], []).prefill_error is None
        except Exception:  # noqa: BLE001 - the engine's failure: counted towards --max-failed-steps
            log.exception("a probe step failed too")
            return False
        finally:
            runner.release([probe])

    def sample(self, plan: StepPlan, out: StepOutput) -> Speculated | None:
        """Sample the step's tokens from its logits and hand them to their sequences; with drafts, what
        speculation gave."""
        speculated = None
        if plan.decode:
            assert out.decode_logits is not None
            if plan.drafts and out.draft_logits is not None:
                speculated = self.verify(plan, out.decode_logits, out.draft_logits)
            else:
                self.release(self.output.sample(list(plan.decode), out.decode_logits))
        if out.prefill_error is not None:
            error = out.prefill_error
            log.error("prefill failed: %s: %s", type(error).__name__, error)
            self.fail(list(plan.prefill), f"prefill failed: {type(error).__name__}: {error}")
        elif plan.prefill:
            assert out.prefill is not None
            done, rows = self.batch.prefilled(plan, out.prefill)
            if done:
                self.release(self.output.sample(done, out.prefill.last_logits[rows]))
        return speculated

    def verify(self, plan: StepPlan, logits: torch.Tensor, draft_logits: list[torch.Tensor]) -> Speculated:
        """Choose the decoding sequences' tokens through their drafts, then drop the KV of rejected drafts."""
        decode = list(plan.decode)
        fed = [plan.drafts[row][: len(rows)] for row, rows in enumerate(draft_logits)]
        before = [len(seq.generated_ids) for seq in decode]
        finished = self.output.sample(decode, logits, fed, draft_logits)
        produced = [len(seq.generated_ids) - n for seq, n in zip(decode, before)]
        for seq, draft, count in zip(decode, fed, produced):
            if draft:
                Speculator.observe(seq, count)
        self._rollback([seq for seq, draft in zip(decode, fed) if draft])  # before those that ended go
        self.release(finished)
        skipped = tuple(max(0, count - 1) for draft, count in zip(fed, produced) if draft)
        return Speculated(sum(len(d) for d in fed), sum(skipped), skipped)

    def _rollback(self, seqs: list[Sequence]) -> None:
        """Drop the KV of the drafts ``seqs`` rejected, one sequence at a time, so that a failure fails
        its own sequence (and a rollback half done is never done twice)."""
        for seq in seqs:
            try:
                self.batch.runner.rollback([seq])
            except Exception as error:  # noqa: BLE001 - one request's failure stays its own
                log.exception("rolling back the draft of sequence %d failed", seq.id)
                self.fail([seq], f"generation failed: {type(error).__name__}: {error}")
