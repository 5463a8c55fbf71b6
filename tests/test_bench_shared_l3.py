"""The two-server benchmark's routing and report arithmetic (pure functions, no servers)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from benchmarks import bench_multiturn as bm
from benchmarks import bench_shared_l3 as sl3

URLS = ("http://127.0.0.1:1111", "http://127.0.0.1:2222")


def test_round_r_of_client_c_goes_to_server_c_plus_r_mod_2() -> None:
    route = sl3.alternating(URLS)
    for client in range(5):
        servers = [route(bm.Turn(client, rnd)) for rnd in range(1, 7)]
        assert servers == [URLS[(client + rnd) % 2] for rnd in range(1, 7)]
        # every round after the first on the server that did not serve the previous one
        assert all(a != b for a, b in itertools.pairwise(servers))
    assert route(bm.Turn(0, 1)) == URLS[1]
    assert route(bm.Turn(1, 1)) == URLS[0]


def test_runner_sends_each_turn_where_the_route_says() -> None:
    args = bm.parse_args(["--num-clients", "2", "--num-rounds", "2", "--quiet"])
    runner = bm.Runner(args, bm.make_workload(args), [1, 2], sl3.alternating(URLS))
    assert runner.route(bm.Turn(1, 2)) == URLS[1]
    default = bm.Runner(args, bm.make_workload(args), [1, 2])
    assert default.route(bm.Turn(1, 2)) == "http://127.0.0.1:30000"


def _run(ttfts: dict[tuple[int, int], float], storage: int, duration: float,
         answer: int = 7) -> dict[str, Any]:
    """A fake pass: 100-token prompts; round 2 hits 40 device tokens and `storage` storage
    tokens, round 1 nothing."""
    recs = [{"client": client, "round": rnd, "ttft_s": ttft, "latency_s": ttft + 1.0,
             "prompt_tokens": 100, "completion_tokens": 3,
             "cached": ({"device": 40, "host": 0, "storage": storage} if rnd == 2
                        else dict.fromkeys(bm.TIERS, 0)),
             "output_ids": [answer, client, rnd], "error": None}
            for (client, rnd), ttft in ttfts.items()]
    return {"records": recs, "requests": len(recs), "duration_s": duration,
            "input_throughput": 100 * len(recs) / duration, "errors": 0,
            "servers": [{"fatal": None}, {"fatal": None}]}


FOUR = ((0, 1), (1, 1), (0, 2), (1, 2))


def test_report_ratios_and_tier_split() -> None:
    private = [_run(dict(zip(FOUR, (1.0, 1.0, 2.0, 4.0))), 0, 2.0),
               _run(dict(zip(FOUR, (1.0, 1.0, 2.0, 4.0))), 0, 2.0)]
    shared = [_run(dict(zip(FOUR, (1.0, 1.0, 1.0, 2.0))), 30, 1.0),
              _run(dict(zip(FOUR, (1.0, 1.0, 3.0, 3.0))), 30, 3.0)]
    cmp = sl3.compare({sl3.PRIVATE: private, sl3.SHARED: shared})
    p, s = cmp["configs"][sl3.PRIVATE], cmp["configs"][sl3.SHARED]
    assert p["ttft_mean_s"] == pytest.approx(3.0) and s["ttft_mean_s"] == pytest.approx(2.25)
    assert s["pass_ttft_mean_s"] == pytest.approx([1.5, 3.0])
    assert p["requests_after_first"] == 4  # round 1 left out, both passes pooled
    assert p["request_throughput"] == pytest.approx(2.0)  # 8 requests in 4 s
    assert s["hit_rate"] == pytest.approx({"all": 0.7, "device": 0.4, "host": 0.0,
                                           "storage": 0.3})
    assert p["hit_rate"]["storage"] == 0.0
    r = cmp["shared_vs_private"]
    assert r["ttft_mean"] == pytest.approx(0.75)
    assert r["ttft_p50"] == pytest.approx(2.5 / 3.0)
    assert r["pass_ttft_mean"] == pytest.approx([0.5, 1.0])
    assert r["request_throughput"] == pytest.approx(1.0)
    assert [x["round"] for x in r["per_round"]] == [1, 2]
    assert r["per_round"][0]["ttft_mean"] == pytest.approx(1.0)
    assert r["per_round"][1]["ttft_mean"] == pytest.approx(0.75)
    assert cmp["same_answers"] == 1.0
    assert "| shared / private | 0.75x | 0.83x | 0.50x, 1.00x | 1.00x |" in sl3.config_table(cmp)
    assert sl3.rounds_table(cmp).splitlines()[3] == (
        "| 2 | 100 | 3,000 / 3,000 | 2,250 / 2,500 | 0.75x, 0.83x "
        "| 40.0% / 0.0% / 0.0% | 40.0% / 0.0% / 30.0% |")


def test_report_counts_different_answers_and_missing_baseline() -> None:
    private = [_run({(0, 1): 1.0, (0, 2): 2.0}, 0, 1.0)]
    shared = [_run({(0, 1): 1.0, (0, 2): 2.0}, 0, 1.0, answer=8)]
    shared[0]["records"][0]["output_ids"] = private[0]["records"][0]["output_ids"]
    cmp = sl3.compare({sl3.PRIVATE: private, sl3.SHARED: shared})
    assert cmp["same_answers"] == 0.5
    no_base = {**cmp["configs"][sl3.PRIVATE], "ttft_mean_s": None}
    assert sl3.shared_vs_private(cmp["configs"][sl3.SHARED], no_base)["ttft_mean"] is None
