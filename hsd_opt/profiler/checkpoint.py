"""The profiler's checkpoint: after every prompt, the statistics so far go atomically to
``<out>.partial.json`` (per rank under torchrun: ``<out>.partial.rank<r>.json``), so an interrupted run loses
nothing and ``--resume`` continues it. A checkpoint made with other settings is refused, naming the setting."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.jsonio import read_json, remove_stale, write_json
from hsd_opt.profiler.stats import PairStats
from hsd_opt.values import is_integer

PARTIAL_FORMAT = "hsd-profile-partial/1"
#: Settings a checkpoint must share with the run that resumes it.
RESUME_FIELDS = ("model", "revision", "tokenizer_sha256", "heads_sha256", "prompts_sha256", "temperature", "top_p",
                 "top_k", "min_p", "max_new_tokens", "tmax", "raw", "seed", "dtype", "target_precision", "layers",
                 "draft_models", "draft_revisions", "draft_layers", "quantized", "token_drafters", "shard",
                 "max_prompts", "world_size")
#: The value a setting had before it was recorded (files written before ``top_p``, ``top_k`` or ``min_p`` existed
#: sampled without them; before ``tmax`` was recorded, budgets were walked to the default 15; before the draft models'
#: revisions were, a file vouches for none).
SETTING_DEFAULTS = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "draft_layers": [], "tmax": 15, "draft_revisions": []}


#: Settings compared only where both files record them (a file made before one was recorded vouches for nothing).
RECORDED_ONLY = ("tokenizer_sha256",)


def differs(a: dict[str, Any], b: dict[str, Any], name: str) -> bool:
    """Whether two files' settings differ in ``name`` (:func:`setting`; one of :data:`RECORDED_ONLY` only where
    both record it)."""
    x, y = setting(a, name), setting(b, name)
    if name in RECORDED_ONLY and (x is None or y is None):
        return False
    return x != y


def setting(settings: dict[str, Any], name: str) -> Any:
    """``settings[name]``, or its :data:`SETTING_DEFAULTS` value when a file made before it existed lacks it (a
    missing ``target_precision``: the ``dtype``, the only target there was)."""
    if name == "target_precision" and settings.get(name) is None:
        return settings.get("dtype")
    return settings.get(name, SETTING_DEFAULTS.get(name))


def partial_path(out: Path, rank: int, world: int) -> Path:
    """Where the checkpoint of ``out`` goes for this rank."""
    return out.with_name(out.name + (".partial.json" if world == 1 else f".partial.rank{rank}.json"))


@dataclass
class Checkpoint:
    """The resumable state of one rank: the settings, the statistics, the prompts done (indices into the suite)
    and the target's continuations (prompt index as a string -> token ids)."""

    path: Path
    settings: dict[str, Any]
    stats: PairStats
    rank: int = 0
    world: int = 1
    done: list[int] = field(default_factory=list)
    continuations: dict[str, list[int]] = field(default_factory=dict)

    def save(self) -> None:
        write_json(self.path, {"format": PARTIAL_FORMAT, "settings": self.settings, "rank": self.rank,
                               "world_size": self.world, "done": self.done, "continuations": self.continuations,
                               "stats": self.stats.to_dict()}, indent=None)


def open_checkpoint(path: Path, settings: dict[str, Any], stats: PairStats, rank: int, world: int, resume: bool,
                    log: Callable[[str], None], warn: Callable[[str], None], vocab: int | None = None,
                    prompts: Collection[int] | None = None) -> Checkpoint:
    """A fresh checkpoint at ``path``, or with ``resume`` the one found there (its settings must equal
    ``settings`` in every :data:`RESUME_FIELDS`, its rank ``rank``, its contents hold together:
    :func:`check_resumed`; ``vocab``: the target's logits, which bound a continuation's token ids; ``prompts``:
    the indices of this rank's prompts, the only ones it may hold). Without ``resume``, an existing checkpoint is
    refused rather than overwritten."""
    ck = Checkpoint(path, settings, stats, rank, world)
    remove_stale(path.parent.glob(f".{path.name}.*.partial"))     # a save a killed run left half-written
    if resume and path.exists():
        d = read_json(path)
        if not isinstance(d, dict) or d.get("format") != PARTIAL_FORMAT:
            raise InputFileError(str(path), f"not a profiler checkpoint (expected format {PARTIAL_FORMAT!r})",
                                 "format")
        theirs = d.get("settings", {})
        if not isinstance(theirs, dict):
            raise InputFileError(str(path), "a damaged checkpoint (its settings are not an object); delete it to "
                                            "start over", "settings")
        for f in RESUME_FIELDS:
            was, now = setting(theirs, f), setting(settings, f)
            if differs(theirs, settings, f):
                raise InputFileError(str(path), f"this checkpoint was made with {f} = {was!r}, this run has {now!r}; "
                                                f"delete it to start over",
                                     f"settings.{f}")
        if not (is_integer(d.get("rank", rank)) and d.get("rank", rank) == rank):     # (true == 1: refused too)
            raise InputFileError(str(path), f"a damaged checkpoint (rank {d.get('rank')!r}, at the path of rank "
                                            f"{rank}); delete it to start over", "rank")
        field = "stats"
        try:
            ck.stats = PairStats.from_dict(d["stats"])
            field = "done"
            ck.done = _integers(d["done"], path, field)
            field = "continuations"
            ck.continuations = {str(k): _integers(v, path, f"continuations.{k}")
                                for k, v in d["continuations"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputFileError(str(path), f"a damaged checkpoint ({type(e).__name__}: {e}); delete it to start "
                                            f"over", field) from None
        check_resumed(ck, stats, int(settings["max_new_tokens"]), vocab, prompts)
        log(f"resuming from {path}: {len(ck.done)} prompt(s) already profiled")
    elif resume:
        warn(f"--resume: no checkpoint at {path}; starting from the beginning")
    refuse_left_checkpoint(path, resume)
    return ck


def _integers(v: Any, path: Path, field: str) -> list[int]:
    """``v``, a list of integers (prompt indices, token ids), else a damaged checkpoint naming ``field`` (a bool
    or a float was read as an integer)."""
    if not isinstance(v, list) or not all(is_integer(x) for x in v):
        bad = v if not isinstance(v, list) else next(x for x in v if not is_integer(x))
        raise InputFileError(str(path), f"a damaged checkpoint (expected a list of integers, holding {bad!r}); "
                                        f"delete it to start over", field)
    return [int(x) for x in v]


def refuse_left_checkpoint(path: Path, resume: bool) -> None:
    """Refuse, without ``resume``, to start over a checkpoint an interrupted run left at ``path`` (its first save
    would replace it); a run checks it before it loads anything, and again as it opens the checkpoint."""
    if not resume and path.exists():
        raise HsdError(f"{path}: a checkpoint of an interrupted run exists; pass --resume to continue it, or "
                       f"delete it to start over")


def check_resumed(ck: Checkpoint, fresh: PairStats, max_new_tokens: int, vocab: int | None,
                  prompts: Collection[int] | None = None) -> None:
    """Refuse (:class:`InputFileError` naming the field) a checkpoint whose contents do not hold together with the
    run that resumes it: statistics of other drafters or tasks, or in another order (``fresh``: the run's empty
    ones), without a counter the run keeps, a count of prompts that is not the prompts done, a prompt done twice
    or without its continuation, a prompt (done or continued) that is not one of ``prompts`` (this rank's
    indices), a continuation longer than ``max_new_tokens`` or with a token outside ``0 .. vocab - 1``. Any of
    them would be mixed into the profile (sums that are not finite or are negative are refused as the statistics
    are read: :meth:`PairStats.from_dict`)."""

    def bad(what: str, field: str) -> InputFileError:
        return InputFileError(str(ck.path), f"a damaged checkpoint ({what}); delete it to start over", field)

    st = ck.stats
    for name in ("neural", "token", "tasks"):
        if getattr(st, name) != getattr(fresh, name):
            raise bad(f"its {name} are {getattr(st, name)}, this run's {getattr(fresh, name)}", f"stats.{name}")
    lacking = sorted(set(fresh.counters) - set(st.counters))
    if lacking:
        raise bad(f"no counter {lacking[0]!r}", "stats.counters")
    if len(set(ck.done)) != len(ck.done) or st.counters["prompts"] != len(ck.done):
        raise bad(f"{len(ck.done)} prompts done ({len(set(ck.done))} distinct), {st.counters['prompts']:g} counted",
                  "done")
    if prompts is not None:
        mine = set(prompts)
        stray = [i for i in ck.done if i not in mine]
        if stray:
            raise bad(f"prompt {stray[0]} is done, but is not one of this run's {len(mine)} prompts", "done")
        stray_keys = [k for k in ck.continuations if not (k.isdecimal() and str(int(k)) == k and int(k) in mine)]
        if stray_keys:
            raise bad(f"a continuation of {stray_keys[0]!r}, which is not one of this run's {len(mine)} prompts",
                      f"continuations.{stray_keys[0]}")
    missing = [i for i in ck.done if str(i) not in ck.continuations]
    if missing:
        raise bad(f"prompt {missing[0]} done without its continuation", "continuations")
    for k, ids in ck.continuations.items():
        if len(ids) > max_new_tokens:
            raise bad(f"prompt {k}'s continuation has {len(ids)} tokens, more than max_new_tokens "
                      f"{max_new_tokens}", f"continuations.{k}")
        if ids and (min(ids) < 0 or (vocab is not None and max(ids) >= vocab)):
            raise bad(f"prompt {k}'s continuation holds a token outside 0..{vocab - 1 if vocab else 'the vocabulary'}",
                      f"continuations.{k}")
