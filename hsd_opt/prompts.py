"""Prompt files: reading and validating them, and turning a prompt (or a conversation) into token ids.

A prompt file is JSON lines, one prompt per line, in either of two forms (they may be mixed):

- ours: ``{"prompt": "...", "task": "code|summarization|math|chat|...", "schema": {...}}``; ``task`` is optional
  (``"other"`` when absent, :data:`JSON_TASK` for a line with a schema) and groups the reports per task type;
  ``schema``, optional, is the JSON schema the answer follows (the profiler generates and measures under it);
- Spec-Bench's question format as it is: ``{"question_id": 82, "category": "writing", "turns": ["...", "..."]}``
  (the benchmark of "Unlocking Efficiency in Large Language Model Inference: A Comprehensive Survey of
  Speculative Decoding", arXiv 2401.07851). The task of such a line is its category GROUP: the eight MT-bench
  categories (:data:`MT_BENCH_CATEGORIES`) form the group ``mt_bench``, every other category (translation,
  summarization, qa, math_reasoning, rag) is its own group, which is how Spec-Bench reports. The raw category
  is kept in :attr:`PromptItem.category` for a finer report.

The prompt of an item is its first turn; a later turn is sent after the model's own answer to the previous one
(:func:`conversation_ids`), as MT-bench does. The project's own suite ships inside the package
(``hsd_opt/data/prompts.jsonl``, read with importlib.resources; ``data/prompts.jsonl`` in the repository is a link
to it), so every command finds it from any directory. The profiler, the runtime, the benchmarks and the heads
trainer all read prompts through this module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.jsonio import json_problem, read_bytes

DEFAULT_SUITE = "prompts.jsonl"
#: The JSON-schema tasks shipped in the package (``hsd_opt/data/json_tasks.jsonl``): prompts with the schema of a
#: realistic API each.
JSON_TASKS = "json_tasks.jsonl"
#: The task of a prompt whose answer follows a JSON schema, unless its line names another: the plan per task a
#: request under a grammar runs.
JSON_TASK = "json"
#: Spec-Bench categories that come from MT-bench; they are reported together as the group ``mt_bench``.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MT_BENCH_GROUP = "mt_bench"
#: What a report groups prompts by: ``group`` (the task: our ``task``, Spec-Bench's category group) or
#: ``category`` (Spec-Bench's raw category; the task for our own lines).
REPORT_KEYS = ("group", "category")
#: Which turns of a multi-turn item are run: the first only, or every turn after the model's own answers.
TURN_MODES = ("first", "all")
_EXPECTED = ('expected {"prompt": "...", "task": "..."} or a Spec-Bench question {"question_id": ..., '
             '"category": "...", "turns": ["...", ...]}')


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a suite.

    Attributes:
        index: 0-based position in the file (blank lines skipped).
        prompt: the text of the first user turn.
        task: the task type (ours) or Spec-Bench category group: what reports group by.
        category: Spec-Bench's raw category (the task for our own lines).
        question_id: Spec-Bench's ``question_id`` (None for our own lines).
        turns: every user turn, the first being ``prompt`` (one turn for our own lines).
        schema: the JSON schema the answer must follow (our lines' ``"schema"``, an object), or None.
        line: its line in the file (1-based), or None for a prompt not read from a file.
    """

    index: int
    prompt: str
    task: str
    category: str = ""
    question_id: Any = None
    turns: tuple[str, ...] = ()
    schema: dict | None = field(default=None, compare=False)
    line: int | None = field(default=None, compare=False)

    @property
    def place(self) -> str:
        """Where it stands, for messages: ``line N`` of its file, else ``prompt N`` (1-based)."""
        return f"line {self.line}" if self.line is not None else f"prompt {self.index + 1}"

    def __post_init__(self):
        if not self.category:
            object.__setattr__(self, "category", self.task)
        if not self.turns:
            object.__setattr__(self, "turns", (self.prompt,))

    def key(self, by: str = "group") -> str:
        """What a report groups this item under: its task (``by="group"``) or its raw category."""
        return self.category if by == "category" else self.task

    def content_sha256(self) -> str:
        """The SHA-256 (16 hex digits) of what the model is given: the turns and the schema (not the task or the
        place in its file): the same prompt in two files, or twice in one, has one."""
        text = json.dumps([list(self.turns), self.schema], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass(frozen=True)
class PromptSuite:
    """A validated prompt file: its ``items`` in file order, the SHA-256 of the file's bytes (what profiles
    record to tell suites apart) and ``source``, the name messages use for it."""

    items: list[PromptItem]
    sha256: str
    source: str

    @property
    def texts(self) -> list[str]:
        return [it.prompt for it in self.items]

    @property
    def tasks(self) -> list[str]:
        """Task types of the suite, sorted (a fixed order for per-task statistics)."""
        return sorted({it.task for it in self.items})


def spec_bench_group(category: str) -> str:
    """The report group of a Spec-Bench category: ``mt_bench`` for the MT-bench ones, else the category."""
    return MT_BENCH_GROUP if category in MT_BENCH_CATEGORIES else category


def text_of_length(stream: Sequence[int], n: int) -> list[int]:
    """The first ``n`` token ids of ``stream`` repeated as often as needed (``[0]`` when it is empty)."""
    stream = list(stream) or [0]
    return (stream * (n // len(stream) + 1))[:n]


def default_prompts_path() -> Path:
    """Path of the suite shipped in the package (``hsd_opt/data/prompts.jsonl``)."""
    ref = resources.files("hsd_opt").joinpath("data", DEFAULT_SUITE)
    return Path(str(ref))


def json_tasks_path() -> Path:
    """Path of the JSON-schema tasks shipped in the package (:data:`JSON_TASKS`)."""
    return Path(str(resources.files("hsd_opt").joinpath("data", JSON_TASKS)))


def with_json_tasks(suite: PromptSuite, n: int) -> PromptSuite:
    """``suite`` followed by the first ``n`` shipped JSON-schema tasks (task :data:`JSON_TASK`, numbered after the
    suite's items); its SHA-256 covers both files and ``n``. ``n`` 0: ``suite`` itself."""
    if n <= 0:
        return suite
    tasks = load_prompts(json_tasks_path())
    # their lines are of the shipped file, not of the suite the messages name: placed by their index there
    extra = [replace(it, index=len(suite.items) + k, line=None) for k, it in enumerate(tasks.items[:n])]
    sha = hashlib.sha256(f"{suite.sha256} {tasks.sha256} {len(extra)}".encode()).hexdigest()
    return PromptSuite(suite.items + extra, sha, f"{suite.source} + {len(extra)} JSON-schema tasks ({JSON_TASKS})")


def _lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate, which no tokenizer reads (JSON's ``"\\ud800"``, or a byte of
    ``argv`` that is no UTF-8, as Python reads it); None for Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _check_text(text: str, field: str, source: str, where: str) -> None:
    """Refuse ``text`` that is no Unicode text (:func:`_lone_surrogate`)."""
    at = _lone_surrogate(text)
    if at is not None:
        raise InputFileError(source, f"{field} holds a lone surrogate ({text[at]!a} at character {at}): "
                                     f"not Unicode text", where)


def check_utf8(text: str, flag: str) -> None:
    """Refuse, naming ``flag``, text given on the command line that was not UTF-8 (Python reads such bytes of
    ``argv`` as lone surrogates: a TypeError from the tokenizer once the model had loaded)."""
    at = _lone_surrogate(text)
    if at is not None:
        raise HsdError(f"{flag}: not UTF-8 text ({text[at]!a} at character {at}: a byte that is no UTF-8); give "
                       f"the text in UTF-8")


def _item(obj: Any, index: int, source: str, line: int) -> PromptItem:
    """Line ``line``'s object as a :class:`PromptItem` (ours or Spec-Bench's), or a refusal naming the line."""
    where = f"line {line}"
    if not isinstance(obj, dict):
        raise InputFileError(source, _EXPECTED, where)
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputFileError(source, '"prompt" must be a non-empty string', where)
        _check_text(prompt, '"prompt"', source, where)
        schema = obj.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise InputFileError(source, f'"schema" must be a JSON schema object, got {type(schema).__name__}',
                                 where)
        task = obj.get("task", JSON_TASK if schema is not None else "other")
        if not isinstance(task, str) or not task:
            raise InputFileError(source, f'"task" must be a non-empty string, got {task!r}', where)
        _check_text(task, '"task"', source, where)
        return PromptItem(index, prompt, task, schema=schema, line=line)
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns:
            raise InputFileError(source, '"turns" must be a non-empty list of strings (Spec-Bench format)', where)
        for k, t in enumerate(turns):
            if not isinstance(t, str) or not t.strip():
                raise InputFileError(source, f'"turns"[{k}] must be a non-empty string', where)
            _check_text(t, f'"turns"[{k}]', source, where)
        cat = obj.get("category")
        if not isinstance(cat, str) or not cat:
            raise InputFileError(source, f'"category" must be a non-empty string (Spec-Bench format), got {cat!r}',
                                 where)
        qid = obj.get("question_id")
        if qid is not None and (isinstance(qid, bool) or not isinstance(qid, (int, str))):
            raise InputFileError(source, f'"question_id" must be an integer or a string, got {qid!r}', where)
        _check_text(cat, '"category"', source, where)
        if isinstance(qid, str):
            _check_text(qid, '"question_id"', source, where)
        return PromptItem(index, turns[0], spec_bench_group(cat), cat, qid, tuple(turns), line=line)
    raise InputFileError(source, f'missing "prompt" (or Spec-Bench\'s "turns"): {_EXPECTED}', where)


def _check_new_id(item: PromptItem, first_line: dict[Any, int], source: str) -> None:
    """Refuse ``item`` when its Spec-Bench ``question_id`` is an earlier line's (``first_line``: each id's line so
    far, updated): output records are told apart by it. The message names both lines."""
    qid = item.question_id
    if qid is None:
        return
    if qid in first_line:
        raise InputFileError(source, f'"question_id" {qid!r} again (first on line {first_line[qid]}): every '
                                     "question needs its own", f"line {item.line}")
    first_line[qid] = item.line


def text_lines(text: str) -> list[str]:
    """The lines of a JSON-lines file's ``text`` as :func:`load_prompts` reads them (line N is item N - 1): a
    byte-order mark (some editors write one) skipped, lines ended at ``"\\n"`` (and ``"\\r\\n"``) only: U+2028,
    U+2029 and U+0085, which JSON writes unescaped inside a string (``json.dumps(..., ensure_ascii=False)``), are
    text of the line, not line ends."""
    return [line.removesuffix("\r") for line in text.removeprefix("\ufeff").split("\n")]


def load_prompts(path: str | Path | None = None) -> PromptSuite:
    """Read and validate a prompt file (ours or Spec-Bench's format); ``None`` means the suite shipped in the
    package.

    Raises:
        InputFileError: missing or empty file, a malformed line, a line in neither format, a line without a
            non-empty ``prompt`` (ours) or ``turns`` and ``category`` (Spec-Bench), a bad ``task`` or
            ``question_id`` (the message names the file and the line).
    """
    if path is None:
        p = default_prompts_path()
        source = "default suite (hsd_opt/data/prompts.jsonl)"
    else:
        p = Path(path)
        source = str(p)
    raw = read_bytes(p, "a JSON-lines prompt file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise InputFileError(str(p), "not UTF-8 text", f"line {line}") from None
    items: list[PromptItem] = []
    first_line: dict[Any, int] = {}
    for lineno, line in enumerate(text_lines(text), 1):
        if not line.strip():
            continue
        where = f"line {lineno}"
        try:
            obj: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputFileError(str(p), f"malformed JSON ({e.msg} at column {e.colno}); {_EXPECTED}",
                                 where) from None
        except (ValueError, RecursionError) as e:
            raise InputFileError(str(p), f"{json_problem(e)}; {_EXPECTED}", where) from None
        items.append(_item(obj, len(items), str(p), lineno))
        _check_new_id(items[-1], first_line, str(p))
    if not items:
        raise InputFileError(str(p), f"empty prompt file: no prompts ({_EXPECTED})")
    return PromptSuite(items, hashlib.sha256(raw).hexdigest(), source)


def check_report_key(by: str) -> str:
    """``by`` if it is one of :data:`REPORT_KEYS`, else a one-line :class:`HsdError` naming ``--by``."""
    if by not in REPORT_KEYS:
        raise HsdError(f"--by: expected {' or '.join(REPORT_KEYS)}, got {by!r}")
    return by


def check_turn_mode(turns: str) -> str:
    """``turns`` if it is one of :data:`TURN_MODES`, else a one-line :class:`HsdError` naming ``--turns``."""
    if turns not in TURN_MODES:
        raise HsdError(f"--turns: expected {' or '.join(TURN_MODES)}, got {turns!r}")
    return turns


def select_items(items: Sequence[PromptItem], limit: int | None = None, per_task: int | None = None,
                 by: str = "group") -> list[PromptItem]:
    """A deterministic selection: the first ``per_task`` items of each task (or category, ``by="category"``) in
    file order, then the first ``limit`` of those. None means no limit."""
    for flag, n in (("--limit", limit), ("--limit-per-task", per_task)):
        if n is not None and n < 1:
            raise HsdError(f"{flag}: expected >= 1, got {n}")
    out = list(items)
    if per_task is not None:
        seen: dict[str, int] = {}
        picked = []
        for it in out:
            k = it.key(by)
            if seen.get(k, 0) < per_task:
                seen[k] = seen.get(k, 0) + 1
                picked.append(it)
        out = picked
    return out[:limit] if limit is not None else out


def user_turns(item: PromptItem, turns: str = "first") -> list[str]:
    """The user turns of ``item`` that are run: the first only (``"first"``) or every one (``"all"``)."""
    return list(item.turns if turns == "all" else item.turns[:1])


def conversation_ids(tokenizer, turns: Sequence[str], answers: Sequence[str] = (), raw: bool = False) -> list[int]:
    """Token ids of user turn ``len(answers)`` of a conversation: the user ``turns[:len(answers) + 1]`` with the
    model's ``answers`` (decoded text) between them, through the tokenizer's chat template with the generation
    prompt. With ``raw`` or a tokenizer without a template: the plain encoding of the texts joined by blank
    lines. The first turn alone is :func:`encode_prompt`."""
    n = len(answers) + 1
    if len(turns) < n:
        raise HsdError(f"conversation: {len(answers)} answers need at least {n} user turns, got {len(turns)}")
    if n == 1:
        return encode_prompt(tokenizer, turns[0], raw=raw)
    if not raw and getattr(tokenizer, "chat_template", None):
        msgs: list[dict[str, str]] = []
        for k in range(n):
            msgs.append({"role": "user", "content": turns[k]})
            if k < len(answers):
                msgs.append({"role": "assistant", "content": answers[k]})
        return _chat_ids(tokenizer, msgs)
    parts = [x for k in range(n) for x in ([turns[k], answers[k]] if k < len(answers) else [turns[k]])]
    return encode_prompt(tokenizer, "\n\n".join(parts), raw=True)


#: The text an earlier answer stands in as when :func:`check_room` counts a later turn's tokens (one token).
STAND_IN = "x"


def check_room(items: Sequence[PromptItem], tokenizer, raw: bool, max_new_tokens: int, context: int | None,
               source: str, turns: str = "first") -> None:
    """Refuse, before any generation, a conversation that can pass the model's ``context`` (tokens; None:
    unchecked), in one line naming ``source`` (the prompt file), the prompt and the turn: each of its user turns
    run (``turns``: :func:`user_turns`) after answers of up to ``max_new_tokens`` each, with ``max_new_tokens`` to
    generate. Decoding would stop at it (HF's ``generate`` only after decoding past the context), a later turn
    after the earlier turns had run (``hsd run``, ``hsd bench``, ``hsd profile``). Each earlier answer is counted as
    ``max_new_tokens`` tokens besides a one-token stand-in that keeps the separators around it as they will be
    (empty answers joined the blank lines around them: ``"\n\n\n\n"`` is 2 tokens where ``"\n\n"`` on each side of
    an answer is 4); an answer whose text encodes to more tokens than were generated is not foreseen."""
    if context is None:
        return
    for it in items:
        for k in range(len(user_turns(it, turns))):
            n = len(conversation_ids(tokenizer, it.turns, [STAND_IN] * k, raw)) + k * max_new_tokens
            if n + max_new_tokens <= context:
                continue
            which = it.place + (f" (question_id {it.question_id})" if it.question_id is not None
                                                else "")
            if k == 0:
                raise HsdError(f"{source}: {which} has {n} tokens; with --max-new-tokens {max_new_tokens} that "
                               f"exceeds the model's context of {context} positions")
            raise HsdError(f"{source}: {which}, turn {k + 1}: its turns so far and {k} answer(s) of up to "
                           f"--max-new-tokens {max_new_tokens} make up to {n} tokens; with {max_new_tokens} more "
                           f"that can exceed the model's context of {context} positions (lower --max-new-tokens, "
                           f"or --turns first)")


def chat_ids(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ``[{"role": ..., "content": ...}, ...]`` ready for the model's next turn: the
    tokenizer's chat template with the generation prompt, or (a tokenizer without a template) the plain encoding
    of the contents joined by blank lines. An empty conversation, or one that encodes to no tokens, raises
    :class:`HsdError`; a template that refuses the conversation (say, roles out of order) too, with its reason."""
    if not messages:
        raise HsdError("empty conversation: need at least one message")
    if getattr(tokenizer, "chat_template", None):
        try:
            return _chat_ids(tokenizer, [dict(m) for m in messages])
        except Exception as e:  # jinja2's TemplateError (raise_exception in the template) and the like
            raise HsdError(f"the chat template refuses this conversation: {e}") from None
    return encode_prompt(tokenizer, "\n\n".join(m["content"] for m in messages), raw=True)


#: A chat template's head shorter than this many tokens is not worth a pass of its own (:func:`template_head`).
MIN_HEAD = 8
#: User turns whose token ids :func:`template_head` compares (they differ from their first character).
_HEAD_PROBES = ("Hello", "1 + 1 = ?", "Write a poem.", "x", "# Title")


def template_head(tokenizer) -> tuple[int, ...]:
    """The token ids every chat prompt of ``tokenizer`` starts with, whatever the user writes: its chat template
    up to the text of a user turn (the default system prompt and the turn's opening), found as the longest prefix
    the encodings of a few different user turns share. Empty when the tokenizer has no chat template, the template
    fails, or the head is shorter than :data:`MIN_HEAD` tokens. A prompt with a system message of its own starts
    otherwise."""
    if not getattr(tokenizer, "chat_template", None):
        return ()
    try:
        probes = [_chat_ids(tokenizer, [{"role": "user", "content": c}]) for c in _HEAD_PROBES]
    except Exception:  # noqa: BLE001 - a template that refuses a plain user turn has no head to keep
        return ()
    n = 0
    while n < min(len(p) for p in probes) and len({p[n] for p in probes}) == 1:
        n += 1
    return tuple(probes[0][:n]) if n >= MIN_HEAD else ()


def _chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of ``messages`` through the tokenizer's chat template, with the generation prompt; a template
    that fails (a syntax error, an undefined name) is an :class:`HsdError` saying so, not a traceback."""
    from jinja2 import TemplateError

    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except TemplateError as e:
        where = getattr(tokenizer, "name_or_path", "") or "the model"
        raise HsdError(f"{where}: its chat template fails ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                       f"fix it (chat_template.jinja or tokenizer_config.json), or give --raw") from None
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(x) for x in ids]


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids of ``prompt``: the tokenizer's chat template (one user turn + generation prompt) unless
    ``raw`` or the tokenizer has none; otherwise the plain encoding (with the tokenizer's special tokens).
    An empty prompt, a blank one through the template, or one that encodes to no tokens raises :class:`HsdError`
    (raw whitespace is text a model completes: the server's ``"prompt": "\\n"``)."""
    if not isinstance(prompt, str):
        raise HsdError(f"the prompt must be text (str), got {type(prompt).__name__}")
    if not callable(tokenizer):
        raise HsdError(f"tokenizer: expected the model's tokenizer (load_model(...).tokenizer), got "
                       f"{type(tokenizer).__name__}")
    if not (prompt if raw else prompt.strip()):
        raise HsdError("empty prompt: give some text with --prompt (or non-empty 'prompt' fields in --prompts)")
    if not raw and getattr(tokenizer, "chat_template", None):
        return _chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    ids = [int(x) for x in tokenizer(prompt)["input_ids"]]
    if not ids:
        raise HsdError("empty prompt: it encodes to no tokens")
    return ids
