"""A request's text and the conditions that stop it, from its output token ids.

    stop token    EOS or one of `stop_token_ids` (neither under `ignore_eos`, as SGLang's
                  `check_finished`); its text is not in the answer unless `no_stop_trim`
    stop string   the answer is cut where the first one starts, unless `no_stop_trim`
    length        `max_new_tokens` reached
    min_new_tokens  nothing above stops a request before it has this many tokens (the logits
                  mask the stop tokens meanwhile, `hicache_server.sampling.LogitsShaper`)

Threading: scheduler thread.
"""

from __future__ import annotations

from hicache_server.request import Request
from hicache_server.tokenizer import Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, req: Request, ids: list[int]) -> str:
        """`ids` as text; special tokens kept only for `skip_special_tokens=false` (which the
        engine refuses for a tokenizer whose `decode` cannot keep them)."""
        return self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)

    def token_text(self, req: Request, token: int) -> str | None:
        """One token's text for its logprob entries (`return_text_in_logprobs`), else None."""
        return self.decode(req, [token]) if req.return_text_in_logprobs else None

    def stop_ids(self, req: Request) -> set[int]:
        """The tokens that end `req`: EOS and its `stop_token_ids`; none under `ignore_eos`."""
        if req.params.ignore_eos:
            return set()
        return set(self.tokenizer.eos_token_ids) | set(req.params.stop_token_ids)

    def stop_reason(self, req: Request, token: int) -> str | None:
        """"stop" (a stop token or string), "length", or None for `req` whose newest token is
        `token`; `req.text` is set when it stops (see the module docstring)."""
        p, out = req.params, req.output_ids
        if len(out) < p.min_new_tokens:  # <= max_new_tokens, so no length stop either
            return None
        if token in self.stop_ids(req):
            req.text = self.decode(req, out if p.no_stop_trim else out[:-1])
            return "stop"
        if p.stop:
            req.text = self.decode(req, out)
            cut = self._stop_string_at(req)
            if cut is not None:
                req.text = req.text if p.no_stop_trim else req.text[:cut]
                return "stop"
        if len(out) >= p.max_new_tokens:
            req.text = self.decode(req, out)
            return "length"
        return None

    def _stop_string_at(self, req: Request) -> int | None:
        """Where the first stop string starts in `req.text`, among those ending in the text of
        the `min_new_tokens`-th token or later; None when there is none."""
        floor = 0
        if req.params.min_new_tokens > 1:
            floor = len(self.decode(req, req.output_ids[:req.params.min_new_tokens - 1]))
        cuts = [i for i in (req.text.find(s, max(0, floor - len(s) + 1))
                            for s in req.params.stop) if i >= 0]
        return min(cuts) if cuts else None
