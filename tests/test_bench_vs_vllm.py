"""The hicache-vs-vLLM driver's arguments, prompts, stream parsing and report (pure
functions: no vLLM, no server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import answer_ties
from benchmarks import bench_multiturn as bm
from benchmarks import bench_vs_vllm as bv

# tiny-llama's geometry: 8 layers, 2 KV heads of 64.
TINY = {"num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "hidden_size": 512, "max_position_embeddings": 8192}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def test_defaults_and_quick_overrides_that_an_explicit_flag_beats() -> None:
    args = bv.parse_args([])
    assert (args.passes, args.clients, args.rounds, args.kv_tokens) == (3, 8, 5, 3008)
    assert (args.prefill_tokens, args.decode_batch, args.dtype) == (2048, 8, "float32")
    assert args.out == bv.DEFAULT_OUT and args.only is None
    quick = bv.parse_args(["--quick", "--rounds", "3"])
    assert (quick.passes, quick.clients, quick.rounds) == (1, 2, 3)
    assert quick.prefill_tokens == bv.QUICK["prefill_tokens"] < args.prefill_tokens
    assert quick.out == bv.QUICK_OUT


@pytest.mark.parametrize("argv", [
    ["--page-size", "16"],  # vLLM's CPU attention: multiples of 32
    ["--kv-tokens", "3000"],  # not whole pages
    ["--kv-tokens", "1024"],  # smaller than the 2,049-token prefill request
    ["--passes", "0"],
    ["--prefill-tokens", "4096"],  # more than one step's batched tokens
])
def test_bad_arguments_exit_with_code_2(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        bv.parse_args(argv)
    assert e.value.code == 2
    assert "must" in capsys.readouterr().err


def test_page_size_16_is_fine_without_vllm() -> None:
    assert bv.parse_args(["--only", "hicache", "--page-size", "16"]).page_size == 16


def test_kv_bytes_and_the_flags_of_each_server(model_dir: Path) -> None:
    assert bv.kv_cache_bytes(model_dir, 3008, "float32") == 3008 * 8 * 2 * 2 * 64 * 4
    assert bv.kv_cache_bytes(model_dir, 3008, "bfloat16") == 3008 * 8 * 2 * 2 * 64 * 2
    args = bv.parse_args([])
    args.model_path = model_dir
    specs = {s.label: s for s in bv.server_specs(args)}
    assert list(specs) == [bv.VLLM_PREFIX, bv.VLLM_NONE, bv.HI_NONE, bv.HI_L1, bv.HI_L2]
    flags = " ".join(specs[bv.VLLM_PREFIX].flags)
    assert "--enable-prefix-caching --enable-prompt-tokens-details" in flags
    # 3,008 tokens and vLLM's null block of 32, 8,192 bytes a token
    assert f"--kv-cache-memory-bytes {(3008 + 32) * 8192}" in flags and "--block-size 32" in flags
    assert "--max-model-len 3008" in flags
    assert "--no-enable-prefix-caching" in specs[bv.VLLM_NONE].flags
    assert "--disable-radix-cache" in specs[bv.HI_NONE].flags
    assert "--enable-hierarchical-cache" not in specs[bv.HI_L1].flags
    hier = specs[bv.HI_L2].flags
    # the default workload's 12,032-token working set x 1.5 headroom over 3,008 tokens
    assert hier[hier.index("--hicache-ratio") + 1] == "6.0"
    # hicache gets the same bytes, less vLLM's null block: 3,008 tokens of every layer
    assert all(s.flags[s.flags.index("--kv-cache-memory-bytes") + 1] == str(3008 * 8192)
               for s in specs.values() if s.engine == bv.HICACHE)
    args.only = bv.HICACHE
    assert [s.engine for s in bv.server_specs(args)] == [bv.HICACHE] * 3


def test_vllm_env_binds_every_core_and_drops_the_gib_kv_size(monkeypatch: Any) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    env = bv.vllm_env(cores=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_calibration_prompts_are_deterministic_and_distinct() -> None:
    a = bv.calibration_prompts(0, "prefill", 3, 2048)
    assert a == bv.calibration_prompts(0, "prefill", 3, 2048)
    assert [len(p) for p in a] == [2048] * 3 and all(0 <= t < bm.BYTE_VOCAB for t in a[0])
    assert len({tuple(p[:32]) for p in a}) == 3  # no two share a first page
    assert bv.calibration_prompts(0, "decode_b1", 1, 2048)[0][:32] != a[0][:32]
    assert bv.calibration_prompts(1, "prefill", 1, 2048)[0] != a[0]
    # and the multi-turn workload is bench_multiturn's, from the same seed
    wl = [bm.make_workload(bm.workload_args(bv.parse_args([]))) for _ in range(2)]
    assert wl[0].system == wl[1].system and wl[0].questions == wl[1].questions


def _chunk(ids: list[int], usage: dict | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": "", "token_ids": ids}], **extra,
            **({"usage": usage} if usage else {})}


def test_chunks_give_ttft_gaps_ids_and_cached_tokens_of_either_server() -> None:
    rec = bm.Record(0, 1, start=10.0)
    last = bv.take_chunk(rec, _chunk([5]), 10.5, rec.start)
    last = bv.take_chunk(rec, _chunk([6, 7]), 10.7, last)  # two tokens in one chunk
    last = bv.take_chunk(rec, _chunk([8]), 11.0, last)
    usage = {"prompt_tokens": 100, "completion_tokens": 4,
             "prompt_tokens_details": {"cached_tokens": 64}}
    bv.take_chunk(rec, {"choices": [], "usage": usage}, 11.1, last)  # vLLM's usage chunk
    assert rec.ttft == pytest.approx(0.5) and rec.itl == pytest.approx([0.2, 0.3])
    assert rec.output_ids == [5, 6, 7, 8] and rec.prompt_tokens == 100
    assert rec.cached == {"device": 64, "host": 0, "storage": 0}
    assert bv.decode_step_s([rec]) == pytest.approx(0.5 / 3)
    hi = bm.Record(0, 1)
    bv.take_chunk(hi, {"choices": [], "usage": usage, "sglext": {"cached_tokens_details": {
        "device": 32, "host": 32, "storage": 0}}}, 1.0, 0.0)
    assert hi.cached == {"device": 32, "host": 32, "storage": 0}
    assert bv.decode_step_s([hi]) is None  # no tokens
    bad = bm.Record(0, 1)
    bv.take_chunk(bad, {"error": {"message": "boom"}}, 1.0, 0.0)
    assert "boom" in bad.error


def test_the_request_body_is_greedy_streamed_and_asks_for_ids_and_usage() -> None:
    body = bv.completion_body([1, 2, 3], 8)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 8
    assert body["temperature"] == 0 and body["ignore_eos"] and body["stream"]
    assert body["return_token_ids"] and body["stream_options"] == {"include_usage": True}


def test_speed_ratios_are_above_1_when_hicache_is_faster() -> None:
    assert bv.speed_ratio("prefill_s", 0.5, 1.0) == pytest.approx(2.0)  # half the time
    assert bv.speed_ratio("request_throughput", 3.0, 1.5) == pytest.approx(2.0)
    assert bv.speed_ratio("ttft_after_first_s", 2.0, 1.0) == pytest.approx(0.5)
    assert bv.speed_ratio("prefill_s", None, 1.0) is None


def _run(label: str, engine: str, rep: int, scale: float, answer: int) -> dict[str, Any]:
    """A fake pass: every time `scale` times a base, 4 requests (2 chats x 2 rounds)."""
    recs = [{"client": c, "round": r, "ttft_s": scale * r, "prompt_tokens": 100,
             "cached": {"device": 50 if r == 2 else 0, "host": 0, "storage": 0},
             "output_ids": [answer, c, r], "error": None} for r in (1, 2) for c in (0, 1)]
    return {"label": label, "engine": engine, "pass": rep, "kv_tokens_usable": 3008,
            "calibration": {"prefill_s": scale * 1.0, "decode_b1_s": scale * 0.02,
                            "decode_batch_s": scale * 0.04, "errors": []},
            "multiturn": {"request_throughput": 1.0 / scale, "ttft_after_first_s": scale * 2,
                          "hit_rate": {"all": 0.25}, "errors": 0, "records": recs}}


def test_summary_ratios_same_tokens_and_the_json_shape() -> None:
    runs = [_run(bv.VLLM_PREFIX, bv.VLLM, 1, 1.0, 7), _run(bv.VLLM_NONE, bv.VLLM, 1, 2.0, 7),
            _run(bv.HI_NONE, bv.HICACHE, 1, 4.0, 7), _run(bv.HI_L1, bv.HICACHE, 1, 0.5, 7),
            _run(bv.VLLM_PREFIX, bv.VLLM, 2, 3.0, 7), _run(bv.HI_L1, bv.HICACHE, 2, 1.5, 9)]
    s = bv.summarize_runs(runs)
    assert s["reference"] == f"{bv.VLLM_PREFIX} pass 1"
    vp, l1, nc = (s["servers"][k] for k in (bv.VLLM_PREFIX, bv.HI_L1, bv.HI_NONE))
    assert vp["metrics"]["prefill_s"] == bv.Spread(2.0, 1.0, 3.0, [1.0, 3.0])
    assert vp["vs"] is None and vp["same_tokens"] == [4, 4]  # pass 2 against pass 1
    assert l1["vs"] == bv.VLLM_PREFIX and nc["vs"] == bv.VLLM_NONE
    assert l1["ratios"]["prefill_s"] == pytest.approx(2.0 / 1.0)  # medians 1.0 vs 2.0
    # medians: 1.333 req/s (2 and 0.667) against 0.667 (1 and 0.333)
    assert l1["ratios"]["request_throughput"] == pytest.approx(2.0)
    assert nc["ratios"]["decode_b1_s"] == pytest.approx(0.5)  # 4x slower than 2x
    assert l1["same_tokens"] == [4, 8]  # pass 2 answered differently
    doc = json.loads(json.dumps(bv.as_json({"summary": s})))
    m = doc["summary"]["servers"][bv.HI_L1]["metrics"]["ttft_after_first_s"]
    assert m == {"median": 2.0, "min": 1.0, "max": 3.0, "each": [1.0, 3.0]}
    table = bv.multiturn_table(s)
    assert f"| {bv.HI_L1} | 1.333 (2.000) | 2.00x | 2,000 (1,000) | 2.00x | 25.0% (25.0%) " \
        "| 4 of 8 | 0 |" in table
    cal = bv.calibration_table(s, 8)
    assert f"| {bv.HI_NONE} | 4,000 | 0.50x | 80.0 | 0.50x | 160.0 | 0.50x | 3,008 |" in cal
    assert f"| {bv.VLLM_PREFIX} | 2,000 (1,000) |  |" in cal


def test_without_vllm_the_reference_is_the_first_server() -> None:
    runs = [_run(bv.HI_NONE, bv.HICACHE, 1, 2.0, 7), _run(bv.HI_L1, bv.HICACHE, 1, 1.0, 7)]
    s = bv.summarize_runs(runs)
    assert s["reference"] == f"{bv.HI_NONE} pass 1"
    assert s["servers"][bv.HI_L1]["same_tokens"] == [4, 4]
    assert s["servers"][bv.HI_L1]["errors"] == 0
    assert s["servers"][bv.HI_L1]["vs"] is None
    assert s["servers"][bv.HI_L1]["ratios"] == dict.fromkeys(
        ["prefill_s", "decode_b1_s", "decode_batch_s", "request_throughput",
         "ttft_after_first_s", "long_docs_ttft_s"])
    assert s["servers"][bv.HI_L1]["long_docs_same"] == [0, 0]  # the workload did not run


def test_kv_tokens_read_from_either_log(tmp_path: Path) -> None:
    hi, vl = tmp_path / "hicache.log", tmp_path / "vllm.log"
    hi.write_text("2026-12-01 14:31:56,117 INFO hicache.stack: L1 (cpu): 3008 tokens, 0.02 GB\n")
    vl.write_text("(EngineCore pid=1) INFO [kv_cache_utils.py:2327] CPU KV cache size: 3,040 "
                  "tokens, Maximum concurrency for 3,008 tokens per request: 1.01x\n")
    assert bv.logged_tokens(bv.HICACHE_KV_LOGGED, hi) == 3008
    assert bv.logged_tokens(bv.VLLM_KV_LOGGED, vl) == 3040
    assert bv.logged_tokens(bv.VLLM_KV_LOGGED, hi) is None
    assert bv.logged_tokens(bv.VLLM_KV_LOGGED, tmp_path / "missing.log") is None


def _workload() -> bm.Workload:
    return bm.Workload(system=[1, 2], questions=[[[3], [4], [5]], [[6], [7], [8]]],
                       no_reuse=False, history=[[1, 2], [1, 2]])


def test_each_chat_is_compared_up_to_its_first_differing_answer() -> None:
    """Chat 0 differs in round 2 at its second token (the prompt holds round 1's shared
    answer); chat 1 never differs; round 3 of chat 0 follows a divergence, uncompared."""
    ref = {(0, 1): [9, 9], (0, 2): [10, 11, 12], (0, 3): [13], (1, 1): [14], (1, 2): [15],
           (1, 3): [16]}
    ours = {**ref, (0, 2): [10, 20, 12], (0, 3): [30]}
    found, after = answer_ties.first_divergences(_workload(), ours, ref, rounds=3)
    assert found == [answer_ties.Divergence(0, 2, [1, 2, 3, 9, 9, 4], [10], 20, 11)]
    assert after == 1
    # an answer that is a prefix of the other's (a stop) has no token to score
    short = {**ref, (1, 1): []}
    found, after = answer_ties.first_divergences(_workload(), short, ref, rounds=3)
    assert found == [] and after == 2


def test_each_long_document_answer_that_differs_is_compared_at_its_first_token() -> None:
    """A long-document question holds no earlier answer: every one that differs is a
    divergence at its first differing token, its prompt rebuilt from the seed; one that
    stopped early has none, and one the reference lacks is not compared."""
    from benchmarks import long_docs

    asked = long_docs.questions(2, seed=3)
    ref_ids = {(q.doc, q.index): [q.doc, q.index, 7] for q in asked}

    def run(ids: dict) -> dict:
        return {"long_docs": {"records": [{"doc": d, "question": i, "output_ids": o,
                                           "error": None} for (d, i), o in ids.items()]}}
    ours = {**ref_ids, (1, 2): [1, 2, 9], (0, 3): [0], (1, 0): [5]}
    theirs = {k: v for k, v in ref_ids.items() if k != (1, 0)}
    found = answer_ties.long_doc_divergences(run(ours), run(theirs), docs=2, seed=3)
    prompt = next(q.prompt for q in asked if (q.doc, q.index) == (1, 2))
    assert found == [answer_ties.Divergence(1, 3, prompt, [1, 2], 9, 7)]


def test_a_divergence_is_scored_by_the_model_it_came_from(monkeypatch, tmp_path: Path
                                                          ) -> None:
    """The embedded model scores the shared prefix: the gap is its logit difference
    between the two tokens, and a near tie is one within the dtype's share of the scale."""
    from hicache_server.models.loader import EMBEDDED_TINY_LLAMA

    monkeypatch.setenv("HICACHE_HOME", str(tmp_path))
    scorer = answer_ties.Scorer(EMBEDDED_TINY_LLAMA, "float32")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    logits = scorer.logits(prompt)
    top2 = logits.topk(2).indices.tolist()
    d = answer_ties.Divergence(0, 1, prompt[:-2], prompt[-2:], top2[0], top2[1])
    got = answer_ties.explain(d, scorer, "float32")
    assert got["argmax_here"] == top2[0] and got["token"] == 2
    assert got["gap"] == pytest.approx(float(logits[top2[0]] - logits[top2[1]]))
    assert got["near_tie"] == (got["gap"] <= 1e-3 * float(logits.abs().max()))
    far = answer_ties.explain(d._replace(theirs=int(logits.argmin())), scorer, "float32")
    assert not far["near_tie"]


def test_vllm_preloads_the_systems_tcmalloc_else_the_venvs_and_its_libiomp5(
        tmp_path: Path, monkeypatch: Any) -> None:
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    python = venv / "bin" / "python"
    monkeypatch.setattr(bv, "TCMALLOC", tmp_path / "system" / bv.TCMALLOC_NAME)
    assert bv.vllm_preload(python) == []
    (venv / "lib" / "libiomp5.so").touch()
    (venv / "lib" / bv.TCMALLOC_NAME).touch()
    assert bv.vllm_preload(python) == [str(venv / "lib" / bv.TCMALLOC_NAME),
                                       str(venv / "lib" / "libiomp5.so")]
    bv.TCMALLOC.parent.mkdir()
    bv.TCMALLOC.touch()  # installed on the system: that one
    assert bv.vllm_preload(python) == [str(bv.TCMALLOC), str(venv / "lib" / "libiomp5.so")]
    assert bv.vllm_preload(None) == [str(bv.TCMALLOC)]


def test_the_report_names_vllms_preload_only_where_vllm_ran() -> None:
    """A `--only hicache` run records no preload (None) and its header says nothing of one;
    a vLLM run's header names each library, or "nothing"."""
    assert bv.preload_clause({"vllm_preload": None}) == ""
    assert bv.preload_clause({}) == ""
    assert bv.preload_clause({"vllm_preload": []}) == "; vLLM preloads nothing"
    assert bv.preload_clause({"vllm_preload": ["libtcmalloc_minimal.so.4", "libiomp5.so"]}) \
        == "; vLLM preloads libtcmalloc_minimal.so.4, libiomp5.so"


def test_cached_only_leaves_out_the_no_cache_servers(model_dir: Path) -> None:
    args = bv.parse_args(["--cached-only", "--quick"])
    args.model_path = model_dir
    assert [s.label for s in bv.server_specs(args)] == [bv.VLLM_PREFIX, bv.HI_L1, bv.HI_L2]
