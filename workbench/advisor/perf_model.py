"""Predicted step time of one layout, from parts the workbench owns and a calibration profile.

Per micro-batch and transformer layer, on one TP rank (``workbench.config`` / the family's ``shapes``
give every size; the profile gives every rate):

* **GEMMs**: the family's Megatron FLOPs (``shapes.layer_and_head_flops``) split into dense and
  attention parts (the attention part is what grows with the sequence: evaluated at ``s`` and ``2s``),
  divided by TP, at the profile's GEMM rate for this GEMM size and its attention rate for this
  sequence; FP8 (where the kernel rule runs it) divides GEMM time by the profile's FP8 speed-up and adds
  its casts as element-wise traffic.
* **element-wise** (norms, activations, residuals, RoPE, the fused kernels): the bytes the layer keeps
  for backward (``shapes.layer_activation_terms`` for the kernels the rule chooses) times a fitted
  traffic factor, at the profile's memory bandwidth; the output layer and loss likewise from
  ``shapes.logits_bytes``; each micro-batch adds its weight gradients into fp32 main grads.
* **TP collectives**: per layer two forward and two backward all-reduces of the ``[s, b, h]``
  activation (sequence parallelism: an all-gather and a reduce-scatter for each), timed by the
  profile's bus bandwidth at that size; with the kernel rule's ``tp_overlap`` the backward ones hide
  under the weight-gradient GEMMs (a fitted fraction of them).
* **CP** (context parallelism, :mod:`workbench.backend.context_parallel`): a rank holds ``s / cp`` tokens of each
  sequence, so its dense GEMMs, element-wise bytes and TP collectives are those of ``s / cp`` tokens, and its
  attention is ``1 / cp`` of the causal work at ``s`` (the load-balanced split: every rank one causal ``2c x 2c``
  block and ``cp - 1`` half blocks; BERT's bidirectional work splits the same way), at the profile's attention rate
  for ``s / cp`` (BERT's ring runs the math block kernel, slower than that rate; no BERT CP row is measured).  The ring's K/V blocks
  (:func:`workbench.backend.context_parallel.ring_bytes`: one hop ``2 b (s/cp) h_kv d e`` bytes, ``h_kv`` the K/V
  heads of a TP rank) travel at the profile's p2p bandwidth, each hop under one block's attention (``a = t_attn /
  cp`` per direction's share): forward exposes ``(cp - 1) max(0, hop - a_f)``, backward ``(cp - 1) max(0, hop' -
  a_b)`` with ``hop'`` a K/V block plus a dK/dV accumulator (fp32), plus the accumulators' last hop home, unhidden;
  both times ``cp_comm_factor`` (not fitted).  Full recompute (and selective of core attention) runs the
  forward ring again.
* **recompute**: selective (the rule's ``selective``: the MLP's forward GEMMs and the bytes it drops,
  or core attention's forward) or full (one more forward of every layer, its collectives included).
* **host**: where the rule replays no CUDA graphs, a layer's launch time (profile, by kernel path) shows
  where it exceeds the layer's device time.

Per step: 1F1B / interleaved pipelines run through :func:`workbench.schedules.simulate` with each
stage's times (``derive().stage_layers``: the balanced split) and the p2p time of one activation as
latency: what the slowest rank waits beyond its own work is the **bubble**.  DP's gradient
reduce-scatter / all-reduce over DP x CP ranks (megatron's ``intra_dp_cp_group``; and the distributed
optimizer's parameter all-gather, its shards over DP x CP) overlaps the last
micro-batch's backward (first forward) where ``overlap_grad_reduce`` (``overlap_param_gather``) is on,
by a fitted fraction; the optimizer step costs the profile's time per local parameter (optimizer CPU offload: the
offloaded share at the assumed host time per parameter, ``Constants.offload_ns_per_param``).  MFU is
Megatron's FLOPs (``derive().flops_per_step``) over the step and the profile's peak.

Every prediction carries its breakdown in seconds per step (compute, tp_comm, cp_comm, dp_comm, bubble,
recompute, host, optimizer), summing to the step time.  Torch-free (``ring_bytes`` is torch-free).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from workbench import kernel_rule, schedules
from workbench.backend.context_parallel import ring_bytes
from workbench.config import RunConfig, derive, pad_vocab_size
from workbench.families import family_of

from workbench.advisor.profile import Profile

__all__ = ["Constants", "Prediction", "Model", "flop_split", "REASONS"]

#: breakdown keys, in the order a table shows them
REASONS = ("compute", "tp_comm", "cp_comm", "dp_comm", "bubble", "recompute", "host", "optimizer")


@dataclass(frozen=True)
class Constants:
    """The model's free constants (fitted to measured rows by :func:`workbench.advisor.calibration.fit`)."""

    #: element-wise bytes moved per byte a layer keeps for backward: the compiled layer (fused) ...
    ew_factor: float = 3.0
    #: ... and megatron's stock layer (unfused: every op reads and writes memory)
    ew_factor_stock: float = 8.0
    #: logits + loss bytes moved per byte of their peak
    head_factor: float = 2.0
    #: bytes per parameter each micro-batch's weight-gradient accumulation moves (read bf16 + fp32, write fp32)
    grad_accum_bytes: float = 10.0
    #: fraction of the weight-gradient GEMMs' time under which backward TP collectives hide (kernel rule's tp_overlap)
    tp_overlap: float = 0.7
    #: multiplier on TP collective time inside a layer (contention with compute, skew between ranks)
    tp_comm_factor: float = 1.0
    #: fraction of the last micro-batch's backward (first forward) under which DP's reduce (gather) hides
    dp_overlap: float = 0.8
    #: multiplier on the CP ring's hop time (contention with the block kernels, skew between ranks); not fitted: at
    #: 1.0 the measured CP=2 rows (16k, 32k) are predicted within 4%, their hops hidden under the blocks (docs/advisor.md)
    cp_comm_factor: float = 1.0
    #: optimizer CPU offload: host time per offloaded parameter of the shard, nanoseconds (the CPU's fused AdamW plus
    #: the gradient's copy to the host and the parameter's back, 8 bytes over PCIe, partly overlapped); assumed, not
    #: fitted: no measured offload row yet.  Torch's fused CPU AdamW measured 0.7 ns per parameter on one core of
    #: the project's CPU machine (memory-bound: 0.6 on two); the copies add ~0.3 at ~25 GB/s.
    offload_ns_per_param: float = 1.0
    #: FP8 casts, by recipe: element-wise bytes per byte of the layer's GEMM inputs (activations and weights)
    fp8_cast_tensorwise: float = 1.0
    fp8_cast_rowwise: float = 1.0
    fp8_cast_delayed: float = 1.0
    #: FP8: fixed time per layer forward + backward (scale reductions and casts launched per GEMM input), microseconds
    fp8_layer_us: float = 20.0
    #: fixed host time per step (schedule, loss and grad-norm reductions, optimizer launch), milliseconds
    step_ms: float = 2.0

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> "Constants":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: float(v) for k, v in d.items() if k in known})


@dataclass
class Prediction:
    step_s: float
    tokens_per_s: float
    mfu: float
    breakdown: dict[str, float]  # seconds per step, by REASONS; sums to step_s
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def main_reason(self) -> str:
        """The largest cost besides compute (what most separates this layout from its pure compute)."""
        other = {k: v for k, v in self.breakdown.items() if k != "compute"}
        return max(other, key=other.get) if other and max(other.values()) > 0 else "compute"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _with_seq(cfg: RunConfig, factor: int) -> RunConfig:
    m = cfg.model
    ds = m.decoder_seq_length * factor if m.decoder_seq_length else None
    return dataclasses.replace(cfg, model=dataclasses.replace(m, seq_length=m.seq_length * factor, decoder_seq_length=ds))


def flop_split(cfg: RunConfig, tp: int) -> dict[str, float]:
    """Forward + backward FLOPs per token of one layer and of the head (output layer, loss, and what else the family
    counts there), each split into dense GEMMs and attention: the family's Megatron FLOPs at ``s`` and ``2s``
    (the attention part is the one that doubles)."""
    m = cfg.model
    unit = 12.0 * m.hidden_size ** 2  # per token
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    shapes = family_of(cfg).shapes
    l1, h1 = shapes.layer_and_head_flops(cfg, vocab)
    l2, h2 = shapes.layer_and_head_flops(_with_seq(cfg, 2), vocab)
    return {"layer_dense": unit * (2 * l1 - l2), "layer_attn": unit * (l2 - l1),
            "head_dense": unit * (2 * h1 - h2), "head_attn": unit * (h2 - h1)}


def _sum(d: dict[str, float]) -> float:
    return float(sum(d.values()))


@dataclass(frozen=True)
class _LayerTimes:
    """One transformer layer's seconds per micro-batch on one rank (:meth:`Model._layer_times`)."""

    device: float  # GEMMs + attention + elementwise, forward and backward
    tp: float  # TP collectives left exposed, forward and backward
    cp: float  # the CP ring's exposed hops, forward and backward
    recompute: float  # rebuilt in backward
    forward: float  # device seconds of the forward (its collectives and ring hops included)
    backward: float  # of the backward (recompute included)
    host_forward: float  # host launches beyond the forward's device time
    host_backward: float


class Model:
    """The performance model of one base config (model, global batch, sequence) on one profile.

    :meth:`predict` takes a layout's config (``workbench.advisor.enumerate.apply_layout``); what does not
    depend on the whole layout is cached, so thousands of layouts cost little.
    """

    def __init__(self, base: RunConfig, profile: Profile, constants: Constants | None = None):
        self.base = base
        self.profile = profile
        self.c = constants or Constants.from_dict(profile.constants)
        self._derived: dict[tuple, Any] = {}
        self._sim: dict[tuple, tuple[float, float]] = {}
        self._flop_cache: dict[int, dict[str, float]] = {}

    # ---- cached pieces
    def _derive(self, cfg: RunConfig):
        p, t = cfg.parallel, cfg.train
        key = (p.tensor_parallel, p.pipeline_parallel, p.vpp, p.world_size, t.micro_batch_size, p.pipeline_split,
               p.context_parallel)
        d = self._derived.get(key)
        if d is None:
            d = self._derived[key] = derive(cfg)
        return d

    def _flops(self, tp: int) -> dict[str, float]:
        fl = self._flop_cache.get(tp)
        if fl is None:
            fl = self._flop_cache[tp] = flop_split(self.base, tp)
        return fl

    def _simulate(self, pp: int, m: int, vpp: int, fwd: list[float], bwd: list[float], latency: float) -> tuple[float, float]:
        """(step time, busiest rank's busy time) of the pipeline, from :func:`workbench.schedules.simulate`
        on times normalised to the first stage's forward (cached: layouts share their shapes)."""
        scale = fwd[0] or 1.0
        key = (pp, m, vpp, tuple(round(x / scale, 3) for x in fwd), tuple(round(x / scale, 3) for x in bwd),
               round(latency / scale, 4))
        hit = self._sim.get(key)
        if hit is None:
            tl = schedules.simulate(None, pp, m, vpp, forward=list(key[3]), backward=list(key[4]), latency=key[5])
            busiest = max(range(pp), key=tl.busy)
            hit = self._sim[key] = (tl.step_time, tl.busy(busiest))
        return hit[0] * scale, hit[1] * scale

    def ring_seconds(self, sh: Any, cp: int, t_attn: float, inter_node: bool = False) -> tuple[float, float]:
        """(forward, backward) seconds the CP ring adds to one layer's micro-batch beyond its attention, on a rank of
        local shape ``sh`` (``sh.s = seq_length / cp``) whose attention takes ``t_attn`` (forward + backward = 3 x
        forward): each of the ``cp`` steps computes one block (``t_attn / cp`` split 1:2) while the next hop travels,
        so a step costs ``max(block, hop)``; the first block needs no hop and the dK/dV accumulators' last hop home
        follows the last block (module docstring).  (0, 0) at cp = 1."""
        if cp <= 1:
            return 0.0, 0.0
        rb = ring_bytes(sh.b, sh.s * cp, max(sh.groups // sh.tp, 1), sh.head_dim, cp, elem_bytes=sh.e)
        hop = self.profile.collective_seconds
        k = self.c.cp_comm_factor
        hop_f = k * hop("p2p", rb["kv_hop"], 2, inter_node)
        hop_b = k * hop("p2p", rb["kv_hop"] + rb["grad_hop"], 2, inter_node)
        last = k * hop("p2p", rb["grad_hop"], 2, inter_node)
        a_f, a_b = t_attn / 3 / cp, 2 * t_attn / 3 / cp
        return (cp - 1) * max(0.0, hop_f - a_f), (cp - 1) * max(0.0, hop_b - a_b) + last

    # ---- the model
    def predict(self, cfg: RunConfig, gpus_per_node: int | None = None, simulate: bool = True) -> Prediction:
        """The layout's step time.  ``simulate``: the pipeline's bubble from the schedule simulator (exact for the
        stage times); otherwise from the closed form ``(p - 1) / (v m)`` on the slowest stage (a quick first pass)."""
        p = cfg.parallel
        per_node = gpus_per_node or p.nproc_per_node
        d = self._derive(cfg)
        kp = kernel_rule.choose(cfg)
        fam = family_of(cfg)
        sh = fam.shapes.shape(cfg, d)
        cp = max(int(p.context_parallel or 1), 1)
        if cp > 1:  # a rank holds seq_length / cp tokens of each sequence (the planner's local shape)
            sh = dataclasses.replace(sh, s=sh.s // cp)
        lt = self._layer_times(cfg, sh, kp, fam, cp, per_node)
        t_head = self._head_seconds(cfg, sh, kp, fam)
        params_local = [n / p.tensor_parallel for n in d.params_per_stage]
        br, fwd, bwd, r_busy = self._pipeline(cfg, d, sh, lt, t_head, params_local, cp, per_node, simulate)
        dpcp = d.data_parallel * cp  # megatron's gradient buffers (and the optimizer's shards) span DP x CP
        br["dp_comm"] = self._dp_seconds(cfg, sh, params_local, dpcp, per_node, fwd[r_busy], bwd[r_busy])
        opt_params = max(params_local) / (dpcp if p.distributed_optimizer else 1)
        off = p.offload_fraction  # that share of the shard steps on the host (optimizer CPU offload)
        ns = (1 - off) * self.profile.optimizer_ns_per_param.value + off * self.c.offload_ns_per_param
        br["optimizer"] = opt_params * ns * 1e-9 + self.c.step_ms * 1e-3
        step = sum(br.values())
        breakdown = {k: br.get(k, 0.0) for k in REASONS}
        mfu = d.flops_per_step / step / d.world_size / (self.profile.peak_tflops * 1e12)
        pp = p.pipeline_parallel
        return Prediction(step_s=step, tokens_per_s=d.tokens_per_step / step, mfu=mfu, breakdown=breakdown,
                          detail={"kernel_path": kp.describe(), "cuda_graphs": kp.cuda_graphs, "microbatches": d.num_microbatches,
                                  "bubble_from": "simulator" if pp > 1 and simulate else "closed form" if pp > 1 else "none",
                                  "stage_layers": list(d.stage_layers)})

    def _layer_times(self, cfg: RunConfig, sh: Any, kp: Any, fam: Any, cp: int, per_node: int) -> "_LayerTimes":
        """One transformer layer's seconds per micro-batch on one rank: GEMMs, attention, elementwise (FP8 casts),
        TP collectives (what overlap hides), the CP ring's exposed hops, recompute, and the host's launches where
        they outlast the device."""
        prof, c, p = self.profile, self.c, cfg.parallel
        tp = p.tensor_parallel
        e, tokens, h = sh.e, sh.b * sh.s, sh.h  # tokens per micro-batch
        fl = self._flops(tp)
        layer_dense, layer_attn = fl["layer_dense"] * tokens / tp, fl["layer_attn"] * tokens / tp
        gemm_rate = prof.gemm_rate(layer_dense / 3 / 4 / 1e9) * 1e12
        t_gemm = layer_dense / gemm_rate
        t_attn = layer_attn / (prof.attention_rate(sh.s) * 1e12) if layer_attn > 0 else 0.0
        terms = fam.shapes.layer_activation_terms(sh, kp)
        bw = prof.memory_gbs.value * 1e9
        ew_factor = c.ew_factor if kp.layer == "compiled" else c.ew_factor_stock
        t_ew = ew_factor * _sum(terms) / bw
        if kp.fp8 != "off":
            gemm_inputs = e * tokens * h * 4 / max(tp if p.sequence_parallel else 1, 1) + 2 * fl["layer_dense"] / 12 / tp
            t_ew += getattr(c, f"fp8_cast_{kp.fp8}") * gemm_inputs / bw + c.fp8_layer_us * 1e-6
            t_gemm /= prof.fp8_gemm_speedup.value
        layer_dev = t_gemm + t_attn + t_ew

        # TP collectives per layer per micro-batch (forward 2, backward 2 of the [s, b, h] activation)
        t_tp_f = t_tp_b = 0.0
        if tp > 1:
            act = e * tokens * h
            if p.sequence_parallel:
                one = (prof.collective_seconds("all_gather", act, tp) + prof.collective_seconds("reduce_scatter", act, tp))
            else:
                one = prof.collective_seconds("all_reduce", act, tp)
            t_tp_f = t_tp_b = 2 * one * c.tp_comm_factor
            if kp.tp_overlap:
                t_tp_b = max(0.0, t_tp_b - c.tp_overlap * t_gemm / 3)

        # the CP ring's exposed K/V traffic per layer per micro-batch
        t_cp_f, t_cp_b = self.ring_seconds(sh, cp, t_attn, inter_node=tp * cp > per_node)

        # recompute, per layer per micro-batch (in backward)
        t_rc = 0.0
        if p.recompute == "full":
            t_rc = layer_dev / 3 + t_tp_f + t_cp_f
        elif p.recompute == "selective":
            if kp.selective == "mlp":
                mlp_flops = 2.0 * tokens * (h * sh.fc1_out + sh.ffn * h) / tp
                kept_none = _sum(fam.shapes.layer_activation_terms(dataclasses.replace(sh, recompute="none"), kp))
                t_rc = mlp_flops / gemm_rate + ew_factor * max(kept_none - _sum(terms), 0.0) / bw
            else:
                t_rc = t_attn / 3 + t_cp_f

        # host: a layer's launches show where they outlast its device time (none where the whole step replays as one
        # graph: workbench.backend.step_graph)
        host_key = "graphs" if kp.cuda_graphs else ("compiled" if kp.layer == "compiled" else "stock")
        host_layer = 0.0 if kp.cuda_graphs_impl == "step" else prof.host_us_per_layer[host_key].value * 1e-6
        dev_f = layer_dev / 3 + t_tp_f + t_cp_f
        dev_b = 2 * layer_dev / 3 + t_tp_b + t_cp_b + t_rc
        return _LayerTimes(device=layer_dev, tp=t_tp_f + t_tp_b, cp=t_cp_f + t_cp_b, recompute=t_rc,
                           forward=dev_f, backward=dev_b, host_forward=max(0.0, host_layer / 3 - dev_f),
                           host_backward=max(0.0, 2 * host_layer / 3 - dev_b))

    def _head_seconds(self, cfg: RunConfig, sh: Any, kp: Any, fam: Any) -> float:
        """The output layer and loss per micro-batch (last stage), forward and backward."""
        prof, c, tp = self.profile, self.c, cfg.parallel.tensor_parallel
        e, tokens, h = sh.e, sh.b * sh.s, sh.h
        fl = self._flops(tp)
        head_dense, head_attn = fl["head_dense"] * tokens / tp, fl["head_attn"] * tokens / tp
        bw = prof.memory_gbs.value * 1e9
        head_bytes = c.head_factor * fam.shapes.logits_bytes(sh, kp)[0]
        head_gemm_rate = prof.gemm_rate(head_dense / 3 / 1e9) * 1e12
        t_head = head_dense / head_gemm_rate + head_bytes / bw
        if head_attn > 0:
            t_head += head_attn / (prof.attention_rate(sh.s) * 1e12)
        if tp > 1:  # the vocab-parallel loss's small all-reduces and the head's input collective
            t_head += 2 * prof.collective_seconds("all_reduce", e * tokens * h, tp) * c.tp_comm_factor
        return t_head

    def _pipeline(self, cfg: RunConfig, d: Any, sh: Any, lt: "_LayerTimes", t_head: float, params_local: list[float],
                  cp: int, per_node: int, simulate: bool) -> tuple[dict[str, float], list[float], list[float], int]:
        """Per-stage micro-batch times (grad accumulation of the stage's parameters included), the step over the
        pipeline schedule, and the busiest stage's breakdown with the bubble; returns (breakdown, forward and
        backward seconds per stage, the busiest stage)."""
        prof, c, p = self.profile, self.c, cfg.parallel
        tp, pp, vpp, dp, micro = p.tensor_parallel, p.pipeline_parallel, p.vpp, d.data_parallel, d.num_microbatches
        bw = prof.memory_gbs.value * 1e9
        fwd, bwd, parts = [], [], []
        for r in range(pp):
            n = d.stage_layers[r]
            last = r == pp - 1
            ga = c.grad_accum_bytes * params_local[r] / bw
            fwd.append(n * (lt.forward + lt.host_forward) + (t_head / 3 if last else 0.0))
            bwd.append(n * (lt.backward + lt.host_backward) + (2 * t_head / 3 if last else 0.0) + ga)
            parts.append({"compute": n * lt.device + (t_head if last else 0.0) + ga, "tp_comm": n * lt.tp, "cp_comm": n * lt.cp,
                          "recompute": n * lt.recompute, "host": n * (lt.host_forward + lt.host_backward)})
        if pp == 1:
            step_pipe, busy, r_busy = micro * (fwd[0] + bwd[0]), micro * (fwd[0] + bwd[0]), 0
        else:
            stage_node = max(per_node // max(tp * cp * dp, 1), 1)  # stages per node (ranks: tp fastest, cp, dp, then pp)
            act = sh.e * sh.b * sh.s * sh.h / (tp if p.sequence_parallel else 1)
            lat = prof.collective_seconds("p2p", act, 2, inter_node=stage_node < pp and tp * cp * dp >= per_node)
            r_busy = max(range(pp), key=lambda r: fwd[r] + bwd[r])
            if simulate:
                step_pipe, busy = self._simulate(pp, micro, vpp, fwd, bwd, lat)
            else:
                busy = micro * (fwd[r_busy] + bwd[r_busy])
                step_pipe = busy * (1 + schedules.closed_form_bubble_fraction(None, pp, micro, vpp)) + 2 * (pp - 1) * lat
        br = {k: v * micro for k, v in parts[r_busy].items()}
        br["bubble"] = max(step_pipe - busy, 0.0)
        return br, fwd, bwd, r_busy

    def _dp_seconds(self, cfg: RunConfig, sh: Any, params_local: list[float], dpcp: int, per_node: int,
                    fwd_busy: float, bwd_busy: float) -> float:
        """Data parallel: the gradient reduce (and the distributed optimizer's parameter gather) over ``dpcp`` = DP x CP,
        exposed beyond what overlaps the busiest stage's backward (forward)."""
        prof, c, p = self.profile, self.c, cfg.parallel
        if dpcp <= 1:
            return 0.0
        across = p.tensor_parallel * dpcp > per_node
        grad = sh.grad_bytes * max(params_local)
        if p.distributed_optimizer:
            t_red = prof.collective_seconds("reduce_scatter", grad, dpcp, across)
            t_gat = prof.collective_seconds("all_gather", sh.e * max(params_local), dpcp, across)
        else:
            t_red, t_gat = prof.collective_seconds("all_reduce", grad, dpcp, across), 0.0
        if p.overlap_grad_reduce:
            t_red = max(0.0, t_red - c.dp_overlap * bwd_busy)
        if p.overlap_param_gather:
            t_gat = max(0.0, t_gat - c.dp_overlap * fwd_busy)
        return t_red + t_gat
