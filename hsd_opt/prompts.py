"""Prompt files: reading and validating them, and turning a prompt into token ids.

A prompt file is JSON lines ``{"prompt": "...", "task": "code|summarization|math|chat|..."}``; ``task`` is
optional (``"other"`` when absent) and groups the reports per task type. The project's own suite ships inside the
package (``hsd_opt/data/prompts.jsonl``, read with importlib.resources; ``data/prompts.jsonl`` in the repository
is a link to it), so every command finds it from any directory. The profiler, the runtime, the benchmarks and
the heads trainer all read prompts through this module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.jsonio import read_bytes

DEFAULT_SUITE = "prompts.jsonl"


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a suite: its text, task type and 0-based index in the file."""

    index: int
    prompt: str
    task: str


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


def default_prompts_path() -> Path:
    """Path of the suite shipped in the package (``hsd_opt/data/prompts.jsonl``)."""
    ref = resources.files("hsd_opt").joinpath("data", DEFAULT_SUITE)
    return Path(str(ref))


def load_prompts(path: str | Path | None = None) -> PromptSuite:
    """Read and validate a prompt file; ``None`` means the suite shipped in the package.

    Raises:
        InputFileError: missing or empty file, a malformed line, a line without a non-empty string ``prompt``,
            a ``task`` that is not a string (the message names the file and the line).
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
    except UnicodeDecodeError:
        raise InputFileError(str(p), "not UTF-8 text") from None
    items: list[PromptItem] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"line {lineno}"
        try:
            obj: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputFileError(str(p), f"malformed JSON ({e.msg} at column {e.colno}); expected "
                                         '{"prompt": "...", "task": "..."}', where) from None
        if not isinstance(obj, dict):
            raise InputFileError(str(p), 'expected an object {"prompt": "...", "task": "..."}', where)
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputFileError(str(p), 'missing "prompt" (expected a non-empty string)', where)
        task = obj.get("task", "other")
        if not isinstance(task, str) or not task:
            raise InputFileError(str(p), f'"task" must be a non-empty string, got {task!r}', where)
        items.append(PromptItem(len(items), prompt, task))
    if not items:
        raise InputFileError(str(p), 'empty prompt file: no prompts (expected JSON lines {"prompt": "...", '
                                     '"task": "..."})')
    return PromptSuite(items, hashlib.sha256(raw).hexdigest(), source)


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids of ``prompt``: the tokenizer's chat template (one user turn + generation prompt) unless
    ``raw`` or the tokenizer has none; otherwise the plain encoding (with the tokenizer's special tokens).
    An empty or blank prompt, or one that encodes to no tokens, raises :class:`HsdError`."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise HsdError("empty prompt: give some text with --prompt (or non-empty 'prompt' fields in --prompts)")
    if not raw and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        ids = list(out)
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(x) for x in ids]
    ids = [int(x) for x in tokenizer(prompt)["input_ids"]]
    if not ids:
        raise HsdError("empty prompt: it encodes to no tokens")
    return ids
