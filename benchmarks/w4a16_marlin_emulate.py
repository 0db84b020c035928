"""CPU emulation of the w4a16 kernels' per-lane index math (``w4a16_marlin.py``'s two layouts).

``emulate`` (repacked) and ``emulate_native`` replay in numpy which word and scale each lane loads, which
nibbles land in which fragment register, ``ldmatrix``'s row addresses, the m16n8k16 fragment layouts,
the C store and the split-K reduction, so that the layouts are checked against ``mx.dequantize``
without a GPU (tests/unit/test_w4a16_marlin.py). The bf16 helpers round as the kernel's ``fma.rn.bf16x2``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from w4a16_marlin_source import CH

if TYPE_CHECKING:
    from w4a16_marlin import Native, Packed, Plan


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _round_bf16(v: np.ndarray) -> np.ndarray:
    """Round float64/32 to the nearest bf16 (ties to even), returned as float32."""
    u = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return _bf16_bits_to_f32(rounded.astype(np.uint32))


def _dq2(word: np.ndarray, s: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w4m::dq2``: the (low, high) bf16 weights of one register as float32: ``v - 128`` is q exactly,
    then ``fma(q, s, b)`` rounds once (MLX CUDA's dequantize)."""
    v = (word & 0x000F000F) | 0x43004300
    s64, b64 = s.astype(np.float64), b.astype(np.float64)
    res = []
    for half in (v & 0xFFFF, v >> 16):
        q = _bf16_bits_to_f32(half).astype(np.float64) - 128.0  # exact
        res.append(_round_bf16(q * s64 + b64))
    return res[0], res[1]


def cuda_dequantize(q: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> np.ndarray:
    """MLX CUDA's 4-bit dequantize as float32: ``scale * q + bias`` as one bf16 FMA (one rounding; nvcc
    fuses the expression in MLX's kernel), where MLX's CPU backend rounds the product and the sum apart."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    nib = ((np.array(q)[:, :, None] >> shifts) & 15).reshape(q.shape[0], -1).astype(np.float64)
    s = np.repeat(np.array(scales.astype(mx.float32)).astype(np.float64), group_size, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32)).astype(np.float64), group_size, axis=1)
    return _round_bf16(nib * s + b)


def emulate(x: mx.array, w: Packed, p: Plan) -> np.ndarray:
    """The kernel's result in float32 [M, N], computed through its per-lane index math.

    Mirrors SOURCE: the x chunk copy to shared memory (LDS stride, zero rows past M), ``ldmatrix.x4``'s
    row addresses, the ring loads (word index, sb index, group), ``dq2`` on ``w >> 0/4/8/12`` and the mma
    fragment layouts of m16n8k16 (A: a0 (g, 2t..), a1 (g+8, ..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); B: b0
    k 2t..2t+1, b1 k 2t+8..; both at column g; C: c0 c1 (g, 2t..), c2 c3 (g+8, ..)), then the C store."""
    wq, sb, group_size = w.wq, w.sb, w.group_size
    xn = np.array(x.astype(mx.float32))
    wqn = np.array(wq).reshape(-1)
    sbn = np.array(sb.astype(mx.float32)).reshape(-1)
    sb_bits = np.array(sb.view(mx.uint16)).reshape(-1).astype(np.uint32)
    assert np.array_equal(_bf16_bits_to_f32(sb_bits), sbn)
    m, k = xn.shape
    nblk = wq.shape[0]
    n = nblk * 16
    kb_steps, groups = k // 64, k // group_size
    gps = 1 if group_size >= 64 else 64 // group_size
    rows = p.mt * 16
    lds = CH * 64 + 8
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    gx, gy, gz = p.grid(m, n)
    split = p.splits > 1
    reduce = split and p.reduce
    out = np.full((m, n), np.nan, np.float32)  # an output no lane writes stays NaN
    ws = np.full((p.splits, m, n), np.nan, np.float32)
    n_ctas = gy
    for bx in range(gx // (32 * p.warps)):
        m0 = bx * rows
        for z in range(gz):
            s_lo, s_hi = z * kb_steps // gz, (z + 1) * kb_steps // gz
            # every warp of every CTA along N at once: nb0 per (cta, warp)
            nb0 = ((np.arange(n_ctas)[:, None] * p.warps + np.arange(p.warps)[None, :]) * p.nb).reshape(-1)
            acc = np.zeros((nb0.size, p.mt, p.nb, 2, 32, 4), np.float32)
            for c0 in range(s_lo, s_hi, CH):
                cols8 = (min(c0 + CH, s_hi) - c0) * 8
                xs = np.zeros((rows * lds,), np.float32)
                ii = np.arange(rows * CH * 8)  # the copy loop's i over all threads, 8 elements (16 bytes) each
                rr, cc = ii // (CH * 8), ii % (CH * 8)
                ok = (m0 + rr < m) & (cc < cols8)
                e = np.arange(8)
                dst_idx = (rr * lds + cc * 8)[ok][:, None] + e
                xs[dst_idx] = xn[(m0 + rr)[ok][:, None], (c0 * 64 + cc * 8)[ok][:, None] + e]
                for pp in range(CH):
                    step = c0 + pp
                    if step >= s_hi:
                        continue
                    nb = np.minimum(nb0[:, None] + np.arange(p.nb)[None, :], nblk - 1)  # [W, NB]
                    widx = ((nb[..., None] * kb_steps + step) * 32 + lane) * 4  # [W, NB, 32] (uint4 -> words)
                    for kk in range(4):
                        # ldmatrix.x4: lane l gives row (l & 15), column + (l >> 4) * 8 of matrix l >> 3;
                        # register r of lane l = matrix r's row l >> 2, columns 2 (l & 3), +1
                        a = np.zeros((p.mt, 32, 4, 2), np.float32)
                        for i in range(p.mt):
                            addr_row = i * 16 + (lane & 15)
                            addr_col = pp * 64 + kk * 16 + (lane >> 4) * 8
                            addrs = addr_row * lds + addr_col  # element address given by each lane
                            for r in range(4):
                                src = addrs[r * 8 + (lane >> 2)] + 2 * t
                                a[i, :, r, 0] = xs[src]
                                a[i, :, r, 1] = xs[src + 1]
                        word = wqn[widx + kk]  # [W, NB, 32]
                        gi = 0 if gps == 1 else (kk * 16) // group_size
                        grp = (step * 64 + gi * group_size) // group_size
                        sidx = ((nb[..., None] * groups + grp) * 8 + g) * 4  # bf16 index of the uint2
                        s_lo2, b_lo2 = sbn[sidx], sbn[sidx + 1]
                        s_hi2, b_hi2 = sbn[sidx + 2], sbn[sidx + 3]
                        breg = [
                            _dq2(word, s_lo2, b_lo2),
                            _dq2(word >> 4, s_lo2, b_lo2),
                            _dq2(word >> 8, s_hi2, b_hi2),
                            _dq2(word >> 12, s_hi2, b_hi2),
                        ]
                        a_regs = [(a[:, :, r, 0], a[:, :, r, 1]) for r in range(4)]
                        for h in range(2):
                            _mma(acc[:, :, :, h], a_regs, breg[2 * h : 2 * h + 2])
            _store(ws[z] if split else out, acc, nb0, m0, m, nblk, p)
        if split and reduce:
            _reduce(out, ws, m0, m, n, gy, gz, p)
    return ws.sum(axis=0) if split and not reduce else out


def emulate_native(x: mx.array, w: Native, p: Plan) -> np.ndarray:
    """The native kernel's result in float32 [M, N], computed through its per-lane index math.

    Mirrors NATIVE_SOURCE: each step's cp.async copies into the swizzled shared layouts (zero rows past
    M, weight rows past N clamped), ``ldmatrix.x4``'s row addresses over the weights and the word each
    lane receives, the 16-byte activation loads and their ``prmt`` pairs, the scale and bias indices,
    ``dq2`` on ``w >> 8u`` and ``w >> (8u + 4)``, the m16n8k16 fragment layouts, the C store and the
    split-K reduction."""
    gs = w.group_size
    xn = np.array(x.astype(mx.float32))
    wn = np.array(w.w).reshape(-1)
    scn = np.array(w.scales.astype(mx.float32)).reshape(-1)
    bin_ = np.array(w.biases.astype(mx.float32)).reshape(-1)
    m, k = xn.shape
    n, kw = w.n, k // 8
    nblk, kb_steps, groups = n // 16, k // 64, k // gs
    gps = 1 if gs >= 64 else 64 // gs
    rows, nc = p.mt * 16, p.warps * p.nb * 16
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    gx, gy, gz = p.grid(m, n)
    split = p.splits > 1
    reduce = split and p.reduce
    out = np.full((m, n), np.nan, np.float32)
    ws = np.full((p.splits, m, n), np.nan, np.float32)
    # every warp of every CTA along N at once: W = gy * warps
    by = np.repeat(np.arange(gy), p.warps)
    warp = np.tile(np.arange(p.warps), gy)
    nb0 = (by * p.warps + warp) * p.nb
    jj = np.arange(p.nb)
    for bx in range(gx // (32 * p.warps)):
        m0 = bx * rows
        for z in range(gz):
            s_lo, s_hi = z * kb_steps // gz, (z + 1) * kb_steps // gz
            acc = np.zeros((by.size, p.mt, p.nb, 2, 32, 4), np.float32)
            for step in range(s_lo, s_hi):
                # activations: unit u (8 bf16) of row r at unit r * 8 + (u ^ 4 (r & 1))
                xs = np.zeros((rows * 64,), np.float32)
                r, u = np.meshgrid(np.arange(rows), np.arange(8), indexing="ij")
                ok = m0 + r < m
                e8 = np.arange(8)
                dst = ((r * 8 + (u ^ ((r & 1) << 2))) * 8)[ok][:, None] + e8
                xs[dst] = xn[(m0 + r)[ok][:, None], (step * 64 + u * 8)[ok][:, None] + e8]
                # weights: unit u (4 words) of CTA row r at unit r * 2 + (u ^ ((r >> 2) & 1)), per CTA
                wsm = np.zeros((gy, nc * 8), np.uint32)
                r, u = np.meshgrid(np.arange(nc), np.arange(2), indexing="ij")
                e4 = np.arange(4)
                dst = ((r * 2 + (u ^ ((r >> 2) & 1))) * 4).reshape(-1)[:, None] + e4
                for cta in range(gy):
                    src_row = np.minimum(cta * nc + r, n - 1)
                    wsm[cta][dst] = wn[(src_row * kw + step * 8 + u * 4).reshape(-1)[:, None] + e4]
                # ldmatrix.x4: lane L addresses row L & 7 of matrix L >> 3; lane l gets word l & 3 of row l >> 2
                mi = lane >> 3
                rr = (warp[:, None, None] * p.nb + jj[None, :, None]) * 16 + 8 * (mi >> 1) + (lane & 7)  # [W, NB, 32]
                addr = (rr * 2 + ((mi & 1) ^ ((rr >> 2) & 1))) * 4  # word address each lane gives
                bw = np.zeros((by.size, p.nb, 32, 4), np.uint32)
                for i in range(4):
                    src = addr[:, :, i * 8 + g] + t  # [W, NB, 32]
                    bw[..., i] = wsm[by[:, None, None], src]
                # scales: outputs min(nb0 + j, NBLK - 1) * 16 + g (+ 8)
                nrow = np.minimum(nb0[:, None] + jj[None, :], nblk - 1)[..., None] * 16 + g  # [W, NB, 32]
                for c32 in range(2):
                    # A: 16 bytes of row r (and r + 8) at unit (4 c32 + t) ^ 4 (r & 1); prmt pairs
                    a = np.zeros((p.mt, 2, 4, 32, 2), np.float32)  # [i, u, reg, lane, (lo, hi)]
                    for i in range(p.mt):
                        r0 = i * 16 + g
                        uu = (c32 * 4 + t) ^ ((r0 & 1) << 2)
                        lo = xs[((r0 * 8 + uu) * 8)[:, None] + e8]  # [32, 8]
                        hi = xs[(((r0 + 8) * 8 + uu) * 8)[:, None] + e8]
                        for uq in range(2):
                            for reg, (src, off) in enumerate(((lo, 0), (hi, 0), (lo, 1), (hi, 1))):
                                a[i, uq, reg, :, 0] = src[:, 2 * uq + off]  # 0x5410 / 0x7632: word u, low/high
                                a[i, uq, reg, :, 1] = src[:, 2 * uq + 4 + off]  # word u + 2
                    gi = 0 if gps == 1 else c32
                    o = nrow * groups + (step * 64 + gi * gs) // gs
                    for h in range(2):
                        s_, b_ = scn[o + 8 * h * groups], bin_[o + 8 * h * groups]
                        wv = bw[..., h * 2 + c32]
                        for uq in range(2):
                            b0 = _dq2(wv >> np.uint32(8 * uq), s_, b_)
                            b1 = _dq2(wv >> np.uint32(8 * uq + 4), s_, b_)
                            a_regs = [(a[:, uq, reg, :, 0], a[:, uq, reg, :, 1]) for reg in range(4)]
                            _mma(acc[:, :, :, h], a_regs, [b0, b1])
            _store(ws[z] if split else out, acc, nb0, m0, m, nblk, p)
        if split and reduce:
            _reduce(out, ws, m0, m, n, gy, gz, p)
    return ws.sum(axis=0) if split and not reduce else out


def _mma(acc: np.ndarray, a: list[tuple[np.ndarray, np.ndarray]], b: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``mma.sync.m16n8k16`` over every warp: ``acc`` [W, MT, NB, 32, 4] += A @ B, from the fragments.

    A: four registers (low, high) [MT, 32]: a0 (g, 2t..), a1 (g+8, ..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
    B: two registers [W, NB, 32]: b0 k 2t..2t+1, b1 k 2t+8.., both at column g; C: c0 c1 (g, 2t..),
    c2 c3 (g+8, ..). The tiles the fragments describe are rebuilt and multiplied per the mma's definition."""
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    at = np.zeros((a[0][0].shape[0], 16, 16), np.float32)
    for r, (lo, hi) in enumerate(a):
        rr, cc = g + 8 * (r & 1), 2 * t + 8 * (r >> 1)
        at[:, rr, cc] = lo
        at[:, rr, cc + 1] = hi
    bt = np.zeros(b[0][0].shape[:-1] + (16, 8), np.float32)
    for r, (lo, hi) in enumerate(b):
        bt[..., 2 * t + 8 * r, g] = lo
        bt[..., 2 * t + 8 * r + 1, g] = hi
    ct = np.einsum("imk,wjkn->wijmn", at, bt)  # [W, MT, NB, 16, 8]
    acc[..., 0] += ct[..., g, 2 * t]
    acc[..., 1] += ct[..., g, 2 * t + 1]
    acc[..., 2] += ct[..., g + 8, 2 * t]
    acc[..., 3] += ct[..., g + 8, 2 * t + 1]


def _store(dst: np.ndarray, acc: np.ndarray, nb0: np.ndarray, m0: int, m: int, nblk: int, p: Plan) -> None:
    """The C fragments' store: lane (g, t) of block j, half h writes rows g, g + 8, columns 2t, 2t + 1."""
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    for w_i, base_nb in enumerate(nb0):
        for i in range(p.mt):
            r0 = m0 + i * 16 + g
            for j in range(p.nb):
                if base_nb + j >= nblk:
                    continue
                for h in range(2):
                    col = (base_nb + j) * 16 + h * 8 + 2 * t
                    c = acc[w_i, i, j, h]
                    ok0, ok1 = r0 < m, r0 + 8 < m
                    dst[r0[ok0], col[ok0]] = c[ok0, 0]
                    dst[r0[ok0], col[ok0] + 1] = c[ok0, 1]
                    dst[r0[ok1] + 8, col[ok1]] = c[ok1, 2]
                    dst[r0[ok1] + 8, col[ok1] + 1] = c[ok1, 3]


def _reduce(out: np.ndarray, ws: np.ndarray, m0: int, m: int, n: int, gy: int, gz: int, p: Plan) -> None:
    """The last CTA of each tile: its column pairs, the slices added in order."""
    rows, pairs = p.mt * 16, p.warps * p.nb * 8
    ii = np.arange(rows * pairs)
    for by in range(gy):
        rr = m0 + ii // pairs
        col = by * p.warps * p.nb * 16 + 2 * (ii % pairs)
        ok = (rr < m) & (col < n)
        for half in (0, 1):
            v = np.zeros(int(ok.sum()), np.float32)
            for zz in range(gz):
                v += ws[zz, rr[ok], col[ok] + half]
            out[rr[ok], col[ok] + half] = v
