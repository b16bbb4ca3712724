"""OpenAI's ``POST /v1/embeddings``: the request body, its inputs as engine prompts, and the answer.

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists (as
OpenAI takes it); each becomes one pooling request (`layerzoo.runtime.pooling`), all batched together.
``encoding_format`` ``"float"`` answers lists of floats, ``"base64"`` the float32 little-endian
bytes base64-encoded (what the ``openai`` client asks for by default and decodes). ``dimensions``
(Matryoshka truncation) is refused by name: embeddings have the model's hidden size. How the
hidden states are pooled is the server's choice (``layerzoo serve --pooling``), else the model's
(``Qwen3Model``: last token), not the request's.
"""

from __future__ import annotations

import base64
import struct
from typing import Literal

from pydantic import BaseModel, ConfigDict

from layerzoo.runtime.pooling import EmbeddingRequestOutput
from layerzoo.server.protocol import APIError

# OpenAI's own limit on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """The body of ``/v1/embeddings``; a field this server does not know is refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # carries no meaning here; accepted as OpenAI's SDKs send it

    def prompts(self) -> list[tuple[str, str | list[int]]]:
        """``(field, text or token ids)`` per input; an empty input is a 400 naming its place."""
        if self.dimensions is not None:
            raise APIError(400, "dimensions: not supported by this server (embeddings have the model's hidden size)",
                           param="dimensions")
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            items = [("input", given)]
        else:
            items = [(f"input.{i}", item) for i, item in enumerate(given)]
        if not items:
            raise APIError(400, "input: expected at least one string or token-id list, got an empty list", param="input")
        if len(items) > MAX_INPUTS:
            raise APIError(400, f"input: {len(items)} inputs is over the limit of {MAX_INPUTS}", param="input")
        for field, item in items:
            if not item:
                what = "an empty string" if isinstance(item, str) else "an empty token-id list"
                raise APIError(400, f"{field}: expected text or token ids to embed, got {what}", param=field)
        return items


def encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """One embedding as the answer carries it: floats, or base64 of its float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
    return embedding


def embeddings_response(outs: list[EmbeddingRequestOutput], encoding_format: str, model_name: str) -> dict:
    """OpenAI's answer: ``{object: "list", data: [{object: "embedding", index, embedding}], model, usage}``."""
    data = [
        {"object": "embedding", "index": i, "embedding": encoded(out.outputs.embedding, encoding_format)}
        for i, out in enumerate(outs)
    ]
    tokens = sum(len(out.prompt_token_ids) for out in outs)
    return {"object": "list", "data": data, "model": model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
