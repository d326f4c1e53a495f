"""The Triton kernels of :mod:`workbench.backend.qkv_rope` (imported only where they run: it imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def _tables(cos_ptr, sin_ptr, s, j, HALF: tl.constexpr):
    """The token's rows of megatron's rounded cos / sin tables ``[s, d]``, each half, in fp32."""
    lo, hi = s * (2 * HALF) + j, s * (2 * HALF) + HALF + j
    return (tl.load(cos_ptr + lo).to(tl.float32), tl.load(cos_ptr + hi).to(tl.float32),
            tl.load(sin_ptr + lo).to(tl.float32), tl.load(sin_ptr + hi).to(tl.float32))


@triton.jit
def triton_qkv_rope_forward(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, S, B, G: tl.constexpr, PG: tl.constexpr,
                            HALF: tl.constexpr, GB: tl.constexpr, PB: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # the token: QKV's row (s, b)
    s, b = t // B, t % B
    j = tl.arange(0, HALF)
    g = tl.arange(0, GB)
    p = tl.arange(0, PB)
    D = 2 * HALF
    N = G * PG
    dtype = q_ptr.dtype.element_ty
    c_lo, c_hi, s_lo, s_hi = _tables(cos_ptr, sin_ptr, s, j, HALF)
    gm = g < G
    gp = gm[:, None] & (p < PG)[None, :]  # [GB, PB]: real (group, query head) pairs
    row = qkv_ptr + t * (G * (PG + 2) * D)
    src = row + ((g[:, None] * (PG + 2) + p[None, :]) * D)[:, :, None] + j[None, None, :]
    m3 = gp[:, :, None]
    x1 = tl.load(src, mask=m3).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m3).to(tl.float32)
    head = g[:, None] * PG + p[None, :]  # the query head [GB, PB]
    dst = (((b * N + head) * S + s) * D)[:, :, None] + j[None, None, :]  # [b, n, s, d]
    tl.store(q_ptr + dst, (x1 * c_lo - x2 * s_lo).to(dtype), mask=m3)
    tl.store(q_ptr + dst + HALF, (x2 * c_hi + x1 * s_hi).to(dtype), mask=m3)
    ksrc = row + ((g * (PG + 2) + PG) * D)[:, None] + j[None, :]  # [GB, HALF]
    k1 = tl.load(ksrc, mask=gm[:, None]).to(tl.float32)
    k2 = tl.load(ksrc + HALF, mask=gm[:, None]).to(tl.float32)
    v1 = tl.load(ksrc + D, mask=gm[:, None])
    v2 = tl.load(ksrc + D + HALF, mask=gm[:, None])
    tl.store(k_ptr + dst, tl.broadcast_to(((k1 * c_lo - k2 * s_lo).to(dtype))[:, None, :], (GB, PB, HALF)), mask=m3)
    tl.store(k_ptr + dst + HALF, tl.broadcast_to(((k2 * c_hi + k1 * s_hi).to(dtype))[:, None, :], (GB, PB, HALF)), mask=m3)
    tl.store(v_ptr + dst, tl.broadcast_to(v1[:, None, :], (GB, PB, HALF)), mask=m3)
    tl.store(v_ptr + dst + HALF, tl.broadcast_to(v2[:, None, :], (GB, PB, HALF)), mask=m3)
