"""The long-document workload: its documents, order and summary (no server needed)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from benchmarks import long_docs


def test_questions_go_round_robin_over_documents_of_three_to_six_thousand_tokens() -> None:
    qs = long_docs.questions(8, seed=0)
    assert len(qs) == 8 * long_docs.QUESTIONS
    assert [(q.doc, q.index) for q in qs[:9]] == [*((d, 0) for d in range(8)), (0, 1)]
    for q in qs:
        doc = len(q.prompt) - long_docs.QUESTION_TOKENS
        assert long_docs.DOC_TOKENS[0] <= doc < long_docs.DOC_TOKENS[1]
        first = next(f for f in qs if f.doc == q.doc and f.index == 0)
        assert q.prompt[:doc] == first.prompt[:doc]  # one document under all its questions
    assert long_docs.questions(8, seed=0) == qs and long_docs.questions(8, seed=1) != qs
    docs = sum(len(q.prompt) - long_docs.QUESTION_TOKENS for q in qs if q.index == 0)
    assert long_docs.working_set_tokens(8, 0) == docs + len(qs) * (
        long_docs.QUESTION_TOKENS + long_docs.ANSWER_TOKENS)


def test_the_summary_counts_later_questions_and_what_a_cache_served() -> None:
    async def send(prompt: list[int], doc: int, index: int) -> SimpleNamespace:
        cached = {"device": 0 if index == 0 else len(prompt) - long_docs.QUESTION_TOKENS}
        return SimpleNamespace(ttft=2.0 if index == 0 else 0.5, cached=cached,
                               output_ids=[doc, index], error=None)

    got = asyncio.run(long_docs.run(2, 0, send))
    assert (got["ttft_first_s"], got["ttft_later_s"], got["errors"]) == (2.0, 0.5, 0)
    assert 0.95 < got["later_cached_share"] < 1.0  # all but the questions' own tokens
    assert len(got["records"]) == 2 * long_docs.QUESTIONS
