"""What ``hsd profile`` takes (:class:`ProfileConfig`) and its checks, without the profiler's imports (torch): the
command refuses a mistyped flag before anything slow loads, and :func:`~hsd_opt.profiler.run.run_profile` checks
the same configuration again."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from hsd_opt.errors import HsdError
from hsd_opt.formats import EXACT_PASS
from hsd_opt.models.loading import check_device_name, check_dtype_name, check_model_name
from hsd_opt.prompts import load_prompts
from hsd_opt.runtime.arguments import check_sampling_flags
from hsd_opt.seeds import check_strided_seed
from hsd_opt.values import is_integer

#: Context lengths (tokens) the costs are measured at unless ``--cost-contexts`` says otherwise.
DEFAULT_CONTEXTS = (64, 512, 2048)
DEFAULT_MAX_NEW_TOKENS = 24
#: ``--cost-budget auto``: seconds the cost phase may take (the most thorough cost plan that fits is used).
DEFAULT_COST_BUDGET = 480.0


@dataclass
class ProfileConfig:
    """Everything ``hsd profile`` takes (see ``hsd profile --help`` for the flags), as typed values: the flag
    strings are parsed by :mod:`hsd_opt.commands.options`."""

    model: str
    out: Path
    prompts: Path | None = None
    layers: Sequence[int] | None = None             # early exits (layer numbers); None: every layer
    draft_models: list[str] = field(default_factory=list)
    draft_layers: Sequence[int] | None = ()         # early exits of each draft model too; None: every layer
    quantized: Sequence[tuple[str | None, str]] | None = None  # (model, kind) copies; None: pool.default_quantized
    token_drafters: list[str] | None = None        # None: the default pool (those whose modules exist)
    token_drafters_left_out: tuple[str, ...] = ()  # names left out of the default pool (token_drafters None)
    heads: Path | None = None
    temperature: float = 0.0
    top_p: float = 1.0                              # nucleus mass applied after the temperature (sampling only)
    top_k: int = 0                                  # sample among the k most probable (0: off; sampling only)
    min_p: float = 0.0                              # among those >= min_p x the most probable (0: off)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    raw: bool = False
    device: str = "auto"
    dtype: str = "auto"                             # the target's and the draft models' (auto | float32 | ...)
    target_precision: str | None = None             # None: dtype's; float32/bfloat16/float16 (the target's dtype,
                                                    # draft models keep dtype); int8/int4: a quantized target
    seed: int = 0
    resume: bool = False
    tmax: int = 15
    cost_repeats: int = 5
    cost_warmup: int = 2
    curve_repeats: int = 2
    cost_contexts: tuple[int, ...] = DEFAULT_CONTEXTS  # tokens in the KV cache the costs are measured at
    batch_sizes: tuple[int, ...] = (1,)            # sequences decoded together to time passes at (batch_costs)
    cost_budget: float | None = DEFAULT_COST_BUDGET  # seconds for the cost phase (None: the full plan)
    shard: tuple[int, int] | None = None            # (k, n): this run does prompts i with i % n == k
    max_prompts: int | None = None
    json_tasks: int = 0                             # the first N shipped JSON-schema tasks join the suite
    chunk: int = 16
    progress: bool = True
    threads: int = 0                                # CPU threads for torch (0: torch's default)
    costs_only: bool = False                        # costs alone, on random weights (run_costs_only)


def check_config(cfg: ProfileConfig) -> None:
    """Refuse, in one line naming the flag, what ``cfg`` may not hold before anything loads: the sampling flags
    (:func:`~hsd_opt.runtime.arguments.check_sampling_flags`), ``--device`` and ``--dtype`` names, the model's and
    the draft models' names, a prompt
    file that cannot be read (:func:`~hsd_opt.prompts.load_prompts`), a seed whose prompts' seeds
    leave 64 bits, a ``tmax`` out of 1 .. :data:`~hsd_opt.formats.EXACT_PASS` - 1, cost contexts that are not
    positive token counts, ADED with a shard."""
    check_sampling_flags(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)
    check_device_name(cfg.device)
    check_dtype_name(cfg.dtype)
    if not cfg.costs_only:           # (a costs-only run also takes a shipped configuration's name)
        check_model_name(cfg.model, "--model")
        for name in cfg.draft_models:
            check_model_name(name, "--draft-model")     # before the target loads (~10 s of it)
    if cfg.prompts is not None:
        load_prompts(cfg.prompts)                       # a file that cannot be read, said before the model loads
    check_strided_seed(cfg.seed, "the prompts")     # prompt i is sampled with seed * SEED_STRIDE + i
    if not (is_integer(cfg.tmax) and 1 <= cfg.tmax < EXACT_PASS):   # a plan's budgets stop there: longer is waste
        raise HsdError(f"--tmax: expected an integer in 1..{EXACT_PASS - 1} (the largest budget a plan may have), "
                       f"got {cfg.tmax!r}")
    bad = [c for c in cfg.cost_contexts if not (is_integer(c) and c >= 1)]
    if bad or not cfg.cost_contexts:
        raise HsdError(f"--cost-contexts: expected context lengths in tokens >= 1, got {list(cfg.cost_contexts)!r}")
    if cfg.shard and cfg.token_drafters is not None and "aded" in cfg.token_drafters:
        raise HsdError("--token-drafters aded: not with --shard (ADED's matrix is built from the continuations of "
                       "every prompt, which a shard does not see: shards would measure different drafters); "
                       "profile it in one run or with torchrun")
