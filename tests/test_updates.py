"""A stream's mailbox (`hicache_server.updates.Mailbox`): a reader slower than the scheduler
gets the tokens that came meanwhile merged into one update (the mailbox holds one unread
delta at most), none lost or repeated."""

from __future__ import annotations

import asyncio
import threading

from hicache_server.output import Delta, Logprobs
from hicache_server.updates import Mailbox

TOKENS = 2000


def delta(token: int, finish: str | None = None) -> Delta:
    return Delta([token], [chr(ord("a") + token % 26)],
                 Logprobs(output_token=[[-0.5, token, None]]),
                 {"completion_tokens": token + 1, "finish_reason": finish})


def test_a_slow_reader_gets_every_token_once_in_few_updates() -> None:
    async def run() -> list:
        box = Mailbox(asyncio.get_running_loop())

        def produce() -> None:
            for t in range(TOKENS):
                last = t == TOKENS - 1
                box.put(delta(t, "length" if last else None), {"done": True} if last else None)

        thread = threading.Thread(target=produce)
        thread.start()
        updates = []
        while not updates or updates[-1].result is None:
            updates.append(await box.get())
            await asyncio.sleep(0.001)  # a slow client
        thread.join()
        return updates

    updates = asyncio.run(run())
    ids = [t for u in updates for t in u.delta.ids]
    assert ids == list(range(TOKENS))
    assert [e[1] for u in updates for e in u.delta.logprobs.output_token] == ids
    assert "".join(u.delta.text for u in updates) == "".join(chr(97 + t % 26) for t in ids)
    assert updates[-1].delta.meta == {"completion_tokens": TOKENS, "finish_reason": "length"}
    assert updates[-1].result == {"done": True}
    assert len(updates) < TOKENS  # merged: the reader was slower than the writer
