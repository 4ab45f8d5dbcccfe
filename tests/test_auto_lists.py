"""graphamp.auto_mixed_precision: the most ops low while the loss stays within a stated tolerance.

A 2-layer GPT-2 in bfloat16 (fast on CPU). Each tolerance is checked by a run of its own: rewrite() with the
lists found, against the FP32 model.
"""

import copy

import pytest
import torch

import graphamp
from graphamp.policy.lists import AutoMixedPrecisionLists
from models import PooledSum, gpt2, large_inputs, token_batch
from training import relative_error


@pytest.fixture(scope="module")
def model_and_batch():
    torch.manual_seed(0)
    ids = token_batch()
    return gpt2(), {"input_ids": ids, "labels": ids}  # two blocks: with one, the loose search moves no op to white


def loss_error(model, batch, lists):
    # No example inputs: the one compile is the no_grad call's (examples would compile a grad-mode graph first).
    amp_model = graphamp.rewrite(copy.deepcopy(model), amp_lists=lists)
    with torch.no_grad():
        return relative_error(amp_model(**batch).loss, model(**batch).loss)


@pytest.fixture(scope="module")
def loose(model_and_batch, bf16):
    model, batch = model_and_batch
    return graphamp.auto_mixed_precision(model, (), batch, tolerance=1e-3, amp_lists=bf16)


@pytest.fixture(scope="module")
def tight(model_and_batch, bf16, loose):
    """A tolerance of half the given lists' error: the loose search's start_error, the figure a rewrite() with the
    given lists gives (2.41e-5 both), without compiling the model once more to measure it."""
    model, batch = model_and_batch
    return graphamp.auto_mixed_precision(model, (), batch, tolerance=loose.start_error / 2, amp_lists=bf16)


def test_a_loose_tolerance_runs_more_ops_low_and_keeps_it(model_and_batch, loose):
    model, batch = model_and_batch

    assert loose.moved_to_white and not loose.moved_to_black
    assert loose.low_nodes > loose.start_low_nodes
    assert loose.error <= 1e-3
    assert loss_error(model, batch, loose.amp_lists) == pytest.approx(loose.error, rel=1e-3, abs=1e-7)


def test_a_tolerance_below_the_given_lists_error_moves_ops_to_black_and_keeps_it(model_and_batch, tight):
    model, batch = model_and_batch
    found = tight

    assert found.start_error > found.tolerance
    assert found.moved_to_black
    assert loss_error(model, batch, found.amp_lists) <= found.tolerance


def test_no_op_kept_fp32_by_the_search_could_run_low_within_the_tolerance(model_and_batch, tight):
    model, batch = model_and_batch
    found = tight

    for entry in found.moved_to_black:
        lowered = found.amp_lists.with_changes(white=[entry])
        assert loss_error(model, batch, lowered) > found.tolerance, entry


def test_the_lists_found_write_to_a_folder_that_reads_back_the_same(tmp_path, loose):
    folder = loose.write(tmp_path / "auto")

    read_back = AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder)

    assert {(e.name, e.color) for e in read_back.entries()} == {(e.name, e.color) for e in loose.amp_lists.entries()}
    for entry in loose.moved_to_white:
        assert "auto: low-precision error" in (folder / "white.txt").read_text().split(entry, 1)[1].splitlines()[0]


def test_an_op_that_overflows_float16_stays_fp32_whatever_the_tolerance():
    torch.manual_seed(0)
    model = PooledSum()

    found = graphamp.auto_mixed_precision(model, large_inputs(8, 256, 16), tolerance=1.0)

    assert "linear" in found.moved_to_black
    assert found.error <= 1.0


def test_tolerance_must_be_positive(model_and_batch):
    model, batch = model_and_batch

    with pytest.raises(graphamp.ArgumentError, match="tolerance=0"):
        graphamp.auto_mixed_precision(model, (), batch, tolerance=0)
