"""A training step captured in one CUDA graph: forward, backward and the optimizer, replayed.

An emulated FP4 step launches hundreds of small kernels from Python (quantize passes, GEMMs,
their amaxes), and the host falls behind the GPU (benchmarks/NOTES.md: a d12 NVFP4 step keeps
the GPU busy 63 of its 119 ms compiled). A CUDA graph replays the whole step's launches with no
Python between them. What makes an FP4 step capturable:

- its random bits: every seed of the dense FP4 layers lives in the QuantContext's
  ``nn.seeds.SeedTable``, which setting ``context.tick`` refills before each replay, so step t
  draws step t's bits (an int seed would be frozen into the graph at its capture value);
- no host synchronization inside the step, and no int seed: experts keep the routing's counts
  on the device (BF16 ones on torch._grouped_mm; FP4 ones whose recipe quantizes each GEMM's
  activations for all experts in one launch, sized from device counts, their seeds table slots:
  nn.gemms.counts_stay_on_device; the others read the counts on the host and are not captured),
  and operand statistics read values back (CUDA refuses the sync at capture); weight dither's
  seed is a slot too, and every seed drawn without a table refuses to
  be captured (the compiled custom ops of nn.ops likewise; with one they read it like the eager path);
- static tensors: the batch is copied into the graph's own input tensors, the optimizer is built
  with ``capturable=True`` (its step count and learning rate on the device), and gradients are
  set to None before capture, so each replay writes them afresh.

The recipe in force is the one at capture: a late switch to BF16 (``bf16_after``) needs a new
capture after the switch.

    step = GraphedStep(loss_fn, optimizer, context, inputs)  # warms up, then captures
    loss = step(tick, *batch)                                 # copies, refills seeds, replays

``autocast=torch.bfloat16`` runs loss_fn under autocast as a training step would, without
autocast's cast cache (whose cached weight casts would be captured once and go stale).

With ``step=False`` the graph holds forward and backward only: the trainer (train.loop, setting
``cuda_graph``) clips, checks for divergence and steps its optimizers eagerly after each replay,
so a diverged step still moves no weight, and the warm-up changes nothing but the gradients.
The gradients then live in the graph's memory: a caller must not set them to None.

Public: ``GraphedStep``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..nn.gemms import QuantContext
from ..nn.seeds import SeedTable


class GraphedStep:
    """``loss_fn(*inputs)`` -> loss, backward, ``optimizer.step()``, captured once and replayed.

    ``warmup`` eager steps (ticks 0 .. warmup-1, on a side stream, as capture requires) run
    first and train the model like any step; the capture itself runs nothing. Calls then go on
    from any tick: ``step(tick, *batch)`` returns the step's loss (a device tensor, read it when
    needed)."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor],
                 optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], context: QuantContext,
                 inputs: tuple[torch.Tensor, ...], *, warmup: int = 3, step: bool = True,
                 autocast: torch.dtype | None = None):
        if not all(t.is_cuda for t in inputs):
            raise ValueError("a CUDA graph replays CUDA work: the inputs must be CUDA tensors")
        if context.seeds is None:
            context.seeds = SeedTable(inputs[0].device)
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        self.context, self.loss_fn, self.step, self.autocast = context, loss_fn, step, autocast
        self.inputs = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for tick in range(warmup):
                context.tick = tick
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        for opt in self.optimizers:  # gradients allocated by the graph, written afresh each replay
            opt.zero_grad(set_to_none=True)
        try:
            with torch.cuda.graph(self.graph):
                self.loss = self._body()
        except RuntimeError as exc:
            raise RuntimeError("the training step could not be captured: it synchronizes with the host or "
                               "draws a seed a graph would freeze (experts that read the routing's counts on the "
                               "host, operand statistics, a seed without a SeedTable): "
                               f"{exc}") from exc

    def _body(self) -> torch.Tensor:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        if self.autocast is None:
            loss = self.loss_fn(*self.inputs)
        else:  # without autocast's cast cache: a cached cast would be captured once and replayed stale
            with torch.autocast("cuda", dtype=self.autocast, cache_enabled=False):
                loss = self.loss_fn(*self.inputs)
        loss.backward()
        if self.step:
            for opt in self.optimizers:
                opt.step()
        return loss.detach()

    def __call__(self, tick: int, *batch: torch.Tensor) -> torch.Tensor:
        for static, new in zip(self.inputs, batch, strict=True):
            static.copy_(new, non_blocking=True)
        self.context.tick = tick  # the seed table's one copy, ordered before the replay
        self.graph.replay()
        return self.loss
