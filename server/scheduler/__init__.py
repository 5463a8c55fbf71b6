"""The scheduler: one thread that owns the cache and runs continuous batching over it.

    loop.py       Scheduler: the inbox, each step (poll the tiers, admit, run, finish)
    admission.py  which waiting request next (LPM) and whether it fits: ask, then commit
    kv.py         a request's device slots: allocated, handed to the tree, released
    retraction.py which running requests go back to the queue when L1 runs out, and how
    text.py       a request's text and its stop conditions (stop ids / strings, length)
    tokens.py     a forward pass's next tokens (shaped, argmax or sampled) and logprobs
"""

from hicache_server.scheduler.loop import Scheduler

__all__ = ["Scheduler"]
