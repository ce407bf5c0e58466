"""``kvserve run-batch`` (server/batch.py): OpenAI batch lines answered through the app."""

from __future__ import annotations

import io
import json
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from server import cli
from engine.stats import StepStats
from server.app import build_app
from server.batch import BatchRequest, parse_batch, run_batch
from server.cli import run_batch as run_batch_cli
from real_engine import ServedEngine

pytestmark = pytest.mark.anyio


def line(custom_id: str, url: str = "/v1/completions", **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_parse_batch_reads_requests_and_skips_blank_lines() -> None:
    requests = parse_batch([line("a", prompt="x"), "", "  ", line("b", "/v1/chat/completions", messages=[])])
    assert requests == [BatchRequest(1, "a", "/v1/completions", {"prompt": "x"}),
                        BatchRequest(4, "b", "/v1/chat/completions", {"messages": []})]


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: a request is a JSON object"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "line 2: custom_id"),
    (line("a"), "line 2: custom_id 'a' is used twice"),
    (json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}), "method must be POST"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/models", "body": {}}), "url '/v1/models'"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": "x"}), "body must be"),
])
def test_parse_batch_names_the_bad_line(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_batch([line("a"), bad])


def test_a_bad_input_file_stops_before_the_model_loads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", prompt="x") + "\n" + line("a", prompt="y") + "\n")
    # Were the model loaded, this would take seconds and print its log; it exits at the check.
    with pytest.raises(SystemExit, match="line 2: custom_id 'a' is used twice"):
        cli.main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", "no-such-model"])
    assert not (tmp_path / "out.jsonl").exists()


class Files:
    """A local HTTP file server: GET serves ``served``, PUT stores into ``stored``
    (paths under /refuse/ answer 403)."""

    def __init__(self) -> None:
        self.served: dict[str, bytes] = {}
        self.stored: dict[str, bytes] = {}
        files = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = files.served.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def do_PUT(self) -> None:  # noqa: N802
                data = self.rfile.read(int(self.headers["Content-Length"]))
                refused = self.path.startswith("/refuse/")
                if not refused:
                    files.stored[self.path] = data
                self.send_response(403 if refused else 201)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def files() -> Iterator[Files]:
    f = Files()
    thread = threading.Thread(target=f.httpd.serve_forever, daemon=True)
    thread.start()
    yield f
    f.httpd.shutdown()
    f.httpd.server_close()


def test_the_input_and_output_can_be_http_urls(files: Files, tmp_path: Path) -> None:
    # vLLM's run-batch: -i fetched with GET, -o sent with one PUT when the batch is done.
    files.served["/in.jsonl"] = (line("a", prompt="x") + "\n\n" + line("b", prompt="y") + "\n").encode()
    assert [r.custom_id for r in parse_batch(run_batch_cli._read_lines(f"{files.url}/in.jsonl"))] == ["a", "b"]
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out:
        out.write('{"custom_id": "a"}\n')
        run_batch_cli._upload(f"{files.url}/out.jsonl", out)
    assert files.stored["/out.jsonl"] == b'{"custom_id": "a"}\n'
    # Through the command: an empty batch loads no model and still writes its (empty) file.
    files.served["/empty.jsonl"] = b"\n"
    assert cli.main(["run-batch", "-i", f"{files.url}/empty.jsonl", "-o", f"{files.url}/empty-out.jsonl",
                     "--no-progress"]) in (0, None)
    assert files.stored["/empty-out.jsonl"] == b""
    # A bad line is named, before any model loads, as from a file.
    files.served["/twice.jsonl"] = (line("a", prompt="x") + "\n" + line("a", prompt="y")).encode()
    with pytest.raises(SystemExit, match="line 2: custom_id 'a' is used twice"):
        cli.main(["run-batch", "-i", f"{files.url}/twice.jsonl", "-o", str(tmp_path / "o.jsonl"),
                  "--model", "no-such-model"])
    with pytest.raises(SystemExit, match="cannot read --input-file: .*404"):
        cli.main(["run-batch", "-i", f"{files.url}/missing.jsonl", "-o", str(tmp_path / "o.jsonl")])
    with pytest.raises(SystemExit, match="cannot write --output-file: .*403"):
        cli.main(["run-batch", "-i", f"{files.url}/empty.jsonl", "-o", f"{files.url}/refuse/out.jsonl"])


async def answer(engine: ServedEngine, lines: list[str], concurrency: int = 8) -> tuple[list[dict], Any]:
    out = io.StringIO()
    summary = await run_batch(build_app(engine), parse_batch(lines), out, concurrency=concurrency, progress=False)
    return [json.loads(x) for x in out.getvalue().splitlines()], summary


async def test_answers_come_in_the_input_order_and_equal_the_servers(client: httpx.AsyncClient, make_engine) -> None:
    engine = make_engine()
    bodies = [{"prompt": "abc", "max_tokens": 30 - 5 * i, "temperature": 0} for i in range(5)]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "temperature": 0}
    got, summary = await answer(engine, [line(f"q{i}", **b) for i, b in enumerate(bodies)]
                                + [line("chat", "/v1/chat/completions", **chat)])
    # The longest request is first and finishes last: the file keeps the input's order anyway.
    assert [g["custom_id"] for g in got] == ["q0", "q1", "q2", "q3", "q4", "chat"]
    assert (summary.succeeded, summary.failed) == (6, 0)
    for g, body in zip(got, bodies + [chat]):
        assert g["error"] is None and g["response"]["status_code"] == 200
        assert g["response"]["request_id"] == g["response"]["body"]["id"]
        assert g["id"].startswith("batch_req_")
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        direct = (await client.post(url, json=body)).json()
        assert g["response"]["body"]["choices"] == direct["choices"]
        assert g["response"]["body"]["usage"] == direct["usage"]


async def test_refused_requests_keep_their_status_and_error(client: httpx.AsyncClient, make_engine) -> None:
    engine = make_engine()
    got, summary = await answer(engine, [
        line("bad", prompt="x", max_tokens=-3),
        line("model", "/v1/chat/completions", model="nope", messages=[{"role": "user", "content": "hi"}]),
        line("stream", prompt="x", stream=True),
        line("ok", prompt="x", max_tokens=2),
    ])
    assert (summary.succeeded, summary.failed) == (1, 3)
    bad, model, stream, ok = got
    direct = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -3})
    assert bad["response"]["status_code"] == direct.status_code == 400
    assert bad["response"]["body"] == direct.json()
    assert bad["error"] == {"code": "invalid_request_error", "message": direct.json()["error"]["message"]}
    assert model["response"]["status_code"] == 404 and model["error"]["code"] == "model_not_found"
    assert stream["response"]["status_code"] == 400 and "stream" in stream["error"]["message"]
    assert ok["error"] is None and ok["response"]["body"]["usage"]["completion_tokens"] == 2
    # A streamed request never reached the engine; the others' streams are closed.
    assert [r.request_id for r in engine.requests] == [ok["response"]["request_id"]]
    assert engine.num_unfinished_requests == 0


class Running:
    """A stat logger: the most requests the engine ran at once."""

    def __init__(self) -> None:
        self.most = 0

    def record(self, stats: StepStats) -> None:
        self.most = max(self.most, stats.num_running)


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_at_most_concurrency_requests_are_in_flight(concurrency: int, make_engine) -> None:
    engine = make_engine()
    running = Running()
    engine.add_stat_logger(running)
    lines = [line(f"q{i}", prompt="abc", max_tokens=40 + i, ignore_eos=True) for i in range(10)]
    got, _ = await answer(engine, lines, concurrency=concurrency)
    assert len(got) == 10 and all(g["error"] is None for g in got)
    assert running.most == concurrency
    # And the app's lifespan ran around them: started, then shut down.
    assert engine.started and engine.shut_down
