"""Greedy decode steps with the LM head's screen (models/head_screen.py) against the whole
head, side by side in one run.

    whole head   every decode row's logits through the whole head (HICACHE_HEAD_SCREEN=off)
    screen fma   plain greedy rows through the int8 screen (x in float32) and the
                 candidates' panels (HICACHE_HEAD_SCREEN=fma)
    screen vnni  the same with x quantized too and exact int8 sums (vpdpbusd where the CPU
                 has AVX512-VNNI, the engine's default there; plain integer C elsewhere)

Same model (Gemma 3 270M, `gemma3-270m`, unless `--model-path`), same weights, same pool:
each of `--batches` rows starts from its own prompt of `--context` tokens of real text (this
repository's docs), then decodes `--steps` greedy tokens, once per configuration in turn
(whole, screens, whole, screens ... `--repeats` times). Prints the median milliseconds of a
decode step (model forward plus argmax) of each, their ratios to the whole head's, and
whether all gave every row the same tokens (they must); writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_forward import write_results
from hicache.memory.device import DeviceKVPool
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.head_screen import HeadScreen
from hicache_server.models.kernels import cpu_head
from hicache_server.models.loader import load_model, resolve_model
from hicache_server.tokenizer import load_tokenizer

PAGE_SIZE = 16
TEXT = Path(__file__).resolve().parent.parent / "docs"


def prompts(model_path: str, rows: int, context: int) -> list[list[int]]:
    """`rows` prompts of `context` tokens, each a different stretch of the docs' text."""
    tok = load_tokenizer(resolve_model(model_path).folder)
    text = "\n".join(p.read_text() for p in sorted(TEXT.glob("*.md")))
    ids = tok.encode(text)
    if len(ids) < rows * context:
        raise SystemExit(f"the docs hold {len(ids)} tokens, fewer than {rows * context}")
    return [ids[i * context:(i + 1) * context] for i in range(rows)]


def decode(model: torch.nn.Module, pool: DeviceKVPool, seqs: list[list[int]], steps: int,
           screen: bool) -> tuple[list[list[int]], list[float]]:
    """Prefill every prompt, then `steps` greedy steps of all rows in one batch; each row's
    tokens and each step's seconds."""
    rows, width = len(seqs), len(seqs[0]) + steps
    slots = [torch.arange(PAGE_SIZE + i * width, PAGE_SIZE + (i + 1) * width) for i in range(rows)]
    out: list[list[int]] = [[] for _ in seqs]
    with torch.inference_mode():
        for i, s in enumerate(seqs):
            n = len(s)
            logits = model.forward(ForwardBatch(torch.tensor(s), torch.arange(n), slots[i][:n],
                                                [slots[i][:n]], [0], [n]), pool)
            out[i].append(int(logits[-1].argmax()))
        times = []
        for _ in range(steps - 1):
            lens = [len(s) + len(o) for s, o in zip(seqs, out)]  # the new token's position + 1
            batch = ForwardBatch(
                torch.tensor([o[-1] for o in out]), torch.tensor([n - 1 for n in lens]),
                torch.stack([slots[i][n - 1] for i, n in enumerate(lens)]),
                [slots[i][:n] for i, n in enumerate(lens)], [n - 1 for n in lens], [1] * rows)
            if screen:
                batch.argmax_only = torch.ones(rows, dtype=torch.bool)
            started = time.perf_counter()
            tokens = model.forward(batch, pool).argmax(dim=-1).tolist()
            times.append(time.perf_counter() - started)
            for o, t in zip(out, tokens):
                o.append(t)
    return out, times


def run_dtype(args: argparse.Namespace, dtype: str) -> list[dict]:
    lm = load_model(args.model_path, dtype, "cpu")
    model, c = lm.model, lm.config
    if model._screen is None:
        raise SystemExit("no head screen here (the CPU linear kernel or the screen's kernel "
                         "is off or unsupported): nothing to compare")
    head = (model.model.embed_tokens if c.tie_word_embeddings else model.lm_head).weight
    built = model._screen
    screens = {f"screen {p}": HeadScreen.build(head.detach(), built.kernel, built.linear_kernel,
                                               built.panels, p) for p in cpu_head.PATHS}
    results = []
    for rows in args.batches:
        seqs = prompts(args.model_path, rows, args.context)
        width = args.context + args.steps
        pool = DeviceKVPool(rows * width // PAGE_SIZE + 2, PAGE_SIZE, c.num_hidden_layers,
                            c.num_key_value_heads, c.head_dim, lm.dtype, lm.device)
        times: dict[str, list[float]] = {"whole head": [], **{k: [] for k in screens}}
        tokens = {}
        before = {k: sc.exact_rows for k, sc in screens.items()}
        for _ in range(args.repeats):
            for config in times:
                model._screen = screens.get(config)
                got, t = decode(model, pool, seqs, args.steps, config in screens)
                times[config] += t
                assert tokens.setdefault(config, got) == got, "greedy decoding must repeat"
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row = {"dtype": dtype, "rows": rows, "context": args.context, "steps": args.steps,
               "whole_ms": round(med["whole head"], 2),
               "same_tokens": all(t == tokens["whole head"] for t in tokens.values())}
        for k, sc in screens.items():
            p = k.split()[-1]
            row[f"{p}_ms"] = round(med[k], 2)
            row[f"{p}_ratio"] = round(med[k] / med["whole head"], 3)
            row[f"{p}_rows_whole_after_screen"] = sc.exact_rows - before[k]
        results.append(row)
        shown = ", ".join(f"{k} {med[k]:.1f} ms ({med[k] / med['whole head']:.2f}x)"
                          for k in screens)
        print(f"{dtype} batch {rows}: whole head {row['whole_ms']:.1f} ms, {shown}; "
              f"same tokens: {row['same_tokens']}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="gemma3-270m")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/head_screen.json"))
    args = parser.parse_args()
    rows = [r for dtype in args.dtypes for r in run_dtype(args, dtype)]
    write_results(args, rows)


if __name__ == "__main__":
    main()
