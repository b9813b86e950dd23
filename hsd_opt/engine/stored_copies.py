"""Quantized copies kept on disk, so that a model's int8/int4 copy is quantized once, not by every process.

Quantizing the float32 weights of Qwen2.5-Coder-1.5B into the kernels' int4 copy takes about 16 s on 2 cores
(its int8 copy 13 s); reading the stored copy back takes about 3 s. A copy is stored only for a model that
says what its weights are: :func:`~hsd_opt.models.loading.load_model` sets ``model.hsd_weights_key`` (the
GGUF file's SHA-256, the hub commit, or a stamp of a local checkpoint's weights, with the dtype). Models built
in memory (tests, trained heads) have none and are quantized every time.

A stored copy lives under ``<cache>/quantized/`` (``$HSD_CACHE``, default ``~/.cache/hsd-opt``) in a file named
after the weights key and the setting (bits, head bits), and after the quantizer's code: a change to
:func:`~hsd_opt.engine.weights.quantize_q4` or :func:`~hsd_opt.engine.weights.quantize_q8` makes the old files
unreachable, and the next save of that model and setting removes them. Files are written atomically (a
temporary file renamed into place); each matrix's tensors are stored with the CRC-32 of their bytes, checked
once the matrix is copied into memory (one pass over its bytes). A file that cannot be read, or whose tensors do
not have the shapes the model needs or their checksum (changed in place on disk), is ignored (said once) and
written again; a failed write only costs the next process the quantization.

Within one process, a matrix is quantized once for every copy of its model at the same bits: the ``int4`` and
``int4-head4`` copies of a model share their layers' tensors and differ only in their heads (:func:`matrix`).
"""

from __future__ import annotations

import hashlib
import inspect
import warnings
import weakref
import zlib
from pathlib import Path

import torch

from hsd_opt.engine import kernels
from hsd_opt.engine import weights as wq
from hsd_opt.jsonio import atomic_write, remove_stale

#: Bumped when the stored layout changes in a way the quantizer's source does not show (2: each matrix's tensors
#: followed by their CRC-32).
FORMAT = 2

#: The matrices made in this process, by ``(id of the float weight, bits)``: two copies of one model at the same
#: bits (``int4`` and ``int4-head4``) share their layers' tensors instead of holding them twice. Both the weight
#: and the matrix are held weakly (an entry lives while some engine uses the matrix and the weight exists), with
#: what tells a weight changed since: its version counter, shape and first and last rows (not its storage:
#: :func:`~hsd_opt.models.memory.resident_weights` moves a weight's values into memory of its own when a float
#: engine over the model is built after a copy of it).
_IN_MEMORY: dict[tuple[int, int], tuple] = {}


def _stamp(weight: torch.Tensor) -> tuple:
    w = weight.detach()
    try:
        version = weight._version
    except RuntimeError:             # a tensor made under torch.inference_mode has no version counter
        version = None
    return version, tuple(w.shape), w[0].clone(), w[-1].clone()


def _same_stamp(a: tuple, b: tuple) -> bool:
    return a[:2] == b[:2] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


def _made(weight: torch.Tensor, bits: int, bias: torch.Tensor | None) -> wq.Mat | None:
    entry = _IN_MEMORY.get((id(weight), bits))
    if entry is None:
        return None
    w_ref, m_ref, stamp = entry
    mat = m_ref()
    if mat is None or w_ref() is not weight or not _same_stamp(stamp, _stamp(weight)):
        return None
    if (mat.bias is None) != (bias is None) or (bias is not None and not torch.equal(mat.bias, bias.detach().float())):
        return None
    return mat


def _remember(weight: torch.Tensor, bits: int, mat: wq.Mat) -> None:
    for key in [k for k, (w, m, _) in _IN_MEMORY.items() if w() is None or m() is None]:
        del _IN_MEMORY[key]
    _IN_MEMORY[(id(weight), bits)] = (weakref.ref(weight), weakref.ref(mat), _stamp(weight))


def _code_hash() -> str:
    src = "".join(inspect.getsource(f) for f in (wq.quantize_q4, wq.block_q4, wq.quantize_q8)) + str(FORMAT)
    return hashlib.sha256(src.encode()).hexdigest()[:12]


def weights_key(model) -> str | None:
    """The key a copy of ``model`` is stored under: its ``hsd_weights_key`` (None: not stored), the dtype of its
    weights now and a digest of a few of their rows (a model changed in place after loading, or converted to
    another dtype, does not find the copy of the weights it was loaded with)."""
    base = getattr(model, "hsd_weights_key", None)
    if not base:
        return None
    try:
        layers = model.model.layers
        probes = [model.lm_head.weight[0], layers[0].self_attn.q_proj.weight[0],
                  layers[-1].mlp.down_proj.weight[-1]]
    except (AttributeError, IndexError, TypeError):    # not a layout the kernels run: nothing to store
        return None
    h = hashlib.sha256()
    for t in probes:
        h.update(str(t.dtype).encode())
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return f"{base}|{h.hexdigest()[:16]}"


def stored_path(weights_key: str, bits: int, head_bits: int) -> Path:
    """Where the copy of the model with ``weights_key`` at this setting is stored."""
    from hsd_opt.cache import cache_dir

    model = hashlib.sha256(weights_key.encode()).hexdigest()[:20]
    return cache_dir() / "quantized" / f"{model}-int{bits}-head{head_bits}-{_code_hash()}.pt"


def load_stored(weights_key: str | None, bits: int, head_bits: int) -> StoredCopy | None:
    """The stored tensors of each matrix (``name -> Mat tensors + [CRC-32]``), or None (no key, no file,
    unreadable). The tensors are mapped from the file, read only when used; :func:`matrix` copies the ones it takes
    into memory and checks them there."""
    if not weights_key:
        return None
    path = stored_path(weights_key, bits, head_bits)
    if not path.is_file():
        return None
    try:   # mapped, not read: a matrix another copy already made (matrix) is never read from the file
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - a damaged file is ignored and written again
        return None
    if not isinstance(data, dict) or not all(isinstance(v, list) and v for v in data.values()):
        return None
    return StoredCopy(data, path)


class StoredCopy(dict):
    """The matrices of a stored copy (``name -> Mat tensors + [CRC-32]``), mapped from the file at ``path``."""

    def __init__(self, data: dict, path: Path):
        super().__init__(data)
        self.path = path
        self.said_changed = False       # a matrix's checksum failed, and it was said


def save_stored(weights_key: str | None, bits: int, head_bits: int, tensors: dict[str, list[torch.Tensor]]) -> None:
    """Store ``tensors`` (``name -> Mat tensors``) for the model with ``weights_key`` (nothing without one);
    files of the same model and setting from another quantizer version are removed."""
    if not weights_key:
        return
    path = stored_path(weights_key, bits, head_bits)
    checked = {name: [*ts, torch.tensor([_crc32(ts)], dtype=torch.int64)] for name, ts in tensors.items()}
    try:
        atomic_write(path, lambda f: torch.save(checked, f))   # streamed: a copy is up to a few GB
        stem = path.name.rsplit("-", 1)[0]
        for old in path.parent.glob(stem + "-*.pt"):
            if old != path:
                old.unlink(missing_ok=True)
        remove_stale(path.parent.glob(f".{stem}-*.pt.*.partial"))   # copies a killed process left half-written
    except OSError as e:
        warnings.warn(f"could not store the quantized copy in {path.parent} ({e}); it will be quantized again "
                      f"next time", stacklevel=2)


def matrix(stored: StoredCopy | None, name: str, bits: int, weight: torch.Tensor,
           bias: torch.Tensor | None, fresh: dict[str, list[torch.Tensor]]) -> wq.Mat:
    """The ``bits`` copy of ``weight`` for the kernels: the one another copy of this process already made of
    the same tensor (shared, not duplicated), else from ``stored`` when it holds ``name`` with the shapes this
    weight needs and its checksum, else quantized now (and its tensors recorded in ``fresh``, to be saved)."""
    rows, cols = weight.shape
    kind = wq.Q8 if bits == 8 else wq.Q4
    mat = _made(weight, bits, bias)
    if mat is not None:
        return mat
    tensors = _stored_tensors(stored, name, kind, rows, cols)
    if tensors is not None:
        mat = wq.Mat(kind, rows, cols, [t.to(weight.device) for t in tensors], bias)
    else:
        mat = wq.quantize(weight, bits, bias)
        fresh[name] = list(mat.tensors)
    _remember(weight, bits, mat)
    return mat


def _stored_tensors(stored: StoredCopy | None, name: str, kind: int, rows: int,
                    cols: int) -> list[torch.Tensor] | None:
    """The tensors of matrix ``name`` copied out of the mapped file (memory, not pages) where ``stored`` holds
    them with the shapes a ``rows`` x ``cols`` matrix of ``kind`` needs and their checksum, else None (a failed
    checksum said once)."""
    got = (stored or {}).get(name)
    if got is None or not _fits(got[:-1], kind, rows, cols) or not _is_crc(got[-1]):
        return None
    copied = [t.to("cpu", copy=True) for t in got[:-1]]
    if _crc32(copied) != int(got[-1][0]):
        _say_changed(stored)
        return None
    return copied


def _say_changed(stored: StoredCopy | None) -> None:
    """Warn, once per stored copy read, that a matrix of it does not match its checksum."""
    if stored is not None and not stored.said_changed:
        stored.said_changed = True
        warnings.warn(f"the stored quantized copy {stored.path} changed on disk (a matrix does not match its "
                      f"checksum); quantizing again and storing it anew", stacklevel=4)


def _is_crc(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.int64 and tuple(t.shape) == (1,)


def _crc32(tensors: list[torch.Tensor]) -> int:
    """CRC-32 of the bytes of ``tensors`` (CPU tensors), one after the other."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


def _fits(tensors: list[torch.Tensor], kind: int, rows: int, cols: int) -> bool:
    if kind == wq.Q8:
        return (len(tensors) == 2 and tensors[0].dtype == torch.int8 and tuple(tensors[0].shape) == (rows, cols)
                and tensors[1].dtype == torch.float32 and tuple(tensors[1].shape) == (rows,))
    G, B = cols // wq.GROUP, -(-rows // wq.Q4_BLOCK)
    return (len(tensors) == 3 and tensors[0].dtype == torch.uint8
            and tuple(tensors[0].shape) == (B, (G + 1) // 2, 512)
            and all(t.dtype == torch.float16 and tuple(t.shape) == (B, G, wq.Q4_BLOCK) for t in tensors[1:]))


def exact_int4_layers(model, weights: wq.ModelWeights, lib=None) -> list[dict[str, wq.Mat]]:
    """For each decoder layer of a float32 ``model`` (its ``weights`` read in place), the projections its int4 copy
    gives exactly (:func:`~hsd_opt.engine.weights.exact_int4`), by name (``q`` .. ``down``); empty dicts where none
    does. With the kernels' library ``lib`` (one that has ``hsd_exact_q4f``), each form is made by the kernels
    straight from the float32 weights and checked by them against every weight
    (:func:`~hsd_opt.engine.kernels.exact_q4f`; nothing read from disk). Else the int4 matrices are those of the
    model's ``int4`` copy: made once in this process (shared with an ``int4`` drafter of the model), read from its
    stored copy when there is one, else quantized now (not stored), and checked in torch. A model whose first
    projection is not exact is not tried further."""
    in_c = lib is not None and kernels.has(lib, "hsd_exact_q4f")
    stored = None if in_c else load_stored(weights_key(model), 4, 8)
    out: list[dict[str, wq.Mat]] = []
    for i, (layer, lw) in enumerate(zip(model.model.layers, weights.layers)):
        got: dict[str, wq.Mat] = {}
        for name, lin in wq.linears(layer).items():
            mat = getattr(lw, name)
            if mat.kind != wq.F32 or mat.tensors[0].dtype != torch.float32 or mat.cols % wq.GROUP:
                continue
            if in_c:
                exact = kernels.exact_q4f(lib, mat)
            else:
                q4 = matrix(stored, f"layers.{i}.{name}", 4, lin.weight, getattr(lin, "bias", None), {})
                exact = wq.exact_int4(mat, q4)
            if exact is None and not out and not got:
                return [{} for _ in weights.layers]
            if exact is not None:
                got[name] = exact
        out.append(got)
    return out
