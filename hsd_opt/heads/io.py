"""The heads file: ``heads.safetensors`` holding the translator tensors and a JSON header in its metadata.

Tensors (float32): ``layer{b}.weight`` ``[d, d]`` (affine) or ``layer{b}.u`` ``[d, r]`` + ``layer{b}.v``
``[r, d]`` (lowrank), ``layer{b}.bias`` ``[d]``, and ``vocab_ids`` ``[K]`` (int64) for a reduced-vocabulary head.
Metadata key ``hsd_heads`` holds JSON::

    {"format": "hsd-heads/1", "model": "embedded:smollm2-135m", "revision": "sha256:...",
     "hidden_size": 576, "vocab_size": 49152, "n_layers": 30, "layers": [1, 2, ...], "kind": "affine",
     "rank": null, "vocab_subset": null | K, "training_data_sha256": "...", "hsd_opt_version": "0.1.0",
     "train": {...settings, "prompts" (absolute path or null), "tokens", "holdout", per-layer held-out results...}}

``model`` is the loaded model's id; a local folder or ``.gguf`` file is recorded by its absolute path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.heads.modules import TranslatorHead
from hsd_opt.heads.settings import KINDS
from hsd_opt.jsonio import atomic_write_bytes
from hsd_opt.models.loading import recorded_model_id, same_model, unwrap_model
from hsd_opt.values import is_finite, is_integer
from hsd_opt.version import __version__

FORMAT = "hsd-heads/1"
META_KEY = "hsd_heads"


class HeadsModelMismatch(HsdError):
    """A heads file made for a different model. The message names the file and the field that differs."""

    def __init__(self, path: str, field: str, message: str):
        self.path, self.field = str(path), field
        super().__init__(f"{path}: {field}: {message}")


def save_heads(path: str | Path, heads: dict[int, TranslatorHead], model, *, model_id: str | None = None,
               revision: str | None = None, training_data_sha256: str = "", train: dict | None = None) -> dict:
    """Write ``heads`` (boundary -> head, all of one kind) atomically to ``path``; return the header."""
    from safetensors.torch import save

    m, mid, rev = unwrap_model(model)
    model_id = model_id if model_id is not None else (mid or getattr(m.config, "_name_or_path", "") or "")
    model_id = recorded_model_id(model_id) if model_id else model_id     # a local model: its absolute path
    revision = revision if revision is not None else (rev or "")
    if not isinstance(heads, dict) or not heads:
        got = "an empty dict" if isinstance(heads, dict) else type(heads).__name__
        raise HsdError(f"heads: expected a dict of exit layers to heads, got {got}")
    bad = next((b for b, h in heads.items() if not (is_integer(b) and isinstance(h, TranslatorHead))), None)
    if bad is not None:
        raise HsdError(f"heads[{bad!r}]: expected an exit layer (an integer) to a TranslatorHead, got "
                       f"{type(heads[bad]).__name__}")
    layers = sorted(heads)
    first = heads[layers[0]]
    tensors: dict[str, torch.Tensor] = {}
    for b in layers:
        h = heads[b]
        if h.kind != first.kind:
            raise HsdError("all heads in one file must be of one kind")
        if h.kind == "affine":
            tensors[f"layer{b}.weight"] = h.weight.detach().float().cpu().contiguous()
        else:
            tensors[f"layer{b}.u"] = h.u.detach().float().cpu().contiguous()
            tensors[f"layer{b}.v"] = h.v.detach().float().cpu().contiguous()
        tensors[f"layer{b}.bias"] = h.bias.detach().float().cpu().contiguous()
    if first.vocab_ids is not None:
        tensors["vocab_ids"] = first.vocab_ids.detach().cpu().long().contiguous()
    header = {
        "format": FORMAT, "model": model_id, "revision": revision,
        "hidden_size": int(m.config.hidden_size), "vocab_size": int(m.lm_head.weight.shape[0]),
        "n_layers": int(m.config.num_hidden_layers), "layers": layers, "kind": first.kind,
        "rank": first.rank if first.kind == "lowrank" else None,
        "vocab_subset": None if first.vocab_ids is None else int(first.vocab_ids.numel()),
        "training_data_sha256": training_data_sha256, "hsd_opt_version": __version__,
        "train": train or {},
    }
    atomic_write_bytes(path, save(tensors, metadata={META_KEY: json.dumps(header)}))
    return header


def read_heads_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and header of a heads file; a missing, corrupt or foreign file raises :class:`InputFileError`."""
    from safetensors import safe_open

    if not isinstance(path, (str, os.PathLike)):
        raise HsdError(f"path: expected the path of a heads file, got {type(path).__name__}")
    p = Path(path)
    if not p.exists():
        raise InputFileError(str(p), "file not found")
    if p.is_dir():
        raise InputFileError(str(p), "is a directory, expected a heads .safetensors file")
    try:
        with safe_open(str(p), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise InputFileError(str(p), f"not a readable safetensors file ({type(e).__name__}: {e})") from None
    if META_KEY not in meta:
        raise InputFileError(str(p), f"no {META_KEY!r} header in the safetensors metadata: not an hsd heads file")
    try:
        header = json.loads(meta[META_KEY])
    except json.JSONDecodeError as e:
        raise InputFileError(str(p), f"malformed JSON header: {e.msg}", META_KEY) from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else header
        raise InputFileError(str(p), f"expected format {FORMAT!r}, got {got!r}", "format")
    _check_header(str(p), header)
    return tensors, header


def _check_header(path: str, header: dict) -> None:
    """Refuse (:class:`InputFileError` naming ``path`` and the field) a header whose fields are missing or of the
    wrong type: sizes integers >= 1, ``layers`` a non-empty list of distinct integers, a known ``kind``, ``rank``
    and ``vocab_subset`` integers >= 1 or null, ``model`` and ``revision`` strings or null, and ``train`` (the
    training settings ``hsd heads eval`` reuses) an object whose ``settings`` (its ``seed`` and ``max_len``),
    ``tokens``, ``holdout`` and ``prompts`` are what training wrote."""
    for key in ("hidden_size", "vocab_size", "n_layers", "layers", "kind"):
        if key not in header:
            raise InputFileError(path, "missing from the header", key)
    if header["kind"] not in KINDS:
        raise InputFileError(path, f"unknown head kind {header['kind']!r} (known: {', '.join(KINDS)})", "kind")
    count = (lambda v: is_integer(v) and v >= 1, "an integer >= 1")
    checks = {"hidden_size": count, "vocab_size": count, "n_layers": count,
              "layers": (lambda v: isinstance(v, list) and len(v) > 0 and all(is_integer(b) for b in v)
                         and len(set(v)) == len(v), "a non-empty list of distinct layer numbers"),
              "rank": (lambda v: v is None or count[0](v), "an integer >= 1 or null"),
              "vocab_subset": (lambda v: v is None or count[0](v), "an integer >= 1 or null"),
              "model": (lambda v: v is None or isinstance(v, str), "a string or null"),
              "revision": (lambda v: v is None or isinstance(v, str), "a string or null"),
              "train": (lambda v: v is None or isinstance(v, dict), "an object or null")}
    _check_fields(path, header, checks, "")
    train = header.get("train") or {}
    _check_fields(path, train, {
        "settings": (lambda v: v is None or isinstance(v, dict), "an object or null"),
        "tokens": (lambda v: v is None or count[0](v), "an integer >= 1 or null"),
        "holdout": (lambda v: v is None or is_finite(v) and 0 < v < 1, "a share in (0, 1) or null"),
        "prompts": (lambda v: v is None or isinstance(v, str), "a path or null")}, "train.")
    _check_fields(path, train.get("settings") or {},
                  {"seed": (lambda v: v is None or is_integer(v), "an integer or null"),
                   "max_len": (lambda v: v is None or count[0](v), "an integer >= 1 or null")}, "train.settings.")


def _check_fields(path: str, obj: dict, checks: dict, prefix: str) -> None:
    """Each field of ``checks`` (name -> (test, what it should be)) present in ``obj`` passes its test, or an
    :class:`InputFileError` names ``path`` and ``prefix`` + the field."""
    for key, (ok, what) in checks.items():
        if key in obj and not ok(obj[key]):
            raise InputFileError(path, f"expected {what}, got {obj[key]!r}", prefix + key)


def _check_model(path: str, header: dict, model_id: str | None, revision: str | None) -> None:
    """Refuse (:class:`HeadsModelMismatch`) a heads file whose ``header`` names another model than ``model_id`` or
    another revision than ``revision`` (either unknown: not checked). A local model named otherwise than in
    training (``tA``, ``./tA``, its absolute path) is the same model (:func:`same_model`), and so is one whose
    revision (its weights' identity) is the one recorded."""
    have_model, have_rev = header.get("model"), header.get("revision")
    same_rev = bool(revision and have_rev and have_rev == revision)
    if model_id and have_model and not same_rev and not same_model(have_model, model_id):
        raise HeadsModelMismatch(path, "model", f"the heads were trained for {have_model!r}, not {model_id!r}")
    if revision and have_rev and have_rev != revision:
        raise HeadsModelMismatch(path, "revision", f"the heads were trained for revision {have_rev!r} of "
                                                   f"{have_model!r}, but the loaded model is revision {revision!r}")


def load_heads(path: str | Path, model, expected_model_id: str | None = None,
               expected_revision: str | None = None) -> tuple[dict[int, TranslatorHead], dict]:
    """Load a heads file for ``model`` (a ``LoadedModel`` or a ``transformers`` model) -> (boundary -> head, header).

    Refuses (:class:`HeadsModelMismatch`, an :class:`HsdError`) a file made for another model: hidden size,
    vocabulary size, layer count, or — when known from ``LoadedModel`` or the ``expected_*`` arguments — model id
    and revision. A missing or corrupt file raises :class:`InputFileError`.
    """
    m, mid, rev = unwrap_model(model)
    tensors, header = read_heads_file(path)
    expected_model_id = expected_model_id if expected_model_id is not None else mid
    expected_revision = expected_revision if expected_revision is not None else rev
    p = str(path)
    cfg = m.config
    checks = [("hidden_size", int(cfg.hidden_size)), ("vocab_size", int(m.lm_head.weight.shape[0])),
              ("n_layers", int(cfg.num_hidden_layers))]
    for field, have in checks:
        if int(header[field]) != have:
            raise HeadsModelMismatch(p, field, f"the heads were trained for a model with {field} {header[field]}, "
                                               f"but this model has {have} (heads for {header.get('model')!r})")
    _check_model(p, header, expected_model_id, expected_revision)
    vocab_ids = tensors.get("vocab_ids")
    k = header.get("vocab_subset")
    if (k is None) != (vocab_ids is None) or (vocab_ids is not None and vocab_ids.numel() != k):
        raise InputFileError(p, f"the header's vocab_subset {k} does not match the tensor ("
                                f"{'none' if vocab_ids is None else f'{vocab_ids.numel()} ids'})", "vocab_ids")
    if vocab_ids is not None:
        if vocab_ids.dim() != 1 or vocab_ids.numel() == 0 or vocab_ids.dtype.is_floating_point \
                or vocab_ids.dtype == torch.bool or int(vocab_ids.max()) >= header["vocab_size"] \
                or int(vocab_ids.min()) < 0 or vocab_ids.unique().numel() != vocab_ids.numel():
            raise InputFileError(p, "must be a non-empty 1-D tensor of distinct integer token ids below vocab_size",
                                 "vocab_ids")
    dev = m.lm_head.weight.device
    heads: dict[int, TranslatorHead] = {}
    n_layers = int(cfg.num_hidden_layers)
    d = int(cfg.hidden_size)
    for b in header["layers"]:
        if not isinstance(b, int) or not 1 <= b < n_layers:
            raise InputFileError(p, f"layer {b!r} outside 1..{n_layers - 1}", "layers")
        rank = int(header.get("rank") or 64)     # the tensors' shapes are checked against it below
        head = TranslatorHead(m, header["kind"], rank=rank, vocab_ids=vocab_ids)
        names = ["weight", "bias"] if header["kind"] == "affine" else ["u", "v", "bias"]
        state = {}
        for n in names:
            t = tensors.get(f"layer{b}.{n}")
            want = tuple(getattr(head, n).shape)
            if t is None:
                raise InputFileError(p, "tensor missing", f"layer{b}.{n}")
            if tuple(t.shape) != want:
                raise InputFileError(p, f"shape {tuple(t.shape)}, expected {want} for hidden size {d}",
                                     f"layer{b}.{n}")
            if not bool(torch.isfinite(t).all()):
                raise InputFileError(p, "holds NaN or infinite values", f"layer{b}.{n}")
            state[n] = t
        with torch.no_grad():
            for n, t in state.items():
                getattr(head, n).copy_(t.to(dev))
        head.eval()
        head.requires_grad_(False)
        heads[b] = head
    return heads, header
