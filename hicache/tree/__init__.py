"""The prefix trees: the `PrefixCache` contract, `RadixCache` (L1), `HiRadixCache` (L1 + L2),
their nodes and the lazy eviction heap."""

from hicache.tree.base import HostCounters, HostSizes, LoadBack, MatchResult, PrefixCache
from hicache.tree.hiradix import LOAD_BACK_THRESHOLD, HiRadixCache
from hicache.tree.node import HiTreeNode, TreeNode
from hicache.tree.radix import RadixCache

__all__ = [
           "LOAD_BACK_THRESHOLD",
           "HiRadixCache",
           "HiTreeNode",
           "HostCounters",
           "HostSizes",
           "LoadBack",
           "MatchResult",
           "PrefixCache",
           "RadixCache",
           "TreeNode",
]
