"""A real `revolta serve` subprocess on 127.0.0.1 (embedded default model, random weights: the text
is meaningless, the protocols are real), and the official SDK clients pointed at it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

MODEL = "revolta-default"
MAX_MODEL_LEN = 2100  # above the 2048 max_tokens of the Anthropic thinking check
STARTUP_TIMEOUT_S = 180


@dataclass(frozen=True)
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str  # the server's stdout and stderr

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        """The value of one (label-free apart from model_name) sample on /metrics."""
        text = httpx.get(self.url + "/metrics", headers=headers).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not on /metrics")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_server(*args: str) -> Iterator[Server]:
    port = _free_port()
    cmd = [sys.executable, "-m", "revolta.cli", "serve", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
           "--enable-fault-injection", *args]
    log = tempfile.NamedTemporaryFile("w", prefix="revolta-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                with open(log.name, errors="replace") as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"revolta serve exited with {proc.returncode}:\n{tail}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("revolta serve did not become healthy in time")
            time.sleep(0.2)
        yield Server(url, proc, log.name)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if os.environ.get("REVOLTA_SERVER_LOG"):  # show it, as the server would have printed it
            with open(log.name, errors="replace") as f:
                sys.stderr.write(f.read())
        os.unlink(log.name)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """The plain deployment: no API key, keep-alive off, fault injection on for the error tests."""
    with run_server("--sse-keep-alive-interval", "0") as s:
        yield s


def openai_client(url: str):
    """The official OpenAI SDK on the server at `url` (no retries: a test sees the first answer)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def anthropic_client(url: str):
    """The official Anthropic SDK on the server at `url` (no retries)."""
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


@pytest.fixture(scope="session")
def oc(server):
    return openai_client(server.url)


@pytest.fixture(scope="session")
def ac(server):
    return anthropic_client(server.url)


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


def kill_mid_stream(server: Server, pid: int) -> tuple[dict | None, float]:
    """Start a long streamed chat, SIGKILL process `pid` once tokens flow, read on to the stream's error event.

    Returns (the error object or None if the stream ended without one, seconds from the kill to that error)."""
    import json
    import signal

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines).startswith("data:")  # generating
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for line in lines:
            payload = line.removeprefix("data: ")
            if payload != "[DONE]" and "error" in json.loads(payload):
                return json.loads(payload)["error"], time.monotonic() - killed
        return None, time.monotonic() - killed


@contextlib.contextmanager
def run_scripted(**config: object) -> Iterator[tuple[object, str]]:
    """The real server app, in-process under uvicorn, on a ScriptedLLM (see scripted_llm.py)."""
    import threading

    import uvicorn

    from revolta.presets.default import ensure_default_model
    from revolta.server.app import build_app
    from revolta.server.config import ServerConfig

    from .scripted_llm import ScriptedLLM

    llm = ScriptedLLM(ensure_default_model(progress=False))  # the tokenizer and template `revolta serve` uses
    app = build_app(llm, ServerConfig(**{"served_model_name": "scripted", "max_model_len": llm.max_model_len,
                                         "sse_keep_alive_interval": 0, **config}))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield llm, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[object, str]]:
    """run_scripted's server for one test module, serving the name "scripted": (the ScriptedLLM, its url)."""
    with run_scripted(served_model_name="scripted") as s:
        yield s


@pytest.fixture
def say(scripted):
    """Queue what the next requests will generate (cleared after the test); `say.prompt()` is the engine's last
    prompt as text."""
    llm = scripted[0]

    def queue(*texts: str) -> None:
        llm.scripts.extend(texts)
    queue.prompt = lambda: llm.tokenizer.decode(llm.prompts[-1], skip_special_tokens=False)
    yield queue
    scripted[0].scripts.clear()
