"""Time to first token when a prompt's prefix comes from each tier, against recomputing it.

For each prompt length, fresh random prompts are served four ways by one engine
(hierarchical cache, write-through, LMDB with `wait_complete` prefetch), in this order:

    recompute   first sight: every token is prefilled
    L1          the same prompt again: the prefix is on the device
    L2          after flushing the device tier: the prefix is loaded back from host memory
    L3          after flushing device and host: prefetched from LMDB into L2, then loaded back

Each request asks for one token, so its latency is its TTFT. Every served request's
`cached_tokens_details` is checked against the tier it was meant to hit (a row that missed is
flagged, not hidden) and its token against the recomputed one. The median over `--repeats`
prompts and the ratio to recompute are printed as a markdown table and written as JSON.

    python -m benchmarks.bench_tier_ttft                                # embedded model
    python -m benchmarks.bench_tier_ttft --random-model llama-1b --prompt-lens 1024 4096 16384

`--random-model` writes a random-weight Llama of a named geometry (bfloat16 safetensors, the
embedded byte tokenizer) to a temporary folder, so a model big enough for prefill to cost
something runs with no download. The tiny embedded model shows the overheads, not the gains.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.models.loader import EMBEDDED_CONFIG, embedded_weights
from hicache_server.tokenizer import EMBEDDED_MARKER_KEY, byte_tokenizer_json

PAGE_SIZE = 16
TIERS = ("recompute", "L1", "L2", "L3")
EXPECTED = {"L1": "device", "L2": "host", "L3": "storage"}
ONE_TOKEN = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
BACKUP_WAIT_S = 120.0
# Geometries of real models (their config.json), with the embedded byte vocabulary.
GEOMETRIES = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64},
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
}


def write_random_model(geometry: str, folder: Path) -> Path:
    """A random-weight Llama of `geometry` (bfloat16) in `folder`, loadable as a local model."""
    config = {k: v for k, v in EMBEDDED_CONFIG.items() if k != EMBEDDED_MARKER_KEY}
    config |= GEOMETRIES[geometry] | {"torch_dtype": "bfloat16", "max_position_embeddings": 32768}
    weights = {k: v.to(torch.bfloat16) for k, v in embedded_weights(config=config).items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(byte_tokenizer_json())
    return folder


def make_engine(model: str, lmdb: Path, max_len: int) -> Engine:
    l1_tokens = 4 * max_len  # the prompt, its copy in flight, and room to spare
    return Engine(load_config(None, {
        "model.path": model, "cache.hierarchical": True, "cache.page_size": PAGE_SIZE,
        "cache.max_total_tokens": l1_tokens, "host.ratio": 2.0,
        "host.write_policy": "write_through", "storage.backend": "lmdb",
        "storage.lmdb.path": str(lmdb), "storage.prefetch_policy": "wait_complete",
        "storage.prefetch_threshold": 0}))


def wait_backed_up(e: Engine, pages: int) -> None:
    """Until LMDB holds `pages` pages (every full page of every prompt served so far)."""
    deadline = time.monotonic() + BACKUP_WAIT_S
    while e.stats()["tiers"]["storage"]["pages"] < pages:
        if time.monotonic() > deadline:
            raise RuntimeError(f"L3 never held {pages} pages")
        time.sleep(0.01)


def serve_four_ways(e: Engine, prompt: list[int], backed: int) -> dict[str, dict]:
    """{tier: {"s": latency, "hit": tokens from the expected tier, "token": first token}}."""
    out = {}
    for tier in TIERS:
        if tier == "L2":
            e.flush_cache(["device"])
        elif tier == "L3":
            wait_backed_up(e, backed)
            e.flush_cache(["device", "host"])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        r = e.generate(input_ids=prompt, sampling_params=ONE_TOKEN)
        elapsed = time.perf_counter() - start
        details = r["meta_info"]["cached_tokens_details"]
        hit = details.get(EXPECTED[tier], 0) if tier in EXPECTED else sum(details.values())
        out[tier] = {"s": elapsed, "hit": hit, "token": r["output_ids"][0]}
    return out


def run(args: argparse.Namespace, model: str, lmdb: Path) -> list[dict]:
    rng = random.Random(args.seed)
    rows = []
    with make_engine(model, lmdb, max(args.prompt_lens)) as e:
        backed = 0
        warm = [rng.randrange(256) for _ in range(min(args.prompt_lens))]
        backed += len(warm) // PAGE_SIZE
        serve_four_ways(e, warm, backed)  # compiles kernels, pins buffers, opens LMDB
        for n in args.prompt_lens:
            runs = []
            for _ in range(args.repeats):
                prompt = [rng.randrange(256) for _ in range(n)]
                backed += n // PAGE_SIZE
                runs.append(serve_four_ways(e, prompt, backed))
            rows.append(summarise(n, runs))
            print(f"  {n} tokens: " + ", ".join(
                f"{t} {rows[-1][t]['ms']:.1f} ms" for t in TIERS), file=sys.stderr)
    return rows


def summarise(n: int, runs: list[dict[str, dict]]) -> dict:
    cacheable = (n - 1) // PAGE_SIZE * PAGE_SIZE
    row: dict = {"prompt_tokens": n, "cacheable_tokens": cacheable}
    base = statistics.median(r["recompute"]["s"] for r in runs)
    for tier in TIERS:
        med = statistics.median(r[tier]["s"] for r in runs)
        row[tier] = {
            "ms": med * 1e3, "ratio": med / base,
            "all_hit": tier == "recompute" or all(r[tier]["hit"] == cacheable for r in runs),
            "same_token": all(r[tier]["token"] == r["recompute"]["token"] for r in runs)}
    return row


def table(rows: list[dict]) -> str:
    head = ["prompt tokens", *[f"{t} ms" for t in TIERS], *[f"{t} / recompute" for t in TIERS[1:]]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [str(r["prompt_tokens"])]
        cells += [f"{r[t]['ms']:.1f}{'' if r[t]['all_hit'] and r[t]['same_token'] else ' (!)'}"
                  for t in TIERS]
        cells += [f"{r[t]['ratio']:.2f}" for t in TIERS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded:tiny-llama")
    p.add_argument("--random-model", choices=sorted(GEOMETRIES), default=None,
                   help="write and serve a random-weight model of this geometry instead")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/tier_ttft.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hicache-tier-ttft-") as tmp:
        model = args.model
        if args.random_model is not None:
            model = str(write_random_model(args.random_model, Path(tmp) / "model"))
        rows = run(args, model, Path(tmp) / "lmdb")
    print(table(rows))
    print("(!) = a request did not hit the tier it was meant to, or its token differed from "
          "recomputation")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "model": args.random_model or args.model,
        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
