"""engine.speculative's verification on hand-made logits: which rows are whose, what the
model picks after each proposal, and which proposals a request keeps."""

from __future__ import annotations

import torch

from engine.outputs import TokenLogprob
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest
from engine.speculative import Proposed, proposal_rows, sample_proposals, verify
from engine.stats import StepStats

GREEDY = SamplingParams(temperature=0, max_tokens=16)


class RecordingSpeculator:
    """What ``verify`` tells the speculator: (request id, proposed, accepted) per call."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int, int]] = []

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        self.records.append((request.request_id, proposed, accepted))


def scheduled(request_id: str, spec: list[int], params: SamplingParams = GREEDY) -> ScheduledRequest:
    request = Request(request_id, [0, 0], params, params.max_tokens, spec_token_ids=list(spec))
    return ScheduledRequest(request, start_pos=1, num_new_tokens=1 + len(spec), block_tables=[[0]], sample=True,
                            spec_token_ids=list(spec))


def test_each_request_has_its_last_known_tokens_row_then_one_per_proposal():
    items = [scheduled("a", []), scheduled("b", [7, 8]), scheduled("c", [9])]
    assert proposal_rows(items) == ([0, 1, 4], {"b": [2, 3], "c": [5]})


def test_a_request_without_proposals_keeps_its_sampled_token_alone():
    stats = StepStats()
    lp = TokenLogprob(3, -0.5)
    assert verify(scheduled("a", []), 3, lp, None, Sampler(8), None, stats) == ([3], [lp])
    assert stats == StepStats()


def test_proposals_are_kept_while_they_are_the_models_picks_then_its_next_pick():
    stats, speculator = StepStats(), RecordingSpeculator()
    lps = [TokenLogprob(t, -1.0) for t in (6, 9, 8)]
    proposed = Proposed([6, 9, 8], lps, generator_state=None)
    first = TokenLogprob(5, -0.1)
    kept = verify(scheduled("a", [5, 6, 7]), 5, first, proposed, Sampler(16), speculator, stats)
    assert kept == ([5, 6, 9], [first, lps[0], lps[1]])  # 7 was not the pick after 6: 9 is kept instead
    assert (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens) == (1, 3, 2)
    assert stats.spec_accepted_per_position == {0: 1, 1: 1}
    assert speculator.records == [("a", 3, 2)]
    everything = verify(scheduled("b", [5, 6]), 5, None, Proposed([6, 4], [None, None], None), Sampler(16),
                        speculator, stats)
    assert everything == ([5, 6, 4], [None, None, None])
    assert stats.spec_accepted_per_position == {0: 2, 1: 2} and speculator.records[-1] == ("b", 2, 2)
    nothing = verify(scheduled("c", [5]), 2, None, Proposed([1], [None], None), Sampler(16), speculator, stats)
    assert nothing == ([2], [None]) and stats.spec_accepted_per_position == {0: 2, 1: 2}


def test_a_seeded_request_keeps_only_the_noise_its_kept_tokens_drew():
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16)
    item = scheduled("a", [5, 6], params)
    generator = item.request.generator
    before = generator.get_state()
    torch.rand(4, generator=generator)  # what sampling the proposals' rows drew
    drawn = generator.get_state()
    verify(item, 5, None, Proposed([6, 6], [None, None], before), Sampler(16), RecordingSpeculator(), StepStats())
    assert torch.equal(generator.get_state(), drawn)  # all kept: every draw was used
    rejected = scheduled("b", [4, 6], params)
    rejected.request.generator.set_state(drawn)
    verify(rejected, 5, None, Proposed([6, 6], [None, None], before), Sampler(16), RecordingSpeculator(), StepStats())
    assert torch.equal(rejected.request.generator.get_state(), before)  # none kept: none drawn


def test_the_row_after_each_proposal_sees_the_proposals_before_it_as_output():
    # Token 1 leads rows 1 and 2 by a little; a repetition penalty takes it down once
    # the proposals before a row hold it, so row 2 (after 3, 1) picks 2 instead.
    logits = torch.tensor([[0.0, 1.0, 0.0, 3.0], [0.0, 5.0, 4.9, 0.0], [0.0, 5.0, 4.9, 0.0]])
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=2.0)
    items = [scheduled("a", [3, 1], params)]
    main, extra = proposal_rows(items)
    proposed = sample_proposals(Sampler(4), logits, items, extra, masks={})
    assert main == [0] and proposed == {"a": Proposed([1, 2], [None, None], None)}
    assert items[0].request.output_token_ids == []  # the request itself is left as it was
    assert sample_proposals(Sampler(4), logits, [scheduled("b", [])], {}, masks={}) == {}
