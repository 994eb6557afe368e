"""Embeddings, scores and rerank (``--task embed`` / ``--task score``): the routes answer what the
model computes, as sentence-transformers would pool it, through the clients and shapes users bring
(the openai client, TEI's, Cohere's and vLLM's bodies), within the server's limits."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from conftest import RunningServer, start_server

WORDS = ("the cat sat on mat dog ran in park a bird flew over house red blue green tree sky sun rain "
         "paris france capital city is of what weather today").split()


def bert_tokenizer(target: Path):
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz"]
    (target / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(target / "vocab.txt"))
    tokenizer.save_pretrained(target)
    return tokenizer


def bert_config(**extra):
    from transformers import BertConfig

    return BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=128, **extra)


@pytest.fixture(scope="module")
def st_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random sentence-transformers checkpoint: BERT, mean pooling, normalized; trained (it says)
    for 8 and 16 dimensions."""
    from transformers import BertModel

    target = tmp_path_factory.mktemp("st-bert")
    torch.manual_seed(0)
    BertModel(bert_config(matryoshka_dimensions=[8, 16])).save_pretrained(target)
    bert_tokenizer(target)
    (target / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    return target


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random cross-encoder: BertForSequenceClassification with one label."""
    from transformers import BertForSequenceClassification

    target = tmp_path_factory.mktemp("cross-encoder")
    torch.manual_seed(1)
    BertForSequenceClassification(bert_config(num_labels=1)).save_pretrained(target)
    bert_tokenizer(target)
    return target


def serve(args: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(["--server", "uvicorn", "--dtype", "float32", *args], tmp_path_factory.mktemp("server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def embed_server(st_bert_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from serve(["--model-id", str(st_bert_dir), "--task", "embed", "--max-client-batch-size", "8"],
                     tmp_path_factory)


@pytest.fixture(scope="module")
def score_server(cross_encoder_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from serve(["--model-id", str(cross_encoder_dir), "--runner", "pooling"], tmp_path_factory)


def mean_pooled(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """What sentence-transformers computes for the checkpoint: mean over the tokens, normalized."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()
    rows = []
    for text in texts:
        encoded = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**encoded).last_hidden_state[0]
        rows.append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=0))
    return torch.stack(rows)


def cross_scores(model_dir: Path, query: str, documents: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(**tokenizer([query] * len(documents), documents, return_tensors="pt", padding=True)).logits
    return torch.sigmoid(logits[:, 0]).tolist()


def openai_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


TEXTS = ["the cat sat on the mat", "a bird flew over the house", "what is the capital of france"]


class TestEmbeddings:
    def test_the_openai_client_gets_the_mean_pooled_normalized_embeddings(self, embed_server, st_bert_dir):
        # the openai client asks for base64 unless told otherwise, and decodes it
        result = openai_client(embed_server).embeddings.create(model="any", input=TEXTS)
        got = torch.tensor([item.embedding for item in result.data])
        assert [item.index for item in result.data] == [0, 1, 2]
        torch.testing.assert_close(got, mean_pooled(st_bert_dir, TEXTS), atol=1e-5, rtol=1e-4)
        assert result.usage.prompt_tokens == result.usage.total_tokens > 3 * 4

    def test_float_and_base64_forms_agree(self, embed_server):
        with embed_server.client() as client:
            floats = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"}).json()
            packed = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
        assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
        np.testing.assert_allclose(decoded, floats["data"][0]["embedding"], rtol=1e-6)

    def test_token_ids_are_embedded_as_given(self, embed_server, st_bert_dir):
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(st_bert_dir)(TEXTS[1])["input_ids"]
        client = openai_client(embed_server)
        by_ids = client.embeddings.create(model="any", input=[ids], encoding_format="float").data[0].embedding
        by_text = client.embeddings.create(model="any", input=TEXTS[1], encoding_format="float").data[0].embedding
        np.testing.assert_allclose(by_ids, by_text, atol=1e-6)

    def test_dimensions_cut_and_normalize_where_the_model_was_trained_for_them(self, embed_server):
        client = openai_client(embed_server)
        full = np.array(client.embeddings.create(model="any", input=TEXTS[0]).data[0].embedding)
        cut = np.array(client.embeddings.create(model="any", input=TEXTS[0], dimensions=8).data[0].embedding)
        assert len(full) == 32 and len(cut) == 8
        np.testing.assert_allclose(cut, full[:8] / np.linalg.norm(full[:8]), atol=1e-5)
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            client.embeddings.create(model="any", input=TEXTS[0], dimensions=5)
        assert "dimensions" in refused.value.body  # the client unwraps {"error": ...}

    def test_concurrent_requests_batched_together_get_their_own_answers(self, embed_server, st_bert_dir):
        texts = [" ".join(WORDS[: 2 + i * 3]) for i in range(8)]  # different lengths: padded in a shared batch
        with ThreadPoolExecutor(8) as pool, embed_server.client() as client:
            answers = list(pool.map(lambda text: client.post("/v1/embeddings", json={
                "input": text, "encoding_format": "float"}).json()["data"][0]["embedding"], texts))
        torch.testing.assert_close(torch.tensor(answers), mean_pooled(st_bert_dir, texts), atol=1e-5, rtol=1e-4)

    def test_tei_embed_answers_a_list_of_vectors(self, embed_server):
        with embed_server.client() as client:
            vectors = client.post("/embed", json={"inputs": TEXTS[:2]}).json()
            raw = client.post("/embed", json={"inputs": TEXTS[0], "normalize": False}).json()
        assert len(vectors) == 2 and all(len(vector) == 32 for vector in vectors)
        assert np.linalg.norm(vectors[0]) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(np.array(raw[0]) / np.linalg.norm(raw[0]), vectors[0], atol=1e-5)

    def test_score_and_rerank_compare_embeddings_by_cosine(self, embed_server, st_bert_dir):
        query, documents = TEXTS[0], TEXTS[1:] + ["the cat sat on a mat"]
        rows = mean_pooled(st_bert_dir, [query, *documents])
        cosines = [float(rows[0] @ row) for row in rows[1:]]
        with embed_server.client() as client:
            scores = client.post("/score", json={"text_1": query, "text_2": documents}).json()
            ranked = client.post("/v1/rerank", json={"query": query, "documents": documents, "top_n": 2}).json()
        assert [item["score"] for item in scores["data"]] == pytest.approx(cosines, abs=1e-5)
        best = sorted(range(3), key=lambda i: cosines[i], reverse=True)[:2]
        assert [item["index"] for item in ranked["results"]] == best
        assert ranked["results"][0]["document"] == {"text": documents[best[0]]}

    def test_limits_and_bad_inputs_are_422_with_tgi_body(self, embed_server):
        too_long = " ".join(["cat"] * 200)  # the model has 128 positions
        with embed_server.client() as client:
            for body, words in [({"input": [TEXTS[0]] * 9}, "--max-client-batch-size"),
                                ({"input": too_long}, "at most"),
                                ({"input": ""}, "empty"),
                                ({"input": []}, "non-empty"),
                                ({"input": [[10**6]]}, "outside"),
                                ({"input": TEXTS[0], "encoding_format": "int8"}, "encoding_format")]:
                answer = client.post("/v1/embeddings", json=body)
                assert answer.status_code == 422, body
                assert answer.json()["error_type"] == "validation" and words in answer.json()["error"]
            cut = client.post("/embed", json={"inputs": too_long, "truncate": True})
            last = client.post("/v1/embeddings", json={"input": too_long, "truncate_prompt_tokens": 16})
        assert cut.status_code == 200 and last.status_code == 200

    def test_info_says_the_task_and_generation_routes_are_404(self, embed_server):
        with embed_server.client() as client:
            info = client.get("/info").json()
            generate = client.post("/generate", json={"inputs": "hi"})
            classify = client.post("/classify", json={"input": "hi"})
            metrics = client.get("/metrics").text
        assert info["task"] == "embed" and info["model_pipeline_tag"] == "feature-extraction" and info["ready"]
        assert generate.status_code == 404 and "--task generate" in generate.json()["error"]
        assert classify.status_code == 404 and "--task score" in classify.json()["error"]
        assert 'tgi_batch_inference_success{method="embed"}' in metrics


    def test_sagemaker_invocations_and_tokenize_serve_an_embedding_server(self, embed_server):
        with embed_server.client() as client:
            tei = client.post("/invocations", json={"inputs": [TEXTS[0]]})
            oai = client.post("/invocations", json={"input": TEXTS[0], "encoding_format": "float"})
            tokens = client.post("/tokenize", json={"prompt": TEXTS[0]})
            models = client.get("/v1/models").json()
        assert tei.status_code == 200 and oai.status_code == 200
        np.testing.assert_allclose(tei.json()[0], oai.json()["data"][0]["embedding"], atol=1e-6)
        assert tokens.status_code == 200 and tokens.json()["count"] == len(TEXTS[0].split()) + 2  # [CLS] ... [SEP]
        assert tokens.json()["max_model_len"] == 128
        assert len(models["data"]) == 1


class TestCrossEncoder:
    QUERY = "what is the capital of france"
    DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "a bird flew over paris"]

    def test_rerank_orders_documents_by_the_cross_encoders_score(self, score_server, cross_encoder_dir):
        expected = cross_scores(cross_encoder_dir, self.QUERY, self.DOCUMENTS)
        with score_server.client() as client:
            ranked = client.post("/v1/rerank", json={"model": "m", "query": self.QUERY,
                                                     "documents": [{"text": d} for d in self.DOCUMENTS]}).json()
        order = sorted(range(3), key=lambda i: expected[i], reverse=True)
        assert [item["index"] for item in ranked["results"]] == order
        assert [item["relevance_score"] for item in ranked["results"]] == pytest.approx(
            [expected[i] for i in order], abs=1e-5)
        assert ranked["id"].startswith("rerank-") and ranked["usage"]["total_tokens"] > 0

    def test_tei_rerank_and_vllm_score_shapes(self, score_server, cross_encoder_dir):
        expected = cross_scores(cross_encoder_dir, self.QUERY, self.DOCUMENTS)
        with score_server.client() as client:
            tei = client.post("/rerank", json={"query": self.QUERY, "texts": self.DOCUMENTS, "return_text": True})
            scores = client.post("/score", json={"text_1": self.QUERY, "text_2": self.DOCUMENTS}).json()
            pairwise = client.post("/score", json={"text_1": [self.QUERY] * 2, "text_2": self.DOCUMENTS[:2]}).json()
            mismatched = client.post("/score", json={"text_1": ["a", "b"], "text_2": self.DOCUMENTS})
        assert {item["index"]: item["score"] for item in tei.json()} == pytest.approx(dict(enumerate(expected)))
        assert tei.json()[0]["text"] == self.DOCUMENTS[tei.json()[0]["index"]]
        assert [item["score"] for item in scores["data"]] == pytest.approx(expected, abs=1e-5)
        assert [item["score"] for item in pairwise["data"]] == pytest.approx(expected[:2], abs=1e-5)
        assert mismatched.status_code == 422 and "text_1" in mismatched.json()["error"]

    def test_pairs_too_long_are_422_or_cut_in_the_document_when_asked(self, score_server):
        long_query, long_document = " ".join(["paris"] * 200), " ".join(["cat"] * 200)  # 128 positions
        with score_server.client() as client:
            refused = client.post("/v1/rerank", json={"query": "paris", "documents": [long_document]})
            cut = client.post("/v1/rerank", json={"query": "paris", "documents": [long_document],
                                                  "truncate_prompt_tokens": 100})
            query_too_long = client.post("/rerank", json={"query": long_query, "texts": ["cat"], "truncate": True})
        assert refused.status_code == 422 and "at most 127 tokens" in refused.json()["error"]
        assert cut.status_code == 200 and cut.json()["usage"]["total_tokens"] == 100
        assert query_too_long.status_code == 422 and query_too_long.json()["error_type"] == "validation"

    def test_classify_gives_labels_and_probabilities(self, score_server):
        with score_server.client() as client:
            answer = client.post("/classify", json={"input": ["the cat", "the dog"]}).json()
            embeddings = client.post("/v1/embeddings", json={"input": "the cat"})
            info = client.get("/info").json()
        assert [item["num_classes"] for item in answer["data"]] == [1, 1]
        assert all(0 <= item["probs"][0] <= 1 and item["label"] == "LABEL_0" for item in answer["data"])
        assert info["task"] == "score"  # settled from the architecture by --runner pooling
        assert embeddings.status_code == 404


def test_a_generation_server_answers_embedding_routes_with_404(tiny_server):
    with tiny_server.client() as client:
        answer = client.post("/v1/embeddings", json={"input": "hello"})
    assert answer.status_code == 404 and "--task embed" in answer.json()["error"]


def test_smollm2_embeds_on_its_last_token(tmp_path_factory):
    """SmolLM2 (the default model) as a causal embedding model: the last token's hidden state, normalized."""
    from transformers import AutoModel, AutoTokenizer

    from tokenmill.model.loading import converted_gguf, default_gguf

    path = converted_gguf(default_gguf())
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, dtype=torch.float32)
    expected = []
    for text in TEXTS[:2]:
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0, -1]
        expected.append(torch.nn.functional.normalize(hidden, dim=0))
    server_iter = serve(["--task", "embed"], tmp_path_factory)
    server = next(server_iter)
    try:
        result = openai_client(server).embeddings.create(model="any", input=TEXTS[:2])
    finally:
        server.stop()
    torch.testing.assert_close(torch.tensor([item.embedding for item in result.data]), torch.stack(expected),
                               atol=2e-4, rtol=1e-3)


class TestPoolingEngine:
    """The engine itself, on the tiny BERT: batching, callers that leave, inputs that fail."""

    @pytest.fixture
    def engine(self, st_bert_dir):
        from tokenmill.engine.pooling import PoolingEngine
        from tokenmill.model.loading import Stages
        from tokenmill.model.pooling import load_pooling_model

        model = load_pooling_model(str(st_bert_dir), None, "float32", "embed", False, Stages())
        engine = PoolingEngine(model, max_batch_tokens=64, max_batch_size=None, max_failed_steps=3)
        yield engine
        engine.stop()

    def test_one_failing_input_fails_alone(self, engine):
        from tokenmill.engine.pooling import Pooled

        inputs = [Pooled([2, 5, 6, 3]), Pooled([2, 10**6, 3]), Pooled([2, 7, 3])]  # an id beyond the embeddings
        engine.run_now(inputs)
        assert inputs[0].answer.result().shape == (32,) and inputs[2].answer.result().shape == (32,)
        with pytest.raises(RuntimeError, match="failed on this input"):
            inputs[1].answer.result()
        assert engine.healthy

    def test_inputs_failing_step_after_step_break_the_engine(self, engine):
        from tokenmill.engine.pooling import Pooled

        told = []
        engine.broken_observer = told.append
        for _ in range(3):
            engine.run_now([Pooled([10**6])])
        assert not engine.healthy and told == ["3 pooling steps failed in a row"]
        with pytest.raises(RuntimeError):
            engine.submit([Pooled([2, 3])])

    def test_a_step_takes_the_oldest_input_and_those_of_nearest_length_that_fit_skipping_callers_that_left(
            self, engine):
        from tokenmill.engine.pooling import Pooled

        left, oldest, like = Pooled([2, 5, 3]), Pooled([2, 5, 3]), Pooled([2, 6, 3])
        long_ = Pooled([2] + [5] * 40 + [3])
        left.answer.cancel()
        engine._waiting.extend([left, oldest, long_, like])
        assert engine._next_batch() == [oldest, like]  # the long one would pad them all to 42 positions (> 64)
        assert engine._next_batch() == [long_]
        assert engine.queue_size == 0
