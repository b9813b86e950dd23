"""The CPU decode kernels (``kernels.c``): build once, load with ctypes, describe weights to them.

At batch 1 a decode step reads every weight once, so on a CPU it is bound by memory bandwidth; torch's stock
float32 matrix-vector products and its per-operation overhead take several times that
(``docs/design.md#decode-kernels``). ``kernels.c`` runs a whole run of decoder layers, or the LM head, in one call
that streams each weight row once for every position of the pass, on the OpenMP threads torch itself uses.

- :func:`load` compiles ``kernels.c`` with the system C compiler the first time (about two seconds) into the cache
  directory (``$HSD_CACHE/kernels/<key>/``, keyed by the source, the compiler and this CPU's instruction set), and
  returns None where that is impossible (no compiler, not a CPU build, ``HSD_KERNELS=0``): callers then use their
  torch path.
- :class:`Mat` describes one weight matrix to the kernels without copying it (float32 or bfloat16 as stored) or
  holds a quantized copy (:func:`quantize_q8`, :func:`quantize_q4`).
- :class:`LayerStack` holds a model's layers as the kernels see them; :meth:`LayerStack.run` is one pass.

The kernels are batch-invariant: a pass over ``m`` positions gives, bit for bit, what ``m`` one-position passes
give, so verification in speculative decoding sees exactly the numbers a plain decode loop sees.

Units: shapes in elements; ``m`` positions per pass, ``hidden`` ``d``. Activations, keys and values float32.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Sequence

import torch

from hsd_opt.errors import HsdError

SOURCE = Path(__file__).with_name("kernels.c")
#: Matrix types the kernels read.
F32, BF16, Q8, Q4 = 0, 1, 2, 3
#: Input columns per int4 group (a scale and a minimum each).
GROUP = 32
#: Passes over more positions than this go through torch where an exact torch path exists (prefill of a float32
#: model: a blocked GEMM is faster there); quantized copies run such passes in chunks of this size.
MAX_PASS = 64

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11"]


class _CMat(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("rows", ctypes.c_int32), ("cols", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _CLayer(ctypes.Structure):
    _fields_ = [(n, _CMat) for n in ("q", "k", "v", "o", "gate", "up", "down")] + \
               [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p)]


class _CModel(ctypes.Structure):
    _fields_ = [("n_heads", ctypes.c_int32), ("n_kv", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("hidden", ctypes.c_int32), ("inter", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("layers", ctypes.POINTER(_CLayer))]


_LOCK = threading.Lock()
_LIB: list = []  # [ctypes.CDLL or None] once tried
_P = ctypes.c_void_p


def compiler() -> str | None:
    """The C compiler to build the kernels with: ``$CC``, else the first of cc, gcc, clang on the PATH."""
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags (Linux), else the processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path(cc: str, portable: bool = False) -> Path:
    """Where the compiled library for this source, compiler (``cc``) and CPU lives in the cache directory."""
    from hsd_opt.cache import cache_dir

    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = cc
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(_FLAGS).encode(), version.encode(), _cpu_key().encode(),
                 platform.machine().encode(), b"portable" if portable else b""):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / "kernels" / h.hexdigest()[:16] / "hsd_kernels.so"


def build(cc: str, out: Path, portable: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """Compile ``kernels.c`` into ``out`` (written atomically); ``portable`` leaves out the AVX2 code.

    Raises:
        HsdError: the compiler failed (its message is included).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"compiling the CPU decode kernels with {cc} (once per machine; a few seconds) ...")
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.partial")
    os.close(fd)
    cmd = [cc, *_FLAGS, *(["-DHSD_PORTABLE"] if portable else []), str(SOURCE), "-o", tmp, "-lm"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise HsdError(f"compiling {SOURCE.name} failed: {(res.stderr or res.stdout).strip()[:2000]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.hsd_version.restype = ctypes.c_int
    lib.hsd_simd.restype = ctypes.c_int
    lib.hsd_work_floats.restype = ctypes.c_long
    lib.hsd_work_floats.argtypes = [ctypes.POINTER(_CModel), ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.hsd_layers.restype = ctypes.c_int
    lib.hsd_layers.argtypes = [ctypes.POINTER(_CModel), ctypes.c_int, ctypes.c_int, _P, ctypes.c_int, ctypes.c_int,
                               _P, _P, _P, _P, ctypes.c_int, _P, ctypes.c_int]
    lib.hsd_linear.restype = ctypes.c_int
    lib.hsd_linear.argtypes = [ctypes.POINTER(_CMat), _P, ctypes.c_int, _P, _P, ctypes.c_int]
    lib.hsd_rows_f32.restype = ctypes.c_int
    lib.hsd_rows_f32.argtypes = [ctypes.POINTER(_CMat), _P, _P, ctypes.c_int, _P, _P]
    lib.hsd_rms_norm.restype = None
    lib.hsd_rms_norm.argtypes = [_P, ctypes.c_int, ctypes.c_int, _P, ctypes.c_float, _P]
    return lib


def load(log: Callable[[str], None] | None = None, portable: bool = False) -> ctypes.CDLL | None:
    """The kernels library (compiled on first use, then cached on disk), or None where it cannot be had: not
    x86-64/ARM Linux or macOS with a C compiler, ``HSD_KERNELS=0`` in the environment, or a failed build (then
    ``log`` is told why once). ``portable`` builds the variant without AVX2 code (for tests)."""
    if os.environ.get("HSD_KERNELS", "1").strip().lower() in ("0", "off", "no", "false"):
        return None
    with _LOCK:
        if not portable and _LIB:
            return _LIB[0]
        lib = None
        cc = compiler()
        if cc is not None:
            try:
                path = library_path(cc, portable)
                if not path.is_file():
                    build(cc, path, portable, log)
                lib = _bind(ctypes.CDLL(str(path)))
            except (HsdError, OSError, subprocess.SubprocessError) as e:
                if log:
                    log(f"the CPU decode kernels are unavailable ({e}); using torch's operations")
                lib = None
        elif log:
            log("no C compiler found (cc, gcc or clang; or set CC): using torch's operations")
        if not portable:
            _LIB.append(lib)
        return lib


def load_for_model(problem: str | None, required: bool) -> ctypes.CDLL | None:
    """The library for an engine whose layout check gave ``problem`` (None: the kernels can run it): None when
    there is a problem or the library cannot be had, or :class:`HsdError` naming why when ``required``."""
    lib = load() if problem is None else None
    if problem is None and lib is None:
        problem = "the kernels are unavailable (no C compiler, or HSD_KERNELS=0)"
    if problem is not None and required:
        raise HsdError(f"kernels: {problem}")
    return lib


def available(device: torch.device | str) -> bool:
    """True when the kernels can run passes on ``device`` (CPU only) and the library loads."""
    return torch.device(device).type == "cpu" and load() is not None


# ------------------------------------------------------------------------------------------------ matrices


class Mat:
    """One weight matrix ``[rows, cols]`` as the kernels read it; keeps the tensors it points to alive.

    Build with :meth:`dense` (float32 / bfloat16 weights used in place), :func:`quantize_q8` or :func:`quantize_q4`.
    ``bias`` is kept as float32 (a copy when the model stores another dtype)."""

    def __init__(self, kind: int, rows: int, cols: int, tensors: Sequence[torch.Tensor | None],
                 bias: torch.Tensor | None):
        self.kind, self.rows, self.cols = kind, rows, cols
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.tensors = [t for t in tensors]
        w, scale, zero = (list(tensors) + [None, None, None])[:3]
        self.c = _CMat(kind, rows, cols, 0, w.data_ptr(), _ptr(scale), _ptr(zero), _ptr(self.bias))

    @classmethod
    def dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Mat":
        """A float32 or bfloat16 ``[rows, cols]`` weight, read in place (it must be contiguous on the CPU)."""
        w = weight.detach()
        if w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu" or not w.is_contiguous():
            raise HsdError(f"kernels: expected a contiguous float32/bfloat16 CPU weight, got {w.dtype} on {w.device}")
        return cls(F32 if w.dtype == torch.float32 else BF16, w.shape[0], w.shape[1], [w], bias)

    def nbytes(self) -> int:
        """Bytes a pass reads for this matrix."""
        return sum(t.numel() * t.element_size() for t in self.tensors if t is not None)

    def dequantized(self) -> torch.Tensor:
        """The matrix as float32 ``[rows, cols]`` (what the kernels compute with)."""
        w = self.tensors[0]
        if self.kind in (F32, BF16):
            return w.float()
        if self.kind == Q8:
            return w.float() * self.tensors[1][:, None]
        g = q4_codes(self).float() * self.tensors[1].float()[..., None] + self.tensors[2].float()[..., None]
        return g.reshape(self.rows, self.cols)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quantize_q8(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Mat:
    """Symmetric int8 per output row: ``w ~ code * scale[r]``, ``scale = max|w[r]| / 127``."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    q = torch.empty(w.shape, dtype=torch.int8)
    for a in range(0, w.shape[0], 4096):        # a block of rows at a time (the same values, in cache)
        q[a:a + 4096] = torch.round(w[a:a + 4096] / scale[a:a + 4096, None]).clamp_(-127, 127)
    return Mat(Q8, w.shape[0], w.shape[1], [q, scale.contiguous()], bias)


def quantize_q4(weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = GROUP) -> Mat:
    """Asymmetric int4 in groups of 32 input columns: ``w ~ code * scale + minimum`` per group (``scale = (max -
    min) / 15``, scale and minimum stored as float16), the scheme of GGUF's Q4_1, whose codes, scales and minimums
    it recovers exactly from de-quantized Q4_1 weights.
    Stored as bytes ``[rows, pairs, 32]`` with ``pairs = ceil(groups / 2)``: byte ``j`` of pair ``p`` holds code
    ``j`` of group ``2p`` (low nibble) and code ``j`` of group ``2p + 1`` (high nibble), so one 32-byte load and
    a mask (or a shift and a mask) give a group's 32 codes in column order."""
    if group_size != GROUP:
        raise HsdError(f"kernels: int4 groups are {GROUP} columns, got {group_size}")
    w = weight.detach().float()
    N, K = w.shape
    if K % GROUP:
        raise HsdError(f"int4 quantization needs input width divisible by {GROUP}, got {K}")
    wg = w.reshape(N, K // GROUP, GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)
    # scale and minimum in float16 (as Q4_1 stores them); the codes are rounded against those stored values
    step = ((hi - lo) / 15.0).clamp_min(6.1e-5).half()
    lo = lo.half()
    sf, lf = step.float(), lo.float()
    q = torch.round((wg - lf[..., None]) / sf[..., None]).clamp_(0, 15).to(torch.uint8)
    G = K // GROUP
    if G % 2:
        q = torch.cat([q, torch.zeros(N, 1, GROUP, dtype=torch.uint8)], 1)
    q = q.reshape(N, -1, 2, GROUP)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()
    return Mat(Q4, N, K, [packed, step.contiguous(), lo.contiguous()], bias)


def q4_codes(mat: Mat) -> torch.Tensor:
    """The codes of an int4 :class:`Mat` as uint8 ``[rows, groups, 32]`` in column order (0..15)."""
    packed = mat.tensors[0]
    pairs = torch.stack([packed & 15, packed >> 4], 2)      # [rows, pairs, 2, 32]
    return pairs.reshape(mat.rows, -1, GROUP)[:, : mat.cols // GROUP]


def quantize(weight: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> Mat:
    """:func:`quantize_q8` (``bits=8``) or :func:`quantize_q4` (``bits=4``)."""
    if bits == 8:
        return quantize_q8(weight, bias)
    if bits == 4:
        return quantize_q4(weight, bias)
    raise HsdError(f"unsupported bit width {bits} (expected 8 or 4)")


# ------------------------------------------------------------------------------------------------ a model


class LayerMats:
    """One decoder layer's matrices and norm weights for :class:`LayerStack`."""

    def __init__(self, q: Mat, k: Mat, v: Mat, o: Mat, gate: Mat, up: Mat, down: Mat, ln1: torch.Tensor,
                 ln2: torch.Tensor):
        self.mats = (q, k, v, o, gate, up, down)
        self.ln1 = ln1.detach().float().contiguous()
        self.ln2 = ln2.detach().float().contiguous()

    def nbytes(self) -> int:
        return sum(m.nbytes() for m in self.mats)


class DenseLayer:
    """One layer's weights as float32 ``[out, in]`` tensors and biases, named as the engine's torch path reads
    them (``q, bq, k, bk, ..., ln1, eps1, act``)."""

    def __init__(self, lm: LayerMats, eps1: float, eps2: float):
        import torch.nn.functional as F

        names = ("q", "k", "v", "o", "gate", "up", "down")
        for name, m in zip(names, lm.mats):
            setattr(self, name, m.dequantized())
            setattr(self, "b" + name, m.bias)
        self.ln1, self.ln2, self.eps1, self.eps2 = lm.ln1, lm.ln2, eps1, eps2
        self.act, self.qk_norm = F.silu, False


class LayerStack:
    """A model's decoder layers as the kernels see them (pre-norm, rotary, grouped-query attention, SiLU MLP).

    Args:
        lib: the library from :func:`load`.
        layers: one :class:`LayerMats` per decoder layer.
        n_heads, n_kv, head_dim, hidden, inter: the attention and MLP shapes.
        eps1, eps2: the input and post-attention RMSNorm epsilons (the same for every layer).
    """

    def __init__(self, lib, layers: Sequence[LayerMats], n_heads: int, n_kv: int, head_dim: int, hidden: int,
                 inter: int, eps1: float, eps2: float):
        self.lib, self.layers = lib, list(layers)
        arr = (_CLayer * len(self.layers))()
        for i, lm in enumerate(self.layers):
            cl = arr[i]
            for name, m in zip(("q", "k", "v", "o", "gate", "up", "down"), lm.mats):
                setattr(cl, name, m.c)
            cl.ln1, cl.ln2 = lm.ln1.data_ptr(), lm.ln2.data_ptr()
        self._arr = arr
        self.c = _CModel(n_heads, n_kv, head_dim, hidden, inter, 0, eps1, eps2,
                         ctypes.cast(arr, ctypes.POINTER(_CLayer)))
        self.hidden = hidden
        self.eps1, self.eps2 = eps1, eps2
        self._work = torch.empty(0)
        self._xg = torch.empty(0)

    def nbytes(self) -> int:
        return sum(lm.nbytes() for lm in self.layers)

    def dense_layer(self, l: int) -> "DenseLayer":
        """Layer ``l``'s weights as float32 tensors (converted or de-quantized for one pass; float32 weights are
        the stored tensors themselves), in the fields the engine's torch path reads."""
        return DenseLayer(self.layers[l], self.eps1, self.eps2)

    def _work_for(self, m: int, cache_len: int, nt: int) -> torch.Tensor:
        need = int(self.lib.hsd_work_floats(ctypes.byref(self.c), m, cache_len, nt))
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        return self._work

    def run(self, l0: int, l1: int, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
            kptrs, vptrs, cache_len: int) -> torch.Tensor:
        """Layers ``l0 .. l1-1`` on ``x`` ``[m, hidden]`` (float32, updated in place and returned) at positions
        ``start .. start+m-1``; ``cos``/``sin`` ``[m, head_dim]`` float32; ``kptrs``/``vptrs``: :func:`cache_ptrs`
        of the layers' caches ``[1, n_kv, cache_len, head_dim]`` float32."""
        x = x.contiguous()
        m = x.shape[0]
        nt = torch.get_num_threads()
        work = self._work_for(m, cache_len, nt)
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = self.lib.hsd_layers(ctypes.byref(self.c), l0, l1, x.data_ptr(), m, start, cos.data_ptr(),
                                 sin.data_ptr(), kptrs, vptrs, cache_len, work.data_ptr(), nt)
        if rc != 0:
            raise HsdError(f"kernels: bad pass (layers {l0}..{l1 - 1}, {m} positions from {start}, cache {cache_len})")
        return x

    def linear(self, mat: Mat, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T (+ b)`` for ``x`` ``[m, cols]`` float32 -> ``[m, rows]`` float32."""
        return linear(self.lib, mat, x)


def linear(lib, mat: Mat, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ b)`` with the kernels: ``x`` ``[m, cols]`` float32 -> ``[m, rows]`` float32."""
    x = x.float().contiguous()
    m = x.shape[0]
    y = out if out is not None else torch.empty(m, mat.rows, dtype=torch.float32)
    nt = torch.get_num_threads()
    work = torch.empty(nt * 4 * mat.cols, dtype=torch.float32) if mat.kind != F32 else None
    rc = lib.hsd_linear(ctypes.byref(mat.c), x.data_ptr(), m, y.data_ptr(), _ptr(work), nt)
    if rc != 0:
        raise HsdError("kernels: bad linear call")
    return y


def rows_f32(lib, mat: Mat, rows: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``W[rows[j]] . x[positions[j]] (+ b)`` for a float32 :class:`Mat` -> ``[n]`` float32, each value exactly
    what :func:`linear` gives at that row and position. ``rows``/``positions``: int64 ``[n]``, the pairs of one
    position adjacent; ``x`` ``[m, cols]`` float32."""
    x = x.float().contiguous()
    rows, positions = rows.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    y = torch.empty(rows.numel(), dtype=torch.float32)
    if (positions.numel() and int(positions.max()) >= x.shape[0]) or \
            lib.hsd_rows_f32(ctypes.byref(mat.c), rows.data_ptr(), positions.data_ptr(), rows.numel(),
                             x.data_ptr(), y.data_ptr()) != 0:
        raise HsdError("kernels: bad rows call")
    return y


def rms_norm(lib, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[m, d]`` float32 with float32 ``weight`` ``[d]`` (the kernels' own, batch-invariant)."""
    x = x.float().contiguous()
    out = torch.empty_like(x)
    lib.hsd_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), float(eps), out.data_ptr())
    return out


def cache_ptrs(caches: Sequence[torch.Tensor]):
    """A ctypes array of the caches' data pointers (what :meth:`LayerStack.run` takes for keys or values)."""
    arr = (ctypes.c_void_p * len(caches))(*[c.data_ptr() for c in caches])
    return arr
