"""A request's text, decoded a few tokens at a time, and the conditions that stop it.

    stop token    EOS or one of `stop_token_ids` (neither under `ignore_eos`, as SGLang's
                  `check_finished`); its text is not in the answer unless `no_stop_trim`
    stop string   the answer is cut where the first one starts, unless `no_stop_trim`
    length        `max_new_tokens` reached
    min_new_tokens  nothing above stops a request before it has this many tokens (the logits
                  mask the stop tokens meanwhile, `hicache_server.sampling.LogitsShaper`);
                  a stop string counts only if it ends in text that settled with the
                  `min_new_tokens`-th token or later

Deltas, not snapshots (SGLang's detokenizer, vLLM's incremental detokenizer): per token
only the window `ids[prefix_offset:]` is decoded, and the text past
`decode(ids[prefix_offset:read_offset])` is new unless it ends in U+FFFD (a character whose
bytes have not all come). Of the new text, the last `max(len(stop)) - 1` characters are
held back while a stop string may still start in them; the rest is handed on
(`RequestOutput.pieces`) and never taken back. Joined, the pieces are the whole output
decoded at once, cut at a stop string. Work per token is the window's, never the output's.

Threading: scheduler thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_server.output import RequestOutput
from hicache_server.request import Request
from hicache_server.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what decoding an unfinished UTF-8 sequence ends with


class OutputText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, req: Request, ids: Sequence[int]) -> str:
        """`ids` as text; special tokens kept only for `skip_special_tokens=false` (which the
        engine refuses for a tokenizer whose `decode` cannot keep them)."""
        return self.tokenizer.decode(ids, skip_special_tokens=req.input.params.skip_special_tokens)

    def token_text(self, req: Request, token: int) -> str | None:
        """One token's text for its logprob entries (`return_text_in_logprobs`), else None."""
        return self.decode(req, [token]) if req.input.return_text_in_logprobs else None

    def stop_ids(self, req: Request) -> set[int]:
        """The tokens that end `req`: EOS and its `stop_token_ids`; none under `ignore_eos`."""
        if req.input.params.ignore_eos:
            return set()
        return set(self.tokenizer.eos_token_ids) | set(req.input.params.stop_token_ids)

    def stop_reason(self, req: Request, token: int) -> str | None:
        """"stop" (a stop token or string), "length", or None for `req` whose newest token is
        `token`; the text that settled with it is handed on (see the module docstring)."""
        p, out = req.input.params, req.output
        checking = len(out.ids) >= p.min_new_tokens  # <= max_new_tokens: no length stop
        if checking and token in self.stop_ids(req):
            end = len(out.ids) - (0 if p.no_stop_trim else 1)
            self._hand_on(req, self._read(req, end, final=True), search=False, final=True)
            return "stop"
        final = len(out.ids) >= p.max_new_tokens
        new = self._read(req, len(out.ids), final)
        if self._hand_on(req, new, search=checking and bool(p.stop), final=final):
            return "stop"
        return "length" if final else None

    def flush(self, req: Request) -> None:
        """Hand on all that is decoded and held (a request ending otherwise: an error, an
        abort); nothing when its text is final already."""
        if not req.output.text_done:
            self._hand_on(req, self._read(req, len(req.output.ids), final=True),
                          search=False, final=True)

    def _read(self, req: Request, end: int, final: bool) -> str:
        """The text `ids[:end]` adds to what was read before: "" while it may end in an
        unfinished character, unless `final`."""
        out = req.output
        prefix = self.decode(req, out.ids[out.prefix_offset:out.read_offset])
        window = self.decode(req, out.ids[out.prefix_offset:end])
        if len(window) <= len(prefix) or (window.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        out.prefix_offset, out.read_offset = out.read_offset, end
        return window[len(prefix):]

    def _hand_on(self, req: Request, new: str, search: bool, final: bool) -> bool:
        """Hand on `new` after the held text, holding back what may start a stop string;
        with `search`, cut at the first stop string that ends in `new`. Whether it cut."""
        out, p = req.output, req.input.params
        text, done = out.held + new, len(out.held)
        cut = _first_stop(text, p.stop, done) if search else None
        if cut is not None:
            _settle(out, text if p.no_stop_trim else text[:cut])
            return True
        if final:
            _settle(out, text)
            return False
        keep = max(0, len(text) - (max(map(len, p.stop), default=1) - 1))
        if keep:
            out.pieces.append(text[:keep])
        out.held = text[keep:]
        return False


def _settle(out: RequestOutput, text: str) -> None:
    """The last of the text: nothing is held or decoded after it."""
    if text:
        out.pieces.append(text)
    out.held, out.text_done = "", True


def _first_stop(text: str, stops: Sequence[str], done: int) -> int | None:
    """Where the first stop string ending past `text[:done]` (searched before) starts."""
    cuts = [i for i in (text.find(s, max(0, done - len(s) + 1)) for s in stops) if i >= 0]
    return min(cuts) if cuts else None
