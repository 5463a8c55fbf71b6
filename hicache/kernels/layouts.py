"""Names of the host KV layouts, shared by the copy kernels and the host pool above them
(the lowest package that needs them, so neither side imports the other for a string).

    page_first   [num_pages, num_layers, 2, page_size, kv_heads, head_dim]  a page contiguous
    layer_first  [num_layers, 2, num_pages, page_size, kv_heads, head_dim]  a layer contiguous
"""

from __future__ import annotations

PAGE_FIRST = "page_first"
LAYER_FIRST = "layer_first"
HOST_LAYOUTS = (PAGE_FIRST, LAYER_FIRST)
