"""The training stacks people already use, with their defaults: HF Trainer, accelerate, Lightning (CPU, tiny Llama)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import graphamp
from tests.models import VOCAB, token_batch
from tests.training import relative_error

transformers = pytest.importorskip("transformers")

SEQ = 16
MAX_STEPS = 4


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, use_cache=False, pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def rewritten(model, amp_lists):
    ids = token_batch(seq=SEQ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on CPU is slow: the model is tiny
        return graphamp.rewrite(model, (), dict(input_ids=ids, labels=ids), amp_lists=amp_lists, progress=False)


class TokenDataset(torch.utils.data.Dataset):
    """Rows of `input_ids` and `labels` (plus a column the model does not take, for remove_unused_columns)."""

    def __init__(self, rows=16):
        self.rows = rows

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        ids = token_batch(batch=1, seq=SEQ, seed=i)[0]
        return {"input_ids": ids, "labels": ids.clone(), "source_text": f"row {i}"}


def trainer_arguments(tmp_path, **overrides):
    arguments = dict(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=MAX_STEPS, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, save_steps=2, logging_steps=1, disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**arguments, **overrides})


def collate_tensors(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels")}


# -- HF Trainer ----------------------------------------------------------------------------------------------------


def test_trainer_trains_evaluates_and_saves_a_checkpoint_from_pretrained_loads(tmp_path, fp16):
    model = llama()
    amp_model = rewritten(model, fp16)
    opt = graphamp.decorate(torch.optim.AdamW(amp_model.parameters(), lr=1e-3), fp16)
    trainer = transformers.Trainer(
        model=amp_model, args=trainer_arguments(tmp_path), train_dataset=TokenDataset(), eval_dataset=TokenDataset(),
        optimizers=(opt, None),
    )
    assert trainer.train().global_step == MAX_STEPS
    assert "eval_loss" in trainer.evaluate()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / f"checkpoint-{MAX_STEPS}")
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_trainer_first_step_reuses_the_capture_of_an_example_with_num_items_in_batch(tmp_path, bf16):
    """The Trainer passes `num_items_in_batch` (a float32 scalar tensor) to a model whose forward takes **kwargs:
    with it in the example, rewrite()'s capture serves the training steps instead of a second one."""
    ids = token_batch(batch=2, seq=SEQ)
    example = dict(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(float(ids.numel())))
    amp_model = graphamp.rewrite(llama(), (), example, amp_lists=bf16, progress=False)
    trainer = transformers.Trainer(
        model=amp_model, args=trainer_arguments(tmp_path, max_steps=2, save_strategy="no"),
        train_dataset=TokenDataset(), optimizers=(torch.optim.AdamW(amp_model.parameters(), lr=1e-3), None),
    )

    trainer.train()

    assert len([c for c in amp_model.captures if c.training]) == 1


def test_trainer_logs_the_true_gradient_norm_in_float16(tmp_path, fp16):
    model = llama()
    eager = copy.deepcopy(model)
    amp_model = rewritten(model, fp16)
    opt = graphamp.decorate(torch.optim.SGD(amp_model.parameters(), lr=0.0), fp16)
    trainer = transformers.Trainer(
        model=amp_model, args=trainer_arguments(tmp_path, max_steps=1, save_strategy="no"),
        train_dataset=TokenDataset(rows=2), optimizers=(opt, None), data_collator=collate_tensors,
    )  # one batch of both rows, whatever order the sampler draws them in
    trainer.train()
    logged = next(entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry)
    rows = collate_tensors([TokenDataset()[i] for i in range(2)])
    eager(**rows).loss.backward()
    true_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm=1e9)
    assert relative_error(torch.tensor(float(logged)), true_norm) < 2e-2


def test_trainer_resumes_from_its_checkpoint(tmp_path, bf16):
    amp_model = rewritten(llama(), bf16)
    opt = graphamp.decorate(torch.optim.AdamW(amp_model.parameters(), lr=1e-3), bf16)
    transformers.Trainer(
        model=amp_model, args=trainer_arguments(tmp_path), train_dataset=TokenDataset(), optimizers=(opt, None)
    ).train()
    resumed = transformers.Trainer(
        model=amp_model, args=trainer_arguments(tmp_path, max_steps=MAX_STEPS + 2), train_dataset=TokenDataset(),
        optimizers=(opt, None),
    )
    assert resumed.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{MAX_STEPS}")).global_step == MAX_STEPS + 2


def test_trainer_bf16_on_top_is_refused(tmp_path, bf16, fresh_accelerator_state):
    """Trainer(bf16=True) runs the model under torch.autocast: two AMP systems at once."""
    amp_model = rewritten(llama(), bf16)
    opt = graphamp.decorate(torch.optim.AdamW(amp_model.parameters(), lr=1e-3), bf16)
    trainer = transformers.Trainer(
        model=amp_model, args=trainer_arguments(tmp_path, bf16=True, max_steps=1, save_strategy="no"),
        train_dataset=TokenDataset(rows=2), optimizers=(opt, None),
    )
    with pytest.raises(graphamp.DoubleAmpError, match="two AMP systems"):
        trainer.train()


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one process-wide state; each test builds its own Accelerator."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(True)
    yield
    state.AcceleratorState._reset_state(True)


# -- accelerate ----------------------------------------------------------------------------------------------------


def test_accelerate_standard_loop_clips_true_gradients(fp16, fresh_accelerator_state):
    accelerate = pytest.importorskip("accelerate")
    model = llama()
    eager = copy.deepcopy(model)
    amp_model = rewritten(model, fp16)
    opt = graphamp.decorate(torch.optim.AdamW(amp_model.parameters(), lr=1e-3), fp16)
    accelerator = accelerate.Accelerator(cpu=True)
    prepared_model, prepared_opt = accelerator.prepare(amp_model, opt)
    rows = collate_tensors([TokenDataset()[i] for i in range(2)])

    accelerator.backward(prepared_model(**rows).loss)
    norm = accelerator.clip_grad_norm_(prepared_model.parameters(), max_norm=1e9)
    prepared_opt.step()
    prepared_opt.zero_grad()

    eager(**rows).loss.backward()
    true_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm=1e9)
    assert relative_error(norm, true_norm) < 2e-2
    assert opt.skipped_steps == 0 and not torch.equal(model.lm_head.weight, eager.lm_head.weight)


def test_accelerate_bf16_mixed_precision_on_top_is_refused(bf16, fresh_accelerator_state):
    accelerate = pytest.importorskip("accelerate")
    amp_model = rewritten(llama(), bf16)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    prepared = accelerator.prepare(amp_model)
    with pytest.raises(graphamp.DoubleAmpError, match="two AMP systems"):
        prepared(**collate_tensors([TokenDataset()[0]]))


# -- Lightning -----------------------------------------------------------------------------------------------------


def lightning_module(amp_model, amp_lists, automatic: bool):
    lightning = pytest.importorskip("lightning")

    class CausalLM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = amp_model
            self.automatic_optimization = automatic

        def training_step(self, rows, index):
            loss = self.model(**rows).loss
            if not automatic:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def configure_optimizers(self):
            return graphamp.decorate(torch.optim.AdamW(self.parameters(), lr=1e-3), amp_lists)

    return lightning, CausalLM()


def test_lightning_bf16_mixed_on_top_is_refused(bf16):
    """Lightning's precision="bf16-mixed" wraps training_step in torch.autocast: two AMP systems at once."""
    lightning, module = lightning_module(rewritten(llama(), bf16), bf16, automatic=True)
    trainer = lightning.Trainer(
        max_steps=1, accelerator="cpu", precision="bf16-mixed", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(TokenDataset(rows=2), batch_size=2, collate_fn=collate_tensors)
    with pytest.raises(graphamp.DoubleAmpError, match="two AMP systems"):
        trainer.fit(module, loader)


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_lightning_optimization_reaches_max_steps(automatic, fp16):
    model = llama()
    before = model.lm_head.weight.detach().clone()
    lightning, module = lightning_module(rewritten(model, fp16), fp16, automatic)
    trainer = lightning.Trainer(
        max_steps=MAX_STEPS, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=2, collate_fn=collate_tensors)
    trainer.fit(module, loader)
    assert trainer.global_step == MAX_STEPS
    assert not torch.equal(model.lm_head.weight, before)
