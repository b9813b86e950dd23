"""The on/off settings read from the environment: 1/0, on/off, yes/no, true/false in any case, the default where
unset or empty, anything else refused naming the variable (it was taken as on: ``HSD_CUDA_GRAPHS=false`` turned
the graphs on)."""

from __future__ import annotations

import pytest

from hsd_opt.errors import HsdError
from hsd_opt.values import env_switch


def test_an_environment_switch_reads_the_usual_words_and_refuses_others(monkeypatch):
    for value, want in (("1", True), ("on", True), (" YES ", True), ("True", True), ("0", False), ("off", False),
                        ("No", False), ("false", False)):
        monkeypatch.setenv("HSD_X", value)
        assert env_switch("HSD_X", not want) is want, value
    for default in (True, False):
        monkeypatch.setenv("HSD_X", "")
        assert env_switch("HSD_X", default) is default
        monkeypatch.delenv("HSD_X")
        assert env_switch("HSD_X", default) is default
    monkeypatch.setenv("HSD_X", "maybe")
    with pytest.raises(HsdError, match=r"HSD_X='maybe': expected 1 or 0"):
        env_switch("HSD_X", True)


def test_the_engines_settings_read_off_as_off(monkeypatch):
    from hsd_opt.engine.layered import torch_path_settings

    monkeypatch.setenv("HSD_CUDA_GRAPHS", "false")
    monkeypatch.setenv("HSD_FIXED_SHAPES", "off")
    monkeypatch.setenv("HSD_COMPILE", "yes")
    got = torch_path_settings()
    assert got["cuda_graphs"] is False and got["compiled"] is True
