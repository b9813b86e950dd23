"""Every exported kernel built for Arm (each NEON variant, with and without OpenMP) gives, under emulation, the
bytes the portable build gives here: ``tests/arm/cases.py`` writes the cases and the reference outputs,
``tests/arm/check_kernels.c`` recomputes them with the kernels built for the target. The same driver built for each
x86 variant this CPU runs checks the driver itself. Needs Debian's ``gcc-aarch64-linux-gnu`` and ``qemu-user``
(``make test-arm`` installs them); skipped, saying so, without them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hsd_opt.engine import kernels, variants
from tests.arm.cases import write
from tests.helpers import compiler_has_openmp

HERE = Path(__file__).parent
DRIVER = HERE / "arm" / "check_kernels.c"
CROSS = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("arm") / "cases.bin"
    write(path)
    return path


def _build(cc: str, variant: variants.Variant, openmp: bool, out: Path) -> Path:
    # the library's own flags (the same optimizations and instruction sets), for an executable
    cmd = [cc, *(f for f in kernels.flags(variant, openmp) if f != "-shared"), str(DRIVER), "-o", str(out), "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def _run(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.rstrip().endswith(" 0 failed"), res.stdout[-3000:] + res.stderr[-2000:]
    return res.stdout


ARM = [v for v in variants.VARIANTS if v.arch == "aarch64"]
#: Compiles and emulates: `make test-arm` and `make test` run these, not the inner loop's `make test-fast`.
pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which(CROSS) is None or shutil.which(QEMU) is None,
                    reason=f"no {CROSS} or {QEMU} here (make test-arm installs them): the Arm variants are not tested")
@pytest.mark.parametrize("variant", ARM, ids=[v.name for v in ARM])
@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "no-openmp"])
def test_each_arm_variant_gives_the_portable_bytes_under_emulation(cases, tmp_path, variant, openmp):
    exe = _build(CROSS, variant, openmp, tmp_path / "check")
    out = _run([QEMU, "-L", SYSROOT, str(exe), str(cases)])
    features = int(out.splitlines()[0].rsplit(" ", 1)[1])
    assert features & ~variants.OPENMP == variant.features and bool(features & variants.OPENMP) == openmp
    assert out.count("\nok ") >= 78 and "ok     hsd_filter_probs" in out    # every case ran


X86 = [v for v in variants.VARIANTS if v.arch in ("x86_64", "any")]


@pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler here")
@pytest.mark.parametrize("variant", X86, ids=[v.name for v in X86])
@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "no-openmp"])
def test_every_x86_variant_this_cpu_runs_gives_the_portable_bytes(cases, tmp_path, variant, openmp):
    """Natively, each variant (with and without OpenMP) agrees with the portable bytes on every exported kernel;
    a variant this CPU cannot run is skipped, naming what it lacks."""
    lack = variants.missing(variant, variants.cpu_features())
    if lack:
        pytest.skip(f"this CPU lacks {', '.join(lack)}: the {variant.name} variant is not tested here")
    if openmp and not compiler_has_openmp():
        pytest.skip(f"{kernels.compiler()} builds without OpenMP here: the build without it is tested")
    out = _run([str(_build(kernels.compiler(), variant, openmp, tmp_path / "check")), str(cases)])
    features = int(out.splitlines()[0].rsplit(" ", 1)[1])
    assert features & ~variants.OPENMP == variant.features and bool(features & variants.OPENMP) == openmp
    assert "ok     hsd_layers" in out and "ok     hsd_screen_pick" in out and "ok     hsd_screen_pick offsets" in out \
        and "ok     hsd_screen_window top-k, min-p, offsets, pins" in out and "ok     hsd_gumbel" in out \
        and "ok     hsd_filter_probs" in out
