"""Resolving a Hugging Face hub id to a local snapshot: list what the repository holds, fetch only
the files that loading reads, and tell how it goes.

``huggingface_hub`` does the transfer and keeps its cache layout (``models--org--name/snapshots/<commit>``
under ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, or ``--huggingface-hub-cache``), so a later start finds
the files with ``HF_HUB_OFFLINE=1``. It reads ``HF_TOKEN`` and ``HF_ENDPOINT`` itself. Every failure
becomes one :class:`HubError` line naming the repository, the endpoint and what to do about it.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOADING_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")
"""Configs, tokenizers (vocabularies, merges, sentencepiece and tiktoken files), chat templates and remote
code: small files that ``from_pretrained`` may read."""
BIN_WEIGHTS = ("pytorch_model*.bin", "model*.bin", "adapter_model.bin")
"""PyTorch pickles that are weights (not ``training_args.bin`` or optimizer states)."""
PROGRESS_EVERY_SECONDS = 5.0


class HubError(Exception):
    """A hub id could not be resolved to a local snapshot; the message is one line for the operator.
    ``unreachable``: the hub gave no answer at all (network down), rather than one that said no;
    ``reason``: the cause alone, for callers that phrase the rest themselves."""

    def __init__(self, message: str, unreachable: bool = False, reason: str = "") -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.reason = reason or message


@dataclass(frozen=True)
class Listing:
    """What a download will fetch: a repository's files at one commit, chosen for loading."""

    repo_id: str
    revision: str | None
    commit: str
    files: dict[str, int | None]
    """File name to size in bytes (None where the hub did not say)."""
    cache_dir: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(size or 0 for size in self.files.values())

    def describe(self) -> str:
        return f"{self.repo_id}@{self.commit[:12]}: {len(self.files)} files, {human_bytes(self.total_bytes)}"


def endpoint() -> str:
    """The hub's address: ``HF_ENDPOINT``, else huggingface.co (read when asked, as the hub client does)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def offline() -> bool:
    """``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``): only the local cache may be used."""
    from huggingface_hub import constants

    return constants.is_offline_mode()


def is_repo_id(name: str) -> bool:
    """Whether ``name`` can be a hub repository id (``org/name`` or ``name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def cached(repo_id: str, revision: str | None, cache_dir: str | None = None) -> Path:
    """The snapshot already in the local cache, without asking the hub (HubError when absent)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                      allow_patterns=cached_choice(repo_id, revision, cache_dir)))
    except Exception as error:  # noqa: BLE001 - the hub client raises many kinds here
        reason = f"{cache_dir or cache_root()}; {type(error).__name__}"
        raise HubError(f"{repo_id!r}{at(revision)} is not in the local Hugging Face cache ({reason})",
                       reason=reason) from None


def cached_choice(repo_id: str, revision: str | None, cache_dir: str | None) -> list[str] | None:
    """The files :func:`choose_files` takes from the repository listing that the last download cached,
    so that the cache counts as complete without the files that were never fetched; None (every file)
    without such a listing (an older hub client, or a snapshot put there by hand)."""
    try:
        from huggingface_hub import get_cached_repo_tree

        return choose_files([entry.path for entry in get_cached_repo_tree(repo_id, revision=revision,
                                                                          cache_dir=cache_dir)])
    except Exception:  # noqa: BLE001 - no cached listing: the hub client checks nothing either
        return None


def list_files(repo_id: str, revision: str | None, cache_dir: str | None = None,
               required: str = "config.json") -> Listing:
    """Ask the hub what ``repo_id`` holds at ``revision`` and choose what loading needs; ``required``
    names the file without which it is not what was asked for (a checkpoint's config.json, an
    adapter's adapter_config.json)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint()).model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as error:  # noqa: BLE001 - becomes one line below
        raise HubError(explain(repo_id, revision, error), unreachable(error)) from None
    sizes = {sibling.rfilename: sibling.size for sibling in info.siblings or []}
    if required not in sizes:
        raise HubError(f"{repo_id!r}{at(revision)} on {endpoint()} has no {required}: "
                       f"it is not a {'PEFT adapter' if required.startswith('adapter') else 'transformers checkpoint'}")
    chosen = choose_files(list(sizes))
    if not any(name.endswith((".safetensors", ".bin")) for name in chosen):
        weights = sorted(name for name in sizes if name.endswith((".gguf", ".pth", ".pt", ".onnx", ".h5", ".msgpack")))
        raise HubError(f"{repo_id!r}{at(revision)} on {endpoint()} holds no safetensors or PyTorch weights at its "
                       f"top level{' (only ' + ', '.join(weights[:3]) + ')' if weights else ''}")
    if not info.sha:
        raise HubError(f"{endpoint()} named no commit for {repo_id!r}{at(revision)}: is HF_ENDPOINT a Hugging Face "
                       "hub (or a mirror of one)?")
    return Listing(repo_id, revision, info.sha, {name: sizes[name] for name in chosen}, cache_dir)


def choose_files(names: list[str]) -> list[str]:
    """The files of a repository that loading reads: top-level configs, tokenizer files and weights,
    ``*.safetensors`` when there are any (else the ``*.bin`` weights), never both."""
    top = [name for name in names if "/" not in name]
    small = [name for name in top if name.endswith(LOADING_SUFFIXES)]
    safetensors = [name for name in top if name.endswith(".safetensors")]
    if any(name.startswith("model") for name in safetensors):  # Mistral-style repos also ship consolidated.*
        safetensors = [name for name in safetensors if not name.startswith("consolidated")]
    weights = safetensors or [name for name in top if any(fnmatch.fnmatch(name, pattern) for pattern in BIN_WEIGHTS)]
    if safetensors:  # a .bin index would only point at files that are not fetched
        small = [name for name in small if not name.endswith(".bin.index.json")]
    return sorted(small + weights)


def download(listing: Listing, report: Callable[[str], None] | None = None) -> Path:
    """Fetch the listed files into the cache (those already there are not fetched again) and return
    the snapshot directory; ``report`` hears progress lines (files done / total, bytes)."""
    from huggingface_hub import snapshot_download

    progress = Progress(listing, report or log.info)
    try:
        path = snapshot_download(listing.repo_id, revision=listing.revision, cache_dir=listing.cache_dir,
                                 allow_patterns=list(listing.files), endpoint=endpoint(),
                                 tqdm_class=progress.bar_class())  # type: ignore[arg-type]
    except Exception as error:  # noqa: BLE001 - becomes one line below
        raise HubError(explain(listing.repo_id, listing.revision, error), unreachable(error)) from None
    progress.finished()
    return Path(path)


def snapshot(repo_id: str, revision: str | None, cache_dir: str | None = None,
             required: str = "config.json", max_bytes: int | None = None) -> Path:
    """A local snapshot of ``repo_id``: from the cache only when offline, else listed and downloaded
    (or found in the cache when the hub cannot be reached). ``max_bytes``: the most the files to
    fetch may hold, as the hub lists them (a HubError, before any download, beyond)."""
    if offline():
        return cached(repo_id, revision, cache_dir)
    listing = list_or_none(repo_id, revision, cache_dir, required)
    if listing is None:
        return cached(repo_id, revision, cache_dir)
    if max_bytes is not None and listing.total_bytes > max_bytes:
        raise HubError(f"{repo_id!r}{at(revision)} holds {human_bytes(listing.total_bytes)} to download, more than "
                       f"the limit of {human_bytes(max_bytes)}")
    log.info("downloading %s", listing.describe())
    return download(listing)


def list_or_none(repo_id: str, revision: str | None, cache_dir: str | None = None,
                 required: str = "config.json") -> Listing | None:
    """:func:`list_files`, or None when the hub cannot be reached but the cache holds the snapshot
    (a start without network still works, as the hub client's own fallback does)."""
    try:
        return list_files(repo_id, revision, cache_dir, required)
    except HubError as error:
        if not error.unreachable:
            raise
        try:
            found = cached(repo_id, revision, cache_dir)
        except HubError:
            raise error from None
        log.warning("%s; using the cached snapshot %s", error, found)
        return None


def explain(repo_id: str, revision: str | None, error: Exception) -> str:
    """One line for a failed hub call: the repository, the endpoint and, for the usual causes, the fix."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"cannot download {repo_id!r}{at(revision)} from {endpoint()}"
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(error, GatedRepoError):
        cause = (f"the repository is gated (HTTP {status}): accept its conditions on the hub and set HF_TOKEN "
                 "to a token of an account that has access")
    elif isinstance(error, RevisionNotFoundError):
        cause = f"the repository has no revision {revision or 'main'!r} (HTTP {status}); check --revision"
    elif isinstance(error, RepositoryNotFoundError) or status in (401, 403):
        cause = (f"no such repository, or it is private or gated (HTTP {status}): check --model-id, and set "
                 "HF_TOKEN to a token with access if it is private or gated")
    elif isinstance(error, HfHubHTTPError):
        cause = f"the hub answered HTTP {status}: {first_line(error)}"
    elif isinstance(error, PermissionError):
        cause = (f"this user (uid {os.getuid()}) cannot write the hub cache ({error.filename or error}): make it "
                 "writable, or point HF_HOME or --huggingface-hub-cache elsewhere")
    elif isinstance(error, LocalEntryNotFoundError):
        cause = f"the hub could not be reached and the cache does not hold it ({first_line(error)})"
    elif unreachable(error):
        cause = (f"the hub could not be reached ({type(error).__name__}: {first_line(error)}); check the network, "
                 "or set HF_HUB_OFFLINE=1 to load from the local cache only")
    else:
        cause = f"{type(error).__name__}: {first_line(error)}"
    return f"{where}: {cause}"


def unreachable(error: Exception) -> bool:
    """Whether the hub gave no answer (refused connection, timeout, offline mode), rather than one that
    said no: only then may a cached snapshot stand in. The hub client's transport errors (httpx's) are
    recognised by their base class's name, which the httpx versions it has used all share."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(error, HfHubHTTPError):
        return False
    if isinstance(error, (OfflineModeIsEnabled, ConnectionError, TimeoutError)):
        return True
    return any(cls.__name__ == "TransportError" for cls in type(error).__mro__)


def first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2])[:300] or type(error).__name__


def at(revision: str | None) -> str:
    return f" (revision {revision})" if revision else ""


def cache_root() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


class Progress:
    """Gathers what ``snapshot_download``'s progress bars count (files done, bytes written) and reports
    it as a log line every few seconds: a server's log has no terminal for bars."""

    def __init__(self, listing: Listing, report: Callable[[str], None]) -> None:
        self.listing, self.report = listing, report
        self.files_done = 0
        self.bytes_done = 0
        self.lock = threading.Lock()
        self.last_report = time.monotonic()

    def counted(self, unit: str, count: float) -> None:
        """A bar counted ``count`` in all: files (unit ``it``) or bytes (unit ``B``)."""
        with self.lock:
            if unit == "B":
                self.bytes_done = max(self.bytes_done, int(count))
            else:
                self.files_done = max(self.files_done, int(count))
            due = time.monotonic() - self.last_report >= PROGRESS_EVERY_SECONDS
            if due:
                self.last_report = time.monotonic()
        if due:
            self.report(self.line())

    def line(self) -> str:
        total = self.listing.total_bytes
        return (f"downloading {self.listing.repo_id}: {self.files_done}/{len(self.listing.files)} files, "
                f"{human_bytes(min(self.bytes_done, total) if total else self.bytes_done)} of {human_bytes(total)}")

    def finished(self) -> None:
        with self.lock:
            self.files_done = len(self.listing.files)
            self.bytes_done = max(self.bytes_done, self.listing.total_bytes)
        self.report(self.line())

    def bar_class(self) -> type:
        """A class that ``snapshot_download`` takes for ``tqdm_class`` and that reports here."""
        return type("ProgressBar", (ProgressBar,), {"progress": self})


class ProgressBar:
    """What ``huggingface_hub`` calls on a progress bar, counting into :attr:`progress` and drawing nothing."""

    progress: Progress

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.unit = kwargs.get("unit", "it")
        self.total = kwargs.get("total")
        self.n = kwargs.get("initial") or 0
        self.desc = kwargs.get("desc", "")

    def update(self, n: float | None = 1) -> None:
        self.n += n or 0
        self.progress.counted(self.unit, self.n)

    @property
    def format_dict(self) -> dict[str, Any]:
        return {"n": self.n, "total": self.total, "rate": None, "unit": self.unit}

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    set_description_str = set_description

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass
