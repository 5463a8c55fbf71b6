"""Page allocator, device KV pool, request-to-token table and host KV pool (CPU first)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.kernels.layouts import HOST_LAYOUTS
from hicache.memory import host as memory_pool_host
from hicache.memory.device import (
    DeviceKVPool,
    PageAllocator,
    pages_of,
    slots_of,
)
from hicache.memory.host import HostKVPool

SEED = 1234
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small KV geometry: every tensor below stays under a few hundred KB.
NUM_LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 4


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(SEED)


def assert_whole_pages(slots: torch.Tensor, page_size: int) -> None:
    assert slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert slots.numel() % page_size == 0
    rows = slots.view(-1, page_size)  # [n_pages, page_size]
    assert bool((rows[:, 0] % page_size == 0).all())
    assert torch.equal(rows - rows[:, :1], torch.arange(page_size).expand_as(rows))


# --------------------------------------------------------------------------- PageAllocator


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_returns_whole_pages_of_managed_range(page_size: int) -> None:
    alloc = PageAllocator(num_pages=8, page_size=page_size, first_page=2)
    slots = alloc.alloc(3 * page_size)
    assert slots is not None and slots.numel() == 3 * page_size
    assert_whole_pages(slots, page_size)
    pages = pages_of(slots, page_size)
    assert bool(((pages >= 2) & (pages < 10)).all())
    assert alloc.num_free_pages == 5
    assert alloc.available_size() == 5 * page_size
    assert alloc.used_size() == 3 * page_size
    assert alloc.total_size() == 8 * page_size


def test_alloc_zero_is_empty_and_changes_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    slots = alloc.alloc(0)
    assert slots is not None and slots.numel() == 0 and slots.dtype == torch.int64
    assert alloc.available_size() == 8
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.available_size() == 8


def test_alloc_returns_none_when_full_and_recovers_after_free() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    first = alloc.alloc(6)
    assert first is not None
    assert alloc.alloc(4) is None  # only one page left: no partial allocation, no raise
    assert alloc.available_size() == 2
    last = alloc.alloc(2)
    assert last is not None and alloc.available_size() == 0
    assert alloc.alloc(2) is None
    alloc.free(first)
    again = alloc.alloc(6)
    assert again is not None
    assert set(again.tolist()) == set(first.tolist())


def test_no_slot_handed_out_twice_until_exhausted() -> None:
    page_size, num_pages = 4, 10
    alloc = PageAllocator(num_pages, page_size, first_page=1)
    seen: list[int] = []
    while (slots := alloc.alloc(page_size * 3)) is not None:
        seen += slots.tolist()
    while (slots := alloc.alloc(page_size)) is not None:
        seen += slots.tolist()
    assert len(seen) == len(set(seen)) == num_pages * page_size
    assert set(seen) == set(range(page_size, (num_pages + 1) * page_size))


def test_freed_pages_are_reused_in_the_order_freed() -> None:
    alloc = PageAllocator(num_pages=6, page_size=2)
    slots = alloc.alloc(12)
    assert slots is not None
    chosen = slots_of(torch.tensor([4, 1, 3]), 2)
    alloc.free(chosen)
    again = alloc.alloc(6)
    assert again is not None and torch.equal(again, chosen)


def test_reset_frees_everything() -> None:
    alloc = PageAllocator(num_pages=3, page_size=2)
    assert alloc.alloc(6) is not None
    alloc.reset()
    assert alloc.available_size() == 6 and alloc.used_size() == 0
    slots = alloc.alloc(6)
    assert slots is not None and sorted(slots.tolist()) == list(range(6))


def test_pages_of_and_slots_of_are_inverse() -> None:
    pages = torch.tensor([7, 2, 5], dtype=torch.int64)
    slots = slots_of(pages, 4)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    assert torch.equal(pages_of(slots, 4), pages)
    assert torch.equal(pages_of(slots_of(pages, 1), 1), pages)


@pytest.mark.parametrize("num_tokens", [3, 5, -4])
def test_alloc_non_multiple_of_page_size_raises(num_tokens: int) -> None:
    alloc = PageAllocator(num_pages=4, page_size=4)
    with pytest.raises(ValueError, match=str(num_tokens)):
        alloc.alloc(num_tokens)
    assert alloc.available_size() == 16


def test_double_free_raises_and_changes_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    slots = alloc.alloc(4)
    assert slots is not None
    alloc.free(slots[:2])
    with pytest.raises(ValueError, match=rf"page {int(slots[0]) // 2}\b.*freed twice"):
        alloc.free(slots)
    assert alloc.available_size() == 6  # the valid second page was not freed either
    alloc.free(slots[2:])
    assert alloc.available_size() == 8


def test_free_same_page_twice_in_one_call_raises() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    slots = alloc.alloc(4)
    assert slots is not None
    with pytest.raises(ValueError, match="twice in one call"):
        alloc.free(torch.cat([slots[:2], slots[:2]]))
    assert alloc.available_size() == 4


def test_free_page_never_handed_out_raises() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    assert alloc.alloc(2) is not None  # page 0
    with pytest.raises(ValueError, match=r"page 3\b.*not allocated"):
        alloc.free(slots_of(torch.tensor([3]), 2))
    assert alloc.available_size() == 6


@pytest.mark.parametrize("bad_slot", [-2, 0, 1, 10, 11, 100])
def test_free_out_of_range_slot_raises(bad_slot: int) -> None:
    # Pages 1..4 of size 2: valid slots are [2, 10).
    alloc = PageAllocator(num_pages=4, page_size=2, first_page=1)
    assert alloc.alloc(8) is not None
    with pytest.raises(ValueError, match=rf"slot {bad_slot}\b.*out of range"):
        alloc.free(torch.tensor([bad_slot, bad_slot + 1]))
    assert alloc.available_size() == 0


def test_free_partial_or_misaligned_page_raises() -> None:
    alloc = PageAllocator(num_pages=4, page_size=4)
    slots = alloc.alloc(16)
    assert slots is not None
    with pytest.raises(ValueError, match=r"\b3 slots.*partial page"):
        alloc.free(slots[:3])
    with pytest.raises(ValueError, match=r"\[1, 2, 3, 4\].*misaligned"):
        alloc.free(torch.arange(1, 5))
    with pytest.raises(ValueError, match=r"\[4, 5, 7, 6\]"):
        alloc.free(torch.tensor([4, 5, 7, 6]))
    with pytest.raises(ValueError, match="1-D"):
        alloc.free(slots.view(4, 4))
    with pytest.raises(TypeError, match="integer"):
        alloc.free(slots.float())
    assert alloc.available_size() == 0


def test_free_accepts_int32_indices() -> None:
    alloc = PageAllocator(num_pages=2, page_size=2)
    slots = alloc.alloc(4)
    assert slots is not None
    alloc.free(slots.to(torch.int32))
    assert alloc.available_size() == 4


def test_constructor_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(num_pages=0, page_size=2)
    with pytest.raises(ValueError, match="page_size"):
        PageAllocator(num_pages=2, page_size=0)


# One step of the random walk: ("alloc", pages) or ("free", which held allocation) or
# ("bad_free", which allocated-then-freed page).
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 5)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("bad_free"), st.integers(0, 1000)),
    ),
    max_size=40,
)


@pytest.mark.parametrize("page_size", [1, 2, 16])
@settings(
    derandomize=True,
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=_ops, num_pages=st.integers(1, 12), first_page=st.integers(0, 2))
def test_random_alloc_free_matches_set_model(
    page_size: int, ops: list[tuple[str, int]], num_pages: int, first_page: int
) -> None:
    alloc = PageAllocator(num_pages, page_size, first_page)
    managed = set(range(first_page, first_page + num_pages))
    held: list[torch.Tensor] = []  # allocations not yet freed
    model_used: set[int] = set()  # pages handed out
    for op, arg in ops:
        if op == "alloc":
            slots = alloc.alloc(arg * page_size)
            if arg > len(managed) - len(model_used):
                assert slots is None
                continue
            assert slots is not None and slots.numel() == arg * page_size
            assert_whole_pages(slots, page_size)
            pages = set(pages_of(slots, page_size).tolist())
            assert len(pages) == arg and pages <= managed and not pages & model_used
            model_used |= pages
            held.append(slots)
        elif op == "free" and held:
            slots = held.pop(arg % len(held))
            alloc.free(slots)
            model_used -= set(pages_of(slots, page_size).tolist())
        elif op == "bad_free":
            free_pages = sorted(managed - model_used)
            if free_pages:
                page = free_pages[arg % len(free_pages)]
                with pytest.raises(ValueError, match="not allocated"):
                    alloc.free(slots_of(torch.tensor([page]), page_size))
        assert alloc.used_size() == len(model_used) * page_size
        assert alloc.available_size() + alloc.used_size() == alloc.total_size()
        assert alloc.num_free_pages == len(managed) - len(model_used)


# --------------------------------------------------------------------------- DeviceKVPool


def make_device_pool(num_pages: int = 5, page_size: int = 4) -> DeviceKVPool:
    return DeviceKVPool(num_pages, page_size, NUM_LAYERS, KV_HEADS, HEAD_DIM, torch.float32, DEVICE)


def test_device_pool_set_get_round_trip() -> None:
    pool = make_device_pool()
    slots = pool.alloc(8)
    assert slots is not None
    k = torch.randn(8, KV_HEADS, HEAD_DIM)
    v = torch.randn(8, KV_HEADS, HEAD_DIM)
    pool.set_kv(1, slots, k, v)
    k_buf, v_buf = pool.get_kv(1)
    assert k_buf.shape == (pool.num_slots, KV_HEADS, HEAD_DIM)
    assert torch.equal(k_buf[slots.to(k_buf.device)].cpu(), k)
    assert torch.equal(v_buf[slots.to(v_buf.device)].cpu(), v)
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not k_buf.cpu()[untouched].any()  # other slots keep their zeros
    other_k, _ = pool.get_kv(0)
    assert not other_k.any()  # other layers untouched


def test_device_pool_never_hands_out_padding_page() -> None:
    pool = make_device_pool(num_pages=5, page_size=4)
    assert pool.num_slots == 6 * 4
    slots = pool.alloc(20)
    assert slots is not None
    assert int(slots.min()) == 4 and int(slots.max()) == 23  # page 0 = slots 0..3 excluded
    assert pool.alloc(4) is None and pool.available_size() == 0
    with pytest.raises(ValueError, match="out of range"):
        pool.free(torch.arange(4))


def test_device_pool_page_view_shares_memory() -> None:
    pool = make_device_pool(num_pages=5, page_size=4)
    k_pages, v_pages = pool.page_view(2)
    assert k_pages.shape == v_pages.shape == (6, 4, KV_HEADS, HEAD_DIM)
    k, v = pool.get_kv(2)
    assert k_pages.data_ptr() == k.data_ptr() and v_pages.data_ptr() == v.data_ptr()
    slot = 3 * 4 + 2  # page 3, offset 2
    pool.set_kv(
        2,
        torch.tensor([slot]),
        torch.full((1, KV_HEADS, HEAD_DIM), 7.0),
        torch.zeros(1, KV_HEADS, HEAD_DIM),
    )
    assert bool((k_pages[3, 2] == 7.0).all())
    assert int(k_pages.count_nonzero()) == KV_HEADS * HEAD_DIM


def test_device_pool_sizes() -> None:
    pool = make_device_pool(num_pages=5, page_size=4)
    per_token = DeviceKVPool.bytes_per_token(NUM_LAYERS, KV_HEADS, HEAD_DIM, torch.float32)
    assert per_token == 2 * NUM_LAYERS * KV_HEADS * HEAD_DIM * 4
    assert pool.page_bytes == 4 * per_token
    measured = sum(t.numel() * t.element_size() for t in pool.k_buffers + pool.v_buffers)
    assert pool.size_bytes == measured == 6 * pool.page_bytes
    assert pool.dtype == torch.float32 and pool.device.type == DEVICE


def test_pages_for_budget_counts_the_padding_page() -> None:
    args = (4, NUM_LAYERS, KV_HEADS, HEAD_DIM, torch.float16)
    page_bytes = 4 * DeviceKVPool.bytes_per_token(*args[1:])
    assert DeviceKVPool.pages_for_budget(10 * page_bytes, *args) == 9
    assert DeviceKVPool.pages_for_budget(10 * page_bytes + page_bytes - 1, *args) == 9
    with pytest.raises(ValueError, match=str(page_bytes)):
        DeviceKVPool.pages_for_budget(2 * page_bytes - 1, *args)


def test_device_pool_rejects_bad_shapes_and_layers() -> None:
    pool = make_device_pool()
    slots = pool.alloc(4)
    assert slots is not None
    with pytest.raises(ValueError, match=r"\(4, 2, 4\)"):
        pool.set_kv(
            0, slots, torch.zeros(4, KV_HEADS, HEAD_DIM + 1), torch.zeros(4, KV_HEADS, HEAD_DIM)
        )
    with pytest.raises(IndexError, match="layer 3"):
        pool.get_kv(NUM_LAYERS)


def test_device_auto_resolves_to_available_device() -> None:
    pool = DeviceKVPool(2, 2, 1, 1, 2, torch.float32, "auto")
    assert pool.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pool.get_kv(0)[0].device.type == pool.device.type


# --------------------------------------------------------------------------- HostKVPool


def make_host_pool(layout: str, num_pages: int = 6, page_size: int = 4) -> HostKVPool:
    return HostKVPool(num_pages, page_size, NUM_LAYERS, KV_HEADS, HEAD_DIM, torch.float32, layout)


def unique_pages(n: int, page_size: int) -> torch.Tensor:
    """`[n, L, 2, page_size, kv_heads, head_dim]`, distinct per (page, layer, kv, offset, head,
    dim), so any mix-up of pages, layers, K/V or offsets changes some value."""
    shape = (n, NUM_LAYERS, 2, page_size, KV_HEADS, HEAD_DIM)
    total = n * NUM_LAYERS * 2 * page_size * KV_HEADS * HEAD_DIM
    return torch.arange(1, total + 1, dtype=torch.float32).reshape(shape)  # exact below 2**24


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_host_set_get_pages_round_trip(layout: str) -> None:
    pool = make_host_pool(layout)
    pool.buffer.zero_()
    pages = torch.randperm(6)[:4]
    data = unique_pages(4, 4)
    pool.set_pages(pages, data)
    assert torch.equal(pool.get_pages(pages), data)
    assert torch.equal(pool.get_pages(pages.flip(0)), data.flip(0))
    for i, page in enumerate(pages.tolist()):
        assert torch.equal(pool.get_page(page), data[i])
    untouched = sorted(set(range(6)) - set(pages.tolist()))
    assert not pool.get_pages(torch.tensor(untouched)).any()


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_host_set_page_and_layer_kv_see_the_same_bytes(layout: str) -> None:
    pool = make_host_pool(layout)
    data = unique_pages(6, 4)
    for page in range(6):
        pool.set_page(page, data[page])
    for layer in range(NUM_LAYERS):
        k, v = pool.layer_kv(layer)
        assert k.shape == v.shape == (6, 4, KV_HEADS, HEAD_DIM)
        for page in range(6):
            assert torch.equal(k[page], pool.get_page(page)[layer, 0])
            assert torch.equal(v[page], pool.get_page(page)[layer, 1])
    k, _ = pool.layer_kv(1)
    k[2, 3].fill_(-5.0)  # a view: the write lands in the pool
    assert bool((pool.get_page(2)[1, 0, 3] == -5.0).all())
    assert torch.equal(pool.get_page(2)[1, 1], data[2, 1, 1])


def test_host_page_first_get_page_is_a_view_layer_first_a_copy() -> None:
    first = make_host_pool("page_first")
    first.get_page(1).fill_(3.0)
    assert bool((first.get_pages(torch.tensor([1])) == 3.0).all())
    layer = make_host_pool("layer_first")
    layer.buffer.zero_()
    copy = layer.get_page(1)
    assert copy.is_contiguous()
    copy.fill_(3.0)
    assert not layer.get_page(1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_page_buffer_is_the_page_bytes(dtype: torch.dtype) -> None:
    pool = HostKVPool(4, 2, NUM_LAYERS, KV_HEADS, HEAD_DIM, dtype, "page_first")
    pool.set_pages(torch.arange(4), unique_pages(4, 2).to(dtype))
    raw = pool.page_buffer(2)
    assert len(raw) == raw.nbytes == pool.page_bytes
    expected = pool.get_page(2).contiguous().view(torch.uint8).numpy().tobytes()
    assert raw.tobytes() == expected
    raw[:] = pool.page_buffer(3)  # storage writes straight into the pool
    assert torch.equal(pool.get_page(2), pool.get_page(3))


def test_host_page_buffer_refuses_layer_first() -> None:
    pool = make_host_pool("layer_first")
    with pytest.raises(ValueError, match=r"page_first.*get_page/set_page"):
        pool.page_buffer(0)


def test_host_unknown_layout_lists_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"'head_first'.*page_first, layer_first"):
        make_host_pool("head_first")


def test_host_rejects_bad_pages_and_shapes() -> None:
    pool = make_host_pool("page_first")
    with pytest.raises(IndexError, match="page 6"):
        pool.get_pages(torch.tensor([0, 6]))
    with pytest.raises(IndexError, match="page -1"):
        pool.get_page(-1)
    with pytest.raises(ValueError, match="shape"):
        pool.set_pages(torch.tensor([0, 1]), unique_pages(3, 4))


def test_host_allocator_has_no_padding_page() -> None:
    pool = make_host_pool("layer_first", num_pages=3, page_size=4)
    assert pool.total_size() == 12
    slots = pool.alloc(12)
    assert slots is not None and sorted(slots.tolist()) == list(range(12))
    assert pool.available_size() == 0 and pool.alloc(4) is None
    pool.free(slots[4:8])
    assert pool.available_size() == 4
    assert pool.size_bytes == 3 * pool.page_bytes == pool.buffer.numel() * 4


def test_host_pool_past_available_memory_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_pool_host, "available_memory_bytes", lambda: 2 * 10**9)
    page_bytes = 2 * NUM_LAYERS * 4 * KV_HEADS * HEAD_DIM * 4  # float32, page_size 4
    num_pages = int(1.9 * 10**9) // page_bytes  # 95% of available, above the 90% cap
    with pytest.raises(MemoryError, match=r"1\.90 GB.*2\.00 GB.*--hicache-size.*host\.ratio"):
        make_host_pool("page_first", num_pages=num_pages)
    small = make_host_pool("page_first", num_pages=16)  # far under the cap: allowed
    assert small.num_pages == 16


def test_host_check_available_false_skips_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_pool_host, "available_memory_bytes", lambda: 0)
    with pytest.raises(MemoryError):
        make_host_pool("page_first")
    pool = HostKVPool(6, 4, NUM_LAYERS, KV_HEADS, HEAD_DIM, torch.float32, check_available=False)
    assert pool.layout == "page_first"


def test_available_memory_bytes_is_positive() -> None:
    assert memory_pool_host.available_memory_bytes() > 0


def test_host_pool_not_pinned_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only host
    pool = make_host_pool("page_first")
    assert pool.is_pinned is False
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        HostKVPool(2, 2, 1, 1, 2, torch.float32, pin_memory=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_pool_pinned_with_cuda() -> None:
    assert make_host_pool("page_first").is_pinned is True
    assert HostKVPool(2, 2, 1, 1, 2, torch.float32, pin_memory=False).is_pinned is False
