"""Sampling, finishing and logprobs through the engine (tiny model and a transformers checkpoint)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_engine, run_all, solo, submit
from hf_models import build_hf_model

from engine.runtime.request import LogprobOptions, NewRequest
from engine.runtime.sampling_params import SamplingParams

PROMPT = list(range(40, 90))
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def test_invalid_params_are_rejected_at_submission(engine):
    for bad, msg in [({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
                     ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
                     ({"logit_bias": {"99999": 1.0}}, "logit_bias must has keys in [0, 4095], got 99999.")]:
        with pytest.raises(ValueError) as e:
            submit(engine, PROMPT, **bad)
        assert str(e.value) == msg
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.add_requests([NewRequest(PROMPT, SamplingParams(), LogprobOptions(True, logprob_start_len=len(PROMPT)))])
    with pytest.raises(ValueError, match="context length"):
        submit(engine, [7] * engine.context_len)
    too_long = engine.cfg.max_position_embeddings + 1  # (a position past the model's has no rotation: refused at start)
    with pytest.raises(ValueError, match=f"context_length {too_long} is longer than the model's max_position_emb"):
        make_engine(context_length=too_long)


def test_top_k_1_equals_greedy(engine):
    greedy = solo(engine, PROMPT, **GREEDY).output_ids
    assert solo(engine, PROMPT, **(GREEDY | {"temperature": 1.0, "top_k": 1, "sampling_seed": 3})).output_ids == greedy


def test_logit_bias_forces_and_forbids_without_leaking(engine):
    base = solo(engine, PROMPT, **GREEDY).output_ids
    other = list(range(100, 130))
    neighbour_alone = solo(engine, other, **GREEDY).output_ids
    forced, banned = 777, base[0]
    r1 = submit(engine, PROMPT, **(GREEDY | {"temperature": 1.0, "logit_bias": {str(forced): 100.0}}))[0]
    r2 = submit(engine, PROMPT, **(GREEDY | {"logit_bias": {str(t): -100.0 for t in set(base)}}))[0]
    r3 = submit(engine, other, **GREEDY)[0]
    out = run_all(engine)
    assert out[r1].output_ids == [forced] * 12
    assert banned not in out[r2].output_ids and not set(base) & set(out[r2].output_ids)
    assert out[r3].output_ids == neighbour_alone


def test_stop_string_split_across_tokens_is_found_and_trimmed(engine):
    tok = engine.tokenizer
    plain = solo(engine, PROMPT, **GREEDY)
    pieces = [tok.decode([t]) for t in plain.output_ids]
    i = next(i for i in range(2, 11) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    prefix = "".join(pieces[:i])
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    cut = (prefix + pieces[i] + pieces[i + 1]).find(stop)
    out = solo(engine, PROMPT, **(GREEDY | {"stop": ["zzzz-never", stop]}))
    assert out.finish_reason == {"type": "stop", "matched": stop}
    assert out.text == (prefix + pieces[i] + pieces[i + 1])[:cut] and stop not in out.text
    kept = solo(engine, PROMPT, **(GREEDY | {"stop": stop, "no_stop_trim": True}))
    assert kept.text.endswith(stop) and kept.output_ids == out.output_ids


def test_eos_and_min_new_tokens(engine):
    eos = 1
    bias = {"temperature": 0, "logit_bias": {str(eos): 100.0}, "max_new_tokens": 20}
    out = solo(engine, PROMPT, **bias)
    assert out.output_ids == [eos] and out.finish_reason == {"type": "stop", "matched": eos} and out.text == ""
    held = solo(engine, PROMPT, **(bias | {"min_new_tokens": 5}))
    assert len(held.output_ids) == 6 and held.output_ids[-1] == eos and eos not in held.output_ids[:5]
    ignoring = solo(engine, PROMPT, **(bias | {"min_new_tokens": 5, "ignore_eos": True, "max_new_tokens": 8}))
    assert eos not in ignoring.output_ids[:5] and ignoring.output_ids[5:] == [eos] * 3  # held back, then not stopping
    stop_id = solo(engine, PROMPT, **GREEDY).output_ids[3]
    by_id = solo(engine, PROMPT, **(GREEDY | {"stop_token_ids": [stop_id]}))
    assert by_id.output_ids[-1] == stop_id and by_id.finish_reason == {"type": "stop", "matched": stop_id}
    assert solo(engine, PROMPT, **GREEDY).finish_reason == {"type": "length", "length": 12}


def test_n_samples_share_one_prefill(engine):
    engine.flush_cache()
    rids = submit(engine, PROMPT, max_new_tokens=8, temperature=1.0, n=3, sampling_seed=5, ignore_eos=True)
    out = run_all(engine)
    assert len(rids) == 3 and set(rids) == set(out)
    assert all(out[r].cached_tokens >= len(PROMPT) - 1 for r in rids)
    assert len({tuple(out[r].output_ids) for r in rids}) > 1


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_lp")
    return build_hf_model("mixed_b4_gqa4", d), make_engine(model_path=str(d), skip_tokenizer_init=True, load_format="auto")


def test_logprobs_match_transformers_and_rescoring(hf_pair):
    hf, eng = hf_pair
    prompt = list(range(7, 30))
    lp = LogprobOptions(return_logprob=True, top_logprobs_num=3, token_ids_logprob=[5, 9])
    out = solo(eng, prompt, lp, max_new_tokens=10, temperature=0, ignore_eos=True)
    full = prompt + out.output_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    for i, (val, tok) in enumerate(out.logprobs.output_token):
        assert tok == out.output_ids[i]
        assert abs(val - ref[len(prompt) - 1 + i, tok].item()) < 1e-4
        assert out.logprobs.output_top[i][0] == (val, tok)
        assert [t for _, t in out.logprobs.output_ids[i]] == [5, 9]
        assert abs(out.logprobs.output_ids[i][1][0] - ref[len(prompt) - 1 + i, 9].item()) < 1e-4
    score = solo(eng, full, LogprobOptions(return_logprob=True, logprob_start_len=0), max_new_tokens=0)
    assert score.output_ids == [] and score.finish_reason == {"type": "length", "length": 0}
    entries = score.logprobs.input_token
    assert len(entries) == len(full) and entries[0] == (None, full[0])
    for (a, ta), (b, tb) in zip(entries[len(prompt):], out.logprobs.output_token):
        assert ta == tb and abs(a - b) < 1e-4
    start = solo(eng, full, LogprobOptions(return_logprob=True, logprob_start_len=5), max_new_tokens=0)
    assert len(start.logprobs.input_token) == len(full) - 5


def test_output_logprobs_of_a_batch_of_mixed_asks_are_each_one_alone(hf_pair):
    """Rows asking for different top-n and ids, and one asking for none, share each step's logprob table (read back
    with the ids): each request gets the entries it gets alone, and the top entries are the largest, in order."""
    _, eng = hf_pair
    asks = [LogprobOptions(True, top_logprobs_num=1, token_ids_logprob=[9]), LogprobOptions(True, top_logprobs_num=4),
            None, LogprobOptions(True, token_ids_logprob=[3, 5, 9, 2])]
    prompts = [list(range(7 + i, 30 + 3 * i)) for i in range(4)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = [solo(eng, p, lp, **params) for p, lp in zip(prompts, asks)]
    rids = [submit(eng, p, lp, **params)[0] for p, lp in zip(prompts, asks)]
    got = run_all(eng)
    for rid, want, lp in zip(rids, alone, asks):
        g = got[rid]
        assert g.output_ids == want.output_ids and (g.logprobs is None) == (lp is None) == (want.logprobs is None)
        if lp is None:
            continue
        assert len(g.logprobs.output_token) == 6 and len(g.logprobs.output_top) == (6 if lp.top_logprobs_num else 0)
        assert len(g.logprobs.output_ids) == (6 if lp.token_ids_logprob else 0)
        for name in ("output_token", "output_top", "output_ids"):
            for x, y in zip(getattr(g.logprobs, name), getattr(want.logprobs, name)):
                x, y = ([x], [y]) if name == "output_token" else (x, y)  # (one entry, or a list of them)
                assert [t for _, t in x] == [t for _, t in y]
                assert [v for v, _ in x] == pytest.approx([v for v, _ in y], abs=1e-4)
        for (val, tok), top in zip(g.logprobs.output_token, g.logprobs.output_top):
            assert top[0] == (val, tok) and [v for v, _ in top] == sorted((v for v, _ in top), reverse=True)
        for ids in g.logprobs.output_ids:
            assert [t for _, t in ids] == lp.token_ids_logprob
