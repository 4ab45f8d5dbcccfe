"""The training stacks people use, with their defaults, train a rewritten model: HF Trainer, accelerate,
Lightning, PEFT (LoRA) and TRL's SFTTrainer (CPU, a tiny Llama). Each run keeps graphamp's matmuls low (the
decisions of the graphs that ran) and its losses close to the same stack's torch.autocast run on an FP32 twin.
Two AMP systems at once (the stack's own autocast on top of graphamp) are refused."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.fx import GraphModule

import graphamp
from conftest import CompiledCodeRecorder
import graphamp.frontends.named_backend as named_backend
from graphamp.passes.marks import mark_of
from models import VOCAB, token_batch
from training import relative_error

transformers = pytest.importorskip("transformers")

SEQ = 16
MAX_STEPS = 4
MATMULS = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul"}
LOSS_TOLERANCE = 1e-2  # bfloat16 against autocast's bfloat16, over a few steps
# graphamp's warnings that code ran eagerly, in float32, outside its graphs: none may pass unless a test expects it.
pytestmark = pytest.mark.filterwarnings("error:graphamp. :UserWarning")


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, use_cache=False, pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def matmul_dtypes(graphs) -> list[torch.dtype]:
    """The dtypes of the matmuls in those of `graphs` (graphamp's BackendGraphs) that ran, sub-graphs included."""
    return [
        node.meta["val"].dtype
        for graph in graphs if graph.runs
        for module in graph.graph_module.modules() if isinstance(module, GraphModule)
        for node in module.graph.nodes if getattr(node.target, "_opname", None) in MATMULS
    ]


def assert_matmuls_ran_in(dtype, graphs, at_least=7):
    """At least a Llama layer's matmuls (q, k, v, o, gate, up, down) ran in graphamp's graphs, all in `dtype`."""
    dtypes = matmul_dtypes(graphs)
    assert len(dtypes) >= at_least and set(dtypes) == {dtype}, dtypes


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


def logged_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def quiet_rewrite(model, amp_lists, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on CPU is slow: the model is tiny
        return graphamp.rewrite(model, amp_lists=amp_lists, **kwargs)


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one process-wide state; each test builds its own Accelerator."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(True)
    yield
    state.AcceleratorState._reset_state(True)


@pytest.fixture
def backends_by_name(monkeypatch):
    """The backends torch.compile(backend="graphamp") makes, recorded. They run the rewritten graphs as fx code:
    inductor would compile the same graphs for ~20 s per model on this CPU, and its kernels hide their dtypes."""
    made = []

    class Recorded(named_backend.AmpBackend):
        def __init__(self, config, inductor=True, *args, **kwargs):
            super().__init__(config, False, *args, **kwargs)
            made.append(self)

    monkeypatch.setattr(named_backend, "AmpBackend", Recorded)
    monkeypatch.setattr(named_backend, "_BACKENDS", {})  # one backend per options: none made before this test
    return made


# -- HF Trainer ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def autocast_trainer_losses(tmp_path_factory):
    """The losses of the Trainer with bf16=True (torch.autocast) on the FP32 Llama, the reference for bfloat16."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    trainer = transformers.Trainer(
        model=llama(), args=trainer_arguments(tmp_path_factory.mktemp("autocast"), bf16=True, save_strategy="no"),
        train_dataset=TokenDataset(),
    )
    trainer.train()
    AcceleratorState._reset_state(True)
    return logged_losses(trainer)


def test_trainer_trains_evaluates_and_saves_a_checkpoint_from_pretrained_loads(tmp_path, fp16):
    model = quiet_rewrite(llama(), fp16)
    opt = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-3), fp16)
    trainer = transformers.Trainer(
        model=model, args=trainer_arguments(tmp_path), train_dataset=TokenDataset(), eval_dataset=TokenDataset(4),
        optimizers=(opt, None),
    )
    assert trainer.train().global_step == MAX_STEPS
    assert "eval_loss" in trainer.evaluate()
    assert_matmuls_ran_in(torch.float16, graphamp.rewritten_graphs(model))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / f"checkpoint-{MAX_STEPS}")
    assert type(loaded) is type(model)
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_trainer_losses_match_the_trainer_with_autocast(tmp_path, bf16, autocast_trainer_losses):
    model = quiet_rewrite(llama(), bf16)
    trainer = transformers.Trainer(
        model=model, args=trainer_arguments(tmp_path, save_strategy="no"), train_dataset=TokenDataset()
    )
    trainer.train()
    losses = logged_losses(trainer)
    assert len(losses) == MAX_STEPS
    assert relative_error(torch.tensor(losses), torch.tensor(autocast_trainer_losses)) < LOSS_TOLERANCE
    assert_matmuls_ran_in(torch.bfloat16, graphamp.rewritten_graphs(model))


def test_trainer_steps_with_num_items_in_batch_reuse_the_graph_compiled_ahead(tmp_path, bf16):
    """The Trainer passes `num_items_in_batch` (a float32 scalar tensor) to a model whose forward takes **kwargs:
    with it in the example, the graph rewrite() compiled ahead serves every training step."""
    ids = token_batch(batch=2, seq=SEQ)
    # labels a tensor of its own, as the Trainer's batches have: dynamo guards on which inputs alias each other.
    example = dict(input_ids=ids, labels=ids.clone(), num_items_in_batch=torch.tensor(float(ids.numel())))
    model = quiet_rewrite(llama(), bf16, example_kwargs=example)
    trainer = transformers.Trainer(
        model=model, args=trainer_arguments(tmp_path, max_steps=2, save_strategy="no"), train_dataset=TokenDataset(),
    )
    trainer.train()
    graphs = graphamp.rewritten_graphs(model)
    assert len(graphs) == 1 and graphs[0].runs == 3  # the compile ahead, then two steps


def test_trainer_logs_the_true_gradient_norm_in_float16(tmp_path, fp16):
    model = llama()
    eager = copy.deepcopy(model)
    quiet_rewrite(model, fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.0), fp16)
    trainer = transformers.Trainer(
        model=model, args=trainer_arguments(tmp_path, max_steps=1, save_strategy="no"),
        train_dataset=TokenDataset(rows=2), optimizers=(opt, None), data_collator=collate_tensors,
    )  # one batch of both rows, whatever order the sampler draws them in
    trainer.train()
    logged = next(entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry)
    rows = collate_tensors([TokenDataset()[i] for i in range(2)])
    eager(**rows).loss.backward()
    true_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm=1e9)
    assert relative_error(torch.tensor(float(logged)), true_norm) < 2e-2


def skipping_first_step(model, fp16):
    """A decorated optimizer whose first step overflows (scale 2^40) and is skipped; the scale then drops to 1024."""
    return graphamp.decorate(torch.optim.SGD(model.parameters(), lr=1e-3), fp16, init_loss_scaling=2.0**40,
                             decr_ratio=2.0**-30, model=model)


def test_trainer_holds_the_lr_schedule_on_skipped_steps_with_applied_steps_scheduler(tmp_path, fp16):
    """As the Trainer's own fp16 path: `if not accelerator.optimizer_step_was_skipped: lr_scheduler.step()`."""
    model = quiet_rewrite(llama(), fp16)
    opt = skipping_first_step(model, fp16)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
    trainer = transformers.Trainer(
        model=model, args=trainer_arguments(tmp_path, max_steps=3, save_strategy="no"), train_dataset=TokenDataset(),
        optimizers=(opt, graphamp.AppliedStepsScheduler(schedule, opt)), data_collator=collate_tensors,
    )
    trainer.train()
    assert opt.skipped_steps == 1 and schedule.last_epoch == 2
    assert opt.param_groups[0]["lr"] == 1e-3 / 3


def test_accelerated_scheduler_holds_on_skipped_steps_with_applied_steps_scheduler(fp16, fresh_accelerator_state):
    accelerate = pytest.importorskip("accelerate")
    model = quiet_rewrite(llama(), fp16)
    opt = skipping_first_step(model, fp16)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
    accelerator = accelerate.Accelerator(cpu=True)
    model, prepared_opt, prepared_schedule = accelerator.prepare(
        model, opt, graphamp.AppliedStepsScheduler(schedule, opt)
    )
    rows = collate_tensors([TokenDataset()[i] for i in range(2)])
    lrs = []
    for step in range(2):
        accelerator.backward(model(**rows).loss)
        prepared_opt.step()
        prepared_schedule.step()
        prepared_opt.zero_grad()
        lrs.append(prepared_schedule.get_last_lr()[0])
    assert opt.skipped_steps == 1 and lrs == [1e-3, 1e-3 / 2]


def test_trainer_resumes_from_its_checkpoint(tmp_path, bf16):
    model = quiet_rewrite(llama(), bf16)
    opt = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-3), bf16)
    transformers.Trainer(
        model=model, args=trainer_arguments(tmp_path), train_dataset=TokenDataset(), optimizers=(opt, None)
    ).train()
    resumed = transformers.Trainer(
        model=model, args=trainer_arguments(tmp_path, max_steps=MAX_STEPS + 2), train_dataset=TokenDataset(),
        optimizers=(opt, None),
    )
    assert resumed.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{MAX_STEPS}")).global_step == MAX_STEPS + 2


def test_trainer_bf16_on_top_is_refused(tmp_path, bf16, fresh_accelerator_state):
    """Trainer(bf16=True) runs the model under torch.autocast: two AMP systems at once."""
    model = quiet_rewrite(llama(), bf16)
    trainer = transformers.Trainer(
        model=model, args=trainer_arguments(tmp_path, bf16=True, max_steps=1, save_strategy="no"),
        train_dataset=TokenDataset(rows=2),
    )
    with pytest.raises(graphamp.DoubleAmpError, match="two AMP systems"):
        trainer.train()


def test_trainer_trains_a_model_compiled_in_place_by_graphamps_name(
    tmp_path, autocast_trainer_losses, backends_by_name
):
    """No graphamp call in the loop: `model.compile(backend="graphamp")` (nn.Module.compile, in place, so the class,
    forward's signature and the checkpoint's keys stay the model's)."""
    model = llama()
    model.compile(backend="graphamp", options={"dtype": "bfloat16"})
    trainer = transformers.Trainer(
        model=model, args=trainer_arguments(tmp_path, save_steps=MAX_STEPS), train_dataset=TokenDataset()
    )
    trainer.train()
    assert relative_error(torch.tensor(logged_losses(trainer)), torch.tensor(autocast_trainer_losses)) < LOSS_TOLERANCE
    assert_matmuls_ran_in(torch.bfloat16, [graph for backend in backends_by_name for graph in backend.graphs])
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / f"checkpoint-{MAX_STEPS}")
    assert list(loaded.state_dict()) == list(model.state_dict())


def test_trainer_torch_compile_backend_graphamp_is_refused_by_accelerate(tmp_path, fresh_accelerator_state):
    """TrainingArguments(torch_compile_backend=...) goes through accelerate's TorchDynamoPlugin, which takes only the
    backends of its DynamoBackend enum (accelerate 1.x): the name never reaches torch. Rewrite the model, or compile
    it in place by name (the test above), instead."""
    arguments = trainer_arguments(tmp_path, torch_compile=True, torch_compile_backend="graphamp", save_strategy="no")
    with pytest.raises(ValueError, match="'GRAPHAMP' is not a valid DynamoBackend"):
        transformers.Trainer(model=llama(), args=arguments, train_dataset=TokenDataset(rows=2))


# -- accelerate ----------------------------------------------------------------------------------------------------


def test_accelerate_standard_loop_clips_true_gradients(fp16, fresh_accelerator_state):
    accelerate = pytest.importorskip("accelerate")
    model = llama()
    eager = copy.deepcopy(model)
    quiet_rewrite(model, fp16)
    opt = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-3), fp16)
    accelerator = accelerate.Accelerator(cpu=True)
    prepared_model, prepared_opt = accelerator.prepare(model, opt)
    rows = collate_tensors([TokenDataset()[i] for i in range(2)])

    accelerator.backward(prepared_model(**rows).loss)
    norm = accelerator.clip_grad_norm_(prepared_model.parameters(), max_norm=1e9)
    prepared_opt.step()
    prepared_opt.zero_grad()

    eager(**rows).loss.backward()
    true_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm=1e9)
    assert relative_error(norm, true_norm) < 2e-2
    assert opt.skipped_steps == 0 and not torch.equal(model.lm_head.weight, eager.lm_head.weight)
    assert_matmuls_ran_in(torch.float16, graphamp.rewritten_graphs(model))


def test_accelerate_bf16_mixed_precision_on_top_is_refused(bf16, fresh_accelerator_state):
    accelerate = pytest.importorskip("accelerate")
    model = quiet_rewrite(llama(), bf16)
    prepared = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
    with pytest.raises(graphamp.DoubleAmpError, match="two AMP systems"):
        prepared(**collate_tensors([TokenDataset()[0]]))


# -- Lightning -----------------------------------------------------------------------------------------------------


def lightning_module(model, make_optimizer, automatic=True):
    """A LightningModule whose training_step calls self(...), which calls the Llama."""
    lightning = pytest.importorskip("lightning")

    class CausalLM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.automatic_optimization = automatic

        def forward(self, rows):
            return self.model(**rows).loss

        def training_step(self, rows, index):
            loss = self(rows)
            if not automatic:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

    return lightning, CausalLM()


def lightning_fit(module, lightning, max_steps=MAX_STEPS, **trainer_options) -> torch.Tensor:
    """Fit `module` for MAX_STEPS steps; the losses its training_step returned (recorded by a callback, outside the
    code torch.compile may compile)."""
    losses = []

    class RecordLoss(lightning.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            losses.append(outputs["loss"].detach())

    trainer = lightning.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[RecordLoss()], **trainer_options,
    )
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=2, collate_fn=collate_tensors)
    trainer.fit(module, loader)
    assert trainer.global_step == max_steps
    return torch.stack(losses).float()


@pytest.fixture(scope="module")
def autocast_lightning_losses():
    """Lightning's losses with precision="bf16-mixed" (torch.autocast) on the FP32 Llama."""
    lightning, module = lightning_module(llama(), lambda parameters: torch.optim.AdamW(parameters, lr=1e-3))
    return lightning_fit(module, lightning, precision="bf16-mixed")


def test_lightning_bf16_mixed_on_top_is_refused(bf16):
    """Lightning's precision="bf16-mixed" wraps training_step in torch.autocast: two AMP systems at once."""
    lightning, module = lightning_module(quiet_rewrite(llama(), bf16), lambda p: torch.optim.AdamW(p, lr=1e-3))
    with pytest.raises(graphamp.DoubleAmpError, match="two AMP systems"):
        lightning_fit(module, lightning, precision="bf16-mixed", max_steps=1)


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_lightning_optimization_matches_autocast(automatic, bf16, autocast_lightning_losses):
    model = quiet_rewrite(llama(), bf16)
    lightning, module = lightning_module(
        model, lambda parameters: graphamp.decorate(torch.optim.AdamW(parameters, lr=1e-3), bf16), automatic
    )
    losses = lightning_fit(module, lightning)
    assert relative_error(losses, autocast_lightning_losses) < LOSS_TOLERANCE
    assert_matmuls_ran_in(torch.bfloat16, graphamp.rewritten_graphs(model))


def test_lightning_fit_of_a_module_compiled_by_graphamps_name_keeps_mixed_precision(
    autocast_lightning_losses, backends_by_name
):
    """`trainer.fit(torch.compile(lit_module, backend="graphamp"))`: Lightning unwraps the compiled module and
    compiles its forward and training_step with the same backend (lightning.pytorch.utilities.compile), so the
    matmuls stay low at precision="32-true"."""
    lightning, module = lightning_module(llama(), lambda parameters: torch.optim.AdamW(parameters, lr=1e-3))
    losses = lightning_fit(torch.compile(module, backend="graphamp", options={"dtype": "bfloat16"}), lightning)
    assert relative_error(losses, autocast_lightning_losses) < LOSS_TOLERANCE
    assert_matmuls_ran_in(torch.bfloat16, [graph for backend in backends_by_name for graph in backend.graphs])


# -- PEFT ----------------------------------------------------------------------------------------------------------


def lora_llama(use_cache: bool, amp_lists=None):
    """A tiny Llama with LoRA adapters, and its FP32 twin; with `amp_lists`, the base model is rewritten before
    peft wraps it (graphamp refuses a PeftModel: its generate() and merge reach the model inside)."""
    peft = pytest.importorskip("peft")
    base = llama()
    base.config.use_cache = use_cache
    eager_base = copy.deepcopy(base)
    if amp_lists is not None:
        graphamp.rewrite(base, amp_lists=amp_lists)

    def with_adapters(model):
        torch.manual_seed(1)  # the same adapters on both
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.02)  # not PEFT's zeros: the adapters change the loss from step 0
        return model

    return with_adapters(base), with_adapters(eager_base)


def adapter_losses(model, autocast: bool, steps=3) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        ids = token_batch(2, SEQ, seed=step)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("use_cache", [False, True], ids=["no_cache", "use_cache"])
def test_peft_lora_trains_with_its_adapters_low_and_autocasts_losses(bf16, use_cache):
    model, eager = lora_llama(use_cache, bf16)
    losses = adapter_losses(model, autocast=False)
    assert relative_error(torch.tensor(losses), torch.tensor(adapter_losses(eager, autocast=True))) < LOSS_TOLERANCE
    graphs = graphamp.rewritten_graphs(model.get_base_model())
    assert_matmuls_ran_in(torch.bfloat16, graphs, at_least=7 + 4)  # the layer's and the adapters' A and B
    adapters = {
        mark_of(node).module for graph in graphs for node in graph.graph_module.graph.nodes
        if getattr(node.target, "_opname", None) == "linear" and "lora_" in mark_of(node).module
    }
    assert "model.layers.0.self_attn.q_proj.lora_A.default" in adapters  # the rewritten base model's own paths


def test_peft_black_module_written_against_the_base_models_path_runs_in_float32():
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16", custom_black_modules=["lm_head"])
    model, _ = lora_llama(use_cache=False, amp_lists=lists)
    ids = token_batch(2, SEQ)
    model(input_ids=ids, labels=ids)
    head = [
        node.meta["val"].dtype for graph in graphamp.rewritten_graphs(model.get_base_model())
        for node in graph.graph_module.graph.nodes
        if getattr(node.target, "_opname", None) == "linear" and mark_of(node).module.endswith("lm_head")
    ]
    assert head == [torch.float32]


# -- TRL -----------------------------------------------------------------------------------------------------------


def word_tokenizer():
    """A tokenizer over the tiny Llama's vocabulary, built in memory (no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(1, VOCAB)} | {"<pad>": 0}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="<pad>", eos_token="t2"
    )


def sft_trainer(tmp_path, model, **config):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"input_ids": [token_batch(1, SEQ, seed=i)[0].tolist() for i in range(16)]})
    arguments = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to="none", use_cpu=True,
        logging_steps=1, save_strategy="no", disable_tqdm=True, learning_rate=1e-3, **config,
    )
    return trl.SFTTrainer(model=model, args=arguments, train_dataset=rows, processing_class=word_tokenizer())


def test_sft_trainer_trains_with_low_matmuls_and_autocasts_losses(tmp_path, bf16, fresh_accelerator_state):
    """With bf16=False (graphamp is the AMP); TRL turns gradient checkpointing on by default: kept in the graph.

    TRL computes the loss with its own fused LM head (ChunkedLogProbFunction: chunked `torch.mm(..., out=)`), which
    dynamo runs eagerly: graphamp's eager policy runs its forward matmul low by the lists, as autocast does. Its
    backward, outside any AMP context, reads the float32 hidden states graphamp's graph returns (autocast's are
    bfloat16): the open part of issue 39 (outputs in autocast's dtype)."""
    model = llama()
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    trainer = sft_trainer(tmp_path / "graphamp", model, bf16=False)
    with CompiledCodeRecorder() as recorder:
        trainer.train()
    reference = sft_trainer(tmp_path / "autocast", eager, bf16=True)
    reference.train()
    chunked_forward = [c for c in recorder.calls_of("mm") if c.out_dtypes == (torch.bfloat16,)]
    assert chunked_forward  # TRL's LM head, in its forward
    assert trainer.args.gradient_checkpointing
    assert relative_error(torch.tensor(logged_losses(trainer)), torch.tensor(logged_losses(reference))) < LOSS_TOLERANCE
    graphs = graphamp.rewritten_graphs(model)
    assert_matmuls_ran_in(torch.bfloat16, graphs)  # the decoder layer's seven
    modules = {
        getattr(mark_of(node), "module", None) for graph in graphs for node in graph.graph_module.graph.nodes
    }
    assert "lm_head" not in modules


def test_sft_trainer_defaults_turn_autocast_on_and_are_refused(tmp_path, bf16, fresh_accelerator_state):
    """SFTConfig's bf16 defaults to True: its autocast on top of graphamp is two AMP systems; pass bf16=False."""
    model = graphamp.rewrite(llama(), amp_lists=bf16)
    with pytest.raises(graphamp.DoubleAmpError, match="two AMP systems"):
        sft_trainer(tmp_path, model).train()
