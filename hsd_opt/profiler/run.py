"""``hsd profile``'s driver: acceptance rates and costs of a drafter pool for one target -> ``hsd-profile/1``.

:func:`run_profile` reads as its phases: validate the settings, load the target, build the pool
(:mod:`~hsd_opt.profiler.pool`), open or resume the checkpoint (:mod:`~hsd_opt.profiler.checkpoint`), let the
target generate its continuations, measure every pair on them (:mod:`~hsd_opt.profiler.measure`), reduce across
ranks (:mod:`~hsd_opt.profiler.dist`), time the costs (:mod:`~hsd_opt.profiler.costs`), assemble the profile
(:mod:`~hsd_opt.profiler.assemble`) with its provenance and write it. See ``docs/design.md#the-profiler``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hsd_opt.engine import kernels, variants
from hsd_opt.engine.kernels import MAX_PASS
from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.formats import Profile, profile_from_dict, provenance_from_dict, save_profile
from hsd_opt.models.loading import (
    eos_token_ids,
    file_sha256,
    model_positions,
    recorded_model_id,
)
from hsd_opt.profiler.assemble import (
    batch_costs_entries,
    build_profile,
    costs_profile,
    forced_by_task,
    positions_by_task,
    prompts_by_task,
    walk_key,
)
from hsd_opt.profiler.batch_costs import measure_batch_costs
from hsd_opt.profiler.checkpoint import open_checkpoint, partial_path, refuse_left_checkpoint
from hsd_opt.profiler.config import ProfileConfig, check_config
from hsd_opt.profiler.costs import (
    PREFILL_CHUNK,
    calibrate,
    choose_plan,
    estimate_seconds,
    fit_contexts,
    measure_costs,
    time_draw_saving,
    time_sampling,
    time_token_drafter,
    time_window_saving,
)
from hsd_opt.profiler.dist import all_gather, all_reduce_sum, barrier, close_process_group, dist_info
from hsd_opt.profiler.measure import generate, profile_sequence, walk_rounds
from hsd_opt.profiler.pool import Pool, aded_store, build_aded, build_pool, encode_item, exit_boundaries, fresh_drafter
from hsd_opt.profiler.stats import PairStats
from hsd_opt.prompts import PromptItem, PromptSuite, check_room, load_prompts, text_of_length, with_json_tasks
from hsd_opt.runtime.sampling import filter_window, unfiltered
from hsd_opt.seeds import SEED_STRIDE
from hsd_opt.version import __version__

#: Seconds a progress tick of the cost phase may take at most, where the calibration lets a prefill chunk fit.
PROGRESS_SECONDS = 3.0


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, all cores (``/proc/stat``; None elsewhere)."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)          # idle + iowait
    return (sum(fields[:8]) - idle) / hz, sum(fields[:8]) / hz


def busy_cores_now(seconds: float = 0.5) -> float | None:
    """Cores other processes keep busy now: the machine's busy CPU time over the next ``seconds`` less this
    process's own, per second (``/proc/stat``; None where it cannot be read). What the machine does now, not the
    1-minute load average, which still counts a job that ended a minute ago."""
    a, own_a = _cpu_seconds(), time.process_time()
    if a is None:
        return None
    time.sleep(seconds)
    b, own_b = _cpu_seconds(), time.process_time()
    if b is None or b[1] <= a[1]:
        return None
    wall = (b[1] - a[1]) / (os.cpu_count() or 1)                     # seconds of each core's clock
    return max(0.0, ((b[0] - a[0]) - (own_b - own_a)) / wall)


def set_threads(threads: int, warn: Callable[[str], None], busy: Callable[[], float | None] = busy_cores_now) -> str:
    """``threads > 0``: use that many torch CPU threads. ``0`` (auto): torch's default, except on a CPU machine
    whose cores other processes keep busy now (``busy()``: at least all cores but half of one, sampled over half a
    second), where 1 thread is used: there, OpenMP threads spin-waiting for each other make small decode steps many
    times slower. Returns a note for the provenance."""
    if threads and threads > 0:
        torch.set_num_threads(int(threads))
        return f"--threads {threads}"
    if torch.cuda.is_available():
        return "torch default"
    cpus = os.cpu_count() or 1
    others = busy()
    if others is None and hasattr(os, "getloadavg"):              # no /proc/stat (macOS): the load average
        others = os.getloadavg()[0]
    if others is not None and cpus > 1 and others >= cpus - 0.5 and torch.get_num_threads() > 1:
        torch.set_num_threads(1)
        warn(f"this machine is busy (other processes keep {others:.1f} of {cpus} cores busy now): profiling with 1 "
             f"torch thread, and the costs are measured with 1 thread; pass --threads {cpus} to force more")
        return f"auto: 1 ({others:.1f} of {cpus} cores busy)"
    return "torch default"


def _load_target(cfg: ProfileConfig):
    """``(loaded model, the target's engine, heads sha256 or None, heads metadata, target precision)``: a
    :class:`LayeredLM` over the loaded weights (random ones built from the model's configuration with
    ``cfg.costs_only``; with trained exit heads when asked), or with ``--target-precision
    int8|int4`` a :class:`~hsd_opt.engine.quantized.QuantizedLM` of them on the CPU kernels, which is then the
    target itself (its greedy output is the reference)."""
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.engine.precisions import QUANT_KINDS, TARGET_PRECISIONS
    from hsd_opt.models.loading import load_model

    precision = cfg.target_precision
    if precision is not None and precision not in TARGET_PRECISIONS:
        raise HsdError(f"--target-precision: expected {', '.join(TARGET_PRECISIONS)} (or None: the loaded dtype), "
                       f"got {precision!r}")
    load_dtype = cfg.dtype if precision is None or precision in QUANT_KINDS else precision
    if precision in QUANT_KINDS and cfg.heads is not None:
        raise HsdError(f"--heads: trained exit heads belong to the float target, not to --target-precision "
                       f"{precision}")
    if cfg.costs_only:
        from hsd_opt.models.random_weights import load_for_costs

        loaded = load_for_costs(cfg.model, device=cfg.device, dtype=load_dtype)
    else:
        loaded = load_model(cfg.model, device=cfg.device, dtype=load_dtype)
    if precision in QUANT_KINDS:
        return loaded, quantized_target(loaded, precision), None, {}, precision
    exit_heads, heads_meta, heads_sha = None, {}, None
    if cfg.heads is not None:
        if not Path(cfg.heads).is_file():
            raise InputFileError(str(cfg.heads), "file not found", None)
        from hsd_opt.heads import load_heads

        # random weights (costs only): the heads' shapes are checked, not the model id and revision they name
        exit_heads, heads_meta = load_heads(str(cfg.heads), loaded.model if cfg.costs_only else loaded)
        heads_sha = file_sha256(Path(cfg.heads))
    return loaded, LayeredLM(loaded.model, exit_heads=exit_heads), heads_sha, heads_meta, loaded.dtype


def quantized_target(loaded, precision: str):
    """The ``precision`` (``int8``/``int4``) copy of ``loaded``'s model as a target: on the CPU kernels only, whose
    batch invariance makes its verify passes compute exactly what its own decode steps compute (so greedy HSD
    over it equals its own autoregressive loop); :class:`HsdError` naming ``--target-precision`` otherwise."""
    from hsd_opt.engine.precisions import QUANT_KINDS
    from hsd_opt.engine.quantized import QuantizedLM

    bits, group = QUANT_KINDS[precision]
    n = loaded.model.config.num_hidden_layers
    try:
        return QuantizedLM(loaded.model, bits=bits, group_size=group, name=f"layer{n}", kernels=True)
    except HsdError as e:
        raise HsdError(f"--target-precision {precision}: a quantized target runs on the CPU decode kernels only "
                       f"({e})") from None


def model_shape(config) -> dict[str, int | None]:
    """The sizes of a model's configuration that make its costs (layers, widths, heads, vocabulary): a merge of
    rates and costs refuses costs of a model of another shape."""
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    return {k: (int(v) if isinstance(v, int) else None) for k in keys for v in [getattr(config, k, None)]}


def _settings(cfg: ProfileConfig, loaded, heads_sha, suite: PromptSuite, boundaries, pool: Pool, world: int,
              precision: str) -> dict:
    """What a profile was made with: what a resumed run must share (``checkpoint.RESUME_FIELDS``) and merged
    profiles must share (``assemble.MERGE_FIELDS``)."""
    return {
        "model": recorded_model_id(loaded.model_id), "revision": loaded.revision,   # a local model: absolute
        "tokenizer_sha256": tokenizer_sha256(loaded), "model_shape": model_shape(loaded.model.config),
        "heads": str(Path(cfg.heads).resolve()) if cfg.heads else None,     # absolute: a plan runs from any folder
        "heads_sha256": heads_sha, "prompts": suite.source, "prompts_sha256": suite.sha256,
        "temperature": float(cfg.temperature), "top_p": float(cfg.top_p), "top_k": int(cfg.top_k),
        "min_p": float(cfg.min_p), "max_new_tokens": int(cfg.max_new_tokens), "tmax": int(cfg.tmax),
        "raw": bool(cfg.raw),
        "seed": int(cfg.seed), "dtype": loaded.dtype, "target_precision": precision, "layers": list(boundaries),
        "draft_models": [nd.model_id for nd in pool.neural if nd.kind == "model"],
        "draft_revisions": sorted({f"{nd.model_id}@{nd.revision}" for nd in pool.neural if nd.model_id}),
        "draft_layers": sorted({nd.boundary for nd in pool.neural if nd.kind == "early_exit" and nd.model_id}),
        "quantized": [nd.name for nd in pool.neural if nd.kind == "quantized"],
        "token_drafters": [f"{d.kind}:{d.name}" for d in pool.token] + (["aded:aded"] if pool.want_aded else []),
        "shard": list(cfg.shard) if cfg.shard else None,
        "max_prompts": cfg.max_prompts, "world_size": world,
    }


#: Text whose token ids stand for a tokenizer's vocabulary, merges and normalisation in
#: :func:`tokenizer_sha256`.
TOKENIZER_PROBE = ("The quick brown fox; def f(x): return x ** 2  # ünïcödé, 日本語, emoji \U0001f600\n\t"
                   "  1234567 + 0.5 = ?  <|im_start|> </s> [INST]")


def tokenizer_sha256(loaded) -> str | None:
    """The SHA-256 (16 hex digits) of what the model's tokenizer makes of text: its size, the ids of
    :data:`TOKENIZER_PROBE`, its chat template and the model's EOS ids (None without a tokenizer). A model directory
    whose tokenizer or chat template was changed, its weights not, keeps its revision: this tells the two apart
    (a resumed profile, a merge of profiles, would mix prompts encoded two ways)."""
    tok = loaded.tokenizer
    if tok is None:
        return None
    template = getattr(tok, "chat_template", None)
    what = [len(tok), list(tok.encode(TOKENIZER_PROBE, add_special_tokens=False)),
            template if isinstance(template, (str, dict)) else None, eos_token_ids(loaded)]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def prompt_keys(items: Sequence[PromptItem], temperature: float, seed: int) -> list[str]:
    """One key per prompt of ``items`` (the prompts a profile measured): its content's SHA-256
    (:meth:`~hsd_opt.prompts.PromptItem.content_sha256`) and, sampled, ``@`` the seed its continuation was drawn with
    (``seed * SEED_STRIDE + index``). Two profiles that share a key measured the same positions, whatever their
    files, shards, ``--max-prompts`` or ``--json-tasks``: ``hsd profile merge`` says so."""
    return [it.content_sha256() + (f"@{int(seed) * SEED_STRIDE + it.index}" if temperature > 0 else "")
            for it in items]


def _my_prompts(items: list[PromptItem], shard, rank: int, world: int) -> list[PromptItem]:
    """The prompts this process profiles: its ``--shard``, then round-robin over torchrun ranks."""
    mine = [it for it in items if shard is None or it.index % shard[1] == shard[0]]
    return [it for j, it in enumerate(mine) if j % world == rank]


def _grammars(loaded, items: Sequence[PromptItem], source: str) -> dict[int, Any]:
    """The compiled grammar of every item with a JSON schema, by item index (a schema that does not compile: an
    error naming the prompt file and line)."""
    if not any(it.schema is not None for it in items):
        return {}
    from hsd_opt.grammar.compiler import compiler_for, schema_grammars

    try:
        compiler = compiler_for(loaded)
        compiler.tokenizer()                        # its tables: where the tokenizer is one llguidance cannot read
    except HsdError as e:
        raise HsdError(f"the prompts with a JSON schema (--json-tasks, or {source}'s \"schema\" fields): {e}") from None
    return schema_grammars(compiler, items, source)


def _constraint(grammars: dict[int, Any], it: PromptItem):
    """A fresh :class:`~hsd_opt.grammar.constraint.Constraint` of the item's grammar, or None without one."""
    from hsd_opt.grammar.constraint import Constraint

    g = grammars.get(it.index)
    return None if g is None else Constraint(g)


def _grammar_rows(grammars: dict[int, Any], it: PromptItem, cont: list[int]):
    """``(allowed [G, V] bool, forced [G] bool)``: the item's grammar's row at each position of its continuation
    and where it allows one token only; ``(None, None)`` without a grammar."""
    c = _constraint(grammars, it)
    if c is None:
        return None, None
    rows = [c.allowed(cont, k) for k in range(len(cont))]
    forced = np.array([c.only(cont, k) is not None for k in range(len(cont))], dtype=bool)
    return (torch.stack(rows) if rows else torch.zeros(0, c.vocab_size, dtype=torch.bool)), forced


def _generate_continuations(cfg: ProfileConfig, loaded, eng, mine: list, ck, eos: set, source, progress,
                            grammars: dict[int, Any]) -> None:
    """The target's continuation of each of this run's prompts not yet generated (a prompt with a schema: under
    its grammar), checkpointed one by one (they are also ADED's default corpus)."""
    need = [it for it in mine if str(it.index) not in ck.continuations]
    gid = progress.add_task("generating", total=len(mine), completed=len(mine) - len(need)) if progress else None
    for it in need:
        ids = encode_item(loaded, it, cfg.raw, source)
        gen = None
        if cfg.temperature > 0:
            gen = torch.Generator().manual_seed(int(cfg.seed) * SEED_STRIDE + it.index)
        ck.continuations[str(it.index)] = generate(eng, ids, cfg.max_new_tokens, cfg.temperature, eos, gen,
                                                   cfg.top_p, _constraint(grammars, it), cfg.top_k, cfg.min_p)
        ck.save()
        if progress:
            progress.update(gid, advance=1)


def _measure_prompts(cfg: ProfileConfig, loaded, pool, tds: list, mine: list, todo: list, ck, eos: set, source,
                     progress, on_prompt: Callable[[int], None] | None, grammars: dict[int, Any]) -> None:
    """Every drafter's distribution at every generated position of each prompt of ``todo``, streamed into the
    checkpoint's sums (saved after each prompt; ``on_prompt(k)`` called after the k-th). Under a grammar the
    positions it forces are counted as ``forced_tokens``, apart from ``generated_tokens`` (those measured)."""
    pid = progress.add_task("profiling", total=len(mine), completed=len(mine) - len(todo)) if progress else None
    walked = [d for d in tds if getattr(d, "may_abstain", False)]
    for k, it in enumerate(todo, 1):
        ids = encode_item(loaded, it, cfg.raw, source)
        cont = ck.continuations[str(it.index)]
        allowed, forced = _grammar_rows(grammars, it, cont)
        acc_nn, agr_nn, acc_tn, agr_tn, secs = profile_sequence(
            pool.neural, [fresh_drafter(d) for d in tds], ids, cont, cfg.temperature, cfg.chunk, cfg.top_p,
            allowed, forced, cfg.top_k, cfg.min_p)
        n_forced = int(forced.sum()) if forced is not None else 0
        measured = len(cont) - n_forced
        st = ck.stats
        st.add_neural(it.task, acc_nn, agr_nn)
        if tds:
            st.add_token(it.task, acc_tn, agr_tn)
        for ti, d in enumerate(tds):
            st.count(f"propose_seconds.{d.name}", secs[ti])
            st.count(f"propose_calls.{d.name}", measured)
        if allowed is None and walked:      # under a grammar decoding takes forced tokens without a round
            for d in walked:
                counts = walk_rounds(lambda: fresh_drafter(d).fork(), ids, cont, cfg.tmax)
                for T in range(1, cfg.tmax + 1):
                    st.count(walk_key("rounds", d.name, T, it.task), counts[0, T - 1])
                    st.count(walk_key("blocks", d.name, T, it.task), counts[1, T - 1])
            st.count(f"walked_prompts.{it.task}", 1)
        for key, n in (("prompts", 1), ("prompt_tokens", len(ids)), ("generated_tokens", measured),
                       *((("forced_tokens", n_forced),) if forced is not None else ())):
            st.count(key, n)
            st.count(f"{key}.{it.task}", n)
        st.count("eos_stops", 1 if cont and cont[-1] in eos else 0)
        ck.done.append(it.index)
        ck.save()
        if progress:
            progress.update(pid, advance=1, description=f"profiling ({int(st.counters['generated_tokens'])} tokens)")
        if on_prompt:
            on_prompt(k)


@dataclass
class _Costs:
    """What the cost phase measured: per engine its layer costs (``lcs``), the token drafters' costs, the cost
    plan's record, the sampling seconds per pass size (None: greedy), the batch costs, the contexts (tokens),
    what the target's pass saves by draws per pass size (None: it draws from its distributions) and what a pass of
    its engine saves by reading the filters' window (None: no top-k or min-p, or no screen)."""

    lcs: dict
    token_costs: dict
    plan_info: dict
    sampling: list[float] | None
    batch: dict
    contexts: list[int]
    draw_saving: list[float] | None = None
    window_saving: list[float] | None = None


def _costs_phase(cfg: ProfileConfig, loaded, eng, pool, tds: list, text: list[int], log, warn) -> _Costs:
    """Every engine's costs at every context length that fits the models (the target's engine first), the token
    drafters', the sampling's (with a temperature) and the batched passes'."""
    by_engine: dict[int, tuple[Any, list[int]]] = {id(eng): (eng, [])}       # the target's engine first
    label: dict[int, str] = {}                    # an engine's name in the progress bar: its deepest drafter's
    for nd in sorted(pool.neural, key=lambda nd: nd.boundary):
        by_engine.setdefault(id(nd.engine), (nd.engine, []))[1].append(nd.boundary)
        label[id(nd.engine)] = nd.name
    most = _max_positions(e for e, _ in by_engine.values())
    contexts = fit_contexts(cfg.cost_contexts, most, cfg.tmax)
    if contexts != sorted(set(cfg.cost_contexts)):
        warn(f"--cost-contexts: the models hold {most} positions; costs are measured at "
             f"{', '.join(map(str, contexts))} tokens")
    log(f"measuring costs at contexts of {', '.join(map(str, contexts))} tokens")
    lcs, token_costs, plan_info = _measure_all_costs(cfg, by_engine, label, contexts, tds, text, log, warn)
    sampling = None
    if cfg.temperature > 0:
        sampling = time_sampling(_target_rows(eng, text, cfg.tmax + 1), cfg.temperature, cfg.top_p, cfg.tmax + 1,
                                 top_k=cfg.top_k, min_p=cfg.min_p)
        log(f"sampling: {sampling[0] * 1e3:.2f} ms per draft step, {sampling[-1] * 1e3:.2f} ms per pass over "
            f"{cfg.tmax + 1} tokens (temperature, the filters and a draw; added to every model's costs)")
    draw_saving = window_saving = None
    cheap = cfg.temperature > 0 and getattr(eng, "picks_cheaply", False)
    windowed = cheap and filter_window(cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p, eng.vocab_size) is not None
    if windowed:
        window_saving = time_window_saving(eng, text, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                           cfg.tmax + 1)
        log(f"the filters' window: a pass of the target's engine over 1 token {window_saving[0] * 1e3:.2f} ms "
            f"cheaper, over {cfg.tmax + 1} tokens {window_saving[-1] * 1e3:.2f} ms (its int8 screen and the "
            f"window's logits instead of every logit; taken off every pass of its levels)")
    elif cheap and unfiltered(cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p):
        draw_saving = time_draw_saving(eng, text, cfg.temperature, cfg.tmax + 1)
        log(f"draws by noise: the target's step {draw_saving[0] * 1e3:.2f} ms cheaper, its pass over {cfg.tmax + 1} "
            f"tokens {draw_saving[-1] * 1e3:.2f} ms (its int8 screen instead of every logit; taken off its cost and "
            f"its verification of token drafters)")
    batch = _measure_batch_costs(cfg, by_engine, label, contexts[0], text, log)
    return _Costs(lcs, token_costs, plan_info, sampling, batch, contexts, draw_saving, window_saving)


def _provenance_record(cfg: ProfileConfig, settings: dict, loaded, heads_meta, stats, costs: _Costs, pool,
                       timings: dict, world: int, threads_note: str) -> dict:
    """The profile's ``provenance``: the settings, the model, the counts (overall and per task), how the costs
    were measured and checked, the timings (seconds), the versions, the threads and the kernel variant."""
    task_prompts, task_prompt_tokens = prompts_by_task(stats)
    return {
        **settings,
        "source": loaded.source, "device": loaded.device, "heads_meta": heads_meta or None,
        "prompt_count": int(stats.counters["prompts"]),
        "prompt_tokens": int(stats.counters["prompt_tokens"]),
        "generated_tokens": int(stats.counters["generated_tokens"]),
        "positions_by_task": positions_by_task(stats), "forced_by_task": forced_by_task(stats),
        **({"prompts_by_task": task_prompts, "prompt_tokens_by_task": task_prompt_tokens} if task_prompts else {}),
        "temperature_note": ("acceptance uses softmax(logits / T) then top-k, top-p and min-p (the runtime's "
                             "sampling distribution at every level); at T = 0 the plain softmax(logits) (T = 1) for "
                             "the TV acceptance and argmax for greedy_agreement"),
        **_cost_record(cfg, loaded, costs, pool, timings, world, threads_note),
    }


def _cost_record(cfg: ProfileConfig, loaded, costs: _Costs, pool, timings: dict, world: int,
                 threads_note: str) -> dict:
    """The provenance of the costs: the contexts (tokens) and the cost plan, the cost model and its check, the
    timings (seconds), the date, the versions, the threads, the kernel variant, the machine (``host``:
    :func:`~hsd_opt.engine.variants.host`) and how the torch path ran (each of
    :attr:`~hsd_opt.engine.layered.LayeredLM.torch_path`'s settings, on where any engine had it)."""
    return {
        "cost_contexts": {"requested": sorted(set(cfg.cost_contexts)), "measured": costs.contexts},
        "cost_plan": costs.plan_info,
        "cost_model": "exits: cost, cost_curve and verify_cost are sums of median timings of advance() per "
                      "exit boundary scaled to the whole model's direct timing; the whole model (target, draft "
                      "model, quantized copy): cost and cost_curve timed directly; at every context of "
                      "context_costs (the top-level costs: the first); all non-decreasing in t and in the "
                      "context (docs/design.md#the-cost-model); step_measured = direct median of one warm "
                      "decode step; with a temperature, sampling_seconds[t - 1] (processing a pass's t rows "
                      "of logits and one draw) is included in every model's pass over t tokens; a target that "
                      "draws by noise through its screen (top-p 1): draw_saving_seconds[t - 1] taken off its "
                      "cost and off its verify_cost of each token drafter, not off its cost_curve; sampled with "
                      "top-k or min-p through the target's screen: window_saving_seconds[t - 1] taken off every "
                      "pass over t tokens of each level on the target's engine (cost, cost_curve, verify_cost)",
        "sampling_seconds": costs.sampling,
        "draw_saving_seconds": costs.draw_saving,
        "window_saving_seconds": costs.window_saving,
        "cost_model_check": {nd.name: costs.lcs[id(nd.engine)][0].check for nd in pool.neural
                             if nd.kind in ("target", "model", "quantized")},
        "timings": timings,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hsd_opt_version": __version__, "torch": torch.__version__, "world_size": world,
        "torch_threads": torch.get_num_threads(), "threads_note": threads_note, "cpu_count": os.cpu_count(),
        "kernels": kernels.provenance(loaded.device), "host": variants.host(),
        "torch_path": {k: any(nd.engine.torch_path[k] for nd in pool.neural) for k in pool.neural[0].engine.torch_path},
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def _threads_and_prompts(cfg: ProfileConfig, warn) -> tuple[str, PromptSuite, list[PromptItem]]:
    """Torch's threads set (:func:`set_threads`: its note), the suite (the shipped JSON-schema tasks added with
    ``--json-tasks``) and the items this run profiles: the first ``--max-prompts`` of the suite or file, then
    every JSON-schema task asked for."""
    threads_note = set_threads(cfg.threads, warn)
    own = load_prompts(cfg.prompts)
    suite = with_json_tasks(own, cfg.json_tasks)
    added = len(suite.items) - len(own.items)           # every shipped one where fewer are shipped than asked for
    if cfg.json_tasks > added:
        warn(f"--json-tasks {cfg.json_tasks}: the package ships {added} JSON-schema tasks; profiling all {added}")
    mine = own.items[: cfg.max_prompts] if cfg.max_prompts is not None else own.items
    return threads_note, suite, list(mine) + list(suite.items[len(own.items):])


def run_profile(cfg: ProfileConfig, on_prompt: Callable[[int], None] | None = None,
                log: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None) -> Profile | None:
    """Profile ``cfg.model``; write ``cfg.out`` (rank 0) and return the :class:`Profile` (None on other ranks).

    ``log``/``warn`` receive one-line messages; with ``cfg.progress`` a progress bar is shown on stderr.
    ``on_prompt(k)`` is called after the k-th prompt of this run is done and checkpointed (tests use it to
    simulate a crash). With ``cfg.costs_only``: :func:`run_costs_only`.
    """
    log = log or (lambda s: None)
    warn = warn or (lambda s: None)
    if cfg.costs_only:
        return run_costs_only(cfg, log, warn)
    try:
        return _profile_ranks(cfg, on_prompt, log, warn)
    finally:
        close_process_group()       # under torchrun: before the interpreter's teardown meets gloo's threads


def _profile_ranks(cfg: ProfileConfig, on_prompt: Callable[[int], None] | None, log: Callable[[str], None],
                   warn: Callable[[str], None]) -> Profile | None:
    """:func:`run_profile` of this process (one torchrun rank, or the whole run): the profile on rank 0."""
    rank, world = dist_info()

    # validate, load the target, then the pool
    check_config(cfg)
    refuse_left_checkpoint(partial_path(Path(cfg.out), rank, world), cfg.resume)   # before minutes of loading
    threads_note, suite, items = _threads_and_prompts(cfg, warn)
    shard_items = _my_prompts(items, cfg.shard, 0, 1)       # every rank's together: what the profile measures
    if cfg.shard and not shard_items:
        raise HsdError(f"--shard {cfg.shard[0]}/{cfg.shard[1]}: none of the {len(items)} prompts is in it (prompt k "
                       f"is in shard k % {cfg.shard[1]}); a profile of no prompts has no rates")
    t_start = time.perf_counter()
    loaded, eng, heads_sha, heads_meta, precision = _load_target(cfg)
    boundaries = exit_boundaries(cfg.layers, eng.n_layers)
    target_name = f"layer{eng.n_layers}"
    left_out = cfg.token_drafters_left_out
    if cfg.shard and cfg.token_drafters is None:
        log("--shard: the default pool without aded (its matrix needs every prompt's continuation)")
        left_out = (*left_out, "aded")
    pool = build_pool(loaded, eng, boundaries, cfg.draft_models, cfg.quantized, cfg.token_drafters, cfg.device,
                      cfg.dtype, log, warn, cfg.draft_layers, left_out=left_out)
    settings = _settings(cfg, loaded, heads_sha, suite, boundaries, pool, world, precision)
    stats = _new_stats(pool, suite.tasks, cfg.tmax)

    # resume
    mine = _my_prompts(items, cfg.shard, rank, world)
    ck = open_checkpoint(partial_path(Path(cfg.out), rank, world), settings, stats, rank, world, cfg.resume, log,
                         warn, eng.vocab_size, [it.index for it in mine])
    done = set(ck.done)
    todo = [it for it in mine if it.index not in done]

    eos = set(eos_token_ids(loaded))
    progress = None
    if cfg.progress and rank == 0:
        from hsd_opt.console import progress_bar

        progress = progress_bar()
        progress.start()
    t_prof = time.perf_counter()
    try:
        tds = _profile_prompts(cfg, loaded, eng, pool, mine, todo, ck, eos, suite.source, progress, on_prompt, world,
                               warn)
    finally:
        if progress:
            progress.stop()
    profiling_seconds = time.perf_counter() - t_prof
    stats = ck.stats

    # reduce: the sums of every rank (rank 0 goes on alone)
    if world > 1:
        _sum_over_ranks(stats, world, eng.device)
        if rank != 0:
            barrier()
            return None

    # costs, at every context length that fits the models
    t_cost = time.perf_counter()
    costs = _costs_phase(cfg, loaded, eng, pool, tds, _suite_text(loaded, mine, ck, cfg, suite), log, warn)
    cost_seconds = time.perf_counter() - t_cost

    # assemble, with provenance, and write
    prof = build_profile(pool.neural, tds, stats, costs.lcs, cfg.tmax, target_name, costs.token_costs,
                         costs.sampling, costs.draw_saving, costs.window_saving)
    prof.batch_costs = batch_costs_entries(prof, pool.neural, costs.batch, costs.contexts[0])
    timings = {"profiling_seconds": round(profiling_seconds, 3), "cost_seconds": round(cost_seconds, 3),
               "total_seconds": round(time.perf_counter() - t_start, 3)}
    record = _provenance_record(cfg, settings, loaded, heads_meta, stats, costs, pool, timings, world, threads_note)
    record["prompt_keys"] = prompt_keys(shard_items, cfg.temperature, cfg.seed)
    prof.provenance = provenance_from_dict(record, str(cfg.out))
    _write(prof, Path(cfg.out), world, warn)
    return prof


#: Where a model has no tokenizer, the UTF-8 bytes of the prompts stand for their tokens, from this id on (below
#: it are special tokens in most vocabularies: padding, BOS, EOS, unknown).
BYTE_OFFSET = 3


def run_costs_only(cfg: ProfileConfig, log: Callable[[str], None], warn: Callable[[str], None]) -> Profile:
    """Measure the costs of ``cfg``'s pool alone on this machine and write them to ``cfg.out``: ``hsd profile
    --costs-only``, for plans on hardware the rates were not measured on (``hsd profile merge-costs``).

    The target and each draft model are timed on their own weights where they are on this machine, else (a
    configuration, a hub id) built from their configuration with random weights
    (:func:`~hsd_opt.models.random_weights.load_for_costs`: a step costs what it costs with the real weights of the
    same form; ``provenance.draft_sources`` says which each draft model had); nothing is generated and no
    acceptance is measured. Every cost is measured as :func:`run_profile` measures it, the token drafters' on the
    prompts' token ids (:func:`costs_texts`; ADED's matrix is built from them). Returns the profile
    (:func:`~hsd_opt.profiler.assemble.costs_profile`): no acceptance rates, ``provenance.costs_only`` true.
    Refuses ``--resume``, ``--shard`` and several processes (:func:`_check_costs_only`)."""
    check_config(cfg)
    _check_costs_only(cfg)
    threads_note, suite, items = _threads_and_prompts(cfg, warn)
    t_start = time.perf_counter()
    loaded, eng, heads_sha, heads_meta, precision = _load_target(cfg)
    boundaries = exit_boundaries(cfg.layers, eng.n_layers)
    pool = build_pool(loaded, eng, boundaries, cfg.draft_models, cfg.quantized, cfg.token_drafters, cfg.device,
                      cfg.dtype, log, warn, cfg.draft_layers, costs_only=True,
                      left_out=cfg.token_drafters_left_out)
    settings = _settings(cfg, loaded, heads_sha, suite, boundaries, pool, 1, precision)
    texts = costs_texts(loaded, items, cfg.raw, suite.source)
    tds = list(pool.token)
    if pool.want_aded:
        tds.append(build_aded({str(i): t for i, t in enumerate(texts)}, 1, warn))
    t_cost = time.perf_counter()
    costs = _costs_phase(cfg, loaded, eng, pool, tds, [t for text in texts for t in text], log, warn)
    prof = costs_profile(pool.neural, tds, costs.lcs, cfg.tmax, f"layer{eng.n_layers}", costs.token_costs,
                         costs.sampling, costs.draw_saving, costs.window_saving)
    prof.batch_costs = batch_costs_entries(prof, pool.neural, costs.batch, costs.contexts[0])
    timings = {"cost_seconds": round(time.perf_counter() - t_cost, 3),
               "total_seconds": round(time.perf_counter() - t_start, 3)}
    text_note = ("the prompts' token ids" if loaded.tokenizer is not None else
                 f"the prompts' UTF-8 bytes + {BYTE_OFFSET} as token ids (the model has no tokenizer)")
    record = {**settings, "source": loaded.source, "device": loaded.device, "heads_meta": heads_meta or None,
              "costs_only": True, "token_drafter_text": text_note,
              "draft_sources": {d.model_id: d.source for d in pool.draft_models},
              **_cost_record(cfg, loaded, costs, pool, timings, 1, threads_note)}
    prof.provenance = provenance_from_dict(record, str(cfg.out))
    _write(prof, Path(cfg.out), 1, warn)
    return prof


def _check_costs_only(cfg: ProfileConfig) -> None:
    """Refuse what a costs-only run has no use for, naming the flag: ``--resume`` (no prompts are checkpointed),
    ``--shard`` and several processes (costs are one machine's measurements, not sums)."""
    if cfg.resume:
        raise HsdError("--resume: --costs-only keeps no checkpoint (it profiles no prompts); run it again")
    if cfg.shard is not None:
        raise HsdError("--shard: --costs-only measures costs, which are not split over prompts")
    if dist_info()[1] > 1:
        raise HsdError("--costs-only runs in one process: start it without torchrun")


def costs_texts(loaded, items: list[PromptItem], raw: bool, source: str) -> list[list[int]]:
    """Token ids of each prompt of ``items`` (the chat template applied unless ``raw``): what a costs-only run
    times the token drafters on. A model without a tokenizer (a bare configuration) takes each prompt's UTF-8
    bytes plus :data:`BYTE_OFFSET` (modulo its vocabulary) instead: text's repeats, which the n-gram drafters
    match, in ids the model has."""
    if loaded.tokenizer is not None:
        return [encode_item(loaded, it, raw, source) for it in items]
    vocab = int(loaded.model.config.vocab_size)
    return [[(BYTE_OFFSET + b) % vocab for b in it.prompt.encode()] for it in items]


def _profile_prompts(cfg: ProfileConfig, loaded, eng, pool, mine: list, todo: list, ck, eos: set, source: str,
                     progress, on_prompt, world: int, warn) -> list:
    """The continuations (:func:`_generate_continuations`), then every drafter measured on them
    (:func:`_measure_prompts`; ADED built from them when wanted); returns the token drafters measured."""
    # a prompt that with --max-new-tokens would pass the fewest positions a model of the pool holds: refused
    check_room(mine, loaded.tokenizer, cfg.raw, cfg.max_new_tokens, _max_positions(nd.engine for nd in pool.neural),
               source)
    grammars = _grammars(loaded, mine, source)
    if pool.want_aded:
        aded_store()                          # a cache that cannot keep its matrix: said before the generation
    _generate_continuations(cfg, loaded, eng, mine, ck, eos, source, progress, grammars)
    tds = list(pool.token)
    if pool.want_aded:
        tds.append(build_aded(ck.continuations, world, warn))
    _measure_prompts(cfg, loaded, pool, tds, mine, todo, ck, eos, source, progress, on_prompt, grammars)
    return tds


def _sum_over_ranks(stats: PairStats, world: int, device) -> None:
    """``stats`` made the sums of every torchrun rank's: one all-reduce over the counters every rank keeps (their
    union: a rank without a schema's prompt counts no forced tokens, and vectors of different lengths aborted)."""
    for key in set().union(*all_gather(sorted(stats.counters), world)):
        stats.counters.setdefault(key, 0.0)
    stats.load_flat(all_reduce_sum(stats.flat(), device))


def _new_stats(pool, tasks: list[str], tmax: int) -> PairStats:
    """Empty sums for the pool's drafters over ``tasks``, with the counters the measurement keeps: prompts,
    tokens and EOS stops, overall and per task (a task's context, a token drafter's calls there), each token
    drafter's proposing seconds and calls, and an abstaining drafter's rounds per budget 1..``tmax`` and task
    (:func:`~hsd_opt.profiler.measure.walk_rounds`)."""
    names = pool.token_names
    counters = ["prompts", "prompt_tokens", "generated_tokens", "eos_stops"]
    counters += [f"generated_tokens.{t}" for t in tasks]           # the order of earlier checkpoints, kept
    counters += [f"{c}.{t}" for c in ("prompts", "prompt_tokens") for t in tasks]
    counters += [f"propose_seconds.{n}" for n in names] + [f"propose_calls.{n}" for n in names]
    walked = [d.name for d in pool.token if getattr(d, "may_abstain", False)]
    if walked:
        counters += [f"walked_prompts.{t}" for t in tasks]
        counters += [walk_key(c, n, T, t) for c in ("rounds", "blocks") for n in walked
                     for T in range(1, tmax + 1) for t in tasks]
    return PairStats([nd.name for nd in pool.neural], names, tasks, counters)


def _write(prof: Profile, out: Path, world: int, warn: Callable[[str], None]) -> None:
    """Write ``prof`` to ``out`` (atomically) and remove every rank's checkpoint; warn of its first warnings (the
    triangle bound), and wait for the other ranks."""
    _, warnings = profile_from_dict(prof.to_dict(), str(out))
    save_profile(prof, out)
    for r in range(world):
        partial_path(out, r, world).unlink(missing_ok=True)
    for w in warnings[:5]:
        warn(w)
    if world > 1:
        barrier()


def _measure_batch_costs(cfg: ProfileConfig, by_engine: dict, label: dict[int, str], context: int,
                         text: list[int], log: Callable[[str], None]) -> dict[int, dict]:
    """``{id(engine): {B: (ratio, seconds)}}`` for ``cfg.batch_sizes`` (nothing for batch 1 alone)
    (:func:`~hsd_opt.profiler.batch_costs.measure_batch_costs`), with a progress line per engine."""
    if len(cfg.batch_sizes) < 2:
        return {}
    sizes = ", ".join(map(str, cfg.batch_sizes))
    log(f"timing passes over {sizes} sequences at a context of {context} tokens")
    out = {}
    t0 = time.perf_counter()
    for k, (e, _) in by_engine.items():
        out[k] = measure_batch_costs(e, cfg.batch_sizes, cfg.tmax, text, context, greedy=cfg.temperature == 0)
        top = max(cfg.batch_sizes)
        log(f"  {label.get(k, 'target')}: a step of {top} sequences costs {out[k][top][0][0]:.2f}x one sequence's, "
            f"a pass over {cfg.tmax + 1} tokens each {out[k][top][0][-1]:.2f}x")
    log(f"batch costs: {time.perf_counter() - t0:.0f} s")
    return out


def _max_positions(engines) -> int | None:
    """The fewest positions any of ``engines``' models is computed for (:func:`model_positions`; None: unknown)."""
    ns = [model_positions(getattr(e.model, "config", None)) for e in engines]
    ns = [n for n in ns if n is not None]
    return min(ns) if ns else None


def _suite_text(loaded, items: list[PromptItem], ck, cfg: ProfileConfig, suite: PromptSuite) -> list[int]:
    """Token ids of the profiled prompts, each followed by the target's continuation: the real text a token
    drafter's ``propose`` is timed on."""
    out: list[int] = []
    for it in items:
        cont = ck.continuations.get(str(it.index))
        if cont is not None:
            out += encode_item(loaded, it, cfg.raw, suite.source) + list(cont)
    return out


def _target_rows(eng, text: list[int], n: int, most: int = 64) -> torch.Tensor:
    """Logits ``[m, V]`` of the target over the first ``max(n, most)`` tokens of ``text`` (real text: the rows
    :func:`~hsd_opt.profiler.costs.time_sampling` processes)."""
    ids = text_of_length(text, max(n, most))
    st = eng.new_state(len(ids))
    eng.append(st, ids)
    eng.advance(st, eng.n_layers)
    return eng.logits(st, eng.n_layers, 0, len(ids))


def prefill_chunk(engine, prefill_token: float) -> int:
    """Tokens per prefill call while costs are measured: about :data:`PROGRESS_SECONDS` of work (progress
    between calls), at most ``PREFILL_CHUNK``. Longer than one kernel pass for an engine whose long passes
    take its prefill path (a GEMM), a whole number of kernel passes for one that runs them on the kernels (a
    quantized copy), where 65 tokens would be a pass of 64 and a step of 1."""
    chunk = min(PREFILL_CHUNK, int(PROGRESS_SECONDS / max(prefill_token, 1e-9)))
    if getattr(engine, "long_passes_on_kernels", False):
        return max(MAX_PASS, chunk // MAX_PASS * MAX_PASS)
    return max(MAX_PASS + 1, chunk)


def _measure_all_costs(cfg: ProfileConfig, by_engine: dict, label: dict[int, str], contexts: list[int], tds: list,
                       text: list[int], log: Callable[[str], None], warn: Callable[[str], None]):
    """``({id(engine): [LayerCosts per context]}, {token drafter: [seconds per propose at each context]}, the
    cost plan as a dict for the provenance)``.

    First every engine is calibrated (:func:`~hsd_opt.profiler.costs.calibrate`, seconds each), then the most
    thorough cost plan whose estimate fits ``cfg.cost_budget`` is chosen
    (:func:`~hsd_opt.profiler.costs.choose_plan`); the progress bar's units are the estimated seconds, so its
    ETA holds across engines of very different sizes, and it moves at least every few seconds (prefill chunks
    sized from the calibration). ``by_engine`` starts with the target's engine; an engine over a model's own
    weights is measured before the copies of that model, which take its prefilled states as at run time."""
    order = [k for k in by_engine if not by_engine[k][0].is_copy] + [k for k in by_engine if by_engine[k][0].is_copy]
    source = {}
    for k in order:
        e = by_engine[k][0]
        source[k] = next((j for j in order if by_engine[j][0] is not e and e.can_share_prompt(by_engine[j][0])), None)
    progress = None
    if cfg.progress:
        from hsd_opt.console import progress_bar

        progress = progress_bar(percent=True)
        progress.start()
    try:
        calib, plan, est, budget = _calibrate_and_plan(cfg, by_engine, order, source, label, contexts, text, progress,
                                                       log, warn)
        tok_est = 0.05 * len(tds) * len(contexts)
        pid = progress.add_task("measuring costs", total=est + tok_est) if progress else None
        lcs = _engine_costs(cfg, by_engine, order, source, label, contexts, text, calib, plan, est, budget, progress,
                            pid)
        token_costs = _token_drafter_costs(tds, contexts, text, progress, pid)
    finally:
        if progress:
            progress.stop()
    info = {**plan.to_dict(), "budget_seconds": cfg.cost_budget, "estimated_seconds": round(est, 1),
            "calibration": {label[k]: {"step": c.step, "pass_max": c.pass_max, "prefill_token": c.prefill_token}
                            for k, c in calib.items()}}
    return lcs, token_costs, info


def _calibrate_and_plan(cfg: ProfileConfig, by_engine: dict, order: list[int], source: dict, label: dict[int, str],
                        contexts: list[int], text: list[int], progress, log: Callable[[str], None],
                        warn: Callable[[str], None]):
    """Calibrate every engine in ``order``, then choose the most thorough cost plan whose estimate fits what the
    calibration left of ``cfg.cost_budget`` (said; warned when even the coarsest does not): ``({key:
    Calibration}, the plan, its estimated seconds, the seconds left of the budget or None)``. ``source[k]``: the
    engine whose prefilled states engine ``k`` shares, or None."""
    t0 = time.perf_counter()
    calib = {}
    cid = progress.add_task("costs: calibrating", total=len(order)) if progress else None
    for k in order:
        calib[k] = calibrate(by_engine[k][0], cfg.tmax, greedy=cfg.temperature == 0, text=text)
        if progress:
            progress.update(cid, advance=1, description=f"costs: calibrated {label[k]}")
    budget = None if cfg.cost_budget is None else max(0.0, cfg.cost_budget - (time.perf_counter() - t0))
    engines = [(calib[k], len(by_engine[k][1]), source[k] is not None) for k in order]
    plan, est = choose_plan(budget, engines, contexts, cfg.tmax, cfg.cost_repeats, cfg.cost_warmup,
                            cfg.curve_repeats)
    note = (f"cost plan {plan.level!r}: about {est:.0f} s for {len(order)} engine(s)"
            + ("" if cfg.cost_budget is None else f" (--cost-budget {cfg.cost_budget:.0f} s)"))
    if budget is not None and est > budget:
        warn(f"{note}; even the coarsest plan is over the budget: measuring with it anyway")
    else:
        log(note)
    return calib, plan, est, budget


def _engine_costs(cfg: ProfileConfig, by_engine: dict, order: list[int], source: dict, label: dict[int, str],
                  contexts: list[int], text: list[int], calib: dict, plan, est: float, budget: float | None,
                  progress, pid) -> dict:
    """``{key: [LayerCosts per context]}``: every engine's exits timed (:func:`measure_costs`) in ``order``, an
    engine that feeds copies keeping its prefilled states for them; the refinements of the direct timings share
    what the budget leaves over the plan's estimate ``est``, by engine cost. The progress task ``pid`` advances
    by the estimated seconds."""
    est_of = {k: estimate_seconds(plan, calib[k], contexts, len(by_engine[k][1]), cfg.tmax, source[k] is not None)
              for k in order}
    lcs = {}
    states: dict = {}                       # prefilled states of engines over their own weights, by engine
    for k in order:
        e, bs = by_engine[k]

        def step(msg: str, seconds: float = 1.0, name=label[k]) -> None:
            if progress:
                progress.update(pid, advance=seconds, description=f"costs: {name}, {msg}")

        def extend(n_steps: int, seconds: float) -> None:
            if progress:
                progress.update(pid, total=progress.tasks[pid].total + seconds)

        chunk = prefill_chunk(e, calib[k].prefill_token)
        slack = None if budget is None else max(0.0, budget - est) * est_of[k] / max(est, 1e-9)
        feeds = any(source[j] == k for j in order)
        lcs[k] = measure_costs(e, bs, tmax=cfg.tmax, contexts=contexts, on_step=step, plan=plan, calib=calib[k],
                               on_extend=extend, chunk=chunk, refine_seconds=slack,
                               greedy=cfg.temperature == 0, text=text,
                               keep_states=states.setdefault(k, {}) if feeds else None,
                               share_from=(by_engine[source[k]][0], states[source[k]]) if source[k] else None)
    states.clear()
    return lcs


def _token_drafter_costs(tds: list, contexts: list[int], text: list[int], progress, pid) -> dict[str, list[float]]:
    """``{token drafter: [seconds per propose at each context]}``, each timed on a fresh drafter over ``text``."""
    token_costs = {}
    for d in tds:
        token_costs[d.name] = []
        for c in contexts:
            token_costs[d.name].append(time_token_drafter(lambda d=d: fresh_drafter(d), text, c))
            if progress:
                progress.update(pid, advance=0.05, description=f"costs: {d.name}, context {c}")
    return token_costs
