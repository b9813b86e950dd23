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
