"""Embeddings, scores and rerank over HTTP (``--task embed`` and ``--task score``)."""
