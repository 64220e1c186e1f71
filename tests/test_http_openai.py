"""Black-box tests of the OpenAI-compatible routes (http_api.md §3, §4 items 30-37) on a live server.

One server of the default model (configs/tiny: random weights, byte-level BPE, ChatML template) serves
the whole module; requests go through both httpx and the official `openai` client. The tiny model
generates random text, so finish reasons are forced with logit_bias.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from starlette.requests import ClientDisconnect

from engine.runtime.request import RequestOutput
from engine.runtime.tokenizer import Tokenizer
from server.async_engine import Channel
from server.errors import sse_error
from server.submission import SSEResponse, Submission
from server.submission import sse_frames as submission_frames
from tests.server_utils import TINY, LiveServer, live_server

PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TINY)


@pytest.fixture(scope="module")
def model_name(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def sse_frames(resp: httpx.Response) -> list[dict]:
    """Parse an SSE body strictly: only `data: ` lines, JSON each, ending with `data: [DONE]`."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in resp.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    assert lines.count("data: [DONE]") == 1
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def chat_prompt_len(tok: Tokenizer, messages: list[dict]) -> int:
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False))


# ---- item 30: models ----------------------------------------------------------------------------------
def test_model_list_and_retrieve(http: httpx.Client, oai: openai.OpenAI, model_name: str) -> None:
    body = http.get("/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "sglang" and card["parent"] is None
    assert isinstance(card["max_model_len"], int) and isinstance(card["created"], int)
    assert [m.id for m in oai.models.list()] == [model_name]
    got = oai.models.retrieve(model_name)
    assert got.id == got.root == model_name
    assert http.get(f"/v1/models/{model_name}").json() == card


def test_unknown_model_is_404(http: httpx.Client, oai: openai.OpenAI) -> None:
    r = http.get("/v1/models/x")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model 'x' does not exist", "type": "invalid_request_error",
                                  "param": "model", "code": "model_not_found"}}
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


# ---- item 31: the completions grid ---------------------------------------------------------------------
@pytest.mark.parametrize("echo,logprobs,use_list,n,token_ids",
                         list(itertools.product([False, True], [None, 5], [False, True], [1, 2], [False, True])))
def test_completion_grid(oai: openai.OpenAI, tok: Tokenizer, echo: bool, logprobs: int | None, use_list: bool,
                         n: int, token_ids: bool) -> None:
    prompts = [PROMPT, "Once upon a time"] if use_list else [PROMPT]
    ids = [tok.encode(p) for p in prompts]
    if token_ids:
        prompt_arg = ids if use_list else ids[0]
    else:
        prompt_arg = prompts if use_list else prompts[0]
    r = oai.completions.create(model="default", prompt=prompt_arg, max_tokens=8, temperature=0.8, n=n,
                               echo=echo, logprobs=logprobs, extra_body={"ignore_eos": True})
    assert r.id and r.created > 0 and r.object == "text_completion"
    assert len(r.choices) == len(prompts) * n
    assert [c.index for c in r.choices] == list(range(len(prompts) * n))
    for c in r.choices:
        assert isinstance(c.text, str)
        if echo:
            assert c.text.startswith(prompts[c.index // n])
        if logprobs:
            assert isinstance(c.logprobs.tokens[0], str)
            assert isinstance(c.logprobs.top_logprobs[1], dict) and len(c.logprobs.top_logprobs[1]) > 0
            prompt_entries = len(ids[c.index // n]) if echo else 0
            assert len(c.logprobs.tokens) == prompt_entries + 8 == len(c.logprobs.token_logprobs)
            assert (c.logprobs.token_logprobs[0] is None) == echo
        else:
            assert c.logprobs is None
    assert r.usage.prompt_tokens == sum(len(x) for x in ids)
    assert r.usage.completion_tokens == 8 * len(prompts) * n
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens > 0


def test_completion_raw_shape(http: httpx.Client, tok: Tokenizer) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 3,
                                           "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200, body
    assert set(body) == {"id", "object", "created", "model", "choices", "usage", "metadata"}
    assert body["model"] == "default" and body["metadata"] == {"weight_version": "default"}
    n = len(tok.encode(PROMPT))  # OpenAI's fields; no cached-token details without --enable-cache-report
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 4, "total_tokens": n + 4,
                             "prompt_tokens_details": None}
    choice = body["choices"][0]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason", "matched_stop", "prompt_logprobs"}
    assert choice["prompt_logprobs"] is None  # vLLM's key, null when not asked
    assert (choice["finish_reason"], choice["matched_stop"]) == ("length", None)
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert all(len(top) == 3 for top in lp["top_logprobs"])
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    # greedy: the chosen token is the most likely one
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen == pytest.approx(max(top.values()))


def test_token_id_prompt_with_echo_returns_decoded_prompt(http: httpx.Client, tok: Tokenizer) -> None:
    ids = tok.encode("Hello there, general")
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(tok.decode(ids))
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


# ---- item 32: completion stream with usage ---------------------------------------------------------------
def test_completion_stream_usage(oai: openai.OpenAI, http: httpx.Client, tok: Tokenizer) -> None:
    stream = oai.completions.create(model="default", prompt=[PROMPT, "Hi"], max_tokens=6, n=2, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in finished
                finished[c.index] = c.finish_reason
    assert sorted(texts) == sorted(finished) == [0, 1, 2, 3]
    assert set(finished.values()) <= {"length", "stop"}
    assert usage is not None
    assert usage.prompt_tokens == len(tok.encode(PROMPT)) + len(tok.encode("Hi"))
    assert usage.completion_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "stream": True, "echo": True,
                                           "logprobs": 2, "temperature": 0})
    frames = sse_frames(r)
    assert all("usage" not in f for f in frames)
    assert frames[0]["choices"][0]["text"].startswith(PROMPT)
    entries = sum(len(f["choices"][0]["logprobs"]["tokens"]) for f in frames)
    assert entries == len(tok.encode(PROMPT)) + 5
    assert [f["choices"][0]["finish_reason"] for f in frames][-1] == "length"
    plain = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "echo": True, "temperature": 0})
    assert "".join(f["choices"][0]["text"] for f in frames) == plain.json()["choices"][0]["text"]


# ---- item 33: chat ---------------------------------------------------------------------------------------
def test_chat_completion(oai: openai.OpenAI, tok: Tokenizer) -> None:
    r = oai.chat.completions.create(model="default", messages=CHAT, max_tokens=6, n=2, logprobs=True,
                                    top_logprobs=5, temperature=0.7, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.object == "chat.completion"
    assert len(r.id) == 32 and int(r.id, 16) >= 0  # a uuid hex
    for c in r.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert len(c.logprobs.content) == 6
        for entry in c.logprobs.content:
            assert isinstance(entry.token, str) and entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 5
    assert r.usage.prompt_tokens == chat_prompt_len(tok, CHAT)
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_raw_shape(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 3, "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200, body
    assert set(body) == {"id", "object", "created", "model", "choices", "usage", "metadata", "prompt_logprobs"}
    assert body["prompt_logprobs"] is None
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": choice["message"]["content"],
                                 "reasoning_content": None, "tool_calls": None}
    assert choice["logprobs"] is None and choice["finish_reason"] == "length" and choice["matched_stop"] is None
    assert body["usage"]["completion_tokens"] == 3


def test_continue_final_message(http: httpx.Client, tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two"}]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "continue_final_message": True})
    assert r.status_code == 200, r.text
    prefix = tok.apply_chat_template(msgs[:1], add_generation_prompt=True) + "one two"
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(prefix, add_special_tokens=False))
    bad = http.post("/v1/chat/completions", json={"messages": msgs[:1], "continue_final_message": True})
    assert bad.status_code == 400 and "assistant" in bad.json()["message"]


# ---- item 34: chat stream framing ------------------------------------------------------------------------
def test_chat_stream_framing(http: httpx.Client, oai: openai.OpenAI) -> None:
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "n": 2, "stream": True, "ignore_eos": True,
                                                "stream_options": {"include_usage": True}, "logprobs": True})
    frames = sse_frames(r)
    assert len({f["id"] for f in frames}) == 1
    assert all(f["object"] == "chat.completion.chunk" for f in frames)
    usage = frames[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    per_index: dict[int, list[dict]] = {0: [], 1: []}
    for f in frames[:-1]:
        assert "usage" not in f and len(f["choices"]) == 1
        per_index[f["choices"][0]["index"]].append(f["choices"][0])
    for choices in per_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        ends = [c for c in choices if c["finish_reason"] is not None]
        assert len(ends) == 1 and ends[0] is choices[-1]
        assert ends[0]["delta"] == {} and ends[0]["finish_reason"] == "length" and ends[0]["matched_stop"] is None
        assert sum(len(c["logprobs"]["content"]) for c in choices[1:-1]) == 5

    roles, finishes = [], []
    for chunk in oai.chat.completions.create(model="default", messages=CHAT, max_tokens=4, stream=True,
                                              extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            finishes += [c.finish_reason] if c.finish_reason else []
    assert roles == ["assistant"] and finishes == ["length"]


def test_usage_equals_the_clients_completion_usage(oai: openai.OpenAI, tok: Tokenizer) -> None:
    """vLLM's tests compare usage with CompletionUsage(...): pydantic's equality counts every extra field."""
    n = len(tok.encode(PROMPT))
    c = oai.completions.create(model="default", prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True})
    assert c.usage == CompletionUsage(prompt_tokens=n, completion_tokens=5, total_tokens=n + 5)
    assert not c.usage.model_extra and c.usage.prompt_tokens_details is None
    assert c.choices[0].prompt_logprobs is None  # vLLM's key, sent as null when not asked
    chat = oai.chat.completions.create(model="default", messages=CHAT, max_completion_tokens=5,
                                       extra_body={"ignore_eos": True})
    m = chat_prompt_len(tok, CHAT)
    assert chat.usage == CompletionUsage(prompt_tokens=m, completion_tokens=5, total_tokens=m + 5)
    assert chat.prompt_logprobs is None
    *_, last = oai.chat.completions.create(model="default", messages=CHAT, max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    assert last.choices == [] and last.usage == CompletionUsage(prompt_tokens=m, completion_tokens=3, total_tokens=m + 3)


def test_continuous_usage_stats(http: httpx.Client, oai: openai.OpenAI) -> None:
    """vLLM's shape (its extension): usage on every chunk, rising on every chunk with choices, so the last token's
    chunk carries the finish; the usage chunk repeats the count. Without it the finish has a chunk of its own."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = {"model": "default", "messages": CHAT, "max_completion_tokens": 10, "temperature": 0,
          "extra_body": {"min_tokens": 10}}
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options=opts))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and chunks[0].choices[0].delta.role == "assistant"
    assert all(b > a for a, b in zip(counts, counts[1:-1])) and counts[-2:] == [10, 10], counts
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert finished == [chunks[-2]] and finished[0].choices[0].delta.content is not None
    assert chunks[-1].choices == []
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == oai.chat.completions.create(**kw).choices[0].message.content
    frames = sse_frames(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True,
                                                           "ignore_eos": True, "stream_options": opts}))
    counts = [f["usage"]["completion_tokens"] for f in frames]
    assert counts[0] >= 1 and all(b > a for a, b in zip(counts, counts[1:-1])) and counts[-2:] == [4, 4], counts
    assert frames[-2]["choices"][0]["finish_reason"] == "length" and frames[-1]["choices"] == []
    assert all("prompt_logprobs" not in c for f in frames for c in f["choices"])


def test_greedy_chat_stream_equals_non_stream(http: httpx.Client, oai: openai.OpenAI) -> None:
    kw = {"model": "default", "messages": CHAT, "max_tokens": 24, "temperature": 0}
    full = oai.chat.completions.create(**kw)
    parts = [c.delta.content or "" for chunk in oai.chat.completions.create(**kw, stream=True)
             for c in chunk.choices]
    assert "".join(parts) == full.choices[0].message.content
    completion = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0}).json()
    frames = sse_frames(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                           "stream": True}))
    assert "".join(f["choices"][0]["text"] for f in frames) == completion["choices"][0]["text"]


def test_seed_is_reproducible(oai: openai.OpenAI) -> None:
    a, b = (oai.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1234)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


# ---- item 35: finish fields ------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("case", ["newline", "eos", "length"])
def test_finish_fields(http: httpx.Client, tok: Tokenizer, route: str, case: str) -> None:
    newline = tok.encode("\n")
    assert len(newline) == 1
    eos = tok.eos_token_id
    extra = {"newline": {"stop": ["\n"], "logit_bias": {str(newline[0]): 100}},
             "eos": {"logit_bias": {str(eos): 100}},
             "length": {"max_tokens": 5, "ignore_eos": True}}[case]
    body = {"temperature": 0, "max_tokens": 16, **extra}
    if route == "completions":
        r = http.post("/v1/completions", json={"prompt": PROMPT, **body})
    else:
        r = http.post("/v1/chat/completions", json={"messages": CHAT, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    expected = {"newline": ("stop", "\n"), "eos": ("stop", eos), "length": ("length", None)}[case]
    assert (choice["finish_reason"], choice["matched_stop"]) == expected
    text = choice["text"] if route == "completions" else choice["message"]["content"]
    if case != "length":
        assert text == ""  # the stop string / EOS is trimmed
    assert r.json()["usage"]["completion_tokens"] == (5 if case == "length" else 1)


# ---- item 36: error bodies -------------------------------------------------------------------------------
def _assert_openai_400(r: httpx.Response, needle: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["object"] == "error" and body["type"] == "BadRequestError" and body["code"] == 400
    assert body["param"] is None and needle in body["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_error_body(http: httpx.Client, route: str, stream: bool) -> None:
    base = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": CHAT}
    cases = [({"temperature": -1}, "temperature must be a non-negative finite number"),
             ({"top_p": 1.5}, "top_p must be in (0, 1]"),
             ({"max_tokens": 0}, "max_tokens"),
             ({"n": 0}, "n must be in"),
             ({"logit_bias": {"999999": 1}}, "logit_bias must has keys in"),
             ({"regex": "a+"}, "not supported"),
             ({"stream": "x"}, "stream"),
             ({"stop": 5}, "stop"),
             ({"stop": ["end", ""]}, "stop cannot contain an empty string.")]
    for extra, needle in cases:
        _assert_openai_400(http.post(route, json={**base, "stream": stream, **extra}), needle)
    _assert_openai_400(http.post(route, content=json.dumps(base), headers={"content-type": "text/plain"}),
                       "application/json")
    _assert_openai_400(http.post(route, content=b"{not json", headers={"content-type": "application/json"}),
                       "Invalid request")


def test_error_body_openai_client_and_prompts(http: httpx.Client, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="default", prompt=PROMPT, temperature=-1)
    assert err.value.status_code == 400 and err.value.body["type"] == "BadRequestError"
    for prompt in ("", [], [[]], ["a", ""]):
        _assert_openai_400(http.post("/v1/completions", json={"prompt": prompt}), "Prompt cannot be empty")
    _assert_openai_400(http.post("/v1/completions", json={"prompt": 5}), "prompt")
    _assert_openai_400(http.post("/v1/completions", json={}), "prompt")
    _assert_openai_400(http.post("/v1/chat/completions", json={"messages": []}), "messages")
    _assert_openai_400(http.post("/v1/chat/completions", json={"messages": CHAT, "top_logprobs": 2}),
                       "top_logprobs")


def test_context_length_errors(http: httpx.Client, tok: Tokenizer) -> None:
    ctx = http.get("/v1/models").json()["data"][0]["max_model_len"]
    n_prompt = len(tok.encode(PROMPT))
    msg = f"Requested token count exceeds the model's maximum context length of {ctx} tokens"
    _assert_openai_400(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": ctx}), msg)
    _assert_openai_400(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": ctx, "stream": True}),
                       msg)
    _assert_openai_400(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": ctx}), msg)
    ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": ctx - n_prompt, "n": 1,
                                            "stop_token_ids": list(range(4096)), "min_tokens": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop"  # prompt + max == ctx
    _assert_openai_400(http.post("/v1/completions", json={"prompt": [7] * ctx}),
                       "is longer than the model's context length")


# ---- item 37: penalties ----------------------------------------------------------------------------------
def test_frequency_penalty(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model="default", prompt=PROMPT, max_tokens=12, frequency_penalty=1.0,
                               presence_penalty=0.5)
    assert isinstance(r.choices[0].text, str)
    c = oai.chat.completions.create(model="default", messages=CHAT, max_tokens=12, frequency_penalty=1.0,
                                    extra_body={"repetition_penalty": 1.2, "top_k": 20, "min_p": 0.05})
    assert isinstance(c.choices[0].message.content, str)


# ---- disconnects abort -----------------------------------------------------------------------------------
def _rid_frees_up(http: httpx.Client, rid: str, within: float = 5.0) -> bool:
    """A rid can be reused once its request has ended (the engine refuses rids in flight)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "rid": rid})
        if r.status_code == 200:
            return True
        assert "Duplicate request ID" in r.json()["message"]
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(server: LiveServer, http: httpx.Client, stream: bool) -> None:
    rid = f"disconnect-{stream}"
    body = {"messages": CHAT, "max_tokens": 20000, "ignore_eos": True, "stream": stream, "rid": rid}
    with server.client(timeout=0.5) as c:
        if stream:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/chat/completions", json=body)
    assert _rid_frees_up(http, rid)  # 20000 tokens would take far longer than 5 s
    assert server.logs().count(f"Abort request rid={rid}") == 1  # the line SGLang's leak checks look for


# ---- in-process: the stream machinery with a stand-in engine -----------------------------------------
class _FakeEngine:
    """Stands in for AsyncEngine: queues scripted outputs on a real Channel; records aborts."""

    def __init__(self, script: list[RequestOutput], rids: list[str]) -> None:
        self.script, self.rids = script, rids
        self.aborted: list[str] = []

    def submit(self, reqs):
        channel = Channel()
        for out in self.script:
            channel.put_nowait(self.rids.index(out.rid), out)
        return list(self.rids), channel

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def _out(rid: str, ids: list[int], text: str, reason: dict | None) -> RequestOutput:
    return RequestOutput(rid=rid, new_ids=ids, new_text=text, logprobs=None, completion_tokens=len(ids),
                         prompt_tokens=3, cached_tokens=0, finished=reason is not None, finish_reason=reason)


def _frames(sub: Submission, path: str = "/v1/chat/completions"):
    return submission_frames(sub, lambda i, out: f"data: {json.dumps({'i': i, 'text': out.new_text})}\n\n",
                      lambda status, message: sse_error(path, status, message))


def test_stream_error_after_start_is_an_error_event() -> None:
    fail = {"type": "abort", "message": "internal error in the engine: boom", "status_code": 500}
    fake = _FakeEngine([_out("a", [5], "x", None), _out("a", [], "", fail)], ["a"])
    sub = Submission(fake, [], "/v1/chat/completions")  # type: ignore[arg-type]

    async def drain() -> list[str]:
        return [f async for f in _frames(sub)]

    frames = asyncio.run(drain())
    assert frames[-1] == "data: [DONE]\n\n"
    err = json.loads(frames[-2][len("data: "):])
    assert err == {"error": {"message": "internal error in the engine: boom", "type": "InternalServerError",
                             "param": None, "code": 500}}
    assert json.loads(frames[0][len("data: "):]) == {"i": 0, "text": "x"}
    assert sub.joined[0].text == "x" and sub.joined[0].finished


def test_closing_a_stream_aborts_unfinished_samples() -> None:
    done = {"type": "length", "length": 1}
    fake = _FakeEngine([_out("r_0", [5], "x", done), _out("r_1", [6], "y", None)], ["r_0", "r_1"])
    sub = Submission(fake, [], "/v1/completions")  # type: ignore[arg-type]
    resp = SSEResponse(_frames(sub, "/v1/completions"), sub)

    async def read_then_close() -> None:
        frames = resp.body_iterator
        for _ in range(2):
            await anext(frames)  # type: ignore[call-overload]
        await frames.aclose()  # type: ignore[attr-defined]
        sub.close()  # what SSEResponse does once the client is gone

    asyncio.run(read_then_close())
    assert fake.aborted == ["r_1"]


def test_client_gone_before_first_frame_aborts_all() -> None:
    fake = _FakeEngine([], ["a"])
    sub = Submission(fake, [], "/v1/completions")  # type: ignore[arg-type]
    resp = SSEResponse(_frames(sub, "/v1/completions"), sub)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        raise OSError("client went away")

    with pytest.raises((OSError, ClientDisconnect)):
        asyncio.run(resp({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert fake.aborted == ["a"]  # no frame was ever produced, so only the response's close could abort it


def test_default_logprob_cap_is_vllms_20(http: httpx.Client) -> None:
    body = {"messages": CHAT, "max_tokens": 1, "logprobs": True}
    r = http.post("/v1/chat/completions", json=body | {"top_logprobs": 21})
    assert r.status_code == 400 and "20" in r.json()["message"] and r.json()["param"] == "top_logprobs"
    assert http.post("/v1/chat/completions", json=body | {"top_logprobs": 20}).status_code == 200
