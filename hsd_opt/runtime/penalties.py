"""Frequency and presence penalties and logit biases (the OpenAI API's ``frequency_penalty``, ``presence_penalty``
and ``logit_bias``), and the repetition penalty (vLLM's ``repetition_penalty``, llama.cpp's ``repeat_penalty``):
the target they decode is the model with its logits moved before temperature and top-p,

    ``r(logits[j]) + bias[j] - frequency * c[j] - presence * (c[j] > 0)``

where ``c[j]`` counts token ``j`` among the tokens generated before the position (the prompt's not counted, as the
API defines it), and ``r`` divides a positive logit by ``repetition`` and multiplies any other by it for every token
of the context before the position (the prompt's too; with ``repetition_last``, of its last that many tokens), as
Hugging Face's ``RepetitionPenaltyLogitsProcessor`` and llama.cpp do; other logits are left. In float32, as
``logits + offsets``, a repeated token's offset holding ``r(l) - l`` (:meth:`Penalties.repetition_offsets`): those
depend on the model's own logits at the repeated tokens, which a pass through the int8 screen computes exactly
(:meth:`~hsd_opt.engine.interface.Picks.values`). The offsets depend on the prefix, so each row of a pass gets its
own: a verify pass's row ``i`` counts the drafts before it, which are the target's tokens wherever they are accepted.
Every level of a hierarchy reads its logits moved the same way (its drafts then follow the target it drafts for), and
greedy decoding takes ``argmax(logits + offsets)`` through the engine's picks (:mod:`hsd_opt.engine.picks`: an int8
screen where the head has one), so the output stays the penalised target's, token for token.

Units: offsets in logits (float32), shapes ``[V]`` per row; token ids below the model's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from hsd_opt.errors import HsdError
from hsd_opt.runtime.arguments import check_penalties


@dataclass(frozen=True)
class Penalties:
    """What moves a sequence's logits (see the module doc). ``bias``: token id -> offset in logits."""

    frequency: float = 0.0
    presence: float = 0.0
    bias: Mapping[int, float] = field(default_factory=dict)
    #: the repetition penalty's factor (1: none) and how many of the context's last tokens it looks at (None: all)
    repetition: float = 1.0
    repetition_last: int | None = None

    def __post_init__(self):
        check_penalties(self.frequency, self.presence, self.bias, self.repetition, self.repetition_last)

    @property
    def active(self) -> bool:
        """Whether anything moves (all zero: the model's own logits)."""
        return bool(self.frequency or self.presence or any(self.bias.values()) or self.repeats)

    @property
    def repeats(self) -> bool:
        """Whether the repetition penalty moves anything (its offsets depend on the logits)."""
        return self.repetition != 1.0

    def repeated(self, context: Sequence[int]) -> torch.Tensor:
        """The token ids (int64, ascending, each once) whose logits the repetition penalty moves at the row after
        ``context`` (the prompt's and the generated tokens up to that row): those of its last
        :attr:`repetition_last` tokens (all: None); none without the penalty."""
        if not self.repeats or not context:
            return torch.empty(0, dtype=torch.long)
        tail = context if self.repetition_last is None else context[-self.repetition_last:]
        return torch.tensor(list(tail), dtype=torch.long).unique()

    def repetition_offsets(self, values: torch.Tensor) -> torch.Tensor:
        """``r(l) - l`` (float32) for the model's logits ``values`` at the repeated tokens: ``l / repetition`` where
        ``l`` > 0, ``l * repetition`` elsewhere, less ``l``."""
        v = values.float()
        return torch.where(v > 0, v / self.repetition, v * self.repetition) - v

    def check_vocab(self, vocab: int, where: str = "logit_bias") -> None:
        """Refuse a biased token id the model does not have (``vocab`` its logits' width)."""
        bad = sorted(t for t in self.bias if t >= vocab)
        if bad:
            raise HsdError(f"{where}: token id {bad[0]} is not in the model's vocabulary of {vocab}")

    def base(self, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The biases as a row ``[vocab]`` float32 (zeros where none is given)."""
        row = torch.zeros(vocab, dtype=torch.float32)
        if self.bias:
            row[torch.tensor(list(self.bias), dtype=torch.long)] = torch.tensor(list(self.bias.values()),
                                                                                 dtype=torch.float32)
        return row.to(device)

    def offsets(self, generated: Sequence[int], vocab: int, base: torch.Tensor | None = None) -> torch.Tensor:
        """The offsets ``[vocab]`` float32 of the row after ``generated`` (the tokens generated so far):
        ``bias - frequency * count - presence * (count > 0)``, computed in float32 on the tokens that occur (a
        token generated ``c`` times: ``bias - (frequency * c + presence)``). ``base``: :meth:`base` made once."""
        row = (self.base(vocab) if base is None else base).clone()
        if generated and (self.frequency or self.presence):
            ids, counts = torch.tensor(list(generated), dtype=torch.long).unique(return_counts=True)
            ids, counts = ids.to(row.device), counts.to(row.device, torch.float32)
            row.index_add_(0, ids, -(counts * self.frequency + self.presence))
        return row

    def rows(self, generated: Sequence[int], start: int, end: int, vocab: int,
             base: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`offsets` after ``generated[:n]`` for ``n = start .. end-1``: ``[end - start, vocab]``."""
        return torch.stack([self.offsets(generated[:n], vocab, base) for n in range(start, end)])


def penalties_or_none(frequency: float = 0.0, presence: float = 0.0,
                      bias: Mapping[int, float] | None = None, repetition: float = 1.0,
                      repetition_last: int | None = None) -> Penalties | None:
    """A :class:`Penalties` of the arguments (checked), None when nothing moves."""
    p = Penalties(frequency, presence, dict(bias or {}), repetition, repetition_last)
    return p if p.active else None
