"""Files written atomically, with errors that name the path: a path that cannot be written is refused before any
work (``check_writable``) or, found while writing, an :class:`OutputFileError` (an ``HsdError`` and an ``OSError``)
that leaves nothing behind; a new file gets the permissions ``open`` would give it. JSON read that Python's reader
refuses (malformed, a number too long, nesting too deep): an error naming the file and the line."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from hsd_opt.errors import HsdError, InputFileError, OutputFileError
from hsd_opt.jsonio import FILE_MODE, atomic_write, check_writable, read_json, write_json
from hsd_opt.prompts import load_prompts
from tests.helpers import cli_output, run_cli


def _unwritable_paths(tmp_path):
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("x")
    return {str(tmp_path / "a_dir"): "is a directory", str(tmp_path / "a_file" / "out.json"): "is a file"}


def test_paths_that_cannot_be_written_are_refused_naming_the_flag_and_the_path(tmp_path):
    for path, why in _unwritable_paths(tmp_path).items():
        with pytest.raises(HsdError) as e:
            check_writable(path, "--out")
        assert str(e.value).startswith(f"--out {path}") and why in str(e.value), e.value
        with pytest.raises(OutputFileError) as w:
            write_json(path, {"a": 1})
        assert path in str(w.value) and isinstance(w.value, OSError)
    assert sorted(os.listdir(tmp_path)) == ["a_dir", "a_file"] and not os.listdir(tmp_path / "a_dir")
    check_writable(tmp_path / "new" / "p.json", "--out")     # a folder to be made is fine, and none is made yet
    assert not (tmp_path / "new").exists()
    write_json(tmp_path / "new" / "p.json", {"a": 1})         # the write makes it


def test_a_folder_that_cannot_be_made_is_refused_before_the_work_even_as_root(tmp_path):
    """``os.access`` grants root every folder: ``--json /proc/x/out.json`` (a pseudo-filesystem where no folder can
    be made) passed the check and failed after the work. A read-only folder refuses the same way as a non-root
    user sees it; nothing is left behind where a folder can be made."""
    with pytest.raises(HsdError, match=r"^--json /proc/hsd-x/out.json: cannot write it: no folder can be made in "
                                       r"/proc \("):
        check_writable("/proc/hsd-x/out.json", "--json")
    check_writable(tmp_path / "a" / "b" / "out.json", "--json")
    assert os.listdir(tmp_path) == []


def test_a_link_is_checked_where_it_points_as_it_is_written(tmp_path, monkeypatch):
    """The check tried the link's own folder, the write the folder it points into: ``--json link`` to a place no
    file can be written passed the check and failed after the work (the answers lost). Its own folder is still
    checked: files beside it (a profile's checkpoint) are written there."""
    doomed, fine = tmp_path / "doomed.json", tmp_path / "fine.json"
    doomed.symlink_to("/proc/hsd-x/out.json")
    with pytest.raises(HsdError, match=rf"^--json {doomed}: cannot write it: no folder can be made in /proc"):
        check_writable(doomed, "--json")
    fine.symlink_to(tmp_path / "sub" / "real.json")
    check_writable(fine, "--json")
    write_json(fine, {"a": 1})
    assert fine.is_symlink() and read_json(tmp_path / "sub" / "real.json") == {"a": 1}
    ro = tmp_path / "ro"                 # a folder where no file can be made, holding a link to a writable one
    ro.mkdir()
    (ro / "P.json").symlink_to(tmp_path / "w" / "P.json")
    made = tempfile.mkstemp

    def refused_in_ro(*args, dir=None, **kw):
        if dir is not None and os.path.samefile(dir, ro):
            raise PermissionError(1, "Operation not permitted")
        return made(*args, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", refused_in_ro)
    with pytest.raises(HsdError, match=r"--out .*ro/P\.json: cannot write there \(Operation not permitted"):
        check_writable(ro / "P.json", "--out")        # a profile's checkpoint goes beside the link


def test_a_device_or_a_pipe_is_refused_not_replaced_by_a_file(tmp_path):
    """``--out /dev/null`` as root renamed a file onto the device (``/dev/full`` became a 3 KB file), and a FIFO
    was replaced by a file: the outputs are renamed into place, so a path that is not a regular file is refused,
    before the work and at the write, and left as it was."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        with pytest.raises(HsdError, match=f"^--out {path}: not a regular file"):
            check_writable(path, "--out")
        with pytest.raises(OutputFileError, match="not a regular file"):
            write_json(path, {"a": 1})
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["fifo"]


def test_a_dash_is_refused_rather_than_written_as_a_file_named_dash(tmp_path, monkeypatch):
    """``--json -`` reads as standard output; the outputs are written whole and atomically, so it is refused
    rather than leaving a file called ``-`` in the working folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HsdError, match=r"^--json -: expected a file name"):
        check_writable("-", "--json")
    check_writable("./-", "--json")             # a file that happens to be called so, asked for as such: fine
    assert os.listdir(tmp_path) == []


def test_a_link_is_written_through_and_stays_a_link(tmp_path):
    """Writing to a symbolic link replaces the file it points to, not the link (it became a file of its own, and
    the file it pointed to kept its old bytes)."""
    from hsd_opt.jsonio import atomic_write_bytes

    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "t.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_bytes(link, b"new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path):
    path = tmp_path / "p.json"
    write_json(path, {"a": 1})

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputFileError, match="No space left on device"):
        atomic_write(path, fail)
    assert read_json(path) == {"a": 1} and os.listdir(tmp_path) == ["p.json"]


def test_a_new_file_gets_the_permissions_open_would_give_it_and_a_replaced_one_keeps_its_own(tmp_path):
    write_json(tmp_path / "r.json", {"a": 1})
    os.chmod(tmp_path / "r.json", 0o600)
    write_json(tmp_path / "r.json", {"a": 2})
    assert stat.S_IMODE(os.stat(tmp_path / "r.json").st_mode) == 0o600 and read_json(tmp_path / "r.json") == {"a": 2}
    write_json(tmp_path / "p.json", {"a": 1})
    with open(tmp_path / "q.json", "w") as f:
        f.write("{}")
    assert stat.S_IMODE(os.stat(tmp_path / "p.json").st_mode) == FILE_MODE
    assert FILE_MODE == stat.S_IMODE(os.stat(tmp_path / "q.json").st_mode)


def test_solve_refuses_an_output_it_cannot_write_before_solving(tmp_path):
    profile = os.path.join(os.path.dirname(__file__), "data", "profile_lookup.json")
    for path, why in _unwritable_paths(tmp_path).items():
        r = run_cli("solve", "--profile", profile, "--tmax", "4", "--out", path)
        out = cli_output(r)
        assert r.exit_code == 2 and f"--out {path}" in out and why in out and "Traceback" not in out, out
        assert "hierarchy" not in out     # refused before the plan was solved and printed


# JSON a user hands in that Python's reader refuses for other reasons than its syntax (a number of more digits than
# it converts, nesting deeper than it recurses): an error naming the file and the line, never a traceback.
HUGE = "7" * 5000
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("text,needle", [('{"a": ' + HUGE + "}", "a number too long to read"),
                                         ('{"a": ' + DEEP + "}", "nest too deeply"),
                                         ('{"a": ', "malformed JSON at line 1 column 7")])
def test_a_json_file_python_cannot_read_is_an_error_naming_it(tmp_path, text, needle):
    p = tmp_path / "x.json"
    p.write_text(text)
    with pytest.raises(InputFileError, match="x.json") as e:
        read_json(p)
    assert needle in str(e.value)


@pytest.mark.parametrize("bad", ['{"prompt": "hi", "n": ' + HUGE + "}", '{"prompt": ' + DEEP + "}"])
def test_a_prompt_file_line_python_cannot_read_is_an_error_naming_the_line(tmp_path, bad):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "fine"}\n' + bad + "\n")
    with pytest.raises(InputFileError, match="p.jsonl") as e:
        load_prompts(p)
    assert "line 2" in str(e.value)


def test_a_path_that_is_not_a_path_is_named_not_a_pathlib_traceback(tmp_path):
    """``load_plan(None)``, ``save_plan(plan, None)``: pathlib's TypeError; now one line naming the argument."""
    for call in (lambda: read_json(None), lambda: write_json(None, {}), lambda: read_json(3),
                 lambda: atomic_write(None, lambda f: None)):
        with pytest.raises(HsdError, match="path: expected a file path"):
            call()
