"""The C kernels backend (``kernels.c``): build once, load with ctypes, run a model's layers and head on them.

At batch 1 a decode step reads every weight once, so on a CPU it is bound by memory bandwidth; torch's stock
float32 matrix-vector products and its per-operation overhead take several times that
(``docs/design.md#decode-kernels``). ``kernels.c`` runs a whole run of decoder layers, or the LM head, in one call
that streams each weight row once for every position of the pass, on the OpenMP threads torch itself uses.

- :func:`load` compiles ``kernels.c`` with the system C compiler the first time (about two seconds) into the cache
  directory (``$HSD_CACHE/kernels/<key>/``, keyed by the source, the compiler and this CPU's instruction set),
  checks that the library's structs are laid out as this module's (:data:`ABI_VERSION` and the struct sizes), and
  returns None where that is impossible (no compiler, not a CPU build, ``HSD_KERNELS=0``): engines then use the
  torch path (:mod:`hsd_opt.engine.torch_path`), with one warning (:func:`unavailable_warning`).
- :class:`KernelPath` holds a model's :class:`~hsd_opt.engine.weights.ModelWeights` as the kernels see them (no
  copies of the weights); :meth:`KernelPath.layers` is one pass, :meth:`KernelPath.head` the LM head.

The kernels are batch-invariant: a pass over ``m`` positions gives, bit for bit, what ``m`` one-position passes
give, so verification in speculative decoding sees exactly the numbers a plain decode loop sees.

Units: shapes in elements; ``m`` positions per pass, ``hidden`` ``d``. Activations, keys and values float32.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import struct
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from hsd_opt.cache import UnwritableFolder
from hsd_opt.engine import variants
from hsd_opt.engine.interface import EXACT_PASS
from hsd_opt.engine.state import DecodeState, Rows
from hsd_opt.engine.variants import Variant
from hsd_opt.engine.weights import BF16, F32, GROUP, PROJECTIONS, Q4F, Q8, Q8F, Mat, ModelWeights
from hsd_opt.errors import HsdError
from hsd_opt.values import env_switch

SOURCE = Path(__file__).with_name("kernels.c")
#: The layout of the structs below; ``hsd_version()`` in ``kernels.c`` returns the same number. Bump both when a
#: struct or a function's arguments change.
ABI_VERSION = 17
#: Passes over more positions than this go through torch where an exact torch path exists (prefill of a float32
#: model: a blocked GEMM is faster there); quantized copies run such passes on the kernels too (in calls of at most
#: :data:`BATCH_ROWS` positions).
MAX_PASS = EXACT_PASS
#: A float32 model's prompt of this many positions or more takes the torch path (its blocked GEMMs are faster
#: there; docs/results.md, "a prompt's pass on the torch path"); shorter prompts, and later passes up to MAX_PASS
#: positions, the kernels. For a library with 8-lane tiles (AVX2); see PREFILL_ON_TORCH_FROM_WIDE.
PREFILL_ON_TORCH_FROM = 40
#: The same for a library with 16-lane float32 tiles (AVX-512, ``hsd_simd() == 2``), which stays ahead of the
#: torch path over more positions (``benchmarks/prefill_path.py``).
PREFILL_ON_TORCH_FROM_WIDE = 64
#: The same for a library reading every projection in the exact int4 form (``Q4F``) with 16-lane tiles (AVX-512):
#: its passes read the weights from the first-level cache once de-quantized, and stay ahead of the torch path up to
#: 512 positions in one pass, so every pass of a prompt (at most ``PREFILL_CHUNK``, 256) is theirs. A prompt computed
#: on the kernels alone is computed as its steps compute it, so a later prompt may take its positions
#: (``DecodeState.stepwise``).
PREFILL_ON_TORCH_FROM_EXACT = 513
#: The same with 8-lane tiles (AVX2, NEON): on a Zen 3, the AVX2-only CPU they are for, the torch path is faster
#: from about 112 positions (2026-12-05, ``benchmarks/prefill_path.py``: torch/kernels 1.26 at 80, 1.06 at 96, 0.99
#: at 112, 0.78-0.89 at 256 to 512 in one pass, 0.73-0.87 over the runtime's passes of 256 to 1,000 positions;
#: 2026-11-28: 1.08 at 96, 0.98 at 128). The AVX2 build on a Zen 5 (four 256-bit FMA pipes) stayed ahead to 1,000;
#: such a CPU runs the AVX-512 library. NEON is not timed (no Arm machine here): the same value.
PREFILL_ON_TORCH_FROM_EXACT_NARROW = 112
#: A prompt's pass that ends beyond this many positions takes the torch path whatever its length: over a long
#: context the kernels' attention (a query at a time) loses ground to torch's (``benchmarks/prefill_path.py
#: --chunked``: a prompt of 1,000 positions 1.07-1.13x faster all on the kernels, of 2,000 0.90-1.10x).
PREFILL_ON_KERNELS_WITHIN = 1024
#: The same for a 16-lane library (AVX-512): its attention of several rows at a time stays ahead further
#: (``benchmarks/prefill_path.py --chunked`` on a Zen 5, 2026-12-05: torch/kernels 1.56 at 1,000 positions, 1.27 at
#: 2,000, 1.13 at 4,000; the AVX2 build there 0.84 at 2,000 and 0.73 at 4,000).
PREFILL_ON_KERNELS_WITHIN_WIDE = 4096
#: Rows of a matrix the kernels expand at a time into a thread's scratch (``HSD_SCRATCH_ROWS`` in ``kernels.c``).
SCRATCH_ROWS = 8
#: Rows computed in one call at most (of one sequence or several; a pass over more takes several calls).
BATCH_ROWS = 256
#: What the torch path costs where the kernels are unavailable, for the warning that says so
#: (docs/results.md, "the decode kernels against the torch path"; benchmarks/torch_path.py).
TORCH_PATH_SLOWDOWN = "about 2x slower per float32 step, 5x per int4 step"

class _CMat(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("rows", ctypes.c_int32), ("cols", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _CLayer(ctypes.Structure):
    _fields_ = [(n, _CMat) for n in PROJECTIONS] + [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p)]


class _CModel(ctypes.Structure):
    _fields_ = [("n_heads", ctypes.c_int32), ("n_kv", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("hidden", ctypes.c_int32), ("inter", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("layers", ctypes.POINTER(_CLayer))]


_LOCK = threading.Lock()
_LIB: list = []  # [ctypes.CDLL or None] once tried
_P = ctypes.c_void_p
_SCRATCH = threading.local()


def scratch(name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer of at least ``n`` values kept per thread under ``name`` (a kernel's scratch or output read within
    one call: a fresh one per call costs page faults, the allocator handing large blocks back and taking them
    again)."""
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = torch.empty(n, dtype=dtype)
        setattr(_SCRATCH, name, buf)
    return buf


def compiler() -> str | None:
    """The C compiler to build the kernels with: ``$CC``, else the first of cc, gcc, clang on the PATH (None: none).

    Raises:
        HsdError: ``$CC`` is set to a program that is not there, or to several words (``ccache gcc``: the build
            runs one program), rather than building with another compiler than the one asked for.
    """
    asked = os.environ.get("CC", "").strip()
    if asked:
        if len(asked.split()) > 1:
            raise HsdError(f"CC={asked!r}: give one compiler program (a path, or a name on PATH) to build the kernels "
                           f"with, or unset CC")
        if not shutil.which(asked):
            raise HsdError(f"CC={asked}: no such program (a path, or a name on PATH); unset CC to use cc, gcc or "
                           f"clang")
        return asked
    for cc in ("cc", "gcc", "clang"):
        if shutil.which(cc):
            return cc
    return None


def openmp_wanted() -> bool:
    """False where ``HSD_OPENMP=0`` asks for a build without OpenMP (what a compiler that cannot build with it gets
    anyway: the kernels then run on the calling thread)."""
    return env_switch("HSD_OPENMP", True)


def libomp_dir(cc: str | None = None) -> Path | None:
    """The folder of an LLVM OpenMP runtime (``libomp``) to build with, where the compiler's ``-fopenmp`` alone does
    not link one: ``$HSD_LIBOMP`` (a folder holding ``libomp.dylib`` or ``libomp.so``; clang only) on any system;
    with Apple's clang, the copy inside torch (``torch/lib``: the runtime torch itself loads, so that the process
    holds one), else Homebrew's (``brew install libomp``). None: plain ``-fopenmp``.

    Raises:
        HsdError: ``$HSD_LIBOMP`` names a folder without the runtime, or the compiler is not clang.
    """
    forced = os.environ.get("HSD_LIBOMP", "").strip()
    cc = cc or compiler()
    if forced:
        d = Path(forced).expanduser()
        if not any((d / f"libomp.{ext}").is_file() for ext in ("dylib", "so")):
            raise HsdError(f"HSD_LIBOMP={forced}: no libomp.dylib or libomp.so in that folder")
        if cc and "clang" not in _compiler_version(cc):
            raise HsdError(f"HSD_LIBOMP={forced}: an LLVM OpenMP runtime is linked by clang; the compiler {cc} is "
                           f"not clang (set CC=clang, or unset HSD_LIBOMP for its own -fopenmp)")
        return d
    if platform.system() != "Darwin" or not cc or "Apple clang" not in _compiler_version(cc):
        return None
    for d in (Path(torch.__file__).parent / "lib", Path("/opt/homebrew/opt/libomp/lib"),
              Path("/usr/local/opt/libomp/lib")):
        if (d / "libomp.dylib").is_file():
            return d
    return None


def _openmp_flags(cc: str | None) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) that build with OpenMP threads: ``-fopenmp``, or with :func:`libomp_dir`'s
    runtime, clang's ``-Xclang -fopenmp`` linked to it (its ``omp.h`` where it lies beside it or in a sibling
    ``include``; kernels.c declares the two functions it calls where there is none)."""
    d = libomp_dir(cc)
    if d is None:
        return ["-fopenmp"], []
    inc = next((c for c in (d, d.parent / "include") if (c / "omp.h").is_file()), None)
    return ["-Xclang", "-fopenmp", *([f"-I{inc}"] if inc else [])], [f"-L{d}", "-lomp", f"-Wl,-rpath,{d}"]


def flags(variant: Variant, openmp: bool = True, cc: str | None = None) -> list[str]:
    """The compiler flags of ``variant``'s library built by ``cc`` (default :func:`compiler`): explicit instruction
    sets, never ``-march=native``; with ``openmp``, :func:`_openmp_flags`'s."""
    return [*variants.COMMON_FLAGS, *variant.flags, *(_openmp_flags(cc)[0] if openmp else [])]


def link_flags(openmp: bool = True, cc: str | None = None) -> list[str]:
    """What follows the source on the command line: the OpenMP runtime where :func:`libomp_dir` names one, libm."""
    return [*(_openmp_flags(cc)[1] if openmp else []), "-lm"]


def _variant(variant: Variant | str) -> Variant:
    return variants.BY_NAME[variant] if isinstance(variant, str) else variant


@functools.lru_cache(maxsize=None)
def _compiler_version(cc: str) -> str:
    """What ``cc --version`` says (asked once per compiler and process), or ``cc`` where it cannot be run."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc


def library_path(cc: str, variant: Variant | str = "portable", openmp: bool = True) -> Path:
    """Where the library of ``variant`` built by ``cc`` (with or without OpenMP) lives in the cache directory:
    keyed by the source, the compiler's version and the flags (explicit, so one cache serves every CPU that runs
    the variant)."""
    from hsd_opt.cache import cache_dir

    variant = _variant(variant)
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags(variant, openmp, cc) + link_flags(openmp, cc)).encode(),
                 _compiler_version(cc).encode(),
                 variants.machine().encode()):
        h.update(part)
        h.update(b"\0")
    suffix = "" if openmp else "-noomp"
    return cache_dir() / "kernels" / h.hexdigest()[:16] / f"hsd_kernels-{variant.name}{suffix}.so"


class BuildStopped(HsdError):
    """The compiler did not finish for a reason of the moment (killed by a signal, as the out-of-memory killer does;
    out of memory or disk; past the time allowed): the build is tried again next time, not remembered as one the
    compiler cannot make."""


#: What a compiler driver says when the program it ran was stopped, or the machine ran out of something (gcc: "Killed
#: signal terminated program cc1"; clang: "... failed due to signal", "unable to execute command").
_STOPPED = re.compile(r"signal terminated program|due to signal|unable to execute command|no space left on device|"
                      r"cannot allocate memory|out of memory|virtual memory exhausted", re.IGNORECASE)


def build(cc: str, out: Path, variant: Variant | str = "portable", log: Callable[[str], None] | None = None,
          source: Path | None = None, defines: Sequence[str] = (), openmp: bool = True) -> Path:
    """Compile ``kernels.c`` (or ``source``, another version of it) for ``variant`` into ``out`` (written
    atomically); ``defines``: more macros to define; ``openmp``: with OpenMP threads.

    Raises:
        HsdError: the compiler failed (its message is included); :class:`BuildStopped` where it was stopped.
    """
    from hsd_opt.cache import cache_error
    from hsd_opt.jsonio import FOLDER_MODE, remove_stale

    variant = _variant(variant)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out.parent.glob("*.so.partial"))     # what a compiler wrote on for a killed build, long ago
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.partial")
    except OSError as e:
        raise cache_error("the compiled kernels", out.parent, e) from None
    if log:
        log(f"compiling the CPU decode kernels ({variant.name}{'' if openmp else ', no OpenMP'}) with {cc} "
            f"(once per machine; a few seconds) ...")
    os.close(fd)
    source = source or SOURCE
    cmd = [cc, *flags(variant, openmp, cc), *(f"-D{d}" for d in defines), str(source), "-o", tmp,
           *link_flags(openmp, cc)]
    what = f"compiling {source.name} ({variant.name}) with {cc}"
    try:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise BuildStopped(f"{what} took more than 600 s and was stopped") from None
        if res.returncode != 0:
            said = (res.stderr or res.stdout).strip()[:2000]
            stopped = res.returncode < 0 or _STOPPED.search(said) is not None
            raise (BuildStopped if stopped else HsdError)(
                f"{what} {'was stopped' if stopped else 'failed'}: "
                f"{said or f'exit status {res.returncode}, nothing said'}")
        os.chmod(tmp, FOLDER_MODE)  # a library readable by all who share the cache (mkstemp made it private)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.hsd_version.restype = ctypes.c_int
    lib.hsd_simd.restype = ctypes.c_int
    try:
        lib.hsd_features.restype = ctypes.c_int
    except AttributeError:          # a library of an older kernels.c (benchmarks/kernels_ab.py's baseline)
        pass
    lib.hsd_layout.restype = None
    lib.hsd_layout.argtypes = [ctypes.POINTER(ctypes.c_long)]
    lib.hsd_team.restype = ctypes.c_int
    lib.hsd_team.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_long)]
    lib.hsd_work_floats.restype = ctypes.c_long
    lib.hsd_work_floats.argtypes = [ctypes.POINTER(_CModel), ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.hsd_layers.restype = ctypes.c_int
    lib.hsd_layers.argtypes = [ctypes.POINTER(_CModel), ctypes.c_int, ctypes.c_int, _P, ctypes.c_int, _P, _P, _P,
                               _P, _P, _P, _P, _P, ctypes.c_int]
    lib.hsd_linear.restype = ctypes.c_int
    lib.hsd_linear.argtypes = [ctypes.POINTER(_CMat), _P, ctypes.c_int, _P, _P, ctypes.c_int]
    lib.hsd_rows_f32.restype = ctypes.c_int
    lib.hsd_rows_f32.argtypes = [ctypes.POINTER(_CMat), _P, _P, ctypes.c_int, _P, _P]
    lib.hsd_screen_q16.restype = ctypes.c_int
    lib.hsd_screen_q16.argtypes = [ctypes.c_int]
    lib.hsd_screen_i16.restype = ctypes.c_int
    lib.hsd_screen_i16.argtypes = [_P, _P, ctypes.c_int, ctypes.c_int, _P, ctypes.c_int, _P, ctypes.c_int]
    lib.hsd_screen_bounds.restype = ctypes.c_int
    lib.hsd_screen_bounds.argtypes = [_P, ctypes.c_int, ctypes.c_int, ctypes.c_int, _P, _P, ctypes.c_int, _P]
    lib.hsd_screen_pick.restype = ctypes.c_int
    lib.hsd_screen_pick.argtypes = [ctypes.POINTER(_CMat), _P, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P,
                                    ctypes.c_int, _P, ctypes.c_int]
    lib.hsd_screen_window.restype = ctypes.c_int
    lib.hsd_screen_window.argtypes = [ctypes.POINTER(_CMat), _P, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P,
                                      ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_float, _P, _P, _P,
                                      ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, ctypes.c_int]
    lib.hsd_rms_norm.restype = None
    lib.hsd_rms_norm.argtypes = [_P, ctypes.c_int, ctypes.c_int, _P, ctypes.c_float, _P]
    try:
        lib.hsd_exact_q4f.restype = ctypes.c_long
        lib.hsd_exact_q4f.argtypes = [_P, ctypes.c_int, ctypes.c_int, _P, _P, _P, ctypes.c_int]
        lib.hsd_exact_q8f.restype = ctypes.c_long
        lib.hsd_exact_q8f.argtypes = [_P, ctypes.c_int, ctypes.c_int, _P, _P, ctypes.c_int]
        lib.hsd_exact_mismatch.restype = ctypes.c_long
        lib.hsd_exact_mismatch.argtypes = [ctypes.POINTER(_CMat), _P, ctypes.c_int]
        lib.hsd_screen_codes.restype = ctypes.c_int
        lib.hsd_screen_codes.argtypes = [_P, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, ctypes.c_int]
        lib.hsd_gumbel.restype = None
        lib.hsd_gumbel.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_float, _P, ctypes.c_int]
        lib.hsd_log_rows.restype = None
        lib.hsd_log_rows.argtypes = [_P, ctypes.c_int, _P]
        lib.hsd_filter_probs.restype = ctypes.c_int
        lib.hsd_filter_probs.argtypes = [_P, ctypes.c_int, ctypes.c_int, ctypes.c_double, ctypes.c_double,
                                         ctypes.c_int, ctypes.c_double, _P]
    except AttributeError:          # a library of an older kernels.c (benchmarks/kernels_ab.py's baseline)
        pass
    return lib


def has(lib, name: str) -> bool:
    """Whether ``lib`` exports the function ``name`` (a library of an older ``kernels.c`` may not)."""
    try:
        getattr(lib, name)
    except AttributeError:
        return False
    return True


def expected_layout() -> list[int]:
    """What ``hsd_layout`` reports for the structs as this module declares them: the ABI version, the sizes of
    ``hsd_mat``, ``hsd_layer`` and ``hsd_model`` and the offsets of ``hsd_mat.bias`` and ``hsd_model.layers``."""
    return [ABI_VERSION, ctypes.sizeof(_CMat), ctypes.sizeof(_CLayer), ctypes.sizeof(_CModel), _CMat.bias.offset,
            _CModel.layers.offset]


def check_layout(lib: ctypes.CDLL) -> None:
    """Raise :class:`HsdError` when the library's structs are not laid out as this module's (a library built from
    another version of ``kernels.c``, or an edit to one side only)."""
    got = (ctypes.c_long * 6)()
    if lib.hsd_version() != ABI_VERSION:
        raise HsdError(f"the library is version {lib.hsd_version()}, this module expects {ABI_VERSION}")
    lib.hsd_layout(got)
    if list(got) != expected_layout():
        raise HsdError(f"the library's struct layout {list(got)} differs from this module's {expected_layout()}")


def unavailable_warning(why: str) -> str:
    """The one line said when the kernels cannot be had (by the CLI on stderr, to the Python API as a warning)."""
    return (f"hsd-opt: the CPU decode kernels are unavailable ({why}); decoding on the CPU uses torch's "
            f"operations, {TORCH_PATH_SLOWDOWN}")


@dataclass(frozen=True)
class KernelInfo:
    """What the loaded kernels are: for ``hsd doctor``, ``hsd bench`` and a profile's provenance.

    Attributes:
        variant: the variant's name (:data:`~hsd_opt.engine.variants.VARIANTS`).
        why: why this variant, in words.
        openmp: whether the library has OpenMP threads (without, a kernel call runs on the calling thread).
        path: the library in the cache.
        compiler: the compiler that built it.
    """

    variant: str
    why: str
    openmp: bool
    path: Path
    compiler: str

    def line(self, threads: int, asked: int | None = None) -> str:
        """One line: the variant, why, the threads a call gets (``threads``: its OpenMP team, :func:`team`; of
        ``asked``, torch's count, where the OpenMP runtime gives fewer) and where the library lives."""
        if not self.openmp:
            th = "1 thread (built without OpenMP)"
        else:
            th = f"{threads} OpenMP thread{'s' * (threads != 1)}"
            if asked is not None and threads < asked:
                th += f" of the {asked} asked (the OpenMP runtime gives fewer: OMP_THREAD_LIMIT, OMP_DYNAMIC)"
        return f"kernels: {self.variant} ({self.why}); {th}; {self.path}"


_INFO: list = []  # [KernelInfo] of the library in _LIB
_WHY: list = []   # [why the kernels are unavailable] where _LIB holds None


def unavailable_reason() -> str | None:
    """Why the kernels engines use are unavailable here, in words (loading them first), or None where they load."""
    if variants.disabled():
        return f"HSD_KERNELS={os.environ.get('HSD_KERNELS', '').strip()} turns them off"
    load(log=lambda m: None)
    return None if _INFO else (_WHY[-1] if _WHY else "unknown")


def info() -> KernelInfo | None:
    """The loaded kernels' :class:`KernelInfo` (loading them first), or None where they are unavailable."""
    load()
    return _INFO[0] if _INFO else None


def provenance(device: str | torch.device) -> dict | None:
    """What a profile or a benchmark records of the CPU decode kernels on ``device``: ``{"variant", "openmp"}``
    (None: not the CPU, ``HSD_KERNELS=0``, or the kernels are unavailable)."""
    if variants.disabled() or torch.device(device).type != "cpu":
        return None
    i = info()
    return None if i is None else {"variant": i.variant, "openmp": i.openmp}


def _openmp_failed_mark(cc: str, variant: Variant) -> Path:
    """The file beside ``variant``'s libraries in the cache that says its OpenMP build failed with ``cc`` here
    (holding the compiler's message)."""
    return library_path(cc, variant, True).with_suffix(".openmp-failed")


def _load_variant(cc: str, variant: Variant, log: Callable[[str], None] | None,
                  omp: bool) -> tuple[ctypes.CDLL, bool, Path]:
    """``variant``'s library, bound and checked, whether it has OpenMP and its path: built with OpenMP unless
    ``omp`` is False (:func:`openmp_wanted` said no) or that build fails (then without, said once to ``log``, and
    the failure marked beside the library in the cache, so that it is not tried again; a library built without
    OpenMP because ``HSD_OPENMP=0`` asked once is not such a mark).

    Raises:
        HsdError: the build failed (the OpenMP build's message) or the library is not this module's layout.
    """
    path = library_path(cc, variant, omp)
    for p in {path, library_path(cc, variant, False)}:
        if p.is_file() and not library_is_whole(p):     # cut short: the loader would map pages past its end (a
            p.unlink(missing_ok=True)                   # bus error, no exception), so built again instead
    failed = _openmp_failed_mark(cc, variant) if omp else None      # (its path: the OpenMP build's flags)
    if failed and not path.is_file() and failed.is_file() and library_path(cc, variant, False).is_file():
        omp, path = False, library_path(cc, variant, False)
    if not path.is_file():
        try:
            build(cc, path, variant, log, openmp=omp)
        except HsdError as first:
            if not omp or isinstance(first, BuildStopped):      # stopped: neither a build without it nor a mark
                raise
            omp, path = False, library_path(cc, variant, False)
            try:
                build(cc, path, variant, log, openmp=False)
            except HsdError:
                raise first from None
            try:
                failed.write_text(f"{str(first)[:2000]}\n")
            except OSError:
                pass                           # tried again next time
            if log:
                log(f"hsd-opt: {cc} cannot build with OpenMP; the kernels run on one thread")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        # a cached library that does not load (a write cut short, a damaged disk): built again, once (a library
        # that loads is never replaced in-process: the loader would hand back the first one for its path)
        path.unlink(missing_ok=True)
        build(cc, path, variant, log, openmp=omp)
        lib = ctypes.CDLL(str(path))
    lib = _bind(lib)
    check_layout(lib)
    return lib, omp, path


def library_is_whole(path: Path) -> bool:
    """Whether the shared library at ``path`` holds every byte its ELF headers point to (its program headers'
    segments, its section headers). A library cut short (a copy or a disk that failed midway; :func:`build` itself
    writes atomically) is not: loading one maps pages past the end of the file, and the first read of them kills
    the process with a bus error, which no exception reports. A file that is not ELF (a Mach-O library) is left
    to the loader's own checks."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if data[:4] != b"\x7fELF":
        return len(data) >= 4
    if len(data) < 0x40 or data[4] not in (1, 2) or data[5] not in (1, 2):
        return False
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    # e_phoff, e_shoff; e_phentsize, e_phnum, e_shentsize, e_shnum (ELF64 / ELF32 layouts)
    phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), data, 0x20 if wide else 0x1C)
    phent, phnum, shent, shnum = struct.unpack_from(order + "HHHH", data, 0x36 if wide else 0x2A)
    if phoff + phent * phnum > len(data) or shoff + shent * shnum > len(data):
        return False
    for i in range(phnum):
        at = phoff + i * phent
        offset, size = (struct.unpack_from(order + "QxxxxxxxxxxxxxxxxQ", data, at + 8) if wide else
                        struct.unpack_from(order + "IxxxxxxxxI", data, at + 4))    # p_offset, p_filesz
        if offset + size > len(data):
            return False
    return True


def _build_failed_mark(cc: str, variant: Variant) -> Path:
    """The file beside ``variant``'s libraries in the cache that says ``cc`` could not build it here (holding the
    compiler's message): the next load goes straight to a narrower variant (a new compiler or source: another
    folder, tried afresh)."""
    return library_path(cc, variant, False).with_suffix(".build-failed")


def _load_first(cc: str, candidates: Sequence[Variant], log: Callable[[str], None] | None,
                omp: bool) -> tuple[ctypes.CDLL | None, Variant, bool, Path | None, str | None, str]:
    """The first of ``candidates`` (the chosen variant, then narrower ones this CPU runs) that ``cc`` builds and
    loads: ``(library, its variant, OpenMP, path, why none loaded or None, what was passed over or "")``. One that
    fails is marked in the cache (:func:`_build_failed_mark`) and said once to ``log``; a marked one is passed
    over, the last never. One whose build was stopped (:class:`BuildStopped`) is passed over in this run only. Where
    the last fails too, the marks this call made are taken back: what failed was the toolchain, not a variant."""
    passed: list[str] = []
    stopped_ones: list[str] = []
    marked: list[Path] = []
    why: str | None = None
    for i, v in enumerate(candidates):
        last = i == len(candidates) - 1
        mark = _build_failed_mark(cc, v)
        built = any(_built(cc, v, o) for o in (True, False))   # since the mark: it builds after all
        if mark.is_file() and not built and not last:
            passed.append(v.name)
            continue
        try:
            lib, has_omp, path = _load_variant(cc, v, log, omp)
        except (HsdError, OSError, subprocess.SubprocessError) as e:
            why = str(e)
            if last or isinstance(e, UnwritableFolder):     # a cache that holds no library holds no narrower one
                break
            stopped = isinstance(e, BuildStopped)      # of the moment: this run goes on, the next tries it again
            if not stopped:
                try:
                    mark.parent.mkdir(parents=True, exist_ok=True)
                    mark.write_text(f"{why[:2000]}\n")
                    marked.append(mark)
                except OSError:
                    pass                               # tried again next time
            if log:
                said = (f"building the {v.name} kernels with {cc} was stopped" if stopped
                        else f"{cc} cannot build the {v.name} kernels")
                log(f"hsd-opt: {said} ({why.splitlines()[0][:200]}); trying {candidates[i + 1].name}"
                    + (" for this run" if stopped else ""))
            (stopped_ones if stopped else passed).append(v.name)
            continue
        fell = "; ".join(([f"{cc} cannot build {', '.join(passed)}"] if passed else [])
                         + ([f"building {', '.join(stopped_ones)} was stopped (tried again next run)"]
                            if stopped_ones else []))
        return lib, v, has_omp, path, None, fell
    for mark in marked:         # every candidate failed, the last too: the compiler's or the system's failure (no C
        mark.unlink(missing_ok=True)     # headers, a failed exec), not the variants': each is tried again next run
    return None, candidates[0], False, None, why, ""


def _built(cc: str, v: Variant, openmp: bool) -> bool:
    """Whether ``v``'s library (with or without OpenMP) is in the cache (an OpenMP build with ``$HSD_LIBOMP``
    unusable: not)."""
    try:
        return library_path(cc, v, openmp).is_file()
    except HsdError:
        return False


def _bad_libomp(cc: str) -> str | None:
    """Why ``$HSD_LIBOMP`` cannot be used with ``cc`` (:func:`libomp_dir`), or None."""
    try:
        libomp_dir(cc)
    except HsdError as e:
        return str(e)
    return None


def load(log: Callable[[str], None] | None = None, variant: str | None = None) -> ctypes.CDLL | None:
    """The kernels library (compiled on first use, then cached on disk), or None where it cannot be had: no C
    compiler, a failed build, a library whose layout differs (:func:`check_layout`), or ``HSD_KERNELS=0`` in the
    environment. The variant is :func:`~hsd_opt.engine.variants.choose`'s (``HSD_KERNELS=<name>`` forces one);
    ``variant`` names another to build and load, apart from the one engines use (tests, benchmarks). The first call
    says why the kernels are unavailable once, in :func:`unavailable_warning`'s words: to ``log`` (the CLI's stderr)
    when given, else as a ``RuntimeWarning``; ``HSD_KERNELS=0`` is a choice and says nothing. ``log`` also hears
    that a build starts.

    Raises:
        HsdError: ``HSD_KERNELS`` names no variant, or one this CPU cannot run; ``HSD_OPENMP`` is neither on nor
            off.
    """
    if variant is None and variants.disabled():
        return None
    with _LOCK:
        if variant is None and _LIB:
            return _LIB[0]
        features = variants.cpu_features()
        if variant is None:
            chosen, reason = variants.choose(features)
        else:
            chosen, reason = variants.BY_NAME[variant], "asked for"
        lib, why, omp, path = None, None, False, None
        wanted = openmp_wanted()                # a bad HSD_OPENMP is the user's error, not an unavailable build
        cc = compiler()
        if cc is None:
            why = "no C compiler found: install gcc or clang, or set CC"
        elif wanted and (bad := _bad_libomp(cc)):
            why = bad                           # the user's runtime folder: no variant is to blame
        else:
            # chosen, not forced: a compiler that cannot build it (too old for a flag) falls to the next variant
            chosen_by_us = variant is None and not reason.startswith("forced")
            later = variants.runnable(features) if chosen_by_us else [chosen]
            candidates = [chosen] + later[later.index(chosen) + 1:] if chosen in later else [chosen]
            lib, chosen, omp, path, why, fell = _load_first(cc, candidates, log, wanted)
            if fell:
                reason = f"{fell}; the next this CPU runs"
        if why is not None:
            if log:
                log(unavailable_warning(why))
            else:
                warnings.warn(unavailable_warning(why), RuntimeWarning, stacklevel=2)
        if variant is None:
            _LIB.append(lib)
            if lib is not None:
                _INFO.append(KernelInfo(chosen.name, reason, omp, path, cc))
            else:
                _WHY.append(why)
            variants.note_loaded(chosen.name if lib is not None else "unavailable")
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


def team(lib: ctypes.CDLL, nthreads: int) -> tuple[int, list[int]]:
    """The OpenMP team a kernel call with ``nthreads`` threads gets: its size and each thread's OS thread id (on
    Linux; elsewhere the team member numbers)."""
    ids = (ctypes.c_long * max(nthreads, 1))()
    n = lib.hsd_team(nthreads, ids)
    return n, list(ids)[:n]


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (``omp_pause_resource_all(omp_pause_hard)`` of the
    ``libgomp.so.1`` that torch and the kernels share).

    OpenMP gives every thread that opens a parallel region a pool of its own. Once the threads of all pools outnumber
    the cores, libgomp stops spinning at its barriers and sleeps instead, and each of a pass's barriers then waits for
    a thread to wake: a server that loaded its model on the main thread and decodes on another decodes 1.4x slower
    (`docs/results.md`). Called on the main thread once it is done with torch and before the decoding thread starts,
    it leaves that thread's pool the only one. A later parallel region on the calling thread makes a new pool.
    Returns False where the runtime is not libgomp or cannot pause."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
    return pause(2) == 0        # omp_pause_hard


# ------------------------------------------------------------------------------------------------ a model


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _struct(mat: Mat) -> _CMat:
    """The kernels' description of ``mat`` (made once and kept on it, with the float32 copy of a bias in another
    dtype). Raises :class:`HsdError` for a matrix the kernels cannot read."""
    if mat.c is None:
        w = mat.tensors[0]
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in mat.tensors) or \
                (mat.kind in (F32, BF16) and w.dtype not in (torch.float32, torch.bfloat16)):
            raise HsdError(f"kernels: expected contiguous CPU tensors of a float32/bfloat16/int8/int4 matrix, got "
                           f"{w.dtype} on {w.device}")
        bias = None if mat.bias is None else mat.bias.float().contiguous()
        scale, zero = (mat.tensors[1:] + [None, None])[:2]
        mat.c = (_CMat(mat.kind, mat.rows, mat.cols, 0, w.data_ptr(), _ptr(scale), _ptr(zero), _ptr(bias)), bias)
    return mat.c[0]


def layout_problem(weights: ModelWeights, device: torch.device, head_dim: int) -> str | None:
    """Why the kernels cannot run a model with these weights on ``device`` (None when they can): they compute
    pre-norm layers with q/k/v biases only, SiLU, one pair of norm epsilons, float32/bfloat16 weights or int8/int4
    copies (int4 widths a multiple of 32), on the CPU."""
    if device.type != "cpu":
        return f"the model is on {device}"
    lw = weights.layers
    dtypes = {m.tensors[0].dtype for layer in lw for m in layer.mats() if not m.quantized}
    if dtypes - {torch.float32, torch.bfloat16}:
        return f"dtype {sorted(dtypes - {torch.float32, torch.bfloat16}, key=str)[0]} (expected float32 or bfloat16)"
    if lw[0].q_norm is not None:
        return "per-head q/k norms (Qwen3)"
    if any(layer.act is not torch.nn.functional.silu for layer in lw):
        return "an activation other than SiLU"
    if len({(layer.eps1, layer.eps2) for layer in lw}) != 1:
        return "norm epsilons that differ between layers"
    if any(m.bias is not None for layer in lw for m in (layer.o, layer.gate, layer.up, layer.down)):
        return "biases outside q/k/v"
    if head_dim % 2:
        return "an odd head size"
    return None


class KernelPath:
    """A model's decoder layers and head on the kernels (pre-norm, rotary, grouped-query attention, SiLU MLP).

    Args:
        lib: the library from :func:`load`.
        weights: the model's weights (read in place; float32 copies are made only of norms and biases stored in
            another dtype).
        n_heads, n_kv, head_dim: attention shapes.
        exact: per layer, projections to read in an exact int4 form instead (kind ``Q4F``, from
            :func:`~hsd_opt.engine.stored_copies.exact_int4_layers`): the same float32 values, fewer bytes.
        head: the LM head to read instead of ``weights.head``: its exact int8 form (kind ``Q8F``, from
            :func:`~hsd_opt.engine.weights.exact_int8`), the same float32 values from a quarter of the bytes.
    """

    def __init__(self, lib, weights: ModelWeights, n_heads: int, n_kv: int, head_dim: int,
                 exact: Sequence[Mapping[str, Mat]] | None = None, head: Mat | None = None):
        self.lib, self.weights = lib, weights
        #: the matrix :meth:`head` reads: the model's head, or its exact int8 form
        self.head_mat = head or weights.head
        #: an int8 head (a quantized copy's) is read against the activation in int16 (:func:`screen_i16`; its codes
        #: in that layout, kept on the matrix, so copies sharing a head share them too); None: :func:`linear`
        self._head_i16 = i16_codes(self.head_mat)
        lw = weights.layers
        self._keep: list = []             # float32 norm weights and exact int4 forms the structs point to
        arr = (_CLayer * len(lw))()
        for i, layer in enumerate(lw):
            for name in PROJECTIONS:
                mat = (exact[i].get(name) if exact else None) or getattr(layer, name)
                self._keep.append(mat)
                setattr(arr[i], name, _struct(mat))
            ln1, ln2 = layer.ln1.float().contiguous(), layer.ln2.float().contiguous()
            self._keep += [ln1, ln2]
            arr[i].ln1, arr[i].ln2 = ln1.data_ptr(), ln2.data_ptr()
        self._arr = arr
        self.c = _CModel(n_heads, n_kv, head_dim, weights.embed.shape[1], lw[0].gate.rows, 0, lw[0].eps1,
                         lw[0].eps2, ctypes.cast(arr, ctypes.POINTER(_CLayer)))
        self.norm = weights.norm.float().contiguous()
        self._work = torch.empty(0)
        #: a float32 prompt's pass over this many positions or more is faster on the torch path
        every_exact = bool(exact) and all(len(e) == len(PROJECTIONS) for e in exact)
        simd = lib.hsd_simd()
        #: 16-lane tiles (AVX-512): long contexts' prompt passes stay on the kernels further (prefill_within)
        self.wide = simd >= 2
        if every_exact and simd >= 1:
            self.prefill_on_torch_from = (PREFILL_ON_TORCH_FROM_EXACT if simd >= 2 else
                                          PREFILL_ON_TORCH_FROM_EXACT_NARROW)
        else:
            self.prefill_on_torch_from = PREFILL_ON_TORCH_FROM if simd <= 1 else PREFILL_ON_TORCH_FROM_WIDE

    def prefill_within(self) -> int:
        """Positions within which a prompt's pass may end and stay on the kernels
        (:data:`PREFILL_ON_KERNELS_WITHIN`, ``_WIDE`` for 16-lane tiles)."""
        return PREFILL_ON_KERNELS_WITHIN_WIDE if self.wide else PREFILL_ON_KERNELS_WITHIN

    def _work_for(self, m: int, cache_len: int, nt: int) -> torch.Tensor:
        need = int(self.lib.hsd_work_floats(ctypes.byref(self.c), m, cache_len, nt))
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        return self._work

    def layers(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Layers ``l0 .. l1-1`` on ``x`` ``[m, hidden]`` at positions ``start .. start+m-1`` of ``st`` (float32
        caches), in calls of at most :data:`BATCH_ROWS` positions; returns the new hidden states (float32; ``x`` is
        not changed). ``cos``/``sin`` ``[1, m, head_dim]``."""
        return self.layers_many(l0, l1, [Rows(x, st, start, cos, sin)])[0]

    def layers_many(self, l0: int, l1: int, parts: Sequence[Rows]) -> list[torch.Tensor]:
        """:meth:`layers` for several sequences at once: every row of every part in one call (in calls of at most
        :data:`BATCH_ROWS` rows), each weight row read once for all of them, each row
        attending over its own sequence's cache. The kernels compute every row as they would alone, so each part
        gets bit for bit what :meth:`layers` gives it. Returns each part's new hidden states."""
        for p in parts:
            if p.st.cache_ptrs is None:
                p.st.cache_ptrs = (cache_ptrs(p.st.k), cache_ptrs(p.st.v))
        ms = [p.x.shape[0] for p in parts]
        if len(parts) == 1:
            p = parts[0]
            x = p.x.to(torch.float32).clone()       # updated in place; the caller's tensor may be a saved residual
            pos = torch.arange(p.start, p.start + ms[0], dtype=torch.int32)
            seq = torch.zeros(ms[0], dtype=torch.int32)
            cos, sin = p.cos[0].float().contiguous(), p.sin[0].float().contiguous()
        else:
            x = torch.cat([p.x.to(torch.float32) for p in parts])
            pos = torch.cat([torch.arange(p.start, p.start + m, dtype=torch.int32) for p, m in zip(parts, ms)])
            seq = torch.repeat_interleave(torch.arange(len(parts), dtype=torch.int32), torch.tensor(ms))
            cos = torch.cat([p.cos[0] for p in parts]).float().contiguous()
            sin = torch.cat([p.sin[0] for p in parts]).float().contiguous()
        kc = (ctypes.c_void_p * len(parts))(*[ctypes.addressof(p.st.cache_ptrs[0]) for p in parts])
        vc = (ctypes.c_void_p * len(parts))(*[ctypes.addressof(p.st.cache_ptrs[1]) for p in parts])
        lens = torch.tensor([p.st.max_len for p in parts], dtype=torch.int32)
        longest = max(p.st.max_len for p in parts)
        nt = torch.get_num_threads()
        step = BATCH_ROWS
        for i in range(0, x.shape[0], step):
            m = min(step, x.shape[0] - i)
            work = self._work_for(m, longest, nt)
            rc = self.lib.hsd_layers(ctypes.byref(self.c), l0, l1, x[i:].data_ptr(), m, pos[i:].data_ptr(),
                                     seq[i:].data_ptr(), cos[i:].data_ptr(), sin[i:].data_ptr(), kc, vc,
                                     lens.data_ptr(), work.data_ptr(), nt)
            if rc != 0:
                raise HsdError(f"kernels: bad pass (layers {l0}..{l1 - 1}, rows {i}..{i + m - 1} of {len(parts)} "
                               f"sequences)")
        return list(x.split(ms))

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm of hidden ``[m, d]`` (the kernels' own, batch-invariant), float32."""
        return rms_norm(self.lib, hidden, self.norm, self.weights.norm_eps)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on hidden ``[m, d]`` -> float32 logits ``[m, V]``, in blocks of
        :data:`MAX_PASS` rows (every row computed as a decode step computes it)."""
        if hidden.shape[0] == 0:
            return torch.empty(0, self.head_mat.rows, dtype=torch.float32)
        blocks = [self._head_rows(self.normed(hidden[i:i + MAX_PASS])) for i in range(0, hidden.shape[0], MAX_PASS)]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)

    def _head_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The head's logits ``[m, V]`` at normed hidden ``x`` ``[m, d]``, each row as it is computed alone."""
        if self._head_i16 is None:
            return linear(self.lib, self.head_mat, x)
        mat = self.head_mat
        a = screen_i16(self.lib, self._head_i16, mat.tensors[1], mat.rows, x)
        if a is not None:
            return a
        if x.shape[0] == 1:              # not finite: what the int8 product makes of it
            return linear(self.lib, mat, x)
        return torch.cat([self._head_rows(x[i:i + 1]) for i in range(x.shape[0])])


def linear(lib, mat: Mat, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ b)`` with the kernels: ``x`` ``[m, cols]`` float32 -> ``[m, rows]`` float32."""
    x = x.float().contiguous()
    m = x.shape[0]
    y = out if out is not None else torch.empty(m, mat.rows, dtype=torch.float32)
    nt = torch.get_num_threads()
    work = torch.empty(nt * SCRATCH_ROWS * mat.cols, dtype=torch.float32) if mat.kind != F32 else None
    rc = lib.hsd_linear(ctypes.byref(_struct(mat)), x.data_ptr(), m, y.data_ptr(), _ptr(work), nt)
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
            lib.hsd_rows_f32(ctypes.byref(_struct(mat)), rows.data_ptr(), positions.data_ptr(), rows.numel(),
                             x.data_ptr(), y.data_ptr()) != 0:
        raise HsdError("kernels: bad rows call")
    return y


def exact_mismatch(lib, mat: Mat, weight: torch.Tensor, nthreads: int | None = None) -> int:
    """The first weight (flat index ``r * cols + c``) of the exact form ``mat`` (kind ``Q4F`` or ``Q8F``, width a
    multiple of 32) whose value as the kernels compute it (``fma(code, scale, minimum)``, ``code * scale``: their
    row expansion itself, ``expand_row``) differs in its bits from ``weight`` (float32 ``[rows, cols]``), or -1
    when every weight is the same bit for bit (``hsd_exact_mismatch``, rows over the threads): the check
    :func:`exact_q4f` and :func:`exact_q8f` make, for a form made another way."""
    w = weight.detach()
    if mat.kind not in (Q4F, Q8F) or w.dtype != torch.float32 or tuple(w.shape) != (mat.rows, mat.cols) \
            or w.device.type != "cpu" or not w.is_contiguous():
        raise HsdError("kernels: an exact form is checked against contiguous float32 weights of its shape")
    got = int(lib.hsd_exact_mismatch(ctypes.byref(_struct(mat)), w.data_ptr(), nthreads or torch.get_num_threads()))
    if got < -1:
        raise HsdError("kernels: bad exact-form check")
    return got


def _exact_input(lib, weight: Mat, fn: str) -> torch.Tensor | None:
    w = weight.tensors[0]
    if weight.kind != F32 or w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() \
            or weight.cols % GROUP or not has(lib, fn):
        return None
    return w


def exact_q4f(lib, weight: Mat) -> Mat | None:
    """The float32 ``weight`` in the exact int4 form (kind ``Q4F``, the matrix
    :func:`~hsd_opt.engine.weights.exact_int4` makes), made by the kernels straight from the float32 weights
    (``hsd_exact_q4f``: :func:`~hsd_opt.engine.weights.quantize_q4`'s float32 operations, written in
    :func:`~hsd_opt.engine.weights.pair_codes`' layout), then every weight read back as the kernels compute it and
    compared with the float32 one, bit for bit (:func:`exact_mismatch`'s check, in the same pass); None when one
    differs, or for a weight not float32, a width not a multiple of 32, a library without the function."""
    w = _exact_input(lib, weight, "hsd_exact_q4f")
    if w is None:
        return None
    rows, cols, G = weight.rows, weight.cols, weight.cols // GROUP
    codes = torch.empty(-(-rows // 4), -(-G // 2), 128, dtype=torch.uint8)
    scale, minimum = (torch.empty(rows, G, dtype=torch.float16) for _ in range(2))
    # one thread: a model's ~200 matrices are ~200 short calls, and a parallel region per call waits on the
    # scheduler where another process holds a core (2 threads: 0.08 s less on an idle 2-core Zen 3, more when busy)
    got = lib.hsd_exact_q4f(w.data_ptr(), rows, cols, codes.data_ptr(), scale.data_ptr(), minimum.data_ptr(), 1)
    if got < -1:
        raise HsdError("kernels: bad exact int4 call")
    return Mat(Q4F, rows, cols, [codes, scale, minimum], weight.bias) if got == -1 else None


def exact_q8f(lib, weight: Mat) -> Mat | None:
    """The float32 ``weight`` in the exact int8 form (kind ``Q8F``, the matrix
    :func:`~hsd_opt.engine.weights.exact_int8` makes), made by the kernels (``hsd_exact_q8f``: exact_int8's float32
    operations, in :func:`~hsd_opt.engine.weights.pair_rows_int8`'s layout) and checked as :func:`exact_q4f` checks
    its form, bit for bit; None where it does not give every weight (or as :func:`exact_q4f`)."""
    w = _exact_input(lib, weight, "hsd_exact_q8f")
    if w is None:
        return None
    rows, cols = weight.rows, weight.cols
    codes = torch.empty(-(-rows // 2), cols // 8, 16, dtype=torch.int8)
    scale = torch.empty(rows, cols // GROUP, dtype=torch.float16)
    got = lib.hsd_exact_q8f(w.data_ptr(), rows, cols, codes.data_ptr(), scale.data_ptr(), torch.get_num_threads())
    if got < -1:
        raise HsdError("kernels: bad exact int8 call")
    return Mat(Q8F, rows, cols, [codes, scale], weight.bias) if got == -1 else None


def makes_noise(lib) -> bool:
    """Whether ``lib`` makes draws' noise (:func:`gumbel`) at a fraction of the cost of ``torch.rand`` and two
    ``torch.log``: it has ``hsd_gumbel`` and vector instructions (the portable build's FMAs are software calls,
    slower than torch)."""
    return lib is not None and has(lib, "hsd_gumbel") and bool(lib.hsd_simd())


def gumbel(lib, key: int, n: int, temperature: float) -> torch.Tensor:
    """``temperature`` times ``n`` standard Gumbel values (float32 ``[n]``) for the draw keyed by ``key`` (an
    unsigned 64-bit integer): ``-log(-log u)`` of uniforms on float32's 24-bit grid from splitmix64's outputs from
    ``key`` (``hsd_gumbel``, over torch's threads: the same values for a key on every build and thread count)."""
    out = torch.empty(n, dtype=torch.float32)
    lib.hsd_gumbel(key, n, temperature, out.data_ptr(), torch.get_num_threads())
    return out


def filter_probs(lib, x: torch.Tensor, temperature: float, top_p: float, top_k: int,
                 min_p: float) -> torch.Tensor | None:
    """Sampling's filters over a window's columns (``hsd_filter_probs``): rows ``x`` ``[m, n]`` of logits
    (``-inf`` outside each row's window) -> probabilities ``[m, n]`` float32, what
    :func:`~hsd_opt.runtime.sampling.process_logits` computes to float32 rounding (top-k's ties: the lower column
    first), in one call rather than a score of small torch operations. None where a row holds a value that is not
    a number, no finite value, or one that ``x / temperature`` makes infinite (``process_logits`` then gives its
    error or softmax's limit)."""
    x = x.float().contiguous()
    out = torch.empty_like(x)
    top_k = top_k if 0 < top_k < x.shape[1] else 0         # a k of every column or more: no such filter
    rc = lib.hsd_filter_probs(x.data_ptr(), x.shape[0], x.shape[1], temperature, top_p, top_k, min_p,
                              out.data_ptr())
    if rc < 0:
        raise HsdError("kernels: bad filter call")
    return out if rc == 0 else None


def screen_codes(lib, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The greedy screen's int8 copy of a float32 head ``w`` ``[V, K]`` (K even): its codes in :func:`screen_i16`'s
    layout (:func:`pack_screen_codes` of :func:`~hsd_opt.engine.weights.quantize_q8`'s codes, the same bytes), its
    row scales ``[V]`` float32 (quantize_q8's), and per row ``|code * scale - w|`` and ``|w|`` ``[V]`` float64
    (summed in float64), in one pass of ``hsd_screen_codes``; None where the library lacks it or ``w`` is not a
    contiguous float32 CPU tensor of even width."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() or w.shape[1] % 2 \
            or not has(lib, "hsd_screen_codes"):
        return None
    V, K = w.shape
    codes = torch.empty(-(-V // 16), K // 2, 32, dtype=torch.int8)
    scale = torch.empty(V, dtype=torch.float32)
    rho, wnorm = (torch.empty(V, dtype=torch.float64) for _ in range(2))
    if lib.hsd_screen_codes(w.data_ptr(), V, K, codes.data_ptr(), scale.data_ptr(), rho.data_ptr(), wnorm.data_ptr(),
                            torch.get_num_threads()) != 0:
        raise HsdError("kernels: bad screen codes call")
    return codes, scale, rho, wnorm


def i16_codes(mat: Mat) -> torch.Tensor | None:
    """The codes of an int8 head ``mat`` (kind ``Q8``: per-row scales, no bias, an even width) in
    :func:`screen_i16`'s layout (:func:`pack_screen_codes`, made once and kept on ``mat``); None for another
    matrix. An int8 or int4 copy's head reads them against the activation in int16 with one scale per position,
    as the greedy screen reads its codes: exact int32 sums, a finer activation than the integer path's int8 per
    group of 32, one conversion per row and position (what each read costs on the CPUs measured:
    docs/results.md#figures-behind-the-design)."""
    if mat.kind != Q8 or mat.bias is not None or mat.cols % 2:
        return None
    if mat.i16_codes is None:
        mat.i16_codes = pack_screen_codes(mat.tensors[0])
    return mat.i16_codes


def pack_screen_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[V, K]`` (K even) in :func:`screen_i16`'s layout: ``[ceil(V / 16), K / 2, 32]``, per block of
    16 rows and pair of columns the two codes of each row in turn (rows past ``V`` zero)."""
    V, K = codes.shape
    blocks = -(-V // 16)
    padded = torch.zeros(blocks * 16, K, dtype=torch.int8)
    padded[:V] = codes
    return padded.reshape(blocks, 16, K // 2, 2).permute(0, 2, 1, 3).reshape(blocks, K // 2, 32).contiguous()


def screen_i16(lib, packed: torch.Tensor, scale: torch.Tensor, rows: int, x: torch.Tensor,
               nthreads: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The greedy screen's logits ``[m, rows]`` float32 of int8 codes (``packed`` by :func:`pack_screen_codes`,
    float32 row ``scale`` ``[rows]``) at ``x`` ``[m, K]``, the activation quantized to int16 with one scale per
    position (``hsd_screen_i16`` in ``kernels.c``: exact int32 sums, so the same on every instruction set). None
    when ``x`` holds a value that is not finite. ``out``: a float32 buffer of at least ``m * rows`` values to
    write them into (its first ``m * rows`` returned as ``[m, rows]``)."""
    x = x.float().contiguous()
    n = x.shape[0] * rows
    a = torch.empty(x.shape[0], rows, dtype=torch.float32) if out is None or out.numel() < n else \
        out.view(-1)[:n].view(x.shape[0], rows)
    rc = lib.hsd_screen_i16(packed.data_ptr(), scale.data_ptr(), rows, x.shape[1], x.data_ptr(), x.shape[0],
                            a.data_ptr(), nthreads or torch.get_num_threads())
    if rc < 0:
        raise HsdError("kernels: bad screen call")
    return a if rc == 0 else None


def screen_bounds(lib, x: torch.Tensor, c: torch.Tensor, wnorm: torch.Tensor, q16: int) -> torch.Tensor | None:
    """The greedy screen's bound ``e`` ``[m, V]`` float32 at each position of normed hidden ``x`` ``[m, d]``
    (:mod:`hsd_opt.engine.screen`; ``c``, ``wnorm``: its per-row constants ``[V]``; ``q16``: :func:`screen_i16`'s
    int16 range, ``hsd_screen_q16(d)``); None when ``x`` holds a value that is not finite."""
    x = x.float().contiguous()
    e = torch.empty(x.shape[0], c.numel(), dtype=torch.float32)
    rc = lib.hsd_screen_bounds(x.data_ptr(), x.shape[0], x.shape[1], q16, c.data_ptr(), wnorm.data_ptr(), c.numel(),
                               e.data_ptr())
    if rc < 0:
        raise HsdError("kernels: bad screen call")
    return e if rc == 0 else None


def screen_pick(lib, head: Mat, x: torch.Tensor, a: torch.Tensor, c: torch.Tensor, wnorm: torch.Tensor,
                cap: int, q16: int, nthreads: int | None = None,
                offsets: torch.Tensor | None = None) -> torch.Tensor | None:
    """Greedy ids ``[m]`` (int64) of the float32 ``head`` at normed hidden ``x`` ``[m, d]`` from the screen's
    logits ``a`` ``[m, V]``: the argmax over the rows whose bound (:func:`screen_bounds` with the same ``q16``)
    reaches the highest lower bound, their logits computed as :func:`rows_f32` computes them (first index on
    ties). ``offsets`` ``[m, V]`` float32 (finite): the argmax of the logits plus them instead (each sum rounded to
    float32, as ``(logits + offsets).argmax(-1)``; the bound widened for the sums' rounding). None when ``x``,
    ``a`` or ``offsets`` holds a value that is not finite or a position has more than ``cap`` candidates."""
    x, a = x.float().contiguous(), a.float().contiguous()
    if a.shape != (x.shape[0], head.rows) or x.shape[1] != head.cols:
        raise HsdError("kernels: bad screen call")
    if offsets is not None:
        offsets = offsets.float().contiguous()
        if offsets.shape != a.shape:
            raise HsdError("kernels: bad screen call")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = lib.hsd_screen_pick(ctypes.byref(_struct(head)), x.data_ptr(), x.shape[0], q16, a.data_ptr(),
                             None if offsets is None else offsets.data_ptr(),
                             c.data_ptr(), wnorm.data_ptr(), cap, out.data_ptr(),
                             nthreads or torch.get_num_threads())
    if rc < 0:
        raise HsdError("kernels: bad screen call")
    return out if rc == 0 else None


def screen_window(lib, head: Mat, x: torch.Tensor, a: torch.Tensor, c: torch.Tensor, wnorm: torch.Tensor, q16: int,
                  top_k: int, below: float, reach: float, slack: float, cap: int,
                  offsets: torch.Tensor | None = None,
                  pins: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  nthreads: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The logits ``[m, V]`` float32 of a window of each position's largest (``hsd_screen_window``; what
    :meth:`~hsd_opt.engine.screen.HeadScreen.window` states) and the window's columns (int64, ascending: every token
    some position's window holds): at normed hidden ``x`` ``[m, d]``, from the screen's
    logits ``a`` ``[m, V]`` (its constants ``c``, ``wnorm`` ``[V]``, int16 range ``q16``), the float32 ``head``'s
    logits (as :func:`rows_f32` computes them) of the tokens that may be among the ``top_k`` largest of the logits
    plus ``offsets`` (``[m, V]`` float32, finite; None: zero) and no more than ``below`` (logit units; ``inf``: no
    limit) under the largest, ``-inf`` elsewhere. ``reach``: how far under the largest the ``top_k``-th is first
    sought (where ``below`` is infinite); ``slack``: the floor's relative allowance. ``pins``: positions (ascending),
    token ids (int64 ``[n]``) and exact moved values (float32 ``[n]``) that stand for those tokens' bounds. None
    when a value is not finite or a position's window holds more than ``cap`` tokens."""
    x, a = x.float().contiguous(), a.float().contiguous()
    m, V = a.shape
    if V != head.rows or x.shape != (m, head.cols):
        raise HsdError("kernels: bad screen call")
    if offsets is not None:
        offsets = offsets.float().contiguous()
        if offsets.shape != a.shape:
            raise HsdError("kernels: bad screen call")
    pos, ids, vals = pins if pins is not None else (torch.zeros(0, dtype=torch.int64),) * 2 + (torch.zeros(0),)
    pos, ids = pos.to(torch.int64).contiguous(), ids.to(torch.int64).contiguous()
    vals = vals.float().contiguous()
    nt = nthreads or torch.get_num_threads()
    out = torch.empty(m, V, dtype=torch.float32)
    work, cand = scratch("window", nt * 3 * V, torch.float32), scratch("window_ids", m * cap, torch.int64)
    counts = torch.zeros(m, dtype=torch.int32)
    rc = lib.hsd_screen_window(ctypes.byref(_struct(head)), x.data_ptr(), m, q16, a.data_ptr(),
                               None if offsets is None else offsets.data_ptr(), c.data_ptr(), wnorm.data_ptr(),
                               top_k, below, reach, slack, pos.data_ptr(), ids.data_ptr(), vals.data_ptr(),
                               pos.numel(), cap, out.data_ptr(), work.data_ptr(), cand.data_ptr(),
                               counts.data_ptr(), nt)
    if rc < 0:
        raise HsdError("kernels: bad screen call")
    if rc:
        return None
    n = counts.tolist()
    if m == 1:
        return out, cand[:n[0]].clone()
    return out, torch.unique(torch.cat([cand[t * cap:t * cap + n[t]] for t in range(m)]))


def rms_norm(lib, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[m, d]`` float32 with float32 ``weight`` ``[d]`` (the kernels' own, batch-invariant)."""
    x = x.float().contiguous()
    out = torch.empty_like(x)
    lib.hsd_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), float(eps), out.data_ptr())
    return out


def cache_ptrs(caches: Sequence[torch.Tensor]):
    """A ctypes array of the caches' data pointers (what :meth:`KernelPath.layers` takes for keys or values)."""
    arr = (ctypes.c_void_p * len(caches))(*[c.data_ptr() for c in caches])
    return arr
