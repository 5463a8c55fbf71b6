"""Timed forwards at start (`storage.prefill_warmup_s`): the prefill model has observations
before the first request, and the forwards leave nothing behind."""

from __future__ import annotations

from test_engine import GREEDY, tiered


def test_the_warm_up_times_forwards_and_keeps_nothing(tmp_path) -> None:
    with tiered(tmp_path, **{"storage.prefill_warmup_s": 30.0}) as e:
        # the warm-up runs before the scheduler's first step: a call waits for it
        observed = e.scheduler.call(
            lambda: e.cache.storage.estimates().prefill_observations).result(120)
        free = e.scheduler.call(lambda: e.cache.device_pool.available_size()).result(120)
        total = e.cache.device_pool.allocator.total_size()
        answer = e.generate(input_ids=list(range(1, 40)), sampling_params=GREEDY)
    assert observed >= 3  # the model can be fitted from them
    assert free == total  # every borrowed slot given back, nothing in the tree
    assert answer["output_ids"]


def test_no_warm_up_without_a_storage_tier_or_a_budget(tmp_path) -> None:
    with tiered(tmp_path, **{"storage.prefill_warmup_s": 0.0}) as e:
        observed = e.scheduler.call(
            lambda: e.cache.storage.estimates().prefill_observations).result(120)
    assert observed == 0


def test_a_failing_warm_up_leaves_a_serving_engine(tmp_path, monkeypatch, caplog) -> None:
    """The warm-up is an optimisation: a forward that raises is logged, and the engine
    serves (its cost model learns from the first requests)."""
    from hicache_server.model_runner import ModelRunner

    def broken(self, tokens):
        raise RuntimeError("no made-up tokens today")

    monkeypatch.setattr(ModelRunner, "timed_prefill", broken)
    with caplog.at_level("WARNING", logger="hicache_server.scheduler.warmup"), \
            tiered(tmp_path, **{"storage.prefill_warmup_s": 1.0}) as e:
        answer = e.generate(input_ids=list(range(1, 40)), sampling_params=GREEDY)
    assert answer["output_ids"]
    assert "prefill warm-up failed" in caplog.text
