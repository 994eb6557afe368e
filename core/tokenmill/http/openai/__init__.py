"""OpenAI's API over the engine: the request and response shapes (``schemas``), their conversion into
TGI's parameters (``convert``), chat templates and tools (``chat``, ``toolcalls``), response bodies and
stream chunks (``shapes``) and the routes (``routes``)."""
