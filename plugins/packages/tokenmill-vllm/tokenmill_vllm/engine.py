"""tokenmill's engine loop with vLLM's ``LLMEngine`` running the batch.

Each step, tokenmill's scheduler queue admits waiting sequences (within the KV memory vLLM
reports, so vLLM's own queue stays short and the scheduler plugin decides who goes first); they
enter vLLM by prompt token ids with their sampling parameters; one ``LLMEngine.step()`` runs;
each new token goes through tokenmill's detokenizer and stop checks (``Engine.accept_token``),
and a sequence that finishes, fails or loses its client is aborted in vLLM at once.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from tokenmill.engine import Engine, StepClock
from tokenmill.engine.sequence import GenerationRequest, Sequence
from tokenmill.interfaces import EngineSetup, SchedulerQueue
from tokenmill.model.kv_memory import bytes_per_token
from tokenmill.model.loading import ModelLoadError
from tokenmill.sampling import uses_sampling
from tokenmill.sampling.grammar import Grammar

log = logging.getLogger(__name__)

ENGINE_ARGS_VARIABLE = "TOKENMILL_VLLM_ENGINE_ARGS"
"""A JSON object of extra ``vllm.EngineArgs`` (``{"enforce_eager": true}``), over tokenmill's own."""


def unsupported_reason(request: GenerationRequest) -> str | None:
    """Why vLLM's sampler cannot honour ``request`` as tokenmill would, or None."""
    sampling = request.sampling
    if sampling.typical_p is not None and sampling.typical_p < 1.0:
        return "`typical_p` is not supported by --backend vllm"
    if sampling.watermark:
        return "`watermark` is not supported by --backend vllm"
    if sampling.frequency_penalty:
        return ("TGI's `frequency_penalty` is not supported by --backend vllm; the OpenAI routes' "
                "`frequency_penalty` and `presence_penalty` are")
    if request.grammar is not None and lark_grammar(request.grammar) is None:
        return "this grammar cannot be handed to --backend vllm"
    if request.min_tokens:  # vLLM would mask end tokens itself, but tokenmill decides when a sequence ends
        return "`min_tokens` is not supported by --backend vllm"
    return None


def sampling_params(seq: Sequence) -> Any:
    """vLLM's ``SamplingParams`` for one sequence. vLLM never stops on its own before tokenmill does:
    end-of-sequence tokens, stop sequences and the length limit are tokenmill's checks."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    request, sampling = seq.request, seq.request.sampling
    sampled = uses_sampling(sampling)
    grammar = request.grammar
    return SamplingParams(
        temperature=(sampling.temperature or 1.0) if sampled else 0.0,
        top_k=(sampling.top_k or 0) if sampled else 0,
        top_p=(sampling.top_p or 1.0) if sampled else 1.0,
        min_p=(sampling.min_p or 0.0) if sampled else 0.0,
        logit_bias=dict(sampling.logit_bias) or None,
        seed=seq.seed if sampled else None,
        repetition_penalty=sampling.repetition_penalty or 1.0,
        presence_penalty=sampling.presence_penalty or 0.0,
        frequency_penalty=sampling.occurrence_penalty or 0.0,
        max_tokens=request.max_new_tokens,
        ignore_eos=True,
        logprobs=request.top_n_tokens,
        prompt_logprobs=0 if request.decoder_input_details else None,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=StructuredOutputsParams(grammar=lark_grammar(grammar)) if grammar is not None else None,
    )


def lark_grammar(grammar: Grammar) -> str | None:
    """A tokenmill grammar as the Lark text vLLM's guidance backend reads, or None when it has no
    such form. Lark stays as it is; llguidance's serialized grammar of a JSON schema (with tokenmill's
    JSON layout) or a regular expression holds one Lark grammar or one schema, which ``%json`` embeds."""
    if grammar.kind == "lark":
        return grammar.source
    try:
        parts = json.loads(grammar.source).get("grammars") or []
    except (ValueError, AttributeError):
        return None
    if len(parts) != 1:
        return None
    if parts[0].get("lark_grammar"):
        return parts[0]["lark_grammar"]
    if parts[0].get("json_schema") is not None:
        return "start: %json " + json.dumps(parts[0]["json_schema"])
    return None


def token_logprobs(token_id: int, logprobs: dict[int, Any] | None, top_n: int
                   ) -> tuple[float | None, list[tuple[int, float]]]:
    """The chosen token's log-probability and the ``top_n`` best (id, logprob), from vLLM's dict."""
    if not logprobs:
        return None, []
    chosen = logprobs.get(token_id)
    ranked = sorted((entry.rank, tid, entry.logprob) for tid, entry in logprobs.items() if entry.rank is not None)
    top = [(tid, lp) for rank, tid, lp in ranked if rank <= top_n][:top_n]
    return (chosen.logprob if chosen is not None else None), top


class KvStats:
    """vLLM's KV-cache use and preemptions, as its scheduler reports them every step."""

    def __init__(self, blocks_total: int = 0, bytes_per_block: int = 0) -> None:
        self.usage = 0.0
        self.preempted = 0
        self.blocks_total = blocks_total
        self.bytes_per_block = bytes_per_block

    def logger_factory(self) -> Any:
        """A per-engine stat-logger factory for ``LLMEngine.from_engine_args(stat_loggers=...)``."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    stats.usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0))
                if iteration_stats is not None:
                    stats.preempted += int(getattr(iteration_stats, "num_preempted_reqs", 0))

            def log_engine_initialized(self) -> None:
                pass

        return Recorder

    def usage_dict(self) -> dict[str, int]:
        used = round(self.usage * self.blocks_total)
        return {"bytes": used * self.bytes_per_block, "blocks_used": used, "blocks_total": self.blocks_total}


class VllmRunner:
    """The runner face tokenmill's engine keeps: releasing a sequence aborts it in vLLM."""

    chunked_prefill = True
    pausable = False
    kv_block_size = 1

    def __init__(self, llm: Any, stats: KvStats) -> None:
        self.llm = llm
        self.stats = stats
        self.active: set[str] = set()
        """The vLLM request ids still running there."""

    def step(self, prefill: list[Sequence], chunks: list[int], want_prompt_logits: list[bool],
             decode: list[Sequence]) -> Any:
        raise NotImplementedError("vLLM runs whole engine steps (VllmEngine.step)")

    def can_decode(self, seqs: list[Sequence]) -> bool:
        return True  # vLLM preempts within its own KV memory

    def kv_free_tokens(self) -> int | None:
        return None

    def release(self, seqs: list[Sequence]) -> None:
        ids = [request_id(s) for s in seqs if request_id(s) in self.active]
        if ids:
            self.active.difference_update(ids)
            self.llm.abort_request(ids)
        self._forget_usage_when_idle()

    def reset(self) -> None:
        if self.active:
            self.llm.abort_request(sorted(self.active))
            self.active.clear()
        self._forget_usage_when_idle()

    def _forget_usage_when_idle(self) -> None:
        """vLLM reports its KV use only from steps; after the last abort no step follows, but it holds nothing."""
        if not self.active:
            self.stats.usage = 0.0

    def kv_usage(self) -> dict[str, int]:
        return self.stats.usage_dict()


def vllm_prompt(seq: Sequence) -> dict[str, Any]:
    """The sequence's prompt as vLLM takes it: token ids, and the request's part of the prefix cache
    (its cache salt, else its tenant's) as vLLM's cache salt, if it has one."""
    prompt: dict[str, Any] = {"prompt_token_ids": seq.prompt_ids}
    partition = getattr(seq.request, "cache_partition", None)
    if partition is not None:
        prompt["cache_salt"] = partition
    return prompt


def request_id(seq: Sequence) -> str:
    return str(seq.id)


def is_dead(error: Exception) -> bool:
    """Whether ``error`` says vLLM's engine-core process is gone (vLLM's ``EngineDeadError``)."""
    return type(error).__name__ == "EngineDeadError"


class VllmEngine(Engine):
    """tokenmill's queueing, events, detokenization and stop checks over vLLM's batch."""

    def __init__(self, llm: Any, runner: VllmRunner, queue: SchedulerQueue, setup: EngineSetup) -> None:
        config = setup.config
        super().__init__(runner, queue, setup.tokenizer, setup.eos_ids, config.max_batch_prefill_tokens, setup.pm,
                         stream_buffer_tokens=config.stream_buffer_tokens)
        self.llm = llm
        self.by_request_id: dict[str, Sequence] = {}

    @property
    def vllm_runner(self) -> VllmRunner:
        return self.runner  # type: ignore[return-value]

    def unavailable_reason(self, request: GenerationRequest) -> str | None:
        return unsupported_reason(request)

    def step(self) -> None:
        admitted = self._admit()
        if not self.running:
            return
        method = "prefill" if admitted or any(not s.generated_ids for s in self.running) else "decode"
        clock = StepClock(method, len(admitted))
        try:
            outputs = self.llm.step()
        except Exception as error:  # noqa: BLE001 - vLLM's failure fails this batch, or ends the engine
            self.observe_step(clock.timing(ok=False))
            if is_dead(error):
                self.give_up(f"vLLM's engine died: {error}")
                return
            log.exception("vLLM's step failed")
            self.fail(list(self.running), f"generation failed: {type(error).__name__}: {error}")
            return
        clock.forwarded()
        self._take(outputs)
        self.preemptions = self.vllm_runner.stats.preempted
        self.observe_step(clock.timing(ok=True))

    def _admit(self) -> list[Sequence]:
        """Hand the sequences the scheduler admits now to vLLM."""
        admitted = []
        for seq in self.queue.admit(self.running, self.step_budget()):
            if not self.start_sequence(seq):
                continue
            if self.sampler(seq).processors:
                self.fail([seq], "--backend vllm cannot apply logits processors from plugins "
                                 "(tokenmill_logits_processors)")
                continue
            try:
                self.llm.add_request(request_id(seq), vllm_prompt(seq), sampling_params(seq))
            except Exception as error:  # noqa: BLE001 - vLLM refuses this request only, unless it has died
                if is_dead(error):  # it waits again and ends with the rest, as unhealthy
                    self.queue.requeue(seq)
                    self.give_up(f"vLLM's engine died: {error}")
                    return admitted
                log.warning("vLLM refused sequence %d: %s", seq.id, error)
                self.llm.abort_request([request_id(seq)])  # it may be half registered
                self.fail([seq], f"vLLM refused the request: {error}")
                continue
            self.vllm_runner.active.add(request_id(seq))
            self.by_request_id[request_id(seq)] = seq
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _take(self, outputs: list[Any]) -> None:
        """Each request's new tokens, through tokenmill's stop checks; finished ones leave vLLM."""
        ended = []
        for output in outputs:
            seq = self.by_request_id.get(output.request_id)
            if seq is None or seq.cancelled:
                continue
            if output.prompt_logprobs and not seq.prefill_tokens and seq.request.decoder_input_details:
                seq.prefill_tokens = self.prompt_token_infos(seq.prompt_ids, [
                    entry[token].logprob if entry and token in entry else None
                    for token, entry in zip(seq.prompt_ids, output.prompt_logprobs)])
            if self._take_tokens(seq, output.outputs[0]):
                ended.append(seq)
            elif output.finished and request_id(seq) in self.by_request_id:  # not failed by _take_tokens
                self.vllm_runner.active.discard(request_id(seq))
                reason = output.outputs[0].finish_reason
                self.fail([seq], f"vLLM ended the request before tokenmill's limits did ({reason})")
        self.release(ended)

    def _take_tokens(self, seq: Sequence, completion: Any) -> bool:
        """Accept the tokens of one output; True when the sequence finished."""
        top_n = seq.request.top_n_tokens
        logprobs = completion.logprobs or []
        for index, token_id in enumerate(completion.token_ids):
            logprob, top = token_logprobs(token_id, logprobs[index] if index < len(logprobs) else None, top_n)
            try:
                if self.accept_token(seq, token_id, logprob, top):
                    return True
            except Exception as error:  # noqa: BLE001 - one request's failure stays its own
                log.exception("sequence %d failed", seq.id)
                self.fail([seq], f"generation failed: {type(error).__name__}: {error}")
                return False
        return False

    def release(self, seqs: list[Sequence]) -> None:
        super().release(seqs)
        for seq in seqs:
            self.by_request_id.pop(request_id(seq), None)

    def drop_cached_prefixes(self) -> int:
        """vLLM resets its whole prefix cache at once and does not count blocks: 0 when it refused
        (some blocks are in use), else 1."""
        return int(bool(self.llm.reset_prefix_cache()))

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)
        shutdown = getattr(getattr(self.llm, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()


def engine_arguments(setup: EngineSetup) -> dict[str, Any]:
    """``vllm.EngineArgs`` from tokenmill's settings, then ``TOKENMILL_VLLM_ENGINE_ARGS`` over them."""
    config = setup.config
    context = getattr(setup.model_config, "max_position_embeddings", None)
    arguments: dict[str, Any] = {
        "model": str(setup.model_path),
        "served_model_name": setup.model_id,
        "dtype": str(setup.dtype).removeprefix("torch."),
        "max_model_len": config.total_tokens_limit(context),
        "seed": 0,
        "trust_remote_code": config.trust_remote_code,
        "structured_outputs_config": {"backend": "guidance"},  # tokenmill's grammars are llguidance's
        "logprobs_mode": "processed_logprobs",  # after penalties and warpers, as tokenmill's sampler reports them
        "max_logprobs": max(20, config.max_top_n_tokens),
        "enable_prefix_caching": getattr(config, "prefix_caching", True),
    }
    if config.max_batch_size:
        arguments["max_num_seqs"] = config.max_batch_size
    if config.max_batch_prefill_tokens:
        arguments["max_num_batched_tokens"] = config.max_batch_prefill_tokens
    if setup.device.type == "cuda":  # the margin tokenmill's own KV pool leaves too
        arguments["gpu_memory_utilization"] = round(0.9 * config.cuda_memory_fraction, 3)
    extra = os.environ.get(ENGINE_ARGS_VARIABLE, "").strip()
    if extra:
        try:
            overrides = json.loads(extra)
        except ValueError as error:
            raise ModelLoadError(f"{ENGINE_ARGS_VARIABLE} is not JSON: {error}") from None
        if not isinstance(overrides, dict):
            raise ModelLoadError(f"{ENGINE_ARGS_VARIABLE} must be a JSON object of vllm.EngineArgs fields")
        arguments.update(overrides)
    return arguments


def start_vllm_engine(setup: EngineSetup) -> VllmEngine:
    """Start vLLM's engine on the checkpoint and wrap it in tokenmill's loop (not started)."""
    # vLLM's log records then pass through tokenmill's logging (JSON lines with --json-output).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError as error:
        raise ModelLoadError(f"vLLM cannot be imported: {error}") from None
    arguments = engine_arguments(setup)
    try:
        engine_args = EngineArgs(**arguments)
    except TypeError as error:
        raise ModelLoadError(f"vLLM's engine arguments: {error}") from None
    stats = KvStats()
    llm = LLMEngine.from_engine_args(engine_args, stat_loggers=[stats.logger_factory()])
    cache = llm.vllm_config.cache_config
    stats.blocks_total = int(cache.num_gpu_blocks or 0)
    stats.bytes_per_block = bytes_per_token(setup.model_config, setup.dtype) * cache.block_size
    kv_tokens = stats.blocks_total * cache.block_size
    log.info("vLLM engine: %d KV blocks of %d positions, max_model_len %d", stats.blocks_total, cache.block_size,
             llm.vllm_config.model_config.max_model_len)
    queue = setup.new_queue(kv_tokens)
    return VllmEngine(llm, VllmRunner(llm, stats), queue, setup)
