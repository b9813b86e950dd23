"""The CPU decode kernels: numerically the operations they replace, batch-invariant bit for bit, the same
decoding as the torch path, built once and cached, and refused or skipped cleanly where they cannot run."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from hsd_opt.engine import kernels, variants
from hsd_opt.engine import weights as wq
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.quantized import QuantizedLM
from hsd_opt.errors import HsdError
from hsd_opt.runtime.decode import HSD, Level
from tests.helpers import compiler_has_openmp, make_tiny_llama, stepwise_greedy

LIB = kernels.load()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here: the kernels cannot be built")


def _mat(kind: str, w: torch.Tensor, b: torch.Tensor | None) -> wq.Mat:
    if kind == "f32":
        return wq.Mat.in_place(w.contiguous(), b)
    if kind == "bf16":
        return wq.Mat.in_place(w.bfloat16().contiguous(), b)
    return wq.quantize(w, 8 if kind == "q8" else 4, b)


@pytest.mark.parametrize("kind,rows,cols", [(k, r, c) for k in ("f32", "bf16", "q8", "q4")
                                             for r, c in ((37, 64), (8, 96), (5, 40)) if k != "q4" or c % 32 == 0])
def test_linear_is_the_matrix_product_of_its_weights(kind, rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    w, b = torch.randn(rows, cols, generator=g), torch.randn(rows, generator=g)
    mat = _mat(kind, w, b)
    deq = mat.dequantized()
    for m in (1, 2, 3, 5, 7):
        x = torch.randn(m, cols, generator=g)
        got = kernels.linear(LIB, mat, x)
        if kind in ("q4", "q8") and cols % wq.GROUP == 0:
            want = _integer_reference(mat, x) + b.double()
        else:
            want = x.double() @ deq.double().t() + b.double()
        assert got.shape == (m, rows) and got.dtype == torch.float32
        assert (got.double() - want).abs().max() <= 1e-4 * (1 + want.abs().max())
        # and what the weights compute on the unquantized input, to within the activations' rounding
        exact = x.double() @ deq.double().t() + b.double()
        assert (got.double() - exact).abs().max() <= 0.02 * (1 + exact.abs().max())
    if kind != "f32":   # quantized (or rounded) weights, each within half a step of the original
        assert not torch.equal(deq, w)


@pytest.mark.parametrize("kind", ["f32", "bf16", "q8", "q4"])
def test_a_row_that_is_not_finite_gives_no_finite_output(kind):
    """An input row holding a NaN or an infinity makes every output of that row not finite, as the float product
    does (the int8 activations of the integer path cannot hold one: a NaN came out as plausible numbers); the rows
    beside it are what they are alone."""
    g = torch.Generator().manual_seed(11)
    mat = _mat(kind, torch.randn(8, 64, generator=g), None)
    x = torch.randn(4, 64, generator=g)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    got = kernels.linear(LIB, mat, x)
    assert not torch.isfinite(got[1:3]).any()
    for i in (0, 3):
        assert torch.equal(got[i], kernels.linear(LIB, mat, x[i:i + 1])[0]) and torch.isfinite(got[i]).all()


def _integer_reference(mat: wq.Mat, x: torch.Tensor) -> torch.Tensor:
    """int4 / int8 rows times int8 activations, the scheme of kernels.c's integer path, in float64: each
    position's input quantized per group of 32 columns to round(x * 127 / max|x|), scale max|x| / 127."""
    m, K = x.shape
    xg = x.reshape(m, K // 32, 32)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xg * inv[..., None]).double()                    # [m, G, 32]
    d, sums = (amax / 127.0).double(), xg.sum(-1).double()           # [m, G]
    if mat.kind == wq.Q4:
        scale, zero = wq.q4_factors(mat)
        codes = wq.q4_codes(mat).double()                       # [N, G, 32]
        dots = torch.einsum("ngc,mgc->mng", codes, q)                # [m, N, G]
        return (dots * scale.double()[None] * d[:, None]).sum(-1) + sums @ zero.double().t()
    codes, scale = mat.tensors
    dots = torch.einsum("ngc,mgc->mng", codes.double().reshape(mat.rows, K // 32, 32), q)
    return (dots * d[:, None]).sum(-1) * scale.double()[None]


@pytest.mark.parametrize("kind", ["f32", "bf16", "q8", "q4"])
def test_linear_is_batch_invariant(kind):
    """A product over m rows gives, bit for bit, what m one-row products give, at every m (tiles differ), with an
    even and an odd number of groups of 32 columns (int4: the last group's pair half empty)."""
    g = torch.Generator().manual_seed(1)
    for cols in (128, 160):
        w = torch.randn(45, cols, generator=g)
        mat = _mat(kind, w, torch.randn(45, generator=g))
        x = torch.randn(70, cols, generator=g)
        one = torch.cat([kernels.linear(LIB, mat, x[i:i + 1]) for i in range(70)])
        for m in (2, 3, 4, 5, 6, 7, 8, 9, 11, 14, 16, 70):
            assert torch.equal(kernels.linear(LIB, mat, x[:m]), one[:m]), (cols, m)


@pytest.mark.skipif(LIB is None or LIB.hsd_simd() < 2, reason="this CPU has no AVX-512: no 16-lane tiles to test")
def test_the_16_lane_tiles_give_the_8_lane_tiles_bits(tmp_path):
    """Where the CPU has AVX-512, float32 products over 2+ positions take 16-lane tiles (two rows' 8-lane
    accumulators in one register): every element bit for bit what the 8-lane tiles (AVX2 alone) give."""
    narrow = kernels.load(variant="avx2")
    assert narrow.hsd_simd() == 1
    g = torch.Generator().manual_seed(3)
    for kind, cols in (("f32", 576), ("f32", 133), ("bf16", 200)):
        mat = _mat(kind, torch.randn(42, cols, generator=g), torch.randn(42, generator=g))
        x = torch.randn(70, cols, generator=g)
        for m in (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 70):
            assert torch.equal(kernels.linear(LIB, mat, x[:m]), kernels.linear(narrow, mat, x[:m])), (kind, cols, m)


def test_the_kernels_exponential_is_within_2_ulp_and_the_same_in_every_lane():
    """The softmax and SiLU's e^x (``hsd_exp``, vectorized by the compiler): within 2 units in the last place of
    the exact value over the range it is not clamped in, and each element the same whether it is computed in a
    vector's lanes or alone (one call per element)."""
    LIB.hsd_exp_rows.restype = None
    LIB.hsd_exp_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    x = torch.cat([torch.linspace(-87.0, 88.0, 200_003), torch.randn(9_999) * 4, torch.tensor([0.0, -0.0, 1e-30])])
    y = torch.empty_like(x)
    LIB.hsd_exp_rows(x.data_ptr(), x.numel(), y.data_ptr())
    exact = x.double().exp()
    ulp = (exact.float().nextafter(torch.tensor(float("inf"))).double() - exact.float().double()).abs()
    assert ((y.double() - exact).abs() / ulp).max() <= 2
    alone = torch.empty(1)
    for i in torch.randint(0, x.numel(), (300,), generator=torch.Generator().manual_seed(0)).tolist():
        LIB.hsd_exp_rows(x[i:].data_ptr(), 1, alone.data_ptr())
        assert alone.item() == y[i].item()


def test_q4_recovers_q4_1_weights_and_rounds_others_to_the_nearest_code():
    """GGUF Q4_1 groups (code * d + m, codes 0..15, d and m in float16) come back exactly; any other weight is
    within half a step (plus the float16 rounding of the step) of its original."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 4, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(48, 4, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (torch.randn(48, 4, 1, generator=g) * 0.05).half().float()
    w = (q * d + m).reshape(48, 128)
    mat = wq.quantize_q4(w)
    assert mat.tensors[1].dtype == torch.float16 and mat.tensors[2].dtype == torch.float16
    torch.testing.assert_close(mat.dequantized(), w, rtol=0, atol=1e-6)
    w2 = torch.randn(16, 64, generator=g)
    wg = w2.reshape(16, 2, 32)
    step = ((wg.amax(-1) - wg.amin(-1)) / 15).repeat_interleave(32, dim=1)
    err = (wq.quantize_q4(w2).dequantized() - w2).abs()
    assert (err <= step * 0.5 * 1.01 + 2e-3 * w2.abs()).all() and err.max() > 0



def test_the_int4_block_layout_holds_every_code_scale_and_minimum_once():
    """Blocks of 16 rows (the last padded with zeros), pairs of groups: every code, scale and minimum comes back."""
    g = torch.Generator().manual_seed(5)
    for rows, groups in ((1, 1), (15, 2), (16, 5), (17, 4), (33, 3)):
        codes = torch.randint(0, 16, (rows, groups, 32), dtype=torch.uint8, generator=g)
        scale, minimum = torch.rand(rows, groups, generator=g).half(), torch.randn(rows, groups, generator=g).half()
        packed, bs, bm = wq.block_q4(codes, scale, minimum)
        blocks = (rows + 15) // 16
        assert packed.shape == (blocks, (groups + 1) // 2, 512) and bs.shape == bm.shape == (blocks, groups, 16)
        mat = wq.Mat(wq.Q4, rows, 32 * groups, [packed, bs, bm], None)
        assert torch.equal(wq.q4_codes(mat), codes)
        got_scale, got_minimum = wq.q4_factors(mat)
        assert torch.equal(got_scale, scale) and torch.equal(got_minimum, minimum)
        assert packed.sum() == codes.sum() + 15 * codes[:, 1::2].sum()   # the padding holds no code (all zeros)


def test_an_int4_row_does_not_depend_on_its_block_or_the_threads():
    """Rows are computed 16 at a time: a row's product is the same bits whichever rows share its block (the
    matrix cut after it) and however the rows are shared between threads."""
    g = torch.Generator().manual_seed(6)
    w, bias = torch.randn(45, 160, generator=g), torch.randn(45, generator=g)
    x = torch.randn(3, 160, generator=g)
    full = kernels.linear(LIB, wq.quantize_q4(w, bias), x)
    for n in (1, 15, 16, 17, 33):
        assert torch.equal(kernels.linear(LIB, wq.quantize_q4(w[:n], bias[:n]), x), full[:, :n]), n
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(kernels.linear(LIB, wq.quantize_q4(w, bias), x), full), t
    finally:
        torch.set_num_threads(threads)

@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(seed=3, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0)


def _engines(model):
    return {"f32": LayeredLM(model, kernels=True), "q8": QuantizedLM(model, bits=8, kernels=True),
            "q4": QuantizedLM(model, bits=4, kernels=True),
            "bf16": LayeredLM(_bf16(model), kernels=True)}


def _bf16(model):
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["f32", "bf16", "q8", "q4"])
def test_a_pass_over_t_positions_equals_t_steps_bit_for_bit(tiny, kind):
    """The property speculative verification relies on: hidden states, caches and logits of a verify pass over a
    block equal those of one-token steps over it, exactly."""
    eng = _engines(tiny)[kind]
    assert eng.uses_kernels
    ids = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(4))
    a, b = eng.new_state(40, save_boundaries=[2, 4]), eng.new_state(40, save_boundaries=[2, 4])
    for st in (a, b):
        eng.append(st, ids[:12])
        eng.advance(st, 4)
    eng.append(a, ids[12:30])
    eng.advance(a, 2)                 # an exit pass first: the verify pass resumes from boundary 2
    eng.advance(a, 4)
    for i in range(12, 30):
        eng.append(b, ids[i:i + 1])
        eng.advance(b, 4)
    assert torch.equal(eng.logits(a, 4, 11, 30), eng.logits(b, 4, 11, 30))
    assert torch.equal(eng.logits(a, 2, 12, 30), eng.logits(b, 2, 12, 30))
    assert all(torch.equal(x[:, :, :30], y[:, :, :30]) for x, y in zip(a.k + a.v, b.k + b.v))


@pytest.mark.parametrize("kind", ["f32", "q4"])
def test_attention_over_a_long_cache_is_the_same_whichever_way_heads_are_grouped(kind):
    """From 256 cached positions on, the query heads sharing a key/value head are attended together (their keys
    and values read once); a pass that starts before that point attends head by head. Both give the same values:
    a pass over positions 250..269 equals one-token steps over them, bit for bit."""
    model = make_tiny_llama(seed=5, vocab_size=64, layers=2, hidden=64, heads=4, kv_heads=2, scale=8.0)
    eng = LayeredLM(model, kernels=True) if kind == "f32" else QuantizedLM(model, bits=4, kernels=True)
    ids = torch.randint(3, 64, (270,), generator=torch.Generator().manual_seed(6))
    a, b = eng.new_state(280), eng.new_state(280)
    for st in (a, b):
        eng.append(st, ids[:250])
        eng.advance(st, 2)
    eng.append(a, ids[250:270])
    eng.advance(a, 2)
    for i in range(250, 270):
        eng.append(b, ids[i:i + 1])
        eng.advance(b, 2)
    assert torch.equal(eng.logits(a, 2, 250, 270), eng.logits(b, 2, 250, 270))


@pytest.mark.parametrize("hidden", [256, 192])
def test_a_few_rows_over_a_long_cache_attend_as_one_row_does(hidden):
    """Passes of a few rows over 256 cached positions or more (verifications, batched steps; the query heads of a
    key/value head attended together): every value as a one-token step's and a long pass's, whichever sequences
    share the pass, in heads of 64 lanes and of 48."""
    model = make_tiny_llama(seed=7, vocab_size=64, layers=2, hidden=hidden, heads=4, kv_heads=2, scale=8.0)
    eng = LayeredLM(model, kernels=True)
    ids = torch.randint(3, 64, (620,), generator=torch.Generator().manual_seed(8))

    def run(sizes, start=590, end=610):
        st = eng.new_state(640)
        eng.append(st, ids[:start])
        eng.advance(st, 2)
        i = start
        while i < end:
            k = min(sizes, end - i)
            eng.append(st, ids[i:i + k])
            eng.advance(st, 2)
            i += k
        return st, eng.logits(st, 2, start, end)

    one, want = run(1)
    for size in (2, 3, 8, 20):                          # 20: one pass of more rows than attend together
        st, got = run(size)
        assert torch.equal(got, want), size
        assert all(torch.equal(x[:, :, :610], y[:, :, :610]) for x, y in zip(st.k + st.v, one.k + one.v))
    # two sequences in one pass, at depths 600 and 300: each as alone
    a, b = eng.new_state(640), eng.new_state(640)
    eng.append(a, ids[:600])
    eng.append(b, ids[20:320])
    eng.advance_many([(a, 2), (b, 2)])
    eng.append(a, ids[600:603])
    eng.append(b, ids[320:322])
    eng.advance_many([(a, 2), (b, 2)])
    for st, lo, hi in ((a, 0, 603), (b, 20, 322)):
        alone = eng.new_state(640)
        eng.append(alone, ids[lo:hi - 3 if st is a else hi - 2])
        eng.advance(alone, 2)
        for i in range(alone.n, hi - lo):
            eng.append(alone, ids[lo + i:lo + i + 1])
            eng.advance(alone, 2)
        assert torch.equal(eng.logits(st, 2, 290, hi - lo), eng.logits(alone, 2, 290, hi - lo))


def test_kernel_path_tracks_the_torch_path(tiny):
    """float32: the same model computed with reordered sums (logits agree to ~1e-5); bfloat16 weights with
    float32 activations: close to the float32 model."""
    ids = torch.randint(3, 64, (40,), generator=torch.Generator().manual_seed(1))
    ref = LayeredLM(tiny, kernels=False)
    assert not ref.uses_kernels
    want = ref.head(ref.hidden_states(ids, [4])[4], 4)
    lean = LayeredLM(tiny, kernels=True)
    st = lean.new_state(48)
    lean.append(st, ids[:1])
    lean.advance(st, 4)
    for i in range(1, 40):           # decode steps, the kernels' own passes
        lean.append(st, ids[i:i + 1])
        lean.advance(st, 4)
    got = lean.logits(st, 4, 0, 40)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    bf = LayeredLM(_bf16(tiny), kernels=True)
    assert bf.dtype == torch.float32                      # float32 activations and caches
    got_bf = bf.head(bf.hidden_states(ids, [4])[4], 4)
    assert (got_bf.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_a_float32_prompt_of_prefill_on_torch_from_positions_takes_the_exact_torch_path(tiny):
    """A float32 model's prompt pass (from position 0) over the kernels' prefill_on_torch_from positions or more,
    or over more than MAX_PASS, runs the torch path (bit for bit the modules); a shorter prompt runs the kernels,
    and so does a later pass over as many positions (a verification): bit for bit the one-position steps."""
    lean, ref = LayeredLM(tiny, kernels=True), LayeredLM(tiny, kernels=False)
    n = lean._kernels.prefill_on_torch_from
    wide = kernels.PREFILL_ON_TORCH_FROM_WIDE if LIB.hsd_simd() >= 2 else kernels.PREFILL_ON_TORCH_FROM
    assert n == wide
    assert 1 < n <= kernels.MAX_PASS
    ids = torch.randint(3, 64, (kernels.MAX_PASS + 5,), generator=torch.Generator().manual_seed(2))
    for m in (n, kernels.MAX_PASS + 5):
        assert torch.equal(lean.hidden_states(ids[:m], [4])[4], ref.hidden_states(ids[:m], [4])[4])
    assert not torch.equal(lean.hidden_states(ids[:n - 1], [4])[4], ref.hidden_states(ids[:n - 1], [4])[4])
    p = 5                                          # a prompt, then one pass over n positions after it
    one = lean.new_state(p + n, save_boundaries=[4])
    lean.append(one, ids[:p])
    lean.advance(one, 4)
    lean.append(one, ids[p:p + n])
    lean.advance(one, 4)
    st = lean.new_state(p + n, save_boundaries=[4])
    lean.append(st, ids[:p])
    lean.advance(st, 4)
    for i in range(p, p + n):
        lean.append(st, ids[i:i + 1])
        lean.advance(st, 4)
    assert torch.equal(lean.logits(one, 4, p, p + n), lean.logits(st, 4, p, p + n))


def test_a_prompt_pass_ending_beyond_the_kernels_context_takes_the_torch_path(tiny, monkeypatch):
    """Prompt passes short enough for the kernels run there only while they end within PREFILL_ON_KERNELS_WITHIN
    positions (a long context's attention is faster on the torch path); passes after the prompt (decode steps,
    verifications) stay on the kernels at any context."""
    lean = LayeredLM(tiny, kernels=True)
    monkeypatch.setattr(kernels, "PREFILL_ON_KERNELS_WITHIN", 20)
    monkeypatch.setattr(kernels, "PREFILL_ON_KERNELS_WITHIN_WIDE", 20)
    m = min(10, lean._kernels.prefill_on_torch_from - 1)
    assert lean._on_kernels(0, m, 3 * m) and lean._on_kernels(m, m, 3 * m)
    assert not lean._on_kernels(20, m, 20 + m)                  # ends beyond 20: the torch path
    assert lean._on_kernels(20 + m, 1, 20 + m) and lean._on_kernels(20 + m, 4, 20 + m)  # after the prompt
    ids = torch.randint(3, 64, (20 + m,), generator=torch.Generator().manual_seed(5))
    st = lean.new_state(20 + m)
    st.prompt = 20 + m
    for a in range(0, 20 + m, m):                                   # the prompt in passes, as a decoding makes them
        lean.append(st, ids[a:a + m])
        lean.advance(st, 4)
    ref = LayeredLM(tiny, kernels=True)
    monkeypatch.setattr(kernels, "PREFILL_ON_KERNELS_WITHIN", 10**6)
    monkeypatch.setattr(kernels, "PREFILL_ON_KERNELS_WITHIN_WIDE", 10**6)
    whole = ref.new_state(20 + m)
    whole.prompt = 20 + m
    for a in range(0, 20 + m, m):
        ref.append(whole, ids[a:a + m])
        ref.advance(whole, 4)
    assert torch.equal(lean.logits(st, 4, 0, 20), ref.logits(whole, 4, 0, 20))
    assert not torch.equal(lean.logits(st, 4, 20, 20 + m), ref.logits(whole, 4, 20, 20 + m))


@pytest.mark.parametrize("kind", ["bf16", "q8", "q4"])
def test_long_passes_of_the_other_engines_match_their_steps(tiny, kind):
    """Prefill-sized passes of bfloat16 engines run the torch operations in float32 over the same weights, close
    to what their decode steps compute on the kernels; quantized copies run them on the kernels in passes of
    MAX_PASS positions (a GEMM would de-quantize every weight per pass), bit for bit their steps. The profiler's
    teacher-forced ``hidden_states`` computes exactly what the steps compute (the numbers the runtime drafts
    with)."""
    eng = _engines(tiny)[kind]
    n = kernels.MAX_PASS + 6
    ids = torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(3))
    one = eng.new_state(n, save_boundaries=[4])
    eng.append(one, ids)
    eng.advance(one, 4)                                              # one pass over n rows
    long = eng.logits(one, 4, 0, n)
    st = eng.new_state(n + 1)
    rows = []
    for i in range(n):
        eng.append(st, ids[i:i + 1])
        eng.advance(st, 4)
        rows.append(eng.logits(st, 4, i, i + 1))
    steps = torch.cat(rows)
    h = eng.hidden_states(ids, [4])[4]     # the profiler's heads take rows in blocks of at most MAX_PASS too
    assert torch.equal(torch.cat([eng.head(h[i:i + kernels.MAX_PASS], 4) for i in range(0, n, kernels.MAX_PASS)]),
                       steps)
    if kind == "bf16":   # the same float32 values in another order
        assert not eng.long_passes_on_kernels
        assert (long - steps).abs().max() <= 1e-4 * steps.abs().max()
    else:                # the same kernel operations per position, the head in blocks of MAX_PASS rows too
        assert eng.long_passes_on_kernels
        assert torch.equal(long, steps)


@pytest.mark.parametrize("chain,budgets", [(["layer1", "layer4"], [3]), (["q4", "layer2", "layer4"], [2, 3]),
                                           (["q8", "q4", "layer4"], [4, 2])])
def test_hsd_on_the_kernels_equals_their_ar(tiny, chain, budgets):
    lm = LayeredLM(tiny, kernels=True)
    q = {"q4": QuantizedLM(tiny, bits=4, kernels=True), "q8": QuantizedLM(tiny, bits=8, kernels=True)}
    levels = [Level(n, q[n], 4) if n in q else Level(n, lm, int(n[5:])) for n in chain]
    ar = HSD([Level("layer4", lm, 4)], [])
    h = HSD(levels, budgets)
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        p = torch.randint(3, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        want = stepwise_greedy(lm, p, 40)
        assert h.generate(p, 40).token_ids == want and ar.generate(p, 40).token_ids == want


@pytest.mark.slow
def test_the_library_is_built_once_and_found_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    cc, omp = kernels.compiler(), compiler_has_openmp()
    path = kernels.library_path(cc, openmp=omp)
    assert str(path).startswith(str(tmp_path)) and not path.exists()
    path.parent.mkdir(parents=True)
    killed, busy = path.parent / "tmpold.so.partial", path.parent / "tmpnow.so.partial"
    for p in (killed, busy):        # a killed build's compiler wrote on long ago; another build writes now
        p.write_bytes(b"\x7fELF")
    os.utime(killed, (1e9, 1e9))
    said = []
    kernels.build(cc, path, log=said.append, openmp=omp)
    assert path.is_file() and said and "compiling" in said[0]
    assert list(path.parent.glob("*.partial")) == [busy]      # written atomically; the old one removed
    assert kernels.library_path(cc, openmp=omp) == path   # same source, compiler and CPU: the same file


@pytest.mark.slow
def test_a_cached_library_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    """A library cut short in the cache (a full disk, a copy) made every run fall back to the torch path, warning,
    and was never rebuilt."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    monkeypatch.setenv("HSD_OPENMP", "0")
    cc = kernels.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    path = kernels.library_path(cc, variants.BY_NAME["portable"], openmp=False)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF cut short")
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no "kernels unavailable" warning
        lib = kernels.load(variant="portable")
    assert lib is not None and lib.hsd_simd() == 0 and path.stat().st_size > 1000


@pytest.mark.slow
def test_a_cached_library_cut_short_past_its_headers_is_built_again_not_a_bus_error(tmp_path):
    """A library cut short after its headers (a copy stopped midway) loaded without an error and killed the process
    with a bus error (SIGBUS) at its first use, every run; now it is found cut short and built again. Run in a
    child process, which such a crash does not take the tests down with."""
    env = {**os.environ, "HSD_CACHE": str(tmp_path), "HSD_OPENMP": "0"}
    load = ("from hsd_opt.engine import kernels, variants\n"
            "lib = kernels.load(variant='portable')\n"
            "print(lib.hsd_simd(), kernels.library_path(kernels.compiler(), variants.BY_NAME['portable'], False))")
    first = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    simd, path = first.stdout.split()
    whole = Path(path).read_bytes()
    assert kernels.library_is_whole(Path(path))
    for size in (20_000, len(whole) // 2, len(whole) - 1):
        Path(path).write_bytes(whole[:size])
        assert not kernels.library_is_whole(Path(path))
        again = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, (size, again.returncode, again.stderr)
        assert again.stdout.split() == [simd, path] and Path(path).stat().st_size == len(whole)


@pytest.mark.slow
def test_the_portable_build_agrees_with_itself_and_the_reference(tmp_path, monkeypatch):
    """The variant without AVX2 (what a CPU without it gets) computes the same products, batch-invariant."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    lib = kernels.load(variant="portable")
    assert lib is not None and lib.hsd_simd() == 0
    g = torch.Generator().manual_seed(5)
    w = torch.randn(21, 64, generator=g)
    for kind in ("f32", "bf16", "q8", "q4"):
        mat = _mat(kind, w, None)
        x = torch.randn(6, 64, generator=g)
        got = kernels.linear(lib, mat, x)
        want = _integer_reference(mat, x) if kind in ("q4", "q8") else (x @ mat.dequantized().t()).double()
        assert (got.double() - want).abs().max() <= 1e-4 * (1 + got.abs().max())
        if kind in ("q4", "q8"):    # exact integer sums, the same lanes: the same bits as the AVX2 build
            assert torch.equal(got, kernels.linear(LIB, mat, x))
        assert torch.equal(got, torch.cat([kernels.linear(lib, mat, x[i:i + 1]) for i in range(6)]))


def test_switched_off_or_impossible_means_the_torch_path(tiny, monkeypatch):
    monkeypatch.setenv("HSD_KERNELS", "0")
    assert kernels.load() is None
    assert not LayeredLM(tiny).uses_kernels and not QuantizedLM(tiny, bits=8).uses_kernels
    with pytest.raises(HsdError, match="kernels: the kernels are unavailable"):
        LayeredLM(tiny, kernels=True)
    monkeypatch.delenv("HSD_KERNELS")
    assert LayeredLM(tiny).uses_kernels                   # the default where they run
    import copy

    with pytest.raises(HsdError, match="kernels: dtype torch.float16"):
        LayeredLM(copy.deepcopy(tiny).half(), kernels=True)
    assert not LayeredLM(copy.deepcopy(tiny).half()).uses_kernels


def test_a_failed_build_is_reported_once_and_leaves_the_torch_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "SOURCE", tmp_path / "broken.c")
    (tmp_path / "broken.c").write_text("this is not C\n")
    said = []
    assert kernels.load(log=said.append, variant="portable") is None
    assert any("unavailable" in s and "failed" in s for s in said)
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.partial"))


def test_a_cache_that_cannot_hold_the_library_is_named_with_how_to_move_it(tmp_path, monkeypatch):
    """HSD_CACHE naming a file: the kernels are unavailable, and the reason names HSD_CACHE and what to do, once,
    from the widest variant too (it said the compiler could not build that one, and tried a narrower one in the
    same cache)."""
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "a_file"))
    for name in ("_LIB", "_INFO", "_WHY"):                  # the engines' own load (variant None), made afresh
        monkeypatch.setattr(kernels, name, [])
    monkeypatch.setattr(variants, "_LOADED", [])
    for variant in ("portable", None):
        said = []
        assert kernels.load(log=said.append, variant=variant) is None
        assert len(said) == 1 and "unavailable" in said[0], said
        assert f"HSD_CACHE={tmp_path / 'a_file'}: the cache cannot hold the compiled kernels" in said[0]
        assert "point HSD_CACHE at a folder you can write" in said[0] and "cannot build" not in said[0]


@pytest.mark.slow
def test_the_library_is_checked_against_this_modules_structs(tmp_path, monkeypatch):
    """A library whose ``hsd_version`` or struct layout differs from kernels.py's (an edit to one side only) is
    not used: it says which, once, and the engines take the torch path."""
    kernels.check_layout(LIB)                                       # the real one agrees
    monkeypatch.setattr(kernels, "ABI_VERSION", kernels.ABI_VERSION + 1)
    with pytest.raises(HsdError, match="version"):
        kernels.check_layout(LIB)
    monkeypatch.undo()
    src = kernels.SOURCE.read_text().replace("int32_t type, rows, cols, pad;", "int32_t type, rows, cols, pad, extra;")
    assert "extra;" in src
    (tmp_path / "kernels.c").write_text(src)
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "SOURCE", tmp_path / "kernels.c")
    said = []
    assert kernels.load(log=said.append, variant="portable") is None
    # a compiler without OpenMP also says it builds again without, and that the kernels run on one thread
    assert len(said) == (2 if compiler_has_openmp() else 4) and "compiling" in said[0]
    assert "struct layout" in said[-1] and "unavailable" in said[-1]


def test_without_a_compiler_the_python_api_is_warned_once(monkeypatch, tiny):
    """The one line the CLI prints on stderr reaches a user of the Python API as a RuntimeWarning, once, naming
    the cause and what it costs; the engines then run on the torch path."""
    monkeypatch.setattr(kernels, "_LIB", [])
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C compiler found.*slower per float32 step") as got:
        eng = LayeredLM(tiny)
    assert len(got) == 1 and not eng.uses_kernels
    assert kernels.TORCH_PATH_SLOWDOWN in str(got[0].message)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")                              # said once: no second warning
        assert not LayeredLM(tiny).uses_kernels


NO_OPENMP = pytest.mark.skipif(LIB is None or not LIB.hsd_features() & variants.OPENMP,
                               reason="this library is built without OpenMP (HSD_OPENMP=0): one thread, no team")


@NO_OPENMP
def test_a_kernel_call_runs_on_every_thread_of_torchs_openmp_runtime():
    """A kernel call's team has torch's thread count, each member its own OS thread (both cores of this machine
    busy in one call), and the library shares torch's OpenMP runtime: one libgomp in the process, and no new
    threads once torch's own parallel regions have run (docs/design.md#decode-kernels, "OpenMP")."""
    import os
    import sys

    n = torch.get_num_threads()
    assert n >= min(2, os.cpu_count() or 1)
    size, tids = kernels.team(LIB, n)
    assert size == n and len(set(tids)) == n
    if sys.platform.startswith("linux"):
        maps = Path("/proc/self/maps").read_text().splitlines()
        gomp = {line.split()[-1] for line in maps if "libgomp" in line.split()[-1]}
        assert len(gomp) == 1, gomp
        torch.ones(1 << 22).add_(1)                                  # a torch parallel region (OpenMP)
        before = len(os.listdir("/proc/self/task"))
        kernels.team(LIB, n)
        kernels.linear(LIB, wq.Mat.in_place(torch.randn(64, 64)), torch.randn(3, 64))
        assert len(os.listdir("/proc/self/task")) == before


@NO_OPENMP
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads counted in /proc")
def test_releasing_the_thread_pool_frees_this_threads_workers_and_leaves_the_kernels_exact():
    """release_thread_pool frees the calling thread's OpenMP workers (what `hsd serve` does on its main thread
    before decoding on another: one pool in the process), and a kernel call on another thread afterwards gets a
    full team and the same numbers."""
    import os
    import threading

    n = torch.get_num_threads()
    if n < 2:
        pytest.skip("one thread: no pool to free")
    if not any("libgomp" in line for line in Path("/proc/self/maps").read_text().splitlines()):
        pytest.skip("torch's OpenMP runtime is not libgomp here")
    mat, x = wq.Mat.in_place(torch.randn(64, 64)), torch.randn(3, 64)
    want = kernels.linear(LIB, mat, x)
    kernels.team(LIB, n)                                     # this thread's pool exists
    before = len(os.listdir("/proc/self/task"))
    assert kernels.release_thread_pool()
    assert len(os.listdir("/proc/self/task")) == before - (n - 1)
    got: dict = {}

    def other():
        got["team"] = kernels.team(LIB, n)[0]
        got["y"] = kernels.linear(LIB, mat, x)

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert got["team"] == n and torch.equal(got["y"], want)
    assert torch.equal(kernels.linear(LIB, mat, x), want)      # and on this thread again (a new pool)


def test_doctor_says_why_the_kernels_are_unavailable_and_which_compiler(monkeypatch):
    """``hsd doctor`` names the cause on its kernels line (it said "HSD_KERNELS=0, or see the line above", which
    neither was) and always has a compiler line (none without kernels)."""
    from hsd_opt.commands.doctor import system_lines

    monkeypatch.setattr(kernels, "_LIB", [])
    monkeypatch.setattr(kernels, "_INFO", [])
    monkeypatch.setattr(kernels, "_WHY", [])
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    with pytest.warns(RuntimeWarning):
        lines = system_lines()
    assert any(s.startswith("kernels: unavailable (no C compiler found") for s in lines), lines
    assert any(s.startswith("compiler: none found (install gcc or clang, or set CC)") for s in lines), lines
    monkeypatch.setenv("HSD_KERNELS", "0")
    assert any(s.startswith("kernels: unavailable (HSD_KERNELS=0 turns them off)") for s in system_lines())
    monkeypatch.setenv("HSD_KERNELS", " Off ")      # the value given, not another word for it
    assert any(s.startswith("kernels: unavailable (HSD_KERNELS=Off turns them off)") for s in system_lines())


@pytest.mark.skipif(not compiler_has_openmp() or (os.cpu_count() or 1) < 2,
                    reason="no OpenMP build here, or one core (one thread asked)")
@pytest.mark.slow
def test_doctor_says_the_threads_a_kernel_call_gets_not_those_asked():
    """Under ``OMP_THREAD_LIMIT=1`` (a batch system's limit) a kernel call runs on one thread: doctor said torch's
    count of threads."""
    import subprocess

    env = {**os.environ, "OMP_THREAD_LIMIT": "1", "OMP_NUM_THREADS": "2"}
    for chosen in ("HSD_KERNELS", "HSD_OPENMP"):          # the runs of `make test-variants` set them
        env.pop(chosen, None)
    res = subprocess.run([sys.executable, "-m", "hsd_opt.cli", "doctor"], capture_output=True, text=True, env=env,
                         timeout=300)
    line = next(s for s in res.stdout.splitlines() if s.startswith("kernels:"))
    assert "; 1 OpenMP thread of the 2 asked (" in line, line


@pytest.mark.parametrize("variable", ["HSD_EXACT_INT4", "HSD_FIXED_SHAPES", "HSD_WEIGHT_ONLY", "HSD_OPENMP"])
def test_doctor_refuses_a_bad_on_off_setting_as_every_command_does(variable, monkeypatch):
    """``HSD_EXACT_INT4=2 hsd doctor`` said all was well while ``hsd run`` refused the setting: doctor exits 2
    naming it too."""
    from typer.testing import CliRunner

    from hsd_opt.cli import app

    monkeypatch.setenv(variable, "2")
    res = CliRunner().invoke(app, ["doctor"])
    assert res.exit_code == 2 and f"{variable}='2': expected 1 or 0" in res.output, res.output


def _compiler_wrapper(path, script: str, cc: str, monkeypatch):
    """A compiler at ``path`` that runs the shell ``script`` and then ``cc`` with its arguments, set as ``CC`` with a
    fresh cache under ``path``'s folder, no OpenMP, the variant chosen (not forced)."""
    path.write_text(f'#!/bin/sh\n{script}\nexec {cc} "$@"\n')
    path.chmod(0o755)
    monkeypatch.setenv("HSD_CACHE", str(path.parent / "cache"))
    monkeypatch.setenv("CC", str(path))
    monkeypatch.setenv("HSD_OPENMP", "0")
    monkeypatch.delenv("HSD_KERNELS", raising=False)
    return path


@pytest.mark.slow
def test_a_compiler_that_cannot_build_the_widest_variant_falls_to_the_next_and_remembers(tmp_path, monkeypatch):
    """A compiler too old for one flag (GCC 10 and -mavxvnni) gave no kernels at all, the torch path, and tried the
    failing builds again on every command: the next variant this CPU runs is built instead, said once, and the
    failure is remembered in the cache."""
    import shutil

    chosen, _ = variants.choose(forced="")
    ok = variants.runnable(variants.cpu_features())
    cc = shutil.which("gcc") or shutil.which("cc")
    if chosen.name == "portable" or cc is None:
        pytest.skip("no SIMD variant here, or no gcc")
    nxt = ok[ok.index(chosen) + 1]
    refused = next(f for f in chosen.flags if f not in nxt.flags)
    wrapper = _compiler_wrapper(tmp_path / "old-cc", f'for a; do [ "$a" = "{refused}" ] && {{ echo "unrecognized '
                                f"command-line option '{refused}'\" >&2; exit 1; }}; done", cc, monkeypatch)
    said: list[str] = []
    for attempt in range(2):
        for name in ("_LIB", "_INFO", "_WHY"):
            monkeypatch.setattr(kernels, name, [])
        said.clear()
        lib = kernels.load(log=said.append)
        assert lib is not None and kernels.info().variant == nxt.name, said
        assert kernels.info().why.startswith(f"{wrapper} cannot build {chosen.name}"), kernels.info().why
        tried = [s for s in said if s.startswith("compiling") and f"({chosen.name}," in s]
        assert (len(tried) == 1) if attempt == 0 else not tried, said      # the second load does not try again


@pytest.mark.skipif(not compiler_has_openmp(), reason="the compiler here cannot build with OpenMP")
@pytest.mark.slow
def test_a_build_stopped_once_is_not_remembered_as_one_the_compiler_cannot_make(tmp_path, monkeypatch):
    """The out-of-memory killer stopping the compiler once (gcc: "Killed signal terminated program cc1") marked
    OpenMP, then the variant, as failing for good: every later command ran on one thread, or a narrower variant.
    This run goes on with another build; the next builds the chosen variant with OpenMP."""
    import shutil

    chosen, _ = variants.choose(forced="")
    cc = shutil.which("gcc") or shutil.which("cc")
    if chosen.name == "portable" or cc is None:
        pytest.skip("no SIMD variant here (one build to try), or no gcc")
    calls = tmp_path / "calls"
    wrapper = tmp_path / "oom-cc"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo x >> {calls};; esac\n'        # builds, not probes
                       f'[ "$(wc -l < {calls} 2>/dev/null || echo 0)" -eq 1 ] && {{ echo "gcc: fatal error: '
                       f'Killed signal terminated program cc1" >&2; exit 1; }}\nexec {cc} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.delenv("HSD_KERNELS", raising=False)
    monkeypatch.delenv("HSD_OPENMP", raising=False)
    for attempt in range(2):
        for name in ("_LIB", "_INFO", "_WHY"):
            monkeypatch.setattr(kernels, name, [])
        said: list[str] = []
        assert kernels.load(log=said.append) is not None
        marks = [p.name for p in (tmp_path / "cache").rglob("*") if p.suffix in (".openmp-failed", ".build-failed")]
        assert marks == [], marks
        if attempt == 0:
            assert any(f"building the {chosen.name} kernels with {wrapper} was stopped" in s for s in said), said
            assert "was stopped" in kernels.info().why
    assert kernels.info().variant == chosen.name and kernels.info().openmp, kernels.info()


@pytest.mark.slow
def test_a_failure_of_every_variant_is_the_toolchains_and_not_remembered_against_one(tmp_path, monkeypatch):
    """A compiler that builds nothing (C headers missing: every variant and the portable one fail alike) marked the
    chosen variant as one it cannot build: once the headers were installed, every later command ran the portable
    kernels. Nothing is marked; the next load builds the chosen variant; :func:`variants.host` names the variant
    that loaded (it named the chosen one whatever ran)."""
    import shutil

    chosen, _ = variants.choose(forced="")
    cc = shutil.which("gcc") or shutil.which("cc")
    if chosen.name == "portable" or cc is None:
        pytest.skip("no SIMD variant here (one build to try), or no gcc")
    broken = tmp_path / "no-headers"
    broken.write_text("")
    _compiler_wrapper(tmp_path / "cc", f'case " $* " in *" -o "*) [ -e {broken} ] && {{ echo "kernels.c:1: fatal '
                      f'error: math.h: No such file or directory" >&2; exit 1; }};; esac', cc, monkeypatch)
    monkeypatch.setattr(variants, "_LOADED", [], raising=False)
    for attempt in range(2):
        for name in ("_LIB", "_INFO", "_WHY"):
            monkeypatch.setattr(kernels, name, [])
        said: list[str] = []
        lib = kernels.load(log=said.append)
        marks = [p.name for p in (tmp_path / "cache").rglob("*.build-failed")]
        assert marks == [], marks
        if attempt == 0:
            assert lib is None and variants.host()["kernels"] == "unavailable", said
            broken.unlink()                                 # the headers installed; the compiler is the same
        else:
            assert lib is not None and kernels.info().variant == chosen.name, said
            assert variants.host()["kernels"] == chosen.name


def test_a_cc_that_is_not_one_program_here_is_refused_not_replaced(monkeypatch, tmp_path):
    """``CC=/opt/clang-17/bin/clang`` (not there) and ``CC="ccache gcc"`` built with ``cc`` without a word."""
    import shutil

    for value, words in (("/nonexistent/clang-17", "CC=/nonexistent/clang-17: no such program"),
                         ("ccache gcc", "CC='ccache gcc': give one compiler program")):
        monkeypatch.setenv("CC", value)
        with pytest.raises(HsdError, match=words):
            kernels.compiler()
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc:
        monkeypatch.setenv("CC", cc)
        assert kernels.compiler() == cc
    monkeypatch.setenv("CC", "")
    assert kernels.compiler() in (None, "cc", "gcc", "clang")


def test_an_unusable_hsd_libomp_leaves_the_kernels_unavailable_not_the_command_failed(tmp_path, monkeypatch):
    """``HSD_LIBOMP`` naming a folder without the runtime: the kernels are unavailable, said once (every command
    that loaded them exited 2, ``hsd doctor`` too), no variant marked as one the compiler cannot build; with
    ``HSD_OPENMP=0`` the folder is not read and the kernels build without OpenMP (it exited 2 as well)."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HSD_LIBOMP", str(tmp_path))
    monkeypatch.setenv("HSD_KERNELS", "portable")
    monkeypatch.delenv("HSD_OPENMP", raising=False)
    if kernels.compiler() is None:
        pytest.skip("no C compiler here")
    for openmp in ("1", "0"):
        monkeypatch.setenv("HSD_OPENMP", openmp)
        for name in ("_LIB", "_INFO", "_WHY"):
            monkeypatch.setattr(kernels, name, [])
        said: list[str] = []
        lib = kernels.load(log=said.append)
        marks = [p.name for p in (tmp_path / "cache").rglob("*") if p.suffix in (".openmp-failed", ".build-failed")]
        assert marks == [], marks
        if openmp == "1":
            assert lib is None and len(said) == 1 and f"HSD_LIBOMP={tmp_path}: no libomp" in said[0], said
        else:
            assert lib is not None and not kernels.info().openmp, said


@pytest.mark.parametrize("variable", ["HSD_EXACT_INT4", "HSD_WEIGHT_ONLY", "HSD_COMPILE"])
def test_every_command_refuses_a_bad_on_off_setting_first_naming_only_it(variable, monkeypatch, tmp_path):
    """A setting what runs never reads (an int4 target and ``HSD_EXACT_INT4``) was accepted; one read while a
    plan's int4 target was built was blamed on the plan file (``plan.json: provenance.target_precision: ...``).
    Every command refuses it first, in one line naming the variable alone (the plan here does not even exist)."""
    from typer.testing import CliRunner

    from hsd_opt.cli import app

    monkeypatch.setenv(variable, "maybe")
    for args in (["run", "--plan", str(tmp_path / "plan.json"), "--prompt", "hi"],
                 ["solve", "--profile", str(tmp_path / "profile.json")]):
        res = CliRunner().invoke(app, args)
        out = " ".join(res.output.split())
        assert res.exit_code == 2 and out.startswith(f"error: {variable}='maybe': expected 1 or 0"), out
        assert "plan.json" not in out and "profile.json" not in out, out


def test_a_setting_read_while_a_plans_copy_is_built_is_not_blamed_on_the_plan(monkeypatch):
    """The runtime's models of a plan wrap what building a quantized copy raises as the plan's entry, but not a
    setting's error."""
    from hsd_opt.errors import InputFileError, SettingError
    from hsd_opt.formats import Quantization
    from hsd_opt.runtime import runner

    def bad_setting(*a, **k):
        raise SettingError("HSD_WEIGHT_ONLY='maybe': expected 1 or 0")

    monkeypatch.setattr("hsd_opt.engine.quantized.QuantizedLM", bad_setting)
    models = runner.PlanModels.__new__(runner.PlanModels)
    models._copies = {}
    q = Quantization(bits=4, group_size=32, head_bits=8)
    with pytest.raises(SettingError) as e:
        models.copy(object(), q, "int4", "plan.json", "provenance.target_precision")
    assert not isinstance(e.value, InputFileError) and "plan.json" not in str(e.value)
