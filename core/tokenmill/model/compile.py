"""Whether the model's forward is compiled (torch.compile) with these settings, and asking the runner to:
before the server is ready (the warm-up pays the compile) or, where the runner can build it on steps of
its own, in the background while the server serves with the eager forward."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from tokenmill.model.kv_memory import freeze_heap, trim_heap
from tokenmill.model.loading import cache_dir

if TYPE_CHECKING:
    from tokenmill.config import Config
    from tokenmill.model.loading import LoadedModel, Stages

log = logging.getLogger(__name__)


def compile_unavailable_reason(config: Config, loaded: LoadedModel, runner: Any) -> str | None:
    """Why the model forward is not compiled with these settings, or None."""
    if not hasattr(runner, "compile_forward"):
        return "the backend runs its forward eagerly"
    if config.num_shard > 1:
        return "a sharded forward (--num-shard) is not compiled"
    if loaded.quantization is not None:
        return "quantized layers are not compiled"
    return runner.compile_unavailable_reason()


Forward = Literal["eager", "compiling", "compiled"]
"""Which forward the steps run: /info's ``forward``."""


def use_compile_cache_dir() -> Path:
    """Point inductor's caches (its compiled C++ kernels, the FX graph and autotuning caches) into tokenmill's
    cache, per torch version, unless ``TORCHINDUCTOR_CACHE_DIR`` says where: its default, under /tmp, is
    lost with a restarted container. Inductor keys each entry by what it compiled, so models and settings
    share the directory safely. Call before the first compile."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen or chosen == inductor_default_cache_dir():  # importing parts of torch sets the default
        chosen = str(cache_dir() / "inductor" / f"torch-{torch.__version__}")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen
    return Path(chosen)


def inductor_default_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.runtime_utils import default_cache_dir
    except ImportError:
        return None
    return default_cache_dir()


COMPILE_SWITCH_INTERVAL = 0.0002
"""The GIL's switch interval while a compile runs beside the engine: an eager step lets go of the GIL
in each of its thousands of operators and waits, every time, until the compiling thread is made to
give it back; at Python's 5 ms that made a step of SmolLM2 last seconds."""


def yield_to_engine() -> None:
    """Give the calling thread (and the compiler processes it starts) the lowest CPU priority, where
    the OS lets one thread have its own (Linux)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Compiler:
    """Which forward the runner's steps take, and having the compiled one built: by the warm-up's first
    steps (``compile_forward``), or, where the runner offers ``build_compiled_forward`` and no
    ``--compile-before-ready`` asks otherwise, in a thread of its own while the engine steps eagerly,
    timed as the load stage "compiling the forward"."""

    STAGE = "compiling the forward"

    def __init__(self, config: Config, loaded: LoadedModel, runner: Any, stages: Stages) -> None:
        self.runner = runner
        self.stages = stages
        self.state: Forward = "eager"
        self.from_cache: bool | None = None
        """Whether the background build loaded the forward an earlier start on this machine saved (or, for a
        runner that saves none, found its graph in AOTAutograd's cache), once it is built."""
        reason = compile_unavailable_reason(config, loaded, runner) if config.compile_model else "--no-compile-model"
        self.in_background = reason is None and hasattr(runner, "build_compiled_forward") \
            and not config.compile_before_ready
        self.in_warm_up = reason is None and not self.in_background
        self.thread: threading.Thread | None = None
        if reason:
            log.info("the forward runs eagerly: %s", reason)
        elif self.in_warm_up:
            runner.compile_forward()

    @property
    def forward(self) -> Forward:
        """What the steps run now: a compiled forward whose first steps failed was dropped for the eager one."""
        if self.state == "compiled" and getattr(self.runner, "compiled", True) is None:
            return "eager"
        return self.state

    def start(self) -> None:
        """Once the server serves (the warm-up done, the engine stepping): note the compile the warm-up
        did, or start the one in the background, which then takes no CPU from the start itself."""
        if self.in_warm_up and getattr(self.runner, "compiled", True) is not None:
            self.state = "compiled"
        if self.in_background:
            self.state = "compiling"
            self.thread = threading.Thread(target=self._build, name="tokenmill-compile", daemon=True)
            self.thread.start()

    def _build(self) -> None:
        saved = getattr(self.runner, "compiled_forward_saved", lambda: False)()
        if not saved:  # a compile; loading a saved forward takes seconds, and under a burst it would take minutes
            yield_to_engine()
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(COMPILE_SWITCH_INTERVAL)
        hits = compile_cache_hits()
        detail = ("loading the one an earlier start saved" if saved else "torch.compile") \
            + ", in the background: steps ran eagerly until it was built"
        try:
            loaded = self.stages.run(self.STAGE, self._build_forward, detail=detail)
        except Exception as error:  # noqa: BLE001 - the eager forward keeps serving
            log.warning("the forward stays eager: %s", error)
            self.state = "eager"
            return
        finally:
            sys.setswitchinterval(switch_interval)
        self.from_cache = loaded if isinstance(loaded, bool) else compile_cache_hits() > hits
        self.state = "compiled"
        freeze_heap()  # what tracing left behind (graphs, fake tensors) is collected, goes back to the OS with
        trim_heap()    # the heap's trim, and what the compile keeps is frozen
        log.info("steps now run through the compiled forward")

    def _build_forward(self) -> Any:
        prepare_kernel_loading()
        return self.runner.build_compiled_forward()


PROBE_KERNEL = """#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(float* out_ptr0) { out_ptr0[0] = 0.0f; }
"""
"""The smallest C++ kernel inductor builds (at the first start on a machine, then kept in its cache)."""

OUTPUT_CODE_IMPORTS = ("torch._inductor.select_algorithm", "torch._inductor.codegen.memory_planning")
"""The modules inductor's generated Python code imports at its top (torch 2.13): 1.7 s of imports on a slow CPU,
made while the probe kernel loads. A name torch no longer has is skipped."""


def prepare_kernel_loading() -> None:
    """Do what inductor does once per process before the first C++ kernel of a compiled forward loads, with
    the parts that wait on other processes beside the imports that need the interpreter: it checks which
    vector instruction sets the kernels may use (a child process loads libtorch with a test library: 0.5 s
    for each set the CPU lists, up to three) and keys its precompiled header (the C++ preprocessor over
    torch's headers, 0.4 s). A probe kernel loaded in a thread of its own does both, while this one imports
    what the compiled forward's code will. The modules the probe needs are imported first, here, so that
    the two threads never import the same modules at once."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        from torch.utils import cpp_extension  # noqa: F401 - imported by the probe otherwise
    except ImportError:
        return
    probe = threading.Thread(target=_load_probe_kernel, args=(CppPythonBindingsCodeCache,),
                             name="tokenmill-kernel-probe", daemon=True)
    probe.start()
    for module in OUTPUT_CODE_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    probe.join()


def _load_probe_kernel(cache: Any) -> None:
    try:
        cache.load_pybinding(["float*"], PROBE_KERNEL)
    except Exception as error:  # noqa: BLE001 - inductor does the same work when the forward's kernels load
        log.debug("inductor's probe kernel did not load: %s", error)


def compile_cache_hits() -> int:
    """How many compiled graphs this process has taken from AOTAutograd's cache (torch's own counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["aot_autograd"].get("autograd_cache_hit", 0))


def inductor_unavailable_reason() -> str | None:
    """Why inductor cannot build compiled CPU code here (it calls ``CXX``, else g++), or None."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        return f"inductor needs a C++ compiler and {compiler} is not on PATH"
    return None
