"""Test vectors for the kernels on another instruction set (Arm, under emulation): every exported kernel's inputs
and its outputs as this machine's portable build computes them, in one file that ``check_kernels.c`` reads,
recomputes with its own build and compares byte for byte.

    python -m tests.arm.cases OUT.bin

The portable build is the reference: on x86 every variant gives its bits (``tests/test_variants.py``), and it is
tested against the Python reference there. Format: a sequence of cases, each a tag (``linear``, ``layers``, ...)
then its arrays in a fixed order, every array as ``u32 length of a name, the name, u64 byte count, the bytes``
(little-endian; the driver checks each name).
"""

from __future__ import annotations

import ctypes
import math
import struct
import sys
from pathlib import Path

import torch

from hsd_opt.engine import kernels
from hsd_opt.engine import weights as wq
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.screen import WINDOW_REACH, WINDOW_SLACK, HeadScreen
from tests.helpers import q4_1_weights, q8_0_weights

#: Positions of x each linear case is checked at (the driver reads the same list from the file).
LINEAR_POSITIONS = (1, 2, 3, 4, 5, 7, 8, 9, 17)


class Writer:
    def __init__(self, path: Path):
        self.f = open(path, "wb")

    def array(self, name: str, data) -> None:
        if isinstance(data, torch.Tensor):
            raw = data.contiguous().view(torch.uint8).numpy().tobytes() if data.numel() else b""
        elif data is None:
            raw = b""
        else:
            raw = bytes(data)
        self.f.write(struct.pack("<I", len(name)) + name.encode() + struct.pack("<Q", len(raw)) + raw)

    def ints(self, name: str, *values: int) -> None:
        self.array(name, struct.pack(f"<{len(values)}i", *values))

    def floats(self, name: str, *values: float) -> None:
        self.array(name, struct.pack(f"<{len(values)}f", *values))

    def mat(self, mat: wq.Mat) -> None:
        kernels._struct(mat)
        self.ints("mat", mat.kind, mat.rows, mat.cols)
        ts = mat.tensors + [None, None]
        self.array("w", ts[0])
        self.array("scale", ts[1])
        self.array("zero", ts[2])
        self.array("bias", mat.c[1])


def matrices(g: torch.Generator) -> list[wq.Mat]:
    """One matrix of every kind the kernels read, with short last blocks, tails and biases."""
    out = [wq.Mat.in_place(torch.randn(37, 133, generator=g), torch.randn(37, generator=g)),
           wq.Mat.in_place(torch.randn(21, 200, generator=g).bfloat16()),
           wq.quantize(torch.randn(22, 96, generator=g), 8, torch.randn(22, generator=g)),
           wq.quantize(torch.randn(19, 160, generator=g), 4),
           wq.quantize(torch.randn(9, 40, generator=g), 8)]                # int8 without whole groups
    w4 = q4_1_weights(37, 96, seed=37)
    out.append(wq.exact_int4(wq.Mat.in_place(w4, torch.randn(37, generator=g)), wq.quantize_q4(w4)))
    out.append(wq.exact_int8(wq.Mat.in_place(q8_0_weights(23, 128, seed=23))))
    assert all(m is not None for m in out)
    return out


def layers_case(w: Writer, lib, g: torch.Generator) -> None:
    """Two passes of a tiny model's layers (3 then 4 positions), its projections in the exact int4 form."""
    from tests.helpers import make_tiny_llama

    model = make_tiny_llama(seed=4, vocab_size=64, layers=2, hidden=64, heads=4, kv_heads=2, scale=8.0)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for j, lin in enumerate(wq.linears(layer).values()):
                lin.weight.copy_(q4_1_weights(*lin.weight.shape, seed=100 * i + j))
    saved = list(kernels._LIB)
    kernels._LIB[:] = [kernels.load(variant="avx2") if _runs("avx2") else lib]
    try:
        eng = LayeredLM(model, kernels=True)
    finally:
        kernels._LIB[:] = saved
    kp = eng._kernels
    n_layers, hd = eng.n_layers, eng.head_dim
    w.ints("model", kp.c.n_heads, kp.c.n_kv, kp.c.head_dim, kp.c.hidden, kp.c.inter, n_layers)
    w.floats("eps", kp.c.eps1, kp.c.eps2)
    per = len(wq.PROJECTIONS) + 2
    for i in range(n_layers):
        for mat in kp._keep[i * per:i * per + len(wq.PROJECTIONS)]:
            w.mat(mat)
        w.array("ln1", kp._keep[i * per + len(wq.PROJECTIONS)])
        w.array("ln2", kp._keep[i * per + len(wq.PROJECTIONS) + 1])
    cache_len = 12
    kc = [torch.zeros(kp.c.n_kv, cache_len, hd) for _ in range(n_layers)]
    vc = [torch.zeros(kp.c.n_kv, cache_len, hd) for _ in range(n_layers)]
    kptr, vptr = kernels.cache_ptrs(kc), kernels.cache_ptrs(vc)
    w.ints("passes", 2, cache_len)
    start = 0
    for m in (3, 4):
        x = torch.randn(m, kp.c.hidden, generator=g)
        pos = torch.arange(start, start + m, dtype=torch.int32)
        cos, sin = torch.randn(m, hd, generator=g), torch.randn(m, hd, generator=g)
        w.ints("pass", m, start)
        w.array("x", x)
        w.array("cos", cos)
        w.array("sin", sin)
        out = x.clone()
        seq = torch.zeros(m, dtype=torch.int32)
        lens = torch.tensor([cache_len], dtype=torch.int32)
        work = torch.empty(int(lib.hsd_work_floats(ctypes.byref(kp.c), m, cache_len, 2)))
        kcs = (ctypes.c_void_p * 1)(ctypes.addressof(kptr))
        vcs = (ctypes.c_void_p * 1)(ctypes.addressof(vptr))
        rc = lib.hsd_layers(ctypes.byref(kp.c), 0, n_layers, out.data_ptr(), m, pos.data_ptr(), seq.data_ptr(),
                            cos.data_ptr(), sin.data_ptr(), kcs, vcs, lens.data_ptr(), work.data_ptr(), 2)
        assert rc == 0
        w.array("out", out)
        start += m


def _runs(name: str) -> bool:
    from hsd_opt.engine import variants

    return not variants.missing(variants.BY_NAME[name], variants.cpu_features())


def write(path: Path) -> None:
    lib = kernels.load(variant="portable")
    g = torch.Generator().manual_seed(2026)
    w = Writer(path)
    for mat in matrices(g):
        w.array("case", b"linear")
        w.mat(mat)
        x = torch.randn(max(LINEAR_POSITIONS), mat.cols, generator=g)
        w.ints("positions", *LINEAR_POSITIONS)
        w.array("x", x)
        for m in LINEAR_POSITIONS:
            w.array("y", kernels.linear(lib, mat, x[:m]))
    w.array("case", b"layers")
    layers_case(w, lib, g)
    # the greedy screen of a float32 head: int16 read, bounds, picks; and the exact rows
    head = wq.Mat.in_place(torch.randn(1001, 96, generator=g) * 0.05)
    screen = HeadScreen(lib, head)
    x = torch.randn(6, 96, generator=g)
    a = kernels.screen_i16(lib, screen.packed, screen.scale, head.rows, x)
    e = kernels.screen_bounds(lib, x, screen.c, screen.wnorm, screen.q16)
    ids = kernels.screen_pick(lib, head, x, a, screen.c, screen.wnorm, 1024, screen.q16)
    assert a is not None and e is not None and ids is not None
    u = torch.rand(x.shape[0], head.rows, generator=g).clamp_min_(2.0 ** -25)
    offsets = -(-u.log()).log()                     # Gumbel noise: the pick of a draw (logits + offsets)
    ids_o = kernels.screen_pick(lib, head, x, a, screen.c, screen.wnorm, 1024, screen.q16, offsets=offsets)
    assert torch.equal(ids_o, (kernels.linear(lib, head, x) + offsets).argmax(-1))
    w.array("case", b"screen")
    w.mat(head)
    w.ints("shape", head.rows, head.cols, x.shape[0], screen.q16)
    w.array("packed", screen.packed)
    w.array("rowscale", screen.scale)
    w.array("c", screen.c)
    w.array("wnorm", screen.wnorm)
    w.array("x", x)
    w.array("a", a)
    w.array("e", e)
    w.array("ids", ids)
    w.array("offsets", offsets)
    w.array("ids_offsets", ids_o)
    rows = torch.tensor([5, 17, 999, 0, 3, 3], dtype=torch.int64)
    positions = torch.tensor([0, 0, 1, 2, 2, 5], dtype=torch.int64)
    w.array("rows", rows)
    w.array("positions", positions)
    w.array("picked", kernels.rows_f32(lib, head, rows, positions, x))
    # windows of the largest (hsd_screen_window): top-k alone; top-k and min-p's distance over offsets, tokens pinned
    pins = (torch.tensor([0, 0, 3], dtype=torch.int64), torch.tensor([7, 500, 999], dtype=torch.int64),
            torch.tensor([2.5, -1.0, 0.75]))
    for top_k, below, off, pin in ((5, math.inf, None, None), (40, 3.0, offsets, pins)):
        got = kernels.screen_window(lib, head, x, a, screen.c, screen.wnorm, screen.q16, top_k, below,
                                    WINDOW_REACH, WINDOW_SLACK, 1024, offsets=off, pins=pin)
        assert got is not None and 0 < int(torch.isfinite(got[0]).sum()) < got[0].numel()
        out = got[0]
        pos, ids, vals = pin if pin is not None else (torch.zeros(0, dtype=torch.int64),) * 2 + (torch.zeros(0),)
        w.ints("window", top_k, int(off is not None), pos.numel())
        w.floats("limits", below, WINDOW_REACH, WINDOW_SLACK)
        w.array("pin_pos", pos)
        w.array("pin_ids", ids)
        w.array("pin_vals", vals)
        w.array("window_out", out)
    # the exact forms made and checked (hsd_exact_q4f / q8f, hsd_exact_mismatch) and the screen's int8 copy
    w.array("case", b"exact")
    for kind, (rows, cols) in (("q4f", (37, 96)), ("q8f", (23, 128))):
        wx = q4_1_weights(rows, cols, seed=rows) if kind == "q4f" else q8_0_weights(rows, cols, seed=rows)
        moved = wx.clone()
        moved[rows - 1, 5] = torch.nextafter(moved[rows - 1, 5], torch.tensor(1.0))
        make = kernels.exact_q4f if kind == "q4f" else kernels.exact_q8f
        form = make(lib, wq.Mat.in_place(wx))
        assert form is not None and make(lib, wq.Mat.in_place(moved)) is None
        w.ints("shape", rows, cols)
        w.array("w", wx)
        w.array("moved", moved)
        for i, t in enumerate(form.tensors):
            w.array(f"out{i}", t)
        outs = [torch.empty_like(t) for t in form.tensors]
        args = [t.data_ptr() for t in outs] if kind == "q4f" else [outs[0].data_ptr(), outs[1].data_ptr()]
        built = (lib.hsd_exact_q4f if kind == "q4f" else lib.hsd_exact_q8f)(moved.data_ptr(), rows, cols, *args, 2)
        w.array("ret", struct.pack("<3q", -1, kernels.exact_mismatch(lib, form, moved), built))
    w.ints("shape", head.rows, head.cols)
    w.array("w", head.tensors[0])
    for i, t in enumerate(kernels.screen_codes(lib, head.tensors[0])):
        w.array(f"out{i}", t)
    # the small ones: RMSNorm and e^x
    x = torch.randn(5, 77, generator=g) * 3
    nw = torch.randn(77, generator=g)
    w.array("case", b"norm")
    w.ints("shape", 5, 77)
    w.array("x", x)
    w.array("weight", nw)
    w.array("out", kernels.rms_norm(lib, x, nw, 1e-5))
    xs = torch.cat([torch.linspace(-100, 100, 997), torch.randn(300, generator=g) * 20])
    ys = torch.empty_like(xs)
    lib.hsd_exp_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.hsd_exp_rows(xs.data_ptr(), xs.numel(), ys.data_ptr())
    w.array("case", b"exp")
    w.ints("n", xs.numel())
    w.array("x", xs)
    w.array("y", ys)
    # the noise of draws by the largest of the logits plus noise, and its logarithm
    for key, n, t in ((0x0123456789ABCDEF, 4097, 0.7), (2 ** 64 - 1, 1000, 1.0)):
        noise = kernels.gumbel(lib, key, n, t)
        w.array("case", b"gumbel")
        w.array("key", struct.pack("<Q", key))
        w.ints("n", n)
        w.array("temperature", torch.tensor([t]))
        w.array("y", noise)
    ls = torch.exp(torch.linspace(-80, 80, 1001))
    ly = torch.empty_like(ls)
    lib.hsd_log_rows(ls.data_ptr(), ls.numel(), ly.data_ptr())
    w.array("case", b"log")
    w.ints("n", ls.numel())
    w.array("x", ls)
    w.array("y", ly)
    # sampling's filters over a window's columns: rows with columns outside their window, ties at top-k's k-th
    fx = torch.randn(5, 300, generator=g) * 4
    fx[torch.rand(5, 300, generator=g) < 0.4] = -math.inf
    fx[1] = torch.round(fx[1])
    for temperature, top_p, top_k, min_p in ((0.7, 0.95, 40, 0.05), (1.3, 1.0, 0, 0.1), (0.3, 0.5, 0, 0.0)):
        probs = kernels.filter_probs(lib, fx, temperature, top_p, top_k, min_p)
        assert probs is not None and 0 < int((probs > 0).sum()) < probs.numel()
        w.array("case", b"filter")
        w.ints("shape", *fx.shape, top_k)
        w.array("limits", struct.pack("<3d", temperature, top_p, min_p))
        w.array("x", fx)
        w.array("y", probs)
    w.array("case", b"end")
    w.f.close()


if __name__ == "__main__":
    write(Path(sys.argv[1]))
