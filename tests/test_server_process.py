"""The real `hicache-server` process over real HTTP on loopback: serve, drain on SIGTERM,
find the pages in LMDB after a restart; bad configurations exit 2, a missing model exits 1."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0  # a cold start imports torch and may write the embedded model
EXIT_TIMEOUT_S = 60.0
LISTENING = re.compile(r"hicache-server listening on http://127\.0\.0\.1:(\d+)")
PAGE = 16
# `make gpu-check` runs this file again with HICACHE_TEST_DEVICE=cuda: the served process then
# sizes L1 and L2 itself on the GPU, as `make serve` does there.
DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
CONFIG = """\
model: {{device: {device}}}
cache: {{hierarchical: true, page_size: {page}}}
storage:
  backend: lmdb
  prefetch_policy: wait_complete
  prefetch_threshold: 32
  lmdb: {{path: {lmdb}}}
"""
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # 360 byte tokens
IN_FLIGHT_PROMPT = "Pack my box with five dozen liquor jugs, said the sphinx. " * 6  # 348
SETTLE_TIMEOUT_S = 20.0
SETTLE_POLL_S = 0.05
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


class Server:
    """A `python -m hicache_server.launch` child; stderr is drained by a thread into `lines`."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hicache_server.launch", *args], cwd=REPO, env=dict(os.environ),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, errors="replace")
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: re.Pattern[str], timeout: float = START_TIMEOUT_S
                 ) -> re.Match[str]:
        while True:
            line = self.lines.get(timeout=timeout)
            if line is None:
                raise AssertionError(f"the server exited ({self.proc.wait()}):\n"
                                     + "".join(self.log))
            self.log.append(line)
            if match := pattern.search(line):
                return match

    def rest_of_log(self) -> str:
        while (line := self.lines.get(timeout=EXIT_TIMEOUT_S)) is not None:
            self.log.append(line)
        return "".join(self.log)


@contextmanager
def running(args: list[str]) -> Iterator[tuple[Server, str]]:
    server = Server(args)
    try:
        port = server.wait_for(LISTENING).group(1)
        yield server, f"http://127.0.0.1:{port}"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.proc.wait(timeout=EXIT_TIMEOUT_S)


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "server.yaml"
    path.write_text(CONFIG.format(page=PAGE, device=DEVICE, lmdb=json.dumps(str(tmp_path / "lmdb"))))
    return str(path)


def server_args(config: str) -> list[str]:
    return ["--config", config, "--port", "0", "--max-total-tokens", "2048"]


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> dict[str, Any]:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def exercise_every_route(session: aiohttp.ClientSession, base: str) -> None:
    out = await post(session, f"{base}/generate", {"text": "hello", "sampling_params": GREEDY})
    assert out["meta_info"]["completion_tokens"] == 4
    async with session.post(f"{base}/generate", json={
            "text": "hello", "sampling_params": GREEDY, "stream": True}) as resp:
        text = await resp.text()
    assert text.count("data: {") == 4 and text.endswith("data: [DONE]\n\n")
    done = await post(session, f"{base}/v1/completions", {"prompt": "hello", "max_tokens": 4,
                                                          "temperature": 0, "ignore_eos": True})
    assert done["usage"]["completion_tokens"] == 4
    freed = await post(session, f"{base}/admin/flush", {"tiers": ["device"]})
    assert set(freed["freed"]) == {"device"}
    async with session.get(f"{base}/admin/tiers") as resp:
        assert set((await resp.json())["tiers"]) == {"device", "host", "storage"}
    async with session.get(f"{base}/metrics") as resp:
        assert "hicache:requests_total 3.0" in await resp.text()


async def stream_across_sigterm(session: aiohttp.ClientSession, base: str,
                                server: Server) -> list[dict[str, Any]]:
    """Start a long stream, SIGTERM the server after its first token, read it to the end."""
    body = {"text": IN_FLIGHT_PROMPT, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}}
    async with session.post(f"{base}/generate", json=body) as resp:
        first = await resp.content.readuntil(b"\n\n")
        server.proc.send_signal(signal.SIGTERM)
        rest = (await resp.read()).decode()
    blocks = [first.decode().strip(), *rest.strip().split("\n\n")]
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]


async def backed_up(session: aiohttp.ClientSession, base: str, tokens: int) -> None:
    """Until L3 holds at least `tokens` tokens."""
    for _ in range(int(SETTLE_TIMEOUT_S / SETTLE_POLL_S)):
        async with session.get(f"{base}/admin/tiers") as resp:
            if (await resp.json())["tiers"]["storage"]["used"] >= tokens:
                return
        await asyncio.sleep(SETTLE_POLL_S)
    raise AssertionError(f"L3 never held {tokens} tokens")


def cacheable(prompt: str) -> int:
    """Tokens of `prompt` a cache can serve: its full pages, short of the last token (the
    one computed for its logits). One byte token per character."""
    return (len(prompt) - 1) // PAGE * PAGE


def storage_hit(result: dict[str, Any]) -> int:
    return result["meta_info"]["cached_tokens_details"]["storage"]


async def test_serve_drain_on_sigterm_and_reuse_lmdb(config: str) -> None:
    with running(server_args(config)) as (server, base):
        async with aiohttp.ClientSession() as session:
            await exercise_every_route(session, base)
            kept = await post(session, f"{base}/generate", {"text": PROMPT,
                                                            "sampling_params": GREEDY})
            await backed_up(session, base, cacheable(PROMPT))
            events = await stream_across_sigterm(session, base, server)
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 0
        log = server.rest_of_log()
    assert events[-1]["meta_info"]["finish_reason"] == "length"  # not cut short
    assert len(events[-1]["output_ids"]) == 40
    assert "shutting down" in log and "Traceback" not in log
    with running(server_args(config)) as (server, base):
        async with aiohttp.ClientSession() as session:
            again = await post(session, f"{base}/generate", {"text": PROMPT,
                                                             "sampling_params": GREEDY})
            in_flight = await post(session, f"{base}/generate", {"text": IN_FLIGHT_PROMPT,
                                                                 "sampling_params": GREEDY})
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 0
    # LMDB outlives the process: the new one serves the prompt from L3, with the same tokens.
    assert storage_hit(again) == cacheable(PROMPT)
    assert again["output_ids"] == kept["output_ids"]
    assert storage_hit(in_flight) == cacheable(IN_FLIGHT_PROMPT)


def run_to_exit(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicache_server.launch", *args], cwd=REPO,
                          env=dict(os.environ), capture_output=True, text=True, check=False,
                          timeout=START_TIMEOUT_S)


def test_bad_flag_exits_2_naming_the_key() -> None:
    done = run_to_exit(["--page-size", "0"])
    assert done.returncode == 2 and "cache.page_size" in done.stderr


def test_unknown_config_key_exits_2_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("cache:\n  page_sise: 16\n")
    done = run_to_exit(["--config", str(path)])
    assert done.returncode == 2 and "cache.page_sise" in done.stderr


def test_missing_model_exits_1_with_one_line(tmp_path: Path) -> None:
    done = run_to_exit(["--model-path", str(tmp_path / "nowhere"), "--port", "0"])
    assert done.returncode == 1
    assert "cannot start" in done.stderr and str(tmp_path / "nowhere") in done.stderr
    assert "Traceback" not in done.stderr
