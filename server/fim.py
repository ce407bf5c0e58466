"""Fill-in-the-middle prompts for code models: OpenAI's completions ``suffix`` and
llama.cpp's ``POST /infill``.

A code model trained for it (Qwen2.5-Coder, StarCoder, CodeLlama, DeepSeek-Coder,
...) writes the code between a prefix and a suffix when prompted
``<prefix marker> before <suffix marker> after <middle marker>``; the tokenizer
finds the markers (``models.tokenizer.FimTokens``, here through the tokenizer's
``fim_tokens``). ``/infill`` lays its prompt out as llama.cpp's server does
(``format_infill``): the repository's files of context first, then the prefix
(with the request's ``prompt`` after it), the suffix, the middle marker, each
trimmed to fit the context as llama.cpp trims them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server.engine_client import TokenizerLike
from server.errors import bad_request

# llama.cpp's separator between context chunks for a model without a file separator token.
_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"
# llama.cpp's batch size (n_batch), against which it trims the prefix and the suffix.
_LLAMACPP_BATCH = 2048


def fim_markers(tok: TokenizerLike, param: str) -> Any:
    """The tokenizer's ``FimTokens``; a 400 naming ``param`` for a model without them."""
    fim = getattr(tok, "fim_tokens", None)
    if fim is None:
        raise bad_request(f"{param} needs a code model with fill-in-the-middle tokens (<|fim_prefix|>, "
                          "<|fim_suffix|>, <|fim_middle|> or its family's); this model has none", param)
    return fim


def suffix_prompt(tok: TokenizerLike, prompt: list[int], suffix: str) -> list[int]:
    """OpenAI's completions ``prompt`` + ``suffix`` as a fill-in-the-middle prompt:
    ``[BOS] prefix-marker prompt suffix-marker suffix middle-marker``."""
    fim = fim_markers(tok, "suffix")
    bos = tok.encode("", add_special_tokens=True)  # [BOS] where the model adds one
    if bos and prompt[:1] == bos:
        prompt = prompt[1:]
    return [*bos, fim.prefix, *prompt, fim.suffix, *tok.encode(suffix, add_special_tokens=False), fim.middle]


def infill_prompt(tok: TokenizerLike, prefix: str, suffix: str, prompt: str,
                  extra: Sequence[tuple[str, str]], n_ctx: int, n_predict: int) -> list[int]:
    """llama.cpp's ``/infill`` prompt: ``extra`` is ``(filename, text)`` chunks of context.

    With the model's repository and file separator tokens the context reads
    ``<repo>myproject\\n <sep>name\\n text ... <sep>filename\\n`` (the last one opens
    the file being edited); without them the chunks' texts are joined by a snippet
    line. The prefix keeps its last tokens, at most 3/4 of a batch; the suffix its
    first, what is left of the batch's quarter; the context its last ones, what the
    context leaves past a batch and twice ``n_predict``. The batch is llama.cpp's
    2048 tokens, or half the context where that is less (so the answer has room).
    """
    fim = fim_markers(tok, "input_prefix")

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    context: list[int] = []
    if fim.repo is not None:
        context += [fim.repo, *encode("myproject\n")]
    for filename, text in extra:
        if fim.file_sep is not None:
            context += [fim.file_sep, *encode(filename + "\n")]
        else:
            context += encode(_CHUNK_SEPARATOR)
        context += encode(text)
    if fim.file_sep is not None:
        context += [fim.file_sep, *encode("filename\n")]

    batch = min(_LLAMACPP_BATCH, n_ctx // 2)
    before, after, asked = encode(prefix), encode(suffix), encode(prompt)
    before = before[len(before) - min(len(before), 3 * (batch // 4)):]
    after = after[:max(0, batch // 4 - (2 + len(asked)))]
    take = min(max(0, n_ctx - batch - 2 * n_predict), len(context))
    bos = tok.encode("", add_special_tokens=True)
    # llama.cpp's order: the context, then BOS (where the model adds one), then the markers.
    return [*context[len(context) - take:], *bos, fim.prefix, *before, *asked, fim.suffix, *after, fim.middle]
