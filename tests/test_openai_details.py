"""The OpenAI details that OpenAI's API, vLLM and SGLang define and their clients check, on a live
server started with `--max-logprobs 7 --served-model-name tiny --enable-cache-report`: logprob limits (the
flag), logprobs=0, stream_options without stream, the usage fields with cached-token details, seed's int64
range, unknown models, duplicate request ids, vLLM's prompt_logprobs, unsupported parameters, and one
access-log line per request.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.runtime.tokenizer import Tokenizer
from server.args import parse_args
from tests.server_utils import TINY, LiveServer, live_server

MAX_LOGPROBS = 7
MSG = [{"role": "user", "content": "Tell me a story."}]
USAGE = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server("--max-logprobs", str(MAX_LOGPROBS), "--served-model-name", "tiny", "--enable-cache-report") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def completion(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4} | body)


def chat(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 4} | body)


def refused(r: httpx.Response, status: int, *words: str) -> dict:
    body = r.json()
    assert r.status_code == status, body
    assert body["object"] == "error" and body["code"] == status, body
    assert all(w in body["message"] for w in words), body
    return body


def test_logprob_limits_follow_the_flag(http):
    body = refused(chat(http, logprobs=True, top_logprobs=MAX_LOGPROBS + 1), 400, "top_logprobs", str(MAX_LOGPROBS))
    assert body["param"] == "top_logprobs"
    ok = chat(http, logprobs=True, top_logprobs=MAX_LOGPROBS).json()
    assert all(len(t["top_logprobs"]) == MAX_LOGPROBS for t in ok["choices"][0]["logprobs"]["content"])
    body = refused(completion(http, logprobs=6), 400, "logprobs", "5")  # OpenAI's legacy cap, under the flag
    assert body["param"] == "logprobs"
    assert completion(http, logprobs=5).status_code == 200


def test_logprobs_zero_still_returns_the_sampled_token(http):
    lp = completion(http, logprobs=0, max_tokens=5, temperature=1.0).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["token_logprobs"]) == 5
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {token: logprob} and logprob <= 0


def test_stream_options_needs_stream(http):
    for send in (completion, chat):
        for stream in ({"stream": False}, {}):
            refused(send(http, stream_options={"include_usage": True}, **stream), 400, "stream_options")


def test_cache_report_fills_the_cached_tokens(http, server):
    prompt = "A prompt long enough to leave whole pages in the prefix cache for the second request to reuse. " * 4
    first, again = (completion(http, prompt=prompt).json()["usage"] for _ in range(2))
    for usage in (first, again, chat(http).json()["usage"]):
        assert set(usage) == USAGE and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and not usage.model_extra and usage.prompt_tokens_details.cached_tokens >= 0
    assert not usage.prompt_tokens_details.model_extra


def test_cache_report_flag_has_vllms_name_too():
    assert not parse_args([]).enable_cache_report
    assert parse_args(["--enable-cache-report"]).enable_cache_report
    assert parse_args(["--enable-prompt-tokens-details"]).enable_cache_report


def test_seed_must_fit_int64(http, server):
    """A 400 naming the field, with pydantic's error type in the message: vLLM's test looks for it."""
    for seed, kind in ((2 ** 63, "less_than_equal"), (-(2 ** 63) - 1, "greater_than_equal")):
        refused(completion(http, seed=seed), 400, "seed", kind)
        refused(chat(http, seed=seed), 400, "seed", kind)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MSG, seed=2 ** 63)
    assert "less_than_equal" in err.value.message
    assert completion(http, seed=2 ** 63 - 1).status_code == 200
    assert completion(http, seed=-(2 ** 63)).status_code == 200


def test_unknown_model_is_a_404_unless_served_or_an_alias(http, server):
    for send in (completion, chat):
        body = refused(send(http, model="gpt-4o"), 404, "gpt-4o", "tiny")
        assert body["param"] == "model" and body["type"] == "NotFoundError"
        assert send(http, model="tiny").status_code == send(http, model="default").status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)


@pytest.mark.parametrize("route", [completion, chat])
def test_a_request_id_in_flight_is_refused(http, server, route):
    rid = f"dup-{route.__name__}"
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True, "rid": rid}
    with httpx.Client(base_url=server.url, timeout=60) as other, other.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # NOTE: held: a dropped line iterator, once collected, closes the connection
        next(lines)  # the first chunk: the request is in the engine until this stream closes
        refused(route(http, rid=rid), 400, "Duplicate request ID")
        lines.close()


def test_prompt_logprobs_in_vllms_shape(http, server):
    tok = Tokenizer.from_dir(TINY)
    prompt = "Once upon a time there was"
    ids = tok.encode(prompt)
    for k in (2, MAX_LOGPROBS):
        r = completion(http, prompt=prompt, prompt_logprobs=k, max_tokens=1).json()
        plp = r["choices"][0]["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for pos, entry in enumerate(plp[1:], start=1):
            assert str(ids[pos]) in entry  # the prompt's own token, with its rank
            own = entry[str(ids[pos])]
            assert own["rank"] >= 1 and own["logprob"] <= 0 and own["decoded_token"] == tok.decode([ids[pos]])
            tops = sorted((e for t, e in entry.items() if t != str(ids[pos]) or e["rank"] <= abs(k)),
                          key=lambda e: e["rank"])
            want = k
            assert [e["rank"] for e in tops][:want] == list(range(1, want + 1))
            assert len(entry) in (want, want + 1)
            assert all(math.isfinite(e["logprob"]) for e in entry.values())
    c = chat(http, prompt_logprobs=1, max_tokens=1).json()
    assert c["prompt_logprobs"][0] is None and all(len(e) in (1, 2) for e in c["prompt_logprobs"][1:])
    refused(completion(http, prompt_logprobs=MAX_LOGPROBS + 1), 400, "prompt_logprobs", str(MAX_LOGPROBS))
    refused(completion(http, prompt_logprobs=-2), 400, "prompt_logprobs")
    vocab = json.loads((Path(TINY) / "config.json").read_text())["vocab_size"]
    for send in (completion, chat):  # vLLM: -1 asks for the whole vocabulary, which the cap refuses
        body = refused(send(http, prompt_logprobs=-1), 400,
                       f"Requested prompt logprobs of {vocab}, which is greater than max allowed: {MAX_LOGPROBS}")
        assert body["param"] == "prompt_logprobs"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, extra_body={"prompt_logprobs": -1})
    asked = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert asked.prompt_logprobs[0] is None and all(len(e) == 1 for e in asked.prompt_logprobs[1:])
    plain = client.completions.create(model="tiny", prompt=[prompt, "Hi"], max_tokens=1)
    assert [c.prompt_logprobs for c in plain.choices] == [None, None]

def test_unimplemented_parameters_are_refused(http):
    refused(completion(http, best_of=2), 400, "best_of")
    refused(completion(http, use_beam_search=True), 400, "use_beam_search")
    refused(chat(http, use_beam_search=True), 400, "use_beam_search")
    assert completion(http, best_of=1, use_beam_search=False).status_code == 200


def test_every_request_gets_one_access_log_line(http, server):
    marks = [f"acc-{i}" for i in range(3)]
    completion(http, rid=marks[0])
    chat(http, rid=marks[1])
    with http.stream("POST", "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 3,
                                                           "stream": True, "rid": marks[2]}) as r:
        list(r.iter_lines())
    before = server.logs().count("status=404")
    completion(http, model="nope")
    time.sleep(0.5)
    logs = server.logs()
    line = re.compile(r"rid=(\S+) prompt_tokens=(\S+) completion_tokens=(\d+) latency=([\d.]+)s status=(\d+) "
                      r"finish=(\S+) route=(\S+)")
    for mark, route in zip(marks, ["/v1/completions", "/v1/chat/completions", "/v1/chat/completions"]):
        found = [m for m in line.finditer(logs) if m.group(1) == mark]
        assert len(found) == 1, mark
        assert found[0].group(5) == "200" and found[0].group(7) == route and int(found[0].group(2)) > 0
    assert logs.count("status=404") == before + 1
    assert re.search(r"status=404 finish=error route=/v1/completions", logs)
