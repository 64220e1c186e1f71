"""Bad input against a live server: a schemathesis run over the server's own /openapi.json, and a
hand-written table of hostile bodies. Nothing may be a 5xx; every 4xx is in its route's envelope
(native `{"error": {"message"}}`, /v1/* OpenAI's flat error object); the server keeps serving.

The server runs with small limits so generated requests stay cheap: --max-new-tokens-cap 16 and
--context-length 2048 (--max-batch-size and --max-request-bytes keep their defaults: 256, 1 MiB).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode

from tests.reliability_utils import check_envelope, three_checks
from tests.server_utils import live_server

CAP, CTX = 16, 2048
MAX_EXAMPLES = 12  # per operation and generation mode (positive, negative); derandomized


@pytest.fixture(scope="module")
def srv():
    with live_server("--context-length", str(CTX), "--max-total-tokens", "16384", "--max-new-tokens-cap", str(CAP),
                     "--enable-metrics") as s:
        yield s


# ---- limits ------------------------------------------------------------------------------------------
def test_limits_are_flags_reported_in_server_info(client, reference):
    info = client.get("/server_info").json()
    assert info["max_request_bytes"] == 1 << 20 and info["max_batch_size"] == 256
    assert info["max_new_tokens_cap"] == CAP and info["context_len"] == CTX
    assert info["internal_states"][0]["integrity_ok"] is True


# ---- schemathesis: every operation of /openapi.json ---------------------------------------------------
def _operations() -> list[tuple[str, str]]:
    """(METHOD, path) of every operation the app documents (read in-process, no server needed)."""
    from server.app import create_app
    from server.args import ServerArgs
    from server.state import ServerState

    app = create_app(ServerState(args=ServerArgs(), engine=None, async_engine=None))  # type: ignore[arg-type]
    return [(m.upper(), p) for p, item in app.openapi()["paths"].items() for m in item]


OPERATIONS = _operations()


@pytest.fixture(scope="module")
def api_schema(srv):
    return schemathesis.openapi.from_url(srv.url + "/openapi.json")


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


def test_openapi_documents_every_route_with_its_body():
    paths = {p for _, p in OPERATIONS}
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/abort_request", "/tokenize",
            "/pools/layers/{layer_id}/buffers/{buffer}", "/health", "/flush_cache"} <= paths
    from server.app import create_app
    from server.args import ServerArgs
    from server.state import ServerState

    doc = create_app(ServerState(args=ServerArgs(), engine=None, async_engine=None)).openapi()  # type: ignore[arg-type]
    for path in ("/v1/completions", "/v1/chat/completions"):  # parsed by hand: documented explicitly
        assert "requestBody" in doc["paths"][path]["post"]
    assert all("422" not in op["responses"] for item in doc["paths"].values() for op in item.values())


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_schemathesis_no_5xx_and_errors_in_the_route_envelope(api_schema, srv, session, method, path):
    op = api_schema[path][method]
    seen: dict[int, int] = {}

    def check(case: Any) -> None:
        resp = case.call(base_url=srv.url, session=session, timeout=60)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        where = f"{case.as_curl_command(base_url=srv.url)} -> {resp.status_code} {resp.content[:300]!r}"
        assert resp.status_code < 500, where
        if resp.status_code >= 400:
            assert resp.headers.get("content-type", [""])[0].startswith("application/json"), where
            check_envelope(path, resp.status_code, json.loads(resp.content))

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        run = settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
                       phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))(
            given(case=op.as_strategy(generation_mode=mode))(check))
        try:
            run()
        except Unsatisfiable:
            # no invalid input exists for an operation without a body whose parameters are all free strings
            # (GET /health has none, GET /v1/models/{model_id} takes any string): only negative mode may fail
            params = [p.definition for p in op.iter_parameters()]
            assert mode == GenerationMode.NEGATIVE and not op.body, path
            assert all(p.get("schema", {}).get("type") == "string" for p in params), (path, params)
    assert seen, "no request was made"


# ---- hand-written table ---------------------------------------------------------------------------------
NESTED = b"[" * 100_000 + b"]" * 100_000
BIG = 10 * 1024 * 1024
Q = "What is the capital of France?"
MSG = [{"role": "user", "content": Q}]


def raw(data: bytes) -> dict[str, Any]:
    return {"content": data}


G, C, CH = "/generate", "/v1/completions", "/v1/chat/completions"
# (route, request kwargs for httpx, expected status, fragment of the error message or of the body)
CASES = [
    # wrong JSON types
    (G, {"json": {"text": 5}}, 400, "text must be a string"),
    (G, {"json": {"text": "a", "stream": "yes"}}, 400, "stream must be a boolean"),
    (G, {"json": {"input_ids": [1, "2"]}}, 400, "input_ids must be a list of integer token ids"),
    (G, {"json": {"text": "a", "sampling_params": [1]}}, 400, "sampling_params must be an object"),
    (G, {"json": {"text": "a", "sampling_params": {"max_new_tokens": "5"}}}, 400, "max_new_tokens must be an integer"),
    (G, {"json": {"text": "a", "sampling_params": {"temperature": "hot"}}}, 400, "temperature must be a number"),
    (C, {"json": {"prompt": {"a": 1}}}, 400, "Invalid request: prompt"),
    (C, {"json": {"prompt": Q, "temperature": "hot"}}, 400, "Invalid request: temperature"),
    (CH, {"json": {"messages": "hello"}}, 400, "Invalid request: messages"),
    (CH, {"json": {"messages": [{"content": "no role"}]}}, 400, "Invalid request: messages.0.role"),
    # NaN, infinities, huge numbers (Python's json accepts NaN/Infinity literals: so do both parsers here)
    (G, raw(b'{"text":"a","sampling_params":{"temperature":NaN}}'), 400, "temperature must be a non-negative finite number, got nan"),
    (G, raw(b'{"text":"a","sampling_params":{"temperature":Infinity}}'), 400, "got inf"),
    (G, raw(b'{"text":"a","sampling_params":{"top_p":Infinity}}'), 400, "top_p must be in (0, 1], got inf"),
    (G, raw(b'{"text":"a","sampling_params":{"top_p":NaN}}'), 400, "top_p must be in (0, 1], got nan"),
    (G, raw(b'{"text":"a","sampling_params":{"min_p":NaN}}'), 400, "min_p must be in [0, 1]"),
    (G, raw(b'{"text":"a","sampling_params":{"logit_bias":{"5":NaN}}}'), 400, "logit_bias values must be finite"),
    (G, raw(b'{"text":"a","sampling_params":{"max_new_tokens":1e30}}'), 400, "--max-new-tokens-cap"),
    (G, raw(b'{"text":"a","sampling_params":{"max_new_tokens":1000000000000000000000000000000}}'), 400,
     "--max-new-tokens-cap"),
    (G, raw(b'{"text":"a","sampling_params":{"max_new_tokens":1e400}}'), 400, "max_new_tokens must be an integer"),
    (G, raw(b'{"text":"a","sampling_params":{"sampling_seed":1e300}}'), 400, "sampling_seed must be in"),
    (G, raw(b'{"text":"a","sampling_params":{"n":100000000000000000000}}'), 400, "n must be in [1, 128]"),
    (G, raw(b'{"text":"a","return_logprob":true,"logprob_start_len":100000000000000000000}'), 400,
     "is higher than the number of input tokens"),
    (C, raw(b'{"prompt":"a","temperature":NaN}'), 400, "temperature must be a non-negative finite number"),
    (C, raw(b'{"prompt":"a","top_p":Infinity}'), 400, "top_p must be in (0, 1], got inf"),
    (C, raw(b'{"prompt":"a","max_tokens":1e30}'), 400, "Invalid request: max_tokens"),
    (C, raw(b'{"prompt":"a","max_tokens":1000000000000000000000000000000}'), 400, "exceeds this server's limit"),
    (C, raw(b'{"prompt":"a","n":100000000000000000000}'), 400, "n must be in [1, 128]"),
    (CH, {"content": json.dumps({"messages": MSG, "temperature": float("nan")}).encode()}, 400,
     "temperature must be a non-negative finite number"),
    (CH, raw(b'{"messages":[{"role":"user","content":"a"}],"top_p":Infinity}'), 400, "top_p must be in (0, 1]"),
    (CH, raw(b'{"messages":[{"role":"user","content":"a"}],"max_tokens":1e30}'), 400, "Invalid request: max_tokens"),
    # negative lengths and counts
    (G, {"json": {"text": "a", "sampling_params": {"max_new_tokens": -1}}}, 400, "max_new_tokens must be at least 0, got -1."),
    (G, {"json": {"text": "a", "sampling_params": {"min_new_tokens": -3}}}, 400, "min_new_tokens must be in"),
    (G, {"json": {"text": "a", "sampling_params": {"n": 0}}}, 400, "n must be in [1, 128], got 0."),
    (G, {"json": {"text": "a", "sampling_params": {"stream_interval": -2}}}, 400, "stream_interval must be at least 1"),
    (G, {"json": {"text": "a", "return_logprob": True, "top_logprobs_num": -1}}, 400, "top_logprobs_num must be at least 0"),
    (C, {"json": {"prompt": "a", "max_tokens": -1}}, 400, "max_tokens must be positive"),
    (C, {"json": {"prompt": "a", "max_tokens": 0}}, 400, "max_tokens must be positive"),
    (C, {"json": {"prompt": "a", "logprobs": -1}}, 400, "Invalid request: logprobs"),
    (CH, {"json": {"messages": MSG, "max_tokens": -5}}, 400, "max_tokens must be positive"),
    (CH, {"json": {"messages": MSG, "logprobs": True, "top_logprobs": -1}}, 400, "Invalid request: top_logprobs"),
    # empty and oversized prompts
    (G, {"json": {"text": ""}}, 400, "encodes to no tokens"),
    (G, {"json": {"text": []}}, 400, "The batch is empty"),
    (G, {"json": {"input_ids": []}}, 400, "input_ids cannot be empty."),
    (G, {"json": {"input_ids": [[1, 2], []]}}, 400, "input_ids cannot be empty."),
    (G, {"json": {"input_ids": [7] * (CTX + 10)}}, 400, f"longer than the model's context length ({CTX} tokens)"),
    (G, {"json": {"text": "word " * 2500}}, 400, "longer than the model's context length"),
    (C, {"json": {"prompt": ""}}, 400, "Prompt cannot be empty"),
    (C, {"json": {"prompt": []}}, 400, "Prompt cannot be empty"),
    (C, {"json": {"prompt": [7] * (CTX + 10)}}, 400, "longer than the model's context length"),
    (CH, {"json": {"messages": []}}, 400, "at least 1 item"),
    (CH, {"json": {"messages": [{"role": "user", "content": "word " * 2500}]}}, 400, "context length"),
    # token ids outside the vocabulary (4096 ids)
    (G, {"json": {"input_ids": [4096]}}, 400, "input_ids must be in [0, 4095], got 4096."),
    (G, {"json": {"input_ids": [-1]}}, 400, "input_ids must be in [0, 4095], got -1."),
    (G, {"json": {"input_ids": [[1, 2], [10**20]]}}, 400, "input_ids must be in [0, 4095]"),
    (G, {"json": {"text": "a", "sampling_params": {"stop_token_ids": [4096]}}}, 400, "stop_token_ids must be in"),
    (G, {"json": {"text": "a", "sampling_params": {"logit_bias": {"99999": 1}}}}, 400, "logit_bias must has keys"),
    (G, {"json": {"text": "a", "return_logprob": True, "token_ids_logprob": [5000]}}, 400,
     "token_ids_logprob must be in [0, 4095]"),
    (C, {"json": {"prompt": [4096]}}, 400, "input_ids must be in [0, 4095], got 4096."),
    (C, {"json": {"prompt": [[1], [-7]]}}, 400, "input_ids must be in [0, 4095], got -7."),
    (C, {"json": {"prompt": "a", "stop_token_ids": [10**9]}}, 400, "stop_token_ids must be in"),
    (CH, {"json": {"messages": MSG, "logit_bias": {"4096": 3}}}, 400, "logit_bias must has keys"),
    # unknown sampling keys: refused inside native sampling_params; ignored at the top level (SGLang and
    # OpenAI ignore unknown top-level keys)
    (G, {"json": {"text": "a", "sampling_params": {"temprature": 0.5}}}, 400, "unknown sampling parameter 'temprature'"),
    (G, {"json": {"text": "a", "sampling_params": {"max_new_tokens": 2}, "not_a_field": 1}}, 200, '"output_ids"'),
    (C, {"json": {"prompt": "a", "max_tokens": 2, "not_a_field": 1}}, 200, '"text_completion"'),
    (CH, {"json": {"messages": MSG, "max_tokens": 2, "not_a_field": 1}}, 200, '"chat.completion"'),
    # invalid UTF-8 bytes, lone surrogates, non-JSON bodies
    (G, raw(b'{"text":"\xff\xfe abc"}'), 400, "error parsing the body"),
    (G, raw(b'{"text":"\\ud800"}'), 400, "not valid Unicode"),
    (G, raw(b'{"text":["ok","\\udfff"]}'), 400, "text[1] is not valid Unicode"),
    (G, raw(b'{"text":"a","rid":"\\ud800"}'), 400, "rid is not valid Unicode"),
    (G, raw(b"hello"), 400, "JSON decode error"),
    (G, raw(b'{"text": "a"'), 400, "JSON decode error"),
    (G, raw(b"[1, 2]"), 400, "valid dictionary"),
    (G, raw(b""), 400, "Field required"),
    (C, raw(b'{"prompt":"\xff"}'), 400, "Invalid JSON"),
    (C, raw(b'{"prompt":"\\ud800"}'), 400, "Invalid JSON"),
    (C, raw(b"hello"), 400, "Invalid JSON"),
    (C, {"content": b'{"prompt":"a"}', "headers": {"content-type": "text/plain"}}, 400, "Content-Type must be application/json"),
    (CH, raw(b'{"messages":[{"role":"user","content":"\xc3\x28"}]}'), 400, "Invalid JSON"),
    (CH, raw(b"not json at all"), 400, "Invalid JSON"),
    ("/tokenize", raw(b'{"prompt":"\\ud800"}'), 400, "not valid Unicode"),
    ("/abort_request", raw(b"{nope"), 400, "JSON decode error"),
    # deeply nested JSON: refused, quickly, without a crash
    (G, raw(NESTED), 400, "error parsing the body"),
    (G, raw(b'{"text":' + NESTED + b"}"), 400, "error parsing the body"),
    (C, raw(b'{"prompt":' + NESTED + b"}"), 400, "recursion limit"),
    (CH, raw(b'{"messages":' + NESTED + b"}"), 400, "recursion limit"),
    # too large: 413 before parsing (declared length and chunked)
    (G, raw(b"x" * BIG), 413, "--max-request-bytes"),
    (C, raw(b"x" * BIG), 413, "--max-request-bytes"),
    (CH, raw(b"x" * BIG), 413, "--max-request-bytes"),
    (G, {"content": iter([b'{"text":"'] + [b"a" * 65536] * 40 + [b'"}'])}, 413, "--max-request-bytes"),
    (C, {"content": iter([b'{"prompt":"'] + [b"a" * 65536] * 40 + [b'"}'])}, 413, "--max-request-bytes"),
    # batches past --max-batch-size (256)
    (G, {"json": {"text": ["a"] * 10_000}}, 400, "--max-batch-size"),
    (G, {"json": {"input_ids": [[5]] * 10_000}}, 400, "--max-batch-size"),
    (G, {"json": {"text": ["a"] * 100, "sampling_params": {"n": 3}}}, 400, "--max-batch-size"),
    (C, {"json": {"prompt": ["a"] * 10_000}}, 400, "--max-batch-size"),
    (C, {"json": {"prompt": [[5]] * 10_000}}, 400, "--max-batch-size"),
    (C, {"json": {"prompt": ["a"] * 200, "n": 2}}, 400, "--max-batch-size"),
    (CH, {"json": {"messages": MSG, "n": 10_000}}, 400, "n must be in [1, 128]"),
]


@pytest.mark.parametrize("path,kwargs,status,fragment", CASES, ids=[f"{i:02d}-{c[0]}" for i, c in enumerate(CASES)])
def test_bad_input_table(client, path, kwargs, status, fragment):
    kwargs = dict(kwargs)
    if "content" in kwargs:
        kwargs["headers"] = kwargs.get("headers") or {"content-type": "application/json"}
    t0 = time.monotonic()
    r = client.post(path, **kwargs)
    assert time.monotonic() - t0 < 20, "took too long"
    assert r.status_code == status, (r.status_code, r.text[:400])
    assert fragment in r.text, r.text[:400]
    if status >= 400:
        assert r.headers["content-type"] == "application/json"
        check_envelope(path, status, r.json())


@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_refused_before_a_stream_starts(client, stream):
    """Streams validate first: the same bad values are a 400 in the envelope, not an error frame."""
    bodies = [(G, raw(b'{"text":"a","stream":true,"sampling_params":{"temperature":NaN}}')),
              (C, raw(b'{"prompt":"a","stream":true,"top_p":Infinity}')),
              (CH, raw(b'{"messages":[{"role":"user","content":"a"}],"stream":true,"max_tokens":-1}'))]
    for path, kwargs in bodies:
        content = kwargs["content"] if stream else kwargs["content"].replace(b'"stream":true', b'"stream":false')
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        check_envelope(path, 400, r.json())


def test_chunked_body_under_the_limit_is_served(client):
    body = json.dumps({"text": "chunked", "sampling_params": {"max_new_tokens": 2}}).encode()
    r = client.post(G, content=iter([body[:5], body[5:]]), headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


def test_the_server_survived_all_of_it(client, reference):
    three_checks(client, reference)
    with httpx.Client(base_url=str(client.base_url), timeout=30) as fresh:
        assert fresh.get("/health").status_code == 200
