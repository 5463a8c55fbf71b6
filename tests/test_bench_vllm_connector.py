"""bench_vllm_connector's summary and report (pure functions: no vLLM, no server)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks import bench_vllm_connector as bc

ALONE, HI, EX = bc.ALONE, bc.HICACHE, bc.EXAMPLE


def _pass(req_s: float, answers: list[int] | None = None) -> dict[str, Any]:
    records = [{"client": 0, "round": 1, "output_ids": answers or [7, 8], "error": None}]
    return {"request_throughput": req_s, "ttft_after_first_s": 1.0 / req_s, "errors": 0,
            "hit_rate": {"all": 0.5}, "records": records}


def _result(mt: dict[str, list[float]], nr: dict[str, list[float]]) -> dict[str, Any]:
    one = [{"latency_s": 1.0, "token": [5], "cached": 0}]
    replay = [{"latency_s": 0.05, "token": [5], "cached": 1472}]
    return {"restart": {ALONE: one, HI: {"first": one, "replay": replay},
                        EX: {"first": one, "replay": replay}},
            "serving": {name: {"multiturn": _pass(rates[0])} for name, rates in mt.items()},
            "multiturn_more": {name: [_pass(r, [7, 9] if name == HI else None)
                                      for r in rates[1:]] for name, rates in mt.items()},
            "no_reuse": {name: [_pass(r) for r in rates] for name, rates in nr.items()}}


def _args() -> argparse.Namespace:
    return argparse.Namespace(restart_tokens=1500, clients=8, rounds=5, kv_tokens=3008,
                              no_reuse_passes=2)


def test_each_goal_is_judged_on_median_over_median_and_on_the_pairs() -> None:
    # multi-turn: 1.55x median over median, pairs 1.1x and 2.0x (median 1.55x); no reuse:
    # 0.975x median over median, pairs 0.95x and 1.0x (median 0.975x): both met
    s = bc.summarize(_result({ALONE: [1.0, 1.0], HI: [1.1, 2.0]},
                             {ALONE: [1.0, 1.0], HI: [0.95, 1.0]}))
    assert s["multiturn"][HI]["req_s"] == pytest.approx(1.55)
    assert s["multiturn"][HI]["req_s_each"] == [1.1, 2.0]
    assert s["multiturn_pair_ratios"] == pytest.approx([1.1, 2.0])
    assert s["no_reuse_ratio"] == pytest.approx(0.975)
    # the second connector pass answered differently from vLLM alone's first: counted
    assert s["same_multiturn_tokens"] == [1, 2]
    text = bc.report(s, _args(), ["libtcmalloc_minimal.so.4"])
    assert text.startswith("vLLM preloads libtcmalloc_minimal.so.4")
    assert "(goal >= 1.5, both: met); 1 of 2 answers the same" in text
    assert "not met" not in text
    # multi-turn 1.5x median over median (3.0 / 2.0) but pairs 1.4x and 1.53x (median
    # 1.47x); no reuse 0.98x median over median, pairs 0.93x and 1.03x (0.98x): the
    # multi-turn goal is not met, the other is
    s = bc.summarize(_result({ALONE: [1.0, 3.0], HI: [1.4, 4.6]},
                             {ALONE: [1.0, 1.0], HI: [0.93, 1.03]}))
    assert s["multiturn_ratio"] == pytest.approx(1.5)
    assert sorted(s["multiturn_pair_ratios"]) == pytest.approx([1.4, 4.6 / 3])
    text = bc.report(s, _args(), [])
    assert text.startswith("vLLM preloads nothing")
    assert "(goal >= 1.5, both: not met)" in text and text.count("not met") == 1


def test_a_report_of_one_multiturn_pass_still_summarizes() -> None:
    result = _result({ALONE: [1.0], HI: [1.6]}, {ALONE: [1.0], HI: [0.99]})
    del result["multiturn_more"]  # written before the multi-turn passes were paired
    s = bc.summarize(result)
    assert s["multiturn_pair_ratios"] == [1.6] and s["same_multiturn_tokens"] == [1, 1]
    assert "both: met" in bc.report(s, _args(), [])


def test_a_restart_only_run_reports_each_connector_against_its_first_pass() -> None:
    one = [{"latency_s": 1.0, "token": [5], "cached": 0}]
    result = {"restart": {ALONE: one,
                          HI: {"first": one, "replay": [{"latency_s": 0.06, "token": [5],
                                                         "cached": 1472}]},
                          bc.HICACHE_ASYNC: {"first": one, "replay": [
                              {"latency_s": 0.08, "token": [6], "cached": 1472}]},
                          EX: {"first": [{"latency_s": 2.0, "token": [5], "cached": 0}],
                               "replay": [{"latency_s": 0.1, "token": [5], "cached": 1472}]}}}
    s = bc.summarize(result)
    assert set(s) == {"alone_restart_s", "restart"}
    assert s["restart"][EX]["replay_over_first"] == pytest.approx(0.05)
    assert s["restart"][HI]["replay_over_first"] == pytest.approx(0.06)
    assert not s["restart"][bc.HICACHE_ASYNC]["same_tokens"]
    text = bc.report(s, _args(), [])
    assert "| 0.060 | 0.060 | <= 0.15 met |" in text and "multi-turn" not in text
    assert f"| {bc.HICACHE_ASYNC} | 1000 ms | 80 ms | 0.080 |" in text


def test_kv_bytes_per_token_reads_the_model_folders_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 18, "num_key_value_heads": 1, "head_dim": 256, '
        '"hidden_size": 640, "num_attention_heads": 4}')
    assert bc.kv_bytes_per_token(tmp_path) == 18 * 2 * 256 * 4  # Gemma 3 270M: 36,864
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 30, "num_key_value_heads": 3, "hidden_size": 576, '
        '"num_attention_heads": 9}')
    assert bc.kv_bytes_per_token(tmp_path) == 46_080  # SmolLM2-135M: head_dim 64 derived
