"""The attention of fixed-shape passes in Triton kernels (:mod:`hsd_opt.engine.triton_attention`), run on a CPU by
Triton's interpreter (``TRITON_INTERPRET=1``, set in ``tests/conftest.py``; a GPU compiles the same kernels).

Properties: the kernels write each row's keys and values at its position of its own sequence's caches (nothing
else) and give each row the causal attention over its sequence (``scaled_dot_product_attention``'s values within
float32 rounding, grouped-query heads and a head size that is not a power of two included); a row's output is, bit
for bit, the same alone, among its sequence's other rows of a verify pass and among other sequences' rows, whatever
the caches hold past its position. An engine computing its fixed-shape passes with them keeps every property of
fixed shapes: a verify pass gives its steps' logits bit for bit, a batch gives each sequence what it gets alone,
greedy hierarchies and the batch scheduler the target's own tokens; and one recording of a run of layers replays
every pass of every sequence and batch, bit for bit as op by op.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from hsd_opt.engine import fixed, graphs, triton_attention  # noqa: E402
from hsd_opt.engine.layered import LayeredLM, torch_path_settings  # noqa: E402
from hsd_opt.errors import HsdError  # noqa: E402
from hsd_opt.models.random_weights import TINY, random_model  # noqa: E402
from hsd_opt.runtime.decode import HSD, Level  # noqa: E402
from tests.helpers import steps_pass_and_reference  # noqa: E402


class Sequence:
    """A sequence's queries, keys and values at every position ``[heads or kv, n, hd]`` and its caches (one layer),
    holding its keys and values before ``start`` and noise after."""

    def __init__(self, g: torch.Generator, n: int, capacity: int, heads: int, kv: int, hd: int, dtype):
        def r(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        self.q, self.k, self.v = r(heads, n, hd), r(kv, n, hd), r(kv, n, hd)
        self.kc, self.vc = r(1, kv, capacity, hd), r(1, kv, capacity, hd)

    def before(self, start: int) -> "Sequence":
        self.kc[0, :, :start] = self.k[:, :start]
        self.vc[0, :, :start] = self.v[:, :start]
        return self


def _pass(seqs: list[tuple[Sequence, int, int]]):
    """A fixed-shape pass over ``(sequence, start, rows)`` in order: ``(q, k, v, tables)``."""
    q, k, v = (torch.cat([getattr(s, name)[:, a:a + m] for s, a, m in seqs], dim=1) for name in ("q", "k", "v"))
    pos = torch.cat([torch.arange(a, a + m) for _, a, m in seqs])
    pad = fixed.ROWS - pos.shape[0]
    q, k, v = (torch.cat([t, torch.zeros(t.shape[0], pad, t.shape[2], dtype=t.dtype)], dim=1) for t in (q, k, v))
    pos = torch.cat([pos, pos[-1:].expand(pad)])
    tab = triton_attention.tables([([s.kc], [s.vc]) for s, _, _ in seqs], [m for _, _, m in seqs], pos.tolist())
    assert torch.equal(tab.pos, pos)
    return q, k, v, tab


@pytest.mark.parametrize("heads,kv,hd", [(4, 2, 64), (3, 3, 24)])
def test_each_row_gets_its_sequence_s_causal_attention(heads, kv, hd):
    g = torch.Generator().manual_seed(0)
    spec = [(300, 512, 250, 20), (40, 256, 7, 1), (200, 256, 190, 9)]     # (n, capacity, start, rows)
    seqs = [Sequence(g, n, cap, heads, kv, hd, torch.float32).before(a) for n, cap, a, _ in spec]
    untouched = [(s.kc.clone(), s.vc.clone()) for s in seqs]
    q, k, v, tab = _pass([(s, a, m) for s, (_, _, a, m) in zip(seqs, spec)])
    out = triton_attention.attention(q, k, v, tab, 0)
    assert out.shape == (1, heads, fixed.ROWS, hd)
    o = 0
    for s, (kc, vc), (_, _, a, m) in zip(seqs, untouched, spec):
        kc[0, :, a:a + m], vc[0, :, a:a + m] = s.k[:, a:a + m], s.v[:, a:a + m]
        assert torch.equal(s.kc, kc) and torch.equal(s.vc, vc)          # its rows written, nothing else
        n = a + m
        mask = torch.arange(n).unsqueeze(0) <= torch.arange(a, n).unsqueeze(1)
        want = F.scaled_dot_product_attention(s.q[None, :, a:n], s.kc[:, :, :n], s.vc[:, :, :n], attn_mask=mask,
                                              enable_gqa=heads != kv)
        torch.testing.assert_close(out[:, :, o:o + m], want, atol=2e-6, rtol=2e-5)
        o += m
    assert not out[:, :, o:].any()                                       # rows of no sequence: zero


def test_a_row_s_output_is_the_same_alone_in_a_verify_pass_and_beside_other_sequences():
    g = torch.Generator().manual_seed(1)
    heads, kv, hd = 4, 2, 64

    def seq(n=400):
        return Sequence(g, n, 512, heads, kv, hd, torch.bfloat16)

    one, other = seq(), seq()
    for p in (0, 63, 64, 130, 300):
        outs = []
        for start, m, beside in ((p, 1, []), (max(p - 5, 0), 24, []), (max(p - 40, 0), 48, [(other, 330, 16)]),
                                 (p, 2, [(other, 10, 3), (other, 390, 1)])):
            noise = seq()
            one.kc[0, :, start:], one.vc[0, :, start:] = noise.kc[0, :, start:], noise.vc[0, :, start:]
            one.before(start)
            rows = beside[:1] + [(one, start, m)] + beside[1:]
            q, k, v, tab = _pass([(s, a, n) for s, a, n in rows])
            at = sum(n for _, _, n in rows[:rows.index((one, start, m))]) + p - start
            outs.append(triton_attention.attention(q, k, v, tab, 0)[:, :, at])
        assert all(torch.equal(o, outs[0]) for o in outs), p


def test_a_one_sequence_pass_s_padding_rows_write_its_last_position_s_keys():
    """A recorded pass covers all ROWS rows of its sequence (its padding rows repeat the last position and hold
    stale values): the caches get the real rows' keys and values, nothing past the last position."""
    g = torch.Generator().manual_seed(3)
    s = Sequence(g, 100, 256, 4, 2, 64, torch.float32).before(90)
    want_k, want_v = s.kc.clone(), s.vc.clone()
    want_k[0, :, 90:93], want_v[0, :, 90:93] = s.k[:, 90:93], s.v[:, 90:93]
    q, k, v, _ = _pass([(s, 90, 3)])
    stale = torch.randn(2, 2, fixed.ROWS - 3, 64, generator=g)    # what a recording's padding rows hold
    k[:, 3:], v[:, 3:] = stale
    tab = triton_attention.tables([([s.kc], [s.vc])], [fixed.ROWS], [90, 91, 92])
    out = triton_attention.attention(q, k, v, tab, 0)
    assert torch.equal(s.kc, want_k) and torch.equal(s.vc, want_v)
    assert torch.equal(out[:, :, 2], triton_attention.attention(*_pass([(s, 92, 1)]), 0)[:, :, 0])   # as alone


_COMPILE_FOR_GPUS = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hsd_opt.engine import triton_kernels as tk

ptrs = {"k_ptrs": "*i64", "v_ptrs": "*i64", "head_stride": "*i64", "pos": "*i64", "blocks": "*i64"}
const = "constexpr"
for arch in (80, 90):
    for dt in ("bf16", "fp16", "fp32"):
        for kv, hd in ((32, 128), (2, 64)):
            sig = {"k_new": "*" + dt, "v_new": "*" + dt, **ptrs, **dict.fromkeys(("s_kh", "s_kr", "s_vh", "s_vr"),
                   "i32"), **dict.fromkeys(("KV", "HD", "HD_P", "BM"), const)}
            triton.compile(ASTSource(tk.write_rows, sig, {"KV": kv, "HD": hd, "HD_P": hd, "BM": 16}),
                           target=GPUTarget("cuda", arch, 32))
            sig = {"q": "*" + dt, "out": "*" + dt, **ptrs, **dict.fromkeys(("s_qh", "s_qr", "s_oh", "s_or"), "i32"),
                   "scale": "fp32", "group": "i32", **dict.fromkeys(("HD", "HD_P", "BM", "BN", "F32"), const)}
            consts = {"HD": hd, "HD_P": hd, "BM": 16, "BN": 64, "F32": dt == "fp32"}
            k = triton.compile(ASTSource(tk.attend_rows, sig, consts), target=GPUTarget("cuda", arch, 32))
            assert k.asm["cubin"]
print("compiled")
"""


def test_the_kernels_compile_for_gpus():
    """The interpreter does not type-check as the compiler does: both kernels compile to GPU code (A100's and
    H100's architectures; bfloat16, float16, float32; a 7B's and a tiny model's heads), no GPU needed."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", _COMPILE_FOR_GPUS], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, "cpu", torch.bfloat16)


def _engine(model, triton: bool = True) -> LayeredLM:
    eng = LayeredLM(model, kernels=False)
    if triton:
        eng.attend_in_triton()
    else:
        eng.fix_shapes()
    return eng


def test_a_verify_pass_gives_its_steps_logits_and_a_batch_each_sequence_its_own(model):
    eng, plain = _engine(model), _engine(model, triton=False)
    assert eng.torch_path["triton_attention"] and eng.fixed_shapes and not plain.attends_in_triton
    L = eng.n_layers
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, eng.vocab_size, (60,), generator=g)
    ids = torch.randint(3, eng.vocab_size, (5,), generator=g)
    steps, passes, ref = steps_pass_and_reference(eng, plain, prompt, ids, 128, [2])
    for b in (2, L):
        got = eng.logits(passes, b, 60, 65)
        assert torch.equal(eng.logits(steps, b, 60, 65), got)
        want = plain.logits(ref, b, 60, 65)                      # the same function as SDPA's, other rounding
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    for l in range(L):
        assert torch.equal(steps.k[l][:, :, :65], passes.k[l][:, :, :65])
    # three sequences' rows in one pass, each as alone
    many, solo = [eng.new_state(300) for _ in range(3)], [eng.new_state(300) for _ in range(3)]
    for i, (a, b) in enumerate(zip(many, solo)):
        p = torch.randint(3, eng.vocab_size, (10 + 120 * i,), generator=g)
        for st in (a, b):
            eng.append(st, p)
            eng.advance(st, L)
            eng.append(st, ids[:1 + 2 * i])
        eng.advance(b, L)
    eng.advance_many([(st, L) for st in many])
    for a, b in zip(many, solo):
        assert torch.equal(eng.logits(a, L, 0, a.n), eng.logits(b, L, 0, b.n))


def test_one_recording_of_a_run_replays_every_sequence_s_passes_and_every_batch(model):
    """With the attention in Triton, a pass's composition is data: one recording per run of layers (here made by
    the recorder that calls the pass again) replays steps, verify passes and batches of any sequences, each bit for
    bit what the engine computes op by op."""
    eng, replayed = _engine(model), LayeredLM(model, kernels=False)
    replayed.attend_in_triton()
    replayed.replay_passes(graphs.calls_again)
    L = eng.n_layers
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, eng.vocab_size, (n,), generator=g) for n in (9, 70, 30)]
    pairs = [(eng.new_state(128), replayed.new_state(128)) for _ in prompts]
    for p, (a, b) in zip(prompts, pairs):
        for e, st in ((eng, a), (replayed, b)):
            e.append(st, p)
            e.advance(st, L)
    for m in (1, 3, 1):                          # each sequence alone, then all three in one pass
        ids = torch.randint(3, eng.vocab_size, (m,), generator=g)
        for a, b in pairs:
            for e, st in ((eng, a), (replayed, b)):
                e.append(st, ids)
                e.advance(st, L)
        for a, b in pairs:
            eng.append(a, ids[:1])
            replayed.append(b, ids[:1])
        eng.advance_many([(a, L) for a, _ in pairs])
        replayed.advance_many([(b, L) for _, b in pairs])
        for a, b in pairs:
            assert torch.equal(eng.logits(a, L, 0, a.n), replayed.logits(b, L, 0, b.n))
            assert all(torch.equal(a.k[l][:, :, :a.n], b.k[l][:, :, :b.n]) for l in range(L))
    assert replayed._graphs.recorded == 1        # the run 0 .. L, for every state and batch
    gone = weakref.ref(pairs[0][1].k[0])         # the recording holds no state's caches
    del pairs, a, b
    gc.collect()
    assert gone() is None


def test_greedy_hierarchies_and_the_batch_scheduler_give_the_target_s_own_tokens(model):
    from hsd_opt.runtime.batch import generate_many

    eng, replayed = _engine(model), LayeredLM(model, kernels=False)
    replayed.attend_in_triton()
    replayed.replay_passes(graphs.calls_again)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, eng.vocab_size, (n,), generator=g).tolist() for n in (8, 40, 5)]
    want = [HSD([Level("t", eng, 4)], []).generate(p, 12).token_ids for p in prompts]
    assert HSD([Level("l1", eng, 1), Level("l2", eng, 2), Level("t", eng, 4)], [2, 3]).generate(
        prompts[0], 12).token_ids == want[0]
    hsd = HSD([Level("l1", replayed, 1), Level("t", replayed, 4)], [3])
    assert hsd.generate(prompts[0], 12).token_ids == want[0]
    assert [r.token_ids for r in generate_many(hsd, prompts, 12, max_active=3)] == want
    assert replayed._graphs.recorded == 2        # the runs 0 .. 1 (the drafting exit) and 1 .. 4


def test_the_setting_and_where_the_kernels_cannot_run(model, monkeypatch):
    """Off unless ``HSD_TRITON_ATTENTION=1`` (engines on CUDA take it on by themselves then); asked for where Triton
    is missing, an error names the setting; on a CPU outside Triton's interpreter, an error says how to run it."""
    monkeypatch.delenv("HSD_TRITON_ATTENTION", raising=False)
    assert not torch_path_settings()["triton_attention"]
    monkeypatch.setenv("HSD_TRITON_ATTENTION", "1")
    assert torch_path_settings()["triton_attention"]
    assert not LayeredLM(model, kernels=False).attends_in_triton          # a CPU engine: only when asked
    monkeypatch.setattr(triton_attention, "unavailable", lambda device: "Triton is not installed")
    with pytest.raises(HsdError, match="HSD_TRITON_ATTENTION: Triton is not installed"):
        LayeredLM(model, kernels=False).attend_in_triton()
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(HsdError, match="TRITON_INTERPRET=1"):
        triton_attention._kernels.__wrapped__(True)
    on_kernels = LayeredLM(random_model(TINY, "cpu", torch.float32))
    monkeypatch.undo()
    if on_kernels.uses_kernels:                      # exact without fixed shapes: it ignores them
        on_kernels.attend_in_triton()
        assert not on_kernels.attends_in_triton and not on_kernels.fixed_shapes
