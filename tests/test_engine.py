"""The engine end to end: the same greedy tokens through every tier, batching, limits."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from tier_workload import GREEDY, conversations, run_workload

from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.request import InvalidRequest


def engine(tmp_path, **overrides) -> Engine:
    # no timed warm-up forwards at start: the suite starts many engines (tests/test_warmup.py
    # has its own)
    base = {"cache.page_size": 16, "cache.max_total_tokens": 2048, "model.device": "cpu",
            "storage.prefill_warmup_s": 0.0}
    cfg = load_config(None, {**base, **overrides})
    return Engine(cfg)


def tiered(tmp_path, **overrides) -> Engine:
    return engine(tmp_path, **{"cache.hierarchical": True, "storage.backend": "lmdb",
                               "storage.lmdb.path": str(tmp_path / "lmdb"),
                               "storage.prefetch_policy": "wait_complete",
                               "storage.prefetch_threshold": 32, **overrides})


@pytest.fixture(scope="module")
def reference_outputs(tmp_path_factory) -> list[list[int]]:
    with engine(tmp_path_factory.mktemp("ref"), **{"cache.enable_radix_cache": False}) as e:
        return run_workload(e)


def test_l1_only_gives_the_tokens_of_recomputation(tmp_path, reference_outputs) -> None:
    with engine(tmp_path) as e:
        assert run_workload(e) == reference_outputs
        assert e.stats()["counters"]["cached_device"] > 0


def test_tiny_l1_loads_back_from_l2_with_the_same_tokens(tmp_path, reference_outputs) -> None:
    with tiered(tmp_path, **{"cache.max_total_tokens": 256, "storage.backend": "none",
                             "host.ratio": 8.0}) as e:
        assert run_workload(e) == reference_outputs
        host = e.stats()["tiers"]["host"]
        assert host["hits"] > 0 and host["load_back_tokens"] > 0


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_prefixes_from_l3_after_flushing_l1_and_l2(tmp_path, reference_outputs,
                                                   policy) -> None:
    flushed = []

    def flush(e: Engine) -> None:
        flushed.append(e.flush_cache(["device", "host"]))

    with tiered(tmp_path, **{"host.write_policy": policy}) as e:
        assert run_workload(e, between_turns=flush) == reference_outputs
        stats = e.stats()
    if policy == "write_through":  # every prefix reached L3; later turns came back from it
        assert stats["tiers"]["storage"]["hits"] > 0
        assert stats["counters"]["cached_storage"] > 0


# A hit fetched whole (storage.overlap off), where a test counts the tokens L3 serves: the
# default races a cold hit's head against its tail, and where the line falls is timing.
WHOLE = {"storage.overlap": False}


def test_restart_serves_the_prefix_from_disk(tmp_path, reference_outputs) -> None:
    prompt = conversations()[0][2]
    with tiered(tmp_path, **WHOLE) as e:
        first = e.generate(input_ids=prompt, sampling_params=GREEDY)
    with tiered(tmp_path, **WHOLE) as e2:  # a new process would see the same LMDB
        again = e2.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["output_ids"] == first["output_ids"] == reference_outputs[6]
    details = again["meta_info"]["cached_tokens_details"]
    assert details == {"device": 0, "host": 0, "storage": (len(prompt) - 1) // 16 * 16}


def test_restart_races_the_first_hit_by_default(tmp_path, reference_outputs) -> None:
    """A restarted server has no fetch estimate: its first L3 hit computes its head while
    its tail is fetched (or, with nothing fetched in time, computes it all)."""
    prompt = conversations()[0][2]
    with tiered(tmp_path) as e:
        e.generate(input_ids=prompt, sampling_params=GREEDY)
    with tiered(tmp_path) as e2:
        again = e2.generate(input_ids=prompt, sampling_params=GREEDY)
        storage = e2.stats()["tiers"]["storage"]
    assert again["output_ids"] == reference_outputs[6]
    details = again["meta_info"]["cached_tokens_details"]
    assert details["device"] == details["host"] == 0
    assert details["storage"] % 16 == 0 and details["storage"] < (len(prompt) - 1) // 16 * 16
    assert storage["split_prefetches"] + storage["recomputed_hits"] == 1


def test_batched_requests_give_the_tokens_of_one_at_a_time(tmp_path, reference_outputs) -> None:
    prompts = [c[t] for t in range(3) for c in conversations()]
    with engine(tmp_path, **{"cache.enable_radix_cache": False}) as e:
        results: dict[int, list[int]] = {}

        def go(i: int) -> None:
            results[i] = e.generate(input_ids=prompts[i], sampling_params=GREEDY)["output_ids"]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [results[i] for i in range(len(prompts))] == reference_outputs


def test_matches_transformers_greedy_generation(tmp_path) -> None:
    import transformers  # the `test` extra
    prompt = conversations()[1][0]
    with engine(tmp_path) as e:
        ours = e.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        path = str(e.loaded.path)
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):  # plain greedy decoding, recomputing everything each step
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[len(prompt):]


def test_more_requests_than_l1_holds_all_finish(tmp_path) -> None:
    with engine(tmp_path, **{"cache.max_total_tokens": 192}) as e:
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(e.generate(
            input_ids=[i + 1] * 100, sampling_params=GREEDY))) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 6
    assert all(r["meta_info"]["completion_tokens"] == 8 for r in results)


def test_meta_info_and_stop_conditions(tmp_path) -> None:
    with engine(tmp_path) as e:
        r = e.generate(text="hello hello hello", sampling_params={"max_new_tokens": 3,
                                                                   "temperature": 0})
        assert r["meta_info"]["prompt_tokens"] == 17
        assert r["meta_info"]["finish_reason"] in ("length", "stop")
        assert set(r["meta_info"]["cached_tokens_details"]) == {"device", "host", "storage"}
        full = e.generate(input_ids=[5] * 40, sampling_params=GREEDY)
        stop = full["text"][2:4]
        if stop:
            cut = e.generate(input_ids=[5] * 40, sampling_params={**GREEDY, "stop": stop})
            assert cut["meta_info"]["finish_reason"] == "stop"
            assert stop not in cut["text"] and full["text"].startswith(cut["text"])


def test_seeded_sampling_is_reproducible(tmp_path) -> None:
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": 12,
              "seed": 7, "ignore_eos": True}
    with engine(tmp_path) as e:
        a = e.generate(input_ids=[3] * 30, sampling_params=params)["output_ids"]
        b = e.generate(input_ids=[3] * 30, sampling_params=params)["output_ids"]
        c = e.generate(input_ids=[3] * 30, sampling_params={**params, "seed": 8})["output_ids"]
    assert a == b and a != c


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, 999]}, "outside the vocabulary"),
    ({"input_ids": "abc"}, "list of integers"),
    ({"input_ids": [1] * 9000}, "context"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "unknown field"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "stop"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 4000}}, "L1 KV cache"),
])
def test_bad_requests_are_refused_with_a_reason(tmp_path, kwargs, message) -> None:
    with engine(tmp_path) as e:
        with pytest.raises(InvalidRequest, match=message):
            e.generate(**kwargs)
        assert e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)  # still serving


def test_flush_rejects_unknown_tiers_and_reports_what_it_freed(tmp_path) -> None:
    with tiered(tmp_path) as e:
        e.generate(input_ids=list(range(100)), sampling_params=GREEDY)
        with pytest.raises(InvalidRequest, match="unknown tier"):
            e.flush_cache(["gpu"])
        freed = e.flush_cache()
        assert freed["device"] >= 96 and freed["host"] >= 96 and freed["storage"] >= 96
        tiers = e.stats()["tiers"]
        assert tiers["device"]["evictable"] == 0 and tiers["storage"]["pages"] == 0


def test_shutdown_finishes_running_requests_and_refuses_new_ones(tmp_path) -> None:
    e = tiered(tmp_path)
    results = []
    t = threading.Thread(target=lambda: results.append(
        e.generate(input_ids=[7] * 200, sampling_params={**GREEDY, "max_new_tokens": 32})))
    t.start()
    while not e.scheduler.num_unfinished() and not results:
        time.sleep(0.001)
    e.shutdown()
    t.join()
    assert results and results[0]["meta_info"]["completion_tokens"] == 32
    assert not e._thread.is_alive()
    from hicache_server.engine import EngineClosed
    with pytest.raises(EngineClosed):
        e.generate(input_ids=[1, 2], sampling_params=GREEDY)


def test_shutdown_writes_pending_backups_to_l3(tmp_path) -> None:
    prompt = [(7 * i) % 250 for i in range(360)]
    with tiered(tmp_path) as e:  # exits right after the request: backups still in flight
        e.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 40})
    with tiered(tmp_path) as e2:
        assert e2.stats()["tiers"]["storage"]["pages"] == (360 + 40 - 1) // 16


def test_a_consumer_that_goes_away_does_not_stop_the_scheduler(tmp_path) -> None:
    import asyncio

    with engine(tmp_path) as e:
        async def read_one() -> None:
            it = e.stream(e.make_request(input_ids=[4] * 40, sampling_params={
                **GREEDY, "max_new_tokens": 64}))
            await it.__anext__()

        asyncio.run(read_one())  # the loop closes while the request still runs
        time.sleep(0.2)
        assert e._thread.is_alive()
        assert e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)["output_ids"]


def test_admin_calls_after_shutdown_raise(tmp_path) -> None:
    from hicache_server.engine import EngineClosed

    e = engine(tmp_path)
    assert e.alive()
    e.shutdown()
    assert not e.alive()
    with pytest.raises(EngineClosed):
        e.stats()
    with pytest.raises(EngineClosed):
        e.flush_cache()


def test_a_load_back_for_a_request_that_must_wait_never_deadlocks(tmp_path) -> None:
    # L1 is tiny: admissions that load from L2 but then cannot get room must not leave
    # loads queued with their slots locked (which used to hang this workload).
    import asyncio

    rng = random.Random(4)
    system = [rng.randrange(256) for _ in range(128)]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with tiered(tmp_path, **{"cache.max_total_tokens": 368, "storage.backend": "none",
                             "host.ratio": 4.0}) as e:
        async def chat() -> int:
            history = list(system)
            for _ in range(3):
                prompt = history + [rng.randrange(256) for _ in range(64)]
                out = await e.async_generate(input_ids=prompt, sampling_params=sp)
                history = prompt + out["output_ids"]
                await asyncio.sleep(0.05)
            return 3

        async def main() -> list[int]:
            return await asyncio.wait_for(asyncio.gather(*(chat() for _ in range(3))), 120)

        assert asyncio.run(main()) == [3, 3, 3]


def test_load_back_never_takes_slots_promised_to_running_requests(tmp_path) -> None:
    rng = random.Random(0)
    greedy = {"temperature": 0, "ignore_eos": True}
    with tiered(tmp_path, **{"cache.max_total_tokens": 1024, "storage.backend": "none"}) as e:
        prefix = [rng.randrange(256) for _ in range(481)]
        e.generate(input_ids=prefix, sampling_params={**greedy, "max_new_tokens": 1})
        e.flush_cache(["device"])  # the prefix now lives in L2 only
        long_one = [rng.randrange(256) for _ in range(256)]
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("long", e.generate(
            input_ids=long_one, sampling_params={**greedy, "max_new_tokens": 700})))
        t.start()
        time.sleep(0.5)
        hit = e.generate(input_ids=prefix + [1] * 16, sampling_params={
            **greedy, "max_new_tokens": 1})
        t.join(120)
        assert e._thread.is_alive() and "long" in results
        assert results["long"]["meta_info"]["completion_tokens"] == 700
        assert hit["meta_info"]["completion_tokens"] == 1


def test_pages_from_l3_count_as_storage_even_when_admission_had_to_wait(tmp_path) -> None:
    rng = random.Random(1)
    greedy = {"temperature": 0, "ignore_eos": True}
    with tiered(tmp_path, **{"cache.max_total_tokens": 1024, **WHOLE}) as e:
        prefix = [rng.randrange(256) for _ in range(481)]
        e.generate(input_ids=prefix, sampling_params={**greedy, "max_new_tokens": 1})
        e.flush_cache(["device", "host"])  # the prefix now lives in L3 only
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("long", e.generate(
            input_ids=[rng.randrange(256) for _ in range(256)],
            sampling_params={**greedy, "max_new_tokens": 700})))
        t.start()
        time.sleep(0.5)  # the long request holds most of L1 while the prefetch lands
        hit = e.generate(input_ids=prefix + [1] * 16, sampling_params={
            **greedy, "max_new_tokens": 1})
        t.join(120)
    assert hit["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0,
                                                         "storage": 480}


def test_requests_sharing_a_prefix_in_l3_fetch_it_once(tmp_path, reference_outputs) -> None:
    """Two chats with one system prompt arrive together after L1 and L2 were flushed: the
    shared pages come from LMDB once, and both answers are those of recomputation."""
    prompts = [conversations()[c][2] for c in (0, 1)]
    with tiered(tmp_path, **WHOLE) as e:
        run_workload(e)
        e.flush_cache(["device", "host"])
        before = e.stats()["tiers"]["storage"]["prefetched_tokens"]
        results: dict[int, dict] = {}

        def go(i: int) -> None:
            results[i] = e.generate(input_ids=prompts[i], sampling_params=GREEDY)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fetched = e.stats()["tiers"]["storage"]["prefetched_tokens"] - before
    cacheable = [(len(p) - 1) // 16 * 16 for p in prompts]
    shared = 96  # the system prompt: six whole pages
    assert fetched == sum(cacheable) - shared
    assert [results[i]["output_ids"] for i in range(2)] == reference_outputs[6:8]


def test_a_prompt_is_cached_once_prefilled_while_its_request_still_decodes(tmp_path) -> None:
    """A second request with the same prompt, arriving while the first is still generating,
    reads the prompt from L1 instead of recomputing it."""
    prompt = conversations()[0][1]
    long = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    with engine(tmp_path) as e:
        first: dict = {}
        t = threading.Thread(target=lambda: first.update(
            e.generate(input_ids=prompt, sampling_params=long)))
        t.start()
        deadline = time.monotonic() + 60
        while e.stats()["counters"]["generated_tokens"] < 2:  # prefilled, now decoding
            assert time.monotonic() < deadline, "the first request never started decoding"
            time.sleep(0.005)
        second = e.generate(input_ids=prompt, sampling_params=GREEDY)
        assert not first, "the first request finished too early for this test to mean much"
        t.join()
    assert second["meta_info"]["cached_tokens_details"]["device"] == (len(prompt) - 1) // 16 * 16
    assert second["output_ids"] == first["output_ids"][:len(second["output_ids"])]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_one_request_counts_as_one_use_of_its_prompt(tmp_path, policy) -> None:
    """The prompt enters the tree after prefill and again at finish; hit counts (LFU, and
    write_through_selective's threshold) still see one use, so one request's prompt is not
    copied to L2 under write_through_selective."""
    prompt = conversations()[2][1]
    answer = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}  # crosses pages
    with tiered(tmp_path, **{"storage.backend": "none", "cache.eviction_policy": policy,
                             "host.write_policy": "write_through_selective"}) as e:
        e.generate(input_ids=prompt, sampling_params=answer)
        e._call(e.cache.steps.quiesce)  # a copy in flight is counted only at its ack
        stats = e.stats()
        counts = e._call(lambda: [n.hit_count for n in e.cache.tree.iter_nodes()])
    assert stats["tiers"]["host"]["written_tokens"] == 0
    assert counts and all(c == 1 for c in counts)
