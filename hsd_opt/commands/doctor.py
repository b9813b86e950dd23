"""``hsd doctor``: what runs on this machine. The package and its main dependencies, the CPU and the kernel variant
chosen for it (and why), the threads a kernel call uses, where the compiled library is cached, what the engines
fall back to where the kernels are unavailable, and which packages that only some commands need are missing.
``hsd --version`` prints the package's version line."""

from __future__ import annotations

import platform
import sys

import typer

from hsd_opt.commands.common import cli_command
from hsd_opt.console import console
from hsd_opt.version import __version__


def version_line() -> str:
    """``hsd-opt X.Y.Z (Python A.B.C, platform)``."""
    return f"hsd-opt {__version__} (Python {platform.python_version()}, {platform.system()} {platform.machine()})"


def version_callback(value: bool) -> None:
    if value:
        console.print(version_line())
        raise typer.Exit()


def system_lines() -> list[str]:
    """The lines ``hsd doctor`` prints: versions, the CPU, the variants it runs, the loaded one (a profile and
    ``hsd bench`` record the same choice as ``kernels.provenance``), the compiler, how CUDA runs (where it is) and
    the cache."""
    import torch

    from hsd_opt.cache import cache_dir
    from hsd_opt.engine import kernels, variants

    feats = variants.cpu_features()
    runs = [v.name for v in variants.runnable(feats)]
    lines = [version_line(),
             f"torch {torch.__version__}; {torch.get_num_threads()} threads; CUDA "
             f"{'available: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'not available'}",
             f"cpu: {variants.cpu_name()}; {variants.machine()}; "
             f"{' '.join(sorted(f for f in feats if f in variants.SHOWN_FEATURES)) or 'no SIMD features read'}",
             f"variants this CPU runs: {', '.join(runs)}"]
    info = kernels.info()
    if info is None:
        lines.append(f"kernels: unavailable ({kernels.unavailable_reason()}): decoding on the CPU uses torch's "
                     f"operations, {kernels.TORCH_PATH_SLOWDOWN}")
    else:
        asked = torch.get_num_threads()
        got = kernels.team(kernels.load(), asked)[0] if info.openmp else 1       # what a kernel call gets
        lines.append(info.line(got, asked))
    cc = info.compiler if info is not None else kernels.compiler()
    lines.append(f"compiler: {cc or 'none found (install gcc or clang, or set CC)'}; HSD_KERNELS=<variant> forces "
                 f"one, HSD_OPENMP=0 builds without OpenMP")
    lines.append(sampling_line(kernels.load() if info is not None else None))
    if torch.cuda.is_available():
        lines.append(cuda_line())
    lines.append(packages_line(torch.cuda.is_available()))
    lines.append(f"cache: {cache_dir()}")
    return lines


def sampling_line(lib) -> str:
    """Where a sampled draw's noise comes from on the CPU with the kernels library ``lib`` (None: none loaded:
    no screen, so no draws by noise; :func:`~hsd_opt.engine.kernels.makes_noise`)."""
    from hsd_opt.engine import kernels

    screen = ("at top-p 1 a target with an int8 screen draws by noise, with top-k or min-p it computes only the "
              "logits they may keep")
    if kernels.makes_noise(lib):
        return f"sampling: the kernels make each draw's noise (splitmix64, vectorized logarithms); {screen}"
    return (f"sampling: torch's noise (torch.rand); {screen}"
            if lib is not None else "sampling: torch's noise and distributions (no kernels)")


def packages_line(cuda: bool) -> str:
    """Which of the dependencies that only some commands need are missing here, and what each is for
    (:mod:`hsd_opt.packages`; Triton only where CUDA is: the CPU path has no use for it)."""
    from hsd_opt.packages import OPTIONAL, missing

    gone = [m for m in missing() if cuda or m != "triton"]
    if not gone:
        return "optional packages: all installed"
    return (f"optional packages missing here (pip install {' '.join(gone)}): "
            + "; ".join(f"{m}, for {OPTIONAL[m]}" for m in gone))


def cuda_line() -> str:
    """How engines on CUDA run the torch path: decode steps and verify passes at fixed shapes, their layers
    compiled, their attention in Triton kernels, passes replayed from CUDA graphs, copies reading their codes (each
    as its setting reads now,
    :func:`~hsd_opt.engine.layered.torch_path_settings`)."""
    from hsd_opt.engine.layered import torch_path_settings

    now = torch_path_settings()

    def state(key: str, variable: str) -> str:
        on = now[key]
        return f"{'on' if on else 'off'} ({variable}={'0' if on else '1'} turns it {'off' if on else 'on'})"

    return (f"cuda: passes at fixed shapes {state('fixed_shapes', 'HSD_FIXED_SHAPES')}; their layers compiled "
            f"{state('compiled', 'HSD_COMPILE')}; their attention in Triton kernels "
            f"{state('triton_attention', 'HSD_TRITON_ATTENTION')}; passes replayed from CUDA "
            f"graphs {state('cuda_graphs', 'HSD_CUDA_GRAPHS')}; quantized copies "
            f"reading their codes {state('weight_only', 'HSD_WEIGHT_ONLY')}")


@cli_command
def doctor_cmd() -> None:
    """Print what runs here: the kernel variant for this CPU and why, threads, the library's cache, versions."""
    from hsd_opt.console import err_console
    from hsd_opt.engine import kernels
    kernels.load(log=lambda m: err_console.print(m))
    for line in system_lines():
        console.print(line, soft_wrap=True)
    sys.stdout.flush()
