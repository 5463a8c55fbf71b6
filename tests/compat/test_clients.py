"""The client software people already run, unchanged, against a real `hicache-server` on
loopback: LiteLLM (`completion`, `text_completion`) and lm-eval (`local-completions` for
loglikelihood and generate_until, `local-chat-completions`) on tiny tasks of local rows (no
hub download). The openai SDK is exercised in the main suite (`tests/test_chat.py`,
`tests/test_http_fields.py`).

Marked `compat` and left out of `make test` (the libraries are heavy); `make compat`
installs the `compat` extra and runs this file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.compat

litellm = pytest.importorskip("litellm")
lm_eval = pytest.importorskip("lm_eval")

import lm_eval_tasks  # after the skips: the libraries are optional
from test_server_process import running

MAX_TOKENS = 8
ROWS = [  # question, choices, index of the answer: any rows do, the model is noise
    {"question": "Which is a colour?", "choices": [" red", " seven"], "answer": 0},
    {"question": "Which is a number?", "choices": [" blue", " three"], "answer": 1},
    {"question": "Which is an animal?", "choices": [" cat", " table"], "answer": 0},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(base URL, served model name) of one server for the whole module."""
    config = tmp_path_factory.mktemp("compat") / "server.yaml"
    config.write_text("model: {device: cpu}\ncache: {hierarchical: true, page_size: 16}\n")
    with running(["--config", str(config), "--port", "0", "--max-total-tokens", "4096"]) as (
            _, base):
        import urllib.request
        with urllib.request.urlopen(f"{base}/v1/models") as resp:
            name = json.load(resp)["data"][0]["id"]
        yield base, name


# -------------------------------------------------------------------------------- LiteLLM


def test_litellm_completion_and_text_completion(server: tuple[str, str]) -> None:
    base, name = server
    chat = litellm.completion(model=f"openai/{name}", api_base=f"{base}/v1", api_key="none",
                              messages=[{"role": "user", "content": "Say hello."}],
                              max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens <= MAX_TOKENS
    again = litellm.completion(model=f"openai/{name}", api_base=f"{base}/v1", api_key="none",
                               messages=[{"role": "user", "content": "Say hello."}],
                               max_tokens=MAX_TOKENS, temperature=0)
    assert again.choices[0].message.content == chat.choices[0].message.content  # greedy
    text = litellm.text_completion(model=f"text-completion-openai/{name}",
                                   api_base=f"{base}/v1", api_key="none",
                                   prompt="Once upon a time", max_tokens=MAX_TOKENS,
                                   temperature=0)
    assert isinstance(text.choices[0].text, str)
    assert text.usage.completion_tokens <= MAX_TOKENS


# -------------------------------------------------------------------------------- lm-eval


def write_tasks(folder: Path) -> None:
    rows = folder / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    lm_eval_tasks.write_tasks(folder, rows, "hicache_tiny", "{{question}}", MAX_TOKENS)


def evaluate(model: str, model_args: dict[str, Any], tasks: list[str], folder: Path,
             **kwargs: Any) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                   task_manager=TaskManager(include_path=str(folder)),
                                   log_samples=True, **kwargs)


def test_lm_eval_local_completions_loglikelihood_and_generate_until(
        server: tuple[str, str], tmp_path: Path) -> None:
    base, name = server
    write_tasks(tmp_path)
    args = {"model": name, "base_url": f"{base}/v1/completions", "tokenizer": name,
            "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1}
    out = evaluate("local-completions", args, ["hicache_tiny_mc", "hicache_tiny_gen"],
                   tmp_path)
    assert 0.0 <= out["results"]["hicache_tiny_mc"]["acc,none"] <= 1.0
    assert 0.0 <= out["results"]["hicache_tiny_gen"]["exact_match,none"] <= 1.0
    lls = [resp[0][0] for sample in out["samples"]["hicache_tiny_mc"]
           for resp in sample["resps"]]
    assert len(lls) == sum(len(r["choices"]) for r in ROWS)
    assert all(math.isfinite(ll) and ll < 0 for ll in lls)
    first = out["samples"]["hicache_tiny_mc"][0]
    context, continuation = first["arguments"][0]
    assert lls[0] == pytest.approx(server_loglikelihood(base, name, context, continuation),
                                   abs=1e-3)
    again = evaluate("local-completions", args, ["hicache_tiny_mc"], tmp_path)
    assert [resp[0][0] for s in again["samples"]["hicache_tiny_mc"] for resp in s["resps"]] \
        == pytest.approx(lls, abs=1e-4)  # the second run hits the cache: same numbers


def server_loglikelihood(base: str, name: str, context: str, continuation: str) -> float:
    """log P(continuation | context) from the server's own `/generate` prompt logprobs,
    tokenized as lm-eval tokenizes (the served folder's tokenizer, no special tokens)."""
    import urllib.request

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(name)
    ctx = tok.encode(context, add_special_tokens=False)
    cont = tok.encode(continuation, add_special_tokens=False)
    body = {"input_ids": ctx + cont, "return_logprob": True,
            "logprob_start_len": len(ctx) - 1,  # that entry is None: P(first) needs a prefix
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    req = urllib.request.Request(f"{base}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        entries = json.load(resp)["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries[1:]] == cont
    return sum(e[0] for e in entries[1:])


def test_lm_eval_local_chat_completions(server: tuple[str, str], tmp_path: Path) -> None:
    base, name = server
    write_tasks(tmp_path)
    args = {"model": name, "base_url": f"{base}/v1/chat/completions", "num_concurrent": 1,
            "max_retries": 1}
    out = evaluate("local-chat-completions", args, ["hicache_tiny_gen"], tmp_path,
                   apply_chat_template=True)
    assert 0.0 <= out["results"]["hicache_tiny_gen"]["exact_match,none"] <= 1.0
    assert len(out["samples"]["hicache_tiny_gen"]) == len(ROWS)
