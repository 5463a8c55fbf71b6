"""ForwardBatch: what the model runner hands the model for one forward pass.

Token regions of one batch of `num_seqs` sequences (extend = the new tokens of this pass)::

    input_ids / positions / out_slots   [T] = seq 0's extend | seq 1's extend | ...
    seq_slots[i]                        [prefix_lens[i] + extend_lens[i]]
                                        = cached prefix slots | seq i's part of out_slots

A decode batch is the case `extend_lens == [1] * num_seqs`. The model returns the logits of
each sequence's last new token, or with `output_rows` set, of exactly those rows of `[T]`
(a request that wants prompt logprobs needs every position from its `logprob_start_len`).
Index tensors may live on the CPU
or on the model's device; the model calls `to(device)` once per forward, never per layer.

Threading: built and consumed by the scheduler thread (the one that owns the KV pool).
`layer_hook(i)` runs on that thread too, just before layer i's attention touches the cache
(the runner waits there for layer i's loads, so loading layer i+1 overlaps computing layer i).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hicache.memory import INDEX_DTYPE


@dataclass(eq=False)  # identity equality: tensors have no boolean ==
class ForwardBatch:
    """One forward pass over the new tokens of `num_seqs` sequences (see the module docstring)."""

    input_ids: torch.Tensor  # [T] int64, the new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64, absolute positions (prefix_len + i)
    out_slots: torch.Tensor  # [T] int64, KV slots the new tokens' K/V are written to
    seq_slots: list[torch.Tensor]  # per sequence [prefix_len + extend_len] int64, all its slots
    prefix_lens: list[int]  # tokens already in the KV cache, per sequence
    extend_lens: list[int]  # new tokens per sequence (1 for decode)
    layer_hook: Callable[[int], None] | None = None
    # [R] int64 rows of `[T]` whose logits the model returns, ascending; None = each
    # sequence's last new token (`last_token_indices`), the normal path
    output_rows: torch.Tensor | None = None
    # [R] bool (CPU) over the rows whose logits the model returns: True where only the row's
    # argmax is read (a plain greedy token, `ModelRunner.forward`), so the model may return
    # the head screen's row there (models/head_screen.py); None = every row whole
    argmax_only: torch.Tensor | None = None
    # Lazily built padded slot table for decode kernels; see `slot_table`.
    _slot_table: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False
    )
    # What layers share, built by the first that asks; see `memo`.
    _memo: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.extend_lens)
        if n == 0:
            raise ValueError("a ForwardBatch needs at least one sequence, got extend_lens=[]")
        if len(self.prefix_lens) != n or len(self.seq_slots) != n:
            raise ValueError(
                f"prefix_lens ({len(self.prefix_lens)}), extend_lens ({n}) and seq_slots "
                f"({len(self.seq_slots)}) must have one entry per sequence"
            )
        for name in ("input_ids", "positions", "out_slots"):
            _check_index(name, getattr(self, name), self.num_tokens)
        for i, (p, e, s) in enumerate(zip(self.prefix_lens, self.extend_lens, self.seq_slots)):
            if p < 0 or e < 1:
                raise ValueError(
                    f"sequence {i}: prefix_len must be >= 0 and extend_len >= 1, got {p} and {e}"
                )
            _check_index(f"seq_slots[{i}]", s, p + e)
        if self.output_rows is not None:
            _check_index("output_rows", self.output_rows, self.output_rows.numel())

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        """T, the new tokens of all sequences."""
        return sum(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        """True when every sequence adds exactly one token."""
        return all(e == 1 for e in self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        """Tokens per sequence after this pass (prefix + extend)."""
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def extend_starts(self) -> list[int]:
        """Offset of each sequence's first new token in `input_ids`."""
        starts = [0]
        for e in self.extend_lens[:-1]:
            starts.append(starts[-1] + e)
        return starts

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def last_token_indices(self) -> torch.Tensor:
        """[num_seqs] int64 rows of each sequence's last new token, on `device`."""
        ends = [s + e - 1 for s, e in zip(self.extend_starts, self.extend_lens)]
        return torch.tensor(ends, dtype=INDEX_DTYPE).to(self.device, non_blocking=True)

    def logit_rows(self) -> torch.Tensor:
        """[R] int64 rows whose logits the model returns (`output_rows`, else the last new
        token of each sequence), on `device`."""
        if self.output_rows is None:
            return self.last_token_indices()
        return self.output_rows.to(self.device, INDEX_DTYPE, non_blocking=True)

    def to(self, device: torch.device) -> ForwardBatch:
        """This batch with every index tensor on `device` (self when already there).

        The per-sequence slot lists travel as one concatenated copy, then split into views.
        """
        tensors = [self.input_ids, self.positions, self.out_slots, *self.seq_slots]
        if all(t.device == device and t.dtype == INDEX_DTYPE for t in tensors):
            return self
        moved = torch.cat([t.to(INDEX_DTYPE) for t in tensors]).to(device, non_blocking=True)
        sizes = [t.numel() for t in tensors]
        parts = list(moved.split(sizes))
        return replace(
            self, input_ids=parts[0], positions=parts[1], out_slots=parts[2], seq_slots=parts[3:]
        )

    def memo(self, key: str, build: Callable[[], Any]) -> Any:
        """`build()`, called once per batch: what every layer of one forward shares (an
        attention backend's tables and masks, RoPE's cos/sin). A batch moved by `to` starts
        with an empty memo."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def slot_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(table [num_seqs, max_seq_len] int64, seq_lens [num_seqs] int64)` on `device`.

        Row i holds `seq_slots[i]` then padding (slot 0, never read past `seq_lens[i]`). Built
        once per batch and cached, so every layer of a decode step shares it.
        """
        if self._slot_table is None:
            table = torch.nn.utils.rnn.pad_sequence(
                list(self.seq_slots), batch_first=True, padding_value=0
            )  # [num_seqs, max_seq_len]
            lens = torch.tensor(self.seq_lens, dtype=INDEX_DTYPE).to(self.device)
            self._slot_table = (table.to(INDEX_DTYPE), lens)
        return self._slot_table


def _check_index(name: str, t: torch.Tensor, length: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    if t.numel() != length:
        raise ValueError(f"{name} must hold {length} entries, got {t.numel()}")
