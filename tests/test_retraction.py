"""Admission that estimates new tokens instead of reserving every max_new_tokens, and the
retraction that covers a wrong estimate: end to end on the CPU with the embedded model.

    early stops    requests that may generate 1,024 tokens and stop after a few run more at
                   once than reserving all of max_new_tokens would allow
    retraction     an L1 too small for the decodes it admitted retracts requests; each one
                   resumes from the tree and gives the tokens (and logprobs) it gives alone
    streaming      a retracted request streams each token exactly once
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from conftest import hold_scheduler, record_forwards, submit_all, submit_in_one_step

from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.http.metrics import CacheMetrics
from hicache_server.request import Request

PAGE = 4
SMALL_L1 = 128       # tokens: three 12-token prompts decoding 40 tokens each do not fit
LONG_MAX_NEW = 1024
WAIT_S = 60.0        # a bound on waits that never time out in a passing run
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def make_engine(l1_tokens: int, **overrides: object) -> Engine:
    return Engine(load_config(None, {"cache.page_size": PAGE, "cache.max_total_tokens": l1_tokens,
                                     "model.device": "cpu", **overrides}))


@pytest.fixture(scope="module")
def big() -> Iterator[Engine]:
    with make_engine(4096) as e:
        yield e


@pytest.fixture(scope="module")
def small() -> Iterator[Engine]:
    with make_engine(SMALL_L1) as e:
        yield e


@pytest.fixture(scope="module")
def small_l2() -> Iterator[Engine]:
    """With an L2 that L1 evictions are written back to: a retracted request whose pages
    left L1 meanwhile loads them back."""
    with make_engine(SMALL_L1, **{"cache.hierarchical": True, "host.ratio": 4.0,
                                  "host.write_policy": "write_back"}) as e:
        yield e


def prompts(n: int, seed: int, lengths: tuple[int, ...] = (12,)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def alone(e: Engine, prompt: list[int], max_new: int = GREEDY["max_new_tokens"],
          **options: object) -> dict:
    """The request run by itself."""
    return e.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": max_new},
                      **options)


def batch_sizes(e: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records how many requests each forward pass runs."""
    return record_forwards(e, monkeypatch, len)


def counters(e: Engine) -> dict[str, int]:
    return e.stats()["counters"]


def assert_nothing_held(e: Engine) -> None:
    """Idle: no page locked, every L1 slot free or the tree's, the tree consistent."""
    def check() -> None:
        e.cache.steps.quiesce()  # a copy in flight locks its pages until its ack
        e.cache.check_integrity()
        tree, pool = e.cache.tree, e.cache.device_pool
        assert tree.protected_size() == 0
        assert pool.available_size() + tree.evictable_size() == pool.allocator.total_size()
    e.scheduler.call(check).result(WAIT_S)


def test_requests_that_stop_early_run_more_at_once_than_their_max_new_tokens_allow(
        big: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight requests with max_new_tokens 1,024 in a 4,096-token L1: reserving all of it
    would run three at once; each stops at a token its greedy answer reaches early."""
    ps = prompts(8, seed=1)
    stops = [alone(big, p, max_new=4)["output_ids"][3] for p in ps]  # seen by token 4
    reqs = [big.make_request(input_ids=p, sampling_params={
        "temperature": 0, "max_new_tokens": LONG_MAX_NEW, "stop_token_ids": [stop]})
        for p, stop in zip(ps, stops)]
    sizes = batch_sizes(big, monkeypatch)
    results = [f.result(WAIT_S) for f in submit_in_one_step(big, reqs)]
    assert all(r["meta_info"]["finish_reason"] == "stop" for r in results)
    assert all(len(r["output_ids"]) <= 4 for r in results)
    full_reservation = 4096 // (LONG_MAX_NEW + 1)  # every request holds > 1,024 slots
    assert full_reservation == 3 and max(sizes) > full_reservation
    assert counters(big)["retracted_requests"] == 0
    assert_nothing_held(big)


SIX = prompts(6, seed=2)


@pytest.fixture(scope="module")
def six_alone(big: Engine) -> list[list[int]]:
    return [alone(big, p)["output_ids"] for p in SIX]


@pytest.mark.parametrize("tiers", ["small", "small_l2"])
def test_a_small_l1_retracts_and_every_request_gives_its_tokens_alone(
        six_alone: list[list[int]], tiers: str, request: pytest.FixtureRequest) -> None:
    """Six requests decoding 40 tokens each; admission lets three in (0.7 of 40 estimated
    each), which outgrow the 128-token L1 together."""
    e: Engine = request.getfixturevalue(tiers)
    ps, expected = SIX, six_alone
    before = counters(e)["retracted_requests"]
    reqs = [e.make_request(input_ids=p, sampling_params=GREEDY) for p in ps]
    results = [f.result(WAIT_S) for f in submit_in_one_step(e, reqs)]
    assert [r["output_ids"] for r in results] == expected
    assert all(r["meta_info"]["finish_reason"] == "length" for r in results)
    assert counters(e)["retracted_requests"] > before
    assert sum(r.kv.retractions for r in reqs) == counters(e)["retracted_requests"] - before
    if tiers == "small_l2":  # the prompts differ: only a resumed request hits
        assert e.stats()["tiers"]["host"]["load_back_tokens"] > 0
    metrics = CacheMetrics(e.cache_stats, page_size=PAGE).render().decode()
    assert (f"hicache:retracted_requests_total {float(counters(e)['retracted_requests'])}"
            in metrics.splitlines())
    assert_nothing_held(e)


def test_a_retracted_request_keeps_its_prompt_and_output_logprobs(
        big: Engine, small: Engine) -> None:
    """The longest prompt is retracted first (of requests as far along); it asked for the
    logprobs of its whole prompt: none is lost or read twice, none of its output either."""
    ps = prompts(5, seed=3, lengths=(16, 12, 12, 12, 12))
    options = {"return_logprob": True, "logprob_start_len": 0}
    expected = alone(big, ps[0], **options)
    reqs = [small.make_request(input_ids=ps[0], sampling_params=GREEDY, **options)]
    reqs += [small.make_request(input_ids=p, sampling_params=GREEDY) for p in ps[1:]]
    got, *_ = [f.result(WAIT_S) for f in submit_in_one_step(small, reqs)]
    assert reqs[0].kv.retractions > 0
    assert got["output_ids"] == expected["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        got_lp, want_lp = got["meta_info"][key], expected["meta_info"][key]
        assert [t for _, t, _ in got_lp] == [t for _, t, _ in want_lp]
        assert [lp for lp, _, _ in got_lp] == pytest.approx(
            [lp for lp, _, _ in want_lp], abs=1e-4)
    assert len(got["meta_info"]["input_token_logprobs"]) == len(ps[0])
    assert_nothing_held(small)


def test_a_retracted_request_streams_each_token_once(big: Engine, small: Engine) -> None:
    ps = prompts(5, seed=4, lengths=(16, 12, 12, 12, 12))
    expected = alone(big, ps[0])["output_ids"]
    streamed = small.make_request(input_ids=ps[0], sampling_params=GREEDY)
    others = [small.make_request(input_ids=p, sampling_params=GREEDY) for p in ps[1:]]

    async def stream() -> list[dict]:
        gate = await asyncio.to_thread(hold_scheduler, small)
        chunks = small.stream(streamed)
        first = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0)  # the stream submits its request before it first waits
        futures = [asyncio.wrap_future(f) for f in run_after(others, gate)]
        out = [await first] + [chunk async for chunk in chunks]
        await asyncio.gather(*futures)
        return out

    def run_after(reqs: list[Request], gate: threading.Event) -> list[Future]:
        futures = submit_all(small, reqs)
        gate.set()
        return futures

    chunks = asyncio.run(stream())
    assert streamed.kv.retractions > 0
    final = chunks[-1].result
    assert final["output_ids"] == expected and final["meta_info"]["finish_reason"] == "length"
    # each update holds what is new: joined, every token once, none repeated or missing
    assert [t for c in chunks for t in c.delta.ids] == expected
    assert all(c.delta.ids for c in chunks)
    assert_nothing_held(small)


def test_a_request_with_no_slot_even_alone_fails_with_an_error(
        small: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past position 20 L1 gives nothing (as if every other page were locked): the one
    running request cannot be retracted, so it fails with what was short; the engine goes
    on serving."""
    kv = small.scheduler.kv
    ensure = kv.ensure_slots
    monkeypatch.setattr(kv, "ensure_slots", lambda req, upto: upto <= 20 and ensure(req, upto))
    errors = counters(small)["request_errors"]
    out = small.generate(input_ids=prompts(1, seed=5)[0], sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"] == "error"
    assert "L1 has no room" in out["meta_info"]["error"]
    assert 0 < len(out["output_ids"]) < GREEDY["max_new_tokens"]
    assert counters(small)["request_errors"] == errors + 1
    monkeypatch.undo()
    assert alone(small, prompts(1, seed=6)[0])["meta_info"]["finish_reason"] == "length"
    assert_nothing_held(small)
