"""`make bench`'s thrash measurement: the paired client's order and the report arithmetic
(a fake server on loopback for the client; no hicache server)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from benchmarks import bench_multiturn as bm
from benchmarks import multiturn_report as mr
from benchmarks import run_multiturn as rm

ON, OFF = mr.BASELINE, mr.NO_CACHE


def _pass(on: list[float | None], off: list[float], hit: float = 0.0, errors: int = 0
          ) -> dict[str, Any]:
    """A fake pass: TTFTs per turn on each server (None: the request failed)."""
    side = {"hit_rate": hit, "errors": errors, "error_samples": []}
    return {"seed": 1, "same_answers": 1.0,
            "sides": {ON: {**side, "ttft_s": on}, OFF: {**side, "errors": 0, "ttft_s": off}}}


ALIVE = {ON: {"fatal": None}, OFF: {"fatal": None}}


def test_median_turn_ratio_per_pass_then_their_median_and_spread() -> None:
    passes = [_pass([1.0, 2.0, 9.0], [1.0, 2.0, 2.0]),  # turns 1, 1, 4.5: 1.0
              _pass([3.0, None], [2.0, 1.0], hit=0.02),  # the failed turn left out: 1.5
              _pass([1.0, 1.0], [2.0, 2.0])]  # 0.5
    t = mr.thrash_cost(passes, ALIVE)
    assert t["ratios"] == pytest.approx([1.0, 1.5, 0.5])
    assert (t["median_ratio"], t["min_ratio"], t["max_ratio"]) == (1.0, 0.5, 1.5)
    lo, hi = t["interval"]
    assert 0.5 <= lo <= 1.0 <= hi <= 1.5
    assert t["hit_rate"] == pytest.approx(0.02 / 3) and t["max_hit_rate"] == 0.02
    assert not t["broken"] and t["same_answers"] == 1.0
    goal = mr.thrash_goal(t)
    assert goal["value"] == 1.0 and goal["met"] is True and goal["target"] == "<= 1.05"
    assert mr.thrash_goal({**t, "median_ratio": 1.06})["met"] is False


def test_the_interval_narrows_to_the_value_when_every_pass_agrees() -> None:
    assert mr.median_interval([1.02] * 5) == pytest.approx([1.02, 1.02])
    assert mr.median_interval([1.0, 1.1]) is None  # too few to resample
    one = mr.thrash_cost([_pass([1.2], [1.0])], ALIVE)
    assert one["interval"] is None and "too few passes" in mr.thrash_line(one)
    assert "median of 1 pass)" in mr.thrash_goal(one)["goal"]


def test_an_error_or_a_dead_server_leaves_the_goal_unmeasured() -> None:
    t = mr.thrash_cost([_pass([1.0], [1.0], errors=1)], ALIVE)
    assert t["broken"] and mr.thrash_goal(t)["met"] is None
    dead = {**ALIVE, OFF: {"fatal": "RuntimeError: boom"}}
    assert mr.thrash_goal(mr.thrash_cost([_pass([1.0], [1.0])], dead))["met"] is None
    assert mr.thrash_cost([], ALIVE)["median_ratio"] is None


def test_the_summary_line_tells_a_cost_from_noise() -> None:
    noise = mr.thrash_cost([_pass([1.0], [1.0]), _pass([1.1], [1.0]), _pass([0.9], [1.0])],
                           ALIVE)
    assert "median 1.000x" in mr.thrash_line(noise) and "holds 1" in mr.thrash_line(noise)
    assert "goal <= 1.05: met" in mr.thrash_line(noise)
    cost = mr.thrash_cost([_pass([1.08], [1.0]), _pass([1.1], [1.0]), _pass([1.09], [1.0])],
                          ALIVE)
    assert "above 1: a cost of 8.0% to 10.0%" in mr.thrash_line(cost)
    assert "not met" in mr.thrash_line(cost)


def test_table_rows_follow_the_passes() -> None:
    passes = [_pass([0.1], [0.1]), _pass([0.2], [0.1], errors=2)]
    report = {"passes": passes, "summary": mr.thrash_cost(passes, ALIVE)}
    rows = mr.thrash_table(report).splitlines()
    assert rows[2] == "| 1 | 100 | 100 | 1.00x | 0.0% | 100.0% | 0 |"
    assert rows[3] == f"| 2 | 200 | 100 | 2.00x | 0.0% | 100.0% | {ON}: 2 |"


def test_the_thrash_workload_is_four_times_l1_and_every_history_is_evicted() -> None:
    args = rm.thrash_args(rm.parse_args([]))
    sizing = rm.size_tiers(args)
    assert sizing.working_set == 4 * sizing.l1_tokens
    assert (args.max_parallel, args.system_prompt_length) == (1, 0)
    # between two turns of a chat the others insert more than L1 holds (round 1 the least)
    per_turn = args.request_length + args.output_length
    assert (args.num_clients - 1) * per_turn > sizing.l1_tokens
    assert sizing.largest_request < sizing.l1_tokens  # one request always fits
    assert rm.parse_args(["--only", "thrash"]).only == rm.THRASH
    with pytest.raises(SystemExit):
        rm.parse_args(["--thrash-passes", "0"])


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
