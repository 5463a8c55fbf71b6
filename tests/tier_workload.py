"""The workload every architecture's tests serve through the tiers: three chats of three
turns sharing a 96-token system prompt (prompts of 136-232 tokens, pages of 16), and the
checks that a cached prefix, an L2 load-back and L3 (after a flush and after a restart) give
the tokens of recomputation. A test module builds its model folder and subclasses
`TierChecks` (or calls the checks)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache_server.config import load_config
from hicache_server.engine import Engine

PAGE = 16
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def conversations(n: int = 3, turns: int = 3, seed: int = 0) -> list[list[list[int]]]:
    """Per conversation the prompt of each turn: a shared 96-token system prompt, then a
    history growing by a 40-token question and an 8-token stand-in answer."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(96)]
    convs = []
    for _ in range(n):
        history, prompts = list(system), []
        for _ in range(turns):
            history = history + [rng.randrange(256) for _ in range(40)]
            prompts.append(list(history))
            history = history + [rng.randrange(256) for _ in range(8)]
        convs.append(prompts)
    return convs


def run_workload(e: Engine, between_turns: Callable[[Engine], object] | None = None
                 ) -> list[list[int]]:
    outs = []
    for turn in range(3):
        for conv in conversations():
            outs.append(e.generate(input_ids=conv[turn], sampling_params=GREEDY)["output_ids"])
        if between_turns is not None:
            between_turns(e)
    return outs


def engine(folder: Path, **overrides: object) -> Engine:
    return Engine(load_config(None, {
        "model.path": str(folder), "model.device": "cpu", "cache.page_size": PAGE,
        "cache.max_total_tokens": 2048, "storage.prefill_warmup_s": 0.0, **overrides}))


def tiered(folder: Path, lmdb: Path, **overrides: object) -> Engine:
    return engine(folder, **{"cache.hierarchical": True, "storage.backend": "lmdb",
                             "storage.lmdb.path": str(lmdb),
                             "storage.prefetch_policy": "wait_complete",
                             "storage.prefetch_threshold": 32, "storage.overlap": False,
                             **overrides})


def recompute(folder: Path, **overrides: object) -> list[list[int]]:
    """The workload's answers with no cache at all."""
    with engine(folder, **{"cache.enable_radix_cache": False, **overrides}) as e:
        return run_workload(e)


def greedy_of(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy decoding by a transformers model, recomputing everything each step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def check_transformers_greedy(model: torch.nn.Module, recomputed: list[list[int]]) -> None:
    convs = conversations()
    for i in (0, 8):  # the shortest prompt (136 tokens) and the longest (232)
        prompt = convs[i % 3][i // 3]
        assert recomputed[i] == greedy_of(model, prompt, GREEDY["max_new_tokens"])


def check_cached_prefix(folder: Path, recomputed: list[list[int]]) -> None:
    with engine(folder) as e:
        assert run_workload(e) == recomputed
        assert e.stats()["counters"]["cached_device"] > 0


def check_l2_load_back(folder: Path, lmdb: Path, recomputed: list[list[int]]) -> None:
    """L1 of 256 tokens beside an L2 of 2,048; L1 flushed after the first turn, so the
    second turn's hits come back from L2 whatever L1 would have kept (a hybrid model's L1
    holds full-layer KV in the pages its window KV left) and however fast copies run."""
    with tiered(folder, lmdb, **{"cache.max_total_tokens": 256, "storage.backend": "none",
                                 "host.ratio": 8.0}) as e:
        flushed: list[dict] = []

        def flush_once(e: Engine) -> None:
            if not flushed:
                flushed.append(e.flush_cache(["device"]))

        assert run_workload(e, between_turns=flush_once) == recomputed
        host = e.stats()["tiers"]["host"]
    assert host["hits"] > 0 and host["load_back_tokens"] > 0


def check_l3_flush_and_restart(folder: Path, lmdb: Path, recomputed: list[list[int]]) -> None:
    with tiered(folder, lmdb) as e:
        assert run_workload(e, between_turns=lambda e: e.flush_cache(["device", "host"])) \
            == recomputed
        assert e.stats()["counters"]["cached_storage"] > 0
    prompt = conversations()[0][2]
    with tiered(folder, lmdb) as again:  # a new process sees the same LMDB
        out = again.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == recomputed[6]
    details = out["meta_info"]["cached_tokens_details"]
    assert details == {"device": 0, "host": 0, "storage": (len(prompt) - 1) // PAGE * PAGE}


def check_bfloat16_cached_prefixes(folder: Path, lmdb: Path) -> None:
    """In bfloat16, prefixes cached in L1 (flushed between turns, so L2 and L3 serve them)
    give the tokens of bfloat16 recomputation."""
    want = recompute(folder, **{"model.dtype": "bfloat16"})
    with tiered(folder, lmdb, **{"model.dtype": "bfloat16"}) as e:
        assert run_workload(e, between_turns=lambda e: e.flush_cache(["device"])) == want


class TierChecks:
    """The tier tests of an architecture, once: a test module subclasses this as `TestTiers`
    and gives two fixtures, `served` (a folder the engine serves) and `reference`
    (transformers' float32 model of it)."""

    @pytest.fixture(scope="class")
    @classmethod
    def recomputed(cls, served: Path) -> list[list[int]]:
        return recompute(served)

    def test_recomputation_gives_transformers_greedy_tokens(
            self, reference: torch.nn.Module, recomputed: list[list[int]]) -> None:
        check_transformers_greedy(reference, recomputed)

    def test_a_cached_prefix_plus_extend_gives_the_same_tokens(
            self, served: Path, recomputed: list[list[int]]) -> None:
        check_cached_prefix(served, recomputed)

    def test_l2_load_back_gives_the_same_tokens(self, served: Path, tmp_path: Path,
                                                recomputed: list[list[int]]) -> None:
        check_l2_load_back(served, tmp_path / "lmdb", recomputed)

    def test_l3_after_flushing_l1_and_l2_and_after_a_restart(
            self, served: Path, tmp_path: Path, recomputed: list[list[int]]) -> None:
        check_l3_flush_and_restart(served, tmp_path / "lmdb", recomputed)
