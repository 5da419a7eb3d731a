"""Executes one rank's pipeline action list for one optimizer step, over torch.distributed P2P.

F runs a virtual stage's forward on a micro-batch (stage 0 reads the input ids)
and keeps its input and output for B; B backpropagates the received output
gradient (the last stage: loss / n_targets of the WHOLE global batch, exactly as
without pipelining). Activations are dropped as soon as their backward has run.

Communication. The rank's program (`megaft.pipeline.comm_plan.plan`) groups each
run of adjacent SEND/RECV actions (e.g. `SEND_F(s, i), RECV_B(s, j)` between a
forward and a backward, Megatron's send_forward_recv_backward) into ONE
`dist.batch_isend_irecv`, posted right after the compute before it; where NCCL
needs it the plan posts receives one batch earlier still. Receives are waited for
only right before the compute that consumes them; sends are not waited for until
the end of the step, so they overlap the following compute. Shapes come from the
micro-batch size, sequence length and model width (no shape handshakes).

Why message matching is safe:
* gloo matches by (peer, tag); every message has its own tag, (direction, sending
  stage, micro-batch), so any posting order pairs the right buffers.
* NCCL ignores tags and matches the sends of one ordered rank pair with the
  receives of that pair in posting order. Every rank posts its sends and its
  receives in list order (the plan moves receives earlier as a block, never past
  each other), and `validate` (rule 4) checks that for every ordered pair of ranks
  the schedule lists the sends in the same order as the peer lists the receives.
  Ops in one batch form one NCCL group, so a SEND and a RECV with the same peer in
  one batch cannot block each other, and `comm_plan.nccl_problems` replays the
  plan under NCCL's rendezvous semantics (no buffering, one stream per rank): every
  built schedule passes; on NCCL the runtime refuses a custom one that does not.
The runtime never reorders compute, so a schedule that passes `validate` runs as written.

Wire dtype. Activations and their gradients travel in the autocast's compute dtype under
bf16/fp16 (`wire_dtype`: half fp32's bytes, as Megatron sends them in its params dtype) and in
fp32 otherwise, so fp32 runs send exactly what they computed. A received tensor is cast back
to fp32 (ACT_DTYPE) before the stage uses it, so the stage computes as it would have on fp32
input: the only difference from the single process is one rounding to the compute dtype at
each stage boundary, forward and backward. A mixture's router statistics ride in the same
message as their fp32 bits (`_message`), never rounded.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaft.models.moe.router import RouterSums, router_terms, wire_size
from megaft.models.moe.stats import StepRouterStats
from megaft.pipeline.actions import Action, ActionKind, message_of, rank_of
from megaft.pipeline.comm_plan import nccl_problems, plan
from megaft.pipeline.schedules import build_schedule
from megaft.pipeline.stage import StageModel

K = ActionKind
# A stage's input (and so the gradient it sends back) is fp32: the residual stream's dtype under
# autocast with fp32 weights, and what a stage received before the wire followed the compute dtype.
ACT_DTYPE = torch.float32


def wire_dtype(autocast: Callable, device) -> torch.dtype:
    """The dtype pipeline messages travel in under `autocast` (a function returning the run's
    autocast context): its compute dtype when it enables one on `device`, else fp32."""
    kind = torch.device(device).type
    with autocast():
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    return torch.float32


def _stats_len(extra: int, wire: torch.dtype) -> int:
    """Wire elements of `extra` fp32 router statistics sent as their bits in `wire` elements."""
    return extra * 4 // wire.itemsize


def _message(t: torch.Tensor, tail: Optional[torch.Tensor], wire: torch.dtype) -> torch.Tensor:
    """One send buffer: `t` rounded to `wire`, then (a mixture's) fp32 `tail` bit-cast to `wire`
    elements, so counts and sums arrive exact whatever the wire dtype."""
    buf = t.detach().to(wire).contiguous()
    if tail is None:
        return buf
    return torch.cat([buf.reshape(-1), tail.to(torch.float32).contiguous().view(wire)])


def _tag(direction: str, stage: int, mb: int) -> int:
    return ((stage * 2 + (direction == "B")) << 20) + mb


class _StepState:
    """What one step keeps between actions, keyed by (stage, micro-batch)."""

    def __init__(self, inputs, labels, n_targets: int, shape, autocast: Callable, device, docs=None,
                 router_weight: float = 0.0, head: Optional[Callable] = None, router_valid: Optional[list] = None):
        self.inputs, self.labels, self.n_targets, self.docs = inputs, labels, n_targets, docs
        self.router_valid = router_valid  # per micro-batch: the positions the router statistics count
        self.shape, self.autocast, self.device = shape, autocast, device
        self.wire = wire_dtype(autocast, device)  # what this step's messages travel in
        # Mixtures of experts: each message also carries the micro-batch's router statistics (RouterSums.wire)
        # summed over the stages so far, forward; the totals come back with the gradients (megaft.models.moe).
        self.router_weight = router_weight
        self.head = head  # head(mb, logits) -> the micro-batch's loss sum, instead of the token loss
        self.router: dict[tuple, Optional[RouterSums]] = {}  # this stage's statistics, for its backward
        self.tails: dict[tuple, torch.Tensor] = {}  # (direction, stage, mb) -> the statistics a send carries
        self.totals: dict[tuple, torch.Tensor] = {}  # the last stage's totals, for its backward
        self.received: dict[tuple, tuple[torch.Tensor, list]] = {}  # message -> (buffer, works to wait)
        self.stage_in: dict[tuple, Optional[torch.Tensor]] = {}
        self.stage_out: dict[tuple, torch.Tensor] = {}
        self.input_grads: dict[tuple, torch.Tensor] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.wait_s = 0.0  # time blocked on peers (receives, final drain): this rank's bubble

    def take(self, message: tuple) -> torch.Tensor:
        """The received tensor of `message`, waiting for its batch only now."""
        buf, works = self.received.pop(message)
        t0 = time.perf_counter()
        for work in works:
            work.wait()
        self.wait_s += time.perf_counter() - t0
        return buf

    def left_behind(self) -> bool:
        return bool(self.received or self.stage_in or self.stage_out or self.input_grads or self.tails
                    or self.router or self.totals)


class PipelineRuntime:
    """One rank's executor: `train_step` for a schedule; `forward_loss` and
    `forward_logits` (stage after stage) for evaluation and generation."""

    def __init__(self, model: StageModel, grid, schedule: str, microbatches: int, vpp: int = 1,
                 wrap_compute: Optional[Callable[[Callable, str], Callable]] = None):
        self.model, self.grid = model, grid
        self.pp, self.m = grid.pp_size, microbatches
        full = build_schedule(schedule, self.pp, microbatches, vpp)
        self.actions = full[grid.pp_rank]
        self.program = plan(full, self.pp, vpp)[grid.pp_rank]  # same plan on every rank
        if dist.get_backend(grid.pp_group) == "nccl":
            self._check_nccl(schedule, full, vpp)
        self.last = model.last_stage
        self.stride = grid.pp_stride  # global rank distance between pp neighbours
        self.base = grid.rank - grid.pp_rank * self.stride
        self._sends: list[tuple[list[dist.Work], list[torch.Tensor]]] = []  # in-flight sends, buffers
        self.wait_s = 0.0  # seconds the last train_step spent blocked on peers (benchmarks/pipeline)
        self.extra = wire_size(model.cfg)  # router statistics appended to every message (0: dense)
        self.moe_layers = sum(model.cfg.is_moe(i) for i in range(model.cfg.n_layers))
        self.router_stats = StepRouterStats.of(model)  # the last train_step's (megaft.models.moe.metrics)
        # The action (or batch of sends/receives) train_step is executing, None between steps: the
        # hang report's "pipeline action" (megaft.launch.trace.CollectiveTrace.action_of).
        self.current_action: Optional[Action | list[Action]] = None
        # Compute kinds -> handlers (STYLE §3: a short loop dispatching each action).
        self._compute = {K.F: self._forward, K.B: self._backward}
        if wrap_compute is not None:  # e.g. phase timing: wrap_compute(handler, "forward" | "backward")
            self._compute = {K.F: wrap_compute(self._forward, "forward"), K.B: wrap_compute(self._backward, "backward")}

    def _check_nccl(self, name: str, full, vpp: int) -> None:
        problems = nccl_problems(full, self.pp, vpp)
        if problems:
            raise ValueError(f"pipeline schedule {name!r} (pp={self.pp}, vpp={vpp}, micro-batches={self.m}) would "
                             f"hang on NCCL: {problems[0]}; fix: a built-in schedule (gpipe, 1f1b, "
                             f"interleaved), or gloo")

    def _peer(self, stage: int) -> int:
        return self.base + rank_of(stage, self.pp) * self.stride

    def peer_rank(self, stage: int) -> int:
        """Global rank holding virtual `stage` in this rank's pp group."""
        return self._peer(stage)

    # -- communication -------------------------------------------------------------

    def _post(self, batch: list[Action], state: _StepState) -> None:
        """Post one batch of sends and receives as a single batch_isend_irecv."""
        ops, is_send, recvs, sends = [], [], [], []
        for a in batch:
            direction, sender, mb = message_of(a)
            tag, key = _tag(direction, sender, mb), (a.stage, mb)
            if a.kind.is_send:
                src = state.stage_out[key] if a.kind is K.SEND_F else state.input_grads.pop(key)
                buf = _message(src, state.tails.pop((direction, a.stage, mb)) if self.extra else None, state.wire)
                ops.append(dist.P2POp(dist.isend, buf, self._peer(sender + (1 if direction == "F" else -1)),
                                      self.grid.pp_group, tag))
                sends.append(buf)
            else:
                size = math.prod(state.shape) + _stats_len(self.extra, state.wire) if self.extra else state.shape
                buf = torch.empty(size, dtype=state.wire, device=state.device)
                ops.append(dist.P2POp(dist.irecv, buf, self._peer(sender), self.grid.pp_group, tag))
                recvs.append(((direction, sender, mb), buf))
            is_send.append(a.kind.is_send)
        works = dist.batch_isend_irecv(ops)
        # gloo gives one work per op; NCCL coalesces the batch into one work, which then
        # stands for every op of the batch (gloo hangs on a work waited twice, NCCL does not).
        per_op = len(works) == len(ops)
        recv_works = [w for w, s in zip(works, is_send) if not s] if per_op else [works] * len(recvs)
        for (message, buf), work in zip(recvs, recv_works):
            state.received[message] = (buf, [work] if per_op else work)
        if sends:  # send buffers stay alive until their sends complete
            send_works = [w for w, s in zip(works, is_send) if s] if per_op else works
            self._sends = [(ws, ts) for ws, ts in self._sends if not all(w.is_completed() for w in ws)]
            self._sends.append((send_works, sends))

    def _drain(self) -> None:
        for works, _ in self._sends:
            for work in works:
                work.wait()
        self._sends = []

    # -- compute -------------------------------------------------------------------

    def _split(self, buf: torch.Tensor, shape) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A received message: the tensor, and the router statistics it carries (None when dense)."""
        if not self.extra:
            return buf, None
        n = math.prod(shape)
        tail = buf[n:] if buf.dtype == torch.float32 else buf[n:].clone().view(torch.float32)  # clone: 4-byte aligned
        return buf[:n].view(shape), tail

    def _forward(self, s: int, mb: int, state: _StepState) -> None:
        incoming = None
        if s == 0:
            x, state.stage_in[(s, mb)] = state.inputs[mb].to(state.device), None
        else:
            x, incoming = self._split(state.take(("F", s - 1, mb)), state.shape)
            x = x.to(ACT_DTYPE).requires_grad_()  # fp32 wire: the buffer itself, as before
            state.stage_in[(s, mb)] = x
        last_labels = state.labels[mb].to(state.device) if s == self.last and state.head is None else None
        with state.autocast():
            out = self.model(s, x, last_labels, state.docs[mb] if state.docs else None,
                             seq_len=state.inputs[mb].shape[1],
                             router_valid=state.router_valid[mb] if state.router_valid else None)
            if s == self.last and state.head is not None:  # the logits' own objective (preference pairs)
                out = state.head(mb, out)
        state.stage_out[(s, mb)] = out
        if self.extra:
            self._forward_router(s, mb, incoming, state)
        if s == self.last:
            state.loss_sum += out.detach().double()

    def _forward_router(self, s: int, mb: int, incoming: Optional[torch.Tensor], state: _StepState) -> None:
        """Add this stage's router statistics to the ones received and pass them on; the last
        stage keeps the totals (its backward and every earlier stage's need them)."""
        sums = self.model.router_sums()
        total = torch.zeros(self.extra, device=state.device) if incoming is None else incoming.clone()
        if sums is not None:
            total[:-1] += sums.wire()[:-1]
            total[-1] = sums.tokens  # the micro-batch's tokens: every MoE layer routes the same
        state.router[(s, mb)] = sums
        if sums is not None:  # its counts for the metrics
            self.router_stats.add(router_terms(sums, total, self.moe_layers, self.model.cfg, self.model.global_counts),
                                  values=False)
        if s == self.last:
            state.totals[(s, mb)] = total
            self.router_stats.add(router_terms(None, total, self.moe_layers, self.model.cfg,  # the values
                                               self.model.global_counts))
        else:
            state.tails[("F", s, mb)] = total

    def _router_term(self, s: int, mb: int, total: torch.Tensor, state: _StepState) -> Optional[torch.Tensor]:
        """This stage's share of the micro-batch's router losses, weighted like its token loss."""
        sums = state.router.pop((s, mb))
        if sums is None:
            return None
        return router_terms(sums, total, self.moe_layers, self.model.cfg,
                            self.model.global_counts).local * state.router_weight

    def _backward(self, s: int, mb: int, state: _StepState) -> None:
        out, x = state.stage_out.pop((s, mb)), state.stage_in.pop((s, mb))
        total = None
        if s == self.last:
            if self.extra:
                total = state.totals.pop((s, mb))
                term = self._router_term(s, mb, total, state)
                out = out if term is None else out + term
            (out / state.n_targets).backward()
        else:
            grad, total = self._split(state.take(("B", s + 1, mb)), out.shape)
            term = self._router_term(s, mb, total, state) if self.extra else None
            if term is None:
                out.backward(grad.to(out.dtype))
            else:
                torch.autograd.backward([out, term / state.n_targets], [grad.to(out.dtype), None])
        if x is not None:
            state.input_grads[(s, mb)] = x.grad
            if self.extra:
                state.tails[("B", s, mb)] = total
        del out, x  # the graph and saved activations of (s, mb) go now

    def train_step(self, inputs: list[torch.Tensor], labels: list[torch.Tensor], n_targets: int,
                   autocast: Callable, docs: Optional[list] = None, router_weight: float = 0.0,
                   head: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
                   router_valid: Optional[list] = None) -> torch.Tensor:
        """Forward and backward of every micro-batch; gradients accumulate in the params.
        Returns this rank's summed token loss (fp64; zero unless it holds the last stage).
        `docs`: each micro-batch's packed-document layout (megaft.models.attention.documents.Docs), or None.
        `router_weight`: a mixture of experts' router losses' weight, in token-loss units
        (n_targets / the global batch's micro-batches: megaft.models.moe.metrics). `head(mb, logits)`:
        the last stage's loss sum of micro-batch `mb` from this tp rank's vocabulary slice of its
        logits, instead of the token loss against `labels` (a preference objective's). `router_valid`:
        per micro-batch [rows, seq] True at the positions a mixture of experts' router statistics
        count (a preference batch's tokens, not its padding), None: all."""
        state = _StepState(inputs, labels, n_targets, self.model.activation_shape(*inputs[0].shape), autocast,
                           self.grid.device, docs, router_weight, head, router_valid)
        self.router_stats = StepRouterStats.of(self.model)
        for item in self.program:
            self.current_action = item
            if isinstance(item, list):
                self._post(item, state)
            else:
                self._compute[item.kind](item.stage, item.microbatch, state)
        t0 = time.perf_counter()
        self._drain()
        self.current_action = None
        self.wait_s = state.wait_s + time.perf_counter() - t0
        assert not state.left_behind(), "schedule left work behind"
        return state.loss_sum

    # -- forward only (evaluation, generation) ------------------------------------------

    def _through_stages(self, ids: torch.Tensor, labels: Optional[torch.Tensor], autocast: Callable,
                        docs=None, after: Optional[Callable[[], None]] = None):
        """Run `ids` through every stage, one after the other; the last stage's output
        (loss sum with labels, else local logits) on its rank, None elsewhere. `docs`: the
        batch's packed documents; `after()` runs after each of this rank's stages."""
        dev, model = self.grid.device, self.model
        shape, wire = model.activation_shape(*ids.shape), wire_dtype(autocast, dev)
        result = None
        for s in model.stages:
            if s == 0:
                x = ids.to(dev)
            else:
                x = torch.empty(shape, dtype=wire, device=dev)
                dist.recv(x, self._peer(s - 1), self.grid.pp_group, tag=_tag("F", s - 1, 0))
                x = x.to(ACT_DTYPE)
            with autocast():
                out = model(s, x, labels.to(dev) if s == self.last and labels is not None else None, docs,
                            seq_len=ids.shape[1])
            if after is not None:
                after()
            if s == self.last:
                result = out
            else:
                buf = _message(out, None, wire)
                self._sends.append(([dist.isend(buf, self._peer(s + 1), self.grid.pp_group,
                                                tag=_tag("F", s, 0))], [buf]))
        self._drain()
        return result

    @torch.no_grad()
    def router_counts(self, ids: torch.Tensor, autocast: Callable, docs=None) -> torch.Tensor:
        """Top-k assignments per expert of a micro-batch over this rank's MoE layers (summed over
        them and the ranks holding its tokens): a forward through every stage, no schedule
        (moe.aux_scope=global_batch; the stages' counts add up over pp)."""
        counts = torch.zeros(self.model.cfg.n_experts, device=self.grid.device)

        def collect() -> None:
            sums = self.model.router_sums()
            if sums is not None:
                counts.add_(sums.counts.sum(0))

        self._through_stages(ids, None, autocast, docs, after=collect)
        return counts

    @torch.no_grad()
    def forward_loss(self, ids: torch.Tensor, labels: torch.Tensor, autocast: Callable) -> torch.Tensor:
        """Forward-only pass of one batch through every stage (no schedule: stage after
        stage); the summed token loss on the last stage's rank, zero elsewhere."""
        out = self._through_stages(ids, labels, autocast)
        loss = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        return loss + out.double() if out is not None else loss

    @torch.no_grad()
    def forward_logits(self, ids: torch.Tensor, autocast: Callable, docs=None) -> Optional[torch.Tensor]:
        """This tp rank's vocabulary slice of the logits of `ids` [batch, seq, V/tp] on
        the rank of the last stage (None on the other pp ranks); `docs` as in train_step."""
        out = self._through_stages(ids, None, autocast, docs)
        return None if out is None else out[:, :ids.shape[1]]
