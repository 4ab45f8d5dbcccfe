"""What the training and numerics tests share (CPU and CUDA): a few-step training loop, relative error."""

from __future__ import annotations

import copy
import io
import pickle

import torch
from torch.fx import GraphModule
from torch.torch_version import TorchVersion

import graphamp


# Where dynamo's behaviour differs between the torch versions graphamp supports (>= 2.11), a test says which it needs.
TORCH_BEFORE_2_13 = TorchVersion(torch.__version__) < "2.13"


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


def grads(model) -> list[torch.Tensor]:
    """Copies of the model's parameters' gradients, in parameter order."""
    return [p.grad.clone() for p in model.parameters()]


MATMULS = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul"}


def matmul_dtypes(model) -> list[torch.dtype]:
    """The dtypes of the matmuls in the graphs graphamp rewrote for `model` that ran (sub-graphs included)."""
    return [
        node.meta["val"].dtype
        for graph in graphamp.rewritten_graphs(model) if graph.runs
        for module in graph.graph_module.modules() if isinstance(module, GraphModule)
        for node in module.graph.nodes if getattr(node.target, "_opname", None) in MATMULS
    ]


def rewritten_regression(amp_lists):
    """A rewritten Regression (tests/models.py), its weights from seed 0."""
    from models import Regression, regression_batch

    torch.manual_seed(0)
    return graphamp.rewrite(Regression(), regression_batch(0), amp_lists=amp_lists)


def rewritten_regression_and_eager(amp_lists):
    """A rewritten Regression and its FP32 copy taken before the rewrite (the same weights)."""
    from models import Regression, regression_batch

    torch.manual_seed(0)
    model = Regression()
    eager = copy.deepcopy(model)
    return graphamp.rewrite(model, regression_batch(0), amp_lists=amp_lists), eager


def through_torch_save(obj):
    """`obj` saved with torch.save and loaded back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# The three ways a model (or a model with its optimizer) is copied.
COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch_save": through_torch_save,
}
