"""Anthropic's Messages API (``/v1/messages``), as vLLM and llama.cpp serve it: a typed conversion
into the chat path, and Anthropic's response and stream shapes."""
