"""Built-in tool-call parsers, one format per module (``--tool-call-parser``)."""
