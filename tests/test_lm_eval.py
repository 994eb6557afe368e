"""EleutherAI's lm-evaluation-harness scores a tokenmill server (its ``local-completions`` model: token-id
prompts, ``echo`` with ``logprobs``) as it scores the same checkpoint run by transformers (its ``hf``
model): the same accuracy, the same loglikelihood for each choice, the same greedy answers. On a
small task written here (multiple choice and generation from local jsonl files: no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's `api` extra, which local-completions needs

MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " a small town in Peru"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five", " twenty-two"], "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "answer": 0},
    {"question": "Water freezes at", "choices": [" zero degrees", " one hundred degrees"], "answer": 0},
    {"question": "Once upon a time there was", "choices": [" a princess", " an integer overflow", " tea"], "answer": 1},
]
GENERATION = [{"question": "The capital of France is", "answer": " Paris"},
              {"question": "Once upon a time", "answer": " there was"}]


def task_yaml(name: str, data: Path, kind: str) -> str:
    """An lm-eval task over a local jsonl file (the ``json`` builder of ``datasets``: no hub)."""
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\noutput_type: {kind}\ndoc_to_text: '{{{{question}}}}'\n")


def write_tasks(folder: Path) -> list[str]:
    """Two lm-eval tasks over jsonl files in ``folder``: loglikelihood (multiple choice) and generate_until."""
    for name, rows in (("choice", MULTIPLE_CHOICE), ("generation", GENERATION)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "tiny_choice.yaml").write_text(
        task_yaml("tokenmill_tiny_choice", folder / "choice.jsonl", "multiple_choice")
        + "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "tiny_generation.yaml").write_text(
        task_yaml("tokenmill_tiny_generation", folder / "generation.jsonl", "generate_until")
        + "doc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
    return ["tokenmill_tiny_choice", "tokenmill_tiny_generation"]


def evaluate(model: str, model_args: str, folder: Path, tasks: list[str]) -> dict:
    from lm_eval.tasks import TaskManager

    tasks_here = TaskManager(include_path=str(folder), include_defaults=False)  # lm-eval's own thousands: not indexed
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, batch_size=1,
                                   task_manager=tasks_here, log_samples=True, bootstrap_iters=0, random_seed=0)


def offline(patch: pytest.MonkeyPatch) -> None:
    """No hub: the environment for what is imported later, the flags of what was imported already."""
    import datasets.config
    import huggingface_hub.constants

    patch.setenv("HF_DATASETS_OFFLINE", "1")
    patch.setenv("HF_HUB_OFFLINE", "1")
    for module in (datasets.config, huggingface_hub.constants):
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            if hasattr(module, name):
                patch.setattr(module, name, True)


def per_sample(results: dict, task: str) -> list:
    """Each document's filtered responses, by document id: (loglikelihood, is_greedy) per choice, or the text."""
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


pytestmark = pytest.mark.slow  # two servers and lm-eval's own hf run: the default run leaves it to CI's slow pass


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict]:
    """lm-eval's own run of the checkpoint through transformers, in float32 (once for both backends)."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    tasks = write_tasks(folder)
    with pytest.MonkeyPatch.context() as patch:
        offline(patch)
        results = evaluate("hf", f"pretrained={tiny_model_dir},dtype=float32,device=cpu", folder, tasks)
    return folder, tasks, results


def test_lm_eval_scores_the_server_as_it_scores_transformers(tiny_server, tiny_model_dir, reference, monkeypatch):
    folder, tasks, expected = reference
    offline(monkeypatch)
    served = evaluate("local-completions", f"model=tiny,base_url={tiny_server.url}/v1/completions,"
                      f"tokenizer={tiny_model_dir},tokenizer_backend=huggingface,max_retries=1,max_length=512",
                      folder, tasks)
    choice, generation = tasks
    assert served["results"][choice]["acc,none"] == expected["results"][choice]["acc,none"]
    got, want = per_sample(served, choice), per_sample(expected, choice)
    assert [len(doc) for doc in got] == [len(doc) for doc in want] == [len(row["choices"]) for row in MULTIPLE_CHOICE]
    for served_doc, expected_doc in zip(got, want):
        assert [ll for ll, _ in served_doc] == pytest.approx([ll for ll, _ in expected_doc], abs=1e-3)
        assert [greedy for _, greedy in served_doc] == [greedy for _, greedy in expected_doc]
    assert per_sample(served, generation) == per_sample(expected, generation)
    assert served["results"][generation]["exact_match,none"] == expected["results"][generation]["exact_match,none"]
