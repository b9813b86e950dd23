"""Flag strings of the commands -> the typed values the lower layers take.

Every parser here refuses a malformed value with a one-line :class:`~hsd_opt.errors.HsdError` naming its flag, before
any model is loaded. What the values mean (which layers a model has, which quantized copies exist, what the default
pool is) is the lower layers' business: these functions only read the syntax and check names against the tables
the engine keeps (:data:`~hsd_opt.engine.precisions.QUANT_KINDS`, :data:`~hsd_opt.engine.precisions.COPY_KINDS`,
:data:`~hsd_opt.engine.precisions.TARGET_PRECISIONS`). They import nothing heavy at module level.
"""

from __future__ import annotations

import re

from hsd_opt.errors import HsdError

#: The most torch threads ``--threads`` asks for (torch takes a C int; no machine has more cores).
MAX_THREADS = 4096


def layer_numbers(spec: str, flag: str = "--layers") -> list[int] | None:
    """The layer numbers a ``--layers`` value names, unsorted and unchecked against the model: ``None`` for
    ``"all"``/``"*"`` (every layer), ``[]`` for ``"none"``, else the listed numbers and ranges (``"4,8,14"``,
    ``"2-6"``). The syntax alone, so a malformed value is refused before any model is loaded (the range is checked
    once the model is: :func:`hsd_opt.profiler.pool.exit_boundaries`, :func:`hsd_opt.heads.train.head_layers`).
    Raises :class:`HsdError` naming ``flag``."""
    if spec.strip().lower() in ("all", "*"):
        return None
    if spec.strip().lower() == "none":
        return []
    if not spec.replace(",", "").strip():
        raise HsdError(f"{flag}: empty; expected 'all', 'none' or layer numbers like 4,8,14 or 2-6")
    out: list[int] = []
    for part in spec.split(","):
        a, dash, b = part.strip().partition("-")
        if not part.strip():
            continue
        if not a.strip().isdigit() or (dash and not b.strip().isdigit()):
            raise HsdError(f"{flag}: expected 'all', 'none' or layer numbers like 4,8,14 or 2-6, "
                           f"got {part.strip()!r}")
        if dash and int(b) < int(a):
            raise HsdError(f"{flag}: the range {part.strip()!r} runs backwards (write it low-high)")
        out.extend(range(int(a), int(b) + 1) if dash else [int(a)])
    return out


def quant_spec(name: str) -> tuple[int, int]:
    """``"int8"`` -> (8, 0); ``"int4"`` -> (4, 32): (bits, group size) of a
    :data:`~hsd_opt.engine.precisions.QUANT_KINDS` name (case and spaces ignored). Anything else raises
    :class:`HsdError` naming ``--quantized``."""
    from hsd_opt.engine.precisions import QUANT_KINDS

    s = str(name).strip().lower()
    if s in QUANT_KINDS:
        return QUANT_KINDS[s]
    raise HsdError(f"--quantized: expected {' or '.join(QUANT_KINDS)} (or 'none'), got {name!r}")


def copy_spec(name: str) -> tuple[int, int, int]:
    """A ``--quantized`` kind as (bits, group size, LM head bits): ``"int4"`` -> (4, 32, 8), ``"int4-head4"`` ->
    (4, 32, 4) (:data:`~hsd_opt.engine.precisions.COPY_KINDS`). Anything else raises :class:`HsdError` naming
    ``--quantized``."""
    from hsd_opt.engine.precisions import COPY_KINDS

    s = str(name).strip().lower()
    if s in COPY_KINDS:
        return COPY_KINDS[s]
    raise HsdError(f"--quantized: expected {', '.join(COPY_KINDS)} (or 'none'), got {name!r}")


def quantized_copies(spec: str | None) -> list[tuple[str | None, str]] | None:
    """The ``--quantized`` flag as ``(model, kind)`` pairs: ``int8``/``int4``/``int4-head4``
    (:data:`~hsd_opt.engine.precisions.COPY_KINDS`, lower-cased) are copies of the target (``model`` None),
    ``MODEL:int4`` a copy of the draft model ``MODEL`` (an alias, id or path as ``--draft-model`` takes it; the kind
    follows the last colon). ``None`` (flag not given) -> None: the profiler's default
    (:func:`hsd_opt.profiler.pool.default_quantized`); ``"none"`` -> []. Repeats are dropped; a bad kind or an
    empty model raises :class:`HsdError` naming ``--quantized``."""
    from hsd_opt.engine.precisions import COPY_KINDS

    if spec is None:
        return None
    if spec.strip().lower() in ("", "none"):
        return []
    out: list[tuple[str | None, str]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        model, colon, kind = part.rpartition(":")
        if colon and not model.strip():
            raise HsdError(f"--quantized: expected {', '.join(COPY_KINDS)} or MODEL:KIND (e.g. MODEL:int4), "
                           f"got {part!r}")
        copy_spec(kind)
        item = (model.strip() or None, kind.strip().lower())
        if item not in out:
            out.append(item)
    return out


#: ``--dtype`` spellings of each float precision besides its own name.
_DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def resolve_target_precision(precision: str | None, dtype: str | None) -> tuple[str | None, str | None]:
    """``(load dtype, precision)`` for ``--target-precision`` and ``--dtype``: a float precision is the dtype the
    model is loaded in (a different explicit ``--dtype`` is refused); ``int8``/``int4`` load the model in
    ``dtype`` (auto: float32 on a CPU) and quantize it. ``precision`` None or ``"auto"``: the loaded dtype
    (returned as None, to be read off the loaded model). The precision returned is one of
    :data:`~hsd_opt.engine.precisions.TARGET_PRECISIONS` or None. :class:`HsdError` names the flag on bad input."""
    from hsd_opt.engine.precisions import QUANT_KINDS, TARGET_PRECISIONS

    p = (precision or "auto").strip().lower()
    d = None if dtype in (None, "", "auto") else dtype
    if p == "auto":
        return d or "auto", None
    if p not in TARGET_PRECISIONS:
        raise HsdError(f"--target-precision: expected auto or {', '.join(TARGET_PRECISIONS)}, got {precision!r}")
    if p in QUANT_KINDS:
        return d or "auto", p
    if d is not None and d.lower() not in (p, _DTYPE_SHORT[p]):
        raise HsdError(f"--target-precision {p} and --dtype {dtype} disagree: give one of them")
    return p, p


def _positive_ints(spec: str, flag: str, what: str) -> set[int]:
    """The comma-separated integers >= 1 of ``spec``; :class:`HsdError` naming ``flag`` and ``what`` they are
    otherwise."""
    out = set()
    for p in spec.split(","):
        try:
            v = int(p)
        except ValueError:
            v = 0
        if v < 1:
            raise HsdError(f"{flag}: expected {what} (integers >= 1, comma-separated), got {spec!r}")
        out.add(v)
    return out


def cost_contexts(spec: str) -> list[int]:
    """``--cost-contexts``: ``"64,512,2048"`` -> sorted distinct context lengths in tokens, each >= 1;
    :class:`HsdError` naming ``--cost-contexts`` otherwise."""
    return sorted(_positive_ints(spec, "--cost-contexts", "context lengths in tokens, e.g. 64,512,2048"))


def batch_sizes(spec: str, flag: str = "--batch-sizes") -> list[int]:
    """``--batch-sizes``: ``"1,2,4,8"`` -> sorted distinct numbers of sequences decoded together, each >= 1, 1
    always among them; :class:`HsdError` naming ``flag`` otherwise."""
    return sorted(_positive_ints(spec, flag, "numbers of sequences, e.g. 1,2,4,8") | {1})


def shard(spec: str | None) -> tuple[int, int] | None:
    """``--shard K/N`` -> ``(K, N)`` with ``0 <= K < N``; None (not given or empty) for no sharding."""
    if not spec:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m or not int(m.group(2)) >= 1 or not int(m.group(1)) < int(m.group(2)):
        raise HsdError(f"--shard: expected K/N with 0 <= K < N (e.g. 0/4), got {spec!r}")
    return int(m.group(1)), int(m.group(2))
