"""L3 of a hybrid model by kind (`hicache.storage.kinds`): Gemma 3 270M (15 window layers of 512
tokens, 3 full) stores every page's full layers and only the trailing window of each boundary
its tree kept; a model stored in full would keep all 18 layers for every page.

For each prompt length: a server with L1, L2 and L3 (LMDB in a temporary folder) serves a
prompt of random token ids once (its time to the first token is the recompute), flushes L1 and
L2 and closes; a second server on the same LMDB (a restart) serves it again. Reported: the
stored bytes per stored token against storing every layer (the goal: <= 0.25x), the restart's
hit and its time to the first token against the recompute (the goal at 4k: <= 0.2x).

    python -m benchmarks.bench_l3_kinds                       # 4k and 8k, float32
    python -m benchmarks.bench_l3_kinds --dtype bfloat16
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from benchmarks.bench_window_bytes import run_args, save_rows
from hicache.storage.page_format import VALUE_OVERHEAD
from hicache_server.config import load_config
from hicache_server.engine import Engine

BYTES_GOAL, RESTART_GOAL = 0.25, 0.2


def _engine(model: str, dtype: str, lmdb: Path) -> Engine:
    return Engine(load_config(None, {
        "model.path": model, "model.device": "cpu", "model.dtype": dtype,
        "cache.hierarchical": True, "storage.backend": "lmdb", "storage.lmdb.path": str(lmdb),
        "storage.prefetch_policy": "wait_complete"}))


def _first_token(e: Engine, prompt: list[int]) -> tuple[float, dict]:
    started = time.perf_counter()
    out = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1,
                                                        "temperature": 0})
    return time.perf_counter() - started, out


def measure(model: str, dtype: str, length: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 200_000) for _ in range(length)]
    with tempfile.TemporaryDirectory() as tmp:
        lmdb = Path(tmp) / "l3"
        with _engine(model, dtype, lmdb) as e:
            recompute_s, first = _first_token(e, prompt)
            e.flush_cache(["device", "host"])  # every backup lands first
            storage = e.stats()["tiers"]["storage"]
            pool = e.cache.slots.device_kv()
            full_bpt = pool.full_token_bytes
            window_bpt = pool.window_token_bytes
            ps = pool.page_size
        with _engine(model, dtype, lmdb) as again:
            restart_s, out = _first_token(again, prompt)
    full_tokens, window_tokens = storage["backed_up_tokens"], storage["window_backed_up_tokens"]
    overhead = VALUE_OVERHEAD / ps  # a stored value's header and tag, per token
    stored = full_tokens * (full_bpt + overhead) + window_tokens * (window_bpt + overhead)
    every_layer = full_tokens * (full_bpt + window_bpt + overhead)
    return {"prompt_tokens": length, "full_part_tokens": full_tokens,
            "window_part_tokens": window_tokens, "stored_bytes": stored,
            "store_bytes_reported": storage["bytes"],
            "bytes_ratio": stored / every_layer,
            "restart_hit": out["meta_info"]["cached_tokens_details"],
            "same_token": out["output_ids"] == first["output_ids"],
            "recompute_ttft_s": recompute_s, "restart_ttft_s": restart_s,
            "restart_ratio": restart_s / recompute_s}


def main() -> None:
    args = run_args(__doc__, [4096, 8192])
    rows = [measure(args.model, args.dtype, n) for n in args.lengths]
    for r in rows:
        print(f"{r['prompt_tokens']:>6} tokens ({args.dtype}): L3 holds {r['full_part_tokens']} "
              f"tokens of full layers, {r['window_part_tokens']} of window layers = "
              f"{r['bytes_ratio']:.3f}x the bytes of every layer (goal <= {BYTES_GOAL}); "
              f"restart hit {r['restart_hit']}, same token {r['same_token']}, TTFT "
              f"{r['recompute_ttft_s']:.2f} s -> {r['restart_ttft_s']:.3f} s = "
              f"{r['restart_ratio']:.3f}x (goal <= {RESTART_GOAL} at 4k)")
    print(f"wrote {save_rows('l3_kinds', args, rows)}")


if __name__ == "__main__":
    main()
