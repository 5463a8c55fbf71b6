"""The field policy of the generation routes (docs/architecture.md, "HTTP"), in one place:

- a field the server does not know is accepted and ignored, with one warning per field name
  per process in the log (`known_fields`). Clients send their whole vocabulary (SGLang's
  bench_serving sends `lora_path: null`, guidellm `continuous_usage_stats`); a 400 for a
  harmless extra breaks them, and a warning per request would flood the log (vLLM warns too);
- a known field whose value asks for what the server cannot do is a 400 naming the field and
  the value it allows (`refuse_unsupported`): ignoring a LoRA adapter or a JSON schema would
  answer something the client did not ask for;
- a known field with a bad shape or an out-of-range value is a 400 (`body.check_type`, then
  the engine's `InvalidRequest`).

A nested field is named by its path (`sampling_params.beam`, `stream_options.x`), and warned
about once under that name. The names remembered are bounded (`WarnedNames`): a client that
sends a new name with every request grows neither memory nor the log.

Threading: the handlers run on the event loop only, so the set of names already warned about
needs no lock.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

from hicache_server.http.body import brief
from hicache_server.http.errors import HttpError

logger = logging.getLogger(__name__)

# Distinct unknown field names warned about in a process: real clients send a handful
# (SGLang's bench_serving and guidellm a few each); past this many, a new name is not logged.
MAX_WARNED_NAMES = 256
# Characters of an unknown name kept and shown: a name is a handle, and a body may be 8 MiB.
MAX_NAME_CHARS = 64


class WarnedNames:
    """The unknown field names already warned about, at most `limit`, each cut to
    `name_chars` characters; once full, new names pass unlogged (one line says so)."""

    def __init__(self, limit: int = MAX_WARNED_NAMES,
                 name_chars: int = MAX_NAME_CHARS) -> None:
        if limit < 1 or name_chars < 1:
            raise ValueError(f"limit and name_chars must be >= 1, got {limit}, {name_chars}")
        self.limit, self.name_chars = limit, name_chars
        self.names: set[str] = set()
        self.full = False  # the line saying that new names go unlogged was written

    def warn_once(self, name: str, route: str) -> None:
        """Log `name` (sent to `route`) unless it was, or `limit` names were, already."""
        shown = name if len(name) <= self.name_chars else name[:self.name_chars] + "..."
        if shown in self.names or self.full:
            return
        if len(self.names) >= self.limit:
            self.full = True
            logger.warning("%d unknown request field names have been logged; new ones are "
                           "ignored without a warning from now on", self.limit)
            return
        self.names.add(shown)
        logger.warning("ignoring the unknown request field `%s` (first sent to %s; later "
                       "requests that carry it are not logged)", shown, route)


# The names warned about in this process
WARNED = WarnedNames()


class Only(NamedTuple):
    """The one value of a known field this server honours (leaving the field out, or null,
    means the same); any other value asks for `feature`, which it cannot do."""

    value: Any
    feature: str


def known_fields(body: Mapping[str, Any], known: Collection[str], route: str,
                 prefix: str = "") -> dict[str, Any]:
    """`body` without the fields not in `known`; each unknown name is logged once per process
    (`prefix` is the path of a nested object, such as "sampling_params.")."""
    for name in body:
        if name not in known:
            WARNED.warn_once(f"{prefix}{name}", route)
    return {k: v for k, v in body.items() if k in known}


def refuse_unsupported(body: Mapping[str, Any], rules: Mapping[str, Only],
                       prefix: str = "") -> None:
    """A 400 for the first field whose value asks for what its `Only` rule says the server
    cannot do."""
    for name, rule in rules.items():
        value = body.get(name)
        if not _honoured(value, rule.value):
            allowed = json.dumps(rule.value)
            raise HttpError(400, f"`{prefix}{name}`: {rule.feature} is not supported by this "
                            f"server, got {brief(value)}; allowed: {allowed} (or leave it out)")


def _honoured(value: Any, only: Any) -> bool:
    """Whether `value` asks for nothing beyond `only`. Empty values ask for nothing: SGLang's
    clients send `lora_path: ""` or `[null, null]` (one per prompt) for "no adapter"."""
    if _unset(value):
        return True
    return only is not None and type(value) is type(only) and value == only


def _unset(value: Any) -> bool:
    if value is None or value == "" or value == [] or value == {}:
        return True
    return isinstance(value, list) and all(_unset(v) for v in value)


def check_int(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    """`body[name]` as an integer in [low, high] (None when absent or null); a 400 naming the
    field and the range otherwise. For limits the HTTP layer sets itself (the engine checks
    its own)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise HttpError(400, f"`{name}` must be an integer in [{low}, {high}], got "
                        f"{brief(value)}")
    return value
