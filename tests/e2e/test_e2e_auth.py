"""API-key auth on the real server: every API route needs the key; probes and the
metrics scrape stay open."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from e2e_helpers import MODEL, KVServe

pytestmark = pytest.mark.slow

# (method, path, JSON body) for every route that needs the key; bodies are valid
# requests (max_tokens=1), so with the key each one succeeds.
PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "Hi"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2, 3]}),
    ("GET", "/version", None),
]
OPEN = ["/health", "/ready", "/metrics"]


@pytest.fixture(scope="module")
def http(server: KVServe) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c


def assert_unauthorized(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED,
                         ids=[f"{m} {p}" for m, p, _ in PROTECTED])
def test_protected_route_needs_the_key(http: httpx.Client, server: KVServe, method: str,
                                       path: str, body: dict | None) -> None:
    assert_unauthorized(http.request(method, path, json=body))
    assert_unauthorized(http.request(method, path, json=body,
                                     headers={"Authorization": "Bearer wrong-key"}))
    assert_unauthorized(http.request(method, path, json=body,
                                     headers={"Authorization": f"Basic {server.api_key}"}))
    r = http.request(method, path, json=body, headers=server.headers)
    assert r.status_code == 200, r.text


def test_unknown_route_is_401_without_key_and_404_with_it(http: httpx.Client,
                                                          server: KVServe) -> None:
    assert_unauthorized(http.get("/v1/nope"))
    assert http.get("/v1/nope", headers=server.headers).status_code == 404


@pytest.mark.parametrize("path", OPEN)
def test_probes_and_metrics_are_open(http: httpx.Client, path: str) -> None:
    assert http.get(path).status_code == 200
    assert http.get(path, headers={"Authorization": "Bearer wrong-key"}).status_code == 200


def test_a_browsers_preflight_and_the_request_log(http: httpx.Client, server: KVServe) -> None:
    # --allowed-origins '["http://chat.example"]': that origin's preflight is answered without
    # the key; another origin gets no CORS header.
    preflight = {"Origin": "http://chat.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = http.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://chat.example"
    r = http.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    # --enable-log-requests --max-log-len 40: the request's id, its parameters and its prompt, cut.
    prompt = "A prompt long enough to be cut in the log: " + "word " * 20
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                  headers={"Authorization": f"Bearer {server.api_key}", "Origin": "http://chat.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://chat.example"
    [line] = [x for x in server.log(tail=10**7).splitlines() if f"Received request {r.json()['id']}" in x]
    assert repr(prompt) not in line and "A prompt long enough" in line and "in all)" in line
    assert "max_tokens=2" in line
