"""The L2 side of a tree without a host tier (`tree.host`, the `base.HostTier` contract):
harmless answers, as SGLang's `BasePrefixCache` gives (no host hit, nothing to load back,
nothing to protect, zero host sizes, no copies in flight), so the tier owner never asks
which tree it holds. `HiRadixCache` answers the contract itself.

Sizes are tokens. Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.tree.base import EMPTY, HostCounters, HostSizes, LoadBack
from hicache.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.transfer.engines import TransferHandle


class NoHostTier:
    """The L2 side of a tree without L2: nothing is ever there, nothing ever moves."""

    def init_load_back(self, last_host_node: TreeNode) -> LoadBack:
        return LoadBack(EMPTY, last_host_node)

    def protect_host(self, node: TreeNode) -> None:
        pass

    def release_host(self, node: TreeNode) -> None:
        pass

    def host_sizes(self) -> HostSizes:
        return HostSizes()

    def host_counters(self) -> HostCounters:
        return HostCounters()

    def forget_stored(self) -> None:
        pass

    def back_up_path(self, node: TreeNode) -> bool:
        return False

    def flush_host(self) -> int:
        return 0

    def writing_check(self, wait: bool = False, claim: bool = True) -> list[TreeNode]:
        return []

    def loading_check(self, wait: bool = False) -> int:
        return 0

    def copies_pending(self) -> bool:
        return False

    def reload_windows(self, last: TreeNode) -> bool:
        return True

    def start_loading(self) -> TransferHandle | None:
        return None

    def wait_copies(self) -> None:
        pass
