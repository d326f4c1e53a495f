"""Context parallelism without Transformer Engine: load-balanced sequence sharding and ring attention over SDPA maths.

Context parallelism (CP) splits each sequence over the ``cp`` ranks of a context-parallel group.  Every layer except
core attention is per-token and runs on the local shard unchanged; core attention needs every key and value of the
sequence, so the ranks pass their K/V blocks around a ring (:func:`ring_attention`).

**Sharding (causal load balancing)**, as megatron-core (``get_batch_on_this_cp_rank``) and torchtitan
(``_context_parallel`` "head-tail" load balancer) do it: the sequence of length ``s`` is cut into ``2 * cp`` chunks of
``c = s / (2 * cp)`` tokens; rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that order
(:func:`load_balanced_chunks`, :func:`shard_sequence`, :func:`unshard`).  Under a causal mask the work of a query
grows with its position; pairing an early chunk with a late one gives every rank the same amount of attention work.
The positions a rank holds (for RoPE, learned position embeddings) are those chunks' positions
(:func:`shard_positions`).  A sequence length that ``2 * cp`` does not divide is refused.

**Ring attention** (Liu et al. 2023; megatron-core's ``AttnFuncWithCPAndKVP2P``; torchtitan's ring over SDPA).  Each
rank keeps its queries; at step ``i = 0 .. cp-1`` it holds the K/V block of rank ``src = (r - i) mod cp`` and computes
that block's attention, while the K/V block of the next step is already travelling (one ``batch_isend_irecv``: send to
``r + 1``, receive from ``r - 1``; gloo on CPU, NCCL on GPU).  The partial outputs ``O_i`` with their log-sum-exps
``L_i`` (per query row) are merged in fp32::

    L = log(exp(L_a) + exp(L_b)),   O = O_a * exp(L_a - L) + O_b * exp(L_b - L)

With the load-balanced layout and a causal mask each step is one of three shapes (local halves ``[0:c]`` = chunk
``r``, ``[c:2c]`` = chunk ``2cp-1-r``; the K/V halves are chunks ``src`` and ``2cp-1-src``):

- ``src == r`` (step 0): both local chunks against both, causal.  Positions increase along the local shard, so this
  is the ordinary causal triangle over the ``2c x 2c`` block.
- ``src < r``: K/V chunk ``src`` precedes both query chunks, chunk ``2cp-1-src`` follows both: all ``2c`` queries
  against the first K/V half, no mask (half a block of work).
- ``src > r``: both K/V chunks precede query chunk ``2cp-1-r`` and follow query chunk ``r``: the second query half
  against all ``2c`` keys, no mask (half a block of work).

Every rank therefore does one causal ``2c x 2c`` block and ``cp - 1`` unmasked half blocks (``c x 2c`` or ``2c x c``):
the same work on every rank, with nothing fully masked computed.  Without the load-balanced layout (a contiguous split)
these three rules give wrong results, which the tests check.  Bidirectional attention (``causal=False``, BERT) does
every step in full; an optional key padding mask (``kv_padding``, ``[b, s_local]``, True = padded) is all-gathered once
and applied to each block (a query with no visible key gets a zero output and zero gradients).

**Backward** (FlashAttention-2's recomputation): with the merged output ``O``, its log-sum-exp ``L`` and ``dO``,
``D = rowsum(dO * O)``; per block ``P = exp(S - L)``, ``dV = P^T dO``, ``dS = P * (dO V^T - D)``, ``dQ = dS K * scale``,
``dK = dS^T Q * scale``.  The K/V blocks go around the ring again; each block's ``dK/dV`` accumulator (fp32) travels
with it and, after one last hop, arrives at its owner.  Grouped-query attention (fewer K/V heads) computes the query
heads of a group against their shared K/V head (query head ``j`` uses K/V head ``j // (h / h_kv)``, SDPA's
``enable_gqa`` order), so only ``h_kv`` heads travel and ``dK/dV`` sum over the group.

Block kernels: ``impl="math"`` is plain PyTorch (each block's scores materialised, ``b * h * s_local^2`` fp32 at most;
any device and dtype; the reference).  ``impl="flash"`` runs each block through torch's FlashAttention-2 op
(``aten._scaled_dot_product_flash_attention`` and its backward, which return / take the log-sum-exp; CUDA, fp16 /
bf16, no padding mask; K/V heads repeated per query group for the kernel, their gradients summed back), so no score
matrix is kept; its backward gets the merged output and log-sum-exp, which makes each block's gradient exact.  The
flash path passed its two-GPU check on H200 (``test_cuda_cp2_flash_blocks_match_math_and_reference``, scale call 9 at
9810c0f).  ``impl="cudnn"`` runs them through cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention``
and its backward, the same contract; Hopper or newer, head dim up to 128): the kernel torch's SDPA takes on one Hopper
GPU, faster there than flash (the kernel rule's ``KernelChoice.sdpa_order`` note).  ``impl="auto"`` takes cuDNN where it runs
and a one-time probe per device, dtype and head dim finds it equal to flash (forward with the log-sum-exp and
backward of a diagonal and a rectangular block of grouped queries; :func:`ring_block_kernels` says what ran and why):
first reading the K/V heads itself (``cudnn-gqa``: cuDNN takes fewer K/V heads than query heads, so no per-group
copies of K/V and no fp32 dK/dV per query head to sum), else on K/V expanded per group (``cudnn``); else flash where
it runs (CUDA, fp16 / bf16, no padding mask), else math.  Dropout inside attention, ALiBi and other additive biases, and packed
sequences (THD) are not supported.

**Communication volume** per CP rank, per attention layer, per micro-batch (``s_local = s / cp``; ``h_kv`` = K/V heads
on this TP rank, ``d`` = head dim, ``e`` = bytes per element of K/V, 2 for bf16; ring hops go to one neighbour)::

    forward   sent = (cp - 1) * 2 * b * s_local * h_kv * d * e                  (K and V, cp-1 hops)
    backward  sent = (cp - 1) * 2 * b * s_local * h_kv * d * e                  (K and V again)
                   +  cp      * 2 * b * s_local * h_kv * d * 4                  (dK, dV accumulators, fp32)
    with activation recompute of the layer: one more forward.

:func:`ring_bytes` computes these numbers (and one hop's) for the planner and the advisor's ring time.  Each hop of the forward overlaps the previous block's
compute; the step is communication-bound when ``2 * s_local * h_kv * d * e / link_bandwidth`` exceeds one half
block's attention time.

Wired into GPT (causal, MoE included) and BERT (bidirectional, ``kv_padding``) training (``parallel.context_parallel``,
see docs/context_parallel.md): the workbench SDPA attention calls :func:`ring_attention` over megatron's CP group, the trainer shards each micro-batch with :func:`shard_sequence`
(:func:`workbench.rank.data.shard_batch`); the compiled layer calls it between its compiled pieces
(``workbench.backend.compiled_layer._ring_context``).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

__all__ = [
    "load_balanced_chunks", "shard_sequence", "shard_positions", "unshard", "gather_sequence", "ring_attention",
    "ring_bytes", "ring_block_kernels", "step_plan",
]


# --------------------------------------------------------------------------------------------- sharding


def _check_split(seq_len: int, cp: int) -> int:
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context-parallel size must be a positive integer, got {cp!r}")
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * context_parallel = {2 * cp}: "
                         f"causal load balancing cuts the sequence into 2*cp equal chunks; use a sequence length that "
                         f"is a multiple of {2 * cp}")
    return seq_len // (2 * cp)


def load_balanced_chunks(seq_len: int, cp: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per CP rank, the two ``(start, stop)`` token ranges it holds, in order: chunk ``r`` and chunk
    ``2 * cp - 1 - r`` of ``2 * cp`` equal chunks.  Raises ValueError when ``2 * cp`` does not divide ``seq_len``."""
    c = _check_split(seq_len, cp)
    return [((r * c, (r + 1) * c), ((2 * cp - 1 - r) * c, (2 * cp - r) * c)) for r in range(cp)]


def shard_positions(seq_len: int, cp_rank: int, cp: int, device: Any = None):
    """The positions (``torch.long``, ``[seq_len / cp]``) rank ``cp_rank`` holds: its RoPE / position-embedding ids."""
    import torch

    (a0, a1), (b0, b1) = load_balanced_chunks(seq_len, cp)[cp_rank]
    return torch.cat([torch.arange(a0, a1, device=device), torch.arange(b0, b1, device=device)])


def shard_sequence(x, cp_rank: int, cp: int, seq_dim: int):
    """Rank ``cp_rank``'s load-balanced shard of ``x`` along ``seq_dim`` (chunks ``r`` and ``2cp-1-r`` concatenated).
    ``seq_dim`` is 1 for ``[b, s]`` token batches, 0 for megatron's ``[s, b, ...]``, 2 for SDPA's ``[b, h, s, d]``."""
    import torch

    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp - 1}")
    seq_dim = seq_dim % x.dim()
    (a0, a1), (b0, b1) = load_balanced_chunks(x.shape[seq_dim], cp)[cp_rank]
    return torch.cat([x.narrow(seq_dim, a0, a1 - a0), x.narrow(seq_dim, b0, b1 - b0)], dim=seq_dim)


def unshard(shards: Sequence[Any], seq_dim: int):
    """The whole sequence from every rank's shard (``shards[r]`` = rank r's, as :func:`shard_sequence` made it)."""
    import torch

    cp = len(shards)
    seq_dim = seq_dim % shards[0].dim()
    halves = [s.chunk(2, dim=seq_dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))], dim=seq_dim)


def gather_sequence(x, group, seq_dim: int):
    """All-gather every CP rank's shard of ``x`` and :func:`unshard` it (no autograd: for checks and logging)."""
    import torch
    import torch.distributed as dist

    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard(shards, seq_dim)


# --------------------------------------------------------------------------------------------- the plan


def step_plan(rank: int, src: int, cp: int, causal: bool) -> tuple[str, str, bool]:
    """What rank ``rank`` computes against the K/V block of rank ``src``: ``(query part, K/V part, causal
    diagonal)``, a part being ``"all"``, ``"first"`` or ``"second"`` half of the local ``2c`` tokens (module
    docstring).  Only valid for the load-balanced layout."""
    if not causal:
        return "all", "all", False
    if src == rank:
        return "all", "all", True
    if src < rank:
        return "all", "first", False
    return "second", "all", False


def _part(x, part: str, dim: int):
    if part == "all":
        return x
    n = x.shape[dim] // 2
    return x.narrow(dim, 0, n) if part == "first" else x.narrow(dim, n, x.shape[dim] - n)


def ring_bytes(batch: int, seq_len: int, kv_heads: int, head_dim: int, cp: int, elem_bytes: int = 2,
               recompute: bool = False) -> dict[str, int]:
    """Bytes one CP rank sends per attention layer per micro-batch (module docstring): ``forward``, ``backward``
    and ``total`` (``recompute``: the layer's forward runs twice); one hop's: ``kv_hop`` (a K/V block, forward and
    backward) and ``grad_hop`` (a dK/dV accumulator, fp32: backward only; its last hop returns it to its owner).
    Torch-free: the planner and the advisor's cost model (:mod:`workbench.advisor.perf_model`) read it."""
    if cp <= 1:
        return {"forward": 0, "backward": 0, "total": 0, "kv_hop": 0, "grad_hop": 0}
    kv = 2 * batch * (seq_len // cp) * kv_heads * head_dim
    fwd = (cp - 1) * kv * elem_bytes
    bwd = (cp - 1) * kv * elem_bytes + cp * kv * 4
    return {"forward": fwd, "backward": bwd, "total": fwd * (2 if recompute else 1) + bwd, "kv_hop": kv * elem_bytes,
            "grad_hop": kv * 4}


# --------------------------------------------------------------------------------------------- block maths


def _scores(q, k, scale: float, diag: bool, kmask):
    """fp32 scores ``[b, hk, g, sq, sk]`` of grouped queries ``q [b, hk, g, sq, d]`` against ``k [b, hk, sk, d]``,
    masked with -inf (causal diagonal: top-left triangle; ``kmask [b, sk]`` True = padded)."""
    import torch

    s = torch.einsum("bngqd,bnkd->bngqk", q.float(), k.float()) * scale
    if diag:
        sq, sk = s.shape[-2], s.shape[-1]
        tri = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~tri, float("-inf"))
    if kmask is not None:
        s = s.masked_fill(kmask[:, None, None, None, :], float("-inf"))
    return s


def _finite(x):
    import torch

    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _block_forward(q, k, v, scale: float, diag: bool, kmask):
    """(out fp32 ``[b, hk, g, sq, d]``, lse fp32 ``[b, hk, g, sq]``; -inf where no key is visible)."""
    import torch

    s = _scores(q, k, scale, diag, kmask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    return torch.einsum("bngqk,bnkd->bngqd", p, v.float()), lse


def _block_backward(do, q, k, v, out, lse, scale: float, diag: bool, kmask):
    """(dq, dk, dv) in fp32 of one block, from the merged output ``out`` and its ``lse`` (FlashAttention-2's
    recomputation: ``delta = rowsum(dO * O)``)."""
    import torch

    do = do.float()
    delta = (do * out.float()).sum(-1)
    s = _scores(q, k, scale, diag, kmask)
    p = torch.exp(s - _finite(lse)[..., None])
    dv = torch.einsum("bngqk,bngqd->bnkd", p, do)
    dp = torch.einsum("bngqd,bnkd->bngqk", do, v.float())
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bngqk,bnkd->bngqd", ds, k.float()) * scale
    dk = torch.einsum("bngqk,bngqd->bnkd", ds, q.float()) * scale
    return dq, dk, dv


def key_padding(mask, b: int):
    """Megatron's key-padding mask ``[b, 1, 1, s_local]`` (True = a padded key; BERT) as the ``kv_padding
    [b, s_local]`` :func:`ring_attention` takes; any other mask shape is refused."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise NotImplementedError(f"context parallelism: a padding mask of shape {tuple(mask.shape)}; "
                                  "the ring takes a key-padding mask [b, 1, 1, s_local]")
    return mask.reshape(b, -1).bool()


def _flash_ok(q, kv_padding) -> bool:
    """Whether torch's FlashAttention-2 kernel can run the blocks: CUDA on an Ampere or newer GPU (sm80+; older
    GPUs refuse the kernel), fp16 / bf16, no padding mask, head dim a multiple of 8 up to 256."""
    import torch

    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and kv_padding is None and d % 8 == 0
            and d <= 256 and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention")
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def _flash_heads(q, k, v, expand: bool = True):
    """Grouped ``q [b, hk, g, s, d]`` and ``k/v [b, hk, s, d]`` as the kernel's ``[b, h, s, d]`` (K/V heads repeated
    per group, SDPA's ``enable_gqa`` order; ``expand=False``: K/V as they are, for a kernel that reads K/V head
    ``j // g`` for query head ``j`` itself)."""
    b, hk, g, sq, d = q.shape
    q4 = q.reshape(b, hk * g, sq, d).contiguous()
    if g > 1 and expand:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return q4, k.contiguous(), v.contiguous()


def _kernel_inputs(do, q, k, v, out, lse, lse_tail: tuple = (), expand: bool = True):
    """A fused kernel's backward inputs from the ring's grouped layout: ``[b, h, s, d]`` (K/V heads repeated per
    group unless ``expand=False``), the log-sum-exp in the kernel's own shape (``lse_tail``: cuDNN's trailing 1)."""
    b, hk, g, sq, d = q.shape
    q4, k4, v4 = _flash_heads(q, k, v, expand)
    flat = (b, hk * g, sq, d)
    return do.reshape(flat).contiguous(), q4, k4, v4, out.reshape(flat).contiguous(), \
        lse.reshape(b, hk * g, sq, *lse_tail).contiguous()


def _grouped_grads(q, k, dq, dk, dv, expand: bool):
    """A fused kernel's ``dq, dk, dv`` back in the ring's grouped fp32 layout (dK/dV summed over each query group
    where the kernel saw K/V expanded, as :func:`_flash_heads` with ``expand``; as they are where it read the K/V
    heads itself)."""
    b, hk, g, sq, d = q.shape
    sk = k.shape[2]
    if g == 1 or not expand:
        return dq.float().view(b, hk, g, sq, d), dk.float(), dv.float()
    return (dq.float().view(b, hk, g, sq, d), dk.float().view(b, hk, g, sk, d).sum(2),
            dv.float().view(b, hk, g, sk, d).sum(2))


def _flash_block_forward(q, k, v, scale: float, diag: bool, kmask, aux: dict):
    import torch

    b, hk, g, sq, d = q.shape
    q4, k4, v4 = _flash_heads(q, k, v)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, diag, False, scale=scale)
    if not aux:  # the kernel's varlen / RNG outputs; its backward takes them back (unused without dropout)
        aux.update(cum_seq_q=res[2], cum_seq_k=res[3], philox_seed=res[6], philox_offset=res[7])
    return res[0].float().view(b, hk, g, sq, d), res[1].float().view(b, hk, g, sq)


def _flash_block_backward(do, q, k, v, out, lse, scale: float, diag: bool, kmask, aux: dict):
    import torch

    do4, q4, k4, v4, out4, lse4 = _kernel_inputs(do, q, k, v, out, lse)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do4, q4, k4, v4, out4, lse4, aux["cum_seq_q"], aux["cum_seq_k"], q.shape[3], k.shape[2], 0.0, diag,
        aux["philox_seed"], aux["philox_offset"], scale=scale)
    return _grouped_grads(q, k, dq, dk, dv, expand=True)


def _cudnn_ok(q, kv_padding) -> bool:
    """Whether cuDNN's fused attention can run the blocks: what flash needs, a head dim up to 128, a Hopper or newer
    GPU, torch's cuDNN SDPA enabled, and either cuDNN 9.15.1 or newer or block lengths that are multiples of 128 (the
    local shard a multiple of 256: its halves are blocks too).  Torch's SDPA prefers cuDNN on Hopper from 9.15.1,
    whose fix concerns other lengths (the kernel rule's ``KernelChoice.sdpa_order`` note has the H100 timings)."""
    import torch

    if not (_flash_ok(q, kv_padding) and q.shape[-1] <= 128 and torch.cuda.get_device_capability(q.device) >= (9, 0)
            and torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()):
        return False
    return (torch.backends.cudnn.version() or 0) >= 91501 or q.shape[-2] % 256 == 0


def _cudnn_block_forward(q, k, v, scale: float, diag: bool, kmask, aux: dict, gqa: bool = False):
    """``gqa``: K/V heads as they are (cuDNN reads K/V head ``j // g`` for query head ``j``; no copies of K/V per
    group, dK/dV come back summed), else expanded per group as for flash."""
    import torch

    b, hk, g, sq, d = q.shape
    q4, k4, v4 = _flash_heads(q, k, v, expand=not gqa)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, diag, False, scale=scale)
    if not aux:  # its backward takes these back (empty / unused without dropout and varlen); the lse's own shape
        aux.update(cum_seq_q=res[2], cum_seq_k=res[3], philox_seed=res[6], philox_offset=res[7],
                   lse_tail=tuple(res[1].shape[3:]))
    return res[0].float().view(b, hk, g, sq, d), res[1].float().reshape(b, hk, g, sq)


def _cudnn_block_backward(do, q, k, v, out, lse, scale: float, diag: bool, kmask, aux: dict, gqa: bool = False):
    import torch

    do4, q4, k4, v4, out4, lse4 = _kernel_inputs(do, q, k, v, out, lse, aux["lse_tail"], expand=not gqa)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do4, q4, k4, v4, out4, lse4, aux["philox_seed"], aux["philox_offset"], None, aux["cum_seq_q"],
        aux["cum_seq_k"], q.shape[3], k.shape[2], 0.0, diag, scale=scale)
    return _grouped_grads(q, k, dq, dk, dv, expand=not gqa)


#: the block kernel each ``(device, dtype, head dim, impl)`` of this process ran, and why (:func:`ring_block_kernels`)
_DECIDED: dict[tuple, tuple[str, str]] = {}
#: :func:`_probe_cudnn`'s verdict per ``(device, dtype, head dim)``: probed once a process
_PROBED: dict[tuple, tuple[str, str]] = {}


def _probe_cudnn(q) -> tuple[str, str]:
    """``impl="auto"`` on a GPU where cuDNN may run: one small causal block and a rectangular one, grouped queries (two
    per K/V head), through flash's kernel and cuDNN's, forward (output and log-sum-exp) and backward.  cuDNN reading
    the K/V heads itself (``cudnn-gqa``) where it runs and agrees with flash within bf16 rounding, else cuDNN on K/V
    expanded per group (``cudnn``), else flash; the reason kept."""
    import torch

    key = (str(q.device), str(q.dtype), int(q.shape[-1]))
    if key in _PROBED:
        return _PROBED[key]
    gen = torch.Generator(device=q.device).manual_seed(0)
    d, cases = q.shape[-1], []
    for diag, sq, sk in ((True, 256, 256), (False, 128, 256)):
        qq = torch.randn(1, 2, 2, sq, d, device=q.device, dtype=q.dtype, generator=gen)
        kk, vv = (torch.randn(1, 2, sk, d, device=q.device, dtype=q.dtype, generator=gen) for _ in range(2))
        do = torch.randn(1, 2, 2, sq, d, device=q.device, dtype=q.dtype, generator=gen)
        cases.append((diag, qq, kk, vv, do))

    def run(fwd, bwd, **kw):
        outs = []
        for diag, qq, kk, vv, do in cases:
            aux: dict = {}
            o, lse = fwd(qq, kk, vv, 0.125, diag, None, aux, **kw)
            outs += [o, lse, *bwd(do, qq, kk, vv, o.to(q.dtype), lse, 0.125, diag, None, aux, **kw)]
        return outs

    want, notes = run(_flash_block_forward, _flash_block_backward), []
    for name, gqa in (("cudnn-gqa", True), ("cudnn", False)):
        try:
            got = run(_cudnn_block_forward, _cudnn_block_backward, gqa=gqa)
        except Exception as e:  # noqa: BLE001 -- any refusal of the cuDNN op: the next candidate
            notes.append(f"{name}: cuDNN attention refused: {type(e).__name__}: {str(e)[:160]}")
            continue
        worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(got, want))
        if worst < 2e-2:
            _PROBED[key] = (name, "; ".join([f"matches flash ({worst:.1e})", *notes]))
            return _PROBED[key]
        notes.append(f"{name}: cuDNN attention differs from flash by {worst:.1e}")
    _PROBED[key] = ("flash", "; ".join(notes))
    return _PROBED[key]


def ring_block_kernels() -> dict[str, str]:
    """The block kernel the ring ran in this process per ``device/dtype/head dim/impl`` and why (``"cudnn: matches
    flash (3.1e-03)"``, ``"flash: cuDNN not eligible ..."``, ``"math: ..."``); empty when the ring has not run."""
    return {"/".join(map(str, k)): f"{v[0]}: {v[1]}" for k, v in _DECIDED.items()}


def _merge(out, lse, blk_out, blk_lse):
    """Merge a block's (out, lse) into the running (out, lse) in place-free fp32 (-inf safe)."""
    import torch

    new = torch.logaddexp(lse, blk_lse)
    safe = _finite(new)
    return out * torch.exp(lse - safe)[..., None] + blk_out * torch.exp(blk_lse - safe)[..., None], new


# --------------------------------------------------------------------------------------------- the ring


class _Ring:
    """Send to the next CP rank, receive from the previous one (global ranks of ``group``)."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send):
        """Start sending ``send`` forward and receiving its like from behind: ``(receive buffer, requests)``."""
        import torch
        import torch.distributed as dist

        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending):
        recv, reqs = pending
        for r in reqs:
            r.wait()
        return recv


def _kernels(kernel: str, aux: dict):
    """(block forward, block backward) of the chosen kernel (``math``, ``flash``, ``cudnn``, ``cudnn-gqa``), same
    signatures."""
    if kernel == "math":
        return _block_forward, _block_backward
    if kernel == "flash":
        return (lambda *a: _flash_block_forward(*a, aux)), (lambda *a: _flash_block_backward(*a, aux))
    gqa = kernel == "cudnn-gqa"
    return (lambda *a: _cudnn_block_forward(*a, aux, gqa=gqa)), (lambda *a: _cudnn_block_backward(*a, aux, gqa=gqa))


def _ring_forward(q, k, v, kmasks, ring, rank: int, cp: int, causal: bool, scale: float, plan, block_forward):
    """Grouped ``q [b, hk, g, s, d]``, ``k/v [b, hk, s, d]`` -> (out fp32, lse fp32)."""
    import torch

    b, hk, g, s, d = q.shape
    out = lse = None
    kv = torch.stack([k, v])
    for i in range(cp):
        pending = ring.start(kv) if i + 1 < cp else None
        src = (rank - i) % cp
        qp, kvp, diag = plan(rank, src, cp, causal)
        km = None if kmasks is None else _part(kmasks[src], kvp, 1)
        blk_out, blk_lse = block_forward(_part(q, qp, 3), _part(kv[0], kvp, 2), _part(kv[1], kvp, 2), scale, diag, km)
        if out is None and qp == "all":  # the first block over every query is the running result as it stands:
            out, lse = blk_out, blk_lse  # merged into zeros and -inf it gives the same numbers, at 3 fp32 passes
        else:
            if out is None:
                out = torch.zeros(b, hk, g, s, d, dtype=torch.float32, device=q.device)
                lse = torch.full((b, hk, g, s), float("-inf"), dtype=torch.float32, device=q.device)
            if qp == "all":
                out, lse = _merge(out, lse, blk_out, blk_lse)
            else:  # half the queries: merge into that half of the buffers (no autograd here)
                idx = slice(0, s // 2) if qp == "first" else slice(s // 2, s)
                out[..., idx, :], lse[..., idx] = _merge(out[..., idx, :], lse[..., idx], blk_out, blk_lse)
        if pending is not None:
            kv = _Ring.wait(pending)
    return out, lse


def _ring_backward(do, q, k, v, out, lse, kmasks, ring, rank: int, cp: int, causal: bool, scale: float, plan,
                   block_backward):
    import torch

    dq = None  # the first block over every query starts the sum (no zeros to add it to)
    kv = torch.stack([k, v])
    dkv_pending = None
    for i in range(cp):
        pending = ring.start(kv) if i + 1 < cp else None
        src = (rank - i) % cp
        qp, kvp, diag = plan(rank, src, cp, causal)
        km = None if kmasks is None else _part(kmasks[src], kvp, 1)
        bq, bk, bv = block_backward(_part(do, qp, 3), _part(q, qp, 3), _part(kv[0], kvp, 2), _part(kv[1], kvp, 2),
                                    _part(out, qp, 3), _part(lse, qp, 3), scale, diag, km)
        if dq is None and qp == "all":
            dq = bq  # fp32, the block kernel's own new tensor
        else:
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if dq is None else dq
            _part(dq, qp, 3).add_(bq)
        if kvp == "all":  # the whole block's gradients, one copy (no zeros to fill)
            blk = torch.stack([bk, bv]).float()
        else:
            blk = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
            _part(blk[0], kvp, 2).copy_(bk)
            _part(blk[1], kvp, 2).copy_(bv)
        dkv = blk if dkv_pending is None else _Ring.wait(dkv_pending) + blk  # the accumulator of src's K/V
        if cp == 1:
            return dq, dkv
        dkv_pending = ring.start(dkv)  # on to the next rank; after the last hop it reaches its owner
        if pending is not None:
            kv = _Ring.wait(pending)
    return dq, _Ring.wait(dkv_pending)


def _autograd_function():
    import torch

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, kmasks, group, causal, scale, plan, kernel):
            b, h, s, d = q.shape
            hk = k.shape[1]
            qg = q.reshape(b, hk, h // hk, s, d)
            ring = _Ring(group) if group is not None else None
            rank, cp = (ring.rank, ring.size) if ring is not None else (0, 1)
            aux: dict = {}
            out, lse = _ring_forward(qg, k, v, kmasks, ring, rank, cp, causal, scale, plan, _kernels(kernel, aux)[0])
            out = out.to(q.dtype)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.kmasks, ctx.ring, ctx.rank, ctx.cp = kmasks, ring, rank, cp
            ctx.causal, ctx.scale, ctx.plan, ctx.kernel, ctx.aux = causal, scale, plan, kernel, aux
            return out.reshape(b, h, s, d)

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            b, h, s, d = q.shape
            hk = k.shape[1]
            qg = q.reshape(b, hk, h // hk, s, d)
            dog = dout.to(q.dtype).reshape(b, hk, h // hk, s, d)
            dq, dkv = _ring_backward(dog, qg, k, v, out, lse, ctx.kmasks, ctx.ring, ctx.rank, ctx.cp, ctx.causal,
                                     ctx.scale, ctx.plan, _kernels(ctx.kernel, ctx.aux)[1])
            return (dq.reshape(b, h, s, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                    None, None, None, None, None, None)

    return RingAttention


_FUNCTION: Any = None


def _block_kernel(impl: str, q, kv_padding) -> str:
    """The block kernel for ``impl`` (:func:`ring_attention`), recorded with its reason (:func:`ring_block_kernels`);
    ``auto``: cuDNN where it runs and its probe agrees with flash (:func:`_probe_cudnn`), else flash where it runs,
    else math."""
    flash = impl != "math" and _flash_ok(q, kv_padding)
    if impl == "flash" and not flash:
        raise ValueError("ring_attention impl 'flash' needs CUDA tensors in fp16 / bf16, a head dim that is a multiple "
                         "of 8 up to 256 and no kv_padding; impl='math' runs everywhere")
    cudnn = flash and _cudnn_ok(q, kv_padding)
    if impl in ("cudnn", "cudnn-gqa") and not cudnn:
        raise ValueError(f"ring_attention impl {impl!r} needs what 'flash' needs, a head dim up to 128, a Hopper or "
                         "newer GPU, torch's cuDNN SDPA enabled and cuDNN >= 9.15.1 or a local shard a multiple of "
                         "256 long; impl='flash' or 'math' otherwise")
    if impl != "auto":
        kernel, why = impl, "asked for"
    elif cudnn:
        kernel, why = _probe_cudnn(q)
    elif flash:
        kernel, why = "flash", "cuDNN not eligible (head dim, GPU, cuDNN version or shard length)"
    else:
        kernel, why = "math", "flash not eligible (CPU, fp32, head dim or a padding mask)"
    _DECIDED[(str(q.device), str(q.dtype), int(q.shape[-1]), impl)] = (kernel, why)
    return kernel


def ring_attention(q, k, v, group, causal: bool, scale: Optional[float] = None, kv_padding=None, impl: str = "auto",
                   _plan=None):
    """Attention of this CP rank's queries against the whole sequence's keys and values, by ring attention.

    ``q [b, h, s_local, d]``, ``k/v [b, h_kv, s_local, d]`` (SDPA's layout; ``h_kv`` divides ``h``: MHA / GQA / MQA)
    hold this rank's load-balanced shard (:func:`shard_sequence`, ``seq_dim=2``); returns ``[b, h, s_local, d]`` in
    ``q``'s dtype, equal to ``F.scaled_dot_product_attention`` over the whole sequence (``is_causal=causal``,
    ``enable_gqa=True``) sharded the same way.  ``group``: the CP process group (None, or a group of one: plain local
    attention).  ``scale``: default ``1 / sqrt(d)``.  ``kv_padding``: optional ``[b, s_local]`` bool, True = a padded
    key (BERT); it is all-gathered once per call.  ``impl``: the block kernel, ``"math"`` (plain PyTorch, any device and
    dtype), ``"flash"`` (torch's FlashAttention-2 op: CUDA, fp16 / bf16, no ``kv_padding``), ``"cudnn"`` (cuDNN's
    fused attention on K/V expanded per query group: what flash needs, Hopper or newer, head dim up to 128),
    ``"cudnn-gqa"`` (the same reading the K/V heads itself) or ``"auto"`` (cuDNN where it runs and agrees with flash,
    grouped first, else flash where it runs, else math: :func:`_block_kernel`).  fp32, bf16 and fp16 inputs; the
    merge and the gradient accumulation run in fp32.  Differentiable in q, k, v.
    """
    import torch
    import torch.distributed as dist

    global _FUNCTION
    if impl not in ("auto", "math", "flash", "cudnn", "cudnn-gqa"):
        raise ValueError(f"ring_attention impl {impl!r}: use 'auto', 'math', 'flash', 'cudnn' or 'cudnn-gqa'")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("ring_attention takes q/k/v as [b, heads, s_local, head_dim] (SDPA's layout); "
                         "permute megatron's [s, b, heads, d] with .permute(1, 2, 0, 3)")
    b, h, s, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"ring_attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)} "
                         f"(self-attention on one shard: same batch, length and head dim)")
    if h % k.shape[1]:
        raise ValueError(f"ring_attention: {h} query heads are not a multiple of {k.shape[1]} key/value heads")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    cp = 1 if group is None else dist.get_world_size(group)
    if causal and s % 2 and cp > 1:
        raise ValueError(f"ring_attention: the local shard has {s} tokens; the causal load-balanced layout holds two "
                         f"equal chunks per rank (shard with shard_sequence)")
    kmasks = None
    if kv_padding is not None:
        if kv_padding.shape != (b, s):
            raise ValueError(f"kv_padding must be [b, s_local] = {(b, s)}, got {tuple(kv_padding.shape)}")
        kv_padding = kv_padding.to(device=q.device, dtype=torch.bool)
        if group is None:
            kmasks = [kv_padding]
        else:
            parts = [torch.empty((b, s), dtype=torch.uint8, device=q.device) for _ in range(cp)]
            dist.all_gather(parts, kv_padding.to(torch.uint8).contiguous(), group=group)
            kmasks = [p.bool() for p in parts]
    kernel = _block_kernel(impl, q, kv_padding)
    if _FUNCTION is None:
        _FUNCTION = _autograd_function()
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return _FUNCTION.apply(q, k, v, kmasks, group, bool(causal), scale, _plan or step_plan, kernel)
