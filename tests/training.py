"""What the training and numerics tests share (CPU and CUDA): a few-step training loop, relative error."""

from __future__ import annotations

import torch


def relative_error(a, b) -> float:
    """||a - b|| / ||b|| in float64, for tensors or numbers."""
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return ((a - b).norm() / b.norm()).item()


def loss_of(out) -> torch.Tensor:
    """The HF loss when the model computes one, else a scalar of the output."""
    return out.loss if hasattr(out, "loss") else out.float().pow(2).mean()


def hf_loss(out, _target) -> torch.Tensor:
    """The loss of a training batch whose model computes it (HF models given labels)."""
    return out.loss


def adamw(lr):
    return lambda parameters: torch.optim.AdamW(parameters, lr=lr)


def sgd(lr, momentum=0.0):
    return lambda parameters: torch.optim.SGD(parameters, lr=lr, momentum=momentum)


def mean_loss_of_first_and_last_epoch(net, optimizer, batches, loss_fn, steps: int) -> tuple[float, float]:
    """`steps` steps cycling over `batches` of (args, kwargs, target); a decorated optimizer minimizes the loss."""
    losses = []
    for step in range(steps):
        args, kwargs, target = batches[step % len(batches)]
        loss = loss_fn(net(*args, **kwargs), target)
        optimizer.zero_grad()
        if hasattr(optimizer, "minimize"):  # graphamp.decorate's wrapper: loss scaling, skip on inf/NaN
            optimizer.minimize(loss)
        else:
            loss.backward()
            optimizer.step()
        losses.append(loss.detach())
    losses = torch.stack(losses).tolist()  # one host sync, after the loop
    epoch = len(batches)
    return sum(losses[:epoch]) / epoch, sum(losses[-epoch:]) / epoch
