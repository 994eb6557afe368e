"""Hardening: no fault in a step, a scheduler or a client leaves a request without an answer, a slot
or a KV block taken, or a broken server pretending to be healthy.

The faults come from the plugin package ``tests/packages/tokenmill-faults``, pip-installed once into
a venv over this interpreter's packages: ``--attention faulty`` (the built-in ``sdpa`` until told to
raise, hang or slow down) and ``--scheduler faulty-fifo`` (``fifo`` whose queue methods raise on
demand), both steered by the JSON control file named by ``$TOKENMILL_FAULTS`` (see the package's
README); ``GET /faults`` says what was injected, so that every test checks its fault really fired.
Every server is a real process on loopback, on the tiny random Llama; every client has a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningServer, overlay_venv, start_server

from tokenmill.config import parse_config

FAULTS_PACKAGE = Path(__file__).resolve().parent / "packages" / "tokenmill-faults"

ANSWER_SECONDS = 30.0
"""The longest any request of these tests may take to be answered: longer means it hangs."""


# ---- the fault-injection plugins and their servers ---------------------------------------------------


class Faults:
    """The control file of one server's tokenmill-faults plugins. Each :meth:`set` writes a new
    version (atomically, with a ``_version`` of its own), which starts the plugin's counts afresh."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._versions = itertools.count()
        self.set()

    def set(self, **settings: Any) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps({**settings, "_version": next(self._versions)}))
        os.replace(temporary, self.path)

    def clear(self) -> None:
        self.set()


@dataclass
class FaultyServer:
    """A server running the tokenmill-faults plugins, and their control file."""

    server: RunningServer
    faults: Faults

    @property
    def url(self) -> str:
        return self.server.url

    def report(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/faults", timeout=10).json()

    def used(self, key: str) -> int:
        """How often the fault ``key`` fired since the control file was last written."""
        return self.report()["used"].get(key, 0)

    def stop(self) -> None:
        stop_process(self.server)


def stop_process(server: RunningServer) -> None:
    """End the server however it is (its whole group, when it has one of its own)."""
    process = server.process
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    try:  # gunicorn's worker, in the server's own session, must not outlive the test
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="module")
def faults_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv over this interpreter's packages with tokenmill-faults pip-installed (from a copy, so that
    the build leaves nothing in the source tree)."""
    python = overlay_venv(tmp_path_factory.mktemp("faults-venv"))
    source = tmp_path_factory.mktemp("faults-source") / "tokenmill-faults"
    shutil.copytree(FAULTS_PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(source)], check=True,
                   capture_output=True)
    return python


def start_faulty(python: Path, model_dir: Path, tmp_path: Path, args: list[str], server: str = "uvicorn",
                 new_session: bool = False) -> FaultyServer:
    """A paged server with ``--attention faulty --scheduler faulty-fifo``, healthy and fault-free."""
    faults = Faults(tmp_path / "faults.json")
    env = {"TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "0", "TOKENMILL_PLUGINS": "faults",
           "TOKENMILL_FAULTS": str(faults.path)}
    running = start_server(["--model-id", str(model_dir), "--server", server, "--backend", "paged",
                            "--attention", "faulty", "--scheduler", "faulty-fifo", *args],
                           tmp_path, env=env, python=str(python), new_session=new_session)
    return FaultyServer(running, faults)


@pytest.fixture
def own_server(faults_python: Path, tiny_model_dir: Path, tmp_path: Path
               ) -> Iterator[Callable[..., FaultyServer]]:
    """Start a server of the test's own (one it may break or stop); it is ended after the test."""
    started: list[FaultyServer] = []

    def start(*args: str, server: str = "uvicorn", new_session: bool = False) -> FaultyServer:
        running = start_faulty(faults_python, tiny_model_dir, tmp_path, list(args), server, new_session)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture(scope="module")
def shared_server(faults_python: Path, tiny_model_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultyServer]:
    """The server the tests that leave it healthy share: 4 concurrent requests, 2 sequences a step."""
    running = start_faulty(faults_python, tiny_model_dir, tmp_path_factory.mktemp("shared"),
                           ["--max-concurrent-requests", "4", "--max-batch-size", "2"])
    yield running
    running.stop()


@pytest.fixture
def shared(shared_server: FaultyServer) -> Iterator[FaultyServer]:
    """The shared server, without faults before and after the test, and checked to be healthy after it."""
    shared_server.faults.clear()
    yield shared_server
    shared_server.faults.clear()
    assert shared_server.server.process.poll() is None, shared_server.server.log()[-3000:]


@pytest.fixture(scope="module")
def streams_server(faults_python: Path, tiny_model_dir: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultyServer]:
    """A server for many streams and slow readers: 64 concurrent requests, streams that pause once 4
    tokens wait unsent, and end after 2 s paused so; up to 100 top tokens a token, for big events."""
    running = start_faulty(faults_python, tiny_model_dir, tmp_path_factory.mktemp("streams"),
                           ["--max-concurrent-requests", "64", "--stream-buffer-tokens", "4",
                            "--stream-idle-timeout", "2", "--max-top-n-tokens", "100"])
    yield running
    running.stop()


@pytest.fixture
def streams(streams_server: FaultyServer) -> Iterator[FaultyServer]:
    streams_server.faults.clear()
    yield streams_server
    streams_server.faults.clear()


# ---- clients ------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    body: Any


def is_error_answer(answer: Answer) -> bool:
    """TGI's error: a non-200 status with ``{"error": str, "error_type": str}``."""
    body = answer.body
    return (answer.status != 200 and isinstance(body, dict) and isinstance(body.get("error"), str)
            and isinstance(body.get("error_type"), str))


def post(url: str, path: str, body: dict[str, Any], timeout: float = ANSWER_SECONDS) -> Answer:
    """POST ``body`` and read the whole answer; an AssertionError when none comes in ``timeout``."""
    try:
        response = httpx.post(f"{url}{path}", json=body, timeout=timeout)
    except httpx.TimeoutException:
        raise AssertionError(f"POST {path} got no answer in {timeout}s: the request hangs") from None
    try:
        parsed = response.json()
    except ValueError:
        parsed = response.text
    return Answer(response.status_code, parsed)


def generate(url: str, inputs: str = "Hello there", max_new_tokens: int = 8, timeout: float = ANSWER_SECONDS,
             **parameters: Any) -> Answer:
    return post(url, "/generate", {"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, **parameters}},
                timeout)


@dataclass
class StreamResult:
    """How one streamed request ended."""

    status: int
    events: list[Any] = field(default_factory=list)
    """The ``data:`` payloads, parsed (``"[DONE]"`` as it is)."""
    body: Any = None
    """The error body of a stream refused before it started (non-200)."""
    cut: str | None = None
    """Set when the connection broke before the stream ended (what broke)."""
    first_event: threading.Event = field(default_factory=threading.Event)
    times: list[float] = field(default_factory=list)
    """When each event came (monotonic)."""

    @property
    def tokens(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and "token" in e)

    @property
    def last(self) -> Any:
        return self.events[-1] if self.events else None

    def ended_with_error(self) -> bool:
        """Answered with an error: a refused stream's error body, or a stream whose last event is an error."""
        if self.status != 200:
            return is_error_answer(Answer(self.status, self.body))
        last = [e for e in self.events if e != "[DONE]"][-1:] or [None]
        return self.cut is None and isinstance(last[0], dict) and "error" in last[0] and "error_type" in last[0]

    def ended_normally(self) -> bool:
        """A TGI stream's last event carries ``generated_text``."""
        return (self.status == 200 and self.cut is None and isinstance(self.last, dict)
                and isinstance(self.last.get("generated_text"), str))


def read_stream(url: str, body: dict[str, Any], path: str = "/generate_stream", timeout: float = ANSWER_SECONDS,
                result: StreamResult | None = None) -> StreamResult:
    """Stream to the end (at most ``timeout`` seconds in all, else an AssertionError: it hangs)."""
    result = result or StreamResult(0)
    deadline = time.monotonic() + timeout
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=10)) as client, \
                client.stream("POST", f"{url}{path}", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                response.read()
                try:
                    result.body = response.json()
                except ValueError:
                    result.body = response.text
                return result
            for line in response.iter_lines():
                if time.monotonic() > deadline:
                    raise AssertionError(f"the stream did not end in {timeout}s ({result.tokens} tokens)")
                if line.startswith("data:"):
                    data = line[5:].strip()
                    result.events.append(data if data == "[DONE]" else json.loads(data))
                    result.times.append(time.monotonic())
                    result.first_event.set()
    except httpx.TimeoutException:
        raise AssertionError(f"the stream stalled: nothing for {timeout}s after {result.tokens} tokens") from None
    except httpx.HTTPError as error:  # the connection broke: no end event
        result.cut = f"{type(error).__name__}: {error}"
    finally:
        result.first_event.set()  # waiters wake whatever happened
    return result


def stream_body(inputs: str, max_new_tokens: int, **parameters: Any) -> dict[str, Any]:
    return {"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, **parameters}}


def in_parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def info(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/info", timeout=10).json()


def health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).status_code


def settled(url: str, timeout: float = 10.0) -> bool:
    """Nothing waits or runs and no KV block is held (a paged server), within ``timeout``."""
    def quiet() -> bool:
        now = info(url)
        return now["queue_size"] == 0 and now["batch_size"] == 0 and (now["kv"] or {}).get("blocks_used", 0) == 0

    return wait_until(quiet, timeout)


def assert_serves_every_slot(url: str, slots: int, max_new_tokens: int = 4) -> None:
    """``slots`` parallel requests (``--max-concurrent-requests`` of them) all get 200: no slot leaked."""
    answers = in_parallel([lambda i=i: generate(url, f"Slot {i}", max_new_tokens) for i in range(slots)])
    assert [a.status for a in answers] == [200] * slots, answers
    assert health(url) == 200


class HealthWatch:
    """Polls /health in the background: what it answered, in order, until the server is gone."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[int | str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status: int | str = httpx.get(f"{self.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                status = "down"
            if not self.seen or self.seen[-1] != status:
                self.seen.append(status)
            time.sleep(0.05)

    def stop(self) -> list[int | str]:
        self._stop.set()
        self._thread.join(5)
        return self.seen


def exit_status(server: RunningServer, timeout: float) -> int | None:
    """The server's exit status, waiting up to ``timeout`` seconds; None when it still runs."""
    try:
        return server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


# ---- settings ----------------------------------------------------------------------------------------


def test_the_hardening_settings_have_their_defaults_and_environment_variables() -> None:
    defaults = parse_config([], env={})
    assert (defaults.max_failed_steps, defaults.step_timeout, defaults.stream_idle_timeout) == (5, 600, 300)
    from_env = parse_config([], env={"MAX_FAILED_STEPS": "2", "STEP_TIMEOUT": "7.5", "STREAM_IDLE_TIMEOUT": "9"})
    assert (from_env.max_failed_steps, from_env.step_timeout, from_env.stream_idle_timeout) == (2, 7.5, 9)
    flags = parse_config(["--max-failed-steps", "3", "--step-timeout", "4", "--stream-idle-timeout", "6"], env={})
    assert (flags.max_failed_steps, flags.step_timeout, flags.stream_idle_timeout) == (3, 4, 6)


# ---- failed engine steps ---------------------------------------------------------------------------------


def test_one_failed_step_fails_only_its_requests_with_424_and_the_server_serves_on(shared: FaultyServer) -> None:
    shared.faults.set(**{"raise": 1})
    failed = generate(shared.url, "Hello there", 8)
    assert failed.status == 424 and is_error_answer(failed), failed
    assert failed.body["error_type"] == "generation", failed
    assert shared.used("raise") == 1
    assert generate(shared.url, "Hello there", 8).status == 200
    assert health(shared.url) == 200
    assert settled(shared.url)


def test_failed_steps_that_are_not_consecutive_never_break_the_engine(shared: FaultyServer) -> None:
    """Four failed steps, a good one, four more (the default --max-failed-steps is 5): still healthy.
    A request that fails alone in its step is followed by the engine's probe step, which draws a fault
    too: eight faults make four requests fail in four counted failed steps."""
    for _ in range(2):
        shared.faults.set(**{"raise": 8})
        failed = [generate(shared.url, f"Failing {i}", 4) for i in range(4)]
        assert [a.status for a in failed] == [424] * 4, failed
        assert generate(shared.url, "Hello there", 4).status == 200
    assert health(shared.url) == 200 and info(shared.url)["ready"]


def test_a_fault_pinned_to_one_prompt_length_fails_that_request_and_no_other(shared: FaultyServer) -> None:
    """(Checks the faulty kernel's pinning, which later tests rely on.)"""
    tokens = httpx.post(f"{shared.url}/tokenize", json={"inputs": "one two three four five six seven"},
                        timeout=10).json()
    shared.faults.set(raise_if_prompt_len=len(tokens))
    assert generate(shared.url, "Hi", 8).status == 200
    pinned = generate(shared.url, "one two three four five six seven", 8)
    assert pinned.status == 424 and is_error_answer(pinned), pinned
    assert generate(shared.url, "Hi", 8).status == 200
    assert shared.used("raise") == 1 and health(shared.url) == 200


@pytest.mark.slow  # a server of its own that ends: minutes of the default run
def test_consecutive_failed_steps_break_the_engine_every_request_gets_an_error_and_the_process_exits_3(
        own_server: Callable[..., FaultyServer]) -> None:
    """--max-failed-steps 3 with one sequence a step: the first three requests fail in their own steps,
    which breaks the engine; the requests still waiting, whole or streamed, get an error too."""
    faulty = own_server("--max-failed-steps", "3", "--max-batch-size", "1", "--max-concurrent-requests", "16")
    watch = HealthWatch(faulty.url)
    faulty.faults.set(**{"raise": -1})
    whole = [lambda i=i: generate(faulty.url, f"Request {i}", 16) for i in range(5)]
    streamed = [lambda i=i: read_stream(faulty.url, stream_body(f"Stream {i}", 16)) for i in range(3)]
    results = in_parallel(whole + streamed)
    answers, streams = results[:5], results[5:]
    for answer in answers:
        assert is_error_answer(answer), answer
    for stream in streams:
        assert stream.ended_with_error(), stream
    status = exit_status(faulty.server, 10)
    seen = watch.stop()
    assert status == 3, f"exit status {status}; /health said {seen}\n{faulty.server.log()[-3000:]}"
    assert 503 in seen, seen
    assert 200 not in seen[seen.index(503):], seen  # once broken, never healthy again


@pytest.mark.slow  # a server of its own that ends: minutes of the default run
def test_a_step_longer_than_step_timeout_breaks_the_engine_answers_its_waiters_and_exits(
        own_server: Callable[..., FaultyServer]) -> None:
    faulty = own_server("--step-timeout", "3")
    watch = HealthWatch(faulty.url)
    faulty.faults.set(hang=60)
    hung_at = time.monotonic()
    answer, stream = in_parallel([lambda: generate(faulty.url, "Hello there", 16, timeout=20),
                                  lambda: read_stream(faulty.url, stream_body("Hi", 16), timeout=20)])
    answered = time.monotonic() - hung_at
    assert is_error_answer(answer), answer
    assert stream.ended_with_error(), stream
    assert answered < 12, f"the waiters were answered {answered:.1f}s after the step hung (--step-timeout 3)"
    status = exit_status(faulty.server, max(1.0, 12 - (time.monotonic() - hung_at)))
    seen = watch.stop()
    assert status not in (None, 0), f"exit status {status}; /health said {seen}\n{faulty.server.log()[-3000:]}"
    assert 503 in seen, seen


# ---- scheduler faults ------------------------------------------------------------------------------------


def test_admit_failing_after_taking_sequences_answers_them_serves_the_next_and_leaks_no_slot(
        shared: FaultyServer) -> None:
    shared.faults.set(admit_raise_after_take=1)
    answers = in_parallel([lambda i=i: generate(shared.url, f"Taken {i}", 16) for i in range(3)])
    assert shared.used("admit_raise_after_take") == 1
    assert all(a.status == 200 or is_error_answer(a) for a in answers), answers
    assert any(is_error_answer(a) for a in answers), answers  # those it took were told
    assert generate(shared.url, "Next", 8).status == 200
    assert_serves_every_slot(shared.url, 4)
    assert settled(shared.url)


def test_admit_failing_before_taking_anything_leaves_no_request_unanswered(shared: FaultyServer) -> None:
    shared.faults.set(admit_raise=1)
    answers = in_parallel([lambda i=i: generate(shared.url, f"Waiting {i}", 16) for i in range(3)])
    assert shared.used("admit_raise") == 1
    assert all(a.status == 200 or is_error_answer(a) for a in answers), answers
    assert_serves_every_slot(shared.url, 4)
    assert settled(shared.url)


def test_preempt_failing_leaves_no_request_unanswered(shared: FaultyServer) -> None:
    """preempt is asked while sequences run and others wait: three requests, two sequences a step."""
    shared.faults.set(preempt_raise=1)
    answers = in_parallel([lambda i=i: generate(shared.url, f"Preempted {i}", 32) for i in range(3)])
    assert shared.used("preempt_raise") == 1
    assert all(a.status == 200 or is_error_answer(a) for a in answers), answers
    assert_serves_every_slot(shared.url, 4)
    assert settled(shared.url)


@pytest.mark.parametrize("how", ["preempt", "suspend"])
def test_requeue_failing_for_a_sequence_set_aside_leaves_no_request_unanswered(shared: FaultyServer,
                                                                               how: str) -> None:
    """The scheduler sets the latest running sequence aside (KV freed, or kept: suspended), and putting
    it back in the queue fails: its request is answered all the same."""
    shared.faults.set(**{how: 1, "requeue_raise": 1})
    answers = in_parallel([lambda i=i: generate(shared.url, f"Requeued {i}", 32) for i in range(3)])
    assert shared.used(how) == 1 and shared.used("requeue_raise") == 1
    assert all(a.status == 200 or is_error_answer(a) for a in answers), answers
    assert_serves_every_slot(shared.url, 4)
    assert settled(shared.url)


def test_drain_failing_at_shutdown_still_ends_every_request_with_an_answer(
        own_server: Callable[..., FaultyServer]) -> None:
    """SIGTERM with two streams running and two waiting (two sequences a step), 1 s of grace, and the
    scheduler's drain raising: every stream still ends with its error event."""
    faulty = own_server("--graceful-termination-timeout", "1", "--max-batch-size", "2")
    faulty.faults.set(slow=0.01, drain_raise=-1)  # a step takes 20 ms: 1500 tokens would take 30 s
    results = [StreamResult(0) for _ in range(4)]
    threads = [threading.Thread(target=read_stream, args=(faulty.url, stream_body(f"Drained {i}", 1500)),
                                kwargs={"timeout": 40, "result": result}, daemon=True)
               for i, result in enumerate(results)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)  # in order: the first two run, the last two wait
    assert results[0].first_event.wait(20) and results[1].first_event.wait(20)
    faulty.server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(25)
    assert not any(thread.is_alive() for thread in threads), [r.tokens for r in results]
    for result in results:
        assert result.ended_with_error() or result.ended_normally(), (result.status, result.cut, result.last)
    assert exit_status(faulty.server, 20) is not None
    assert "injecting drain_raise" in faulty.server.log()  # the fault did fire


# ---- n and best_of ---------------------------------------------------------------------------------------


def test_when_one_sibling_of_best_of_fails_the_whole_request_is_answered_with_an_error_promptly(
        shared: FaultyServer) -> None:
    """best_of=2 of 1500 tokens (a step takes over 10 ms: 15 s at least), one sibling failing at its
    fourth token: the request's error comes in seconds, and the other sibling is not left running."""
    shared.faults.set(processor_raise=1, processor_after_tokens=3, slow=0.005)
    started = time.monotonic()
    answer = generate(shared.url, "Hello there", 1500, best_of=2, do_sample=True)
    elapsed = time.monotonic() - started
    assert is_error_answer(answer), answer
    assert elapsed < 6, f"answered after {elapsed:.1f}s"
    assert shared.used("processor_raise") == 1
    assert settled(shared.url, 5)


def test_when_one_choice_of_an_n_stream_fails_the_stream_ends_with_an_error_promptly(shared: FaultyServer) -> None:
    shared.faults.set(processor_raise=1, processor_after_tokens=3, slow=0.005)
    started = time.monotonic()
    result = read_stream(shared.url, {"model": "tiny", "prompt": "Hello there", "max_tokens": 1500, "n": 2,
                                      "temperature": 1.0, "stream": True}, path="/v1/completions")
    elapsed = time.monotonic() - started
    assert result.status == 200 and result.cut is None, result
    assert isinstance(result.last, dict) and "error" in result.last, result.events[-3:]
    assert "[DONE]" not in result.events
    assert elapsed < 6, f"ended after {elapsed:.1f}s"
    assert shared.used("processor_raise") == 1
    assert settled(shared.url, 5)


# ---- overload ------------------------------------------------------------------------------------------


def test_a_flood_far_above_max_concurrent_requests_gets_only_200s_and_429s(shared: FaultyServer) -> None:
    """100 requests at once against --max-concurrent-requests 4: never a 5xx, never a broken connection."""
    async def flood() -> list[httpx.Response | BaseException]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=shared.url, timeout=ANSWER_SECONDS, limits=limits) as client:
            calls = [client.post("/generate", json={"inputs": f"Flood {i}", "parameters": {"max_new_tokens": 16}})
                     for i in range(100)]
            return await asyncio.gather(*calls, return_exceptions=True)

    answers = asyncio.run(flood())
    broken = [a for a in answers if isinstance(a, BaseException)]
    assert not broken, broken[:3]
    statuses = [a.status_code for a in answers if isinstance(a, httpx.Response)]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert 200 in statuses and 429 in statuses, statuses
    for answer in answers:
        if isinstance(answer, httpx.Response) and answer.status_code == 429:
            body = answer.json()
            assert body["error_type"] == "overloaded" and isinstance(body["error"], str), body
    assert_serves_every_slot(shared.url, 4)


# ---- clients that leave or stop reading -------------------------------------------------------------------


def open_raw_stream(url: str, body: dict[str, Any], small_buffers: bool = False) -> socket.socket:
    """A /generate_stream request on a plain socket. ``small_buffers``: a 4 KiB receive buffer and
    536-byte segments, which keep the server's side of the connection from buffering megabytes (on
    loopback its send buffer grows with the 64 KiB segment size), so that a client that stops reading
    fills the path to it in some hundred kilobytes."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if small_buffers:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(ANSWER_SECONDS)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /generate_stream HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_events(sock: socket.socket, count: int) -> bytes:
    """Read until ``count`` stream events arrived (or the stream ended)."""
    received = b""
    while received.count(b"data:") < count:
        chunk = sock.recv(4096)
        if not chunk:
            break
        received += chunk
    return received


def kv_blocks_used(url: str) -> int:
    return info(url)["kv"]["blocks_used"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_a_storm_of_dropped_streams_frees_every_kv_block_and_the_server_serves_on(streams: FaultyServer) -> None:
    """40 streams on --backend paged, each dropped after its third event, half of them with a TCP reset."""
    streams.faults.set(slow=0.002)  # 1900 tokens take several seconds: every stream is dropped mid-way
    sockets = [open_raw_stream(streams.url, stream_body(f"Storm {i} " * (1 + i % 5), 1900)) for i in range(40)]
    try:
        for sock in sockets:
            assert read_events(sock, 3).count(b"data:") >= 3
        assert kv_blocks_used(streams.url) > 0  # the storm holds KV memory
    finally:
        for index, sock in enumerate(sockets):
            if index % 2:  # close with a reset, as a crashed client or a proxy does
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()
    streams.faults.clear()
    assert wait_until(lambda: kv_blocks_used(streams.url) == 0, 10), info(streams.url)["kv"]
    assert metric(streams.url, "tokenmill_kv_blocks_used") == 0
    assert settled(streams.url)
    assert health(streams.url) == 200
    assert generate(streams.url, "Hello there", 8).status == 200


def test_a_stream_whose_client_stops_reading_is_ended_after_stream_idle_timeout_and_its_kv_freed(
        streams: FaultyServer) -> None:
    """--stream-buffer-tokens 4, --stream-idle-timeout 2: the client reads the first event, then nothing,
    its socket open. Once the buffers between are full (small ones: some dozens of events of 100 top tokens)
    the sequence pauses, and 2 s later it is ended and its KV blocks freed, long before its 2000 tokens."""
    sock = open_raw_stream(streams.url, stream_body("Hello there", 2000, top_n_tokens=100), small_buffers=True)
    try:
        first = read_events(sock, 1)
        assert b"data:" in first, first

        def paused() -> bool:
            running = httpx.get(f"{streams.url}/queue", timeout=10).json()["running"]
            return any(entry["state"] == "paused" for entry in running)

        assert wait_until(paused, 60), httpx.get(f"{streams.url}/queue", timeout=10).json()
        paused_at = time.monotonic()
        assert kv_blocks_used(streams.url) > 0
        time.sleep(1.0)
        assert paused(), "ended before --stream-idle-timeout"
        assert wait_until(lambda: kv_blocks_used(streams.url) == 0, 8), httpx.get(f"{streams.url}/queue").json()
        assert time.monotonic() - paused_at >= 1.5
        assert settled(streams.url)
        rest = b""
        sock.settimeout(10)
        try:  # what it had sent, to the response's end: its last chunk, or the connection closed
            while not rest.endswith(b"\r\n0\r\n\r\n") and (chunk := sock.recv(1 << 20)):
                rest += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError("the ended stream's response never ended") from None
        assert (first + rest).count(b'"token"') < 2000  # ended, not finished
    finally:
        sock.close()
    assert health(streams.url) == 200
    assert generate(streams.url, "Hello there", 8).status == 200


# ---- SIGTERM -----------------------------------------------------------------------------------------------


def open_streams(url: str, count: int, max_new_tokens: int, timeout: float) -> tuple[list[StreamResult],
                                                                                     list[threading.Thread]]:
    results = [StreamResult(0) for _ in range(count)]
    threads = [threading.Thread(target=read_stream, args=(url, stream_body(f"Stream {i}", max_new_tokens)),
                                kwargs={"timeout": timeout, "result": result}, daemon=True)
               for i, result in enumerate(results)]
    for thread in threads:
        thread.start()
    for result in results:
        assert result.first_event.wait(30) and result.events, (result.status, result.body, result.cut)
    return results, threads


@pytest.mark.slow  # a server of its own that ends: minutes of the default run
def test_sigterm_to_the_process_group_lets_gunicorn_streams_finish_and_exits_0(
        own_server: Callable[..., FaultyServer]) -> None:
    """One SIGTERM to gunicorn's whole process group (its master and worker both get it, as from a
    terminal or `kill -TERM -pgid`) drains: the 4 streams in flight run to their end."""
    faulty = own_server(server="gunicorn", new_session=True)
    faulty.faults.set(slow=0.005)  # a step takes over 10 ms: 150 tokens, 1.5 s at least
    results, threads = open_streams(faulty.url, 4, 150, 60)
    assert not any(result.ended_normally() for result in results)
    os.killpg(faulty.server.process.pid, signal.SIGTERM)
    signalled = time.monotonic()
    for thread in threads:
        thread.join(60)
    for result in results:
        assert result.ended_normally(), (result.status, result.cut, result.last)
        assert result.tokens == 150 and result.times[-1] > signalled  # in flight at the SIGTERM, and finished
    status = exit_status(faulty.server, 30)
    assert status == 0, f"exit status {status}\n{faulty.server.log()[-3000:]}"


@pytest.mark.slow
def test_a_second_sigterm_ends_the_streams_in_flight_at_once(own_server: Callable[..., FaultyServer]) -> None:
    """Streams that would take half a minute: after the first SIGTERM they go on (draining); a second
    one, seconds later, ends each of them with an error event at once."""
    faulty = own_server(server="gunicorn", new_session=True)
    faulty.faults.set(slow=0.01)  # 1500 tokens: over 30 s
    results, threads = open_streams(faulty.url, 4, 1500, 60)
    group = faulty.server.process.pid
    os.killpg(group, signal.SIGTERM)
    first = time.monotonic()
    time.sleep(3)
    for result in results:
        assert not result.ended_normally() and result.cut is None and not result.ended_with_error(), result.last
        assert result.times and result.times[-1] > first + 1, "the stream stopped after the first SIGTERM"
    os.killpg(group, signal.SIGTERM)
    second = time.monotonic()
    for thread in threads:
        thread.join(10)
    ended = time.monotonic() - second
    assert not any(thread.is_alive() for thread in threads)
    for result in results:
        assert result.ended_with_error(), (result.status, result.cut, result.last)
        assert result.tokens < 1500
    assert ended < 8, f"the streams ended {ended:.1f}s after the second SIGTERM"
    assert exit_status(faulty.server, 30) is not None
