"""`make bench`'s thrash measurement: the paired client's order (a fake server on loopback;
no hicache server)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_multiturn as bm


async def _fake_server(seen: list[tuple[str, int, int]], name: str) -> web.AppRunner:
    """A /generate that streams one token event (the prompt's length) and [DONE]."""
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((name, len(body["input_ids"]), body["sampling_params"]["max_new_tokens"]))
        resp = web.StreamResponse()
        await resp.prepare(request)
        n = len(body["input_ids"])
        meta = {"prompt_tokens": n, "completion_tokens": 1, "cached_tokens_details": {}}
        event = {"output_ids": [n % bm.BYTE_VOCAB], "meta_info": meta}
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def _port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


def test_run_paired_sends_each_turn_to_both_servers_in_abba_order() -> None:
    args = bm.parse_args(["--num-clients", "2", "--num-rounds", "2", "--request-length", "4",
                          "--output-length", "1", "--system-prompt-length", "0", "--quiet"])
    seen: list[tuple[str, int, int]] = []

    async def main() -> dict[str, list[bm.Record]]:
        a, b = await _fake_server(seen, "a"), await _fake_server(seen, "b")
        try:
            urls = {"a": f"http://127.0.0.1:{_port(a)}", "b": f"http://127.0.0.1:{_port(b)}"}
            return await bm.run_paired(args, urls, flip=True)
        finally:
            await a.cleanup()
            await b.cleanup()

    recs = asyncio.run(main())
    assert [s[0] for s in seen] == ["b", "a", "a", "b", "b", "a", "a", "b"]  # flipped ABBA
    # round 1: the 4-token question; round 2: question + answer + question, on both
    assert [s[1] for s in seen] == [4, 4, 4, 4, 9, 9, 9, 9]
    assert [(r.client, r.round) for r in recs["a"]] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert all(r.error is None and r.ttft >= 0 for rs in recs.values() for r in rs)
