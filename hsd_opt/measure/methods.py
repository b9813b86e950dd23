"""What ``hsd bench`` runs, checked without the measurement's imports (torch): the methods of the single-stream
bench and of the load bench, how every method samples (:class:`Sampling`), and the checks of their flags, each
refused in one line naming the flag before anything slow loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hsd_opt.errors import HsdError
from hsd_opt.prompts import PromptItem
from hsd_opt.runtime.arguments import check_sampling_flags
from hsd_opt.seeds import SEED_RANGE, SEED_STRIDE, seed_fits

#: Every method of the single-stream bench, as the report names it.
METHODS = ("hf_ar", "hf_prompt_lookup", "hf_early_exit", "hf_assisted", "ar", "single_draft", "hsd", "hsd_task")
#: Methods that run only when named: ``hf_early_exit`` (Hugging Face's early-exit self-speculation, which is slow
#: enough on a CPU to take most of a default bench's time).
ON_REQUEST_METHODS = ("hf_early_exit",)
#: Methods run when none are named: all but those run on request and ``hsd_task`` (which runs when the plan has
#: plans per task; ``hf_assisted`` runs when there is a draft model: :func:`default_methods`).
DEFAULT_METHODS = tuple(m for m in METHODS if m not in ON_REQUEST_METHODS and m != "hsd_task")


@dataclass(frozen=True)
class Sampling:
    """How every method decodes: greedy at ``temperature == 0``, else sampling from softmax(logits / T) then top-k
    (``top_k`` > 0), top-p and min-p (``min_p`` > 0), as HF ``generate`` orders them, with a seed per prompt and turn
    (:meth:`seed_for`); a prompt's output follows its grammar in ``grammars`` (by
    prompt index, a compiled :class:`~hsd_opt.grammar.compiler.Grammar`: ``--json-schema``/``--grammar``'s for
    every prompt, or a prompt line's own ``schema``), if it has one (our methods only)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    grammars: dict[int, Any] = field(default_factory=dict)
    top_k: int = 0
    min_p: float = 0.0

    @property
    def constrained(self) -> bool:
        """Whether any output follows a grammar."""
        return bool(self.grammars)

    def constraint(self, item: PromptItem):
        """A fresh grammar state for one generation of ``item`` (None: it follows no grammar)."""
        from hsd_opt.grammar.constraint import Constraint

        g = self.grammars.get(item.index)
        return Constraint(g) if g is not None else None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def seed_for(self, item: int, turn: int) -> int:
        """The seed of turn ``turn`` of prompt ``item``: ``seed + item + turn * SEED_STRIDE``."""
        return int(self.seed) + int(item) + SEED_STRIDE * int(turn)

    def to_dict(self) -> dict[str, float] | None:
        return None if self.greedy else {"temperature": self.temperature, **self.filters, "seed": self.seed}

    @property
    def filters(self) -> dict[str, float]:
        """The keyword arguments of a generation's filters (``top_p``, ``top_k``, ``min_p``)."""
        return {"top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}


def check_sampling(sampling: Sampling) -> None:
    """Refuse what :func:`~hsd_opt.runtime.arguments.check_sampling_flags` refuses (a temperature below 0 or not
    finite, a top-p outside (0, 1], a seed beyond 64 bits, a top-k below 0, a min-p outside [0, 1], a filter at
    temperature 0), in one line."""
    check_sampling_flags(1, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.seed)


def check_seeds(sampling: Sampling, items, turns: str) -> None:
    """Refuse a ``--seed`` whose derived seeds (:meth:`Sampling.seed_for`, every prompt of ``items`` and, with
    ``--turns all``, every turn) leave the 64-bit range: before anything runs, naming the flag."""
    if sampling.greedy or not items:
        return
    last_turn = max(max(len(it.turns), 1) for it in items) - 1 if turns == "all" else 0
    seeds = (sampling.seed_for(min(it.index for it in items), 0),
             sampling.seed_for(max(it.index for it in items), last_turn))
    if not all(seed_fits(s) for s in seeds):
        raise HsdError(f"--seed: the seeds of these prompts (seed + prompt + {SEED_STRIDE} x turn) reach "
                       f"{seeds[1] if seeds[1] > SEED_RANGE[1] else seeds[0]}, beyond a 64-bit integer; give a "
                       f"smaller --seed")


#: The load bench's methods (``hsd bench --concurrency``; :mod:`hsd_opt.measure.load_bench`).
LOAD_METHODS = ("hsd", "hsd_batch1", "hsd_plain")


def parse_concurrency(text: str, flag: str = "--concurrency") -> list[int]:
    """Client counts from ``"1,2,4,8"``: distinct integers >= 1, in the order given. Bad text raises
    :class:`HsdError` naming ``flag``."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            c = int(part)
        except ValueError:
            raise HsdError(f"{flag}: expected client counts like 1,2,4,8, got {part!r}") from None
        if c < 1:
            raise HsdError(f"{flag}: client counts must be >= 1, got {c}")
        if c not in out:
            out.append(c)
    if not out:
        raise HsdError(f"{flag}: expected client counts like 1,2,4,8, got {text!r}")
    return out
