"""Security properties against live servers: the API key on every route but the probes /health and /liveness (path tricks
included), loopback by default, CORS only for named origins, no tensor contents in any response, no
request field that names a file to load, and request bodies limited before parsing (chunked too).
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

from server.args import ServerArgs, parse_args
from tests.reliability_utils import check_envelope, reference_ids
from tests.server_utils import live_server

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD, EVIL = "http://good.example", "http://evil.example"


def _app():
    from server.app import create_app
    from server.state import ServerState

    return create_app(ServerState(args=ServerArgs(api_key="k"), engine=None, async_engine=None))  # type: ignore[arg-type]


def _flat_routes(routes: list[Any]) -> list[Any]:
    """Route objects, with included routers (FastAPI keeps them nested; no prefixes here) flattened."""
    out = []
    for route in routes:
        sub = getattr(route, "original_router", None)
        out += _flat_routes(sub.routes) if sub is not None else [route]
    return out


def _every_route() -> list[tuple[str, str]]:
    """(method, path) for every method of every route object in the app (not only the documented ones)."""
    out = []
    for route in _flat_routes(_app().routes):
        path = route.path.replace("{layer_id}", "0").replace("{buffer}", "key").replace("{model_id:path}", "x")
        path = path.replace("{model_id}", "x")
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            out.append((method, path))
    return out


@pytest.fixture(scope="module")
def keyed():
    with live_server("--api-key", KEY, "--cors-origins", GOOD, "--max-total-tokens", "4096") as s, s.client() as c:
        yield s, c


@pytest.fixture(scope="module")
def plain():
    with live_server("--max-total-tokens", "4096") as s, s.client() as c:
        yield s, c


# ---- API key ---------------------------------------------------------------------------------------------
def test_every_route_of_the_app_needs_the_key_but_the_probes(keyed):
    srv, c = keyed
    routes = _every_route()
    assert ("GET", "/health") in routes and ("GET", "/liveness") in routes and ("POST", "/generate") in routes
    assert ("HEAD", "/docs") in routes
    assert len(routes) >= 28
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"},
                        {"Authorization": f"Bearer {KEY}x"}, {"X-API-Key": KEY}):
            r = c.request(method, path, headers=headers)
            if path in ("/health", "/liveness"):  # the kubelet's probes carry no key
                assert r.status_code == 200, (method, path, headers)
                continue
            assert r.status_code == 401, (method, path, headers, r.status_code)
            if method != "HEAD":
                check_envelope(path, 401, r.json())
        r = c.request(method, path, headers=AUTH)
        assert r.status_code != 401, (method, path)


def _raw(port: int, request_line: str, headers: str = "") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"{request_line}\r\nHost: t\r\n{headers}Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


@pytest.mark.parametrize("target", ["/health/", "/health/../server_info", "/./server_info", "//server_info",
                                    "/HEALTH", "/health%2f..%2fserver_info", "/server_info?/health", "/health;/pools",
                                    "http://t/server_info", "/%68ealth/../pools"])
def test_path_tricks_do_not_bypass_the_key(keyed, target):
    srv, _ = keyed
    status, data = _raw(int(srv.url.rsplit(":", 1)[1]), f"GET {target} HTTP/1.1")
    assert status in (400, 401, 404), (target, data[:300])
    assert b"max_total_num_tokens" not in data and b"size_tokens" not in data


def test_body_is_not_read_before_the_key_is_checked(keyed):
    srv, c = keyed
    big = iter([b'{"text":"'] + [b"a" * 65536] * 40 + [b'"}'])
    r = c.post("/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 401
    r = c.post("/generate", content=iter([b'{"text":"'] + [b"a" * 65536] * 40 + [b'"}']),
               headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 413


def test_the_key_is_never_echoed(keyed, plain):
    _, c = keyed
    info = c.get("/server_info", headers=AUTH)
    assert info.json()["api_key"] == "<redacted>" and KEY not in info.text
    assert KEY not in c.get("/metrics", headers=AUTH).text


# ---- CORS ------------------------------------------------------------------------------------------------
def _preflight(c: httpx.Client, origin: str) -> httpx.Response:
    return c.options("/generate", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                           "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_answers_only_the_named_origins(keyed):
    _, c = keyed
    ok = _preflight(c, GOOD)  # preflights carry no credentials: answered before the key check
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == GOOD
    bad = _preflight(c, EVIL)
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    r = c.get("/model_info", headers={"Origin": GOOD, **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
    r = c.get("/model_info", headers={"Origin": EVIL, **AUTH})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = c.get("/model_info", headers={"Origin": GOOD})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == GOOD  # the browser sees the 401


def test_cors_is_off_without_cors_origins(plain):
    _, c = plain
    for origin in (GOOD, EVIL, "null"):
        pre = _preflight(c, origin)
        assert pre.status_code == 405 and not any(h.startswith("access-control-") for h in pre.headers)
        r = c.get("/model_info", headers={"Origin": origin})
        assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)


# ---- bind address and defaults ---------------------------------------------------------------------------
def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* shows them) with a socket listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if int(p, 16) == port and state == "0A":  # LISTEN
                found.append(addr)
    return found


def test_default_bind_is_loopback_and_limits_have_defaults(plain):
    srv, c = plain
    assert ServerArgs().host == "127.0.0.1" and parse_args([]).host == "127.0.0.1"
    assert parse_args([]).cors_origins == [] and parse_args([]).api_key is None
    assert _listening(int(srv.url.rsplit(":", 1)[1])) == ["0100007F"]  # 127.0.0.1 only, no 0.0.0.0, no ::
    info = c.get("/server_info").json()
    assert info["host"] == "127.0.0.1"
    assert info["max_request_bytes"] == 1 << 20 and info["max_batch_size"] == 256
    assert info["max_new_tokens_cap"] == info["context_len"]  # default cap: the context length
    r = c.post("/generate", content=b'{"text":"a","sampling_params":{"max_new_tokens":1e30}}',
               headers={"content-type": "application/json"})
    assert r.status_code == 400 and "--max-new-tokens-cap" in r.json()["error"]["message"]


# ---- no tensor contents ----------------------------------------------------------------------------------
def _longest_number_list(v: Any) -> int:
    if isinstance(v, list):
        here = len(v) if v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) else 0
        return max([here, *(_longest_number_list(x) for x in v)])
    if isinstance(v, dict):
        return max([0, *(_longest_number_list(x) for x in v.values())])
    return 0


def test_no_route_returns_tensor_contents(plain):
    _, c = plain
    c.post("/generate", json={"text": "fill the pool a little", "sampling_params": {"max_new_tokens": 8}})
    layers = c.get("/pools/layers").json()["layers"]
    paths = ["/pools", "/pools/layers", "/server_info", "/model_info", "/v1/models", "/openapi.json"]
    for layer in layers:
        paths.append(f"/pools/layers/{layer['layer_id']}")
        for name, has in layer["buffers"].items():
            if has:
                paths.append(f"/pools/layers/{layer['layer_id']}/buffers/{name}")
    for path in paths:
        r = c.get(path)
        assert r.status_code == 200, path
        body = r.json()
        assert len(r.content) < 64 * 1024, (path, len(r.content))
        assert _longest_number_list(body) <= 8, path  # shapes and layer id lists, never buffer values
        text = json.dumps(body)
        assert "tensor(" not in text and "data_ptr" not in text
    buf = c.get(f"/pools/layers/{layers[0]['layer_id']}/buffers/key").json()
    assert set(buf) == {"layer_id", "buffer", "pool", "pool_class", "local_layer_id", "shape", "dtype", "bytes"}


# ---- no per-request file paths ---------------------------------------------------------------------------
PATH_FIELDS = {"model_path": "/etc", "tokenizer_path": "/etc", "lora_path": "/etc/passwd", "load_format": "pt",
               "chat_template": "{{ ''.__class__ }}", "download_dir": "/tmp", "weights": "/etc/shadow",
               "adapter": "/etc/passwd", "custom_logit_processor": "import os", "config": "/etc/passwd"}


def test_request_fields_naming_files_are_ignored_or_refused(plain, tmp_path):
    srv, c = plain
    expected = reference_ids(c)
    body = {"text": "The reference request of the reliability tests",
            "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
    r = c.post("/generate", json={**body, **PATH_FIELDS})  # top-level extras: ignored (SGLang ignores unknown keys)
    assert r.status_code == 200 and r.json()["output_ids"] == expected
    for key, value in PATH_FIELDS.items():  # inside sampling_params: refused by name
        r = c.post("/generate", json={"text": "a", "sampling_params": {key: value}})
        assert r.status_code == 400 and f"unknown sampling parameter {key!r}" in r.json()["error"]["message"]
    r = c.post("/generate", json={"text": "a", "input_embeds": "/etc/passwd"})
    assert r.status_code == 400 and "input_embeds is not supported" in r.json()["error"]["message"]
    msgs = [{"role": "user", "content": "hello"}]
    plain_chat = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0})
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "model": "/etc/passwd"})
    assert r.status_code == 404 and "root:" not in r.text  # an unknown model is refused, never opened
    for extra in ({"chat_template": "{{ raise_exception('x') }}"},
                  {"chat_template_kwargs": {"bos_token": "", "template": "/etc/passwd"}}, PATH_FIELDS):
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"] == plain_chat.json()["choices"][0]["message"]
    r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, **PATH_FIELDS})
    assert r.status_code == 200
    info = c.get("/server_info").json()
    assert info["model_path"].endswith("configs/tiny") and info["load_format"] == "dummy"  # tests/server_utils.py serves random weights
    assert not any(r.path.startswith(("/load", "/update_weights", "/lora")) for r in _flat_routes(_app().routes))


# ---- request bodies limited before parsing ---------------------------------------------------------------
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize", "/abort_request", "/pools"])
def test_oversized_bodies_are_413_declared_or_chunked(plain, path):
    _, c = plain
    for content in (b"x" * (2 << 20), iter([b"x" * 65536] * 32)):  # Content-Length, then chunked without it
        r = c.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 413, (path, r.status_code, r.text[:200])
        check_envelope(path, 413, r.json())
        assert "--max-request-bytes" in r.text
    assert c.get("/health").status_code == 200
