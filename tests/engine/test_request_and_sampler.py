import pytest
import torch

from shared.engine.request import Request, RequestStatus, SamplingParams
from shared.engine.sampler import sample


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0},
                                 {"top_p": 1.5}, {"top_k": -2}])
def test_sampling_params_reject_out_of_range(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_request_rejects_empty_prompt_and_stops_on_eos_or_length() -> None:
    with pytest.raises(ValueError):
        Request("x", [], SamplingParams())
    r = Request("a", [1, 2], SamplingParams(max_tokens=3), eos_id=0)
    r.append(5, None)
    assert r.status is RequestStatus.WAITING
    r.append(0, None)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.finish_reason == "stop"
    r = Request("b", [1], SamplingParams(max_tokens=2, ignore_eos=True), eos_id=0)
    r.append(0, None)
    r.append(0, None)
    assert r.finish_reason == "length"


def test_greedy_picks_argmax_and_reports_logprob() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    tokens, lps = sample(logits, [SamplingParams(logprobs=True), SamplingParams()], [0, 0])
    assert tokens == [1, 0]
    assert lps[1] is None and lps[0] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())


def test_seeded_sampling_is_reproducible_and_depends_on_index() -> None:
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    draws = [sample(logits, [p], [i])[0][0] for i in range(20)]
    assert draws == [sample(logits, [p], [i])[0][0] for i in range(20)]
    assert len(set(draws)) > 10


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]])
    seen_k = {sample(logits, [SamplingParams(temperature=5.0, top_k=2, seed=s)], [0])[0][0]
              for s in range(200)}
    assert seen_k == {0, 1}
    # probabilities ~ [0.665, 0.245, 0.090]: top_p=0.8 keeps the first two only
    seen_p = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.8, seed=s)], [0])[0][0]
              for s in range(300)}
    assert seen_p == {0, 1}


def test_token_span_matches_slicing_the_whole_sequence() -> None:
    r = Request("s", [1, 2, 3], SamplingParams(max_tokens=5))
    r.output_ids = [7, 8]
    whole = r.all_ids
    for start, end in [(0, 2), (1, 4), (2, 5), (3, 5), (4, 5), (0, 5)]:
        assert r.token_span(start, end) == whole[start:end]
