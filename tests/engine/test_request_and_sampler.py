import dataclasses

import pytest
import torch

from shared.engine.request import Draw, Request, RequestStatus, SamplingParams
from shared.engine.sampler import _filter, adjust, sample, top_logprobs


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


def test_top_logprobs_are_the_likeliest_tokens_as_many_as_each_row_asks() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [2.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(logprobs=True, top_logprobs=2), SamplingParams(),
              SamplingParams(logprobs=True, top_logprobs=9)]
    tops = top_logprobs(logits, params)
    lp = torch.log_softmax(logits, -1)
    assert [t for t, _ in tops[0]] == [1, 3]
    assert [v for _, v in tops[0]] == pytest.approx([lp[0, 1].item(), lp[0, 3].item()])
    assert tops[1] == ()  # not asked for
    assert len(tops[2]) == 4  # no more than the vocabulary
    tokens, lps = sample(logits, params, [0, 0, 0])
    assert tops[0][0] == (tokens[0], pytest.approx(lps[0]))  # greedy: the likeliest
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=21)


def test_a_request_keeps_its_top_logprobs_only_when_asked() -> None:
    asked = Request("a", [1], SamplingParams(max_tokens=3, logprobs=True, top_logprobs=1))
    plain = Request("b", [1], SamplingParams(max_tokens=3))
    for r in (asked, plain):
        r.append(*Draw(5, -0.1, ((5, -0.1),)))
        r.append(*Draw(6, -0.2, ((7, -0.05),)))
    assert asked.output_top == [((5, -0.1),), ((7, -0.05),)]
    assert plain.output_top == [] and plain.output_logprobs == [-0.1, -0.2]


def test_penalties_and_bias_change_the_logits_sampling_sees() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 0.5]])
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                             logit_bias=((0, 10.0), (9, 5.0))), SamplingParams()]
    adjusted = adjust(logits, params, [[2, 2, 1, 7], [2, 2]])  # 7, 9: past the vocabulary
    assert adjusted[0].tolist() == pytest.approx([11.0, 2.0 - 0.75, 3.0 - 1.0, 0.5])
    assert torch.equal(adjusted[1], logits[1]) and torch.equal(logits[0], logits[1])
    assert adjust(logits, [SamplingParams()] * 2, [[2], [2]]) is logits  # nothing asked
    tokens, _ = sample(adjusted, params, [0, 0])
    assert tokens == [0, 2]  # greedy: the bias decides
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3.0},
                {"logit_bias": ((1, 101.0),)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the kernel; torch's path
def test_sampling_draws_each_token_as_often_as_its_probability(dtype: torch.dtype) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], dtype=dtype)
    logits = probs.log().unsqueeze(0)  # log 0 = -inf: never drawn
    draws = 4000
    counts = torch.zeros(5, dtype=dtype)
    for seed in range(draws):
        counts[sample(logits, [SamplingParams(temperature=1.0, seed=seed)], [0])[0][0]] += 1
    assert counts[4] == 0
    # four binomial standard deviations at most: sqrt(4000 * 0.5 * 0.5) ~ 32 draws
    assert (counts / draws - probs).abs().max() < 4 * (0.25 / draws) ** 0.5


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("spread", [0.5, 3.0])
def test_the_nucleus_is_the_prefix_a_full_sort_finds(top_p: float, spread: float) -> None:
    """The torch path's top_p (a GPU's) keeps the smallest likeliest prefix whose mass
    reaches top_p, a small one (a peaked row) or thousands of tokens (a flat one)."""
    gen = torch.Generator().manual_seed(int(top_p * 1000) + int(spread))
    for _ in range(4):
        row = torch.randn(49152, generator=gen) * spread
        kept = _filter(row, SamplingParams(temperature=1.0, top_p=top_p)) > float("-inf")
        ordered = torch.sort(row, descending=True)
        probs = ordered.values.softmax(-1)
        count = max(1, int((probs.cumsum(-1) - probs < top_p).sum()))
        assert int(kept.sum()) == count
        assert kept[ordered.indices[:count]].all()


def test_a_request_draws_the_same_token_alone_or_in_any_batch() -> None:
    """The same request samples the same tokens on any instance, whatever shares its step."""
    logits = torch.randn(8, 49152, generator=torch.Generator().manual_seed(3)) * 4
    params = [SamplingParams(temperature=t, seed=s, top_p=top_p) for s, (t, top_p) in
              enumerate([(1.0, 1.0), (0.7, 1.0), (1.3, 0.9), (0.0, 1.0)] * 2)]
    together, _ = sample(logits, params, list(range(8)))
    alone = [sample(logits[i:i + 1], [params[i]], [i])[0][0] for i in range(8)]
    reversed_batch, _ = sample(logits.flip(0), params[::-1], list(range(8))[::-1])
    assert together == alone == reversed_batch[::-1]
    assert len(set(together)) > 4


def test_the_sampling_kernel_refuses_what_it_cannot_draw_from() -> None:
    from shared.engine.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("needs a C++ compiler")
    logits, one, none = torch.zeros(2, 10), torch.ones(1), torch.zeros(1, dtype=torch.long)
    for rows, top_p, uniform in [([2], 1.0, 0.5), ([0], 1.0, 1.0), ([-1], 1.0, 0.0),
                                 ([0], 1.5, 0.5)]:
        with pytest.raises(RuntimeError, match="outside"):
            kernels.sample_rows(logits, torch.tensor(rows), one, none,
                                torch.tensor([top_p], dtype=torch.float64),
                                torch.tensor([uniform], dtype=torch.float64))


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.05), (0, 0.5), (0, 0.9), (50, 1.0),
                                              (50, 0.5), (3, 1e-9), (400, 0.99)])
@pytest.mark.parametrize("spread", [0.5, 3.0])
def test_the_compiled_draw_keeps_to_the_tokens_the_filter_keeps(
        top_k: int, top_p: float, spread: float) -> None:
    """The kernel cuts a row as `_filter` does (the nucleus inside the first candidates and
    past them): every token it draws is one `_filter` keeps, the likeliest as often as its
    share of what is kept."""
    row = torch.randn(1, 49152, generator=torch.Generator().manual_seed(top_k + 7)) * spread
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    filtered = _filter(row[0], params)
    kept = set(torch.nonzero(filtered > float("-inf")).flatten().tolist())
    draws = 400
    drawn = [sample(row, [dataclasses.replace(params, seed=seed)], [0])[0][0]
             for seed in range(draws)]
    assert set(drawn) <= kept
    top = int(filtered.argmax())
    share = float(filtered.softmax(-1)[top])
    assert abs(drawn.count(top) / draws - share) <= 4 * (share * (1 - share) / draws) ** 0.5


def test_the_torch_draw_at_the_very_end_of_a_row_never_takes_a_token_cut_out() -> None:
    from shared.engine.sampler import _draw_one

    row = torch.tensor([0.0, -1.0, -2.0, float("-inf"), float("-inf")])
    assert _draw_one(row, 1.0 - 2.0**-60) == 2  # rounds to the whole mass: the last kept
    assert _draw_one(row, 0.0) == 0
    huge = SamplingParams(temperature=1.0, top_k=2**70, seed=1)  # the API bounds it below only
    assert sample(row.unsqueeze(0), [huge], [0])[0][0] in (0, 1, 2)
