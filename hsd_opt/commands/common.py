"""What the commands share: turning :class:`~hsd_opt.errors.HsdError` into one line and exit code 2, table cells,
loading a plan with its model (`hsd run`, `hsd bench`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

import typer

from hsd_opt.console import error, warn
from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.packages import need

if TYPE_CHECKING:
    from hsd_opt.formats import Profile

F = TypeVar("F", bound=Callable)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` to stderr and return the Exit to raise (exit code 2 for usage errors)."""
    error(message)
    return typer.Exit(code)


def cli_command(fn: F) -> F:
    """Wrap a command so :class:`HsdError` becomes one line on stderr and exit code 2, never a traceback; the
    environment's on/off settings are checked first (:func:`~hsd_opt.values.check_env_switches`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from hsd_opt.values import check_env_switches

        try:
            check_env_switches()
            return fn(*args, **kwargs)
        except HsdError as e:
            raise fail(str(e)) from None

    return wrapper  # type: ignore[return-value]


def check_outputs(*flags: tuple[str, Optional[Path]],
                  inputs: Sequence[tuple[str, Optional[Path]]] = ()) -> None:
    """Refuse, before any work, each ``(flag, path)`` output a command could not write (see
    :func:`hsd_opt.jsonio.check_writable`), and one that is the same file as another output or as one of the
    ``inputs`` (``(flag, path)``: files the command reads, which writing it would destroy), or one of the model's
    own files inside an input that is a folder (a local model's); paths that are None are not asked for."""
    from hsd_opt.jsonio import check_writable

    seen = [(flag, Path(path).resolve()) for flag, path in inputs if path is not None]
    folders = [(flag, there) for flag, there in seen if there.is_dir()]
    for flag, path in flags:
        if path is None:
            continue
        check_writable(path, flag)
        here = Path(path).resolve()
        other = next((f for f, there in seen if there == here), None)
        if other is not None:
            raise HsdError(f"{flag} {path}: the same file as {other}; write it elsewhere (it would overwrite "
                           f"what {other} holds)")
        inside = next((f for f, there in folders if there in here.parents), None) if _model_file(here) else None
        if inside is not None:
            raise HsdError(f"{flag} {path}: a file of the model in the folder of {inside} (its weights, "
                           f"configuration or tokenizer); write it elsewhere")
        seen.append((flag, here))


#: What a model folder's own files are named like: weights, configuration, tokenizer, chat template.
_MODEL_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".model", ".jinja", ".tiktoken")
_MODEL_NAMES = ("config.json", "generation_config.json", "special_tokens_map.json", "added_tokens.json",
                "vocab.json", "merges.txt", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def _model_file(path: Path) -> bool:
    """Whether ``path`` exists and is named as a model folder's own files are (:data:`_MODEL_NAMES`,
    :data:`_MODEL_SUFFIXES`, ``tokenizer*``): an output beside them (a profile, a report) is not one."""
    name = path.name.lower()
    return path.exists() and (name in _MODEL_NAMES or name.startswith("tokenizer") or name.endswith(_MODEL_SUFFIXES))


def local_model(flag: str, model: Optional[str]) -> list[tuple[str, Path]]:
    """``[(flag, path)]`` where ``model`` names a file or folder here (a GGUF file, a model folder: an input
    :func:`check_outputs` keeps outputs off), else ``[]`` (an alias, a hub id, None)."""
    return [(flag, Path(model))] if model and Path(model).exists() else []


def fmt(x, spec: str = ".3g") -> str:
    """``x`` formatted with ``spec``, or ``-`` for None (table cells)."""
    return "-" if x is None else format(x, spec)


def level_acceptance(d: dict) -> str:
    """Acceptance of each verifying level, bottom up (``"0.62 / 0.91"``), from a report's ``levels``."""
    levels = d.get("levels") or []
    return "/".join(fmt(lv.get("acceptance_rate"), ".2f") for lv in levels[1:]) or "-"


#: The help of ``--target-precision`` on ``hsd run``, ``hsd bench`` and ``hsd serve``.
TARGET_PRECISION_HELP = ("The target the plan must have been made for: float32, bfloat16, float16, int8 or int4 "
                         "(refused otherwise). Default: the plan's provenance.target_precision.")


def read_plan(plan_path: Path, target_precision: Optional[str] = None):
    """The plan at ``plan_path``, refused (one line naming the flag, or the file and its field) where this runtime
    cannot run it: a bad ``--target-precision``, a plan made for another target precision, a level of a kind no
    engine or drafter builds. Without torch's import: a command calls it before anything slow loads."""
    from hsd_opt.commands.options import resolve_target_precision
    from hsd_opt.formats import load_plan
    from hsd_opt.runtime.plan_checks import check_kinds, check_target_precision

    _, asked = resolve_target_precision(target_precision, None)
    plan = load_plan(str(plan_path))
    check_target_precision(plan, str(plan_path), asked)
    check_kinds(plan, str(plan_path))
    return plan


def plan_model(plan, plan_path: Path, model: Optional[str] = None) -> tuple[str, str]:
    """``(the model to load, what its errors name)``: ``model`` (``--model``) or the plan's
    ``provenance.model``, its name checked (:func:`~hsd_opt.models.loading.check_model_name`: an alias, hub id,
    ``.gguf`` file or a path that exists) without torch's import."""
    from hsd_opt.errors import InputFileError
    from hsd_opt.models.loading import check_model_name

    if model is not None and not model.strip():
        raise HsdError("--model: an empty name; name the plan's model, or leave the flag out (the plan's "
                       "provenance.model)")
    name = model or plan.provenance.model
    flag = "--model" if model else f"{plan_path}: provenance.model"     # errors name where the model came from
    if not name:
        raise InputFileError(str(plan_path), "the plan names no model (provenance.model); give --model",
                             "provenance.model")
    check_model_name(name, flag)          # (load_model checks it again, after torch's import)
    return name, flag


def check_load(plan_path: Path, model: Optional[str], device: str, dtype: Optional[str],
               target_precision: Optional[str] = None, retime: Optional[Path] = None):
    """What :func:`load_plan_and_model` refuses without torch's import, before anything slow loads:
    ``--device`` and ``--dtype`` that name nothing (:func:`~hsd_opt.models.loading.check_device_name`,
    :func:`~hsd_opt.models.loading.check_dtype_name`), the plan (:func:`read_plan`), its model's name
    (:func:`plan_model`) and a ``--retime`` profile that cannot be read (:func:`read_retime_profile`; its fit to
    the plan is checked with the runtime). Returns ``(plan, model name, what its errors name)``."""
    from hsd_opt.models.loading import check_device_name, check_dtype_name

    check_device_name(device)
    check_dtype_name(dtype)
    plan = read_plan(plan_path, target_precision)
    read_retime_profile(retime, say_warnings=False)      # (read again, and its warnings said, by the command)
    return (plan, *plan_model(plan, plan_path, model))


def load_plan_and_model(plan_path: Path, model: Optional[str], device: str, dtype: Optional[str],
                        target_precision: Optional[str] = None, engines_only: bool = False,
                        check_plan: Optional[Callable[[Any], None]] = None,
                        outputs: Sequence[tuple[str, Optional[Path]]] = ()):
    """Load the plan and the model it names (or ``model``, which must match the plan's provenance); refuse a
    plan made for another target precision than ``target_precision`` (None: the plan's own). ``engines_only``:
    the model serves the engines alone (`hsd run`, `hsd serve`; see
    :func:`~hsd_opt.models.loading.load_model`). ``check_plan(plan)``: a command's own check of the plan, run
    before the model loads. ``outputs`` (``(flag, path)``) are refused where they are the local model's file or
    inside its folder (:func:`check_outputs`)."""
    from hsd_opt.errors import InputFileError
    from hsd_opt.models.loading import DTYPE_NAMES, load_model

    plan, name, flag = check_load(plan_path, model, device, dtype, target_precision)
    if check_plan is not None:
        check_plan(plan)
    check_outputs(*outputs, inputs=local_model(flag, name))
    if not dtype and plan.provenance.dtype and plan.provenance.dtype.lower() not in DTYPE_NAMES:
        raise InputFileError(str(plan_path), f"expected one of {', '.join(sorted(DTYPE_NAMES))}, got "
                                             f"{plan.provenance.dtype!r}", "provenance.dtype")
    loaded = load_model(name, device=device, dtype=dtype or plan.provenance.dtype or "auto",
                        engines_only=engines_only, flag=flag)
    from hsd_opt.runtime.runner import check_provenance  # (torch, loaded with the model by now)

    check_provenance(plan, loaded, str(plan_path), target_precision)   # (read_plan checked the flag's value)
    prepare_kernels(loaded.device)
    warn_machine(plan, loaded.device)
    return plan, loaded


def warn_machine(plan, device: str) -> None:
    """Warn where this run's threads, CPU kernel variant or kernels' OpenMP threads differ from those the plan's
    costs were measured with: its predicted speed then may not hold here (profile again on this machine)."""
    import torch

    from hsd_opt.models.loading import resolve_device
    from hsd_opt.runtime.runner import machine_differences

    if resolve_device(str(device)).type != "cpu":
        return
    from hsd_opt.engine import kernels

    ran = kernels.provenance(device)
    for d in machine_differences(plan, torch.get_num_threads(), ran["variant"] if ran else None,
                                 ran["openmp"] if ran else None):
        warn(f"{d}: its predicted speed may not hold here (profile again on this machine)")


def warn_sampling(source, plan, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> None:
    """Warn where this run samples otherwise than ``plan`` (read from ``source``) was profiled: its hierarchy and
    predictions are for that setting (profile again with this run's sampling options)."""
    from hsd_opt.runtime.runner import sampling_differences

    for d in sampling_differences(plan, temperature, top_p, top_k, min_p):
        warn(f"{source}: {d}; its hierarchy and predictions are for that setting (hsd profile takes the same "
             f"sampling options)")


def prepare_kernels(device: str) -> None:
    """On a CPU, load the decode kernels now, so that their one-time build (a few seconds) is announced on stderr
    rather than passing silently inside the first engine that wants them."""
    from hsd_opt.models.loading import resolve_device

    if resolve_device(str(device)).type == "cpu":
        from hsd_opt.console import err_console
        from hsd_opt.engine import kernels

        kernels.load(log=lambda m: err_console.print(m))


def retime_text(tokenizer) -> list[int]:
    """Token ids the re-timing passes read (``--retime``): the suite's first 8 chat prompts, one after the other."""
    from hsd_opt.prompts import encode_prompt, load_prompts

    return [t for s in load_prompts().texts[:8] for t in encode_prompt(tokenizer, s)]


def read_retime_profile(retime: Optional[Path], say_warnings: bool = True) -> Optional["Profile"]:
    """The profile ``--retime`` names (its load warnings printed, unless ``say_warnings`` is off), read before any
    model is loaded; None without the flag. :class:`HsdError` naming ``--retime`` and the file when it cannot be
    read."""
    if retime is None:
        return None
    from hsd_opt.console import warn_some
    from hsd_opt.formats import load_profile

    try:
        profile, warnings = load_profile(retime)
    except HsdError as e:
        raise HsdError(f"--retime {e}") from None
    if say_warnings:
        warn_some(warnings)
    return profile


def check_retime(p, profile: "Profile", source: str, retime: Path) -> None:
    """``--retime PROFILE`` (read by :func:`read_retime_profile`) against the plan ``p`` (``source`` names it),
    before any hierarchy is built: the plan has plans per load level to choose again, and the profile prices them
    (:func:`~hsd_opt.measure.retime.check_profile_for_plan`)."""
    from hsd_opt.measure.retime import check_profile_for_plan

    if not p.by_load:
        raise HsdError(f"--retime: {source} has no plans per load level to choose again (hsd solve "
                       f"--batch-sizes)")
    check_profile_for_plan(profile, p, str(retime))


def plan_check_for_retime(profile: Optional["Profile"], plan_path: Path, retime: Optional[Path]):
    """The ``check_plan`` of :func:`load_plan_and_model` for ``--retime PROFILE`` (:func:`check_retime`; None
    without the flag)."""
    if profile is None:
        return None
    return lambda p: check_retime(p, profile, str(plan_path), retime)


def retimed_levels(p, loaded, models, runner, levels: dict, profile: "Profile", mode: str, source: str,
                   say) -> tuple[dict, dict]:
    """``hsd serve --retime PROFILE`` (and ``hsd bench --concurrency --retime``), the profile checked against the
    plan already (:func:`check_retime`): time one step of every engine the plan's hierarchies run (on the suite's
    prompts), and choose each load level's hierarchy again among the plan's own, its levels' and the target alone
    at those step times (:func:`~hsd_opt.measure.retime.retime_load_levels`); ``say`` hears the factors and each
    level that changes. Returns the level -> runner map and the report."""
    from hsd_opt.measure.retime import retime_load_levels
    from hsd_opt.runtime.runner import hsd_for_plan

    built = {(tuple(p.hierarchy), tuple(p.budgets)): runner}
    for n, e in p.by_load.items():
        built.setdefault((tuple(e.hierarchy), tuple(e.budgets)), levels[n])
    alone = ((p.hierarchy[-1],), ())
    if alone not in built:
        built[alone] = hsd_for_plan(p, loaded, mode=mode, source=source, hierarchy=[p.hierarchy[-1]], budgets=[],
                                    models=models)
    text = retime_text(loaded.tokenizer)
    say("timing each engine's step to choose the load levels' hierarchies again (--retime) ...")
    new, report = retime_load_levels(p, profile, built, text=text)
    say("step time now over profiled: " + ", ".join(f"{k} x{v:.2f}" for k, v in sorted(report["factors"].items())))

    def chain(h: list[str], b: list[int]) -> str:
        return " -> ".join(h) + (f" (T={b})" if b else "")

    for n, e in report["levels"].items():
        if (e["chosen"], e["budgets"]) != (e["plan"], e["plan_budgets"]):
            say(f"load level {n}: {chain(e['plan'], e['plan_budgets'])} -> {chain(e['chosen'], e['budgets'])}")
    return new, report


JSON_SCHEMA_HELP = "A JSON schema (a .json file): the output is JSON that follows it (structured output)."
TOP_K_HELP = "Sample among the K most probable tokens (0: off; llama.cpp's default: 40)."
MIN_P_HELP = ("Sample among tokens at least this share of the most probable one's probability, in [0, 1] (0: off; "
              "llama.cpp's default: 0.05).")
GRAMMAR_HELP = ("A grammar file the output follows: a regular expression in a file ending .regex, else a Lark "
                "grammar (llguidance's dialect).")


def grammar_spec(json_schema: Optional[Path], grammar: Optional[Path]):
    """The :class:`~hsd_opt.grammar.compiler.GrammarSpec` of ``--json-schema FILE`` or ``--grammar FILE`` (None
    without either); an :class:`HsdError` naming the flag and the file when it cannot be read or both are given."""
    from hsd_opt.grammar.compiler import GrammarSpec
    from hsd_opt.jsonio import read_text

    if json_schema is not None and grammar is not None:
        raise HsdError("give at most one of --json-schema FILE and --grammar FILE")
    if json_schema is not None or grammar is not None:     # before the model loads
        need("llguidance", what="--json-schema" if json_schema is not None else "--grammar")
    try:
        if json_schema is not None:
            return GrammarSpec.json_schema(read_text(json_schema, "a JSON schema"), f"--json-schema {json_schema}")
        if grammar is not None:
            kind = "regex" if grammar.suffix == ".regex" else "lark"
            text = read_text(grammar, "a grammar")
            if kind == "regex":                    # the file's last line break, not the pattern's own spaces
                text = text.removesuffix("\n").removesuffix("\r")
            return GrammarSpec(kind, text, f"--grammar {grammar}")
    except InputFileError as e:
        raise HsdError(f"{'--json-schema' if json_schema is not None else '--grammar'} {e}") from None
    return None


def item_grammars(items, flag_grammar, loaded, source: str) -> dict[int, object]:
    """The grammar each prompt's answers follow, by item index: ``flag_grammar`` (``--json-schema``/``--grammar``)
    for every prompt when given, else a prompt line's own ``schema`` (compiled, errors naming the line)."""
    if flag_grammar is not None:
        return {it.index: flag_grammar for it in items}
    if not any(it.schema is not None for it in items):
        return {}
    from hsd_opt.grammar.compiler import compiler_for, schema_grammars

    return schema_grammars(compiler_for(loaded), items, source)


def compile_grammar(spec, loaded):
    """``spec`` (None: none) compiled for ``loaded`` (:func:`~hsd_opt.grammar.compiler.compiler_for`)."""
    from hsd_opt.grammar.compiler import compiler_for

    return None if spec is None else compiler_for(loaded).compile(spec)
