"""bench.exact's comparison (the real run serves a model and loads transformers' copy: `python -m bench.exact`)."""

from __future__ import annotations

import pytest

from bench import exact


def test_sixteen_distinct_prompts_of_both_kinds():
    assert len(exact.PROMPTS) == 16 and len(set(exact.PROMPTS)) == 16
    assert {kind for kind, _ in exact.PROMPTS} == {"chat", "completion"}


@pytest.mark.parametrize("a, b, at", [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 5, 3], 1),
    ([1, 2], [1, 2, 3], 2),  # one stopped (EOS) where the other went on
    ([], [], None),
])
def test_first_difference(a, b, at):
    assert exact.first_difference(a, b) == at


def test_a_mismatch_reports_each_sides_top_two_gap_where_the_tokens_part():
    ours = exact.Answer([7, 8], [1, 2, 3], [0.5, 5e-5, 2.0])
    theirs = exact.Answer([7, 8], [1, 4, 3], [0.5, 3e-5, 2.0])

    row = exact.compare("chat", ours, theirs, reference_ids=[7, 8])

    assert (row.match, row.first_difference, row.kvserve_gap, row.transformers_gap) == (False, 1, 5e-5, 3e-5)
    assert row.same_prompt_ids and row.prompt_tokens == 2
    assert row.closest == 0.5  # before the tokens part
    assert "MISMATCH at token 1: kvserve [2] vs transformers [4]" in exact.line(0, row)
    assert exact.line(0, row).count("near tie") == 2


def test_a_match_and_other_prompt_ids_are_said():
    answer = exact.Answer([7, 8], [1, 2], [1.0, 0.25])
    row = exact.compare("completion", answer, answer, reference_ids=[7, 9])
    assert row.match and row.first_difference is None and row.kvserve_gap is None and row.closest == 0.25
    assert not row.same_prompt_ids
    assert exact.line(3, row).endswith(
        "match (2 tokens, closest top-2 gap 0.25)  (transformers' tokenizer gives other prompt ids)")
