"""Tensor parallelism: ``--num-shard 2`` over gloo gives the tokens of one shard, holds half the sliced
weights per rank, and ends cleanly whether it is stopped or a shard dies."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from conftest import free_port, start_server
from engine_helpers import PROMPTS

from tokenmill.model.sharding import ShardingError, even_split, plan_slice


def smollm2_like():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       intermediate_size=1536, num_hidden_layers=2, vocab_size=100)


def test_attention_splits_by_whole_kv_groups_and_the_first_ranks_take_the_remainder():
    assert [even_split(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    first, second = plan_slice(smollm2_like(), 0, 2), plan_slice(smollm2_like(), 1, 2)
    assert (first.kv_heads, first.heads, first.intermediate) == ((0, 2), (0, 6), (0, 768))
    assert (second.kv_heads, second.heads, second.intermediate) == ((2, 3), (6, 9), (768, 1536))


def test_more_shards_than_kv_heads_are_refused_with_the_numbers():
    with pytest.raises(ShardingError, match="3 KV heads \\(9 attention heads\\), fewer than the 4 shards"):
        plan_slice(smollm2_like(), 0, 4)


def shard_args(model_dir: Path) -> list[str]:
    """In float32: the shards' tokens must equal one process's, and a bfloat16 forward rounds its partial
    sums at other points when they are all-reduced."""
    return ["--model-id", str(model_dir), "--server", "uvicorn", "--max-total-tokens", "512",
            "--master-port", str(free_port()), "--dtype", "float32"]


def greedy(server, prompts: list[str], tokens: int = 10) -> list[str]:
    """The greedy texts of ``prompts``, all sent at once."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: str) -> str:
        with server.client() as client:
            return client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": tokens}}).json()[
                "generated_text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def shard_processes(server) -> list[psutil.Process]:
    return psutil.Process(server.process.pid).children(recursive=True)


@pytest.mark.parametrize("backend", [pytest.param("transformers", marks=pytest.mark.slow), "paged"])
def test_two_shards_give_the_greedy_tokens_of_one_through_both_backends(backend, tiny_model_dir, tmp_path):
    outputs = {}
    for shards in ("1", "2"):
        server = start_server([*shard_args(tiny_model_dir), "--backend", backend, "--num-shard", shards], tmp_path)
        try:
            outputs[shards] = greedy(server, PROMPTS)  # eight at once: they share batches and join running ones
            with server.client() as client:
                info = client.get("/info").json()
        finally:
            server.stop()
    assert outputs["2"] == outputs["1"]
    assert info["num_shard"] == 2 and info["backend"] == backend
    assert "shard 0 of 2" in " ".join(s["detail"] for s in info["load_stages"])


@pytest.mark.slow
def test_two_shards_share_cached_prefixes_and_give_the_tokens_of_one_shard_without_a_cache(tiny_model_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from test_prefix_cache import QUESTIONS, SYSTEM

    prompts = [SYSTEM + question for question in QUESTIONS]

    def complete(server, prompt: str) -> tuple[str, int]:
        with server.client() as client:
            answer = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 10,
                                                          "temperature": 0}).json()
        return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    runs = {}
    for shards, caching in (("1", "0"), ("2", "1")):
        server = start_server([*shard_args(tiny_model_dir), "--backend", "paged", "--num-shard", shards], tmp_path,
                              env={"PREFIX_CACHING": caching})
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:  # at once: they share the new prefix in one step
                runs[shards] = list(pool.map(lambda prompt, server=server: complete(server, prompt), prompts))
            runs[shards] += [complete(server, prompt) for prompt in prompts]  # then from the cache
        finally:
            server.stop()
    assert [text for text, _ in runs["2"]] == [text for text, _ in runs["1"]]
    assert all(cached == 0 for _, cached in runs["1"])
    assert all(cached > 0 for _, cached in runs["2"][len(prompts):])


@pytest.mark.slow
def test_each_rank_holds_about_half_of_the_sliced_weights(tiny_model_dir):
    import torch.multiprocessing as mp

    port = free_port()
    results = mp.Manager().dict()
    mp.spawn(_weights_of_rank, args=(tiny_model_dir, port, results), nprocs=2, join=True)
    from tokenmill.model.loading import load_model

    full = load_model(str(tiny_model_dir), None, "float32", "sdpa").model
    sliced = sum(m.weight.numel() for n, m in full.named_modules()
                 if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))
    for rank in (0, 1):
        assert results[rank] == pytest.approx(sliced / 2, rel=0.01)


def _weights_of_rank(rank: int, model_dir: Path, port: int, results) -> None:
    from transformers import AutoConfig

    from tokenmill.model.sharding import init_group, load_sharded

    init_group(rank, 2, "127.0.0.1", port, torch.device("cpu"))
    config = AutoConfig.from_pretrained(model_dir)
    model = load_sharded(model_dir, plan_slice(config, rank, 2), config, torch.float32, torch.device("cpu"), "sdpa")
    results[rank] = sum(m.weight.numel() for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))
    torch.distributed.destroy_process_group()


def test_quantizers_are_refused_when_sharded(tiny_model_dir):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "tokenmill", "launch", "--model-id", str(tiny_model_dir),
                             "--num-shard", "2", "--quantize", "int8"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--quantize int8 cannot shard yet" in result.stderr


@pytest.mark.slow
def test_a_shard_that_dies_ends_the_server_with_a_clear_line_and_no_orphans(tiny_model_dir, tmp_path):
    server = start_server([*shard_args(tiny_model_dir), "--num-shard", "2"], tmp_path)
    try:
        (shard,) = shard_processes(server)
        shard.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 15
        statuses = []
        while server.process.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(f"{server.url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert server.process.poll() == 3, server.log()
        assert 503 in statuses
        assert "shard 1 of 2 exited with status -9; the server stops" in server.log()
        assert not psutil.pid_exists(shard.pid) or shard.status() == psutil.STATUS_ZOMBIE
    finally:
        server.stop()


@pytest.mark.slow
def test_sigterm_stops_every_shard(tiny_model_dir, tmp_path):
    server = start_server([*shard_args(tiny_model_dir), "--num-shard", "2"], tmp_path)
    shards = shard_processes(server)
    assert len(shards) == 1
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    gone, alive = psutil.wait_procs(shards, timeout=15)
    assert not alive


@pytest.mark.slow
def test_smollm2_over_two_shards_answers_as_one_shard_does_through_both_backends(tmp_path):
    from transformers import AutoTokenizer

    from tokenmill.model.loading import DEFAULT_MODEL_FILE, default_gguf

    gguf = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
               for q in ("What is the capital of France?", "Name three colours.", "Count to five.")]
    # float32, as in shard_args: two shards must give one shard's tokens. (The torchrun test below serves the
    # default dtype, bfloat16 on a CPU with native bf16, over two shards.)
    args = ["--server", "uvicorn", "--max-total-tokens", "1024", "--master-port", str(free_port()),
            "--dtype", "float32"]
    expected = []
    for shards, backend in (("1", "paged"), ("2", "paged"), ("2", "transformers")):
        server = start_server([*args, "--num-shard", shards, "--backend", backend], tmp_path)
        try:
            expected.append(greedy(server, prompts, 20))
        finally:
            server.stop()
    assert expected[0] == expected[1] == expected[2] and "Paris" in expected[0][0]


@pytest.mark.slow
def test_ranks_started_by_torchrun_find_each_other_through_its_environment(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    port = free_port()
    env = {**os.environ, "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    other = subprocess.Popen([sys.executable, "-m", "tokenmill", "launch", "--model-id", str(tiny_model_dir)],
                             env={**env, "RANK": "1"})
    try:
        server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "512"],
                              tmp_path, env={k: v for k, v in env.items() if k != "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD"}
                              | {"RANK": "0"})
        try:
            assert shard_processes(server) == []  # torchrun started rank 1, not rank 0
            with server.client() as client:
                assert client.get("/info").json()["num_shard"] == 2
            assert len(greedy(server, PROMPTS[:2])) == 2
        finally:
            server.stop()
        assert other.wait(30) == 0  # rank 0 told it to stop
    finally:
        other.kill()
