"""The validation workers: ``--validation-workers`` threads that do a request's slow, CPU-bound
checks off the event loop (tokenizing up to the payload limit, chat templates, compiling grammars,
loading adapters), each with a :class:`Validator` of its own.

A fast tokenizer must not be used from two threads at once, so each validator holds its own copy
of the tokenizer (and the engine thread detokenizes with the original).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenmill.http.tgi.validation import Validator

T = TypeVar("T")


class ValidationWorkers:
    def __init__(self, count: int) -> None:
        self.count = count
        self.executor = ThreadPoolExecutor(count, thread_name_prefix="tokenmill-validation")
        self._free: queue.SimpleQueue[Validator] = queue.SimpleQueue()
        self.first: Validator | None = None
        """A validator for what only reads settings, the tokenizer's too (None until the model is loaded): it
        holds the engine's own tokenizer, so it never tokenizes."""

    def start(self, make: Callable[[Any], Validator], tokenizer: Any) -> None:
        """Make the settings validator now (:attr:`first`), and the workers' in a thread of their own, each from
        a copy of ``tokenizer``: a copy takes 0.15-0.19 s, which the start need not wait for (a request
        meanwhile waits on a worker for a free validator; on the workers themselves the copies would queue
        behind it). Call last in the start: the copies hold the GIL most of the time they take."""
        self.first = make(tokenizer)

        def make_validators() -> None:
            for _ in range(self.count):
                self._free.put(make(copy.deepcopy(tokenizer)))

        threading.Thread(target=make_validators, name="tokenmill-validators", daemon=True).start()

    async def validate(self, check: Callable[[Validator], T]) -> T:
        """``check(validator)`` on a worker, with a validator no other thread uses meanwhile, in this
        request's context (its log lines carry its id)."""
        def run() -> T:
            validator = self._free.get()
            try:
                return check(validator)
            finally:
                self._free.put(validator)

        return await self.run(run)

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` on a worker (loading an adapter), in this request's context."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, contextvars.copy_context().run, call, *args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)
