"""The long-document workload of `bench_vs_vllm --long-docs N`: N documents of 3-6k tokens
(seeded random token ids), 4 questions about each, asked one at a time round-robin (every
document's first question, then every second one, ...). Between two questions about one
document come the other N - 1 documents, so with N x ~4.5k tokens several times L1 a
document's KV is found again only where the cache keeps it below L1 (or not at all).

A question's prompt is its document then the question's own tokens; the measure is the
mean time to first token of each document's later questions (its first one computes the
document whatever the cache), and how many of their prompt tokens came from a cache.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

DOC_TOKENS = (3000, 6000)  # each document's length, drawn uniformly in this range
QUESTIONS = 4
QUESTION_TOKENS = 64
ANSWER_TOKENS = 16
TOKEN_IDS = 256  # prompts are random ids below this (both engines take token-id prompts)
SEED_SALT = 7  # the documents' RNG stream, apart from the other workloads'


class Question(NamedTuple):
    doc: int
    index: int  # 0: the document's first question
    prompt: list[int]


def questions(docs: int, seed: int) -> list[Question]:
    """Every question of `docs` documents, in the order they are asked."""
    rng = np.random.default_rng([seed, SEED_SALT])
    texts = [rng.integers(TOKEN_IDS, size=int(rng.integers(*DOC_TOKENS))).tolist()
             for _ in range(docs)]
    asked = [[rng.integers(TOKEN_IDS, size=QUESTION_TOKENS).tolist() for _ in range(QUESTIONS)]
             for _ in range(docs)]
    return [Question(d, q, texts[d] + asked[d][q]) for q in range(QUESTIONS)
            for d in range(docs)]


def working_set_tokens(docs: int, seed: int) -> int:
    """Tokens every question's prompt and answer span together (the documents, once)."""
    qs = questions(docs, seed)
    texts = sum(len(q.prompt) - QUESTION_TOKENS for q in qs if q.index == 0)
    return texts + len(qs) * (QUESTION_TOKENS + ANSWER_TOKENS)


def longest_request(docs: int, seed: int) -> int:
    return max((len(q.prompt) for q in questions(docs, seed)), default=0) + ANSWER_TOKENS


async def run(docs: int, seed: int,
              send: Callable[[list[int], int, int], Awaitable[Any]]) -> dict[str, Any]:
    """Ask every question with `send(prompt, doc, index)` (it returns a record with
    `ttft`, `cached` by tier, `output_ids`, `error`), one at a time; the summary."""
    records = []
    for q in questions(docs, seed):
        rec = await send(q.prompt, q.doc, q.index)
        records.append({"doc": q.doc, "question": q.index, "prompt_tokens": len(q.prompt),
                        "ttft_s": rec.ttft, "cached": dict(rec.cached),
                        "output_ids": list(rec.output_ids), "error": rec.error})
    return summarize(records)


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if not r["error"]]
    first = [r["ttft_s"] for r in ok if r["question"] == 0]
    later = [r for r in ok if r["question"] > 0]
    prompt = sum(r["prompt_tokens"] for r in later)
    cached = sum(sum(r["cached"].values()) for r in later)
    return {"ttft_first_s": statistics.fmean(first) if first else None,
            "ttft_later_s": statistics.fmean(r["ttft_s"] for r in later) if later else None,
            "later_cached_share": cached / prompt if prompt else None,
            "errors": len(records) - len(ok), "records": list(records)}
