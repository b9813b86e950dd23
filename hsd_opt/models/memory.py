"""Where a loaded model's weights live in memory: resident, contiguous, on huge pages where the OS offers them.

``transformers`` loads safetensors files by mapping them: the weights stay pages of the file, read from disk on
first touch and dropped again whenever the OS needs memory (then a decode step that should take milliseconds
waits on the disk). A decoder reads every weight on every step, so on a CPU we copy them once into one anonymous
buffer, advised for transparent huge pages on Linux (fewer TLB misses when a step streams hundreds of
megabytes). Tied weights (an embedding shared with the LM head) stay shared.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from typing import Callable, Iterable

_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_HUGE = 2 << 20  # bytes of a huge page on x86-64 and most ARM Linux systems


def _madvise(addr: int, length: int, advice: int) -> bool:
    """``madvise(addr, length, advice)`` through libc on Linux; False elsewhere or when it fails."""
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):
        return False


def drop_pages(tensor) -> int:
    """Give the memory under ``tensor`` back to the OS when it is a view into a larger buffer
    (:func:`resident_weights`), which dropping the tensor would not free: ``madvise(MADV_DONTNEED)`` on the whole
    pages inside its bytes (Linux). The caller guarantees nothing reads them again (they would read zeros).
    Returns the bytes given back (0 elsewhere, or for a tensor that owns its storage: dropping it frees that)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() <= nbytes:
        return 0
    page = 4096
    lo = (tensor.data_ptr() + page - 1) // page * page
    hi = (tensor.data_ptr() + nbytes) // page * page
    return hi - lo if _madvise(lo, hi - lo, _MADV_DONTNEED) else 0


#: Each model's parameters and buffers already moved by :func:`resident_weights`, by id (held weakly, beside the
#: model; a tensor compares by value, so a weak set of them cannot tell one from another).
_MOVED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _was_moved(moved: dict, t) -> bool:
    ref = moved.get(id(t))
    return ref is not None and ref() is t


def complete_residency(model, keep_in_place: Iterable = ()) -> int:
    """:func:`resident_weights` for what is left of a model made resident in part (``load_model`` for the engines
    alone leaves its matrices in the file's pages until a float engine reads them); a model never made resident
    (built in memory, not loaded) is left as it is. ``keep_in_place``: parameters left in the file's pages, which
    the engine reads in another form on every step (a later call may still move them). Returns the bytes moved."""
    if model not in _MOVED:
        return 0
    kept = {id(t) for t in keep_in_place}
    names = {name for name, t in model.named_parameters() if id(t) in kept}
    return resident_weights(model, which=lambda name: name not in names)


def resident_weights(model, which: Callable[[str], bool] | None = None) -> int:
    """Move every parameter and buffer of ``model`` (on the CPU) into one anonymous, huge-page-advised buffer,
    keeping shapes, dtypes and ties; return the bytes moved (0 for a model that is not on the CPU).

    The model's tensors become views into the buffer (``param.data`` is replaced), so the modules and every
    engine that reads the weights see the same memory. ``which(name)``: move only the tensors whose names it
    accepts (``model.named_parameters()``'s and ``named_buffers()``'s; default: all). A tensor moved by an earlier
    call stays where it is, so a model can be made resident in parts: what every engine reads at load, the
    matrices when an engine reads them in place."""
    import torch

    named = list(model.named_parameters()) + list(model.named_buffers())
    if not named or any(t.device.type != "cpu" for _, t in named):
        return 0
    moved = _MOVED.setdefault(model, {})
    tensors = [t for name, t in named if not _was_moved(moved, t) and (which is None or which(name))]
    if not tensors:
        return 0
    groups: dict[tuple[int, tuple, torch.dtype], list] = {}
    for t in tensors:   # tied tensors share storage and layout: move them once
        groups.setdefault((t.data_ptr(), tuple(t.shape), t.dtype), []).append(t)
    sizes = [(ts, (ts[0].numel() * ts[0].element_size() + 63) // 64 * 64) for ts in groups.values()]
    total = sum(n for _, n in sizes)
    buf = torch.empty(total + _HUGE, dtype=torch.uint8)
    start = (-buf.data_ptr()) % _HUGE
    _madvise(buf.data_ptr() + start, total, _MADV_HUGEPAGE)
    off = start
    with torch.no_grad():
        for ts, n in sizes:
            src = ts[0].data
            view = buf[off: off + src.numel() * src.element_size()].view(src.dtype).view(src.shape)
            view.copy_(src)
            for t in ts:
                t.data = view
                moved[id(t)] = weakref.ref(t)
            off += n
    return total
