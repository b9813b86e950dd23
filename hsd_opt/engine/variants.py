"""Which build of the CPU decode kernels (``kernels.c``) runs on this CPU: one variant per instruction set, chosen at
load time from what the CPU reports, each compiled with explicit flags (never ``-march=native``), as ggml's
``ggml-cpu`` variants are.

- :data:`VARIANTS`: every variant, widest first, with the CPU features it needs, its compiler flags and the bits its
  library's ``hsd_features()`` reports (which tests check).
- :func:`cpu_features`: the CPU's features (Linux: the kernel's ``/proc/cpuinfo`` flags, its reading of cpuid on x86
  and of the hardware capabilities on Arm; macOS: ``sysctl``).
- :func:`choose`: the variant to load: ``HSD_KERNELS=<name>`` forces one (refused, naming the missing features, when
  the CPU lacks them), otherwise the widest this CPU runs, with the reason in words.
- :func:`host`: what a benchmark report records of the machine it ran on (the CPU's name, the instruction sets the
  variants tell apart, the variant that runs), so that every figure names its CPU class.

No torch here: ``hsd doctor`` and the tests read it without loading a model.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hsd_opt.errors import HsdError, SettingError
from hsd_opt.values import OFF_WORDS

#: Bits of ``hsd_features()`` (kernels.c).
AVX2, AVX512, VNNI, NEON, DOTPROD, OPENMP = 1, 2, 4, 8, 16, 32

#: Flags every variant is compiled with: no contraction of a multiply and an add into an FMA the source did not
#: write (the kernels' results are defined operation by operation), position-independent, C11.
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11")


@dataclass(frozen=True)
class Variant:
    """One build of the kernels.

    Attributes:
        name: what ``HSD_KERNELS`` takes and ``hsd doctor`` prints.
        arch: the machine it is for (``platform.machine()`` normalised: ``x86_64``, ``aarch64``) or ``any``.
        needs: CPU features it needs, as Linux names them in ``/proc/cpuinfo``.
        flags: compiler flags beyond :data:`COMMON_FLAGS`.
        features: the bits of ``hsd_features()`` its library reports (OpenMP aside).
    """

    name: str
    arch: str
    needs: tuple[str, ...]
    flags: tuple[str, ...]
    features: int


_X86_AVX2 = ("avx2", "fma", "f16c")
_X86_AVX512 = _X86_AVX2 + ("avx512f", "avx512dq", "avx512bw", "avx512vl")
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = _AVX2_FLAGS + ("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl")
#: What an Armv8.2-A CPU has (Linux's names): SIMD, LSE atomics, rounding doubling multiplies, CRC32.
_ARMV82 = ("asimd", "atomics", "asimdrdm", "crc32")

#: Every variant, widest first: :func:`choose` takes the first one the CPU runs.
VARIANTS: tuple[Variant, ...] = (
    Variant("avx512-vnni", "x86_64", _X86_AVX512 + ("avx512_vnni",), _AVX512_FLAGS + ("-mavx512vnni",),
            AVX2 | AVX512 | VNNI),
    Variant("avx512", "x86_64", _X86_AVX512, _AVX512_FLAGS, AVX2 | AVX512),
    Variant("avx2-vnni", "x86_64", _X86_AVX2 + ("avx_vnni",), _AVX2_FLAGS + ("-mavxvnni",), AVX2 | VNNI),
    Variant("avx2", "x86_64", _X86_AVX2, _AVX2_FLAGS, AVX2),
    # -march=armv8.2-a lets the compiler use what Armv8.1-8.2 make mandatory (LSE atomics in the OpenMP runtime's
    # code, RDM, CRC32): a CPU must report those too, not only the dot product
    Variant("neon-dotprod", "aarch64", _ARMV82 + ("asimddp",), ("-march=armv8.2-a+dotprod",), NEON | DOTPROD),
    Variant("neon", "aarch64", ("asimd",), ("-march=armv8-a",), NEON),
    Variant("portable", "any", (), ("-DHSD_PORTABLE",), 0),
)

BY_NAME = {v.name: v for v in VARIANTS}


def machine() -> str:
    """This machine's architecture, normalised: ``x86_64``, ``aarch64`` (``arm64`` on macOS), or as reported."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


# macOS names of the features above (sysctl machdep.cpu.* on x86; hw.optional.* on Apple silicon).
_MAC_X86 = {"AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX512F": "avx512f", "AVX512DQ": "avx512dq",
            "AVX512BW": "avx512bw", "AVX512VL": "avx512vl", "AVX512VNNI": "avx512_vnni", "AVXVNNI": "avx_vnni"}


def _sysctl(*names: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", *names], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_features(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's features in Linux's names (``avx2``, ``avx512f``, ``asimd``, ``asimddp``, ...). ``cpuinfo``: the
    text of ``/proc/cpuinfo`` to read instead of this machine's (tests)."""
    if cpuinfo is None and platform.system() == "Darwin":
        if machine() == "aarch64":
            dot = _sysctl("hw.optional.arm.FEAT_DotProd").strip() == "1"
            return frozenset({"asimd"} | ({"asimddp", *_ARMV82} if dot else set()))   # Apple's: Armv8.4-A and up
        words = _sysctl("machdep.cpu.features", "machdep.cpu.leaf7_features").split()
        return frozenset(_MAC_X86[w] for w in words if w in _MAC_X86)
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def missing(variant: Variant, features: frozenset[str], arch: str | None = None) -> list[str]:
    """What ``variant`` needs that a CPU of ``arch`` (default this machine's) with ``features`` lacks: the
    architecture itself, or features (empty: it runs)."""
    arch = arch or machine()
    if variant.arch not in ("any", arch):
        return [f"an {variant.arch} CPU"]
    return [f for f in variant.needs if f not in features]


def runnable(features: frozenset[str], arch: str | None = None) -> list[Variant]:
    """The variants a CPU of ``arch`` with ``features`` runs, widest first (``portable`` always last)."""
    return [v for v in VARIANTS if not missing(v, features, arch)]


def disabled() -> bool:
    """True where ``HSD_KERNELS=0`` (or off, no, false) turns the kernels off: every engine takes the torch path."""
    return os.environ.get("HSD_KERNELS", "1").strip().lower() in OFF_WORDS


def choose(features: frozenset[str] | None = None, forced: str | None = None,
           arch: str | None = None) -> tuple[Variant, str]:
    """The variant to load and why, in words. ``forced``: a variant's name (default ``$HSD_KERNELS`` when it names
    one; ``auto``, ``1`` or empty choose).

    Raises:
        HsdError: ``forced`` names no variant, or one this CPU cannot run (naming what it lacks).
    """
    features = cpu_features() if features is None else features
    if forced is None:
        forced = os.environ.get("HSD_KERNELS", "")
    forced = forced.strip().lower()
    ok = runnable(features, arch)
    if forced and forced not in ("auto", "1", "on", "yes", "true"):
        if forced not in BY_NAME:
            raise SettingError(f"HSD_KERNELS={forced}: no such kernel variant (one of {', '.join(BY_NAME)}, auto, or 0 "
                           f"for the torch path)")
        v = BY_NAME[forced]
        lack = missing(v, features, arch)
        runs = ", ".join(x.name for x in ok)
        if v.arch not in ("any", arch or machine()):
            raise SettingError(f"HSD_KERNELS={forced}: that variant is for {v.arch} CPUs, this is {arch or machine()} "
                           f"(it runs {runs})")
        if lack:
            raise SettingError(f"HSD_KERNELS={forced}: this CPU lacks {', '.join(lack)} (it runs {runs})")
        return v, f"forced by HSD_KERNELS={forced}"
    best = ok[0]
    here = arch or machine()
    wider = [v for v in VARIANTS if v.arch == (here if best.arch == "any" else best.arch)
             and VARIANTS.index(v) < VARIANTS.index(best)]
    if best.name == "portable":
        why = (f"no SIMD variant this CPU runs: it lacks {', '.join(missing(wider[-1], features, arch))} for "
               f"{wider[-1].name}" if wider else f"no SIMD variant for {here} CPUs")
    elif wider:
        why = f"the widest this CPU runs; it lacks {', '.join(missing(wider[-1], features, arch))} for {wider[-1].name}"
    else:
        why = "the widest this CPU runs"
    return best, why


# The features the variants tell apart, as ``hsd doctor`` and :func:`host` show them.
SHOWN_FEATURES = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
                            "avx_vnni", "asimd", "asimddp", "sve"})


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name: ``/proc/cpuinfo``'s ``model name`` (``cpuinfo``: that text instead, for tests), macOS's
    ``machdep.cpu.brand_string``, else ``platform.processor()`` or the architecture."""
    if cpuinfo is None and platform.system() == "Darwin":
        name = _sysctl("machdep.cpu.brand_string").strip()
        if name:
            return name
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    return platform.processor() or machine()


#: The variant this process's kernels were loaded as (``["unavailable"]`` where none loaded), once they were:
#: :func:`note_loaded`, which the kernels' loader calls.
_LOADED: list[str] = []


def note_loaded(name: str) -> None:
    """Record the variant the kernels were loaded as (``"unavailable"``: none loaded), for :func:`host`: it can
    differ from :func:`choose`'s where the chosen one did not build here and a narrower one runs."""
    _LOADED[:] = [name]


def host(cpuinfo: str | None = None, arch: str | None = None) -> dict:
    """What a benchmark report records of the machine it ran on: ``"cpu"`` (:func:`cpu_name`), ``"arch"``,
    ``"cpus"`` (logical CPUs), ``"isa"`` (the instruction-set features the variants tell apart that the CPU has,
    sorted) and ``"kernels"``: the variant this process loaded (:func:`note_loaded`; ``"unavailable"`` where none
    did), or before it loads any the one it would choose (``$HSD_KERNELS`` honoured; ``"off"`` where
    ``HSD_KERNELS=0`` turns the kernels off; the refusal's text where it names a variant this CPU cannot run).
    ``cpuinfo``, ``arch``: the text of ``/proc/cpuinfo`` and the architecture to read instead of this machine's
    (tests)."""
    this_machine = cpuinfo is None and arch is None
    features, arch = cpu_features(cpuinfo), arch or machine()
    if disabled():
        kernels = "off"
    elif _LOADED and this_machine:
        kernels = _LOADED[0]
    else:
        try:
            kernels = choose(features, arch=arch)[0].name
        except HsdError as e:
            kernels = str(e)
    return {"cpu": cpu_name(cpuinfo), "arch": arch, "cpus": os.cpu_count(),
            "isa": sorted(f for f in features if f in SHOWN_FEATURES), "kernels": kernels}
