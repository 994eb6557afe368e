"""OpenAI's Responses API (``/v1/responses``): a typed conversion into the chat path, the Responses
shapes and stream events, and the bounded store that ``previous_response_id`` reads."""
