"""hicache/memory/windowed.py: WindowedKVPool, the L1 of a hybrid model (full layers' K/V by
the request's slots, sliding-window layers' K/V by a page map, in pages of one pool that
both kinds share).

Its bookkeeping (alloc, drop_window, free, the page map, either kind taking the pages the
other left), then the models through it: a
random-weight Gemma 3 (windows of 40 and 48 tokens, pages of 16) and a Qwen2 with window
layers (Llama's layers) give the very logits and greedy tokens
of a plain DeviceKVPool, for a prompt several windows long prefilled in one chunk and in two,
then decoded; every window page a token no longer needs is given back after each forward
(and poisoned with NaN, so a read of it would show, whichever kind takes it next), so the
window KV held stays about a window and a chunk. Their lean paths over the pool give the
modules' bits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import transformers
from arch_reference import GEMMA_NORMS, random_model, save_servable
from test_gemma3 import gemma3_config as gemma3_test_config
from test_gemma3_tiers import gemma3_config as gemma3_tiers_config
from test_mistral_window import KINDS as WINDOW_KINDS
from test_model import extend_batch

from hicache.memory.device import INDEX_DTYPE, PADDING_PAGE, DeviceKVPool, pages_of
from hicache.memory.windowed import WindowedKVPool
from hicache_server.models import LoadedModel, load_model
from hicache_server.models.attention import CpuKernelAttention, TorchAttention
from hicache_server.models.kernels import cpu_attention

PAGE = 16
SEED = 5
PROMPT_LEN = 150  # several windows of every model below
DECODE_STEPS = 20
CHUNKINGS = {"one_chunk": [PROMPT_LEN], "two_chunks": [70, PROMPT_LEN - 70]}
FULL_PAGES = 16  # 256 slots: the prompt and its decode (171 tokens) with room to spare


# ---------------------------------------------------------------------------------------------
# The pool's bookkeeping

W = 40
UNIT_WINDOWS = [W, None, W]  # layers 0 and 2 slide, layer 1 is full
KV_HEADS, HEAD_DIM = 2, 8


def unit_pool(num_pages: int = 8, window_pages: int = 4) -> WindowedKVPool:
    return WindowedKVPool(num_pages, window_pages, PAGE, UNIT_WINDOWS, KV_HEADS, HEAD_DIM,
                          torch.float32, "cpu")


def test_needs_both_kinds_of_layer() -> None:
    for windows in ([None, None], [W, W]):
        with pytest.raises(ValueError, match="needs full and window layers"):
            WindowedKVPool(4, 2, PAGE, windows, KV_HEADS, HEAD_DIM, torch.float32, "cpu")


def test_one_pool_of_pages_in_groups_of_the_full_layers() -> None:
    """The bytes of 8 full pages and 4 pages of both window layers: 16 pages of one layer,
    the one full layer's size; two window groups of one layer each share its buffers."""
    pool = unit_pool()
    assert (pool.num_pages, pool.groups, pool.group_layers) == (16, 2, ((0,), (2,)))
    assert pool.size_bytes == 17 * PAGE * 2 * KV_HEADS * HEAD_DIM * 4  # and the padding page
    assert pool.page_bytes == 3 * PAGE * 2 * KV_HEADS * HEAD_DIM * 4  # a page of every layer
    assert pool.free_pages() == 16 and pool.available_size() == 16 * PAGE
    # three full layers and 14 window layers: groups of three, the last of two
    big = WindowedKVPool(4, 3, PAGE, [None, W, W] * 3 + [W] * 8, 1, 8, torch.float32, "cpu")
    assert big.groups == 5 and big.num_pages == 4 + 3 * 14 // 3
    assert [len(g) for g in big.group_layers] == [3, 3, 3, 3, 2]


def test_alloc_takes_a_full_page_and_a_page_of_each_group() -> None:
    pool = unit_pool()
    slots = pool.alloc(3 * PAGE)
    assert slots is not None and slots.numel() == 3 * PAGE
    assert pool.free_pages() == 16 - 3 * 3
    assert pool.window_used() == 3 * PAGE and pool.allocator.used_size() == 3 * PAGE
    groups = pool.group_pages_of(slots)
    assert groups.shape == (3, 2) and PADDING_PAGE not in groups.reshape(-1).tolist()
    taken = [*pages_of(slots, PAGE).tolist(), *groups.reshape(-1).tolist()]
    assert len(set(taken)) == 9  # no page twice
    assert torch.equal(pool.window_pages_of(slots), groups[:, 0])
    # every slot to its group's page, at the same offset
    for g in range(2):
        want = groups[:, g].repeat_interleave(PAGE) * PAGE + slots % PAGE
        assert torch.equal(pool.window_slots(slots, g), want)
    # no window pages when asked for none
    bare = pool.alloc(PAGE, window=False)
    assert bare is not None and pool.window_used() == 3 * PAGE and pool.free_pages() == 6
    assert pool.group_pages_of(bare).tolist() == [[PADDING_PAGE, PADDING_PAGE]]


def test_drop_window_frees_exactly_the_mapped_pages_once() -> None:
    pool = unit_pool()
    slots = pool.alloc(3 * PAGE)
    kept = pool.group_pages_of(slots[2 * PAGE:])
    free = pool.free_pages()
    assert pool.drop_window(slots[:2 * PAGE]) == 2 * PAGE
    assert pool.window_used() == PAGE and pool.free_pages() == free + 4
    assert pool.group_pages_of(slots).tolist() == [[PADDING_PAGE] * 2] * 2 + kept.tolist()
    assert pool.drop_window(slots[:2 * PAGE]) == 0  # nothing left to give
    assert pool.window_used() == PAGE
    # a range partly dropped gives only what is still mapped
    assert pool.drop_window(slots) == PAGE and pool.window_used() == 0
    assert pool.drop_window(torch.empty(0, dtype=INDEX_DTYPE)) == 0
    assert pool.free_pages() == 16 - 3 and pool.allocator.used_size() == 3 * PAGE


def test_free_gives_both_back() -> None:
    pool = unit_pool()
    a, b = pool.alloc(2 * PAGE), pool.alloc(2 * PAGE)
    pool.drop_window(a[:PAGE])  # partly dropped already
    pool.free(a)
    pool.free(b)
    assert pool.free_pages() == 16 and pool.window_used() == 0
    assert pool.allocator.used_size() == 0
    assert pool.window_pages_of(torch.cat([a, b])).tolist() == [PADDING_PAGE] * 4
    # the pages come back and map again
    again = pool.alloc(4 * PAGE)
    assert again is not None and PADDING_PAGE not in pool.window_pages_of(again).tolist()


def test_either_kind_takes_the_pages_the_other_left() -> None:
    """No share of its own: full pages alone fill the pool, window pages take what full
    ones gave back, and an allocation the pool cannot meet takes nothing."""
    pool = unit_pool()
    full = pool.alloc(16 * PAGE, window=False)
    assert full is not None and pool.free_pages() == 0 and pool.window_available() == 0
    assert pool.alloc(PAGE) is None and pool.pages_short(PAGE) == 3
    pool.free(full[:4 * PAGE])
    assert pool.pages_short(2 * PAGE) == 2 and pool.alloc(2 * PAGE) is None
    assert pool.free_pages() == 4  # nothing taken
    slots = pool.alloc(PAGE)
    assert slots is not None and pool.free_pages() == 1 and pool.window_used() == PAGE
    pool.free(slots)
    pool.free(full[4 * PAGE:])
    windowed = pool.alloc(5 * PAGE)  # 15 of the 16 pages: most of them window pages
    assert windowed is not None and pool.window_used() == 5 * PAGE and pool.free_pages() == 1
    assert pool.window_capacity() == pool.request_capacity() == 5 * PAGE


def test_window_slots_send_an_unmapped_page_to_the_padding_page() -> None:
    pool = unit_pool()
    slots = pool.alloc(2 * PAGE)
    pool.drop_window(slots[:PAGE])
    for g in range(2):
        got = pool.window_slots(slots, g)
        assert torch.equal(got[:PAGE], torch.arange(PAGE))
        assert bool((got[PAGE:] >= PAGE).all())
    bare = pool.alloc(PAGE, window=False)
    assert torch.equal(pool.window_slots(bare, 1), torch.arange(PAGE))


def test_layers_route_to_their_buffer_and_group() -> None:
    pool = unit_pool()
    slots = pool.alloc(2 * PAGE)
    assert [pool.is_window_layer(i) for i in range(3)] == [True, False, True]
    assert [pool.kv_group(i) for i in range(3)] == [1, 0, 2]
    # one layer per page: every layer's K and V are the pool's one pair of buffers
    for layer in range(3):
        assert pool.get_kv(layer)[0] is pool.shared.k_buffers[0]
        assert pool.k_buffers[layer] is pool.shared.k_buffers[0]
        assert pool.get_kv(layer)[1] is pool.shared.v_buffers[0]
    batch = extend_batch([(torch.arange(2 * PAGE), slots, 0)])
    assert pool.batch_for(1, batch) is batch
    first, second = pool.batch_for(0, batch), pool.batch_for(2, batch)
    assert pool.batch_for(0, batch) is first  # once per forward and group
    for mapped, g in ((first, 0), (second, 1)):
        assert torch.equal(mapped.out_slots, pool.window_slots(slots, g))
        assert torch.equal(mapped.seq_slots[0], pool.window_slots(slots, g))
    k = torch.randn(2 * PAGE, KV_HEADS, HEAD_DIM)
    pool.set_kv(2, second.out_slots, k, -k)
    assert torch.equal(pool.shared.k_buffers[0][second.out_slots], k)
    assert not pool.shared.k_buffers[0][slots].any()  # layer 1's slots untouched
    assert not pool.shared.k_buffers[0][first.out_slots].any()  # nor layer 0's
    # the plain pool: the batch as it is, no windows
    plain = DeviceKVPool(4, PAGE, 3, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    assert plain.batch_for(0, batch) is batch and not plain.has_windows and pool.has_windows


# ---------------------------------------------------------------------------------------------
# Models through the pool


def gemma3_tiers(folder: Path) -> Path:  # windows of 40: a window edge inside a page
    random_model(transformers.Gemma3ForCausalLM, gemma3_tiers_config(), SEED,
                 GEMMA_NORMS).save_pretrained(folder)
    return folder


def gemma3_pattern(folder: Path) -> Path:  # windows of 48, one KV head, head_dim 64
    random_model(transformers.Gemma3ForCausalLM, gemma3_test_config("pattern"), SEED,
                 GEMMA_NORMS).save_pretrained(folder)
    return folder


def qwen2_windows(folder: Path) -> Path:  # layer 0 full, 1 and 2 windows of 32: Llama's path
    torch.manual_seed(SEED)
    return save_servable(transformers.Qwen2ForCausalLM(WINDOW_KINDS["qwen2"](32)), folder)


MODELS: dict[str, Callable[[Path], Path]] = {
    "gemma3_w40": gemma3_tiers, "gemma3_w48": gemma3_pattern, "qwen2_w32": qwen2_windows}


@pytest.fixture(scope="module", params=list(MODELS))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return MODELS[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(SEED))


def loaded(folder: Path, backend: str) -> LoadedModel:
    """The float32 model on `backend`: "loaded" (load_model's choice, the C kernel where it
    builds) or "torch" (TorchAttention on every layer)."""
    lm = load_model(str(folder), dtype="float32", device="cpu")
    if backend == "torch":
        for layer in lm.model.model.layers:
            layer.self_attn.backend = TorchAttention()
    elif cpu_attention.supported():
        assert isinstance(lm.model.attn_backend, CpuKernelAttention)
    return lm


def windows_of(lm: LoadedModel) -> list[int | None]:
    c = lm.config
    windows = [c.window_of(i) for i in range(c.num_hidden_layers)]
    assert None in windows and any(w is not None for w in windows)
    return windows


def floor_page(n: int) -> int:
    return n // PAGE * PAGE


class Run(NamedTuple):
    logits: list[torch.Tensor]  # per forward, every new token's
    tokens: list[int]  # greedy: after the prompt, then after each decode step
    most_used: int  # the most window tokens held (after a forward, before its drop)
    dropped: int  # window tokens given back


def run(lm: LoadedModel, pool: DeviceKVPool | WindowedKVPool, prompt: torch.Tensor,
        chunks: list[int]) -> Run:
    """`prompt` prefilled in `chunks`, then DECODE_STEPS greedy steps, each forward on slots
    taken a page at a time as needed. On a WindowedKVPool, after each forward the window
    pages of the tokens before `cut` (whole pages, every one the next query's window no
    longer reaches) are given back and their K/V turned to NaN."""
    windowed = isinstance(pool, WindowedKVPool)
    slots = torch.empty(0, dtype=INDEX_DTYPE)
    tokens = prompt.clone()
    logits: list[torch.Tensor] = []
    out: list[int] = []
    most_used = dropped_total = 0

    def forward(prefix: int, end: int) -> torch.Tensor:
        nonlocal slots, most_used, dropped_total
        short = -(-end // PAGE) * PAGE - slots.numel()
        if short > 0:
            more = pool.alloc(short)
            assert more is not None, "pool too small for the test"
            slots = torch.cat([slots, more])
        batch = extend_batch([(tokens[:end], slots[:end], prefix)])
        got = lm.model.forward_all_logits(batch, pool)
        logits.append(got)
        if windowed:
            most_used = max(most_used, pool.window_used())
            # the next query has position `end`: it reads keys end - W < j <= end
            cut = floor_page(max(0, end - pool.max_window + 1))
            before = pool.window_pages_of(slots[:cut])
            dropped = pool.drop_window(slots[:cut])
            gone = before[before != PADDING_PAGE]
            assert dropped == gone.numel() * PAGE
            dropped_total += dropped
            poison(pool, gone)
            assert pool.window_used() <= pool.max_window + 2 * PAGE
        return got[-1]

    prefix = 0
    for chunk in chunks:
        last = forward(prefix, prefix + chunk)
        prefix += chunk
    for _ in range(DECODE_STEPS):
        out.append(int(last.argmax()))
        tokens = torch.cat([tokens, torch.tensor(out[-1:])])
        last = forward(len(tokens) - 1, len(tokens))
    out.append(int(last.argmax()))
    return Run(logits, out, most_used, dropped_total)


def poison(pool: WindowedKVPool, window_pages: torch.Tensor) -> None:
    """NaN into every window layer's K and V of these (freed) window pages: a read of a page
    given back would turn the logits to NaN."""
    slots = (window_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    for layer in pool.window_layers:
        k, v = pool.get_kv(layer)
        k[slots] = float("nan")
        v[slots] = float("nan")


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("backend", ["loaded", "torch"])
def test_windowed_pool_gives_the_plain_pools_logits_and_tokens(
        folder: Path, prompt: torch.Tensor, backend: str, chunking: str) -> None:
    lm = loaded(folder, backend)
    windows = windows_of(lm)
    c = lm.config
    chunks = CHUNKINGS[chunking]
    window = max(w for w in windows if w is not None)
    assert PROMPT_LEN > 3 * window
    # sized as a window, the largest chunk and two pages of rounding of the window layers
    window_pages = -(-(window + max(chunks)) // PAGE) + 2
    if len(chunks) > 1:  # less than the sequence: only giving pages back lets it run
        assert window_pages * PAGE < PROMPT_LEN + DECODE_STEPS
    plain = DeviceKVPool(FULL_PAGES, PAGE, c.num_hidden_layers, c.num_key_value_heads,
                         c.head_dim, torch.float32, "cpu")
    pool = WindowedKVPool(FULL_PAGES, window_pages, PAGE, windows, c.num_key_value_heads,
                          c.head_dim, torch.float32, "cpu")
    assert pool.max_window == window

    want = run(lm, plain, prompt, chunks)
    got = run(lm, pool, prompt, chunks)

    assert got.tokens == want.tokens
    assert len(got.logits) == len(want.logits) == len(chunks) + DECODE_STEPS
    for g, w in zip(got.logits, want.logits):
        assert not g.isnan().any()
        assert torch.equal(g, w), (g - w).abs().max().item()
    assert got.most_used <= window + max(chunks) + 2 * PAGE
    assert got.dropped >= floor_page(PROMPT_LEN + DECODE_STEPS - window)
    # one pool of pages: the full layers' buffers, which the window groups' layers share
    full = [i for i, w in enumerate(windows) if w is None]
    window_layers = [i for i, w in enumerate(windows) if w is not None]
    for i, layer in enumerate(full):
        assert pool.get_kv(layer)[0] is pool.shared.k_buffers[i]
    for j, layer in enumerate(window_layers):
        assert pool.get_kv(layer)[0] is pool.shared.k_buffers[j % len(full)]
        assert pool.kv_group(layer) == 1 + j // len(full)


class _Counting:
    """A lean path that counts the batches it ran (returned logits for)."""

    def __init__(self, lean: object) -> None:
        self.lean, self.ran = lean, 0

    def __call__(self, batch: object, pool: object) -> torch.Tensor | None:
        out = self.lean(batch, pool)
        self.ran += out is not None
        return out


@pytest.mark.skipif(not cpu_attention.supported(), reason="needs AVX-512F or AVX2, and a C compiler")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_lean_path_over_a_windowed_pool_gives_the_modules_bits(
        folder: Path, prompt: torch.Tensor, dtype: str) -> None:
    """Short extends and decode steps take the lean path over a WindowedKVPool too (Gemma's
    and Llama's: the full layers bound to the request's slots, the window layers to their
    window slots): the very logits and tokens of the modules, every window page given back
    poisoned with NaN."""
    lm = load_model(str(folder), dtype=dtype, device="cpu")
    lean = lm.model.model.lean
    assert lean is not None
    windows, c = windows_of(lm), lm.config
    chunks = [100, 30, 20]  # the last two short enough for the lean path
    window_pages = -(-(max(w for w in windows if w is not None) + max(chunks)) // PAGE) + 2
    counting, runs = _Counting(lean), []
    for path in (counting, None):
        lm.model.model.lean = path
        pool = WindowedKVPool(FULL_PAGES, window_pages, PAGE, windows, c.num_key_value_heads,
                              c.head_dim, lm.dtype, "cpu")
        runs.append(run(lm, pool, prompt, chunks))
    got, want = runs
    lm.model.model.lean = lean
    assert got.tokens == want.tokens
    for g, w in zip(got.logits, want.logits, strict=True):
        assert not g.isnan().any()
        assert torch.equal(g, w), (g - w).abs().max().item()
    assert counting.ran == len(chunks) - 1 + DECODE_STEPS  # all but the 100-token chunk
