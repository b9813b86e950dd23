"""What a generation's arguments may be, checked without the runtime's imports (torch): the commands refuse a
mistyped flag before anything slow loads, and the runtime checks the same arguments again with the same functions.

Each check raises a one-line :class:`~hsd_opt.errors.HsdError` naming the argument (by the flag's name where the
command line gave it). Units: temperatures and probabilities as floats, counts in tokens, biases and penalties in
logits.
"""

from __future__ import annotations

import json
import math
from typing import Mapping

from hsd_opt.errors import HsdError
from hsd_opt.seeds import seed_fits
from hsd_opt.values import is_finite, is_integer, is_real

#: the names :func:`check_filters` gives each filter by default (its argument's; the CLI passes its flags')
ARGUMENTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}
#: the command-line flags of the generation arguments, the names their errors give (:func:`check_filters`)
FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p"}
#: The most alternatives a generated token's log-probabilities list (``logprobs=k``; the OpenAI API's
#: ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20
#: The API's bounds: penalties in [-2, 2], biases in [-100, 100].
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
#: The repetition penalty's bounds: a factor in [1 / MAX_REPETITION, MAX_REPETITION] (1: none; below 1 favours
#: repeating). A smaller factor would divide a logit out of float32's range (an infinite logit: a token certain
#: on one path, one among equals on another).
MAX_REPETITION = 10.0
MIN_REPETITION = 1 / MAX_REPETITION


def check_filters(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                  names: dict[str, str] = ARGUMENTS) -> None:
    """Refuse a ``temperature`` below 0 or not finite (a negative one reversed the distribution, NaN made it
    greedy), a ``top_p`` outside (0, 1], a ``top_k`` not an integer >= 0 (0: off) or a ``min_p`` outside [0, 1]
    (0: off; above 1 every probability was NaN): a one-line :class:`HsdError` naming the value by ``names``."""
    if not (is_finite(temperature) and temperature >= 0):
        raise HsdError(f"{names['temperature']}: expected a finite value >= 0, got {temperature!r}")
    if not (is_real(top_p) and 0.0 < top_p <= 1.0):
        raise HsdError(f"{names['top_p']}: expected a value in (0, 1], got {top_p!r}")
    if not (is_integer(top_k) and top_k >= 0):
        raise HsdError(f"{names['top_k']}: expected an integer >= 0 (0: off), got {top_k!r}")
    if not (is_real(min_p) and 0.0 <= min_p <= 1.0):
        raise HsdError(f"{names['min_p']}: expected a value in [0, 1] (0: off), got {min_p!r}")


def check_generation_args(max_new_tokens: int, temperature: float, top_p: float, seed: int | None = None) -> None:
    """Refuse ``max_new_tokens`` not an integer >= 1, a ``temperature`` below 0 or not finite, ``top_p`` outside
    (0, 1] or a ``seed`` outside :data:`~hsd_opt.seeds.SEED_RANGE` with a one-line :class:`HsdError` naming the flag
    (the CLI calls this before loading a model; :meth:`~hsd_opt.runtime.decode.HSD.generate` again)."""
    if not is_integer(max_new_tokens):
        raise HsdError(f"--max-new-tokens: expected an integer >= 1, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise HsdError(f"--max-new-tokens: expected >= 1, got {max_new_tokens}")
    check_filters(temperature, top_p, names=FLAGS)
    if seed is not None and not (is_integer(seed) and seed_fits(seed)):
        raise HsdError(f"--seed: expected a 64-bit integer (-2**63 .. 2**64 - 1), got {seed!r}")


def check_sampled_filters(temperature: float, top_p: float, top_k: int, min_p: float) -> None:
    """Refuse a filter (top-p below 1, top-k, min-p) at temperature 0, where decoding is greedy and would ignore it:
    a one-line :class:`HsdError` naming the flag and its value."""
    for flag, value, on in (("--top-p", top_p, top_p < 1.0), ("--top-k", top_k, top_k > 0),
                            ("--min-p", min_p, min_p > 0)):
        if on and temperature == 0:
            raise HsdError(f"{flag} {value:g} needs --temperature > 0 (at temperature 0 decoding is greedy)")


def check_sampling_flags(max_new_tokens: int, temperature: float, top_p: float, top_k: int, min_p: float,
                         seed: int | None = None) -> None:
    """What a command refuses of its generation flags before it loads a model, each in one line naming the flag:
    :func:`check_generation_args`, :func:`check_filters`, and a filter at temperature 0
    (:func:`check_sampled_filters`; a request to the server may send one, and decodes greedy)."""
    check_generation_args(max_new_tokens, temperature, top_p, seed)
    check_filters(top_k=top_k, min_p=min_p, names=FLAGS)
    check_sampled_filters(temperature, top_p, top_k, min_p)


def check_logprobs(logprobs: int | None) -> None:
    """Refuse a number of alternatives to list with each token's log-probability outside 0 ..
    :data:`MAX_TOP_LOGPROBS` with a one-line :class:`HsdError` naming the flag (as :func:`check_generation_args`:
    the CLI calls this before loading a model, a decoding again); None asks for none."""
    if logprobs is not None and not (is_integer(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise HsdError(f"--logprobs: expected a number of alternatives 0 .. {MAX_TOP_LOGPROBS}, got {logprobs!r}")


#: :func:`check_penalties`' default: no biases (never changed)
_NO_BIAS: dict[int, float] = {}


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_penalties(frequency: float = 0.0, presence: float = 0.0, bias: Mapping[int, float] = _NO_BIAS,
                    repetition: float = 1.0, repetition_last: int | None = None) -> None:
    """Refuse what :class:`~hsd_opt.runtime.penalties.Penalties` may not hold: a frequency or presence penalty
    outside [-:data:`MAX_PENALTY`, :data:`MAX_PENALTY`] or not finite, a repetition factor outside
    [:data:`MIN_REPETITION`, :data:`MAX_REPETITION`], a ``repetition_last`` (tokens) not a positive integer, a
    ``bias`` not a dict of token ids >= 0 to numbers in [-:data:`MAX_BIAS`, :data:`MAX_BIAS`]; one line naming the
    API's field."""
    for name, v in (("frequency_penalty", frequency), ("presence_penalty", presence)):
        if not (_is_number(v) and math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
            raise HsdError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
    if not (_is_number(repetition) and math.isfinite(repetition) and MIN_REPETITION <= repetition <= MAX_REPETITION):
        raise HsdError(f"the repetition penalty must be a number in [{MIN_REPETITION:g}, {MAX_REPETITION:g}], "
                       f"got {repetition!r}")
    n = repetition_last
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise HsdError(f"repeat_last_n must be a positive integer, got {n!r}")
    if not isinstance(bias, dict):
        raise HsdError(f"logit_bias: expected a dict of token ids to numbers, got {type(bias).__name__}")
    for t, b in bias.items():
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise HsdError(f"logit_bias: token ids must be non-negative integers, got {t!r}")
        if not (_is_number(b) and -MAX_BIAS <= b <= MAX_BIAS):
            shown = f"an integer of {len(str(b))} digits" if isinstance(b, int) and abs(b) > 1e300 else repr(b)
            raise HsdError(f"logit_bias[{t}] must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {shown}")


def bias_from_json(raw: object, where: str = "logit_bias") -> dict[int, float]:
    """A ``logit_bias`` as JSON holds it (an object from token ids, as strings, to numbers) as ``{id: bias}``; a
    value that is not such an object, or a key that is not a token id, is an :class:`HsdError` naming ``where``
    (the biases' range is :func:`check_penalties`' to check)."""
    if not isinstance(raw, dict):
        raise HsdError(f"{where}: a JSON object from token ids to numbers expected, such as '{{\"28\": -100}}'")
    bias = {}
    for k, v in raw.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 18:     # past 10**18 no vocabulary has the id
            shown = json.dumps(k) if len(k) <= 40 else f"a key of {len(k)} characters"
            raise HsdError(f"{where}: {shown} is not a token id")
        bias[int(k)] = v
    return bias
