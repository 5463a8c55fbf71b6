"""How long `/health` waits while a huge chat message is templated, tokenized and refused.

A client asks `/health` every 5 ms while one request carries a ~1 M-character chat message
(far past the context, so it is refused after tokenizing). The worst wait beyond the
client's own sleep is how long the event loop was blocked. Runs against an in-process
server on loopback (aiohttp's test server), the default model (SmolLM2) and the embedded
one (a byte tokenizer), in one process.

    python -m benchmarks.bench_event_loop            # prints markdown, writes JSON

The test (`tests/test_event_loop.py`) shows the order (the loop answers while the tokenizer
runs); this measures the time, which depends on the machine and never goes in a test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import time
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.http.app import create_app
from hicache_server.models.named import DEFAULT_MODEL

MESSAGE_CHARS = 1_000_000
PROBE_GAP_S = 0.005
SETTLE_S = 0.2  # probing before and after the big request (the first probes warm up)
MODELS = (DEFAULT_MODEL, "embedded:tiny-llama")
RESULTS = Path(__file__).parent / "results" / "event_loop.json"


async def worst_wait(engine: Engine) -> dict[str, Any]:
    body = json.dumps({"messages": [{"role": "user", "content": "a" * MESSAGE_CHARS}],
                       "max_tokens": 1})
    async with TestClient(TestServer(create_app(engine))) as client:
        for _ in range(10):  # warm the client and the route before any probe counts
            await client.get("/health")
        done, waits = asyncio.Event(), []

        async def probe() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(PROBE_GAP_S)
                resp = await client.get("/health")
                resp.release()
                now = time.perf_counter()
                waits.append(now - last - PROBE_GAP_S)
                last = now

        prober = asyncio.ensure_future(probe())
        await asyncio.sleep(SETTLE_S)
        start = time.perf_counter()
        resp = await client.post("/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
        refused_s = time.perf_counter() - start
        status = resp.status
        resp.release()
        await asyncio.sleep(SETTLE_S)
        done.set()
        await prober
    return {"status": status, "request_s": round(refused_s, 3), "probes": len(waits),
            "worst_wait_ms": round(max(waits) * 1e3, 1)}


def run(model: str, trials: int) -> list[dict[str, Any]]:
    cfg = load_config(None, {"cache.max_total_tokens": 2048, "model.device": "cpu",
                             "model.path": model})
    with Engine(cfg) as engine:
        return [asyncio.run(worst_wait(engine)) for _ in range(trials)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    rows = {model: run(model, args.trials) for model in MODELS}
    print("| model | request (s) | /health worst wait, per trial (ms) |\n|---|---|---|")
    for model, trials in rows.items():
        waits = ", ".join(str(t["worst_wait_ms"]) for t in trials)
        request_s = max(t["request_s"] for t in trials)
        print(f"| {model} | {request_s} | {waits} |")
    args.out.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "machine": platform.processor(),
        "message_chars": MESSAGE_CHARS, "probe_gap_s": PROBE_GAP_S, "results": rows},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
