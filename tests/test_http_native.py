"""Native API black-box tests against a live server: http_api.md §4 behaviours 1-29 and 39.

One module-scoped server (configs/tiny, seeded dummy weights: random but deterministic text) serves
most tests; a second one runs with --skip-tokenizer-init and --incremental-streaming-output.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.http_utils import generate, post_concurrently, sse_frames, stream, wait_pool_idle
from tests.server_utils import live_server

META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
             "weight_version", "num_retractions"}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv():
    with live_server("--max-running-requests", "16", "--context-length", "2048", "--max-total-tokens", "40000",
                     "--enable-metrics", "--max-batch-size", "40", "--max-new-tokens-cap", "20000") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with srv.client() as c:
        yield c


def greedy(client, text, n=12, **extra):
    return generate(client, text=text, sampling_params={**GREEDY, "max_new_tokens": n, **extra})


# ---- 1-4: response shapes ---------------------------------------------------------------------------
def test_01_single_text_gives_one_object_with_meta_info(client):
    res = greedy(client, "The quick brown fox", n=5)
    assert isinstance(res, dict) and isinstance(res["text"], str) and res["text"]
    assert all(isinstance(t, int) for t in res["output_ids"])
    assert META_KEYS <= set(res["meta_info"])
    meta = res["meta_info"]
    assert meta["weight_version"] == "default" and meta["num_retractions"] == 0
    assert len(meta["id"]) == 32 and meta["e2e_latency"] > 0


def test_02_completion_tokens_and_prompt_tokens_from_input_ids(client):
    res = generate(client, input_ids=[5, 17, 300, 42], sampling_params={**GREEDY, "max_new_tokens": 6})
    assert res["meta_info"]["prompt_tokens"] == 4
    assert res["meta_info"]["completion_tokens"] == len(res["output_ids"]) == 6
    put = client.put("/generate", json={"input_ids": [5, 17, 300, 42], "sampling_params": {**GREEDY, "max_new_tokens": 6}})
    assert put.status_code == 200 and put.json()["output_ids"] == res["output_ids"]


def test_03_batches_are_lists_in_input_order_with_distinct_ids(client):
    one = generate(client, text=["Hello"], sampling_params={**GREEDY, "max_new_tokens": 4})
    assert isinstance(one, list) and len(one) == 1
    prompts = ["Alpha beta", "Gamma", "Delta epsilon zeta", "Eta"]
    batch = generate(client, text=prompts, sampling_params={**GREEDY, "max_new_tokens": 6}, rid="batch")
    assert [b["meta_info"]["id"] for b in batch] == [f"batch_{i}" for i in range(4)]
    for p, b in zip(prompts, batch):
        assert b["output_ids"] == greedy(client, p, n=6)["output_ids"]


def test_04_parallel_samples_n3_plain_and_streamed(client):
    res = generate(client, text="Once upon", sampling_params={"n": 3, "temperature": 0.5, "max_new_tokens": 5})
    assert isinstance(res, list) and len(res) == 3
    assert len({r["meta_info"]["id"] for r in res}) == 3
    frames = stream(client, text="Once upon", sampling_params={"n": 3, "temperature": 0.5, "max_new_tokens": 5})
    finals = {f["index"]: f for f in frames if f["meta_info"]["finish_reason"] is not None}
    assert {f["index"] for f in frames} == {0, 1, 2} and set(finals) == {0, 1, 2}
    assert all(f["meta_info"]["completion_tokens"] == 5 for f in finals.values())


# ---- 5-8: finish reasons -----------------------------------------------------------------------------
def test_05_max_new_tokens_with_ignore_eos_finishes_by_length(client):
    res = greedy(client, "Count to ten", n=9)
    assert res["meta_info"]["completion_tokens"] == 9
    assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 9}


def test_06_stop_string_is_matched_and_trimmed_unless_no_stop_trim(client):
    base = greedy(client, "Tell me a story", n=24)["text"]
    start = next(i for i in range(len(base) // 2, len(base) - 3) if "\ufffd" not in base[i:i + 3])
    stop = base[start:start + 3]
    cut = base.find(stop)
    res = greedy(client, "Tell me a story", n=24, stop=stop)
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert res["text"] == base[:cut] and stop not in res["text"]
    kept = greedy(client, "Tell me a story", n=24, stop=[stop], no_stop_trim=True)
    assert kept["text"] == base[:cut + len(stop)] and kept["text"].endswith(stop)


def test_07_eos_is_the_last_output_id_but_not_in_the_text(client):
    eos = 1  # configs/tiny eos_token_id [1, 4]
    res = generate(client, text="Hi", sampling_params={"temperature": 0, "max_new_tokens": 20, "min_new_tokens": 3,
                                                         "logit_bias": {str(eos): 100}})
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert len(res["output_ids"]) == 4 and res["output_ids"][-1] == eos and eos not in res["output_ids"][:-1]
    assert "<|eos|>" not in res["text"] and res["text"]


def test_08_stop_token_ids(client):
    ids = greedy(client, "Stop tokens", n=10)["output_ids"]
    t = ids[3]
    res = greedy(client, "Stop tokens", n=10, stop_token_ids=[t])
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": t}
    assert res["output_ids"] == ids[:ids.index(t) + 1]


# ---- 9-10: streaming ---------------------------------------------------------------------------------
def test_09_stream_framing(client):
    r = client.post("/generate", json={"text": "Frames", "stream": True, "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n") and "event:" not in r.text
    assert len(sse_frames(r.text)) == 4  # one frame per token
    frames = stream(client, text="Frames", sampling_params={**GREEDY, "max_new_tokens": 7, "stream_interval": 3})
    assert [f["meta_info"]["completion_tokens"] for f in frames] == [1, 4, 7]  # coalesced, final always sent


def test_10_greedy_stream_is_cumulative_and_ends_with_the_non_stream_result(client):
    body = {"text": "Streaming is", "sampling_params": {**GREEDY, "max_new_tokens": 16}}
    frames = stream(client, **body)
    for a, b in zip(frames, frames[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert b["meta_info"]["completion_tokens"] > a["meta_info"]["completion_tokens"]
    assert all(f["meta_info"]["finish_reason"] is None and "e2e_latency" not in f["meta_info"] for f in frames[:-1])
    assert "index" not in frames[-1]
    final, plain = frames[-1], generate(client, **body)
    assert final["text"] == plain["text"] and final["output_ids"] == plain["output_ids"]
    for k in ("finish_reason", "prompt_tokens", "completion_tokens"):
        assert final["meta_info"][k] == plain["meta_info"][k]
    assert final["meta_info"]["e2e_latency"] > 0


# ---- 11-14: logprobs ---------------------------------------------------------------------------------
def test_11_logprob_start_len_on_a_batch(client):
    prompts = ["The capital of France is a city", "One two three four five six seven"]
    k = 2
    res = generate(client, text=prompts, sampling_params={**GREEDY, "max_new_tokens": 6}, return_logprob=True,
                   logprob_start_len=k, return_text_in_logprobs=True)
    for p, r in zip(prompts, res):
        m = r["meta_info"]
        assert m["prompt_tokens"] == k + len(m["input_token_logprobs"])
        assert p.endswith("".join(e[2] for e in m["input_token_logprobs"]))
        assert len(m["output_token_logprobs"]) == m["completion_tokens"] == m["output_token_logprobs_length"]
        if "\ufffd" not in r["text"]:
            assert r["text"] == "".join(e[2] for e in m["output_token_logprobs"])


def test_12_logprob_entries_are_triples_and_the_first_input_entry_is_null(client):
    res = generate(client, text="Logprob entries here", sampling_params={"max_new_tokens": 3}, return_logprob=True,
                   logprob_start_len=0)
    m = res["meta_info"]
    assert len(m["input_token_logprobs"]) == m["prompt_tokens"]
    assert m["input_token_logprobs"][0][0] is None
    for e in m["input_token_logprobs"][1:] + m["output_token_logprobs"]:
        assert len(e) == 3 and isinstance(e[0], float) and e[0] <= 0 and isinstance(e[1], int) and e[2] is None
    assert [e[1] for e in m["output_token_logprobs"]] == res["output_ids"]
    assert "input_top_logprobs" not in m and "output_token_ids_logprobs" not in m


def test_13_top_logprobs_greedy_first_alternative_is_the_chosen_token(client):
    res = generate(client, text="Top five", sampling_params={**GREEDY, "max_new_tokens": 5}, return_logprob=True,
                   top_logprobs_num=5, token_ids_logprob=[7, 9])
    m = res["meta_info"]
    assert len(m["output_top_logprobs"]) == m["completion_tokens"] == 5
    for top, chosen in zip(m["output_top_logprobs"], m["output_token_logprobs"]):
        assert len(top) == 5 and top[0] == chosen
        assert [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
    assert [[e[1] for e in pos] for pos in m["output_token_ids_logprobs"]] == [[7, 9]] * 5
    assert m["input_top_logprobs"] == [] and m["input_token_ids_logprobs"] == []


def test_14_sampled_logprobs_match_a_rescoring_of_the_sample(client):
    prompt = [11, 22, 33, 44, 55]
    res = generate(client, input_ids=prompt, sampling_params={"temperature": 1.0, "max_new_tokens": 64,
                                                              "ignore_eos": True}, return_logprob=True)
    out = res["output_ids"]
    rescored = generate(client, input_ids=prompt + out, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                        logprob_start_len=0)
    assert rescored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    span = rescored["meta_info"]["input_token_logprobs"][len(prompt):]
    assert [e[1] for e in span] == out
    for (a, _, _), (b, _, _) in zip(span, res["meta_info"]["output_token_logprobs"]):
        assert abs(a - b) < 0.35
    assert max(abs(a[0] - b[0]) for a, b in zip(span, res["meta_info"]["output_token_logprobs"])) < 1e-2


# ---- 15-16: logit bias, prefix cache -----------------------------------------------------------------
def test_15_logit_bias_forces_and_forbids_without_leaking(srv, client):
    forced = generate(client, text="Bias", sampling_params={"max_new_tokens": 8, "logit_bias": {"77": 100}})
    assert forced["output_ids"] == [77] * 8
    plain = greedy(client, "Forbid", n=8)["output_ids"]
    banned = plain[0]
    res = greedy(client, "Forbid", n=8, logit_bias={str(banned): -100})
    assert banned not in res["output_ids"]
    bodies = [{"text": "Forbid", "sampling_params": {**GREEDY, "max_new_tokens": 8,
                                                      **({"logit_bias": {"99": 100}} if i % 2 else {})}}
              for i in range(6)]
    outs = [r.json()["output_ids"] for r in post_concurrently(srv.url, bodies)]
    assert all(o == ([99] * 8 if i % 2 else plain) for i, o in enumerate(outs))


def test_16_flush_cache_and_cached_token_counts(client):
    wait_pool_idle(client)
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert r.headers["content-type"].startswith("text/plain")
    assert client.get("/flush_cache").status_code == 200
    a = list(range(1000, 1100))
    b = a + list(range(2000, 2200))
    first = generate(client, input_ids=a, sampling_params={"max_new_tokens": 1})
    assert first["meta_info"]["cached_tokens"] == 0
    assert generate(client, input_ids=b, sampling_params={"max_new_tokens": 1})["meta_info"]["cached_tokens"] == 100
    assert generate(client, input_ids=b, sampling_params={"max_new_tokens": 1})["meta_info"]["cached_tokens"] == 299
    assert client.post("/flush_cache").status_code == 200
    assert generate(client, input_ids=b, sampling_params={"max_new_tokens": 1})["meta_info"]["cached_tokens"] == 0


def test_16b_flush_cache_is_refused_while_requests_run(srv, client):
    async def run() -> tuple[int, httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            task = asyncio.ensure_future(c.post("/generate", json={"text": "busy", "sampling_params": {
                **GREEDY, "max_new_tokens": 400}}))  # (~2 s eager: 60 tokens took 0.29 s, under the sleep)
            await asyncio.sleep(0.3)
            flush = await c.post("/flush_cache")
            return flush.status_code, await task
    status, done = asyncio.run(run())
    assert status == 400 and done.status_code == 200


# ---- 17-21: validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("params,message", [
    ({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3."),
    ({"repetition_penalty": 3}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 3."),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
    ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens must be in [0, max_new_tokens(4)], got 5."),
    ({"regex": "a+", "json_schema": "{}"}, "Only one of regex, json_schema, or ebnf can be set."),
    ({"regex": "a+"}, "Constrained decoding (regex) is not supported by this server."),
    ({"bogus": 1}, "unknown sampling parameter 'bogus'"),
    ({"stop": [""]}, "stop cannot contain an empty string."),
])
def test_17_invalid_sampling_params_are_400_with_the_sglang_message(client, params, message):
    for stream_flag in (False, True):
        r = client.post("/generate", json={"text": "x", "sampling_params": params, "stream": stream_flag})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        assert message in r.json()["error"]["message"]


def test_18_missing_input_empty_ids_and_duplicate_rids(client):
    cases = [({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
             ({"input_ids": []}, "input_ids cannot be empty."),
             ({"text": ["a", "b"], "rid": ["same", "same"]}, "Duplicate request ID"),
             ({"text": ["a", "b"], "rid": ["only-one"]}, "should be equal to the batch size"),
             ({"text": "a", "input_ids": [1]}, "not both")]
    for body, message in cases:
        r = client.post("/generate", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)


@pytest.mark.parametrize("body", [{"text": 5}, {"text": "a", "stream": "x"}, {"input_ids": ["a"]},
                                  {"text": "a", "sampling_params": "x"}, {"text": "a", "return_logprob": "yes"},
                                  {"text": "a", "rid": 7}, {"text": "a", "logprob_start_len": 1.5}])
def test_19_wrong_json_types_are_400_never_422(client, body):
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Invalid request")
    assert client.post("/generate", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400


def test_19b_non_json_content_type_is_400_naming_it(client):
    """`curl -d` without `-H` sends form-encoded: the 400 says what to fix (as the OpenAI routes do)."""
    body = b'{"text": "a", "sampling_params": {"max_new_tokens": 2}}'
    r = client.post("/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("Content-Type must be application/json, "
                                            "got 'application/x-www-form-urlencoded'.")
    r = client.post("/generate", content=body)
    assert r.status_code == 400 and r.json()["error"]["message"] == "Content-Type must be application/json, got 'none'."
    r = client.post("/generate", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_20_prompt_longer_than_the_context_is_400(client):
    r = client.post("/generate", json={"input_ids": [7] * 2100})
    assert r.status_code == 400
    assert "The input (2100 tokens) is longer than the model's context length (2048 tokens)." in r.json()["error"]["message"]


def test_21_logprob_start_len_at_or_past_the_prompt_is_400(client):
    r = client.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3})
    assert r.status_code == 400 and "is higher than the number of input tokens" in r.json()["error"]["message"]


def test_server_limits_batch_size_and_max_new_tokens_cap(client):
    r = client.post("/generate", json={"text": ["a"] * 21, "sampling_params": {"n": 2}})
    assert r.status_code == 400 and "--max-batch-size" in r.json()["error"]["message"]
    r = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 20001}})
    assert r.status_code == 400 and "--max-new-tokens-cap" in r.json()["error"]["message"]
    r = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": None}})
    assert r.status_code == 400 and "--max-new-tokens-cap" in r.json()["error"]["message"]
    r = client.post("/generate", json={"text": ["a", "b"], "return_logprob": [True, False],
                                       "sampling_params": {"n": 2}})
    assert r.status_code == 400 and "n > 1" in r.json()["error"]["message"]


# ---- 22-24: aborts -----------------------------------------------------------------------------------
def _running(client) -> tuple[int, int]:
    st = client.get("/server_info").json()["internal_states"][0]
    return st["num_running_reqs"], st["num_queue_reqs"]


def test_22_abort_all_returns_every_request_with_finish_reason_abort(srv, client):
    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as c:
            body = {"text": "Write a very long essay", "sampling_params": {"max_new_tokens": 16000, "ignore_eos": True}}
            tasks = [asyncio.ensure_future(c.post("/generate", json=body)) for _ in range(32)]
            deadline = time.monotonic() + 30
            while True:
                st = (await c.get("/server_info")).json()["internal_states"][0]
                if (st["num_running_reqs"], st["num_queue_reqs"]) == (16, 16):
                    break
                assert time.monotonic() < deadline, st
                await asyncio.sleep(0.05)
            r = await c.post("/abort_request", json={"abort_all": True})
            assert r.status_code == 200 and r.content == b""
            return await asyncio.gather(*tasks)
    results = asyncio.run(run())
    assert all(r.status_code == 200 for r in results)
    reasons = [r.json()["meta_info"]["finish_reason"] for r in results]
    assert all(fr["type"] == "abort" for fr in reasons)
    waiting = [fr for fr in reasons if fr["message"] == "Abort in waiting queue"]
    assert len(waiting) == 16
    assert all(len(r.json()["output_ids"]) == 0 for r in results if r.json()["meta_info"]["finish_reason"] in waiting)
    pools = wait_pool_idle(client)
    assert pools["used_tokens"] == pools["evictable_tokens"]


def test_23_abort_one_rid_leaves_the_others_alone(srv, client):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            long = {"text": "abort me", "rid": "victim", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
            short = [{"text": f"keep {i}", "rid": f"keeper{i}", "sampling_params": {**GREEDY, "max_new_tokens": 30}}
                     for i in range(3)]
            tasks = [asyncio.ensure_future(c.post("/generate", json=b)) for b in [long, *short]]
            await asyncio.sleep(0.3)
            r = await c.post("/abort_request", json={"rid": "victim"})
            assert r.status_code == 200 and r.content == b""
            return await asyncio.gather(*tasks)
    victim, *kept = asyncio.run(run())
    assert victim.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < victim.json()["meta_info"]["completion_tokens"] < 1500
    assert all(k.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 30} for k in kept)
    assert client.post("/abort_request", json={"rid": ""}).status_code == 200
    access = [line for line in srv.logs().splitlines() if "server.access" in line]
    assert any("rid=victim " in line and "status=200 finish=abort" in line for line in access)
    assert any("rid=keeper0 prompt_tokens=" in line and "completion_tokens=30 " in line for line in access)


def test_24_killed_clients_leak_nothing_and_the_server_keeps_serving(srv, client):
    def doomed(i: int) -> None:
        """A client killed after 0.5 s: half stream (closed mid-stream), half wait (read timeout)."""
        body = {"text": f"client {i}", "stream": i % 2 == 0, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        t0 = time.monotonic()
        with httpx.Client(timeout=0.5) as c:
            try:
                with c.stream("POST", srv.url + "/generate", json=body) as r:
                    for _ in r.iter_raw():
                        if time.monotonic() - t0 > 0.5:
                            break
            except httpx.TimeoutException:
                pass

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(doomed, range(16)))
    pools = wait_pool_idle(client, timeout=3)
    assert pools["used_tokens"] == pools["evictable_tokens"]
    assert _running(client) == (0, 0)
    assert greedy(client, "still alive", n=4)["meta_info"]["completion_tokens"] == 4


# ---- 25-29: concurrency, info, health, metrics --------------------------------------------------------
def test_25_concurrent_requests_with_mixed_params_each_get_their_own(srv):
    bodies = [{"text": f"mixed {i}", "sampling_params": {"max_new_tokens": 3 + i % 5, "temperature": 0.7,
                                                         "logit_bias": {str(100 + i): 100}}} for i in range(48)]
    res = post_concurrently(srv.url, bodies)
    for i, r in enumerate(res):
        assert r.status_code == 200
        assert r.json()["output_ids"] == [100 + i] * (3 + i % 5)


def test_26_server_info_concurrently(srv, client):
    with ThreadPoolExecutor(4) as pool:
        infos = list(pool.map(lambda _: httpx.get(srv.url + "/get_server_info", timeout=30), range(4)))
    for r in infos:
        info = r.json()
        assert r.status_code == 200 and isinstance(info["max_total_num_tokens"], int) and isinstance(info["version"], str)
    info = client.get("/server_info").json()
    assert info["max_total_num_tokens"] == 40000 and info["context_len"] == 2048
    assert info["max_req_input_len"] == 2047 and info["status"] == "ready"
    assert info["max_batch_size"] == 40 and info["max_new_tokens_cap"] == 20000
    assert info["model_path"].endswith("configs/tiny") and isinstance(info["internal_states"], list)


def test_27_model_info_and_its_deprecated_alias(client):
    info = client.get("/model_info").json()
    assert set(info) == {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params",
                         "weight_version", "has_image_understanding", "has_audio_understanding", "model_type",
                         "architectures"}
    assert info["is_generation"] is True and info["preferred_sampling_params"] is None
    assert info["model_type"] == "minimax_m3" and info["architectures"] == ["MiniMaxM3SparseForCausalLM"]
    assert client.get("/get_model_info").json() == info


def test_28_health_and_health_generate_alongside_generation(srv, client):
    async def run() -> tuple[int, int, int]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            gen = asyncio.ensure_future(c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 40}}))
            h, hg = await asyncio.gather(c.get("/health"), c.get("/health_generate"))
            return h.status_code, hg.status_code, (await gen).status_code
    assert asyncio.run(run()) == (200, 200, 200)


def test_29_metrics_after_a_streamed_generate(client):
    stream(client, text="metrics", sampling_params={"max_new_tokens": 3})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_total", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds", "num_running_reqs",
                 "num_used_tokens", "token_usage", "gen_throughput", "num_queue_reqs", "num_grammar_queue_reqs",
                 "cache_hit_rate", "spec_accept_length", "cached_tokens_total"):
        assert f"sglang:{name}" in r.text, name
    assert 'model_name="' in r.text and "_sum{" in r.text and "_count{" in r.text and "_bucket{" in r.text


def test_39_greedy_is_deterministic(client):
    a, b = greedy(client, "Determinism", n=20), greedy(client, "Determinism", n=20)
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]


# ---- token-id-only server: --skip-tokenizer-init + --incremental-streaming-output --------------------
@pytest.fixture(scope="module")
def ids_client():
    with live_server("--skip-tokenizer-init", "--incremental-streaming-output", "--max-total-tokens", "8192") as s:
        with s.client() as c:
            yield c


def test_skip_tokenizer_init_takes_ids_only_and_returns_no_text(ids_client):
    r = ids_client.post("/generate", json={"text": "hello"})
    assert r.status_code == 400 and "--skip-tokenizer-init" in r.json()["error"]["message"]
    r = ids_client.post("/generate", json={"input_ids": [3, 4, 5], "sampling_params": {"stop": "x"}})
    assert r.status_code == 400 and "stop strings" in r.json()["error"]["message"]
    res = generate(ids_client, input_ids=[3, 4, 5], sampling_params={**GREEDY, "max_new_tokens": 5})
    assert "text" not in res and len(res["output_ids"]) == 5
    assert ids_client.post("/tokenize", json={"prompt": "a"}).status_code == 400


def test_incremental_streaming_sends_deltas(ids_client):
    body = {"input_ids": [9, 8, 7], "sampling_params": {**GREEDY, "max_new_tokens": 8}, "return_logprob": True}
    plain = generate(ids_client, **body)
    frames = stream(ids_client, **body)
    assert all(len(f["output_ids"]) == 1 for f in frames)
    assert [t for f in frames for t in f["output_ids"]] == plain["output_ids"]
    deltas = [e for f in frames for e in f["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in deltas] == plain["output_ids"]
    assert frames[-1]["meta_info"]["completion_tokens"] == 8


def test_tokenize_and_detokenize_round_trip(client):
    r = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"text": "Hello world"}
    batch = client.post("/tokenize", json={"prompt": ["a b", "c"]}).json()
    assert client.post("/detokenize", json={"tokens": batch["tokens"]}).json() == {"text": ["a b", "c"]}
    assert client.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert json.loads(client.post("/tokenize", json={"prompt": 3}).text)["error"]["message"]


# ---- server-side failures (in-process: the engine's fault hook is a test seam) ---------------------------
def test_server_side_abort_is_http_500_or_an_error_frame_mid_stream(monkeypatch):
    from fastapi.testclient import TestClient

    from engine.runtime.engine import Engine
    from server.__main__ import build_state
    from server.app import create_app
    from server.args import parse_args
    from tests.fault_server import inject

    monkeypatch.setattr(Engine, "_accept", Engine._accept)  # restored after the test
    inject("boom", 2, "simulated device failure")
    state = build_state(parse_args(["--max-total-tokens", "4096", "--disable-cuda-graph"]))
    with TestClient(create_app(state)) as c:
        r = c.post("/generate", json={"text": "x", "rid": "boom1", "sampling_params": {"max_new_tokens": 8}})
        assert r.status_code == 500
        assert r.json() == {"error": {"message": "internal error: simulated device failure"}}
        r = c.post("/generate", json={"text": "x", "rid": "boom2", "stream": True, "sampling_params": {"max_new_tokens": 8}})
        assert r.status_code == 200
        frames = sse_frames(r.text)
        assert [f["meta_info"]["completion_tokens"] for f in frames[:-1]] == [1, 2]
        assert frames[-1] == {"error": {"message": "internal error: simulated device failure", "code": 500}}
        ok = c.post("/generate", json={"text": "x", "rid": "fine", "sampling_params": {"max_new_tokens": 4}})
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4
