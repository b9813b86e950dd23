"""The Triton kernels of :mod:`hsd_opt.engine.triton_attention` (imported only where they run: this module imports
Triton). Shapes and the tables' layout: that module's docs.

Written without postponed annotations, so that Triton reads the ``tl.constexpr`` parameters as it reads its own.
"""

import triton
import triton.language as tl


@triton.jit
def write_rows(k_new, v_new, k_ptrs, v_ptrs, head_stride, pos, blocks, s_kh, s_kr, s_vh, s_vr,
               KV: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr, BM: tl.constexpr):
    b = tl.program_id(0)
    n = tl.load(blocks + b * 4 + 2)
    s = tl.load(blocks + b * 4)
    i = tl.arange(0, BM)
    rows = tl.load(blocks + b * 4 + 1) + i
    d = tl.arange(0, HD_P)
    live = i < n
    mask = live[:, None] & (d < HD)[None, :]
    p = tl.load(pos + rows, mask=live, other=0)
    # the row holding a position's keys: a one-sequence pass's padding rows repeat its last position
    first = tl.load(blocks + b * 4 + 3)
    src = first + p - tl.load(pos + first)
    off = p[:, None] * HD + d[None, :]
    stride = tl.load(head_stride + s)
    kc = tl.load(k_ptrs + s).to(tl.pointer_type(k_new.dtype.element_ty))
    vc = tl.load(v_ptrs + s).to(tl.pointer_type(v_new.dtype.element_ty))
    for h in tl.static_range(KV):
        tl.store(kc + h * stride + off, tl.load(k_new + h * s_kh + src[:, None] * s_kr + d[None, :], mask=mask),
                 mask=mask)
        tl.store(vc + h * stride + off, tl.load(v_new + h * s_vh + src[:, None] * s_vr + d[None, :], mask=mask),
                 mask=mask)


@triton.jit
def attend_rows(q, out, k_ptrs, v_ptrs, head_stride, pos, blocks, s_qh, s_qr, s_oh, s_or, scale, group,
                HD: tl.constexpr, HD_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(blocks + b * 4 + 2)
    if n > 0:   # always, but for a pass without rows
        s = tl.load(blocks + b * 4)
        i = tl.arange(0, BM)
        rows = tl.load(blocks + b * 4 + 1) + i
        live = i < n
        d = tl.arange(0, HD_P)
        dm = d < HD
        p = tl.load(pos + rows, mask=live, other=0)
        qt = tl.load(q + h * s_qh + rows[:, None] * s_qr + d[None, :], mask=live[:, None] & dm[None, :],
                     other=0.0)
        base = (h // group) * tl.load(head_stride + s)
        kc = tl.load(k_ptrs + s).to(tl.pointer_type(q.dtype.element_ty)) + base
        vc = tl.load(v_ptrs + s).to(tl.pointer_type(q.dtype.element_ty)) + base
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, HD_P], tl.float32)
        for j in range(0, tl.max(p, 0) // BN + 1):
            keys = j * BN + tl.arange(0, BN)
            kt = tl.load(kc + keys[:, None] * HD + d[None, :], mask=dm[None, :], other=0.0)
            if F32:   # products in float32, exactly (not TF32): float32 caches, and the interpreter's 16-bit floats
                sc = tl.dot(qt.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee") * scale
            else:
                sc = tl.dot(qt, tl.trans(kt)) * scale
            sc = tl.where(keys[None, :] <= p[:, None], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp(m_i - m_new)
            w = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(w, 1)
            vt = tl.load(vc + keys[:, None] * HD + d[None, :], mask=dm[None, :], other=0.0)
            if F32:
                acc = acc * alpha[:, None] + tl.dot(w.to(vt.dtype).to(tl.float32), vt.to(tl.float32),
                                                    input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(w.to(vt.dtype), vt)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(out + h * s_oh + rows[:, None] * s_or + d[None, :], o.to(out.dtype.element_ty),
                 mask=live[:, None] & dm[None, :])
