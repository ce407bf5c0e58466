"""Tokenizer parity with Hugging Face transformers (the reference) on SmolLM2's GGUF.

What differs from the reference, and why: transformers' GGUF converter ignores
``tokenizer.ggml.pre = smollm`` and splits text with the plain GPT-2 regex. The
real SmolLM2 tokenizer (its tokenizer.json, and llama.cpp for "smollm") first
isolates every numeric character (``Digits(individual_digits=True)``), and so
do we. The vocabulary has no token joining a digit to anything else, so the two
only disagree where the digit split moves a word boundary: several spaces before
a numeral ("x =  1") and a space before a non-ASCII numeral (" ½"). Texts with
those are compared to SmolLM2's original pipeline instead (the reference's
vocabulary and merges with the original pre-tokenizer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import tokenizers
from tokenizers import pre_tokenizers

from models.gguf_reader import read_gguf
from models.tokenizer import Tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "你好，世界！今天天气很好。",
    "こんにちは、世界。カタカナとひらがな。",
    "emoji 🤗🚀 and a family 👨‍👩‍👧 done",
    "def f(x):\n    if x:\n        return x\n\treturn None\n",
    "Numbers: 12345, 3.14159 and 1,000,000 (2024)",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
    "\n\nnew\nlines\n\n\n",
    "I'm sure they'LL say it's DONE",
    "",
]
# Where the real SmolLM2 pre-tokenizer and transformers' GGUF converter disagree (see module doc).
DIGIT_SPLIT_TEXTS = ["x =  1", "a   42", "half: ½, squared: ²", "    1. indented list"]
SPECIAL_TEXTS = {"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"}


@pytest.fixture(scope="module")
def ours(gguf_tokenizer) -> Tokenizer:
    return gguf_tokenizer


@pytest.fixture(scope="module")
def reference(reference_tokenizer):
    return reference_tokenizer


@pytest.fixture(scope="module")
def original(reference) -> tokenizers.Tokenizer:
    """The reference's vocabulary with SmolLM2's original tokenizer.json pre-tokenizer."""
    backend = tokenizers.Tokenizer.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_reference(ours, reference, text):
    assert ours.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS + DIGIT_SPLIT_TEXTS)
def test_encode_equals_original_smollm2_pipeline(ours, original, text):
    assert ours.encode(text) == original.encode(text).ids


def test_digits_are_isolated_unlike_transformers_gguf_converter(ours, reference):
    ids = ours.encode("x =  1")
    assert [ours.id_to_token(i) for i in ids] == ["x", "Ġ=", "ĠĠ", "1"]
    assert reference.convert_ids_to_tokens(reference.encode("x =  1")) == ["x", "Ġ=", "Ġ", "Ġ", "1"]
    assert ours.decode(ids) == reference.decode(reference.encode("x =  1")) == "x =  1"


@pytest.mark.parametrize("text", TEXTS + DIGIT_SPLIT_TEXTS)
def test_decode_inverts_encode(ours, text):
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    if text not in SPECIAL_TEXTS:
        assert ours.decode(ours.encode(text)) == text


def test_special_tokens_stay_whole_and_are_skipped_on_decode(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "user\nhi"


def test_special_ids_match_gguf_metadata(ours, reference):
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == [reference.eos_token_id] == [2]
    # All 17 CONTROL tokens (<|endoftext|> .. <empty_output>) are special, not only bos/eos/unk.
    assert ours.all_special_ids == set(range(17)) >= set(reference.all_special_ids)
    assert ours.vocab_size == len(reference) == 49152
    assert ours.chat_template == reference.chat_template


def test_no_bos_added_because_the_gguf_says_add_bos_token_false(ours):
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)


def test_id_to_token(ours, reference):
    for token_id in (0, 2, 216, 10000, 49151):
        assert ours.id_to_token(token_id) == reference.convert_ids_to_tokens(token_id)
    assert ours.id_to_token(49152) is None


def test_decode_rejects_ids_outside_vocabulary(ours):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([5, 49152])


# --- Hugging Face directory ---------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(reference, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2_hf")
    reference.save_pretrained(path)
    return path


def test_from_hf_dir_matches_reference(hf_dir, reference):
    # The saved tokenizer.json carries the converter's plain GPT-2 pre-tokenizer, so all texts agree.
    loaded = Tokenizer.from_hf_dir(hf_dir)
    for text in TEXTS + DIGIT_SPLIT_TEXTS:
        assert loaded.encode(text) == reference.encode(text)
    assert (loaded.bos_token_id, loaded.eos_token_ids) == (1, [2])
    assert loaded.chat_template == reference.chat_template


def test_from_hf_dir_reads_generation_config_and_add_bos_flag(hf_dir, tmp_path):
    shutil.copytree(hf_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.eos_token_ids == [2, 0]
    assert loaded.encode("hi") == [1, *loaded.encode("hi", add_special_tokens=False)]
    assert Tokenizer.from_hf_dir(tmp_path, generation_config={"eos_token_id": 0}).eos_token_ids == [2, 0]


def test_from_hf_dir_without_tokenizer_json_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# --- Other GGUF tokenizer kinds, from tiny files written here ----------------

BYTE_CHARS = pre_tokenizers.ByteLevel.alphabet()


def write_gguf(path: Path, model: str, tokens: list[str], types: list[int], **fields) -> dict[str, Any]:
    """Write a tokenizer-only GGUF file with the gguf package; its metadata as kvserve reads it."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "pre" in fields:
        writer.add_tokenizer_pre(fields["pre"])
    if "merges" in fields:
        writer.add_token_merges(fields["merges"])
    if "scores" in fields:
        writer.add_token_scores(fields["scores"])
    for key, token_id in zip(("fim_pre", "fim_suf", "fim_mid"), fields.get("fim", ())):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
    writer.add_bos_token_id(fields.get("bos", 0))
    writer.add_eos_token_id(fields.get("eos", 0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(path).fields


def byte_level_gguf(path: Path, pre: str) -> tuple[dict[str, Any], dict]:
    merges = ["1 2", "12 3", "4 5", "Ġ Ġ", "ĠĠ Ġ", "Ġ 1", "a b", "ab c", "Ġ a"]
    tokens = ["<|end|>", *sorted(BYTE_CHARS), *(m.replace(" ", "") for m in merges)]
    types = [3] + [1] * (len(tokens) - 1)
    fields = {"tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "tokens": tokens, "token_type": types,
              "merges": merges}
    return write_gguf(path, "gpt2", tokens, types, pre=pre, merges=merges), fields


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_byte_level_pre_types_match_transformers_converter(tmp_path, pre):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
    )

    meta, fields = byte_level_gguf(tmp_path / "tiny.gguf", pre)
    ours = Tokenizer.from_gguf_fields(meta)
    ref, _ = convert_gguf_tokenizer("llama", fields)
    # Chosen so that each pre type gives different ids: "12345" (qwen2 splits digits), "  1" (GPT-2 regex keeps " 1").
    for text in ["12345 abc", "  123 ab\n\n  1", "abc<|end|>12", "x   45", "1234"]:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False).ids, text


def test_unknown_pre_tokenizer_type_is_rejected(tmp_path):
    meta, _ = byte_level_gguf(tmp_path / "tiny.gguf", "made-up")
    with pytest.raises(ValueError, match="pre-tokenizer type 'made-up' is not supported"):
        Tokenizer.from_gguf_fields(meta)


def test_unknown_tokenizer_model_is_rejected(tmp_path):
    meta = write_gguf(tmp_path / "tiny.gguf", "bert", ["[CLS]", "a"], [3, 1])
    with pytest.raises(ValueError, match="'bert' is not supported"):
        Tokenizer.from_gguf_fields(meta)


SPM_PIECES = {"▁": -1.0, "a": -2.0, "b": -2.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0,
              "d": -2.0, "▁a": -1.5, "ab": -1.2, "▁ab": -1.1, "he": -1.3, "ll": -1.4, "llo": -1.0, "hello": -0.5,
              "▁hello": -0.2, "▁w": -1.6, "or": -1.6, "▁wor": -1.0, "ld": -1.5, "▁world": -0.3}


@pytest.fixture
def spm(tmp_path) -> tuple[Tokenizer, tokenizers.Tokenizer]:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
    )

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES)]
    scores = [0.0] * 259 + list(SPM_PIECES.values())
    meta = write_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, bos=1, eos=2)
    fields = {"tokenizer_type": "llama", "tokens": tokens, "scores": scores, "token_type": types, "unk_token_id": 0}
    return Tokenizer.from_gguf_fields(meta), convert_gguf_tokenizer("llama", fields)[0]


def test_sentencepiece_gguf_matches_transformers_and_adds_bos(spm):
    ours, ref = spm
    for text in ["hello world", "ab abhello", "héllo wörld 🤗", "a  b", "hello\nworld"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text
    assert ours.encode("hello")[0] == 1  # llama.cpp adds BOS to SentencePiece vocabularies by default


def test_a_large_scored_vocabularys_merges_are_kept_and_read_back(tmp_path, monkeypatch, caplog):
    # Gemma's 262k tokens took 1.1 s to derive their merges from the scores: a start keeps
    # them on disk, named by the vocabulary, and a later one reads the same merges back.
    from models import gguf_tokenizer

    monkeypatch.setenv("KVSERVE_TOKENIZER_CACHE", str(tmp_path / "kept"))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES)]
    scores = [0.0] * 259 + list(SPM_PIECES.values())
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    derive = gguf_tokenizer._merges_from_scores
    want = derive(tokens, types, scores, vocab)  # (below MIN_CACHED_TOKENS: derived, nothing kept)
    assert ("▁wor", "ld") in want and not (tmp_path / "kept").exists()
    monkeypatch.setattr(gguf_tokenizer, "MIN_CACHED_TOKENS", 1)
    assert derive(tokens, types, scores, vocab) == want
    [kept] = (tmp_path / "kept").iterdir()
    kept.write_bytes(kept.read_bytes()[:16])  # (the first two merges: read back as they are)
    assert derive(tokens, types, scores, vocab) == want[:2]
    other = derive(tokens, types, [*scores[:-1], -5.0], vocab)  # another vocabulary: another file
    assert len(list((tmp_path / "kept").iterdir())) == 2 and other != want
    kept.write_bytes(b"\xff" * 12)  # ids out of range: derived again and replaced
    with caplog.at_level("WARNING"):
        assert derive(tokens, types, scores, vocab) == want
    assert "damaged merges file" in caplog.text and kept.stat().st_size == 8 * len(want)


def test_sentencepiece_space_prefix_follows_llama_cpp(spm):
    # llama.cpp prefixes a space to every text fragment, even one that starts with a space or
    # follows a special token; transformers' Metaspace("first") does neither.
    ours, _ = spm
    assert [ours.id_to_token(i) for i in ours.encode(" hello", add_special_tokens=False)] == ["▁", "▁hello"]
    assert [ours.id_to_token(i) for i in ours.encode("<s>hello", add_special_tokens=False)] == ["<s>", "▁hello"]
    assert ours.decode(ours.encode(" hello")) == " hello"


def test_token_bytes_rebuild_the_text_where_tokens_split_a_character(ours, spm):
    # OpenAI's logprobs carry each token's bytes so that characters split over tokens
    # (an emoji is often two) can be put back together; decode([id]) gives U+FFFD there.
    sp, _ = spm
    for tok, add in ((ours, False), (sp, False)):
        for text in ["🙂 日本 hello", "héllo wörld 🤗"]:
            ids = tok.encode(text, add_special_tokens=add)
            pieces = [tok.token_bytes(i) for i in ids]
            assert b"".join(pieces).decode("utf-8").lstrip(" ") == text
    emoji = ours.encode("🙂", add_special_tokens=False)
    assert len(emoji) == 2 and ours.decode(emoji[:1]) == "\ufffd" and ours.token_bytes(emoji[0]) == b"\xf0\x9f"
    assert ours.token_bytes(ours.eos_token_ids[0]) == b"<|im_end|>"
    assert sp.token_bytes(sp.encode(" hello", add_special_tokens=False)[-1]) == b" hello"


def test_token_bytes_of_added_tokens_are_their_text(tmp_path):
    # An added token is matched whole and not spelled in GPT-2's byte table: "é" is its
    # UTF-8, not the byte the table maps "é" to.
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
              "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>", "é!"],
              "tokenizer.ggml.token_type": [1, 1, 1, 3, 4], "tokenizer.ggml.merges": ["a b"],
              "tokenizer.ggml.eos_token_id": 3}
    tok = Tokenizer.from_gguf_fields(fields)
    assert [tok.token_bytes(i) for i in range(5)] == [b"a", b"b", b"ab", b"<|end|>", "é!".encode()]


# --- Fill-in-the-middle markers ------------------------------------------------


def with_added(ours: Tokenizer, texts: list[str], **kwargs: Any) -> Tokenizer:
    """SmolLM2's tokenizer with ``texts`` added as special tokens (ids from 49152 on)."""
    backend = tokenizers.Tokenizer.from_str(ours.to_json())
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in texts])
    return Tokenizer(backend, bos_token_id=ours.bos_token_id, eos_token_ids=ours.eos_token_ids, **kwargs)


def test_fim_markers_are_found_by_their_family_or_declared(ours):
    # SmolLM2 has <repo_name> and <file_sep> but no fill-in-the-middle markers.
    assert ours.fim_tokens is None
    base = ours.vocab_size
    qwen = with_added(ours, ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|repo_name|>", "<|file_sep|>"])
    fim = qwen.fim_tokens
    assert (fim.prefix, fim.middle, fim.suffix, fim.repo, fim.file_sep) == tuple(range(base, base + 5))
    assert qwen.encode("<|fim_prefix|>a", add_special_tokens=False)[0] == fim.prefix
    # StarCoder's spelling; SmolLM2's own <repo_name> and <file_sep> go with it.
    star = with_added(ours, ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]).fim_tokens
    assert (star.prefix, star.suffix, star.middle) == (base, base + 1, base + 2)
    assert (star.repo, star.file_sep) == (ours.encode("<repo_name>", False)[0], ours.encode("<file_sep>", False)[0])
    # Two of three are not enough; a file's declared ids win over the texts.
    assert with_added(ours, ["<|fim_prefix|>", "<|fim_suffix|>"]).fim_tokens is None
    declared = with_added(ours, ["<|fim_prefix|>", "<|fim_suffix|>"],
                          fim_token_ids={"prefix": 5, "suffix": 6, "middle": 7}).fim_tokens
    assert (declared.prefix, declared.suffix, declared.middle) == (5, 6, 7)


def test_gguf_fim_token_ids_are_read(tmp_path):
    tokens = ["<s>", "</s>", "<pre>", "<suf>", "<mid>", "a", "b"]
    types = [gguf.TokenType.CONTROL] * 5 + [gguf.TokenType.NORMAL] * 2
    fields = write_gguf(tmp_path / "fim.gguf", "gpt2", tokens, types, pre="default", merges=[],
                        fim=(2, 3, 4))
    tok = Tokenizer.from_gguf_fields(fields)
    assert (tok.fim_tokens.prefix, tok.fim_tokens.suffix, tok.fim_tokens.middle) == (2, 3, 4)
    assert tok.fim_tokens.repo is None
