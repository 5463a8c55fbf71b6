"""Page rounding (`hicache.pages`), the one place token counts become whole pages."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hicache.pages import page_count, pages_down, pages_up


@given(st.integers(0, 10**6), st.integers(1, 256))
def test_page_rounding_brackets_the_tokens_with_whole_pages(tokens: int, page: int) -> None:
    down, up, count = pages_down(tokens, page), pages_up(tokens, page), page_count(tokens, page)
    assert down % page == 0 and up % page == 0 and up == count * page
    assert down <= tokens <= up and up - down in (0, page)
    assert (up == down) == (tokens % page == 0)
