"""The cache directory: ``$HSD_CACHE`` when set and not empty, else ``~/.cache/hsd-opt``."""

from pathlib import Path

from hsd_opt.cache import cache_dir
from hsd_opt.drafters.bigram import table_path


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert table_path(None, "abc", 4, None) == tmp_path / "bigram-abc-k4.npz"


def test_cache_dir_defaults_to_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("HSD_CACHE", raising=False)
        else:
            monkeypatch.setenv("HSD_CACHE", value)
        assert cache_dir() == Path(tmp_path) / ".cache" / "hsd-opt"
        assert table_path(None, "abc", 4, 1).parent == cache_dir()


def test_a_cache_named_with_a_tilde_or_relatively_is_one_absolute_folder(monkeypatch, tmp_path):
    """``HSD_CACHE='~/c'`` (quoted, so no shell expanded it) was a folder called ``~`` under the current one, and
    a relative cache another cache in each folder a command ran in."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HSD_CACHE", "~/c")
    assert cache_dir() == tmp_path / "home" / "c"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HSD_CACHE", "rel")
    assert cache_dir() == tmp_path / "rel" and cache_dir().is_absolute()


def test_a_cache_that_cannot_hold_adeds_matrix_or_a_bigram_table_says_so_before_the_work(monkeypatch, tmp_path):
    """ADED's tri-gram matrix and the bigram table are kept in the cache: one that cannot take them (here a path
    under a file, which not even root can make) is one line naming ``HSD_CACHE`` and the fix, before the matrix is
    counted or the table built (minutes of work, then a bare 'cannot write' naming a file)."""
    import pytest

    import hsd_opt.drafters.aded as aded
    import hsd_opt.drafters.bigram as bigram
    from hsd_opt.cache import UnwritableFolder
    from hsd_opt.profiler.pool import build_aded

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HSD_CACHE", str(blocker / "cache"))

    def never(*a, **k):
        pytest.fail("the work ran before the cache was found unwritable")

    monkeypatch.setattr(aded.TrigramMatrix, "from_sequences", classmethod(never))
    monkeypatch.setattr(bigram, "build_bigram_table", never)
    for make in (lambda: build_aded({"0": [5, 6, 7, 5, 6, 7]}, 1, lambda m: None),
                 lambda: bigram.load_or_build_bigram_table(object(), "abc", top_k=4, bos_id=None)):
        with pytest.raises(UnwritableFolder) as e:
            make()
        msg = str(e.value)
        assert msg.startswith(f"HSD_CACHE={blocker / 'cache'}: the cache cannot hold") and "\n" not in msg
        assert "point HSD_CACHE at a folder you can write" in msg
