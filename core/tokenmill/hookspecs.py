"""Every hook a tokenmill plugin can implement.

Plugin kinds (backends, attention kernels, schedulers, KV allocators, quantizers, tool-call and
reasoning parsers) are offered
through the ``tokenmill_*s`` hooks: each returns a list of implementations, and the
matching command-line flag picks one of them by ``name``. The other hooks let a
plugin observe and extend the server. The hook docstrings are written in Markdown:
``.ci/hooks_reference.py`` renders them as the hook reference in ``hooks.md``, and a test
fails when that page is stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import falcon.asgi

    from tokenmill.interfaces import (
        AttentionKernel,
        Backend,
        KVAllocator,
        Quantizer,
        ReasoningParser,
        Scheduler,
        ToolParser,
    )

hookspec = pluggy.HookspecMarker("tokenmill")

HOOKS_VERSION = "2.1"
"""The version of this set of hooks, ``major.minor``: the major grows when a hook changes in a way
old plugins cannot follow, the minor when hooks are added. A plugin module says which version it
was built for (``tokenmill_hooks_version = "2.0"``); it loads when the major versions are equal
and its minor is not newer than this one, or when it was built for hooks 1.x (2.0 changed only the
scheduler's queue, and a 1.x queue still runs through an adapter), and is refused with both versions
named otherwise."""

OLDEST_MAJOR = 1
"""The oldest major version of the hooks whose plugins still load."""


@hookspec
def tokenmill_backends() -> list[Backend]:
    """Offer engine backends.

    Called once when the plugin manager resolves `--backend`. Receives nothing. Returns a list of
    `tokenmill.interfaces.Backend` implementations; the one whose `name` equals `--backend` runs the
    model. Built in: `transformers`, `paged`, `flash`.

    A backend declares the KV layout it needs (`kv_layout`) and its default attention kernel and
    KV allocator (`default_attention`, `default_kv_allocator`). Its `model_unavailable_reason(model)`
    says why it cannot run a loaded model (or None), and `create(model, kv_store, attention)` returns
    a runner (`tokenmill.interfaces.BackendRunner`), whose only caller is the engine thread:

    - `step(prefill, chunks, want_prompt_logits, decode, drafts=None) -> StepOutput` runs one engine step: it
      prefills the next `chunks[i]` tokens of each `prefill` sequence and feeds each `decode`
      sequence its newest token (and, for a `speculative` runner, its draft: see Speculation);
    - the attribute `chunked_prefill`;
    - the attribute `takes_images` (default false): whether `step` places a vision-language prompt's image
      embeddings (`seq.images`, encoded by `tokenmill.model.vision.encode_sequences`) at its image tokens;
      requests with images are refused with a 422 for a runner that does not.

    **KV memory.** A runner over a block pool (the paged runner) exposes it as `kv_pool`; the engine's
    KV-cache manager (`tokenmill.engine.kv_cache.KVCacheManager`) then owns that memory: before each
    step it allocates every sequence's blocks (a prompt's whole context, a draft's positions), after
    the step it names the full blocks (only once the forward that filled them succeeded), and it
    frees, rolls back and resets them. Such a runner only reads `kv_pool.blocks_of(seq.id)` to pack
    its step and keeps no cache state; offered prefix caching (`enable_prefix_caching()`, below), it
    just says whether its pool can keep cached blocks. A runner without `kv_pool` keeps its own KV
    memory and answers `can_decode(seqs)`, `kv_free_tokens()`, `release(seqs)`, `reset()` and
    `kv_usage()` (the transformers runner does).

    **Prefix caching.** A runner without `kv_pool` that reuses computed prompt prefixes sets
    `prefix_caching = True` and answers three more calls:

    - `prefix_hit(seq, planned)` (read-only): the leading tokens of a sequence that holds no KV
      memory whose blocks are cached, as a `PrefixHit`;
    - `plan_prefill(seq, chunk)`, while the engine plans a step, for each prefill chunk in the order
      they run: the sequence takes the cached blocks the engine counted in `seq.num_computed`, its
      context is reserved, and the blocks full after the chunk are named, so that a later sequence of
      the same step shares them; MemoryError when the pool is short, with nothing taken;
    - `reset_prefix_cache()`, for `POST /reset_prefix_cache`.

    tokenmill offers the cache to a runner with `enable_prefix_caching()` and
    `prefix_caching_unavailable_reason()`, as it offers a compiled forward. A request's LoRA adapter
    and its `cache_salt`, else its tenant (the API key it came with), make its blocks' names its own
    (`Sequence.cache_namespace`);
    `tokenmill.engine.prefix` names blocks (`block_hash`, `full_block_hashes`: a vision-language prompt's
    blocks also by the digest of each image whose first token they hold); `tokenmill.engine.kv_cache`
    offers those too, and `tokenmill.engine.prefix.BlockChain` names a runner's blocks as it fills them
    (by their tokens only: a runner that takes images names them with `full_block_hashes`).

    **Speculation.** A runner that verifies drafts (`--speculate`) sets `speculative = True`. Its
    `step` then takes `drafts`, per decoding sequence the tokens to feed after its newest one (an empty
    tuple for none), and returns in `StepOutput.draft_logits`, per decoding sequence, the logits after
    each draft token it fed. A runner over a `kv_pool` is given only drafts the engine found memory
    for, and feeds them all; the engine then drops the rejected ones (naming the blocks accepted
    tokens filled, and calling the pool's optional `truncate(seq_id, tokens)`). A runner of its own
    KV memory may feed fewer, none included, where its memory is short; after the engine has appended
    the tokens it kept, it calls that runner's `rollback(seqs)` for the sequences that fed a draft,
    those that end in the step included (a sequence that got no token, cancelled or failed, is
    released right after and needs nothing): their KV memory must then hold only positions below
    `seq.num_computed`. A runner without `speculative` is never given drafts; tokenmill refuses
    `--speculate` at start with it.

    **Mixed steps.** A backend whose steps prefill newcomers (in chunks) in the same forward as the
    running batch decodes sets `mixed_steps = True` (the paged backends do). Its admission defaults
    then differ from TGI's: `--waiting-served-ratio` 0, and on CPU at most 2048 prompt tokens a step.

    **A compiled forward.** A runner may offer one with both of these methods:
    `compile_unavailable_reason()` (why not here, or None) and `compile_forward()`, which makes later
    steps run through `torch.compile`. tokenmill calls them before the warm-up (which then pays the
    compile) unless `--no-compile-model` is given or the settings rule it out (sharding, LoRA,
    quantization); the paged runner offers it on CPU, and falls back to its eager forward if the
    compile fails. A runner that can also build it off the engine thread offers
    `build_compiled_forward()`: tokenmill then calls that instead, after an eager warm-up, in a
    thread of its own (the load stage "compiling the forward", `/info`'s `forward`), while the
    engine already steps eagerly; it must not touch what the engine thread owns (the KV pool),
    must leave the steps eager until it returns, and raises if the compile fails
    (`--compile-before-ready` keeps the compile in the warm-up). It may return True where it loaded
    a forward an earlier start saved instead of compiling (`/info`'s `forward_from_cache`); a runner
    that saves its forward also offers `compiled_forward_saved()` (whether one is saved for this model
    on this machine): tokenmill then builds at normal CPU priority instead of the lowest, since a
    load takes seconds. The paged runner saves its forward where its linear layers are packed.

    **An engine of its own.** A backend that loads the model and schedules, samples and keeps KV
    memory itself sets `owns_engine = True` and implements `create_engine(setup: EngineSetup)`
    instead of `create`; it returns a subclass of `tokenmill.engine.Engine` that replaces `step()`.
    `--attention`, `--kv-allocator` and `--block-size` do not apply to it. "A backend with an engine
    of its own", under "Writing each kind" in `hooks.md`, says what tokenmill hands it and expects.
    """


@hookspec
def tokenmill_attention_kernels() -> list[AttentionKernel]:
    """Offer attention kernels.

    Called once when the plugin manager resolves `--attention`. Receives nothing. Returns a list of
    `tokenmill.interfaces.AttentionKernel` implementations; the one named by `--attention` is used by
    the backend. Built in: `sdpa` (both layouts), `eager` (padded), `flash` (paged, CUDA).

    A kernel lists the KV layouts it serves (`layouts`). For the padded layout it names the
    `attn_implementation` transformers loads the model with (`transformers_name`); for the paged
    layout it implements `paged_attention(query, key_cache, value_cache, step: PagedStep, scaling,
    sliding_window)` over a packed step whose keys and values are already in the blocks, and may
    require block sizes of a multiple (`block_size_multiple`).
    """


@hookspec
def tokenmill_schedulers() -> list[Scheduler]:
    """Offer request schedulers.

    Called once when the plugin manager resolves `--scheduler`. Receives nothing. Returns a list of
    `tokenmill.interfaces.Scheduler` implementations; the one named by `--scheduler` decides which
    waiting requests join the running batch at each engine step. Built in: `fifo` (TGI's rules) and
    `priority` (class weight, aging and expected cost, with preemption).

    A scheduler is a policy: it decides only the order in which waiting sequences start, and the
    engine does admission and memory. Its `create(limits: BatchLimits)` returns the waiting queue
    (`tokenmill.interfaces.SchedulerQueue`, hooks 2.0): `add(seq)`, `prepend(seq)` (a preempted,
    suspended or not-yet-started sequence, ahead of new ones), `peek()` (the next to start),
    `pop()`, `remove(seq) -> bool`, `__len__` and `__iter__` (the waiting sequences in the order they
    start, for `GET /queue`). `tokenmill.engine.queue.WaitingQueue(limits)` implements all of them
    over a line of sequences; a subclass overrides only `key(seq)` or `ordered()`.

    Every engine step the engine takes sequences with `peek` and `pop` while they fit the step's
    limits together (`tokenmill.engine.admission.Room`: prefill tokens, batch size, KV positions,
    counting only what the prefix cache does not hold), up to the first that does not; none skips
    ahead of it. A policy with `waits_for_company = True` lets newcomers join a running batch only by
    TGI's rule (`tokenmill.engine.admission.joins_now`); the engine then puts them back with
    `prepend`.

    A policy may also define `choose_victim(running, waiting, shortage) -> Preemption | None`: called
    before admission when sequences hold KV memory, with the next waiting sequence and what it lacks
    (`"seats"`, `"prefill"`, `"memory"`, or None when it fits). The sequence it names is set aside
    and requeued to resume later with the same output: with `keep_kv=True` it only gives up its place
    in the batch (on a backend that can leave rows out of a step); otherwise its KV memory is freed
    and recomputed.

    Each `Sequence` carries its `request` (with `priority`, `max_new_tokens`), `prompt_len`,
    `pending_len` and `arrived_at`.

    Hooks 1.x queues (`requeue`, `drain`, `pending()` and their own `admit(holding, budget)` and
    `preempt(running, budget)`, without `pop`) still load: the engine calls their `admit` and
    `preempt` as hooks 1.x did (`tokenmill.engine.scheduling.LegacyAdmission`).

    Exceptions: a queue method may raise; the engine never lets that lose a request. After a call
    that raised, every sequence the engine took in that is neither in the running batch nor in the
    queue's listing (one `pop` or `prepend` dropped) ends with an error (`generation`, 424); the
    running batch goes on, and the next step calls the queue again. A raising `add` fails the
    sequence it was given; a raising `remove` leaves a cancelled sequence that the engine skips when
    it is admitted; a raising `choose_victim` preempts nothing that step; a queue that raises while
    drained at shutdown still gives every sequence its error. Each step with a raising call counts as
    a failed step towards `--max-failed-steps`, so a queue that raises every step breaks the engine
    (`/health` 503, exit status 3). Keep `__iter__` cheap and exception-free: it is how the engine
    knows what waits.
    """


@hookspec
def tokenmill_kv_allocators() -> list[KVAllocator]:
    """Offer KV-cache allocators.

    Called once when the plugin manager resolves `--kv-allocator`. Receives nothing. Returns a list of
    `tokenmill.interfaces.KVAllocator` implementations; the one named by `--kv-allocator` owns the
    backend's KV memory. Built in: `dynamic` (transformers' DynamicCache), `paged` (a caching pool:
    least recently used cached blocks are evicted once the free list is empty).

    An allocator serves one KV layout (`layout`). Its
    `create(model_config, dtype, device, max_tokens, block_size)` returns the store the backend keeps
    keys and values in:

    - for the padded layout, a `PaddedKVCache`: `new_cache`, `concat`, `select_rows`, `trim_left`,
      `nbytes`;
    - for the paged layout, a `BlockPool` of `max_tokens` positions: `layer`, `reserve`, `free`,
      `free_all`, `free_blocks`, `blocks_of`, `bytes_per_block`.

    A pool that also implements `CachingBlockPool` (`lookup`, `idle_among`, `share`, `name`, `unname`,
    `drop_cached`, `cached_blocks`) keeps named blocks cached when their last holder lets go, and the
    paged backends then cache prefixes with it; a plain `BlockPool` still works, without the cache.
    """


@hookspec
def tokenmill_quantizers() -> list[Quantizer]:
    """Offer quantizers.

    Called once when the plugin manager resolves `--quantize`, or when a checkpoint's `config.json`
    names its own `quantization_config.quant_method` (as TGI does: a GPTQ checkpoint loads as `gptq`
    without the flag). Receives nothing. Returns a list of `tokenmill.interfaces.Quantizer`
    implementations; the one named by `--quantize`, or else the one whose `checkpoint_method` is the
    checkpoint's `quant_method`, loads or quantizes the model. Built in: `int8`, `int4`, `gptq`,
    `awq`, `bitsandbytes`, `bitsandbytes-nf4`, `bitsandbytes-fp4`, `fp8`; their layers live in
    `tokenmill.model.quant_linears`, for plugins to reuse.

    A quantizer does one of three things, each a method with a do-nothing default:

    - `load(path, dtype, device, attn_implementation, trust_remote_code)` builds the model itself.
      Checkpoints quantized by another tool need this (set `checkpoint_method` to the `quant_method`
      you read).
    - `from_pretrained_kwargs(dtype, device)` adds arguments to transformers' `from_pretrained`, such
      as a `quantization_config`.
    - `quantize(model)` changes the loaded model in place and returns a detail for the log.

    Quantization is the `quantizing` load stage, and `/info` shows the method.
    """


@hookspec
def tokenmill_tool_parsers() -> list[ToolParser]:
    """Offer tool-call parsers.

    Called once when the server resolves `--tool-call-parser`, after the tokenizer is loaded. Receives
    nothing. Returns a list of `tokenmill.interfaces.ToolParser` implementations; the one named by
    `--tool-call-parser` reads tool calls out of chat outputs. Without the flag, the first parser (by
    `order`) whose `detects(chat_template)` is true serves, else `tgi`. Built in: `hermes`,
    `llama3_json`, `mistral`, `qwen3_xml` (and `qwen3_coder`), `pythonic` (vLLM's names) and `tgi`.

    With a parser whose `grammar_forced` is false, the chat template shows the request's tools (its
    `tools` variable) and, for `tool_choice: "auto"`, the model answers freely: `parse(text, tools,
    final)` returns a `ParsedOutput(content, calls)` for the output so far, where each
    `ParsedCall(name, arguments, complete)` holds the arguments as JSON text as far as written. It is
    called again with the longer output after every token; what it returns must only grow (hold back
    a tail that may still become a marker), and the server streams what grew. `special_texts` names
    special tokens the format uses as markers, which stay in the text it reads. `tool_choice:
    "required"` or a named function holds the output to the `tgi` parser's grammar whatever the parser.
    """


@hookspec
def tokenmill_reasoning_parsers() -> list[ReasoningParser]:
    """Offer reasoning parsers.

    Called once when the server resolves `--reasoning-parser`. Receives nothing. Returns a list of
    `tokenmill.interfaces.ReasoningParser` implementations; the one named by `--reasoning-parser`
    splits chat outputs into `reasoning_content` and `content`. Built in: `deepseek_r1`, `qwen3`,
    `granite` (vLLM's names).

    `starts_reasoning(prompt)` says whether the output begins inside the reasoning (a template that
    opens it in the prompt); `split(text, reasoning_first, final)` returns a `ReasonedOutput(reasoning,
    content, ended)` for the output so far, which, like a tool parser's result, must only grow as the
    text grows. Tool calls are read from the content only. When `thinks(prompt)` is true, a grammar
    the request asks for (`response_format`, a required tool call) holds only the answer: free text
    up to the parser's `end` (`</think>`) comes first.
    """


@hookspec
def tokenmill_load_stage(stage: str, seconds: float, detail: str) -> None:
    """Observe model loading.

    Called in the loader thread each time a model-load stage ends, done or failed (`resolving`,
    `downloading`, `converting gguf`, `loading weights`, `quantizing`, `warm-up`). Receives the stage
    name, its duration in seconds and a short detail: the path, or `failed: <cause>`. Returns
    nothing. Use it to export start-up timings.
    """


@hookspec
def tokenmill_request_started(request_id: str, inputs: str, parameters: dict[str, Any]) -> None:
    """Observe a request that passed validation and is handed to the engine.

    Called on the HTTP event loop; it must not block. Receives the request id (the client's
    `X-Request-Id` when it sent a usable one, else a new one; the response and every log line of the
    request carry it), the prompt text and the parameters as the client sent them (less
    `cache_salt`). Returns nothing.
    """


@hookspec
def tokenmill_request_finished(
    request_id: str, finish_reason: str | None, generated_tokens: int, error: str | None
) -> None:
    """Observe a request that ended: finished, failed, or cancelled because its client left.

    Called on the HTTP event loop; it must not block. Receives the request id, the finish reason
    (`length`, `eos_token` or `stop_sequence`; None when it failed or was cancelled), the number of
    generated tokens and an error message that says why it failed or was cancelled (None on success).
    Returns nothing.
    """


@hookspec
def tokenmill_logits_processors(
    parameters: dict[str, Any],
) -> list[Callable[[list[int], Any], Any]]:
    """Add logits processors to one request.

    Called in the engine thread once per sequence, when it is admitted. Receives the request's
    parameters (as `tokenmill_request_started` does). Returns a list of callables
    `f(token_ids: list[int], scores: torch.Tensor) -> torch.Tensor` over one row of `[vocab]` scores,
    applied in order after tokenmill's penalties and the watermark, and before the grammar mask,
    temperature and top-k/p truncation (so a grammar still holds whatever a processor does).
    `token_ids` holds the prompt and the tokens generated so far. An exception in a processor fails
    only that request (424), never the batch.
    """


@hookspec
def tokenmill_add_routes(app: falcon.asgi.App, server: Any) -> None:
    """Add HTTP routes.

    Called once when the Falcon app is built, before it serves (a server of several models, `--models-dir`,
    builds one app per model each time it loads one, so once per load). Receives the Falcon ASGI app and the
    server state, a `tokenmill.http.app.ServerState`: `server.config` is the configuration,
    `server.engine` the running engine (None until the model is loaded) and `server.loaded` the model
    and tokenizer once loaded. Returns nothing; add routes with `app.add_route`.
    """
