"""Executes one rank's pipeline action list for one optimizer step, over torch.distributed P2P.

F runs a virtual stage's forward on a micro-batch (stage 0 reads the input ids)
and keeps its input and output for B; B backpropagates the received output
gradient (the last stage: loss / n_targets of the WHOLE global batch, exactly as
without pipelining); SEND_*/RECV_* move activations and their gradients with
isend/irecv between the ranks of this rank's pp group. Shapes come from the
micro-batch size, sequence length and model width (no shape handshakes); every
message has its own tag, (direction, sending stage, micro-batch). Sends are
non-blocking and waited for when done or at the end of the step; receives block,
as the schedules' deadlock check assumes (see megaft.pipeline.schedules).
Activations are dropped as soon as their backward has run.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaft.pipeline.actions import ActionKind, rank_of
from megaft.pipeline.schedules import build_schedule
from megaft.pipeline.stage import StageModel

K = ActionKind
WIRE_DTYPE = torch.float32  # activations and their gradients travel in fp32


def _tag(direction: str, stage: int, mb: int) -> int:
    return ((stage * 2 + (direction == "B")) << 20) + mb


class PipelineRuntime:
    """One rank's executor: `train_step` for a schedule, `forward_loss` for evaluation."""

    def __init__(self, model: StageModel, grid, schedule: str, microbatches: int, vpp: int = 1):
        self.model, self.grid = model, grid
        self.pp, self.m = grid.pp_size, microbatches
        self.actions = build_schedule(schedule, self.pp, microbatches, vpp)[grid.pp_rank]
        self.last = model.last_stage
        self.stride = grid.tp_size * grid.dp_size  # global rank distance between pp neighbours
        self.base = grid.rank - grid.pp_rank * self.stride
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def _peer(self, stage: int) -> int:
        return self.base + rank_of(stage, self.pp) * self.stride

    def _send(self, tensor: torch.Tensor, stage_to: int, tag: int) -> None:
        buf = tensor.detach().to(WIRE_DTYPE).contiguous()
        work = dist.isend(buf, dst=self._peer(stage_to), group=self.grid.pp_group, tag=tag)
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((work, buf))

    def _recv(self, shape, stage_from: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=WIRE_DTYPE, device=self.grid.device)
        dist.irecv(buf, src=self._peer(stage_from), group=self.grid.pp_group, tag=tag).wait()
        return buf

    def _drain(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    def train_step(self, inputs: list[torch.Tensor], labels: list[torch.Tensor], n_targets: int,
                   autocast: Callable) -> torch.Tensor:
        """Forward and backward of every micro-batch; gradients accumulate in the params.
        Returns this rank's summed token loss (fp64; zero unless it holds the last stage)."""
        dev, model = self.grid.device, self.model
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        shape = model.activation_shape(*inputs[0].shape)
        received: dict[tuple, torch.Tensor] = {}
        stage_in: dict[tuple, Optional[torch.Tensor]] = {}
        stage_out: dict[tuple, torch.Tensor] = {}
        input_grads: dict[tuple, torch.Tensor] = {}
        for s, kind, mb in self.actions:
            key = (s, mb)
            if kind is K.RECV_F:
                received[("F",) + key] = self._recv(shape, s - 1, _tag("F", s - 1, mb))
            elif kind is K.RECV_B:
                received[("B",) + key] = self._recv(shape, s + 1, _tag("B", s + 1, mb))
            elif kind is K.F:
                if s == 0:
                    x = inputs[mb].to(dev)
                    stage_in[key] = None
                else:
                    x = received.pop(("F",) + key).requires_grad_()
                    stage_in[key] = x
                with autocast():
                    out = model(s, x, labels[mb].to(dev) if s == self.last else None)
                stage_out[key] = out
                if s == self.last:
                    loss_sum += out.detach().double()
            elif kind is K.SEND_F:
                self._send(stage_out[key], s + 1, _tag("F", s, mb))
            elif kind is K.B:
                out, x = stage_out.pop(key), stage_in.pop(key)
                if s == self.last:
                    (out / n_targets).backward()
                else:
                    out.backward(received.pop(("B",) + key).to(out.dtype))
                if x is not None:
                    input_grads[key] = x.grad
            elif kind is K.SEND_B:
                self._send(input_grads.pop(key), s - 1, _tag("B", s, mb))
        self._drain()
        assert not (received or stage_in or stage_out or input_grads), "schedule left work behind"
        return loss_sum

    @torch.no_grad()
    def forward_loss(self, ids: torch.Tensor, labels: torch.Tensor, autocast: Callable) -> torch.Tensor:
        """Forward-only pass of one batch through every stage (no schedule: stage after
        stage); the summed token loss on the last stage's rank, zero elsewhere."""
        dev, model = self.grid.device, self.model
        shape = model.activation_shape(*ids.shape)
        loss = torch.zeros((), dtype=torch.float64, device=dev)
        for s in model.stages:
            x = ids.to(dev) if s == 0 else self._recv(shape, s - 1, _tag("F", s - 1, 0))
            with autocast():
                out = model(s, x, labels.to(dev) if s == self.last else None)
            if s == self.last:
                loss += out.double()
            else:
                self._send(out, s + 1, _tag("F", s, 0))
        self._drain()
        return loss
