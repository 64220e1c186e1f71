"""SamplingParams validation (http_api.md §2 messages) and the batched Sampler (CPU, fixed seeds)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import fields, replace

import pytest
import torch

from engine.runtime.sampler import Sampler, _token_counts, exponential_noise, seed_hash, token_hash, unit
from engine.runtime.sampling_params import SamplingParams

V = 1000


def _err(d: dict, vocab: int = V) -> str:
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict(d).verify(vocab)
    return str(e.value)


# ----------------------------------------------------------------------------- validation

BAD = [
    ({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
    ({"temperature": -1.0}, "temperature must be a non-negative finite number, got -1.0."),
    ({"temperature": float("nan")}, "temperature must be a non-negative finite number, got nan."),
    ({"temperature": float("inf")}, "temperature must be a non-negative finite number, got inf."),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"top_p": -0.5}, "top_p must be in (0, 1], got -0.5."),
    ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan."),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3."),
    ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2], got 3.0."),
    ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5."),
    ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0."),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3."),
    ({"presence_penalty": float("inf")}, "presence_penalty must be in [-2, 2], got inf."),
    ({"repetition_penalty": 3}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 3."),
    ({"repetition_penalty": 3.0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 3.0."),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0."),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got -1.0."),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
    ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens must be in [0, max_new_tokens(4)], got 5."),
    ({"min_new_tokens": 129}, "min_new_tokens must be in [0, max_new_tokens(128)], got 129."),
    ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens(128)], got -1."),
    ({"logit_bias": {str(V): 1.0}}, f"logit_bias must has keys in [0, {V - 1}], got {V}."),
    ({"logit_bias": {"-1": 1.0}}, f"logit_bias must has keys in [0, {V - 1}], got -1."),
    ({"regex": "a+", "json_schema": "{}"}, "Only one of regex, json_schema, or ebnf can be set."),
    ({"regex": "a+", "ebnf": "root ::= 'a'"}, "Only one of regex, json_schema, or ebnf can be set."),
    ({"json_schema": "{}", "ebnf": "root ::= 'a'"}, "Only one of regex, json_schema, or ebnf can be set."),
    # our own additions
    ({"n": 0}, "n must be in [1, 128], got 0."),
    ({"n": 129}, "n must be in [1, 128], got 129."),
    ({"stop_token_ids": [3, V]}, f"stop_token_ids must be in [0, {V - 1}], got {V}."),
    ({"logit_bias": {"7": float("inf")}}, "logit_bias values must be finite numbers, got inf for key 7."),
    ({"logit_bias": {"7": float("nan")}}, "logit_bias values must be finite numbers, got nan for key 7."),
    ({"stream_interval": 0}, "stream_interval must be at least 1, got 0."),
    ({"stop": ""}, "stop cannot contain an empty string."),
    ({"stop": ["end", ""]}, "stop cannot contain an empty string."),
]


@pytest.mark.parametrize(("d", "msg"), BAD, ids=[json.dumps(d) for d, _ in BAD])
def test_verify_rejects_with_exact_message(d: dict, msg: str) -> None:
    assert _err(d) == msg


def test_stop_regex_must_compile() -> None:
    msg = _err({"stop_regex": ["ok", "("]})
    assert msg.startswith("stop_regex '(' is not a valid regular expression")


GOOD = [
    {}, {"temperature": 0}, {"temperature": 0.0}, {"temperature": 2}, {"top_p": 1}, {"top_p": 1e-9},
    {"top_k": -1}, {"top_k": 1}, {"top_k": 10 * V}, {"min_p": 0}, {"min_p": 1.0}, {"frequency_penalty": -2},
    {"frequency_penalty": 2.0}, {"presence_penalty": -2.0}, {"repetition_penalty": 2},
    {"repetition_penalty": 1e-3}, {"max_new_tokens": 0}, {"max_new_tokens": None, "min_new_tokens": 5},
    {"max_new_tokens": 7, "min_new_tokens": 7}, {"logit_bias": {"0": -100, str(V - 1): 100.0}},
    {"regex": "a+"}, {"json_schema": "{}"}, {"ebnf": "root ::= 'a'"}, {"n": 1}, {"n": 128},
    {"stop": "x", "stop_token_ids": [0, V - 1], "stop_regex": r"\d+"}, {"sampling_seed": 2**64 - 1},
    {"ignore_eos": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
     "no_stop_trim": True, "stream_interval": 4, "custom_params": {"a": 1}, "structural_tag": "{}"},
]


@pytest.mark.parametrize("d", GOOD, ids=[json.dumps(d) for d in GOOD])
def test_verify_accepts_good_values(d: dict) -> None:
    SamplingParams.from_dict(d).verify(V)


def test_unknown_key_rejected() -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1})
    msg = str(e.value)
    assert msg.startswith("unknown sampling parameter 'foo'; valid parameters are: ")
    for f in fields(SamplingParams):
        assert f.name in msg


@pytest.mark.parametrize(("d", "field"), [
    ({"temperature": "abc"}, "temperature"), ({"top_p": [1]}, "top_p"), ({"min_p": True}, "min_p"),
    ({"top_k": True}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"max_new_tokens": "5"}, "max_new_tokens"),
    ({"n": False}, "n"), ({"ignore_eos": 1}, "ignore_eos"), ({"stop": 5}, "stop"), ({"stop": ["a", 1]}, "stop"),
    ({"stop_token_ids": 3}, "stop_token_ids"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"logit_bias": [1]}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"1": "x"}}, "logit_bias"), ({"regex": 3}, "regex"), ({"custom_params": "x"}, "custom_params"),
    ({"sampling_seed": 1.5}, "sampling_seed"), ({"stop_regex": [None]}, "stop_regex"),
])
def test_wrong_types_name_the_field(d: dict, field: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict(d)
    msg = str(e.value)
    assert msg.startswith(f"{field} ") and " must be " in msg


def test_null_means_default_and_normalization() -> None:
    nulls = {f.name: None for f in fields(SamplingParams) if f.name != "max_new_tokens"}
    assert SamplingParams.from_dict(nulls) == SamplingParams()
    assert SamplingParams.from_dict(None) == SamplingParams() == SamplingParams.from_dict({})
    # max_new_tokens is the one nullable field: null = until EOS / context length
    assert SamplingParams.from_dict({"max_new_tokens": None}).max_new_tokens is None
    assert SamplingParams().max_new_tokens == 128
    p = SamplingParams.from_dict({"stop": "abc", "stop_token_ids": [5, 5, 2], "stop_regex": "x+",
                                  "logit_bias": {3: 1}, "top_k": 5.0, "temperature": 1})
    assert p.stop == ["abc"] and p.stop_regex == ["x+"] and p.stop_token_ids == frozenset({2, 5})
    assert p.logit_bias == {"3": 1} and p.top_k == 5 and isinstance(p.top_k, int)
    assert SamplingParams(stop="a").stop == ["a"] and SamplingParams(stop=None).stop == []
    q = replace(p, n=1, sampling_seed=9, stop="z")  # (__post_init__ normalizes the copy too)
    assert q.sampling_seed == 9 and q.stop == ["z"] and p.sampling_seed is None and q.stop_token_ids == p.stop_token_ids


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy and not SamplingParams().is_greedy


# ----------------------------------------------------------------------------- sampler helpers

def _sample_many(logits_row: torch.Tensor, p: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws for one logits row (a batch of n copies, each row its own seed)."""
    logits = logits_row[None, :].expand(n, -1).contiguous()
    return Sampler().sample(logits, [p] * n, [[]] * n, [[]] * n, [seed * n + i for i in range(n)], None)


# probabilities in a shuffled token order so that sorted order != id order
_PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]
_PERM = [5, 2, 7, 0, 3, 6, 1, 4]  # token id of the i-th most likely
_LOGITS = torch.empty(8)
_LOGITS[_PERM] = torch.tensor(_PROBS).log()


def _top(m: int) -> set[int]:
    return set(_PERM[:m])


# ----------------------------------------------------------------------------- sampler tests

def test_top_k_1_and_greedy_equal_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(512, 300) * 3
    want = logits.argmax(-1)
    seeds = list(range(512))
    n = 512
    got = Sampler().sample(logits, [SamplingParams(top_k=1, temperature=1.3)] * n, [[]] * n, [[]] * n, seeds)
    assert torch.equal(got, want)
    got = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * n, [[]] * n, [[]] * n, seeds)
    assert torch.equal(got, want) and got.dtype == torch.int64
    # greedy rows mixed with sampling rows stay greedy; the sampling rows draw
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(n)]
    got = Sampler().sample(logits, params, [[]] * n, [[]] * n, seeds)
    assert torch.equal(got[1::2], want[1::2]) and not torch.equal(got[::2], want[::2])


def test_greedy_takes_the_first_of_tied_maxima() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (64, 4096), generator=g).float()  # (every row has many tied maxima)
    logits[5] = float("-inf")
    logits[6, 100:] = float("-inf")
    rows = logits.tolist()
    want = [row.index(max(row)) for row in rows]  # the lowest id among the largest
    got = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 64, [[]] * 64, [[]] * 64, [0] * 64)
    assert got.tolist() == want


@pytest.mark.parametrize(("kw", "support"), [
    ({}, _top(8)),
    ({"top_k": 3}, _top(3)),
    ({"top_k": 1}, _top(1)),
    ({"top_p": 0.75}, _top(3)),   # mass before 3rd = .65 < .75, before 4th = .80
    ({"top_p": 0.5}, _top(2)),
    ({"top_p": 0.1}, _top(1)),
    ({"top_p": 0.97}, _top(6)),   # mass before 6th = .95, before 7th = .98
    ({"min_p": 0.2}, _top(4)),    # keep p >= .08
    ({"min_p": 0.3}, _top(3)),    # keep p >= .12
    ({"min_p": 1.0}, _top(1)),
    ({"top_k": 2, "top_p": 0.9}, _top(2)),
    ({"top_k": 5, "top_p": 0.7, "min_p": 0.01}, _top(3)),
    ({"top_p": 0.9, "min_p": 0.3}, _top(3)),
])
def test_filter_support_exact(kw: dict, support: set[int]) -> None:
    draws = _sample_many(_LOGITS, SamplingParams(**kw), 6000, seed=1)
    assert set(draws.tolist()) == support
    # within the support, frequencies follow the renormalized probabilities
    probs = torch.softmax(_LOGITS, -1)
    kept = sorted(support)
    expect = probs[kept] / probs[kept].sum() * len(draws)
    obs = torch.tensor([(draws == t).sum().item() for t in kept], dtype=torch.float64)
    chi2 = float(((obs - expect) ** 2 / expect).sum())
    assert chi2 < 40, (kw, chi2)


@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temp: float) -> None:
    torch.manual_seed(3)
    logits = torch.randn(6) * 1.5
    n = 20000
    draws = _sample_many(logits, SamplingParams(temperature=temp), n, seed=7)
    expect = torch.softmax(logits.double() / temp, -1) * n
    obs = torch.bincount(draws, minlength=6).double()
    chi2 = float(((obs - expect) ** 2 / expect).sum())
    assert chi2 < 30, chi2  # df = 5; p(chi2 > 30) ~ 1.5e-5


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    torch.manual_seed(5)
    vocab, steps = 64, 12
    step_logits = [torch.randn(6, vocab) * 2 for _ in range(steps)]
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, min_p=0.02, repetition_penalty=1.2,
                            frequency_penalty=0.3, logit_bias={"3": 1.5})
    neighbours = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=5),
                  SamplingParams(top_p=0.5, presence_penalty=1.0), SamplingParams(min_p=0.2, logit_bias={"9": 100}),
                  SamplingParams(temperature=0.7)]

    def run(pos: int, batch: int) -> list[int]:
        params = [*neighbours[:batch - 1]]
        params.insert(pos, target)
        seeds = [100 + j for j in range(batch)]
        seeds[pos] = 1234
        outs: list[list[int]] = [[] for _ in range(batch)]
        prompts = [[1, 2, 3, 3]] * batch
        for s in range(steps):
            rows = torch.cat([step_logits[s][j:j + 1] for j in range(batch)])
            rows[pos] = step_logits[s][5]
            tok = Sampler().sample(rows, params, outs, prompts, seeds, [None] * batch)
            for j in range(batch):
                outs[j].append(int(tok[j]))
        return outs[pos]

    alone = run(0, 1)
    assert len(set(alone)) > 1
    for pos, batch in [(0, 6), (3, 6), (5, 6), (1, 2), (2, 4)]:
        assert run(pos, batch) == alone


def test_logit_bias_forces_and_forbids_without_leaking() -> None:
    torch.manual_seed(11)
    logits = torch.randn(2, 50)
    top = int(logits[1].argmax())
    forced = 17 if top != 17 else 18
    for temp in (0.0, 1.0):
        params = [SamplingParams(temperature=temp, logit_bias={str(forced): 100}), SamplingParams(temperature=temp)]
        seen = set()
        for i in range(200):
            tok = Sampler().sample(logits, params, [[], []], [[], []], [2 * i, 2 * i + 1])
            assert int(tok[0]) == forced
            seen.add(int(tok[1]))
        assert seen != {forced} and (temp > 0 or seen == {top})
    # -100 forbids the argmax; the neighbour still gets it
    logits = torch.stack([logits[1], logits[1]])
    params = [SamplingParams(temperature=0.0, logit_bias={str(top): -100}), SamplingParams(temperature=0.0)]
    tok = Sampler().sample(logits, params, [[], []], [[], []], [0, 0])
    assert int(tok[0]) != top and int(tok[1]) == top
    sharp = torch.zeros(2, 50)
    sharp[:, top] = 5.0  # ~75% of the mass
    params = [SamplingParams(logit_bias={str(top): -100}), SamplingParams()]
    draws = torch.stack([Sampler().sample(sharp, params, [[], []], [[], []], [i, i]) for i in range(300)])
    assert top not in draws[:, 0].tolist() and top in draws[:, 1].tolist()
    processed = Sampler().process_logits(sharp, params, [[], []], [[], []])
    assert torch.equal(processed[1], sharp[1])


def _naive(logits: list[float], p: SamplingParams, out: list[int], prompt: list[int],
           sup: set[int] | None) -> list[float]:
    x = list(logits)
    for k, b in (p.logit_bias or {}).items():
        x[int(k)] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t in sup or ():
        x[t] = -math.inf
    return x


def test_penalties_match_naive_reference() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    vocab = 40
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=0.5),
        SamplingParams(frequency_penalty=-1.2, presence_penalty=0.8),
        SamplingParams(presence_penalty=2.0, logit_bias={"4": 3.0, "0": -2.5}),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=-0.5, logit_bias={"7": -1}),
        SamplingParams(temperature=0.0, frequency_penalty=0.25),
    ]
    b = len(params)
    logits = torch.randn(b, vocab) * 3
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(b)]
    outs = [[rng.randrange(vocab // 2) for _ in range(rng.randrange(0, 25))] for _ in range(b)]
    outs[5] = []  # nothing generated yet: only the prompt is penalized by repetition_penalty
    sup = [None, {1, 2}, None, {39}, None, None, {0}]
    before = logits.clone()
    got = Sampler().process_logits(logits, params, outs, prompts, sup)
    assert torch.equal(logits, before)  # input untouched
    want = torch.tensor([_naive(logits[i].tolist(), params[i], outs[i], prompts[i], sup[i]) for i in range(b)])
    assert torch.allclose(got, want.float(), atol=1e-5, rtol=1e-6)
    assert torch.equal(got[0], logits[0])
    # neutral batch: nothing to do, nothing copied
    assert Sampler().process_logits(logits, [SamplingParams()] * b, outs, prompts, None) is logits


def test_suppress_holds_back_ids() -> None:
    torch.manual_seed(2)
    logits = torch.zeros(3, 20)
    logits[:, 4] = 10.0
    logits[:, 6] = 9.0
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0)]
    tok = Sampler().sample(logits, params, [[]] * 3, [[]] * 3, [0, 1, 2], [{4}, {4, 6}, None])
    assert tok.tolist()[0] == 6 and tok.tolist()[2] == 4
    for i in range(200):
        tok = Sampler().sample(logits, params, [[]] * 3, [[]] * 3, [i] * 3, [{4}, {4, 6, 99}, set()])
        assert int(tok[1]) not in (4, 6)


def test_length_mismatch() -> None:
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="2 logit rows but 1 seeds"):
        Sampler().sample(logits, [SamplingParams()] * 2, [[]] * 2, [[]] * 2, [0])
    with pytest.raises(ValueError, match="params/output_ids/prompt_ids"):
        Sampler().sample(logits, [SamplingParams()], [[]], [[]], [0, 1])


def test_noise_is_keyed_by_seed_position_and_token_and_stays_finite() -> None:
    """The draw's noise: the same for the same (seed, position), different when either changes, Exp(1)
    distributed over the tokens, finite at the hash's extremes (seeds at both ends of int64, any position)."""
    v = 4096
    seeds = torch.tensor([0, 1, 0, -2**63, 2**63 - 1, 7], dtype=torch.int64)
    pos = torch.tensor([0, 0, 1, 2**40, 0, 3], dtype=torch.int64)
    noise = lambda s, p: exponential_noise(seed_hash(s), p, token_hash(v, s.device))  # noqa: E731
    e = noise(seeds, pos)
    assert torch.equal(e, noise(seeds, pos))  # a pure function
    assert bool(torch.isfinite(e).all()) and float(e.min()) > 0 and float(e.max()) < 16.7
    ends = unit(torch.tensor([0, 2**32 - 1], dtype=torch.int64))  # (the hash's extremes)
    assert 0 < float(ends[0]) < float(ends[1]) < 1 and float((-ends.log()).min()) > 0
    assert len({tuple(r) for r in e[:, :16].tolist()}) == len(seeds)  # every (seed, position) its own noise
    assert abs(float(e.mean()) - 1.0) < 0.02 and abs(float(e.var()) - 1.0) < 0.05  # Exp(1): mean 1, variance 1
    # the same row alone or inside a batch
    assert torch.equal(noise(seeds[3:4], pos[3:4])[0], e[3])


def test_carried_penalty_counts_equal_counts_rebuilt_each_step() -> None:
    """One sampler driven step by step (the same requests, each fed its sampled token, so its penalty counts are
    carried and updated in place) against a fresh sampler each step (counts rebuilt from the ids): the same
    processed logits and the same tokens."""
    torch.manual_seed(4)
    vocab = 50
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(temperature=0.0, frequency_penalty=0.7), SamplingParams(temperature=0.9),
              SamplingParams(temperature=0.0, repetition_penalty=0.8)]
    prompts = [[1, 2, 3, 3], [4], [5, 5, 6], [7, 8]]
    outs: list[list[int]] = [[] for _ in params]
    carried, seeds = Sampler(), [11, 12, 13, 14]
    for step in range(12):
        logits = torch.randn(len(params), vocab) * 2
        tok = carried.sample(logits, params, outs, prompts, seeds, carried=step > 0)
        assert tok.tolist() == Sampler().sample(logits, params, outs, prompts, seeds).tolist()
        state = carried._state  # (its counts: carried from the second step on)
        assert torch.equal(state["counts"], _token_counts(outs, vocab, logits.device)), step
        assert torch.equal(state["seen"], _token_counts([a + b for a, b in zip(prompts, outs)], vocab, logits.device) > 0)
        for o, t in zip(outs, tok.tolist()):
            o.append(t)
    assert len({t for o in outs for t in o}) > 4


def test_steady_steps_build_no_tensor_for_logit_bias_or_suppression(monkeypatch) -> None:
    """Rows with a logit_bias and rows under min_new_tokens (their stop ids suppressed): a steady run builds their
    device tensors once, and again only when the suppressed set changes (each build a host-to-device copy: a sync
    on CUDA); the tokens are a fresh sampler's every step."""
    params = [SamplingParams(temperature=0.7, logit_bias={"3": 5.0, "9": -2.0}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, logit_bias={"4": 3.0})]
    prompts, outs, seeds, carried = [[1, 2], [3], [5, 6, 7]], [[], [], []], [1, 2, 3], Sampler()
    built, real = [], torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    torch.manual_seed(0)
    for step in range(8):
        suppress = [{0} if step < 3 else None, {0, 1} if step < 5 else None, None]  # (min_new_tokens: 3 and 5)
        logits = torch.randn(3, 20)
        built.clear()
        tok = carried.sample(logits, params, outs, prompts, seeds, suppress, carried=step > 0)
        assert len(built) == {0: 4, 3: 1}.get(step, 0), (step, built)  # (0: bias, suppressed, keys, settings)
        assert tok.tolist() == Sampler().sample(logits, params, outs, prompts, seeds, suppress).tolist()
        assert (step >= 3 or tok[0] != 0) and (step >= 5 or tok[1] not in (0, 1))
        for o, t in zip(outs, tok.tolist()):
            o.append(t)
