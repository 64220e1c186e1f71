"""A server that blames the right party, in-process (the engine built as `python -m server` builds it, so the
engine's classes can be patched): a bug inside the server is a 500 with a request id, logged with its traceback,
while bad input stays a 400 naming the field; --max-new-tokens-cap lowers every generation route's default alike;
/server_info checks the pool's integrity on the engine thread only, under load too.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from engine.runtime.engine import Engine
from engine.runtime.tokenizer import Tokenizer
from server.__main__ import build_state
from server.app import create_app
from server.args import parse_args

CAP = 5
MSG = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    args = ["--max-total-tokens", "8192", "--disable-cuda-graph", "--max-new-tokens-cap", str(CAP),
            "--chunked-prefill-size", "32"]  # long prompts take many steps: load for the integrity test
    with TestClient(create_app(build_state(parse_args(args))), raise_server_exceptions=False) as c:
        yield c


def _message(path: str, body: dict) -> str:
    return body["message"] if path.startswith("/v1/") else body["error"]["message"]


def test_a_server_bug_is_a_500_with_a_request_id_and_bad_input_a_400(client, monkeypatch, caplog):
    encode = Tokenizer.encode

    def buggy(self, text, add_special_tokens=True):
        if "trigger" in text:
            raise ValueError("a bug deep in the tokenizer")
        return encode(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", buggy)
    for path, body in (("/generate", {"text": "trigger"}), ("/v1/completions", {"prompt": "trigger"})):
        with caplog.at_level(logging.ERROR, logger="server.app"):
            r = client.post(path, json=body)
        assert r.status_code == 500, r.text
        rid = r.headers["x-request-id"]
        message = _message(path, r.json())
        assert re.fullmatch(r"[0-9a-f]{32}", rid) and rid in message and "ValueError" in message
        logged = [rec for rec in caplog.records if rid in rec.getMessage()]
        assert len(logged) == 1 and "a bug deep in the tokenizer" in str(logged[0].exc_info[1])

    bad = [("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
           ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "bogus"),  # SamplingParams.from_dict
           ("/generate", {"input_ids": [10 ** 6]}, "input_ids"),  # the engine's own validation
           ("/generate", {"text": ["a", "b"], "rid": ["only-one"]}, "rids"),  # the route's batch rules
           ("/pools/layers/0/buffers/nope", None, "nope"),  # the pool's unknown buffer name
           ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
           ("/v1/chat/completions", {"messages": MSG, "n": 0}, "n must be")]
    for path, body, field in bad:
        r = client.get(path) if body is None else client.post(path, json=body)
        assert r.status_code == 400 and field in _message(path, r.json()), (path, r.text)
        assert "x-request-id" not in r.headers


def test_the_cap_lowers_each_routes_default_and_refuses_more(client):
    native = client.post("/generate", json={"text": "x", "sampling_params": {"ignore_eos": True}}).json()
    assert native["meta_info"]["completion_tokens"] == CAP  # the default 128, lowered
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSG})):
        r = client.post(path, json=body | {"ignore_eos": True})  # the defaults: 16 and none
        assert r.json()["usage"]["completion_tokens"] == CAP, r.text
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": CAP - 2, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == CAP - 2
    for path, body in (("/generate", {"text": "x", "sampling_params": {"max_new_tokens": CAP + 1}}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": CAP + 1}),
                       ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": CAP + 1})):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "--max-new-tokens-cap" in _message(path, r.json()), r.text


def test_server_info_checks_integrity_on_the_engine_thread_only(client, monkeypatch):
    seen: list[str] = []
    check = Engine.check_integrity

    def recorded(self):
        seen.append(threading.current_thread().name)
        return check(self)

    monkeypatch.setattr(Engine, "check_integrity", recorded)
    load = {"input_ids": list(range(10, 650)), "sampling_params": {"max_new_tokens": CAP, "ignore_eos": True}}
    with ThreadPoolExecutor(18) as pool:
        gens = [pool.submit(client.post, "/generate", json=load) for _ in range(6)]
        infos = [pool.submit(client.get, "/server_info") for _ in range(12)]
        states = [f.result().json()["internal_states"][0] for f in infos]
        assert all(g.result().status_code == 200 for g in gens)
    assert all(s["integrity_ok"] is True for s in states)
    assert any(s["num_running_reqs"] + s["num_queue_reqs"] > 0 for s in states)  # checked under load
    assert seen == ["engine"] * len(infos)
    ae = client.app.state.server.async_engine
    with pytest.raises(RuntimeError, match="engine thread"):
        ae._integrity_ok()  # the check refuses any other thread


def test_every_optional_int_engine_field_is_an_int_flag():
    """EngineArgs' `int | None` fields (their type hints, resolved) parse as integers: server/args.py finds them by
    their annotation's text, which a spelling such as Optional[int] would miss."""
    from dataclasses import fields
    from typing import get_type_hints

    from engine.runtime.engine_args import EngineArgs

    hints = get_type_hints(EngineArgs)
    names = [f.name for f in fields(EngineArgs) if hints[f.name] == int | None]
    assert "cuda_graph_max_bs" in names and "kv_cache_bytes" in names
    for name in names:
        assert getattr(parse_args([f"--{name.replace('_', '-')}", "7"]).engine, name) == 7, name
