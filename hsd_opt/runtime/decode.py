"""Hierarchical Speculative Decoding (HSD paper, arXiv 2510.19705, Algorithm 1) with speculative-sampling
verification (its Algorithm 2; Leviathan et al.) at every level, over our layered engine.

A hierarchy is a list of :class:`Level` s, cheapest (bottom) first, target last:

- a **model level** is the exit after ``boundary`` decoder layers of an :class:`~hsd_opt.engine.interface.Engine`
  (the target's own exits all share ONE :class:`~hsd_opt.engine.state.DecodeState`, i.e. one KV cache per
  layer; another model of the same tokenizer has its own engine and state);
- a **token level** is a :class:`~hsd_opt.drafters.base.TokenDrafter` (n-gram, bigram, ADED): bottom only,
  its draft distribution is one-hot.

All levels see one token sequence. Each generation is a :class:`Decoding` (one sequence); every state of it holds
the sequence, and ``_append``/``_crop`` keep them in sync, so a rejection at any level crops every cache back to
the accepted length. A decoding asks for engine passes by yielding them (:class:`Pass`), so that one driver can
run the passes of many sequences together (:mod:`hsd_opt.runtime.batch`). A model level verifying a block calls
``advance(state, boundary)``, which only runs the layers (and positions) not yet computed: an exit at ``b``
verifying drafts of an exit at ``a < b`` of the same model runs layers ``a .. b-1`` on them, nothing twice.

Semantics (``docs/design.md#levels-and-the-recursion``): the bottom level drafts exactly ``T_0`` tokens per call,
autoregressively; an intermediate level ``i`` keeps requesting blocks from below and verifying them until it holds
``>= T_i`` verified tokens, then hands up EXACTLY ``T_i`` (``mode="exact"``; surplus tokens are dropped and caches
cropped) or all of them (``mode="eager"``); the target verifies one block per round. Fewer tokens are handed up only
at EOS or at the ``max_new_tokens`` limit, which every level respects (nothing is produced past EOS or past the
limit).

Greedy (``temperature == 0``): a draft is accepted while it equals the verifier's argmax; then the verifier's
argmax is appended. Sampling: each level's ``p`` is its own processed distribution (temperature, then top-p,
identically at every level); a draft ``x`` with draft distribution ``q`` is accepted with probability
``min(1, p(x)/q(x))``; at the first rejection a token is sampled from ``norm(max(p - q, 0))``, and if every
draft is accepted a bonus token is sampled from ``p``. Each level hands up its tokens together with its own
``p`` rows at those positions (Algorithm 2 line 23), which the level above uses as ``q``.

Units: seconds (wall time). Shapes: logits/probabilities ``[m, V]`` float32.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator, Sequence

import torch

from hsd_opt.drafters.base import TokenDrafter
from hsd_opt.engine.interface import EXACT_PASS, Engine, Picks, Window
from hsd_opt.engine.picks import LogitPicks
from hsd_opt.engine.state import DecodeState
from hsd_opt.errors import ContextFull, HsdError
from hsd_opt.grammar.constraint import Constraint, mask_logits
from hsd_opt.runtime.arguments import FLAGS, check_filters, check_generation_args, check_logprobs
from hsd_opt.runtime.modes import check_mode
from hsd_opt.runtime.penalties import Penalties
from hsd_opt.runtime.sampling import (
    filter_window,
    filtered_probs,
    gumbel_offsets,
    rejection_sample,
    sample_token,
    unfiltered,
)
from hsd_opt.runtime.state_pool import StatePool
from hsd_opt.values import is_integer

#: Prompt positions per pass of a prefill (:meth:`Decoding.prefill_passes`): a longer prompt is computed in
#: passes of this many, between which a batch serves the other sequences' rounds. Long enough that its passes take
#: the torch path's GEMMs on a float model (over ``kernels.MAX_PASS`` positions), short enough that a stream
#: waits for one such pass, not for a whole long prompt.
PREFILL_CHUNK = 256
#: Positions a quantized copy may be behind the engine whose keys and values it takes, at the start of a round,
#: and still compute them itself (a round leaves it at most one behind); further behind, it takes them again
#: (:meth:`Decoding._catch_up_copies`).
ROUND_LAG = 2


def prompt_pass_ends(n: int, head: int = 0, taken: int = 0) -> list[int]:
    """Where the passes of a prompt of ``n`` positions end: the head of ``head`` positions (0: none) in a pass
    of its own, then passes of at most :data:`PREFILL_CHUNK` positions. A function of the prompt alone, so its
    keys and values are the same whoever computes it. ``taken`` > 0: the first ``taken`` positions were taken from
    an earlier sequence (:func:`takable`); the passes left are those ending after them, the first from ``taken``."""
    ends = [head] if 0 < head < n else []
    a = ends[0] if ends else 0
    while a < n:
        a = min(a + PREFILL_CHUNK, n)
        ends.append(a)
    return [e for e in ends if e > taken]


def head_of(eng: Engine, prompt: Sequence[int]) -> int:
    """Positions of ``eng``'s kept chat-template head (:attr:`Engine.prompt_head`) that ``prompt`` starts with: all
    of them, or 0 where it starts otherwise."""
    head = len(eng.prompt_head)
    return head if list(prompt[:head]) == list(eng.prompt_head) else 0


def takable(eng: Engine, n: int, head: int, src: DecodeState, upto: int) -> int:
    """How many of its first ``upto`` positions a prompt of ``n`` positions (starting with a kept head of ``head``,
    0: none) may take from ``src``, which holds the same tokens there, and still get bit for bit the numbers of its
    own passes (:func:`prompt_pass_ends`): the positions of its passes that compute what one-position steps compute
    (:meth:`Engine.stepwise`) where ``src`` computed them so too, and those of its passes off the kernels (a float
    model's long prompt pass on the torch path) where ``src`` was computed by the very same pass
    (:attr:`DecodeState.off_steps`); up to the first position where neither holds. A pass it takes only the first
    positions of is computed as steps compute it, so its rest too (:func:`prompt_pass_ends` with ``taken``)."""
    ends = prompt_pass_ends(n, head)
    taken = 0
    for a, b in zip([0] + ends[:-1], ends):
        if a >= upto:
            break
        if eng.stepwise(a, b - a, n):
            end = min(b, upto)
            first = src.off_steps.first_within(a, end)
            taken = end if first is None else first
            if first is not None or end < b:
                break
        elif b <= upto and src.off_steps.computed_by(a, b):
            taken = b
        else:
            break
    return taken


def follows_load(temperature: float, seed: int | None) -> bool:
    """Whether a sequence decoded with ``temperature`` and ``seed`` may change hierarchy with the load of a batch:
    greedy tokens are the target's under any hierarchy, and an unseeded sample is promised the target's
    distribution only; a seeded sample keeps its hierarchy, so that its seed reproduces it whatever shares its
    passes."""
    return temperature == 0 or seed is None


def check_prompt(prompt_ids: Sequence[int], vocab: int, max_new_tokens: int, max_positions: int | None) -> list[int]:
    """``prompt_ids`` as a list of ints, refused with a one-line :class:`HsdError` when it is text (encode it first),
    empty, holds an id outside ``0 .. vocab - 1``, or leaves no room for ``max_new_tokens`` in ``max_positions`` (the
    model's context; None: unchecked)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise HsdError("the prompt must be token ids, got text: encode it first (hsd_opt.prompts.encode_prompt)")
    if getattr(prompt_ids, "ndim", 1) != 1:                       # a tensor or array of another shape
        raise HsdError(f"the prompt must be one sequence of token ids, got an array of shape "
                       f"{tuple(prompt_ids.shape)} (for a batch of one, pass its row: ids[0])")
    if hasattr(prompt_ids, "tolist"):
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (dict, set, frozenset)):    # no order, or not ids: a dict's keys were taken
        raise HsdError(f"the prompt must be a sequence of token ids, got {type(prompt_ids).__name__}")
    try:
        prompt = list(prompt_ids)
    except TypeError:
        raise HsdError(f"the prompt must be a sequence of token ids, got {type(prompt_ids).__name__}") from None
    i = next((i for i, t in enumerate(prompt) if not is_integer(t)), None)
    if i is not None:
        raise HsdError(f"the prompt must be token ids (integers), got {prompt[i]!r} at position {i}")
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise HsdError("empty prompt: need at least one token")
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise HsdError(f"the prompt holds token id {bad}, outside the model's vocabulary 0 .. {vocab - 1}")
    if max_positions is not None and len(prompt) + max_new_tokens > max_positions:
        raise ContextFull(f"the prompt ({len(prompt)} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the "
                          f"model's context of {max_positions} positions")
    return prompt


@dataclass
class Level:
    """One level of a hierarchy.

    Attributes:
        name: the plan's name for it (``"layer8"``, ``"ngram"``, ``"layer30"``).
        engine: the engine of a model level (None for a token level).
        boundary: number of decoder layers the exit runs (``engine.n_layers`` for the model's own head).
        drafter: a :class:`TokenDrafter` for a token level (None for a model level).
    """

    name: str
    engine: Engine | None = None
    boundary: int = 0
    drafter: TokenDrafter | None = None

    @property
    def is_model(self) -> bool:
        return self.engine is not None


def _check_order(levels: Sequence[Level]) -> None:
    """Refuse a hierarchy in which a level reads a model no deeper than a level below it that reads the same
    model (an exit above a deeper exit, or the target below one of its exits): cheapest first, target last."""
    seen: dict[int, Level] = {}
    for lv in levels:
        if not lv.is_model:
            continue
        below = seen.get(id(lv.engine))
        if below is not None and lv.boundary <= below.boundary:
            raise HsdError(f"{lv.name!r} (layer {lv.boundary}) verifies {below.name!r} (layer {below.boundary}) of the "
                           f"same model: each level must read deeper than those below it (cheapest first, target "
                           f"last)")
        seen[id(lv.engine)] = lv


@dataclass
class LevelStats:
    """Counters of one level. For a verifying level: ``calls`` verify passes, ``drafted`` draft tokens it checked,
    ``accepted`` of those accepted, ``rejections`` rounds ending in a rejection. For the bottom level: ``calls``
    draft calls, ``drafted`` tokens it produced and ``abstained`` calls where it proposed nothing."""

    name: str
    calls: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    abstained: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "calls": self.calls, "drafted": self.drafted, "accepted": self.accepted,
             "rejections": self.rejections}
        if self.abstained:
            d["abstained"] = self.abstained
            d["draft_rate"] = 1.0 - self.abstained / self.calls
        # a = P(accept one draft): accepted / (accepted + rejections) estimates the profile's a (each round is
        # a run of Bernoulli(a) acceptances up to the first rejection); accepted / drafted is the raw fraction.
        tried = self.accepted + self.rejections
        d["acceptance_rate"] = self.accepted / tried if tried else None
        d["accepted_fraction"] = self.accepted / self.drafted if self.drafted and tried else None
        return d


def add_levels(total: list[LevelStats] | None, levels: Sequence[dict[str, Any]]) -> list[LevelStats]:
    """Add one generation's per-level counters (``stats["levels"]``) into ``total`` (a new list when None), level
    by name (a level new to ``total`` after the others), and return it: how ``hsd run`` and ``hsd bench`` report
    several prompts at once."""
    total = total if total is not None else []
    mine = {a.name: a for a in total}
    for b in levels:
        a = mine.get(b["name"])
        if a is None:
            a = mine[b["name"]] = LevelStats(b["name"])
            total.append(a)
        for k in ("calls", "drafted", "accepted", "rejections", "abstained"):
            setattr(a, k, getattr(a, k) + b.get(k, 0))
    return total


def most_likely(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` largest values of ``row`` ``[V]`` as ``(id, value)``, largest first; of equal values the lower ids
    first, and kept where they tie at the ``k``-th place (``torch.topk`` keeps any of them). A NaN ranks as
    ``+inf`` (above every finite number, as ``torch.topk`` ranks it; a row of a broken model still lists ``k``)."""
    k = min(k, row.numel())
    if k <= 0:
        return []
    rank = torch.where(torch.isnan(row), torch.tensor(float("inf"), dtype=row.dtype), row)
    cols = (rank >= rank.topk(k).values[-1]).nonzero().flatten()     # the k largest and whatever ties the k-th
    picked = sorted(zip(cols.tolist(), rank[cols].tolist()), key=lambda c: (-c[1], c[0]))[:k]
    return [(j, float(row[j])) for j, _ in picked]


@dataclass
class TokenLogprob:
    """The target's log-probability of one generated token (natural log, of the target model's own distribution:
    its logits' log-softmax, before temperature, top-p or a grammar's mask) and of its ``top`` most likely tokens
    at that position, ``(id, logprob)`` most likely first (equal ones: the lower id first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class GenerationResult:
    """Output of :func:`HSD.generate`.

    Attributes:
        token_ids: generated ids only (after the prompt), ending at EOS (included) or at ``max_new_tokens``.
        stats: ``tokens``, ``seconds`` (wall, prefill included), ``prefill_seconds`` (in a batch, where the
            prompt's last pass runs with the first round's: to the first token), ``prefill_tokens`` (the prompt
            positions the target computed: all but a template head taken from an earlier prompt), ``decode_seconds``,
            ``tokens_per_s``, ``seconds_per_token`` (decode only, comparable with a plan's
            ``expected_latency``), ``target_calls``, ``tokens_per_target_call``, ``levels`` (list of
            :class:`LevelStats` dicts, bottom first), ``stopped`` (``"eos"`` | ``"max_new_tokens"`` |
            ``"callback"``: ``on_tokens`` asked to stop).
        logprobs: with ``logprobs=k`` asked for, a :class:`TokenLogprob` per generated id (aligned with
            ``token_ids``); else None.
    """

    token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Pass:
    """What a decoding waits for: ``engine`` advances ``state`` to ``boundary``, then reads positions
    ``start .. end-1`` there: their greedy ids (a list of ints) when ``greedy``; with ``picks``, the rows ready
    for draws (:class:`~hsd_opt.engine.interface.Picks`: a sample by the Gumbel-max form, through the head's int8
    screen where it has one); else their logits ``[m, V]``, with a ``window`` only those the sampler's filters may
    keep (the others ``-inf`` or their values: :meth:`~hsd_opt.engine.interface.Engine.window_logits_many`)."""

    engine: Engine
    state: DecodeState
    boundary: int
    start: int
    end: int
    greedy: bool
    picks: bool = False
    window: Window | None = None

    @property
    def read(self) -> tuple[DecodeState, int, int, int]:
        """``(state, boundary, start, end)``: the read the engine's ``*_many`` methods take."""
        return self.state, self.boundary, self.start, self.end


@dataclass
class Committed:
    """The target committed ``tokens`` (a round ended); the decoding is told whether to stop (True) in reply."""

    tokens: list[int]


def serve(p: Pass) -> list[int] | torch.Tensor | Picks:
    """One :class:`Pass` computed alone."""
    p.engine.advance(p.state, p.boundary)
    if p.picks:
        return p.engine.picks_many([p.read])[0]
    if p.greedy:
        return p.engine.greedy_ids(*p.read).tolist()
    if p.window is not None:
        return p.engine.window_logits_many([p.read], [p.window])[0]
    return p.engine.logits(*p.read)


class HSD:
    """One hierarchy: ``HSD(levels, budgets).generate(prompt_ids, max_new_tokens, ...)``.

    It holds the levels and the rules; each generation is a :class:`Decoding` of its own (its caches, token
    drafters' state, random generator and counters), so several can run at once over the same engines
    (:mod:`hsd_opt.runtime.batch`). Decoding states are reused between generations (:attr:`pool`, a :class:`StatePool`).

    Args:
        levels: bottom first, target last (``levels[-1]`` must be a model level). A depth-1 hierarchy is our
            autoregressive loop; depth 2 is single-draft speculative decoding.
        budgets: ``T_0 .. T_{n-2}`` (``len(levels) - 1`` ints >= 1).
        eos_ids: token ids that end a sequence.
        mode: ``"exact"`` (every intermediate level hands up exactly T_i tokens per call) or ``"eager"`` (hands up
            every verified token once it holds at least T_i).
        residual: keep True. False resamples from ``p`` instead of ``norm(max(p - q, 0))`` after a rejection: a
            deliberately wrong sampler, used only to prove that the statistical test catches a wrong rule.
        share_prompt: a drafter that is a copy (a quantized copy) of a model another level runs over its own
            weights (the target, or a draft model) takes that level's keys and values of the prompt instead of
            computing its own prefill (:meth:`~hsd_opt.engine.interface.Engine.share_prompt`). Its drafts change
            slightly, the output does not (drafts are verified). False, or no such level: every model prefills on
            its own.
        pool: where decoding states no sequence holds wait for the next (:class:`StatePool`; hierarchies over the
            same engines may share one); None: one of its own, which keeps one state per engine and takes no
            positions from them.
    """

    def __init__(self, levels: Sequence[Level], budgets: Sequence[int], eos_ids: Sequence[int] = (),
                 mode: str = "exact", residual: bool = True, share_prompt: bool = True,
                 pool: StatePool | None = None, max_positions: int | None = None):
        levels = list(levels)
        for lv in levels:
            if not lv.is_model and lv.drafter is None:
                raise HsdError(f"level {lv.name!r}: neither an engine nor a drafter")
        if not levels or not levels[-1].is_model:
            raise HsdError("a hierarchy needs a model as its last level (the target)")
        _check_order(levels)
        if len(budgets) != len(levels) - 1:
            raise HsdError(f"budgets: expected {len(levels) - 1} values for {len(levels)} levels, got {len(budgets)}")
        for i, t in enumerate(budgets):
            if not is_integer(t) or t < 1:
                raise HsdError(f"budgets[{i}]: expected an integer >= 1, got {t!r}")
        for lv in levels[1:]:
            if not lv.is_model:
                raise HsdError(f"{lv.name!r} cannot verify: a token drafter may only be the bottom level")
        width = levels[-1].engine.vocab_size
        for lv in levels[:-1]:
            if lv.is_model and lv.engine.vocab_size != width:
                raise HsdError(f"level {lv.name!r}: its head has {lv.engine.vocab_size} rows, the target's {width}; "
                               f"a level of another width is not supported (its distributions would not line up; "
                               f"hsd_opt.models.loading.match_width gives a loaded draft model the target's)")
        check_mode(mode)
        # exact: a level verifies at most the budget below it; eager: what every level below hands up at most
        longest = (max(budgets, default=0) if mode == "exact" else sum(int(t) for t in budgets)) + 1
        if longest > EXACT_PASS:
            raise HsdError(f"budgets {list(budgets)} ({mode}): a verification over {longest} positions; at most "
                           f"{EXACT_PASS} are computed exactly as the target's steps (a budget of at most "
                           f"{EXACT_PASS - 1}{', in all' if mode == 'eager' else ''})")
        self.levels = levels
        #: the most positions a verification pass computes (drafts and the position before them)
        self.longest = longest
        self.budgets = [int(t) for t in budgets] or [1]
        self.eos = frozenset(int(e) for e in eos_ids or ())
        self.mode = mode
        self.residual = residual  # False only in tests: a deliberately wrong sampler (resample from p)
        self.share_prompt = share_prompt
        #: the distinct engines, in level order (exits of one model share one), and the boundaries each is read at
        self.engines: list[Engine] = []
        for lv in levels:
            if lv.is_model and all(lv.engine is not m for m in self.engines):
                self.engines.append(lv.engine)
        self.bounds = {id(e): sorted({lv.boundary for lv in levels if lv.engine is e}) for e in self.engines}
        self.pool = pool if pool is not None else StatePool()
        #: the model's context in positions (prompt + generated tokens at most; None: unchecked)
        self.max_positions = max_positions

    @property
    def target(self) -> Engine:
        return self.levels[-1].engine

    @property
    def pool(self) -> StatePool:
        """Where decoding states no sequence holds wait for the next (a :class:`StatePool`; set one that reuses
        for prompts to take the keys and values of earlier ones)."""
        return self._pool

    @pool.setter
    def pool(self, pool: StatePool) -> None:
        if not isinstance(pool, StatePool):
            raise HsdError(f"pool: a StatePool, not {type(pool).__name__}")
        self._pool = pool

    def take_state(self, eng: Engine, max_len: int, bounds: Sequence[int],
                   prompt: Sequence[int] | None = None) -> DecodeState:
        """A decoding state of ``eng`` with room for ``max_len`` tokens keeping ``bounds`` (:meth:`StatePool.take`).
        With ``prompt`` (and a pool that reuses), the state may hold the first positions of the prompt already,
        computed by an earlier sequence (``st.n`` of them; :meth:`_usable`), else it holds nothing."""
        top = max(bounds, default=0)
        usable = None if prompt is None else (lambda st: self._usable(eng, st, prompt, top))
        return self.pool.take(eng, max_len, bounds, usable)

    @staticmethod
    def _usable(eng: Engine, st: DecodeState, prompt: Sequence[int], top: int) -> int:
        """Positions of the state ``st`` a prompt may take: of the tokens it starts with that ``st`` has computed up
        to every layer (no later pass then reads a residual stream they lack; ``top``, the layer the prompt is
        computed to, must be the last), those :func:`takable` gives, all but the prompt's last, and more than a
        kept head gives; else 0. Only on an engine whose steps run on the kernels (elsewhere the numbers of a pass
        may depend on more than its positions and tokens)."""
        n = len(prompt)
        if top < eng.n_layers or n < 2 or not eng.stepwise(n, 1, n):
            return 0
        m = min(min(st.lens), st.n, n - 1)
        if m <= 0:
            return 0
        differ = (st.tokens[:m].cpu() != torch.tensor(prompt[:m], dtype=torch.long)).nonzero()
        r = int(differ[0, 0]) if differ.numel() else m
        head = head_of(eng, prompt)
        r = takable(eng, n, head, st, r)
        return r if r > head else 0

    def give_state(self, eng: Engine, st: DecodeState) -> None:
        """Return a state to the pool."""
        self.pool.give(eng, st)

    def start(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
              seed: int | None = 0, constraint: Constraint | None = None,
              logprobs: int | None = None, penalties: Penalties | None = None, top_k: int = 0,
              min_p: float = 0.0) -> "Decoding":
        """A new :class:`Decoding` of ``prompt_ids`` by this hierarchy (nothing computed yet); ``seed`` None: a
        random one, and a batch may switch the sequence's hierarchy with the load (:attr:`Decoding.follows_load`);
        ``constraint``: the grammar its output follows (every level's logits masked), None: none; ``logprobs``:
        the number of alternatives (0 .. :data:`~hsd_opt.runtime.arguments.MAX_TOP_LOGPROBS`) each generated token's
        :class:`TokenLogprob` lists, None: no log-probabilities; ``penalties``: frequency and presence penalties
        and logit biases every level's logits take (:mod:`hsd_opt.runtime.penalties`), None: none; ``top_k``,
        ``min_p``: sampling's top-k and min-p filters (0: off; :func:`~hsd_opt.runtime.sampling.process_logits`)."""
        return Decoding(self, prompt_ids, max_new_tokens, temperature, top_p, seed, constraint, logprobs, penalties,
                        top_k, min_p)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0,
                 on_tokens: Callable[[list[int]], bool | None] | None = None,
                 constraint: Constraint | None = None, logprobs: int | None = None,
                 penalties: Penalties | None = None, top_k: int = 0, min_p: float = 0.0) -> GenerationResult:
        """Generate up to ``max_new_tokens`` ids after ``prompt_ids`` (stops after EOS).

        ``on_tokens(ids)`` is called with each block of tokens the target commits (for streaming); when it
        returns True the generation ends after that block (a stop string was seen, the client went away) and the
        result holds every committed token, with ``stats["stopped"] == "callback"``. Each call starts afresh:
        its own caches, token drafters and random generator, so nothing of an earlier (or abandoned) generation
        carries over. ``logprobs=k``: the result's :attr:`GenerationResult.logprobs` (the target's passes then read
        every logit, greedy too; the tokens are the same).
        """
        d = self.start(prompt_ids, max_new_tokens, temperature, top_p, seed, constraint, logprobs, penalties, top_k,
                       min_p)
        try:
            return d.run(on_tokens)
        finally:
            d.close()


def _uniform_where_empty(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits [m, V]`` (masked) with each row that holds no finite logit set to 0 at its ``allowed [m, V]``
    tokens: a drafter that cannot propose any token the grammar allows (a reduced-vocabulary head, ``-inf``
    outside its vocabulary) proposes one of them uniformly, a proper draft distribution, so verification keeps
    the target's output (greedy: the first allowed token). Its argmax was token 0, refused by the grammar; its
    distribution had no mass to sample from."""
    empty = torch.isneginf(logits).all(dim=-1)
    if not bool(empty.any()):
        return logits
    fill = torch.zeros((), dtype=logits.dtype, device=logits.device)
    return torch.where(empty[:, None] & allowed, fill, logits)


class Decoding:
    """One sequence decoded by a hierarchy: its tokens, a decoding state per engine, its token drafters (forked from
    the hierarchy's), its random generator and its counters.

    :meth:`prefill` computes the prompt; :meth:`steps` is the rest of the generation as a generator that yields a
    :class:`Pass` whenever it needs an engine (and is sent its result) and a :class:`Committed` after every round
    (and is sent whether to stop). Whoever drives it decides when passes run and with which other sequences':
    :meth:`HSD.generate` runs each alone, :mod:`hsd_opt.runtime.batch` runs those of many decodings together. The
    tokens do not depend on the driver: every pass computes, for this sequence, what it computes alone.
    :meth:`switch` makes the next round use another hierarchy over the same target (caches of engines new to the
    sequence are filled when first used); :meth:`result` and :meth:`close` end it.
    """

    def __init__(self, hsd: HSD, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = 0, constraint: Constraint | None = None,
                 logprobs: int | None = None, penalties: Penalties | None = None, top_k: int = 0,
                 min_p: float = 0.0):
        check_generation_args(max_new_tokens, temperature, top_p, seed)
        prompt = check_prompt(prompt_ids, hsd.target.vocab_size, max_new_tokens, hsd.max_positions)
        check_filters(top_k=top_k, min_p=min_p, names=FLAGS)
        check_logprobs(logprobs)
        for name, value, kind in (("constraint", constraint, Constraint), ("penalties", penalties, Penalties)):
            if value is not None and not isinstance(value, kind):
                raise HsdError(f"{name}: expected None or a {kind.__module__}.{kind.__name__}, got "
                               f"{type(value).__name__}")
        #: sampling's top-k and min-p filters (0: off; a top-k of the whole vocabulary or more filters nothing, and is
        #: off: the same draws as 0, by noise where nothing else filters)
        self.top_k = 0 if top_k >= hsd.target.vocab_size else int(top_k)
        self.min_p = float(min_p)
        #: alternatives per generated token's log-probabilities (None: none are computed)
        self.n_logprobs = logprobs
        #: a :class:`TokenLogprob` per generated token so far (with ``logprobs``), aligned with ``seq[n_prompt:]``
        self.logprobs: list[TokenLogprob] = []
        self._rows: torch.Tensor | None = None  # the target's log-softmax rows of its last pass (with logprobs)
        self.hsd = hsd
        self.greedy = temperature == 0
        #: whether a batch may switch this sequence's hierarchy with the load (:meth:`switch`)
        self.follows_load = follows_load(temperature, seed)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.device = hsd.target.device
        seed = secrets.randbelow(2**31) if seed is None else seed
        self.gen = torch.Generator(device=self.device).manual_seed(int(seed))
        self.prompt = prompt
        self.n_prompt = len(prompt)
        self.limit = len(prompt) + int(max_new_tokens)
        #: the grammar the output follows (None: none): every level reads the masked model
        self.constraint = constraint
        #: the penalties and biases every level's logits take (None: none; :mod:`hsd_opt.runtime.penalties`)
        self.penalties = penalties if penalties is not None and penalties.active else None
        if self.penalties is not None:
            self.penalties.check_vocab(hsd.target.vocab_size)
        self._bases: dict[int, torch.Tensor] = {}    # logits' width -> the biases as a row
        self.seq: list[int] = []
        self._engines: dict[int, tuple[Engine, HSD]] = {}      # id(engine) -> (engine, the hierarchy it came from)
        self._states: dict[int, DecodeState] = {}
        self._drafters: dict[str, TokenDrafter] = {}
        self.stats: dict[str, LevelStats] = {}
        self._next: HSD | None = None
        self._asked_stop = False
        self.done = False
        self._closed = False            # close() gave the states back: nothing more runs
        #: the prompt's last pass left to the first round's (prefill_passes(defer_last=True))
        self._deferred = False
        #: prompt positions whose keys and values the target took from an earlier prompt (its template's head, or
        #: the positions a free state of the pool holds: :meth:`HSD.take_state`)
        self.prompt_reused = 0
        self._add(hsd)
        self.t0 = self.t1 = self.t2 = time.perf_counter()

    # ------------------------------------------------------------------------------------------ sequence

    def _add(self, hsd: HSD) -> None:
        """Take on ``hsd``'s engines, drafters and counters (the union of every hierarchy the sequence used)."""
        for eng in hsd.engines:
            self._engines.setdefault(id(eng), (eng, hsd))
        for lv in hsd.levels:
            self.stats.setdefault(lv.name, LevelStats(lv.name))
            if lv.drafter is not None and lv.name not in self._drafters:
                d = lv.drafter.fork()
                d.reset(self.prompt)
                if len(self.seq) > self.n_prompt:
                    d.observe(self.seq[:self.n_prompt], self.seq[self.n_prompt:])
                self._drafters[lv.name] = d

    def _state(self, eng: Engine) -> DecodeState:
        """This sequence's state of ``eng``, made on first use with every token so far appended."""
        st = self._states.get(id(eng))
        if st is None:
            bounds = self._bounds(eng)
            st = self.hsd.take_state(eng, self.limit + max(self.hsd.budgets) + 2, bounds,
                                     None if self.seq else self.prompt)
            st.prompt = self.n_prompt
            if self.seq:
                self._fill(eng, st, max(bounds))
            self._states[id(eng)] = st
        return st

    def _bounds(self, eng: Engine) -> list[int]:
        """The layer boundaries ``eng`` is read at by any hierarchy this sequence has used (and the current one)."""
        return sorted({b for e, h in self._engines.values() if e is eng for b in h.bounds[id(eng)]}
                      | set(self.hsd.bounds.get(id(eng), ())))

    def _fill(self, eng: Engine, st: DecodeState, top: int) -> None:
        """Append every token so far to ``st`` (empty): a copy with a source (:meth:`_share_source`) takes that
        engine's keys and values of the positions it has computed, the rest computed when first used."""
        ids = torch.tensor(self.seq, dtype=torch.long, device=eng.device)
        src = self._share_source(eng, top)
        if src is None:
            eng.append(st, ids)
        else:
            other, src_st, done = src
            eng.append(st, ids[:done + 1])
            eng.share_prompt(st, other, src_st, top)
            eng.append(st, ids[done + 1:])

    def _catch_up_copies(self) -> None:
        """A copy of the hierarchy that fell behind (the sequence ran hierarchies without it for a while) takes
        its source's keys and values again, as at a prefill, instead of computing every position it missed: its
        state is emptied and filled anew (:meth:`_fill`), when it is more than :data:`ROUND_LAG` positions behind
        (a round leaves it at most one behind)."""
        for eng in self.hsd.engines:
            st = self._states.get(id(eng))
            if st is None or not eng.is_copy:
                continue
            top = max(self._bounds(eng))
            src = self._share_source(eng, top)
            if src is not None and src[2] - min(st.lens[:top]) > ROUND_LAG:
                eng.crop(st, 0)
                self._fill(eng, st, top)

    def _sources(self, eng: Engine, share_prompt: bool) -> Generator[tuple[Engine, DecodeState], None, None]:
        """The engines this sequence holds whose keys and values ``eng`` can take (a copy of their model, with
        ``share_prompt`` on), with their states."""
        if not (share_prompt and eng.is_copy):
            return
        for key, src in self._states.items():
            other = self._engines[key][0]
            if other is not eng and eng.can_share_prompt(other):
                yield other, src

    def _share_source(self, eng: Engine, top: int) -> tuple[Engine, DecodeState, int] | None:
        """For a copy taken on after the prompt (a switch of hierarchy): the engine over its model's own weights
        whose keys and values it takes, as at a prefill (:meth:`prefill`), instead of computing them all, with
        that engine's state and the positions it has computed in layers ``0 .. top-1`` (its drafts change
        slightly, the output does not); None when there is none."""
        for other, src in self._sources(eng, self.hsd.share_prompt):
            done = min(src.lens[:top])
            if done >= 1:
                return other, src, done
        return None

    def _append(self, toks: list[int]) -> None:
        if not toks:
            return
        self.seq.extend(toks)
        ids = torch.tensor(toks, dtype=torch.long, device=self.device)
        for key, st in self._states.items():
            eng = self._engines[key][0]
            eng.append(st, ids if eng.device == ids.device else ids.to(eng.device))

    def _crop(self, n: int) -> None:
        if n < len(self.seq):
            del self.seq[n:]
            for key, st in self._states.items():
                self._engines[key][0].crop(st, n)

    def _cut_short(self) -> bool:
        """A round drafts no further once a :meth:`switch` waits: each level verifies the drafts it has and hands
        its tokens up at once. Verification takes any number of drafts (greedy: the tokens stay the target's;
        sampled: the number is chosen without looking at the drafts, so each token keeps its level's
        distribution). Under a batch whose load rose, the round started for fewer sequences then ends in the next
        target pass the others share, instead of drafting on alone (a draft pass of one sequence is served only
        every few ticks while the others step)."""
        return self._next is not None

    def _ended(self) -> bool:
        return len(self.seq) >= self.limit or (len(self.seq) > self.n_prompt and self.seq[-1] in self.hsd.eos)

    def _cut_eos(self, toks: list[int]) -> list[int]:
        for i, t in enumerate(toks):
            if t in self.hsd.eos:
                return toks[: i + 1]
        return toks

    # ------------------------------------------------------------------------------------------ levels

    def _pass(self, k: int, start: int, end: int, greedy: bool, keep: bool = True,
              window: Window | None = None) -> Generator[Pass, object, object]:
        """Level k's pass over positions start..end-1: greedy ids, or logits ``[m, V]`` (with a ``window``, those
        outside it possibly ``-inf``). With log-probabilities asked for, a pass of the target reads its logits,
        greedy too (the ids their argmax: the first maximum, as ``greedy_ids``), and with ``keep`` their
        log-softmax rows are kept for :meth:`_record`."""
        lv = self.hsd.levels[k]
        rows = self._reads_rows(k)
        got = yield Pass(lv.engine, self._state(lv.engine), lv.boundary, start, end, greedy and not rows,
                         window=None if rows else window)
        if not rows:
            return got
        if keep:
            self._rows = torch.log_softmax(got.float(), dim=-1)
        return got.argmax(dim=-1).tolist() if greedy else got

    def _reads_rows(self, k: int) -> bool:
        """Whether level ``k``'s passes read every logit of their rows: the target's, with log-probabilities."""
        return self.n_logprobs is not None and k == len(self.hsd.levels) - 1

    def _record(self, n: int) -> None:
        """The log-probabilities of the ``n`` tokens the target just committed, from the rows of its last pass
        (row i: the token after its position i); nothing without ``logprobs``."""
        if self.n_logprobs is None or n <= 0:
            return
        rows = self._rows[:n].cpu()
        toks = self.seq[len(self.seq) - n:]
        for i, t in enumerate(toks):
            self.logprobs.append(TokenLogprob(int(t), float(rows[i, t]), most_likely(rows[i], self.n_logprobs)))

    def _dist(self, k: int, start: int, end: int
              ) -> Generator[Pass, object, tuple[torch.Tensor, torch.Tensor | None]]:
        """Level k's processed probabilities (sampling) at positions start..end-1: [m, V]; of its logits moved by
        the penalties and masked by the grammar first (:meth:`_moved`), then temperature and the filters. With a
        :meth:`_window` the pass reads only the logits the filters may keep, and the filters run over the columns
        some row holds (ties at top-k's ``k``-th place broken among them). With them the support: the columns
        outside which every row is 0 (int64, ascending), None for every column."""
        rows = self._offset_rows(k, start, end) if self.penalties is not None else None
        window = None if self._reads_rows(k) else self._window(k, start, end, rows)   # it reads every logit
        got = yield from self._pass(k, start, end, False, window=window)
        logits = self._moved(k, got if window is None else got.logits, start, end, rows,
                             window.pinned if window is not None and window.pinned else None)
        # every logit read without a window, or where the screen stepped aside for one (cols None)
        return filtered_probs(logits, None if window is None else got.cols, self.temperature, self.top_p,
                              self.top_k, self.min_p)

    def _window(self, k: int, start: int, end: int, rows: torch.Tensor | None) -> Window | None:
        """The logits the filters may keep at level k's positions start..end-1 (:class:`Window`; ``rows``: the
        penalties' offsets there, :meth:`_offset_rows`, or None without penalties), or None where
        they need every logit: top-k keeps the ``k`` largest of the moved logits; min-p those within ``T ln(1 /
        min_p)`` of the largest (``p >= min_p * max p``), both with top-p 1 (top-p after top-k needs all ``k``;
        without top-k, the whole distribution's mass); a repetition penalty's tokens pinned (their offsets depend on
        their logits, which the engine computes first). Not under a grammar (its mask moves the largest), nor on an
        engine without a cheap way to them (:attr:`~hsd_opt.engine.interface.Engine.picks_cheaply`)."""
        vocab = self.hsd.levels[k].engine.vocab_size
        window = filter_window(self.temperature, self.top_p, self.top_k, self.min_p, vocab)
        if window is None or self.constraint is not None or not self.hsd.levels[k].engine.picks_cheaply:
            return None
        if self.penalties is None:
            return window
        if not self.penalties.repeats:
            return replace(window, offsets=rows)
        pinned = tuple(self._repeated(vocab, p) for p in range(start, end))
        return replace(window, offsets=rows, pinned=pinned, reoffset=self.penalties.repetition_offsets)

    def _moved(self, k: int, logits: torch.Tensor, start: int, end: int, rows: torch.Tensor | None = None,
               repeated: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Level k's ``logits`` ``[m, V]`` at positions start..end-1 as this decoding's target reads them: moved by
        the penalties (:meth:`_offset_rows`, or ``rows`` where the caller made them, left as they are; with the
        repetition penalty's from these logits: :meth:`_repeat`, at each row's ``repeated`` ids where the caller
        has them, a window's ``pinned``), then masked by the grammar. A drafter's row that the grammar leaves
        empty (a reduced-vocabulary head where only tokens outside its vocabulary are allowed) drafts from the
        allowed tokens, uniformly (:func:`_uniform_where_empty`)."""
        if self.penalties is not None:
            rows = self._offset_rows(k, start, end) if rows is None else rows.clone()
            read = LogitPicks(logits)
            for i in range(end - start):
                self._repeat(rows[i], start + i, lambda ids, i=i: read.values(i, ids),
                             repeated[i] if repeated is not None else None)
            logits = logits + rows.to(logits.device)
        if self.constraint is not None:
            allowed = self._allowed_rows(start, end).to(logits.device)
            logits = mask_logits(logits, allowed)
            if k < len(self.hsd.levels) - 1:
                logits = _uniform_where_empty(logits, allowed)
        return logits

    def _offset_rows(self, k: int, start: int, end: int) -> torch.Tensor:
        """The penalties' offsets of level k's rows at positions ``start .. end-1`` (row ``p``: the token at ``p +
        1``, the tokens generated up to ``p`` counted; :meth:`Penalties.rows`): ``[end - start, V]``, on the CPU."""
        vocab = self.hsd.levels[k].engine.vocab_size
        base = self._bases.get(vocab)
        if base is None:
            base = self._bases[vocab] = self.penalties.base(vocab)
        n = 1 - self.n_prompt
        return self.penalties.rows(self.seq[self.n_prompt:], start + n, end + n, vocab, base)

    def _offsets(self, k: int, p: int, picks: Picks, i: int) -> torch.Tensor:
        """The offsets of level k's row at position ``p`` (row ``i`` of ``picks``): ``[V]``, :meth:`_offset_rows`'
        row with the repetition penalty's (:meth:`_repeat`) from the row's logits at the repeated tokens."""
        row = self._offset_rows(k, p, p + 1)[0]
        self._repeat(row, p, lambda ids: picks.values(i, ids))
        return row

    def _repeat(self, row: torch.Tensor, p: int, values: Callable[[torch.Tensor], torch.Tensor],
                ids: torch.Tensor | None = None) -> None:
        """Add to the offsets ``row`` ``[V]`` of the row at position ``p`` the repetition penalty's ``r(l) - l`` at
        the tokens it repeats (``ids``, or :meth:`_repeated` where None; ``values(ids)``: the row's logits there,
        float32 on the CPU; a token a window left out, ``-inf``, keeps its offset); nothing without the penalty."""
        if not self.penalties.repeats:
            return
        if ids is None:
            ids = self._repeated(row.numel(), p)
        if ids.numel():
            v = values(ids)
            held = torch.isfinite(v)
            row[ids[held]] += self.penalties.repetition_offsets(v[held]).to(row.device)

    def _repeated(self, vocab: int, p: int) -> torch.Tensor:
        """The tokens the repetition penalty moves at the row at position ``p``
        (:meth:`~hsd_opt.runtime.penalties.Penalties.repeated` of ``seq[:p + 1]``), those of a level's ``vocab``
        (a level whose logits are narrower than the tokenizer): int64 ids."""
        ids = self.penalties.repeated(self.seq[:p + 1])
        return ids[ids < vocab]

    def _greedy_rows(self, k: int, start: int, end: int) -> Generator[Pass, object, Callable[[int], int]]:
        """Level k's greedy token of row ``i`` (position ``start + i``) as a function of ``i``, after its pass over
        positions start..end-1: the ids of ``greedy_ids``; with penalties ``argmax(logits + offsets)`` of the row
        (:meth:`_offsets`), computed when first asked, through the engine's picks (or over the logits the target reads
        for its log-probabilities). The grammar is not applied here."""
        if self.penalties is None:
            ids = yield from self._pass(k, start, end, True)
            return ids.__getitem__
        picks = yield from self._picks(k, start, end)
        done: dict[int, int] = {}

        def row(i: int) -> int:
            if i not in done:
                done[i] = picks.pick(i, self._offsets(k, start + i, picks, i))
            return done[i]

        return row

    def _greedy(self, k: int, start: int, end: int) -> Generator[Pass, object, list[int]]:
        """Level k's greedy tokens at positions start..end-1 (the argmax of its logits, from ``greedy_ids``,
        which need not compute every logit). Under a grammar, the argmax of the masked logits: a row whose argmax
        the grammar allows keeps it (the first maximum is the first allowed maximum too); the others are read
        again alone (:meth:`_masked_row`)."""
        row = yield from self._greedy_rows(k, start, end)
        ids = [row(i) for i in range(end - start)]
        if self.constraint is None:
            return ids
        gen = self.seq[self.n_prompt:]
        for i, t in enumerate(ids):
            if not self.constraint.allows(gen, start + 1 + i - self.n_prompt, t):
                ids[i] = yield from self._masked_row(k, start + i)
        return ids

    def _lag(self, lv: Level) -> int:
        """Positions of the sequence that model level ``lv``'s engine has not computed up to its boundary: its
        next pass computes them with the positions it reads."""
        return len(self.seq) - self._state(lv.engine).lens[lv.boundary - 1]

    def _forced(self, n: int, lv: Level | None = None) -> list[int]:
        """The next tokens (at most ``n``) where the grammar allows one token only: every level's masked
        distribution is one-hot there, so the bottom level takes them without drafting (a token drafter is not
        asked, a model level runs no pass: its next pass computes those positions with the next, the same
        numbers). For a model level ``lv``, only while its next pass stays within :data:`EXACT_PASS` positions.
        None of them without a grammar."""
        if self.constraint is None:
            return []
        room = n if lv is None else min(n, EXACT_PASS - 1 - self._lag(lv))
        gen = self.seq[self.n_prompt:]
        out: list[int] = []
        while len(out) < room and len(self.seq) + len(out) < self.limit:
            t = self.constraint.only(gen + out, len(gen) + len(out))
            if t is None:
                break
            out.append(t)
        return out

    def _forced_block(self, k: int, s: int, drafts: list[int]) -> bool:
        """Whether every draft (at positions ``s ..``) is the one token the grammar allows there, so that level
        ``k`` (below the top) takes them without its pass: its masked distribution is one-hot at each. Only while
        its next pass stays within :data:`EXACT_PASS` positions (it will compute these with the next drafts)."""
        if self.constraint is None:
            return False
        if self._lag(self.hsd.levels[k]) + self.hsd.longest > EXACT_PASS:
            return False
        gen = self.seq[self.n_prompt:]
        return all(self.constraint.only(gen, s + i - self.n_prompt) == t for i, t in enumerate(drafts))

    def _one_hot(self, tokens: list[int], vocab: int) -> torch.Tensor:
        """Rows ``[len(tokens), vocab]`` of one-hot distributions on ``tokens`` (float32)."""
        return torch.nn.functional.one_hot(torch.tensor(tokens, device=self.device), vocab).float()

    def _verify_greedy(self, k: int, s: int, drafts: list[int]) -> Generator[Pass, object, tuple[int, int]]:
        """Level k's greedy check of ``drafts`` (at positions ``s ..``): ``(accepted, the level's token after
        them)``. Under a grammar a row's token is its masked argmax, needed only up to the first mismatch: a row
        whose argmax equals the draft keeps it (the draft is allowed), and a row whose argmax the grammar refuses
        is read again alone (:meth:`_masked_row`), so a long block reads no logits past its rejection."""
        d = len(drafts)
        g = yield from self._greedy_rows(k, s - 1, s + d)  # g(i): the level's argmax at position s + i
        j = 0
        while True:
            while j < d and drafts[j] == g(j):
                j += 1
            if self.constraint is None:
                return j, g(j)  # j <= d: row d is the bonus token's
            t = g(j)
            if not self.constraint.allows(self.seq[self.n_prompt:], s + j - self.n_prompt, t):
                t = yield from self._masked_row(k, s - 1 + j)
            if j < d and t == drafts[j]:
                j += 1
                continue
            return j, t

    def _masked_row(self, k: int, p: int) -> Generator[Pass, object, int]:
        """Level k's masked argmax at position ``p`` (the token at ``p + 1``): the one token the grammar allows
        there, else read from the logits of that row alone (nothing advanced)."""
        gen = self.seq[self.n_prompt:]
        only = self.constraint.only(gen, p + 1 - self.n_prompt)
        if only is not None:
            return only
        logits = yield from self._pass(k, p, p + 1, False, keep=False)
        return int(self._moved(k, logits, p, p + 1).argmax(dim=-1)[0])

    def _allowed_rows(self, start: int, end: int) -> torch.Tensor:
        """The grammar's allowed tokens at the positions a pass reads (``start .. end-1``, each row the token
        after it): ``bool [end - start, V]``. Drafts past ``self.seq`` are not needed: a pass reads positions of
        tokens already appended."""
        gen = self.seq[self.n_prompt:]
        return torch.stack([self.constraint.allowed(gen, p + 1 - self.n_prompt) for p in range(start, end)])

    def _sample(self, p: torch.Tensor, support: torch.Tensor | None = None) -> int:
        return sample_token(p, self.gen, support)

    def _draws_by_picks(self, k: int) -> bool:
        """Whether level ``k`` draws its tokens by the Gumbel-max form (:meth:`_draw`) rather than from its
        processed distribution: the top level (its distribution rows are wanted by no level above), sampling
        without top-p, top-k, min-p or a grammar, on an engine that reads less than every logit for it
        (:attr:`~hsd_opt.engine.interface.Engine.picks_cheaply`). Either way a draw from the same distribution;
        log-probabilities do not change which (:meth:`_picks` then reads every logit), so a seed draws the same
        tokens with them as without."""
        return (k == len(self.hsd.levels) - 1 and unfiltered(self.temperature, self.top_p, self.top_k, self.min_p)
                and self.constraint is None and self.hsd.levels[k].engine.picks_cheaply)

    def _picks(self, k: int, start: int, end: int) -> Generator[Pass, object, Picks]:
        """Level k's rows at positions start..end-1 ready for draws (a pass with ``picks``; with
        log-probabilities, the pass that reads every logit, its rows kept for :meth:`_record`)."""
        if self._reads_rows(k):
            return LogitPicks((yield from self._pass(k, start, end, False)))
        lv = self.hsd.levels[k]
        return (yield Pass(lv.engine, self._state(lv.engine), lv.boundary, start, end, False, picks=True))

    def _draw(self, picks: Picks, i: int, k: int, p: int) -> int:
        """A draw from row ``i``'s ``softmax(logits / T)`` (level ``k``'s row at position ``p``): the largest of its
        logits plus :func:`~hsd_opt.runtime.sampling.gumbel_offsets` from this decoding's generator (plus the
        penalties' offsets, which move the logits the draw is from)."""
        noise = gumbel_offsets(self.hsd.target.vocab_size, self.gen, self.temperature, self.device)
        if self.penalties is not None:
            noise = noise + self._offsets(k, p, picks, i).to(noise.device)
        return picks.pick(i, noise)

    def _verify_picks(self, k: int, s: int, drafts: list[int]) -> Generator[Pass, object, tuple[int, int]]:
        """Algorithm 2 on one-hot ``drafts`` (a token drafter's, at positions ``s ..``) by draws: row ``i``'s draw
        ``y`` from level k's distribution accepts draft ``i`` when it is that draft (probability ``p(x)``, as
        ``min(1, p(x) / 1)``) and is otherwise the correction (``y`` given ``y != x``: the residual ``max(0, p - q)``
        renormalised); after ``d`` acceptances row ``d``'s draw is the bonus token. Rows past the first rejection
        are not drawn. With the deliberately wrong sampler (``HSD.residual`` False) the correction is drawn again
        from ``p``. Returns (accepted count, the corrected or bonus token)."""
        d = len(drafts)
        picks = yield from self._picks(k, s - 1, s + d)  # row i: the token at position s + i
        for i, x in enumerate(drafts):
            t = self._draw(picks, i, k, s - 1 + i)
            if t != x:
                return i, (t if self.hsd.residual else self._draw(picks, i, k, s - 1 + i))
        return d, self._draw(picks, d, k, s - 1 + d)

    def _draft(self) -> Generator[Pass, object, tuple[list[int], torch.Tensor | None]]:
        """Bottom level: exactly min(T_0, room) tokens autoregressively (fewer at EOS, or from a token drafter
        that may abstain: none at all when it does); returns (ids, q rows)."""
        hsd = self.hsd
        lv, st_stats = hsd.levels[0], self.stats[hsd.levels[0].name]
        n = min(hsd.budgets[0] if len(hsd.levels) > 1 else 1, self.limit - len(self.seq))
        st_stats.calls += 1
        if not lv.is_model:
            drafter = self._drafters[lv.name]
            forced = self._forced(n)
            if forced:                           # the grammar's own tokens: the drafter is not asked
                self._append(forced)
                st_stats.drafted += len(forced)
                return forced, None
            n_seq, last = len(self.seq), self.seq[-1]
            toks = self._cut_eos([int(t) for t in drafter.propose(self.seq, n)][:n])
            if len(self.seq) != n_seq or self.seq[-1] != last:    # it is the sequence itself, not a copy
                raise HsdError(f"drafter {lv.name!r} changed the context it was given (TokenDrafter.propose only "
                               f"reads it): the output would no longer be the target's")
            bad = next((t for t in toks if not 0 <= t < hsd.target.vocab_size), None)
            if bad is not None:
                raise HsdError(f"drafter {lv.name!r} proposed token id {bad}, outside the target's vocabulary 0 .. "
                               f"{hsd.target.vocab_size - 1} (a table or matrix made for another model?)")
            short = len(toks) != n and (not toks or toks[-1] not in hsd.eos)
            if short and not drafter.may_abstain:
                raise HsdError(f"drafter {lv.name!r} returned {len(toks)} tokens, expected {n}")
            if self.constraint is not None:      # up to the first token the grammar refuses
                m = len(self.seq) - self.n_prompt
                toks = toks[:self.constraint.allowed_prefix(self.seq[self.n_prompt:], m, toks)]
            st_stats.abstained += not toks
            self._append(toks)
            st_stats.drafted += len(toks)
            return toks, None
        toks: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(n):
            if self._cut_short():
                break
            m = len(self.seq)
            # the target drafting alone (depth 1) reads every position's logits for their log-probabilities
            forced = self._forced(1, lv) if self.n_logprobs is None or len(hsd.levels) > 1 else []
            if forced:                           # one token allowed: this level's draw, without its pass
                t = forced[0]
                if not self.greedy:
                    rows.append(self._one_hot([t], lv.engine.vocab_size))
            elif self.greedy:
                t = (yield from self._greedy(0, m - 1, m))[0]
            elif self._draws_by_picks(0):       # the target alone (level 0 is the top): no rows wanted
                t = self._draw((yield from self._picks(0, m - 1, m)), 0, 0, m - 1)
            else:
                d, support = yield from self._dist(0, m - 1, m)
                # a token the grammar forces (the pass ran anyway: logprobs, or one too long to defer) is taken
                # without a draw, as where no pass ran, so the seed's later draws stay those of that run
                only = self._forced(1)
                t = only[0] if only else self._sample(d[0], support)
                rows.append(d)
            toks.append(t)
            self._append([t])
            if len(hsd.levels) == 1:
                self._record(1)
            if t in hsd.eos:
                break
        st_stats.drafted += len(toks)
        return toks, (torch.cat(rows) if rows else None)

    def _level(self, k: int) -> Generator[Pass, object, tuple[list[int], torch.Tensor | None]]:
        """Algorithm 1 at level k >= 1: returns the tokens it hands up (already appended to the sequence) and its
        own distribution rows at them (sampling) — T_k tokens for an intermediate level, one round at the top."""
        if k == 0:
            return (yield from self._draft())
        hsd = self.hsd
        top = k == len(hsd.levels) - 1
        budget = None if top else hsd.budgets[k]
        n0 = len(self.seq)
        out: list[int] = []
        out_p: list[torch.Tensor] = []
        stats = self.stats[hsd.levels[k].name]
        while not self._ended():
            if not top and self._cut_short():
                break
            s = len(self.seq)  # first draft position
            drafts, q = yield from self._level(k - 1)
            d = len(drafts)
            if d == 0 and self._ended():
                break
            if not top and d and self._forced_block(k, s, drafts):
                out.extend(drafts)          # one-hot at every one of them: this level takes them without a pass
                if not self.greedy:
                    out_p.append(self._one_hot(drafts, hsd.levels[k].engine.vocab_size))
                if budget is not None and len(out) >= budget:
                    break
                continue
            # d == 0 without the end: the drafter below abstained, and this pass is a plain step of level k
            stats.calls += 1
            stats.drafted += d
            p = None
            if self.greedy:
                j, fix = yield from self._verify_greedy(k, s, drafts)
            elif q is None and self._draws_by_picks(k):     # one-hot drafts under the top
                j, fix = yield from self._verify_picks(k, s, drafts)
            else:
                # rows i = distribution of the token at position s + i
                p, support = yield from self._dist(k, s - 1, s + d)
                j, fix = self._verify(p, q, drafts, support)
            stats.accepted += j
            if j < d:
                stats.rejections += 1
                self._crop(s + j)
            new = drafts[:j]
            if not (j == d > 0 and drafts[-1] in hsd.eos) and s + j < self.limit:
                new = new + [fix]
                self._append([fix])
            if top:
                self._record(len(new))
            out.extend(new)
            if p is not None:
                out_p.append(p[: len(new)])
            if top or (budget is not None and len(out) >= budget):
                break
        if budget is not None and hsd.mode == "exact" and len(out) > budget:
            out = out[:budget]
            self._crop(n0 + budget)
        if self.greedy or not out_p:
            return out, None
        probs = torch.cat(out_p)
        return out, probs[: len(out)]

    def _verify(self, p: torch.Tensor, q: torch.Tensor | None, drafts: list[int],
                support: torch.Tensor | None = None) -> tuple[int, int]:
        """Algorithm 2 on the drafts (:func:`~hsd_opt.runtime.sampling.rejection_sample` with this decoding's
        generator; ``support``: the columns outside which ``p`` is 0, None: every column)."""
        return rejection_sample(p, q, drafts, self.gen, residual=self.hsd.residual, support=support)

    # ------------------------------------------------------------------------------------------ public

    def switch(self, hsd: HSD) -> None:
        """Run the next rounds with ``hsd`` (a hierarchy over the same target; greedy tokens stay the target's, a
        sample keeps its distribution). Applied at the next round; a round under way drafts no further
        (:meth:`_cut_short`). Only for a sequence that :attr:`follows_load`."""
        if not self.follows_load:
            raise HsdError("switch: a seeded sample keeps its hierarchy (its seed reproduces it)")
        if not isinstance(hsd, HSD):
            raise HsdError(f"switch: expected an HSD (a hierarchy), got {type(hsd).__name__}")
        if hsd.target is not self.hsd.target:
            raise HsdError("switch: another hierarchy over the same target engine expected")
        self._next = hsd if hsd is not self.hsd else None

    def can_switch(self, hsd: HSD) -> bool:
        """Whether :meth:`switch` to ``hsd`` costs no more than a prefill on it would: every engine of ``hsd`` is
        held already or is a copy that takes the keys and values of one held (:meth:`_share_source`: it computes
        one position, not every position so far). A draft model of its own weights not held yet would compute
        them all."""
        return all(id(eng) in self._states or any(self._sources(eng, hsd.share_prompt)) for eng in hsd.engines)

    def prefill(self) -> None:
        """Compute the prompt, all of it (:meth:`prefill_passes` run to the end)."""
        for _ in self.prefill_passes():
            pass

    def prefill_passes(self, defer_last: bool = False) -> Generator[int, None, None]:
        """Compute the prompt in passes (:func:`prompt_pass_ends`), yielding after every pass but the last (the
        number of prompt positions the target has computed) so that a batch can serve other sequences' rounds in
        between: every model up to its highest level, the target first, then the engines over a model's own
        weights; a copy of a model one of them runs (a quantized drafter of the target or of a draft model) takes
        that engine's keys and values and computes the last position. The target always computes its own. A
        prompt that starts with an engine's :attr:`~hsd_opt.engine.layered.LayeredLM.prompt_head` (and is longer)
        computes the head in a pass of its own, or takes the keys and values the engine kept of that pass for an
        earlier prompt (the same numbers; no pass, no yield). The passes depend on the prompt alone, so a prompt's
        keys and values are the same whoever drives them (``hsd run`` or a batch). A state the pool gives holding
        the prompt's first positions already (:meth:`HSD.take_state`: an earlier sequence's, e.g. a conversation's
        previous turn) computes only the rest, where every pass computes what steps compute, so the numbers are
        still the prompt's own (:func:`takable`). A :meth:`switch` asked for
        before applies first (the prompt is computed for the hierarchy of the first round).

        ``defer_last``: where the target is the hierarchy's only engine (its drafters are exits of it or token
        drafters), the prompt's last pass is left to the first round's pass, which reads the target at the
        prompt's last position and so first advances it over the positions not computed yet: a batch computes
        those positions in its call for the other sequences' rounds (:meth:`Engine.advance_many`; the same numbers
        as alone). The prefill's seconds (:meth:`result`) then run to the first token."""
        self._check_open("prefill")
        if self.seq:
            raise HsdError("prefill: the prompt is computed already (a Decoding prefills once)")
        self.t0 = time.perf_counter()
        if self._next is not None:              # a switch asked for before the first round: prefill its engines
            self.hsd, self._next = self._next, None
            self._add(self.hsd)
        hsd = self.hsd
        for eng in hsd.engines:
            self._state(eng)
        self.seq.extend(self.prompt)            # appended to each engine's state below, a pass at a time
        target = hsd.target
        rest = [e for e in hsd.engines if e is not target]
        order = [target] + [e for e in rest if not e.is_copy] + [e for e in rest if e.is_copy]
        done: list[Engine] = []
        n = self.n_prompt
        for eng in order:
            st = self._states[id(eng)]
            ids = torch.tensor(self.prompt, dtype=torch.long, device=eng.device)
            top_b = max(hsd.bounds[id(eng)])
            src = next((o for o in done if hsd.share_prompt and eng is not target and eng.can_share_prompt(o)
                        and self._states[id(o)].lens[top_b - 1] >= n), None)
            if src is not None:
                eng.crop(st, 0)
                st.prompt = n
                eng.append(st, ids)
                eng.share_prompt(st, src, self._states[id(src)], top_b)
                eng.advance(st, top_b)
            else:
                head = head_of(eng, self.prompt)
                a = held = st.n                 # positions of the prompt the state holds already (take_state)
                if held and eng is target:
                    self.prompt_reused = held
                for b in prompt_pass_ends(n, head, held):
                    eng.append(st, ids[a:b])
                    taken = b == head and eng.take_head(st, top_b)
                    if taken and eng is target:
                        self.prompt_reused = head
                    if defer_last and b == n and eng is target and not rest:
                        self._deferred = True       # computed by the first round's pass
                    elif not taken:
                        eng.advance(st, top_b)
                        if b == head:
                            eng.keep_head(st, top_b)
                    if b < n and not taken:
                        yield b if eng is target else n
                    a = b
            done.append(eng)
        for eng in order:                       # later prompts may copy this one's positions while it decodes
            self._engines[id(eng)][1].pool.lend(eng, self._states[id(eng)])
        _sync(self.device)
        self.t1 = time.perf_counter()

    def run(self, on_tokens: Callable[[list[int]], bool | None] | None = None,
            on_pass: Callable[["Pass"], None] | None = None) -> GenerationResult:
        """Prefill and decode to the end with every pass served alone (:meth:`HSD.generate`'s loop); returns
        :meth:`result`. ``on_tokens`` as in :meth:`HSD.generate`; ``on_pass(p)`` hears each pass before it is
        served (a driver may :meth:`switch` the hierarchy there, as a batch does between rounds)."""
        for name, fn in (("on_tokens", on_tokens), ("on_pass", on_pass)):
            if fn is not None and not callable(fn):
                raise HsdError(f"{name}: expected None or a function, got {type(fn).__name__}")
        self.prefill()
        steps = self.steps()
        reply: object = None
        while True:
            try:
                req = steps.send(reply)
            except StopIteration:
                break
            if isinstance(req, Pass):
                if on_pass is not None:
                    on_pass(req)
                reply = serve(req)
            else:
                reply = on_tokens(req.tokens) is True if on_tokens is not None else False
        return self.result()

    def steps(self) -> Generator[Pass | Committed, object, None]:
        """The generation after :meth:`prefill`, round by round (see the class doc). The first token is the
        target's own, from the prompt's last position the prefill computed (its head only), committed before the
        first round of drafts: the first token of a request waits for no drafting (the others' passes included,
        under load)."""
        self._check_open("steps")
        if not self.seq:
            raise HsdError("steps: the prompt is not computed: call prefill() first")
        first = True
        while not self._ended() and not self._asked_stop:
            if self._next is not None:
                self.hsd, self._next = self._next, None
                self._add(self.hsd)
                self._catch_up_copies()
            before = len(self.seq)
            depth = len(self.hsd.levels)
            if first and depth > 1:
                toks = yield from self._first_token()
            else:
                toks, _ = yield from (self._draft() if depth == 1 else self._level(depth - 1))
            first = False
            if self._deferred:                  # the prompt's last pass ran with the first round's
                _sync(self.device)
                self.t1 = time.perf_counter()
                self._deferred = False
            if not toks:
                break
            for drafter in self._drafters.values():
                drafter.observe(self.seq[:before], toks)
            self._asked_stop = (yield Committed(toks)) is True
        _sync(self.device)
        self.t2 = time.perf_counter()
        self.done = True

    def _first_token(self) -> Generator[Pass, object, list[int]]:
        """The target's token after the prompt (greedy: its argmax; sampled: a draw from its distribution), a
        round of its own; returns it (appended)."""
        k = len(self.hsd.levels) - 1
        m = len(self.seq)
        if self.greedy:
            t = (yield from self._greedy(k, m - 1, m))[0]
        elif self._draws_by_picks(k):
            t = self._draw((yield from self._picks(k, m - 1, m)), 0, k, m - 1)
        else:
            p, support = yield from self._dist(k, m - 1, m)
            t = self._sample(p[0], support)
        self.stats[self.hsd.levels[k].name].calls += 1
        self._append([t])
        self._record(1)
        return [t]

    def result(self) -> GenerationResult:
        """The generated ids and the statistics (see :class:`GenerationResult`)."""
        out = self.seq[self.n_prompt:]
        n = len(out)
        hsd = self.hsd
        depth = len(hsd.levels)
        target_calls = self.stats[hsd.levels[-1].name].calls if depth > 1 else self.stats[hsd.levels[0].name].calls
        t0, t1, t2 = self.t0, self.t1, self.t2
        stats = {
            "tokens": n, "seconds": t2 - t0, "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1,
            "prefill_tokens": self.n_prompt - self.prompt_reused,
            "tokens_per_s": n / (t2 - t0) if t2 > t0 else None,
            "seconds_per_token": (t2 - t1) / n if n else None,
            "target_calls": target_calls, "tokens_per_target_call": n / target_calls if target_calls else None,
            "hierarchy": [lv.name for lv in hsd.levels], "budgets": list(hsd.budgets[: depth - 1]),
            "mode": hsd.mode, "levels": [self.stats[name].to_dict() for name in self._level_order()],
            "stopped": ("eos" if out and out[-1] in hsd.eos else "callback" if self._asked_stop
                        else "max_new_tokens"),
        }
        return GenerationResult(out, stats, list(self.logprobs) if self.n_logprobs is not None else None)

    def _level_order(self) -> list[str]:
        """The names of the levels counted: the last hierarchy's, bottom first, then those of hierarchies it ran
        before (a sequence that follows the load), in the order it took them on."""
        names = [lv.name for lv in self.hsd.levels]
        return names + [n for n in self.stats if n not in names]

    def close(self) -> None:
        """Give the decoding states back to the hierarchies' pools (again: nothing); the decoding runs no more."""
        for key, st in self._states.items():
            eng, hsd = self._engines[key]
            hsd.give_state(eng, st)
        self._states = {}
        self._closed = True

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise HsdError(f"{what}: the decoding is closed (its states are given back)")


def _sync(device) -> None:
    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)
