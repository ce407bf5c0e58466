"""kvserve HTTP layer: the OpenAI-compatible API, SSE streaming, errors, auth, metrics and CLI."""
