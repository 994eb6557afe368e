"""The engine of a pooling server (``--task embed`` or ``score``): one thread that owns the model, takes
the oldest input waiting and, beside it, those of the nearest lengths, as many per step as
``--max-batch-size`` and ``--max-batch-prefill-tokens`` allow (a step's padded batch counts as rows × its
longest input), runs one forward over them, and answers each input's future with its row.

Each step is a prefill with nothing kept: no KV cache, no decoding. An input whose caller left
(its future cancelled) is skipped. A step that fails is retried one input at a time, so only the
inputs that fail themselves get the error; ``--max-failed-steps`` failing in a row break the engine
(/health 503), as for generation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from tokenmill.config import Config
from tokenmill.engine.timing import StepTiming
from tokenmill.kernels import native as native_kernels
from tokenmill.model.cpu_linears import pack_linears, packed_layout, packing_unavailable_reason
from tokenmill.model.loading import Stages
from tokenmill.model.pooling import PoolingModel, load_pooling_model

log = logging.getLogger(__name__)


MAX_PADDING = 0.2
"""The most of a step's positions that may be padding: inputs of other lengths wait for a step of their own
(a forward over rows padded to the longest costs as much as if every row were that long)."""


@dataclass
class Pooled:
    """One input waiting for its row: token ids (and a pair's token types) and the future it is answered by."""

    token_ids: list[int]
    token_types: list[int] | None = None
    answer: Future[torch.Tensor] = field(default_factory=Future)


class PoolingEngine:
    def __init__(self, model: PoolingModel, max_batch_tokens: int, max_batch_size: int | None,
                 max_failed_steps: int) -> None:
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.max_failed_steps = max_failed_steps
        self.step_observer: Callable[[StepTiming], None] | None = None
        self.broken_observer: Callable[[str], None] | None = None
        self.broken: str | None = None
        self.batch_size = 0
        self._waiting: deque[Pooled] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._failed_in_a_row = 0
        self._thread = threading.Thread(target=self._run, name="tokenmill-pooling", daemon=True)

    @property
    def healthy(self) -> bool:
        return self.broken is None and not self._stopping

    @property
    def queue_size(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        while self._waiting:
            self._waiting.popleft().answer.cancel()

    def submit(self, inputs: list[Pooled]) -> None:
        """Queue ``inputs``; each one's ``answer`` gets its row (or the error of its forward)."""
        with self._wake:
            if not self.healthy:
                raise RuntimeError(self.broken or "the engine has stopped")
            self._waiting.extend(inputs)
            self._wake.notify()

    def run_now(self, inputs: list[Pooled]) -> None:
        """Answer ``inputs`` on the calling thread (the warm-up, before the engine starts)."""
        self._step(inputs)

    def _next_batch(self) -> list[Pooled]:
        """The oldest input waiting, and beside it those of the nearest lengths that fit the step and keep its
        padding under :data:`MAX_PADDING` (the oldest always goes, so no input waits forever)."""
        waiting = [item for item in self._waiting if not item.answer.cancelled()]  # callers that left drop out
        if not waiting:
            self._waiting.clear()
            return []
        anchor = len(waiting[0].token_ids)
        batch: list[Pooled] = []
        longest = real = 0
        for item in sorted(waiting, key=lambda item: abs(len(item.token_ids) - anchor)):  # stable: oldest first
            if self.max_batch_size is not None and len(batch) >= self.max_batch_size:
                break
            length = len(item.token_ids)
            padded = max(longest, length) * (len(batch) + 1)
            if batch and (padded > self.max_batch_tokens or padded > (real + length) / (1 - MAX_PADDING)):
                continue
            if item.answer.set_running_or_notify_cancel():  # False: its caller left just now
                batch.append(item)
                longest, real = max(longest, length), real + length
        taken = {id(item) for item in batch}
        self._waiting = deque(item for item in waiting if id(item) not in taken and not item.answer.cancelled())
        return batch

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                batch = self._next_batch()
            if batch:
                self._step(batch)

    def _step(self, batch: list[Pooled]) -> None:
        self.batch_size = len(batch)
        started = time.perf_counter()
        try:
            rows = self.model.forward(self.model.batch([(item.token_ids, item.token_types) for item in batch]))
            ok = True
        except Exception:  # noqa: BLE001 - one input's failure must not fail the others: retry them one by one
            log.exception("a pooling step of %d inputs failed%s", len(batch), "; retrying one by one" if
                          len(batch) > 1 else "")
            rows, ok = None, False
        elapsed = time.perf_counter() - started
        if self.step_observer is not None:
            self.step_observer(StepTiming(self.model.task, len(batch), elapsed, elapsed, ok))
        if rows is not None:
            self._failed_in_a_row = 0
            for item, row in zip(batch, rows):
                item.answer.set_result(row)
        elif len(batch) > 1:
            for item in batch:
                self._step([item])
        else:
            self._failed(batch[0])
        self.batch_size = 0

    def _failed(self, item: Pooled) -> None:
        item.answer.set_exception(RuntimeError("the model failed on this input (the server's log has the cause)"))
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= self.max_failed_steps and self.broken is None:
            self.broken = f"{self._failed_in_a_row} pooling steps failed in a row"
            log.error("the pooling engine is broken: %s", self.broken)
            if self.broken_observer is not None:
                self.broken_observer(self.broken)



POOLING_BATCH_TOKENS = 16_384
"""A step's padded tokens unless ``--max-batch-prefill-tokens`` says (TEI's default ``--max-batch-tokens``)."""


def start_pooling_engine(config: Config, stages: Stages, hub_cache: str | None) -> tuple[PoolingEngine, Config]:
    """Load the embedding or score model, settle the limits for it (the task too, for ``--runner pooling``)
    and warm it up; the engine is returned ready but not started."""
    model = load_pooling_model(config.model_id, config.revision, config.dtype, config.task,
                               config.trust_remote_code, stages, hub_cache)
    if config.disable_custom_kernels:
        native_kernels.turn_off("--disable-custom-kernels")
    if config.prepack_weights and packing_unavailable_reason(model.loaded.model) is None:
        packed = stages.run("packing weights", lambda: pack_linears(model.loaded.model),
                            detail=packed_layout(model.loaded.model))
        log.info("packed %d linear layers", packed)
    context = getattr(model.loaded.model.config, "max_position_embeddings", None)
    settled = replace(config, task=model.task).with_limits(context, on_cpu=model.loaded.device.type == "cpu")
    settled = replace(settled, max_batch_prefill_tokens=config.max_batch_prefill_tokens or POOLING_BATCH_TOKENS)
    engine = PoolingEngine(model, settled.max_batch_prefill_tokens, config.max_batch_size, config.max_failed_steps)
    stages.run("warming up", lambda: engine.run_now([Pooled([model.pad_id] * 8)]), detail="one forward")
    log.info("ready: %s on %s (%s, %d dimensions)", model.loaded.model_id, model.loaded.device, model.task, model.width)
    return engine, settled
