"""Compute the head, load the tail: an L3 hit split into pages recomputed on the device and
pages fetched meanwhile gives the tokens of recomputation for every split, and the cost
model chooses fetch, recompute or split by its estimates."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
from test_engine import GREEDY, conversations, engine, tiered

import hicache.storage.tier_race as tier_module
from hicache.storage.cost import FetchCost, PrefillCost
from hicache.storage.fetch_queue import FETCH_BATCH_PAGES
from hicache.storage.race import race_batch_pages

PAGE = 16
PROMPT = conversations()[0][2]          # 232 tokens
HIT_PAGES = (len(PROMPT) - 1) // PAGE   # 14: the cacheable whole pages
WAIT_S = 60.0  # bound on a wait for the scheduler thread; reached only by a hang


def check_integrity(e) -> None:
    """Idle: the tree and pools consistent, on the scheduler thread."""
    def check() -> None:
        e.cache.steps.quiesce()
        e.cache.check_integrity()
    e.scheduler.call(check).result(WAIT_S)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """The prompt's greedy tokens, recomputed (no cache at all)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp, \
            engine(tmp, **{"cache.enable_radix_cache": False}) as e:
        return e.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def force_head(e, head: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the storage tier split every L3 hit with `head` pages recomputed (None: recompute
    it all; 0: fetch it all), whatever the cost model would say: a race whose first target is
    `head` and whose head is final there (the fetch brings the rest, however long it takes)."""
    e.cache.storage._head_pages = lambda op, hit: None if head is None else min(head, hit)
    monkeypatch.setattr(tier_module, "next_target", lambda race, *args: race.computed)


@pytest.mark.parametrize("head", [0, 1, 7, HIT_PAGES - 1, HIT_PAGES, None])
def test_every_split_gives_the_tokens_of_recomputation(tmp_path, reference, head,
                                                       monkeypatch) -> None:
    with tiered(tmp_path) as e:
        assert e.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == reference
        e.flush_cache(["device", "host"])  # the prompt lives in L3 only
        force_head(e, head, monkeypatch)
        backed_up = e.stats()["tiers"]["storage"]["backed_up_tokens"]
        again = e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        check_integrity(e)
        storage = e.stats()["tiers"]["storage"]
    assert again["output_ids"] == reference
    # pages L3 holds are not written again, fetched or recomputed (the answer's last token
    # has no KV yet, so the request adds no whole page)
    assert storage["backed_up_tokens"] == backed_up
    fetched = 0 if head is None else (HIT_PAGES - head) * PAGE
    details = again["meta_info"]["cached_tokens_details"]
    assert details == {"device": 0, "host": 0, "storage": fetched}
    split = head is not None and 0 < head < HIT_PAGES
    assert storage["split_prefetches"] == int(split)
    assert storage["head_tokens"] == (head * PAGE if split else 0)


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_a_head_the_write_policy_keeps_off_l2_is_copied_there(tmp_path, reference, policy,
                                                              monkeypatch) -> None:
    """The tail hangs below the head in L2, so the head is copied down whatever the policy."""
    with tiered(tmp_path) as e:  # write_through: the prompt reaches L3
        e.generate(input_ids=PROMPT, sampling_params=GREEDY)
    with tiered(tmp_path, **{"host.write_policy": policy}) as e:  # restart: L3 only
        force_head(e, 5, monkeypatch)
        again = e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        check_integrity(e)
    assert again["output_ids"] == reference
    assert again["meta_info"]["cached_tokens_details"]["storage"] == (HIT_PAGES - 5) * PAGE


def test_split_requests_sharing_a_prompt_all_get_its_tokens(tmp_path, reference,
                                                            monkeypatch) -> None:
    """Several requests with one prompt in L3 arrive together while the hit is split."""
    with tiered(tmp_path) as e:
        e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        e.flush_cache(["device", "host"])
        force_head(e, 4, monkeypatch)
        outs: list[list[int]] = []
        threads = [threading.Thread(target=lambda: outs.append(e.generate(
            input_ids=PROMPT, sampling_params=GREEDY)["output_ids"])) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        check_integrity(e)
        again = e.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert outs == [reference] * 3
    assert again["output_ids"] == reference
    assert again["meta_info"]["cached_tokens_details"]["device"] == HIT_PAGES * PAGE


class FixedPrefill(PrefillCost):
    """A prefill that costs `per_token_s` per token, learning nothing."""

    def __init__(self, per_token_s: float) -> None:
        super().__init__()
        self.per_token_s = per_token_s

    def observe(self, rows: Sequence[tuple[int, int]], seconds: float) -> None:
        pass

    def seconds(self, prefix: int, extend: int) -> float | None:
        return extend * self.per_token_s


class FixedFetch(FetchCost):
    def __init__(self, bytes_per_s: float) -> None:
        super().__init__()
        self.bytes_per_s = bytes_per_s

    def observe(self, nbytes: int, seconds: float) -> None:
        pass

    def seconds(self, nbytes: int) -> float | None:
        return nbytes / self.bytes_per_s


@pytest.mark.parametrize(("fetch_vs_compute", "storage_tokens", "split", "recomputed"), [
    (100.0, HIT_PAGES * PAGE, 0, 0),  # fetching is 100x faster: fetch it all
    (1.0, HIT_PAGES // 2 * PAGE, 1, 0),  # as fast: half computed, half fetched
    (0.01, 0, 0, HIT_PAGES * PAGE),  # 100x slower: recompute it all
])
def test_the_cost_model_fetches_splits_or_recomputes(tmp_path, reference, fetch_vs_compute,
                                                     storage_tokens, split, recomputed,
                                                     monkeypatch) -> None:
    """The model's split is the race's first target (here also its last: `next_target`
    stops where it is, so the count is the model's alone)."""
    monkeypatch.setattr(tier_module, "next_target", lambda race, *args: race.computed)
    with tiered(tmp_path) as e:
        e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        e.flush_cache(["device", "host"])
        tier = e.cache.storage
        page_bytes = tier.host_pool.page_bytes
        per_token_s = 1e-3
        tier.planner.prefill = FixedPrefill(per_token_s)
        tier.planner.fetch = FixedFetch(fetch_vs_compute * page_bytes / PAGE / per_token_s)
        again = e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        storage = e.stats()["tiers"]["storage"]
    assert again["output_ids"] == reference
    assert again["meta_info"]["cached_tokens_details"]["storage"] == storage_tokens
    assert storage["split_prefetches"] == split
    assert storage["recomputed_hit_tokens"] == recomputed


def test_estimates_are_learned_while_serving_and_shown(tmp_path) -> None:
    with tiered(tmp_path) as e:
        for turn in range(3):
            for conv in conversations():
                e.generate(input_ids=conv[turn], sampling_params=GREEDY)
            e.flush_cache(["device", "host"])
        model = e.stats()["tiers"]["storage"]["cost_model"]
    assert model["prefill_observations"] >= 3 and model["fetch_observations"] >= 3
    assert model["prefill_tokens_per_s"] > 0
    assert model["fetch_bandwidth_bytes_per_s"] > 0 and model["fetch_latency_s"] >= 0


def test_a_cold_race_gives_the_tokens_of_recomputation(tmp_path, reference) -> None:
    """No estimates yet: the hit is raced (the default), and whatever line the race draws, the answer is
    recomputation's, and head + fetched tail make the whole hit (or, abandoned, none of it
    comes from L3)."""
    with tiered(tmp_path) as e:
        e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        e.flush_cache(["device", "host"])
        assert e.stats()["tiers"]["storage"]["cost_model"]["fetch_bandwidth_bytes_per_s"] is None
        again = e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        check_integrity(e)
        storage = e.stats()["tiers"]["storage"]
    assert again["output_ids"] == reference
    fetched = again["meta_info"]["cached_tokens_details"]["storage"]
    if storage["split_prefetches"]:
        assert fetched + storage["head_tokens"] == HIT_PAGES * PAGE and storage["head_tokens"]
    else:
        assert fetched == 0 and storage["recomputed_hit_tokens"] == HIT_PAGES * PAGE


def test_a_raced_tail_is_fetched_in_calls_of_a_few_pages(tmp_path, reference,
                                                        monkeypatch) -> None:
    """The fetched tail of a race comes in RACE_BATCHES calls or more, so that its pages
    arrive, and are counted, while the head is computed; the answer is recomputation's."""
    head = 2
    with tiered(tmp_path) as e:
        e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        e.flush_cache(["device", "host"])
        force_head(e, head, monkeypatch)
        backend, calls = e.cache.storage.io.backend, []
        inner_get = backend.batch_get

        def counted(keys, host_pool, host_indices):
            calls.append(len(keys))
            return inner_get(keys, host_pool, host_indices)

        monkeypatch.setattr(backend, "batch_get", counted)
        again = e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        check_integrity(e)
    assert again["output_ids"] == reference
    assert again["meta_info"]["cached_tokens_details"]["storage"] == (HIT_PAGES - head) * PAGE
    size = race_batch_pages(HIT_PAGES - head, FETCH_BATCH_PAGES)
    assert size < HIT_PAGES - head and calls and max(calls) == size
    assert sum(calls) == HIT_PAGES - head


def test_a_race_against_a_stalled_link_computes_the_hit(tmp_path, reference) -> None:
    """A link on which the hit's pages take seconds: the compute side takes page after
    page, reaches the end with nothing fetched, and the request goes on as a recompute."""
    with tiered(tmp_path) as probe:
        page_bytes = probe.cache.host_pool.page_bytes
    batch_s = 3.0  # the hit's batch on the link: ~30x the hit's compute here
    slow = {"storage.throttle.bandwidth_mb_s": HIT_PAGES * page_bytes / batch_s / 1e6,
            "storage.lmdb.path": str(tmp_path / "slow")}
    with tiered(tmp_path, **slow) as e:
        e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        e.flush_cache(["device", "host"])
        again = e.generate(input_ids=PROMPT, sampling_params=GREEDY)
        check_integrity(e)
        storage = e.stats()["tiers"]["storage"]
    assert again["output_ids"] == reference
    assert again["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert storage["split_prefetches"] == 0
    assert storage["recomputed_hits"] == 1
    assert storage["recomputed_hit_tokens"] == HIT_PAGES * PAGE


def test_a_restart_over_a_stored_prompt_seeds_the_fetch_model(tmp_path) -> None:
    """At attach the tier times three reads of pages the store holds (1, 4 and 16): a
    restarted server has a fetch estimate before its first request."""
    prompt = [(7 * i) % 250 + 3 for i in range(26 * PAGE)]  # 25 whole pages stored
    with tiered(tmp_path) as e:
        e.generate(input_ids=prompt, sampling_params=GREEDY)
        e.scheduler.call(e.cache.steps.quiesce).result(WAIT_S)  # the pages' backups land in L3
        assert e.stats()["tiers"]["storage"]["cost_model"]["fetch_observations"] == 0
        keys = e.cache.storage.io.backend.sample_keys(4)
        assert len(keys) == 4 and e.cache.storage.io.backend.sample_read(keys) > 0
    with tiered(tmp_path) as e:
        model = e.stats()["tiers"]["storage"]["cost_model"]
    assert model["fetch_observations"] == 3
    assert model["fetch_bandwidth_bytes_per_s"] > 0
