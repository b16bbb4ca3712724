"""``layerzoo serve``: an OpenAI- and Anthropic-compatible HTTP server over `AsyncLLM`, with a chat page.

- `protocol`: the request bodies (pydantic models, validated with one error naming the field)
  and the builders of response bodies and stream chunks;
- `app`: the FastAPI application (routes, API key, errors, limits, streaming, disconnects, drain);
- `metrics`: the Prometheus metrics at ``/metrics``;
- `run`: uvicorn with a SIGTERM drain (in-flight requests finish, new ones get 503);
- `static/index.html`: the chat page served at ``/``.
"""
