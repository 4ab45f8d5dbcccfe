"""Loss code that branches on a data-dependent size (HF's `if label_index.size(0) > 0`): export_program's CaptureError
gives the recipe that works (the loss outside, from the logits); rewrite() trains it around a graph break, and with
fullgraph=True dynamo's error names the line."""

import copy
import inspect

import pytest
import torch
from torch import nn

import graphamp
from training import relative_error


class LossOnlyOverLabelledTokens(nn.Module):
    """HF's `if label_index.size(0) > 0` in DeBERTa's / wav2vec2's loss: a branch on a data-dependent size."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x, labels):
        logits = self.head(x)
        labelled = (labels >= 0).nonzero().view(-1)
        if labelled.size(0) > 0:
            return nn.functional.cross_entropy(logits[labelled], labels[labelled])
        return logits.sum() * 0


def batch():
    return torch.randn(6, 8), torch.tensor([0, -1, 2, 3, -1, 1])


def test_exporting_data_dependent_loss_code_names_the_loss_outside_recipe(bf16):
    with pytest.raises(graphamp.CaptureError, match="compute the loss from the logits"):
        graphamp.export_program(LossOnlyOverLabelledTokens(), batch(), amp_lists=bf16)


def test_rewritten_data_dependent_loss_code_trains_around_a_graph_break(bf16, seeded):
    model, (x, labels) = LossOnlyOverLabelledTokens(), batch()
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (x, labels), amp_lists=bf16)

    loss = model(x, labels)
    loss.backward()
    expected = reference(x, labels)
    expected.backward()

    graphs = graphamp.rewritten_graphs(model)
    assert len(graphs) == 2  # the head before the branch, the loss after it
    assert graphs[0].report.decisions[graphamp.Decision.WHITE] == 1
    assert relative_error(loss, expected) < 2e-2
    assert relative_error(model.head.weight.grad, reference.head.weight.grad) < 2e-2


def test_rewritten_with_fullgraph_the_branch_is_dynamos_error_naming_its_line(bf16):
    source, first = inspect.getsourcelines(LossOnlyOverLabelledTokens.forward)
    line = first + next(i for i, text in enumerate(source) if "if labelled.size(0) > 0" in text)
    with pytest.raises(torch._dynamo.exc.UserError, match="data-dependent") as caught:
        graphamp.rewrite(LossOnlyOverLabelledTokens(), batch(), amp_lists=bf16, fullgraph=True)
    assert f"test_capture_loss_recipe.py:{line}" in str(caught.value)
