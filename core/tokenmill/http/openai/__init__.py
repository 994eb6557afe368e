"""OpenAI's API over the engine: the request and response shapes (``schemas``), their conversion into
TGI's parameters (``convert``), chat templates and tools (``chat``), reading outputs with the tool-call
and reasoning parsers (``reading``), response bodies and stream chunks (``shapes``) and the routes
(``routes``)."""
