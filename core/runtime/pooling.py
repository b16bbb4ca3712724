"""Embeddings: pooling a prompt's final hidden states into one vector (``LLM.embed``, ``/v1/embeddings``).

A pooling request runs its prompt as a prefill only: no token is sampled, and the sequence ends
(finish reason ``pooled``) as soon as its last prompt row has run, giving its KV blocks back. The
hidden states pooled are the model's last ones, after its final norm and before the LM head (what
transformers' ``AutoModel(...).last_hidden_state`` holds):

- ``last``: the row of the prompt's last token (Qwen3-Embedding, E5-Mistral, GTE-Qwen: decoder
  embedders read the last token, which has attended to the whole prompt);
- ``mean``: the mean of every prompt row. A prompt split into chunks (chunked prefill) adds each
  chunk's row sum to `PooledState`, so the mean is the same however the prompt was split.

Then the vector is L2-normalised unless ``normalize=False``. Shapes follow vLLM: `LLM.embed`
returns an `EmbeddingRequestOutput` per prompt whose ``outputs.embedding`` is a ``list[float]``
of ``hidden_size`` values.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch

from layerzoo.errors import UserError

POOLING_METHODS = ("last", "mean")
# A model whose class names no pooling method is pooled this way (decoder embedders read the last token).
DEFAULT_POOLING = "last"


def _check_method(_instance, _attribute, value) -> None:
    if value not in POOLING_METHODS:
        raise UserError(f"pooling: expected one of {', '.join(map(repr, POOLING_METHODS))}, got {value!r:.60}")


def _check_normalize(_instance, _attribute, value) -> None:
    if not isinstance(value, bool):
        raise UserError(f"normalize: expected True or False, got {value!r:.60}")


@attrs.frozen
class PoolingParams:
    """How one prompt becomes an embedding: ``method`` (``"last"`` or ``"mean"``) and whether the
    vector is L2-normalised."""

    method: Literal["last", "mean"] = attrs.field(default=DEFAULT_POOLING, validator=_check_method)
    normalize: bool = attrs.field(default=True, validator=_check_normalize)


class PooledState:
    """A pooling sequence's running pool: fp32 on the CPU, filled by the engine after each step
    from the rows the model runner pooled (`Chunk.pool_rows`).

    ``num_rows`` counts the prompt positions ``0 .. num_rows - 1`` already added (mean), so a
    prompt recomputed after a preemption adds none of them twice; for ``last`` it is 1 once the
    last row was taken.
    """

    def __init__(self, params: PoolingParams):
        self.params = params
        self.num_rows = 0
        self.total: torch.Tensor | None = None  # [hidden] fp32: the row sum (mean) or the last row

    def add(self, num_rows: int, vector: torch.Tensor) -> None:
        """Add ``num_rows`` more rows: their sum ``vector [hidden]`` (mean) or the last row (last)."""
        if self.params.method == "last":
            self.num_rows, self.total = 1, vector
            return
        self.num_rows += num_rows
        self.total = vector if self.total is None else self.total + vector

    def embedding(self) -> list[float]:
        """The pooled vector (mean or last row), L2-normalised when asked, as ``hidden_size`` floats."""
        assert self.total is not None, "nothing pooled yet"
        vector = self.total / self.num_rows if self.params.method == "mean" else self.total
        if self.params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)  # x / max(||x||, 1e-12), as sentence-transformers
        return vector.tolist()


@attrs.define
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: the prompt's embedding, ``hidden_size`` floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@attrs.define
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput``: one prompt's embedding (``outputs.embedding``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool = True


def pooled_row_sums(hidden: torch.Tensor, rows: list[tuple[int, int, bool]]) -> list[tuple[int, torch.Tensor]]:
    """``hidden [T, H]`` → per ``(lo, hi, last)`` span: ``(hi - lo, vector [H] fp32 on the CPU)``,
    the span's row sum, or its row ``hi - 1`` when ``last``. Summed in fp32 whatever the model's dtype."""
    out = []
    for lo, hi, last in rows:
        vector = hidden[hi - 1].float() if last else hidden[lo:hi].float().sum(dim=0)
        out.append((hi - lo, vector.cpu()))
    return out
