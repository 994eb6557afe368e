"""Configuration: TGI's flags and defaults, environment variables, and one-line start-up errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from tokenmill.config import Config, ConfigError, parse_config


def test_tgi_defaults():
    config = parse_config([], env={})
    assert (config.max_concurrent_requests, config.max_best_of, config.max_stop_sequences,
            config.max_top_n_tokens, config.port, config.hostname) == (128, 2, 4, 5, 3000, "0.0.0.0")
    assert (config.backend, config.attention, config.scheduler, config.kv_allocator, config.block_size) == (
        "auto", None, "fifo", None, None), "attention, KV allocator and block size follow the backend"


def test_every_flag_reads_its_upper_snake_case_environment_variable():
    env = {"MAX_TOTAL_TOKENS": "900", "MAX_INPUT_TOKENS": "800", "JSON_OUTPUT": "true", "MODEL_ID": "/models/x",
           "MAX_BATCH_SIZE": "4", "BACKEND": "transformers", "PORT": "8080"}
    config = parse_config([], env=env)
    assert (config.max_total_tokens, config.max_input_tokens, config.json_output, config.model_id,
            config.max_batch_size, config.port) == (900, 800, True, "/models/x", 4, 8080)


def test_hostname_set_to_the_machine_name_is_not_a_bind_address():
    import socket

    assert parse_config([], env={"HOSTNAME": socket.gethostname()}).hostname == "0.0.0.0"
    assert parse_config([], env={"HOSTNAME": "127.0.0.1"}).hostname == "127.0.0.1"


def test_command_line_wins_over_the_environment():
    assert parse_config(["--port", "9000"], env={"PORT": "8080"}).port == 9000


def test_legacy_max_input_length_sets_max_input_tokens():
    assert parse_config(["--max-input-length", "100"], env={}).max_input_tokens == 100
    with pytest.raises(ConfigError, match="disagree"):
        parse_config(["--max-input-length", "100", "--max-input-tokens", "200"], env={})


@pytest.mark.parametrize("argv, message", [
    (["--max-input-tokens", "100", "--max-total-tokens", "100"],
     "--max-total-tokens (100) must be greater than --max-input-tokens (100)"),
    (["--backend", "transformers", "--max-input-tokens", "100", "--max-batch-prefill-tokens", "50"],
     "--max-batch-prefill-tokens (50) must be >= --max-input-tokens (100) for a backend that prefills whole prompts"),
    (["--max-total-tokens", "100", "--max-batch-total-tokens", "50"],
     "--max-batch-total-tokens (50) must be >= --max-total-tokens (100)"),
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests must be > 0"),
    (["--dtype", "int3"], "--dtype must be auto, float16, bfloat16 or float32"),
    (["--enable-profiling"], "--enable-profiling needs --api-key"),
    (["--api-key", " "], "--api-key is empty"),
    (["--prometheus-port", "3000"], "--prometheus-port (3000) must differ from --port"),
    (["--lora-adapters", "a=/x", "--num-shard", "2"], "LoRA adapters cannot shard yet"),
    (["--lora-cache-limit", "0"], "--lora-cache-limit must be >= 1"),
    (["--task", "translate"], "--task must be generate, embed or score"),
    (["--runner", "generate", "--task", "embed"], "--runner generate contradicts --task embed"),
    (["--task", "embed", "--num-shard", "2"], "--task embed cannot shard yet"),
    (["--task", "score", "--speculate", "2", "--reasoning-parser", "qwen3"],
     "--speculate, --reasoning-parser: only for --task generate (this server runs --task score)"),
])
def test_contradictions_fail(argv, message):
    with pytest.raises(ConfigError) as error:
        parse_config(argv, env={})
    assert message in str(error.value)


@pytest.mark.parametrize("argv, task, client_batch", [
    ([], "generate", 4),
    (["--task", "embedding"], "embed", 32),  # vLLM's name
    (["--task", "classify"], "score", 32),
    (["--runner", "pooling"], "pooling", 32),  # embed or score: the checkpoint's architecture settles it at load
    (["--task", "embed", "--max-client-batch-size", "100"], "embed", 100),
])
def test_the_task_and_its_default_client_batch(argv, task, client_batch):
    config = parse_config(argv, env={})
    assert (config.task, config.max_client_batch_size) == (task, client_batch)


def test_limits_follow_the_model_context_when_unset():
    config = Config()
    config = config.with_limits(model_max_positions=8192)
    assert (config.max_total_tokens, config.max_input_tokens, config.max_batch_prefill_tokens) == (4096, 4095, 4145)
    small = Config()
    small = small.with_limits(model_max_positions=512)
    assert (small.max_total_tokens, small.max_input_tokens) == (512, 511)
    assert small.max_batch_total_tokens >= small.max_total_tokens


def run_launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill", "launch", *args], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", **(env or {})})


@pytest.mark.parametrize("args, env, expected", [
    (["--max-input-tokens", "10", "--max-total-tokens", "5"], None, "must be greater than --max-input-tokens"),
    (["--backend", "warp-drive"], None, "unknown --backend 'warp-drive' (choices: auto, flash, paged, transformers)"),
    (["--backend", "flash"], None, "--backend flash is not available here: needs CUDA"),
    (["--backend", "paged", "--attention", "eager"], None,
     "--attention eager cannot serve the paged layout of --backend paged (choices: flash, sdpa)"),
    (["--backend", "paged", "--kv-allocator", "dynamic"], None, "--kv-allocator dynamic cannot serve the paged layout"),
    (["--backend", "transformers", "--attention", "flash"], None, "--attention flash is not available here"),
    (["--attention", "nope"], None, "unknown --attention 'nope' (choices: eager, flash, sdpa)"),
    (["--model-id", "/no/such/model"], None,
     "is not a local directory or .gguf file and is not in the local Hugging Face cache"),
    ([], {"MAX_TOTAL_TOKENS": "lots"}, "MAX_TOTAL_TOKENS='lots' is not a valid int"),
])
def test_launch_fails_at_start_with_one_clear_line(args, env, expected):
    result = run_launch(*args, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_backend_with_mixed_steps_admits_at_once_and_prefills_2048_tokens_a_step_on_cpu():
    config = Config(max_total_tokens=8192)
    config = config.with_limits(8192, mixed_steps=True, on_cpu=True)
    assert (config.max_batch_prefill_tokens, config.waiting_served_ratio) == (2048, 0.0)
    on_gpu = Config(max_total_tokens=8192)
    on_gpu = on_gpu.with_limits(8192, mixed_steps=True, on_cpu=False)
    assert (on_gpu.max_batch_prefill_tokens, on_gpu.waiting_served_ratio) == (8191 + 50, 0.0)


def test_a_backend_that_prefills_whole_prompts_keeps_tgi_s_rules():
    config = Config(max_total_tokens=8192)
    config = config.with_limits(8192, mixed_steps=False, on_cpu=True)
    assert (config.max_batch_prefill_tokens, config.waiting_served_ratio) == (8191 + 50, 0.3)


def test_settings_given_are_kept_and_only_whole_prompt_backends_need_a_budget_of_the_longest_prompt():
    config = parse_config(["--max-input-tokens", "100", "--max-batch-prefill-tokens", "50",
                           "--waiting-served-ratio", "1.2"], env={})
    config = config.with_limits(4096, mixed_steps=True, on_cpu=True)
    assert (config.max_batch_prefill_tokens, config.waiting_served_ratio) == (50, 1.2)
    with pytest.raises(ConfigError, match="for a backend that prefills whole prompts"):
        config = config.with_limits(4096, mixed_steps=False)


def test_a_config_is_frozen_and_settling_its_limits_makes_a_new_one():
    config = parse_config(["--max-total-tokens", "512"], env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_total_tokens = 1024  # type: ignore[misc]
    settled = config.with_limits(model_max_positions=2048, kv_tokens=8192)
    assert (config.max_input_tokens, config.max_batch_total_tokens) == (None, None)
    assert (settled.max_input_tokens, settled.max_batch_total_tokens) == (511, 8192)


def test_api_keys_come_comma_separated_and_from_a_key_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\n\n  third  \nfirst\n", encoding="utf-8")
    config = parse_config(["--api-key", "first, second", "--api-key-file", str(keys)], env={})
    assert config.api_keys == ("first", "second", "third")
    keys.unlink()
    assert config.api_keys == ("first", "second", "third"), "the key file is read once, not per request"
    assert config.priority_keys() is None
    assert parse_config([], env={}).api_keys == ()
    assert parse_config(["--api-key", "a,b", "--priority-header-keys", "b"], env={}).priority_keys() == ("b",)


@pytest.mark.parametrize("argv, message", [
    (["--api-key-file", "/nonexistent/keys"], "--api-key-file /nonexistent/keys: cannot be read"),
    (["--api-key", "a", "--priority-header-keys", "b"], "--priority-header-keys must list keys"),
])
def test_api_key_settings_that_cannot_work_fail_at_start(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv, env={})


def test_a_key_file_without_a_key_fails_at_start(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="holds no key"):
        parse_config(["--api-key-file", str(empty)], env={})
