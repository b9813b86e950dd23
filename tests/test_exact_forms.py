"""The exact forms of float32 weights: where a model's float32 weights are exactly GGUF Q4_1's de-quantized values
(code * scale + minimum, as the embedded SmolLM2's projections are) or Q8_0's (code * scale, as its LM head is),
the kernels read the int4 or int8 codes instead and compute the same float32 products, bit for bit, on every build
and at every number of positions."""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine import kernels, layered, stored_copies
from hsd_opt.engine import weights as wq
from hsd_opt.engine.layered import LayeredLM
from tests.helpers import kernel_builds, make_tiny_llama, q4_1_weights, q8_0_weights

LIB = kernels.load()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here: the kernels cannot be built")


def exact_form(w: torch.Tensor, bias: torch.Tensor | None = None) -> wq.Mat | None:
    return wq.exact_int4(wq.Mat.in_place(w, bias), wq.quantize_q4(w, bias))


def test_the_pair_layout_holds_every_code_once():
    g = torch.Generator().manual_seed(0)
    for rows, groups in ((6, 4), (5, 3), (1, 1), (4, 18), (7, 1), (8, 2), (2, 5)):
        codes = torch.randint(0, 16, (rows, groups, 32), dtype=torch.uint8, generator=g)
        packed = wq.pair_codes(codes)
        assert packed.shape == ((rows + 3) // 4, (groups + 1) // 2, 128)
        assert torch.equal(wq.unpair_codes(packed, rows, groups), codes)
        # where the kernels read them: block r // 4, pair of groups g // 2, the rows' pair, 8 columns k, the row
        for r, gr, col in ((rows - 1, groups - 1, 31), (0, 0, 0), (rows // 2, groups // 2, 13)):
            byte = packed[r // 4, gr // 2, 64 * (r % 4 // 2) + 16 * (col // 8) + 8 * (r % 2) + col % 8]
            assert (byte >> 4 * (gr % 2)) & 15 == codes[r, gr, col]


def test_q4_1_weights_have_an_exact_form_and_others_do_not():
    w = q4_1_weights(12, 96, seed=1)
    mat = exact_form(w)
    assert mat is not None and mat.kind == wq.Q4F and mat.shares is not None
    assert torch.equal(mat.dequantized(), w)
    moved = w.clone()
    moved[7, 40] = torch.nextafter(moved[7, 40], torch.tensor(1.0))     # one weight one step off its grid
    assert exact_form(moved) is None
    assert exact_form(torch.randn(12, 96, generator=torch.Generator().manual_seed(2))) is None
    assert wq.exact_int4(wq.Mat.in_place(w.bfloat16()), wq.quantize_q4(w)) is None   # not float32


def test_the_int8_pair_layout_holds_every_code_once():
    g = torch.Generator().manual_seed(0)
    for rows, cols in ((6, 32), (5, 64), (1, 8), (7, 96)):
        codes = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g)
        packed = wq.pair_rows_int8(codes)
        assert packed.shape == ((rows + 1) // 2, cols // 8, 16)
        assert torch.equal(wq.unpair_rows_int8(packed, rows), codes)


def test_q8_0_weights_have_an_exact_int8_form_and_others_do_not():
    w = q8_0_weights(12, 96, seed=3)
    mat = wq.exact_int8(wq.Mat.in_place(w))
    assert mat is not None and mat.kind == wq.Q8F and mat.nbytes() < w.numel() * 4 / 3
    assert torch.equal(mat.dequantized(), w)
    moved = w.clone()
    moved[7, 40] = torch.nextafter(moved[7, 40], torch.tensor(1.0))     # one weight one step off its grid
    assert wq.exact_int8(wq.Mat.in_place(moved)) is None
    assert wq.exact_int8(wq.Mat.in_place(torch.randn(12, 96, generator=torch.Generator().manual_seed(2)))) is None
    assert wq.exact_int8(wq.Mat.in_place(w.bfloat16())) is None                        # not float32
    assert wq.exact_int8(wq.Mat.in_place(w[:, :80].contiguous())) is None               # width not whole groups
    assert wq.exact_int8(wq.Mat.in_place(q4_1_weights(12, 96, seed=1))) is None         # int4 grid, with offsets


@pytest.fixture(scope="module")
def builds():
    """Every build this CPU runs (each variant, and the widest without OpenMP), built once into the cache."""
    return kernel_builds()


@pytest.mark.parametrize("rows,cols", [(37, 64), (8, 96), (5, 576), (64, 32), (6, 160)])
def test_the_exact_form_gives_the_float32_products_bit_for_bit(builds, rows, cols):
    """Odd rows and groups, short last blocks, 1 to 70 positions (each in-register tile, 1 to 8, and longer
    passes): every element the float32 matrix's own, on every build (16-lane, 8-lane, portable)."""
    g = torch.Generator().manual_seed(rows + cols)
    w, b = q4_1_weights(rows, cols, seed=rows * cols), torch.randn(rows, generator=g)
    f32, q4f = wq.Mat.in_place(w, b), exact_form(w, b)
    assert q4f is not None
    x = torch.randn(70, cols, generator=g)
    for name, lib in builds.items():
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 70):
            assert torch.equal(kernels.linear(lib, q4f, x[:m]), kernels.linear(lib, f32, x[:m])), (name, m)


@pytest.mark.parametrize("rows,cols", [(37, 64), (8, 96), (5, 576), (64, 32), (6, 160)])
def test_the_int8_form_gives_the_float32_products_bit_for_bit(builds, rows, cols):
    """As the int4 form: odd rows, short last blocks, 1 to 70 positions, every build."""
    g = torch.Generator().manual_seed(rows * cols)
    w, b = q8_0_weights(rows, cols, seed=rows + cols), torch.randn(rows, generator=g)
    f32, q8f = wq.Mat.in_place(w, b), wq.exact_int8(wq.Mat.in_place(w, b))
    assert q8f is not None
    x = torch.randn(70, cols, generator=g)
    for name, lib in builds.items():
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 70):
            assert torch.equal(kernels.linear(lib, q8f, x[:m]), kernels.linear(lib, f32, x[:m])), (name, m)


def _q4_1_model():
    """A tiny Llama whose projections hold Q4_1 weights (widths multiples of 32)."""
    model = make_tiny_llama(seed=4, vocab_size=64, layers=3, hidden=64, heads=4, kv_heads=2, scale=8.0)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for j, lin in enumerate(wq.linears(layer).values()):
                lin.weight.copy_(q4_1_weights(*lin.weight.shape, seed=100 * i + j))
    return model


def _kinds(eng: LayeredLM) -> set[int]:
    """The kinds of the projections the engine's kernels read."""
    return {m.kind for m in eng._kernels._keep if isinstance(m, wq.Mat)}


def _engine(model, exact: bool, monkeypatch) -> LayeredLM:
    monkeypatch.setattr(layered, "EXACT_INT4", exact)
    monkeypatch.setattr(layered, "EXACT_INT8", exact)
    return LayeredLM(model, kernels=True)


def test_an_engine_over_q4_1_weights_reads_the_exact_form_and_computes_the_same_logits(monkeypatch):
    model = _q4_1_model()
    exact, plain = _engine(model, True, monkeypatch), _engine(model, False, monkeypatch)
    # the portable variant reads the float32 weights (its scalar de-quantization costs more than the bytes it saves)
    assert _kinds(exact) == ({wq.Q4F} if LIB.hsd_simd() else {wq.F32}) and _kinds(plain) == {wq.F32}
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 64, (n,), generator=g) for n in (5, 11, 2)]
    states = {}
    for name, eng in (("exact", exact), ("plain", plain)):
        sts = [eng.new_state(40) for _ in prompts]
        for st, p in zip(sts, prompts):
            eng.append(st, p)
        eng.advance_many([(st, eng.n_layers) for st in sts])
        for step in range(3):                          # decode steps of all three together, then a 4-token pass
            for st in sts:
                n = 1 if step < 2 else 4
                eng.append(st, torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(step)))
            eng.advance_many([(st, eng.n_layers) for st in sts])
        states[name] = [eng.logits(st, eng.n_layers, 0, st.lens[-1]) for st in sts]
    for a, b in zip(states["exact"], states["plain"]):
        assert torch.equal(a, b)


def test_a_model_whose_weights_are_not_q4_1_keeps_them_as_they_are(monkeypatch):
    model = make_tiny_llama(seed=5, vocab_size=64, layers=2, hidden=64, heads=4, kv_heads=2)
    eng = _engine(model, True, monkeypatch)
    assert _kinds(eng) == {wq.F32}
    assert stored_copies.exact_int4_layers(model, eng.weights) == [{}, {}]


def test_an_engine_over_a_q8_0_head_reads_its_int8_form_and_computes_the_same_logits_and_tokens(monkeypatch):
    """The head's exact int8 form where the head is Q8_0's (the layers' weights are not Q4_1 here): full logits
    of 1 to 9 rows, and greedy tokens of 1 to 6 rows (the int8 screen up to 4 rows, the head above), the same
    bits as the engine reading the float32 head."""
    model = make_tiny_llama(seed=6, vocab_size=96, layers=2, hidden=64, heads=4, kv_heads=2, scale=8.0)
    with torch.no_grad():
        model.lm_head.weight.copy_(q8_0_weights(96, 64, seed=11))
    exact, plain = _engine(model, True, monkeypatch), _engine(model, False, monkeypatch)
    assert exact._kernels.head_mat.kind == (wq.Q8F if LIB.hsd_simd() else wq.F32)
    assert plain._kernels.head_mat.kind == wq.F32
    assert _kinds(exact) == {wq.F32}                          # the layers stay as they are
    ids = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, eng in (("exact", exact), ("plain", plain)):
        st = eng.new_state(20)
        eng.append(st, ids)
        eng.advance(st, eng.n_layers)
        out[name] = ([eng.logits(st, eng.n_layers, 12 - m, 12) for m in (1, 2, 5, 9)],
                     [eng.greedy_ids(st, eng.n_layers, 12 - m, 12) for m in (1, 3, 4, 6)])
    for a, b in zip(out["exact"][0] + out["exact"][1], out["plain"][0] + out["plain"][1]):
        assert torch.equal(a, b)


def test_the_environment_switches_the_forms_off_when_an_engine_is_built(monkeypatch):
    """``HSD_EXACT_INT4=0`` / ``HSD_EXACT_INT8=0`` are read when an engine is built, not when the module is
    imported: set after import, they still take effect."""
    if not LIB.hsd_simd():
        pytest.skip("the portable variant reads float32 weights anyway")
    model = _q4_1_model()
    assert _kinds(LayeredLM(model, kernels=True)) == {wq.Q4F}
    monkeypatch.setenv("HSD_EXACT_INT4", "0")
    assert _kinds(LayeredLM(model, kernels=True)) == {wq.F32}
    monkeypatch.setattr(layered, "EXACT_INT4", True)                    # a bool overrides the environment
    assert _kinds(LayeredLM(model, kernels=True)) == {wq.Q4F}


# ------------------------------------------------------------------- the forms made and checked by the kernels

#: Shapes with a short last block of 4 rows (37: one row; 6: two), an odd last pair of rows and odd groups.
SHAPES = [(37, 96), (6, 160), (5, 576), (1, 32), (64, 32)]


def _one_ulp_up(w: torch.Tensor, r: int, c: int) -> torch.Tensor:
    moved = w.clone()
    moved[r, c] = torch.nextafter(moved[r, c], torch.tensor(float("inf")))
    return moved


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_the_kernels_make_the_forms_torch_makes(builds, rows, cols):
    """On every build, the kernels' int4 and int8 forms of Q4_1 and Q8_0 weights are, byte for byte, the tensors
    :func:`~hsd_opt.engine.weights.exact_int4` (the int4 copy re-paired) and :func:`~hsd_opt.engine.weights.exact_int8`
    make in torch; weights off those grids get none from either."""
    w4, w8 = q4_1_weights(rows, cols, seed=rows + cols), q8_0_weights(rows, cols, seed=rows * cols)
    want4, want8 = exact_form(w4), wq.exact_int8(wq.Mat.in_place(w8))
    for name, lib in builds.items():
        got4, got8 = kernels.exact_q4f(lib, wq.Mat.in_place(w4)), kernels.exact_q8f(lib, wq.Mat.in_place(w8))
        assert got4.kind == wq.Q4F and got8.kind == wq.Q8F, name
        assert all(torch.equal(a, b) for a, b in zip(got4.tensors, want4.tensors)), name
        assert all(torch.equal(a, b) for a, b in zip(got8.tensors, want8.tensors)), name
        noise = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        assert kernels.exact_q4f(lib, wq.Mat.in_place(noise)) is None and exact_form(noise) is None
        assert kernels.exact_q8f(lib, wq.Mat.in_place(noise)) is None
        assert kernels.exact_q8f(lib, wq.Mat.in_place(w4)) is None                       # int4 grid, with offsets


def test_the_kernels_quantize_random_weights_as_quantize_q4_does():
    """Away from any grid too (weights over many magnitudes: float16 scales rounded, subnormal and clamped steps),
    the kernels' codes, scales and minimums are quantize_q4's, and their greedy screen's codes, scales quantize_q8's."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(45, 160, generator=g) * torch.exp(torch.randn(45, 1, generator=g) * 6)
    w[3, :32] = 1e-7                                      # a flat group: the step clamped to 6.1e-5
    rows, cols, G = 45, 160, 5
    codes = torch.empty(12, 3, 128, dtype=torch.uint8)
    scale, minimum = torch.empty(rows, G, dtype=torch.float16), torch.empty(rows, G, dtype=torch.float16)
    assert LIB.hsd_exact_q4f(w.data_ptr(), rows, cols, codes.data_ptr(), scale.data_ptr(), minimum.data_ptr(), 2) >= 0
    q4 = wq.quantize_q4(w)
    assert torch.equal(wq.unpair_codes(codes, rows, G), wq.q4_codes(q4))
    assert all(torch.equal(a, b) for a, b in zip((scale, minimum), wq.q4_factors(q4)))
    packed, row_scale, rho, wnorm = kernels.screen_codes(LIB, w)
    q8 = wq.quantize_q8(w)
    assert torch.equal(packed, kernels.pack_screen_codes(q8.tensors[0])) and torch.equal(row_scale, q8.tensors[1])
    assert torch.allclose(wnorm, w.double().norm(dim=1), rtol=1e-12)
    assert torch.allclose(rho, (q8.tensors[0].double() * row_scale.double()[:, None] - w.double()).norm(dim=1),
                          rtol=1e-12)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows,cols", [(37, 96), (6, 160), (1, 32)])
def test_the_check_refuses_a_single_weight_one_ulp_off(builds, kind, rows, cols):
    """One weight one step (one ulp) off the form's value, in the first or last row (37 and 6 rows: the last of a
    short last block of 4, and of a pair) and the first or last column, or in the middle: the kernels' check
    names exactly that weight, the builder refuses the form, on every build; the exact weights pass."""
    w = q4_1_weights(rows, cols, seed=rows) if kind == "int4" else q8_0_weights(rows, cols, seed=rows)
    make = kernels.exact_q4f if kind == "int4" else kernels.exact_q8f
    for name, lib in builds.items():
        form = make(lib, wq.Mat.in_place(w))
        assert form is not None and kernels.exact_mismatch(lib, form, w) == -1, name
        for r, c in {(0, 0), (0, cols - 1), (rows - 1, 0), (rows - 1, cols - 1), (rows // 2, cols // 2 + 3)}:
            moved = _one_ulp_up(w, r, c)
            for threads in (1, 2):
                assert kernels.exact_mismatch(lib, form, moved, threads) == r * cols + c, (name, r, c, threads)
            assert make(lib, wq.Mat.in_place(moved)) is None, (name, r, c)


def test_the_check_names_the_first_mismatch_and_compares_bits():
    """Of two weights off, the first (in row-major order) is named, however the rows fall to the threads; a
    negative zero where the form gives +0 is refused (the same bits, not only equal values)."""
    w = q8_0_weights(64, 96, seed=5)
    form = kernels.exact_q8f(LIB, wq.Mat.in_place(w))
    moved = _one_ulp_up(_one_ulp_up(w, 60, 7), 9, 90)
    for threads in (1, 2, 3):
        assert kernels.exact_mismatch(LIB, form, moved, threads) == 9 * 96 + 90
    assert w[0, 1] == 0 and not torch.signbit(w[0, 1])  # q8_0_weights: the first group all zero
    neg = w.clone()
    neg[0, 1] = -0.0
    assert torch.equal(neg, w)                                                     # equal values, other bits
    assert kernels.exact_mismatch(LIB, form, neg) == 1
    assert kernels.exact_q8f(LIB, wq.Mat.in_place(neg)) is None


def test_an_engine_makes_its_forms_in_the_kernels_as_torch_makes_them(monkeypatch):
    """The engine's exact forms (made and checked by the kernels) are the tensors the torch path makes from the
    model's int4 copy (``exact_int4_layers`` without the library) and ``exact_int8``."""
    if not LIB.hsd_simd():
        pytest.skip("the portable variant reads float32 weights")
    model = _q4_1_model()
    with torch.no_grad():
        model.lm_head.weight.copy_(q8_0_weights(*model.lm_head.weight.shape, seed=12))
    eng = _engine(model, True, monkeypatch)
    by_torch = stored_copies.exact_int4_layers(model, eng.weights)
    by_kernels = stored_copies.exact_int4_layers(model, eng.weights, LIB)
    assert [sorted(d) for d in by_kernels] == [sorted(d) for d in by_torch] == [sorted(wq.PROJECTIONS)] * 3
    for a, b in zip(by_kernels, by_torch):
        for name in a:
            assert all(torch.equal(x, y) for x, y in zip(a[name].tensors, b[name].tensors))
    head = wq.exact_int8(eng.weights.head)
    assert eng._kernels.head_mat.kind == wq.Q8F
    assert all(torch.equal(x, y) for x, y in zip(eng._kernels.head_mat.tensors, head.tensors))

