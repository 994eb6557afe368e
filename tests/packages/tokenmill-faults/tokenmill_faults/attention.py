"""``--attention faulty``: the normal torch attention, which raises or hangs when the control file says so.

Paged layout: the built-in ``sdpa`` kernel does the work. A plugin does not import another plugin's
module, so it is taken where any caller would take it, from a plugin manager of tokenmill's own
(built-in plugins only), on the first call. Padded layout: the model loads with
``attn_implementation="tokenmill_faulty"``, registered here with transformers as its own SDPA.

Each call first asks the control file (one ``stat``): ``slow`` sleeps every call, ``hang`` sleeps
once, ``raise`` raises; ``prompt_len`` / ``context_len`` limit ``hang`` and ``raise`` to the steps
that hold such a sequence, so that one request can be singled out.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tokenmill.interfaces import AttentionKernel, PagedStep
from tokenmill_faults.control import CONTROL, Control, InjectedFault

TRANSFORMERS_NAME = "tokenmill_faulty"


def matches(settings: dict[str, Any], prefills: list[int], contexts: list[int]) -> bool:
    """Whether a call whose step prefills prompts reaching ``prefills`` positions and holds
    sequences of ``contexts`` positions is one the settings' condition picks (no condition: every call)."""
    prompt_len = settings.get("prompt_len", settings.get("raise_if_prompt_len"))
    context_len = settings.get("context_len", settings.get("raise_if_context_len"))
    if prompt_len is not None and prompt_len not in prefills:
        return False
    if context_len is not None and context_len not in contexts:
        return False
    return True


def inject(control: Control, prefills: list[int], contexts: list[int]) -> None:
    """Sleep or raise as the control file says, for a call with these sequences."""
    control.note("attention")
    settings = control.snapshot()
    if not settings:
        return
    slow = settings.get("slow")
    if slow:
        time.sleep(float(slow))
    if not matches(settings, prefills, contexts):
        return
    hang = control.once("hang") if "hang" in settings else None
    if hang:
        time.sleep(float(hang))
    conditional = "raise_if_prompt_len" in settings or "raise_if_context_len" in settings
    budget = settings.get("raise", -1 if conditional else None)
    if budget is not None and control.take("raise", budget):
        raise InjectedFault("injected fault")


class FaultyAttention(AttentionKernel):
    name = "faulty"
    layouts = ("padded", "paged")
    transformers_name = TRANSFORMERS_NAME
    description = "torch SDPA that raises or hangs on demand ($TOKENMILL_FAULTS; tokenmill-faults, for tests)"

    def __init__(self, control: Control = CONTROL) -> None:
        self.control = control
        self._inner: AttentionKernel | None = None
        self._lock = threading.Lock()

    def inner(self) -> AttentionKernel:
        """The built-in ``sdpa`` kernel, as tokenmill's plugin manager offers it."""
        if self._inner is None:
            with self._lock:
                if self._inner is None:
                    from tokenmill.plugin_manager import build_plugin_manager, choose

                    self._inner = choose(build_plugin_manager(autoload=False), "attention", "sdpa")  # type: ignore[assignment]
        assert self._inner is not None
        return self._inner

    def paged_attention(self, query: Any, key_cache: Any, value_cache: Any, step: PagedStep, scaling: float,
                        sliding_window: int | None = None) -> Any:
        prefills = [c for q, c in zip(step.query_lens, step.context_lens) if q > 1 or c == 1]
        inject(self.control, prefills, list(step.context_lens))
        return self.inner().paged_attention(query, key_cache, value_cache, step, scaling, sliding_window)


def padded_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' attention signature (``query`` ``[batch, heads, q_len, dim]``, ``key``
    ``[batch, kv_heads, kv_len, dim]``): the padded batch's longest prompt is its ``q_len`` at a
    prefill, and every row's context is ``kv_len``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    inject(CONTROL, [kv_len] if q_len > 1 or kv_len == 1 else [], [kv_len])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_with_transformers() -> None:
    """Make ``attn_implementation="tokenmill_faulty"`` mean :func:`padded_attention`, with SDPA's masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TRANSFORMERS_NAME, padded_attention)
    AttentionMaskInterface.register(TRANSFORMERS_NAME, sdpa_mask)
