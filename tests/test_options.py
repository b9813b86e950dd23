"""The commands' flag parsers (:mod:`hsd_opt.commands.options`): typed values out, one-line errors naming the flag."""

from __future__ import annotations

import pytest

from hsd_opt.commands import options
from hsd_opt.errors import HsdError


def test_layer_numbers_read_the_syntax_only():
    assert options.layer_numbers("all") is None and options.layer_numbers(" * ") is None     # every layer
    assert options.layer_numbers("none") == options.layer_numbers(" None ") == []
    assert options.layer_numbers("4, 2,3") == [4, 2, 3]                      # unsorted: the model checks them
    assert options.layer_numbers("2-4,9") == [2, 3, 4, 9]
    assert options.layer_numbers("99") == [99]                               # the range is checked once loaded
    for bad in ("x", "2-", "-3", "1.5", "4,a"):
        with pytest.raises(HsdError, match="--layers: expected"):
            options.layer_numbers(bad)
    with pytest.raises(HsdError, match="--draft-layers"):
        options.layer_numbers("x", "--draft-layers")


def test_quantized_kinds_and_copies():
    assert options.quant_spec("int8") == (8, 0) and options.quant_spec(" INT4 ") == (4, 32)
    assert options.copy_spec("int4") == (4, 32, 8) and options.copy_spec("Int4-Head4") == (4, 32, 4)
    for f, bad in ((options.quant_spec, "int3"), (options.quant_spec, "int4-head4"), (options.copy_spec, "int2")):
        with pytest.raises(HsdError, match="--quantized"):
            f(bad)
    assert options.quantized_copies(None) is None                             # the profiler's default
    assert options.quantized_copies("none") == [] and options.quantized_copies(" ") == []
    assert options.quantized_copies("int4,int8,int4") == [(None, "int4"), (None, "int8")]
    assert options.quantized_copies("int8,qwen2.5-coder-0.5b:int4,INT8") == [
        (None, "int8"), ("qwen2.5-coder-0.5b", "int4")]
    assert options.quantized_copies("split-gguf:qwen2.5-coder-0.5b:int4") == [
        ("split-gguf:qwen2.5-coder-0.5b", "int4")]
    assert options.quantized_copies("int4-head4,small:INT4-head4") == [(None, "int4-head4"), ("small", "int4-head4")]
    for bad in ("small:int3", ":int4", "int2", "int4-head3", "int8-head4"):
        with pytest.raises(HsdError, match="--quantized"):
            options.quantized_copies(bad)


def test_target_precision_and_dtype():
    assert options.resolve_target_precision("int4", "auto") == ("auto", "int4")
    assert options.resolve_target_precision(" INT8 ", "float32") == ("float32", "int8")
    assert options.resolve_target_precision("bfloat16", None) == ("bfloat16", "bfloat16")
    assert options.resolve_target_precision("bfloat16", "bf16") == ("bfloat16", "bfloat16")
    assert options.resolve_target_precision(None, "float32") == ("float32", None)
    assert options.resolve_target_precision("auto", None) == ("auto", None)
    with pytest.raises(HsdError, match="--target-precision"):
        options.resolve_target_precision("int3", None)
    with pytest.raises(HsdError, match="disagree"):
        options.resolve_target_precision("bfloat16", "float32")


def test_cost_contexts():
    assert options.cost_contexts("2048, 64,512,64") == [64, 512, 2048]
    for bad in ("", "64,x", "0", "64,-5", "1.5", "64,"):
        with pytest.raises(HsdError, match="--cost-contexts"):
            options.cost_contexts(bad)


def test_shard():
    assert options.shard(None) is None and options.shard("") is None
    assert options.shard("0/4") == (0, 4) and options.shard(" 3 / 4 ") == (3, 4)
    for bad in ("4/4", "1/0", "a/b", "1", "-1/2"):
        with pytest.raises(HsdError, match="--shard"):
            options.shard(bad)
