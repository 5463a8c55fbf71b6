"""Prometheus metrics: every name through /metrics of a real engine, and CacheMetrics alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import lmdb
import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import app_client, tiered_engine, tiered_engine_in
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from hicache.stats import CacheStats, DeviceStats, HostStats, RequestCounters, StorageStats
from hicache.storage.planner import CostEstimates
from hicache.storage.tier import StorageCounters
from hicache.tree import HostCounters
from hicache_server.engine import Engine
from hicache_server.http import attach_metrics, create_app
from hicache_server.http.metrics import CacheMetrics, TierSummary, tier_summaries

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
PAGE = 16
PROMPT = [(5 * i + 3) % 250 for i in range(6 * PAGE)]
GREEDY = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
TIERED = ("tier_capacity_tokens", "tier_used_tokens", "cached_tokens_total",
          "evicted_tokens_total")
PLAIN = ("prompt_tokens_total", "cache_hit_rate", "load_back_tokens_total",
         "prefetch_tokens_total", "prefetch_restarts_total", "storage_corrupt_pages_total",
         "requests_total",
         "generated_tokens_total")
HISTOGRAMS = ("ttft_seconds", "load_back_seconds", "prefetch_seconds")


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[("hicache:" + name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from tiered_engine_in(tmp_path_factory, "metrics_lmdb")


async def test_every_metric_after_traffic_through_all_tiers(engine: Engine) -> None:
    loop = asyncio.get_running_loop()
    async with TestClient(TestServer(create_app(engine))) as client:
        async def generate() -> dict[str, Any]:
            resp = await client.post("/generate", json={"input_ids": PROMPT,
                                                        "sampling_params": GREEDY})
            assert resp.status == 200
            return (await resp.json())["meta_info"]["cached_tokens_details"]

        await generate()
        await loop.run_in_executor(None, engine.flush_cache, ["device"])  # waits for backups
        assert (await generate())["host"] > 0                # an L2->L1 load-back
        await loop.run_in_executor(None, engine.flush_cache, ["device", "host"])
        assert (await generate())["storage"] > 0             # an L3 prefetch
        resp = await client.get("/metrics")
        assert resp.status == 200 and resp.content_type == "text/plain"
        samples = parse(await resp.text())
    names = {name for name, _ in samples}
    for name in PLAIN + ("backup_tokens_total", "storage_errors_total"):
        assert "hicache:" + name in names, name
    for name in TIERED:
        assert {dict(labels).get("tier") for n, labels in samples if n == "hicache:" + name} \
            == {"device", "host", "storage"}, name
    for name in HISTOGRAMS:
        assert value(samples, name + "_count") >= 1, name
        assert value(samples, name + "_bucket", le="+Inf") == value(samples, name + "_count")
    assert value(samples, "ttft_seconds_count") == 3
    assert value(samples, "requests_total") == 3
    assert value(samples, "prompt_tokens_total") == 3 * len(PROMPT)
    assert value(samples, "generated_tokens_total") == 3 * GREEDY["max_new_tokens"]
    assert 0 < value(samples, "cache_hit_rate") <= 1
    for tier in ("host", "storage"):
        assert value(samples, "cached_tokens_total", tier=tier) > 0
    assert value(samples, "load_back_tokens_total") > 0
    assert value(samples, "prefetch_tokens_total") > 0
    assert value(samples, "backup_tokens_total", dest="host") > 0
    assert value(samples, "backup_tokens_total", dest="storage") > 0
    assert value(samples, "evicted_tokens_total", tier="device") > 0
    assert value(samples, "evicted_tokens_total", tier="host") > 0
    assert value(samples, "tier_capacity_tokens", tier="device") == 2048
    assert value(samples, "storage_errors_total", op="get") == 0
    assert value(samples, "storage_corrupt_pages_total") == 0


# ------------------------------------------------------------------ CacheMetrics alone

L1_ONLY = CacheStats(RequestCounters(requests=2, prompt_tokens=128, generated_tokens=10,
                                     cached_device_tokens=32),
                     DeviceStats(256, 64, 48, 16, 32))
THREE_TIERS = CacheStats(
    RequestCounters(requests=2, prompt_tokens=128, generated_tokens=10, cached_device_tokens=32,
                    cached_host_tokens=16, cached_storage_tokens=32),
    DeviceStats(256, 64, 48, 16, 32),
    HostStats(512, 96, 80, 0, 16, HostCounters(written_tokens=96, device_evicted_tokens=32,
                                               host_evicted_tokens=8, load_back_tokens=16,
                                               reclaimed_copy_tokens=4,
                                               write_dropped_tokens=2)),
    StorageStats.read({"pages": 3, "capacity_bytes": 10_000, "evicted_pages": 2,
                       "corrupt_pages": 1, "errors_by_op": {"get": 4, "set": 0}}, {}, 32,
                      StorageCounters(prefetched_tokens=32, backed_up_tokens=48),
                      page_tokens=PAGE, page_bytes=1000))


def render(stats: CacheStats, **kwargs: Any) -> Samples:
    metrics = CacheMetrics(lambda: stats, page_size=PAGE, **kwargs)
    return parse(metrics.render().decode())


def test_l1_only_yields_device_samples_only() -> None:
    samples = render(L1_ONLY)
    assert value(samples, "cache_hit_rate") == 32 / 128
    assert value(samples, "tier_used_tokens", tier="device") == 64
    tiers = {dict(labels).get("tier") for _, labels in samples} - {None}
    assert tiers == {"device"}
    names = {name for name, _ in samples}
    assert not {"hicache:load_back_tokens_total", "hicache:storage_errors_total",
                "hicache:prefetch_tokens_total"} & names
    assert "hicache:evicted_tokens_total" not in names  # L1 alone does not count evictions


def test_three_tiers_convert_storage_pages_to_tokens() -> None:
    samples = render(THREE_TIERS)
    assert value(samples, "cache_hit_rate") == (32 + 16 + 32) / 128
    assert value(samples, "tier_used_tokens", tier="storage") == 3 * PAGE
    assert value(samples, "tier_capacity_tokens", tier="storage") == 10 * PAGE
    assert value(samples, "evicted_tokens_total", tier="storage") == 2 * PAGE
    assert value(samples, "evicted_tokens_total", tier="device") == 32
    assert value(samples, "storage_errors_total", op="get") == 4
    assert value(samples, "storage_corrupt_pages_total") == 1
    assert value(samples, "backup_tokens_total", dest="storage") == 48
    assert value(samples, "host_reclaimed_copy_tokens_total") == 4
    assert value(samples, "host_write_dropped_tokens_total") == 2
    # without a stored page's size, no storage capacity sample
    no_size = render(replace(THREE_TIERS, storage=replace(THREE_TIERS.storage, page_bytes=0)))
    assert ("hicache:tier_capacity_tokens", (("tier", "storage"),)) not in no_size


def test_no_requests_is_a_zero_hit_rate() -> None:
    assert value(render(CacheStats(RequestCounters(), DeviceStats(0, 0, 0, 0, 0))),
                 "cache_hit_rate") == 0


def test_observe_feeds_histograms_and_drops_unknown_names(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = CacheMetrics(lambda: L1_ONLY, page_size=PAGE)
    for seconds in (0.003, 0.2, 100.0):
        metrics.observe("ttft_seconds", seconds)
    metrics.observe("no_such_seconds", 1.0)
    metrics.observe("no_such_seconds", 1.0)
    samples = parse(metrics.render().decode())
    assert value(samples, "ttft_seconds_count") == 3
    assert value(samples, "ttft_seconds_bucket", le="0.005") == 1
    assert value(samples, "ttft_seconds_bucket", le="80.0") == 2
    assert value(samples, "ttft_seconds_sum") == pytest.approx(100.203)
    assert sum("no_such_seconds" in r.getMessage() for r in caplog.records) == 1


def test_each_instance_has_its_own_registry() -> None:
    first, second = (CacheMetrics(lambda: L1_ONLY, page_size=PAGE) for _ in range(2))
    first.observe("ttft_seconds", 1.0)
    assert value(parse(second.render().decode()), "ttft_seconds_count") == 0
    assert REGISTRY.get_sample_value("hicache:ttft_seconds_count") is None
    assert first.content_type.startswith("text/plain; version=0.0.4")


def test_tier_summaries_and_bad_page_size() -> None:
    summaries = tier_summaries(THREE_TIERS)
    assert summaries["device"] == TierSummary(256, 64, 48, 16, 32)
    assert summaries["storage"] == TierSummary(160, 48, 48, 0, 32)
    with pytest.raises(ValueError, match="page_size"):
        CacheMetrics(lambda: L1_ONLY, page_size=0)


def test_faults_a_backend_catches_itself_reach_metrics_and_admin_tiers(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend turns its own faults into misses; they used to stay inside its stats and
    `storage_errors_total` said 0 while every L3 call failed."""
    with tiered_engine(tmp_path / "lmdb") as e:
        store = e.cache.storage.io.backend

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise lmdb.Error("injected: Input/output error")

        monkeypatch.setattr(store.env, "txn", broken)
        out = e.generate(input_ids=PROMPT, sampling_params=GREEDY)  # queries, then backs up
        assert out["meta_info"]["finish_reason"] == "length"
        e.flush_cache(["device"])  # waits for the backup, which fails
        samples = parse(attach_render(e))
        assert value(samples, "storage_errors_total", op="batch_exists") >= 1
        assert value(samples, "storage_errors_total", op="batch_set") >= 1

        async def tiers() -> dict[str, Any]:
            async with app_client(e, admin=True, wait_idle=False) as client:
                return (await (await client.get("/admin/tiers")).json())["tiers"]["storage"]

        storage = asyncio.run(tiers())
        assert storage["errors_by_op"]["batch_exists"] >= 1
        assert storage["errors"] == sum(storage["errors_by_op"].values()) >= 2


def attach_render(e: Engine) -> str:
    return attach_metrics(e).render().decode()


def test_the_cost_model_reaches_metrics() -> None:
    """What the storage tier's cost model decided (counters) and believes (gauges, absent
    until it has an estimate)."""
    decided = StorageCounters(split_prefetches=2, head_tokens=64, recomputed_hit_tokens=128)
    cold = replace(THREE_TIERS, storage=replace(THREE_TIERS.storage, counters=decided))
    estimates = CostEstimates(5000.0, 2e9, 1e-3, 10, 4, 1.25, 3)
    warm = replace(cold, storage=replace(cold.storage, estimates=estimates))
    for stats in (cold, warm):
        samples = render(stats)
        assert value(samples, "storage_split_prefetches_total") == 2
        assert value(samples, "storage_head_tokens_total") == 64
        assert value(samples, "storage_recomputed_hit_tokens_total") == 128
    names = {name for name, _ in render(cold)}
    assert "hicache:estimated_prefill_tokens_per_second" not in names
    samples = render(warm)
    assert value(samples, "estimated_prefill_tokens_per_second") == 5000
    assert value(samples, "storage_estimated_fetch_bytes_per_second") == 2e9
    assert value(samples, "storage_estimated_fetch_latency_seconds") == 1e-3
    assert value(samples, "storage_race_time_factor") == 1.25
    assert warm.storage.as_dict()["cost_model"]["prefill_observations"] == 10


def test_kv_event_counters_are_exported_only_when_events_are_on() -> None:
    from dataclasses import replace

    from hicache.events.publisher import EventCounters
    on = render(replace(L1_ONLY, events=EventCounters(batches=3, events=7, dropped_batches=1,
                                                      dropped_events=2)))
    assert value(on, "kv_event_batches_total") == 3
    assert value(on, "kv_events_total") == 7
    assert value(on, "kv_events_dropped_total") == 2
    assert not any(name.startswith("hicache:kv_event") for name, _ in render(L1_ONLY))
