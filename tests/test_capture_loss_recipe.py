"""A CaptureError on data-dependent loss code gives the recipe that works: the loss outside, from the logits."""

import pytest
import torch
from torch import nn

import graphamp


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


def test_data_dependent_loss_code_names_the_loss_outside_recipe(bf16):
    x, labels = torch.randn(6, 8), torch.tensor([0, -1, 2, 3, -1, 1])
    with pytest.raises(graphamp.CaptureError, match="compute the loss from the logits"):
        graphamp.rewrite(LossOnlyOverLabelledTokens(), (x, labels), amp_lists=bf16)
