import pytest
import torch

from shared.engine.request import Request, RequestStatus, SamplingParams
from shared.engine.sampler import _filter, sample


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0},
                                 {"top_p": 1.5}, {"top_k": -2}])
def test_sampling_params_reject_out_of_range(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_request_rejects_empty_prompt_and_stops_on_eos_or_length() -> None:
    with pytest.raises(ValueError):
        Request("x", [], SamplingParams())
    r = Request("a", [1, 2], SamplingParams(max_tokens=3), eos_ids=frozenset({0}))
    r.append(5, None)
    assert r.status is RequestStatus.WAITING
    r.append(0, None)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.finish_reason == "stop"
    r = Request("b", [1], SamplingParams(max_tokens=2, ignore_eos=True), eos_ids=frozenset({0}))
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


# Every temperature, top_p and top_k the API accepts, on logits with a wide range (a float32
# denormal temperature used to overflow to inf, give NaN probabilities and crash the engine).
EXTREME_TEMPERATURES = [1e-40, 1e-30, 1e-8, 1e-5, 1e-3, 0.5, 1.0, 2.0]


def _wide_logits(rows: int = 6, vocab: int = 512) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, vocab, generator=gen) * 30
    logits[0, 3] = logits[0, 5] = 200.0  # a tie at the top
    logits[1] = 0.0  # flat: every token equally likely
    return logits


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8, 1e-6])
def test_tiny_temperatures_pick_the_argmax(temperature: float) -> None:
    logits = _wide_logits()
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=s, logprobs=True)
              for s, top_p in enumerate([1.0, 0.5, 1e-9, 1.0, 0.9, 1.0])]
    tokens, lps = sample(logits, params, list(range(len(params))))
    assert tokens == logits.argmax(-1).tolist()
    assert all(lp is not None and lp == lp for lp in lps)  # no NaN


@pytest.mark.parametrize("temperature", EXTREME_TEMPERATURES)
@pytest.mark.parametrize("top_p", [1e-9, 0.1, 0.9, 1.0])
@pytest.mark.parametrize("top_k", [0, 1, 2, 511, 512, 100_000])
def test_every_accepted_parameter_samples_a_token_of_the_vocabulary(
        temperature: float, top_p: float, top_k: int) -> None:
    logits = _wide_logits()
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=3)
    tokens, _ = sample(logits, [p] * len(logits), list(range(len(logits))))
    assert all(0 <= t < logits.shape[1] for t in tokens)
    if top_k == 1 or top_p == 1e-9 or temperature < 1e-5:
        # a single candidate is left (ties aside): row 1 is flat, row 0 ties at the top
        assert tokens[2:] == logits[2:].argmax(-1).tolist()
        assert tokens[0] in (3, 5)


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 0.5, 2.0])
def test_filtered_probabilities_have_no_nan(temperature: float) -> None:
    for row in _wide_logits():
        for top_k, top_p in [(0, 1.0), (5, 1.0), (0, 1e-9), (50, 0.5), (100_000, 0.99)]:
            p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            probs = _filter(row, p).softmax(-1)
            assert not probs.isnan().any() and probs.sum().item() == pytest.approx(1.0)
            assert probs[row == row.max()].sum() > 0  # the most likely token is never cut


def test_sampling_stays_deterministic_per_seed_and_index_at_the_extremes() -> None:
    logits = _wide_logits()
    for temperature in [1e-4, 2.0]:
        p = SamplingParams(temperature=temperature, top_p=0.95, top_k=100, seed=11)
        first = [sample(logits, [p] * len(logits), [i] * len(logits))[0] for i in range(5)]
        again = [sample(logits, [p] * len(logits), [i] * len(logits))[0] for i in range(5)]
        assert first == again


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-46, 1e-45])
def test_top_p_below_float32_range_keeps_the_top_token(top_p: float) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=t, top_p=top_p, seed=5) for t in (1e-5, 0.7, 2.0)]
    tokens, _ = sample(logits, params, [0, 1, 2])
    assert tokens == logits.argmax(-1).tolist()
