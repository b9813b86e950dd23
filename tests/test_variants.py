"""Which kernel variant a CPU gets (``hsd_opt.engine.variants``): the widest it runs, or the one ``HSD_KERNELS``
names, refused with what the CPU lacks; and the loaded library is that variant, with explicit flags."""

from __future__ import annotations

import stat

import pytest

from hsd_opt.engine import kernels, variants
from hsd_opt.errors import HsdError
from hsd_opt.jsonio import FOLDER_MODE
from tests.helpers import compiler_has_openmp

ZEN3 = "flags\t\t: fpu sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2\n"
ZEN4 = ZEN3.rstrip() + " avx512f avx512dq avx512bw avx512vl avx512_vnni\n"
SKYLAKE_X = ZEN3.rstrip() + " avx512f avx512dq avx512bw avx512vl\n"
ALDER_LAKE = ZEN3.rstrip() + " avx_vnni\n"
GRAVITON3 = ("Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma "
             "lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp "
             "svei8mm svebf16 i8mm bf16 dgh rng\n")
#: A CPU (or VM) reporting the dot product without the Armv8.1 atomics the armv8.2-a build may use: plain NEON.
DOT_NO_LSE = "Features\t: fp asimd evtstrm crc32 asimddp\n"
CORTEX_A72 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid\n"


@pytest.mark.parametrize("cpuinfo,arch,want", [
    (ZEN3, "x86_64", "avx2"), (ZEN4, "x86_64", "avx512-vnni"), (SKYLAKE_X, "x86_64", "avx512"),
    (ALDER_LAKE, "x86_64", "avx2-vnni"), (GRAVITON3, "aarch64", "neon-dotprod"), (CORTEX_A72, "aarch64", "neon"),
    (DOT_NO_LSE, "aarch64", "neon"),
    ("flags\t: fpu sse2\n", "x86_64", "portable"), ("", "riscv64", "portable")])
def test_the_widest_variant_the_cpu_runs_is_chosen(cpuinfo, arch, want):
    v, why = variants.choose(variants.cpu_features(cpuinfo), forced="", arch=arch)
    assert v.name == want and why
    if want == "avx2":
        assert "avx_vnni" in why                    # why not the next wider one
    if want == "portable":                          # what the narrowest SIMD variant of this architecture needs
        assert why == ("no SIMD variant this CPU runs: it lacks avx2, fma, f16c for avx2" if arch == "x86_64" else
                       f"no SIMD variant for {arch} CPUs"), why


def test_a_forced_variant_is_taken_or_refused_naming_what_the_cpu_lacks(monkeypatch):
    zen3 = variants.cpu_features(ZEN3)
    assert variants.choose(zen3, forced="portable", arch="x86_64")[0].name == "portable"
    with pytest.raises(HsdError, match=r"HSD_KERNELS=avx512: this CPU lacks avx512f.*it runs avx2, portable"):
        variants.choose(zen3, forced="avx512", arch="x86_64")
    with pytest.raises(HsdError, match="HSD_KERNELS=neon: that variant is for aarch64 CPUs, this is x86_64"):
        variants.choose(zen3, forced="neon", arch="x86_64")
    with pytest.raises(HsdError, match="HSD_KERNELS=avx3: no such kernel variant"):
        variants.choose(zen3, forced="avx3", arch="x86_64")
    monkeypatch.setenv("HSD_KERNELS", "portable")
    assert variants.choose(zen3, arch="x86_64")[0].name == "portable"


def test_a_report_names_the_cpu_its_instruction_sets_and_the_variant_that_runs(monkeypatch):
    monkeypatch.delenv("HSD_KERNELS", raising=False)
    zen3 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\n" + ZEN3
    h = variants.host(zen3, arch="x86_64")
    assert h["cpu"] == "AMD EPYC 7B13" and h["arch"] == "x86_64" and h["kernels"] == "avx2"
    assert h["isa"] == ["avx2", "f16c", "fma"]                     # sse2, bmi2 ... are not what variants tell apart
    assert variants.host(ZEN4, arch="x86_64")["kernels"] == "avx512-vnni"
    assert variants.host(GRAVITON3, arch="aarch64")["kernels"] == "neon-dotprod"
    monkeypatch.setenv("HSD_KERNELS", "avx512")                    # a forced variant this CPU cannot run: said
    assert "lacks avx512f" in variants.host(zen3, arch="x86_64")["kernels"]
    monkeypatch.setenv("HSD_KERNELS", "0")
    assert variants.host(zen3, arch="x86_64")["kernels"] == "off"
    assert variants.cpu_name("Hardware\t: BCM2835\n") == "BCM2835"      # an Arm board's line


def test_every_variant_has_explicit_flags_and_names_its_bits():
    for v in variants.VARIANTS:
        flags = kernels.flags(v)
        assert "-march=native" not in flags and "-ffp-contract=off" in flags and "-fopenmp" in flags
        assert "-fopenmp" not in kernels.flags(v, openmp=False)
    assert variants.VARIANTS[-1].name == "portable" and variants.VARIANTS[-1].features == 0


def test_an_llvm_openmp_runtime_is_linked_where_one_is_named_or_a_mac_has_one(tmp_path, monkeypatch):
    """Apple's clang has no ``-fopenmp`` of its own: the kernels link torch's copy of libomp (else Homebrew's);
    ``HSD_LIBOMP`` names one anywhere; elsewhere plain ``-fopenmp``."""
    v = variants.BY_NAME["portable"]
    monkeypatch.delenv("HSD_LIBOMP", raising=False)
    monkeypatch.setattr(kernels.platform, "system", lambda: "Linux")
    assert kernels.libomp_dir("cc") is None and "-Xclang" not in kernels.flags(v, cc="cc")
    assert kernels.link_flags(cc="cc") == ["-lm"]
    torch_lib = tmp_path / "torch" / "lib"
    torch_lib.mkdir(parents=True)
    (torch_lib / "libomp.dylib").write_bytes(b"")
    (torch_lib / "omp.h").write_text("")
    monkeypatch.setattr(kernels.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(kernels, "torch", type("T", (), {"__file__": str(tmp_path / "torch" / "__init__.py")}))
    monkeypatch.setattr(kernels, "_compiler_version", lambda cc: "Apple clang version 16.0.0" if cc == "cc" else cc)
    assert kernels.libomp_dir("cc") == torch_lib
    assert kernels.flags(v, cc="cc")[-3:] == ["-Xclang", "-fopenmp", f"-I{torch_lib}"]
    assert kernels.link_flags(cc="cc") == [f"-L{torch_lib}", "-lomp", f"-Wl,-rpath,{torch_lib}", "-lm"]
    assert kernels.link_flags(openmp=False, cc="cc") == ["-lm"]
    assert kernels.libomp_dir("gcc-14") is None                   # a Mac's gcc has its own -fopenmp
    monkeypatch.setenv("HSD_LIBOMP", str(tmp_path / "llvm"))
    monkeypatch.setattr(kernels.platform, "system", lambda: "Linux")
    with pytest.raises(HsdError, match=r"HSD_LIBOMP=.*llvm: no libomp.dylib or libomp.so in that folder"):
        kernels.libomp_dir("gcc")
    (tmp_path / "llvm").mkdir()
    (tmp_path / "llvm" / "libomp.so").write_bytes(b"")
    assert kernels.libomp_dir("clang-14") == tmp_path / "llvm"
    assert "-I" not in " ".join(kernels.flags(v, cc="clang-14")) and "-Xclang" in kernels.flags(v, cc="clang-14")
    with pytest.raises(HsdError, match=r"HSD_LIBOMP=.*llvm: an LLVM OpenMP runtime is linked by clang; the "
                                       r"compiler gcc is not clang"):
        kernels.libomp_dir("gcc")                                    # gcc links its own runtime: no -Xclang


def _llvm_libomp() -> str | None:
    """A Debian clang with LLVM's libomp (``apt-get install clang-14 libomp-14-dev``): the folder of libomp.so."""
    import shutil
    from pathlib import Path

    for ver in ("19", "18", "17", "16", "15", "14"):
        d = Path(f"/usr/lib/llvm-{ver}/lib")
        if shutil.which(f"clang-{ver}") and (d / "libomp.so").is_file():
            return str(d)
    return None


@pytest.mark.slow
@pytest.mark.skipif(_llvm_libomp() is None, reason="no clang with LLVM's libomp here (the stand-in for a Mac's)")
def test_a_build_against_an_llvm_openmp_runtime_runs_on_its_threads(tmp_path, monkeypatch):
    """What a Mac does with torch's libomp, on Linux: clang's ``-Xclang -fopenmp`` linked to LLVM's runtime; the
    library reports OpenMP and takes a team of two. Loaded in a child process: a second OpenMP runtime's threads
    in this one would disturb the tests that count this process's threads."""
    import subprocess
    import sys

    d = _llvm_libomp()
    cc = "clang-" + d.split("llvm-")[1].split("/")[0]
    monkeypatch.setenv("HSD_LIBOMP", d)
    out = kernels.build(cc, tmp_path / "k.so", variants.BY_NAME["portable"])
    child = ("import ctypes, sys; from hsd_opt.engine import kernels; lib = kernels._bind(ctypes.CDLL(sys.argv[1]));"
             " print(lib.hsd_features(), kernels.team(lib, 2)[0])")
    features, team = map(int, subprocess.run([sys.executable, "-c", child, str(out)], capture_output=True, text=True,
                                             check=True, timeout=300).stdout.split())
    assert features & variants.OPENMP and team == 2


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler here: the kernels cannot be built")
def test_the_loaded_library_is_the_chosen_variant():
    chosen, why = variants.choose()
    info = kernels.info()
    assert info.variant == chosen.name and info.why == why
    assert kernels.load().hsd_features() & ~variants.OPENMP == chosen.features
    assert info.path.is_file() and chosen.name in info.path.name
    assert info.variant in info.line(2) and str(info.path) in info.line(2)


X86_SIMD = [v for v in variants.VARIANTS if v.arch == "x86_64"]


@pytest.mark.slow
@pytest.mark.skipif(kernels.compiler() is None or variants.machine() != "x86_64",
                    reason="no C compiler here, or not an x86-64 machine")
@pytest.mark.parametrize("variant", X86_SIMD, ids=[v.name for v in X86_SIMD])
def test_every_x86_variant_compiles_here_even_where_the_cpu_cannot_run_it(tmp_path, variant):
    """A variant this CPU lacks is still built (not loaded): a change that breaks the AVX-512 or VNNI code is
    caught on an AVX2 host, whose tests of those variants skip."""
    try:
        out = kernels.build(kernels.compiler(), tmp_path / "k.so", variant, openmp=compiler_has_openmp())
    except HsdError as e:
        if "unrecognized" in str(e) or "unknown" in str(e):     # an old compiler without the flag
            pytest.skip(f"{kernels.compiler()} does not know {variant.name}'s flags: {str(e)[:200]}")
        raise
    assert out.is_file() and out.stat().st_size > 10_000
    assert stat.S_IMODE(out.stat().st_mode) == FOLDER_MODE    # readable by all who share the cache, as a folder


@pytest.mark.skipif(kernels.compiler() is None or not __import__("sys").platform.startswith("linux"),
                    reason="no C compiler here, or not Linux (the stand-in compiler is a shell script)")
@pytest.mark.slow
def test_a_compiler_without_openmp_gets_a_one_thread_build_said_once(tmp_path, monkeypatch):
    """Apple's clang has no ``-fopenmp``: the kernels are built without it, the library says so through its
    features, and the line says the kernels run on one thread; a second load finds that build in the cache."""
    real = kernels.compiler()
    fake = tmp_path / "cc-without-openmp"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "unsupported option -fopenmp" >&2; '
                    f'exit 1; }}; done\nexec {real} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_LIB", [])
    monkeypatch.setattr(kernels, "_INFO", [])
    said = []
    lib = kernels.load(log=said.append)
    assert lib is not None and not lib.hsd_features() & variants.OPENMP
    assert any("cannot build with OpenMP" in s and "one thread" in s for s in said)
    assert kernels.info().openmp is False and "1 thread (built without OpenMP)" in kernels.info().line(2)
    monkeypatch.setattr(kernels, "_LIB", [])
    monkeypatch.setattr(kernels, "_INFO", [])
    again = []
    assert kernels.load(log=again.append) is not None and not again      # cached: no build, nothing said


@pytest.mark.skipif(not compiler_has_openmp(), reason="the compiler here cannot build with OpenMP")
@pytest.mark.slow
def test_one_build_without_openmp_asked_for_leaves_the_next_with_openmp(tmp_path, monkeypatch):
    """``HSD_OPENMP=0`` once builds a one-thread library into the cache; a later load without it builds and loads
    the OpenMP one (the one-thread library was taken for a failed OpenMP build and kept every command on one
    thread)."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    for wanted, openmp in (("0", False), (None, True)):
        if wanted is None:
            monkeypatch.delenv("HSD_OPENMP", raising=False)
        else:
            monkeypatch.setenv("HSD_OPENMP", wanted)
        monkeypatch.setattr(kernels, "_LIB", [])
        monkeypatch.setattr(kernels, "_INFO", [])
        assert kernels.load() is not None and kernels.info().openmp is openmp


def test_a_bad_hsd_openmp_is_an_error_naming_it_not_a_silent_torch_path(monkeypatch):
    """``HSD_OPENMP=maybe`` is refused naming the variable (it made the kernels "unavailable" and every command
    ran on torch's slower path), before anything is built or cached."""
    monkeypatch.setenv("HSD_OPENMP", "maybe")
    monkeypatch.setattr(kernels, "_LIB", [])
    monkeypatch.setattr(kernels, "_INFO", [])
    monkeypatch.setattr(kernels, "_WHY", [])
    with pytest.raises(HsdError, match="^HSD_OPENMP='maybe': expected 1 or 0"):
        kernels.load()
    assert kernels._LIB == []                   # nothing decided: a fixed setting loads as usual
    monkeypatch.setenv("HSD_OPENMP", "on")
    assert kernels.load() is not None
