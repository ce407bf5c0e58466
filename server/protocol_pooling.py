"""The pooling request bodies: OpenAI's ``/v1/embeddings`` and, on it, vLLM's
``/v1/score`` and the rerank API (Jina's, Cohere's)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from engine.sampling_params import PoolingParams, SamplingParams
from server.errors import bad_request
from server.protocol import _Strict, _check_truncate, sampling_error


# Inputs in one embeddings request (OpenAI's limit): each becomes an engine request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings`` (OpenAI), with vLLM's ``add_special_tokens`` and ``normalize``."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored
    add_special_tokens: bool | None = True
    normalize: bool | None = True
    truncate_prompt_tokens: int | None = None  # vLLM's: each input's last N tokens
    priority: int | None = None  # vLLM's: lower is admitted first (--scheduling-policy priority)
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among requests of the same salt

    _truncate = field_validator("truncate_prompt_tokens")(_check_truncate)

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if not value or (isinstance(value, list) and any(isinstance(v, (str, list)) and not v for v in value)):
            raise ValueError("input must not be empty, nor hold an empty text or token list")
        if isinstance(value, list) and isinstance(value[0], (str, list)) and len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs are allowed in one request, "
                             f"got {len(value)}")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: each a text or a list of token ids."""
        value = self.input
        if isinstance(value, str) or isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        """An engine request that samples nothing and answers with its pooled hidden state."""
        try:
            pooling = PoolingParams(dimensions=self.dimensions, normalize=self.normalize is not False)
        except ValueError as e:
            raise bad_request(str(e), "dimensions") from None
        try:
            return SamplingParams.embedding(pooling, priority=self.priority or 0, cache_salt=self.cache_salt)
        except ValueError as e:
            raise sampling_error(e) from None


def _texts(value: str | list[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts or any(not t for t in texts):
        raise bad_request(f"{field} must be a text or a non-empty list of non-empty texts", field)
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"at most {MAX_EMBEDDING_INPUTS} texts are allowed in {field}, got {len(texts)}", field)
    return texts


class ScoreRequest(_Strict):
    """``POST /v1/score`` (vLLM's): the similarity of ``text_1`` to each of ``text_2``
    (one to one, one to many, or pairwise when both are lists of one length)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]

    def pairs(self) -> list[tuple[str, str]]:
        first, second = _texts(self.text_1, "text_1"), _texts(self.text_2, "text_2")
        if len(first) == 1:
            return [(first[0], t) for t in second]
        if len(first) != len(second):
            raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
                              "or as many as text_2", "text_2")
        return list(zip(first, second))


class RerankDocument(_Strict):
    """A document as an object (Cohere's and Jina's clients may send them so)."""

    text: str


class RerankRequest(_Strict):
    """``POST /v1/rerank`` (Jina's and Cohere's, as vLLM and llama.cpp take it): the
    documents by their relevance to the query, best first."""

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool | None = True

    def texts(self) -> list[str]:
        return _texts([d if isinstance(d, str) else d.text for d in self.documents], "documents")
