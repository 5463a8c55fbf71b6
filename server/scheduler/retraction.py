"""Retraction: when L1 cannot give a decode its slot (admission only estimated the tokens
requests generate), running requests go back to the queue, least progressed first.

    who      decoding requests (one token out at least): a request still reading prompt
             logprobs keeps them, and a prefill's slots are reserved anyway; fewest tokens
             out first, then the longest prompt, whose pages free the most (SGLang's order);
             never the last running request
    what     `RequestKV.retract`: its computed pages (prompt and output so far) go to the
             tree, unlocked, the rest to the pool; it waits at the head of the queue with its
             output, logprobs and generator, and readmitted it matches that prefix back (L1,
             or L2 after an eviction), fills the rest and goes on: nothing is sent twice
    after    the new-token estimate jumps back up (`NewTokenRatio.retracted`) and admission
             waits a step, so the room just made is not handed out again at once
    alone    a request that finds no slot while it runs alone fails (`no_room`)

Threading: scheduler thread.
"""

from __future__ import annotations

from hicache.stats import RequestCounters
from hicache_server.request import Request
from hicache_server.scheduler.kv import RequestKV


def progress(req: Request) -> tuple[int, int]:
    """How far a request has come, least progressed lowest: tokens out, then the shorter
    prompt (of two with as many tokens out, the longer prompt frees more)."""
    return len(req.output.ids), -req.prompt_len


class Retraction:
    def __init__(self, kv: RequestKV, waiting: list[Request],
                 counters: RequestCounters) -> None:
        self.kv = kv
        self.running = kv.running  # the scheduler's lists
        self.waiting = waiting
        self.counters = counters

    def victim(self) -> Request | None:
        """The request to retract (see the module docstring); None when there is none."""
        if len(self.running) < 2:
            return None
        return min((r for r in self.running if r.output.ids), key=progress, default=None)

    def any_victim(self, req: Request) -> Request | None:
        """The least progressed running request but `req`, decoding or not: a hybrid
        model's window slots ran short, which a filling request holds too."""
        return min((r for r in self.running if r is not req), key=progress, default=None)

    def retract(self, req: Request) -> None:
        """Move a running request back to the head of the queue, holding nothing on L1."""
        self.kv.retract(req)
        self.running.remove(req)
        self.waiting.insert(0, req)
        req.kv.retractions += 1
        self.counters.retracted_requests += 1

    def no_room(self, req: Request, tokens: int) -> RuntimeError:
        """Why `req` fails: L1 has no room for its `tokens` and no request can be retracted."""
        alone = ("with no other request running" if len(self.running) < 2
                 else "and no running request can be retracted")
        cache = self.kv.cache
        return RuntimeError(
            f"L1 has no room for {tokens} more token(s) of request {req.rid} {alone}: it "
            f"holds {len(req.kv.slots)} slots at position {req.kv.num_computed}, "
            f"{cache.slots.free_slots()} of {cache.slots.device_capacity()} are free and "
            f"{cache.slots.evictable_size()} evictable (the rest is locked); lower max_new_tokens "
            "or raise --max-total-tokens")
