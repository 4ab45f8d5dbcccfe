"""The private torch APIs graphamp calls that have no public form, each with why and the test that pins it.

New private uses go here, so that the next torch release breaks one file (tests/test_architecture.py refuses a
private torch name anywhere else). Each is pinned by a test (named below) that fails if torch changes what graphamp
relies on. Every one was checked on torch 2.13 and on 2.11, the oldest pyproject.toml allows (the whole suite on
both: 2.13.0+cpu and 2.11.0+cu130 on a CPU, 2026-11-28).

Left where they are, as torch documents them as the way to do the thing: the foreach kernels, GradScaler's own two
and underscore ATen op names (training/ and the graphs), each with why in test_architecture.py's
PRIVATE_TORCH_NAMES_ALLOWED.

Private names that stay as strings where they are used (the test reads names, not strings): the `_compiled_call_impl`
and `_call_impl` that frontends/rewrite.py installs on the model as nn.Module.compile does, the LR scheduler's
`_opt_called` that training/optimizer.py leaves out of copies, and the "torch._subclasses.fake_tensor" logger.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch._dispatch.python
import torch._dynamo.exc
import torch._guards
import torch._ops
import torch._subclasses
import torch.utils._foreach_utils
import torch.utils._python_dispatch as _python_dispatch
import torch.utils._pytree
from torch import nn
from torch.fx.experimental import _config as shapes_config
from torch.nn.modules import module as module_globals

__all__ = [
    "disabled_torch_function_impl", "make_wrapper_subclass", "torch_function_off", "view_base",
    "BackendCompilerFailed", "DATA_ATTR", "DYNAMIC_DIM_MARKERS", "ENTER_AUTOCAST", "EXIT_AUTOCAST", "FakeTensor",
    "FakeTensorMode", "HigherOrderOperator", "NormBase", "OpOverload", "OpOverloadPacket", "SET_GRAD_ENABLED",
    "TorchDispatchMode", "all_op_schemas",
    "call_module_with_hooks", "compile_with_inductor", "composable_apis_on", "cpu_runs_bfloat16_natively",
    "default_checkpoint_context_fn", "detect_fake_mode", "dispatch_mode_makes_dynamo_run_eagerly", "dynamo_stance",
    "dynamo_traces_this_thread", "enable_python_dispatcher", "fused_step_takes_loss_scaling", "generate_code_now",
    "global_module_hooks", "group_by_device_and_dtype", "inductor_modes", "inductor_options", "mark_dim_dynamic",
    "module_buffers",
    "never_a_frame_of_its_own", "op_schema", "op_schemas_named", "outside_every_mode", "pytree", "qualified_op_name",
    "recompile_limit", "recording_functorch_transforms", "register_sub_graph", "rerun_checkpointed_region_as",
    "resolve_overload",
    "set_dynamo_config", "size_oblivious_tracing", "sparse_values", "tensor_version", "this_thread_traces",
    "trace_inside_make_fx",
    "tracing_context", "tracing_on_fake_tensors", "wrap_autocast_regions",
]

# -- trees of values ---------------------------------------------------------------------------------------------

# torch's pytree (tree_leaves, tree_map, tree_map_only, tree_unflatten): how torch itself flattens a call's arguments
# and outputs; torch 2.13 has no public module for it. Pinned by every test that rewrites a model, first
# tests/test_backend.py (test_master_gradients_are_fp32_and_close_to_eager).
pytree = torch.utils._pytree

# -- ops and their schemas ---------------------------------------------------------------------------------------

# The types of an ATen op's overload (aten.add.Tensor), its packet (aten.add) and a higher-order op (cond,
# wrap_with_autocast): what a graph node's target is. Pinned by tests/test_cast_pass.py (all of it).
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
HigherOrderOperator = torch._ops.HigherOrderOperator


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """An op overload's schema: its arguments (names, defaults, which it writes or aliases) and returns. Pinned by
    tests/test_cast_pass.py (test_in_place_write_makes_an_earlier_cast_stale)."""
    return op._schema


def qualified_op_name(op: OpOverload | OpOverloadPacket) -> str:
    """'aten::add' for aten.add.Tensor and for aten.add. Pinned by tests/test_eager_policy.py
    (test_a_rewritten_model_under_a_dispatch_mode_runs_low_and_keeps_its_graphs)."""
    return op._schema.name if isinstance(op, OpOverload) else op._qualified_op_name


# The schema of every op registered now, custom ops included. Pinned by tests/test_bad_input.py
# (test_a_typo_of_a_registered_custom_op_gets_a_suggestion).
all_op_schemas = torch._C._jit_get_all_schemas
# op_schemas_named('namespace::name'): the op's schemas, one per overload; [] if none is registered. Pinned by
# tests/test_bad_input.py (test_an_op_spelled_as_node_target_prints_it_is_that_overload).
op_schemas_named = torch._C._jit_get_schemas_for_operator


# resolve_overload('aten::add', *args, **kwargs): the overload name ('Tensor', '' for default) the dispatcher picks for
# a call of the packet. Pinned by tests/test_eager_policy.py (test_an_overload_entry_decides_its_overload_eagerly).
resolve_overload = torch._C._jit_resolve_packet


# -- modes and fake tensors --------------------------------------------------------------------------------------

# The base of a mode that sees every ATen call (graphamp's kernel recorder). Pinned by tests/test_cast_pass.py
# (test_casts_executed_by_a_cnn_are_no_more_than_torch_autocast).
TorchDispatchMode = _python_dispatch.TorchDispatchMode
# The tensors and the mode torch traces with: shapes and dtypes, no data. Pinned by tests/test_cast_pass.py
# (test_node_meta_val_matches_what_executes); no test makes a FakeTensorMode of its own (the backend called outside
# dynamo).
FakeTensor, FakeTensorMode = torch._subclasses.FakeTensor, torch._subclasses.FakeTensorMode
detect_fake_mode = torch._guards.detect_fake_mode
# Runs an op's Python decompositions and meta kernels, as torch's tracers do, on the cast pass's fake values. Pinned by
# tests/test_cast_pass.py (test_node_meta_val_matches_what_executes).
enable_python_dispatcher = torch._dispatch.python.enable_python_dispatcher


@contextlib.contextmanager
def outside_every_mode():
    """Run the block outside the caller's dispatch modes (a recorder, a fake mode) and torch-function modes (the eager
    policy). torch keeps pre-dispatch modes (an export's tracer) on one stack for the process, reached only by the
    thread that traces: another thread takes its own modes off and leaves that stack to the exporting one. Pinned by
    tests/test_fewer_casts.py (test_the_probes_answer_for_this_cpu) and tests/test_eager_parity.py
    (test_a_torch_export_in_another_thread_leaves_a_rewritten_models_calls_low)."""
    if torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PreDispatch):
        modes_off = _python_dispatch._disable_current_modes()
    else:
        modes_off = _this_threads_dispatch_modes_off()
    with modes_off, torch._C.DisableTorchFunction():
        yield


@contextlib.contextmanager
def _this_threads_dispatch_modes_off():
    modes = [_python_dispatch._pop_mode() for _ in range(_python_dispatch._len_torch_dispatch_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            _python_dispatch._push_mode(mode)


@contextlib.contextmanager
def torch_function_off():
    """Run the block with no torch-function handling: graphamp's graphs run their fx code without the eager policy's
    mode (or any other) seeing each ATen call; dynamo traced the modes, and inductor's kernels skip them too. Pinned by
    tests/test_eager_policy.py (test_auto_cast_decides_like_the_cast_pass)."""
    with torch._C.DisableTorchFunction():
        yield


# A tensor subclass that presents one dtype over another's storage (low_storage.py), as torchao's float8 tensors: a
# wrapper with no storage of its own, torch-function handling off. Pinned by tests/test_low_outputs.py.
disabled_torch_function_impl = torch._C._disabled_torch_function_impl


def make_wrapper_subclass(cls: type, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An instance of the wrapper subclass `cls` with `like`'s shape, strides, offset and device, presenting `dtype`.
    Pinned by tests/test_low_outputs.py."""
    return torch.Tensor._make_wrapper_subclass(
        cls, like.shape, strides=like.stride(), storage_offset=like.storage_offset(), dtype=dtype,
        device=like.device, requires_grad=False,
    )


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor `tensor` is a view of (autograd's record), or None. Pinned by tests/test_output_aliases.py."""
    return tensor._base


def tracing_on_fake_tensors() -> bool:
    """Whether a FakeTensorMode is active: torch is tracing (torch.cond's branches, make_fx), not running the model;
    graphamp's eager policy leaves traced calls alone. Pinned by tests/test_eager_policy.py
    (test_auto_cast_decides_like_the_cast_pass[regions])."""
    return _get_dispatch_mode(_FAKE_MODE) is not None


# bound once: the eager policy asks it on every call it may cast
_get_dispatch_mode, _FAKE_MODE = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE


# tracing_context(): dynamo's context for the frame it compiles (its fake mode, each input tensor's symbolic context);
# None outside. Pinned by tests/test_backend.py (test_dynamic_batch_sizes_reuse_one_symbolic_graph).
tracing_context = torch._guards.TracingContext.try_get


# -- dynamo ------------------------------------------------------------------------------------------------------

def set_dynamo_config(**settings) -> None:
    """Set dynamo's process-wide settings (torch._dynamo.config; torch.compiler.config holds none of graphamp's). Pinned
    by tests/test_seams.py (test_lstm_and_gru_run_their_matmuls_low: allow_rnn) and tests/test_backend.py
    (test_a_hook_registered_after_the_first_call_runs_on_the_next: skip_nnmodule_hook_guards)."""
    for name, value in settings.items():
        setattr(torch._dynamo.config, name, value)


def recompile_limit() -> int:
    """How many graphs dynamo compiles for one code object before it runs the frame eagerly. Pinned by
    tests/test_dynamic_shapes.py
    (test_past_dynamos_recompile_limit_graphamp_warns_once_and_the_call_runs_low_eagerly)."""
    return torch._dynamo.config.recompile_limit


def dynamo_stance() -> str:
    """The stance torch.compiler.set_stance(...) put dynamo in ("default" unless the user set one). Pinned by
    tests/test_eager_policy.py (test_a_call_under_a_forced_eager_stance_runs_low_and_the_warning_names_the_stance)."""
    return torch._dynamo.eval_frame._stance.stance


# What torch.compile raises when a backend raises: graphamp takes its own typed error back out of it. Pinned by
# tests/test_integrations.py (test_accelerate_bf16_mixed_precision_on_top_is_refused).
BackendCompilerFailed = torch._dynamo.exc.BackendCompilerFailed


def mark_dim_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Ask the next capture to keep `tensor`'s size at `dim` symbolic where the model allows (torch.export reads it
    too). Pinned by tests/test_capture.py
    (test_a_program_exported_with_dynamic_shapes_takes_new_shapes_and_matches_the_original)."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


# Where mark_dim_dynamic records its marks, in the tensor's __dict__. Pinned by the test that pins mark_dim_dynamic.
DYNAMIC_DIM_MARKERS = ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking")


def dispatch_mode_makes_dynamo_run_eagerly() -> bool:
    """Whether a TorchDispatchMode is active that makes dynamo run a frame eagerly (FlopCounterMode, a memory tracker;
    not one whose `ignore_compile_internals()` is True), and, after one such call, mark the frame's compiled code
    skipped for good. Pinned by tests/test_eager_policy.py
    (test_a_rewritten_model_under_a_dispatch_mode_runs_low_and_keeps_its_graphs)."""
    on_stack = getattr(_python_dispatch, "any_torch_dispatch_mode_on_stack", None)
    if on_stack is not None and getattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", False):
        return on_stack()  # what dynamo's convert_frame asks on torch 2.13
    return _python_dispatch.is_in_any_mode_without_ignore_compile_internals()


@torch._dynamo.assume_constant_result
def dynamo_traces_this_thread() -> bool:
    """Whether this thread is tracing (dynamo, torch.export), asked where torch.compiler.is_compiling() says True: that
    flag is process-wide, True in every thread while any one compiles. Dynamo takes the result as a constant, so a
    function that asks it traces to nothing. Pinned by tests/test_eager_policy.py
    (test_calls_while_another_thread_compiles_run_low)."""
    return torch._guards.TracingContext.try_get() is not None


def never_a_frame_of_its_own(function):
    """Tell dynamo never to compile `function`'s frame, nor the frames it calls, when it runs eagerly inside a compiled
    call (code between two graphs calls it); dynamo still inlines it where it traces a call to it. The eager policy's
    __torch_function__ runs on every torch call there: compiled, it and its helpers would make a graph each (its code's
    exec strategy: SKIP for it and for what it calls). Pinned by tests/test_dynamic_shapes.py
    (test_dynamic_true_serves_every_batch_and_length_from_one_graph)."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(function.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return function


# -- lowering dynamo's graph to ATen -----------------------------------------------------------------------------

_THREADS_LOWERING_WITH_THE_FLAG: set[int] = set()  # threading.get_ident() of each, while it is up


@contextlib.contextmanager
def recording_functorch_transforms():
    """functorch's pre-dispatch wrappers (`_add_batch_dim`, `_vmap_increment_nesting`) record themselves in the graph
    only while torch says it is exporting; traced otherwise, they would batch the tracer's own tensors. That flag is
    process-wide: `exporting_elsewhere_for_graphamp()` tells other threads it is not theirs. Pinned by
    tests/test_call_cost_passes.py (test_grouping_heads_keeps_a_vmap_in_the_same_graph) and tests/test_eager_parity.py
    (test_compiling_a_graph_without_a_vmap_leaves_torchs_process_wide_exporting_flag_down)."""
    exporting = torch.compiler._is_exporting_flag
    torch.compiler._is_exporting_flag = True
    _THREADS_LOWERING_WITH_THE_FLAG.add(threading.get_ident())
    try:
        yield
    finally:
        _THREADS_LOWERING_WITH_THE_FLAG.discard(threading.get_ident())
        torch.compiler._is_exporting_flag = exporting


def this_thread_traces() -> bool:
    """Whether this thread traces (a torch.export): torch.compiler.is_exporting() is one flag for the process, up while
    any thread exports; the exporting thread traces under a TracingContext of its own. Pinned by
    tests/test_eager_parity.py (test_a_torch_export_in_another_thread_leaves_a_rewritten_models_calls_low)."""
    return torch._guards.TracingContext.try_get() is not None


def exporting_elsewhere_for_graphamp() -> bool:
    """Whether torch.compiler.is_exporting() is True only because graphamp lowers a graph with a vmap in another
    thread (not a torch.export of this thread's)."""
    return bool(_THREADS_LOWERING_WITH_THE_FLAG) and threading.get_ident() not in _THREADS_LOWERING_WITH_THE_FLAG


def trace_inside_make_fx(function):
    """`function` traced to its own ATen graph from inside a make_fx trace, as higher-order ops trace their bodies.
    Pinned by tests/test_seams.py (test_a_custom_autograd_function_is_one_node_with_its_bodies_cast_by_the_lists)."""
    from torch._higher_order_ops.utils import reenter_make_fx

    return reenter_make_fx(function)


def register_sub_graph(mode, prefix: str, graph_module: torch.fx.GraphModule) -> None:
    """Register a body traced by trace_inside_make_fx on the graph the proxy `mode` traces, under a fresh name starting
    with `prefix`. Pinned by the test that pins trace_inside_make_fx."""
    from torch._higher_order_ops.utils import unique_graph_id

    _, name = unique_graph_id(mode, prefix=prefix)
    mode.tracer.root.register_module(name, graph_module)


def size_oblivious_tracing():
    """While a graph is traced: torch answers "is this size 1?" with "no" instead of adding a guard (its
    backed_size_oblivious, as its ONNX exporter does; torch has it since 2.7). Pinned by tests/test_capture.py
    (test_a_program_exported_with_dynamic_shapes_takes_new_shapes_and_matches_the_original)."""
    return shapes_config.patch(backed_size_oblivious=True)


def default_checkpoint_context_fn(body: torch.fx.GraphModule, context_fn) -> None:
    """Give the body of a checkpointed region (dynamo's tag_activation_checkpoint) the context_fn that tracing it to
    ATen reads, where dynamo set none (it sets one only for a user's context_fn). Pinned by
    tests/test_activation_checkpointing.py (test_checkpoint_pattern_saves_what_autocast_saves_with_torch_checkpoint)."""
    body.meta.setdefault("_checkpoint_context_fn", context_fn)


# The calls dynamo writes into its graph where a `with torch.autocast(...)` region starts and ends. Pinned by
# tests/test_fp32_regions.py (test_matmul_inside_autocast_disabled_region_runs_fp32) and tests/test_integrations.py
# (test_accelerate_bf16_mixed_precision_on_top_is_refused).
ENTER_AUTOCAST, EXIT_AUTOCAST = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
# The call dynamo writes into its graph where a `torch.no_grad()`/`enable_grad()` block starts and ends. Pinned by
# tests/test_capture.py (test_a_weight_cast_made_under_no_grad_is_not_shared_with_the_grad_mode_code_after_it).
SET_GRAD_ENABLED = torch._C._set_grad_enabled
# What dynamo writes into its graph for `tensor.data`. Pinned by tests/test_module_edits.py
# (test_a_write_through_data_in_forward_reaches_the_model).
DATA_ATTR = torch._C._autograd._get_data_attr


def wrap_autocast_regions(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torch.export's own pass: each autocast region (ENTER_AUTOCAST ... EXIT_AUTOCAST) becomes a wrap_with_autocast op
    around its sub-graph (torch has it since 2.5). Pinned by tests/test_fp32_regions.py
    (test_matmul_inside_autocast_disabled_region_runs_fp32)."""
    from torch._export.passes.replace_autocast_with_hop_pass import replace_autocast_with_hop_pass

    return replace_autocast_with_hop_pass(graph_module, None)[0]


# -- compiling ---------------------------------------------------------------------------------------------------

def generate_code_now(graph_module: torch.fx.GraphModule) -> None:
    """Make a GraphModule's Python code now: torch defers it to the first call, and a `forward` taken before is a stub
    that calls the module. Pinned by tests/test_module_hooks.py
    (test_a_global_forward_hook_runs_at_every_module_call_as_in_eager)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(graph_module)


def compile_with_inductor(graph_module: torch.fx.GraphModule, example_inputs: list, mode: str | None,
                          config_patches: dict):
    """Inductor's compile of an ATen graph, with torch.compile's `mode` (its inductor settings) under `config_patches`.

    The partitioner may recompute in backward a value that backward reads whole (a GEMM's operand): the float32 copy
    of a low value, which a cast or torch's own kernels (SDPA's math path upcasts q, k and v) make, is then recomputed
    from the low value instead of saved (docs/compile.md, "What backward keeps"). Pinned by tests/test_backend.py
    (test_inductor_compiles_the_rewritten_graphs_with_their_matmuls_low) and tests/test_low_outputs.py
    (test_compiled_it_saves_for_backward_no_more_than_autocast_and_compile)."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx  # imported late: inductor takes seconds to import

    patches = {**(list_mode_options(mode) if mode else {}), **config_patches}
    with torch._functorch.config.patch(ban_recompute_materialized_backward=False):
        return compile_fx(graph_module, example_inputs, config_patches=patches or None)


def inductor_modes() -> list[str]:
    """torch.compile's modes (torch._inductor.list_mode_options, which torch.compile's docstring names): a backend of
    one's own gets `mode` unchecked. Pinned by tests/test_bad_input.py (rewrite-unknown-mode)."""
    from torch._inductor import list_mode_options

    return list(list_mode_options())


def inductor_options() -> list[str]:
    """The keys of torch.compile's `options` (torch._inductor.list_options, which torch.compile's docstring names):
    a backend of one's own gets them unchecked. Pinned by tests/test_bad_input.py (rewrite-unknown-option)."""
    from torch._inductor import list_options

    return list_options()


# -- modules -----------------------------------------------------------------------------------------------------

# nn.Module's own call, hooks included (what `module(...)` runs when nothing is compiled), as a function of the module.
# Pinned by tests/test_module_hooks.py (test_forward_hook_registered_before_rewrite_changes_values_as_in_eager).
call_module_with_hooks = nn.Module._call_impl


def module_buffers(module: nn.Module) -> dict:
    """The module's own buffers by name (None for one registered empty), as the dict it keeps: writing an entry puts a
    buffer back with no registration hook. Pinned by tests/test_failed_rewrite.py
    (test_the_example_call_restores_a_buffer_the_forward_reassigns)."""
    return module._buffers


_GLOBAL_HOOK_TABLES = tuple(
    name for name, table in vars(module_globals).items() if name.startswith("_global_") and isinstance(table, dict)
)


def global_module_hooks() -> tuple:
    """The handles of the global module hooks (register_module_forward_hook and the like) now registered. Pinned by
    tests/test_seams.py (test_a_global_module_hook_registered_after_the_first_call_runs)."""
    return tuple(tuple(getattr(module_globals, table)) for table in _GLOBAL_HOOK_TABLES)


@contextlib.contextmanager
def inside_the_vmaps_of(values):
    """Run ops on traced values that live inside a torch.vmap (functorch BatchedTensors whose vmap no longer runs):
    the vmap levels are entered again, outermost first, with their batch sizes (a level is its depth in functorch's
    stack). Pinned by tests/test_cast_pass.py (test_ops_inside_a_vmap_are_cast_by_the_lists)."""
    functorch = torch._C._functorch
    sizes = {}
    for value in values:
        while isinstance(value, torch.Tensor) and functorch.is_batchedtensor(value):
            inner = functorch.get_unwrapped(value)
            sizes[functorch.maybe_get_level(value)] = inner.shape[functorch.maybe_get_bdim(value)]
            value = inner
    entered = 0
    try:
        for level in range(1, max(sizes, default=0) + 1):
            entered += 1
            if functorch._vmap_increment_nesting(sizes.get(level, 1), "different") != level:
                break  # another transform runs here: the op then fails, and the pass names it (RewriteError)
        yield
    finally:
        for _ in range(entered):
            functorch._vmap_decrement_nesting()


def dynamo_traces_hook_table_subclasses() -> bool:
    """Whether dynamo traces a module whose hook table is an OrderedDict subclass: torch 2.11's shortcut for nn.Module
    calls asks the table's tracker for .len(), which its UserDefinedDictVariable lacks (an internal error, not a graph
    break). Pinned by tests/test_module_hooks.py (test_full_backward_hook_sees_the_gradients_autocast_sees)."""
    from torch._dynamo.variables.user_defined import UserDefinedDictVariable
    return hasattr(UserDefinedDictVariable, "len")


@contextlib.contextmanager
def global_module_hooks_removed_on_failure():
    """A failed torch.export leaves its buffer-assignment hook among the global module hooks on torch 2.11 (the handle
    is removed only when the trace succeeds); every later dynamo trace of a buffer write then breaks its graph there.
    The hooks registered inside the block are removed if it raises. Pinned by tests/test_capture.py
    (test_a_failed_export_leaves_no_global_hook_behind)."""
    before = {name: set(getattr(module_globals, name)) for name in _GLOBAL_HOOK_TABLES}
    try:
        yield
    except BaseException:
        for name, keys in before.items():
            table = getattr(module_globals, name)
            for key in [key for key in table if key not in keys]:
                del table[key]
        raise


def composable_apis_on(module: nn.Module) -> dict:
    """torch.distributed's composable APIs applied to `module` (`checkpoint(module)`, `fully_shard`) by name; {} where
    torch lacks them. Pinned by tests/test_activation_checkpointing.py
    (test_composable_checkpoint_of_a_block_is_refused_with_the_fix)."""
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:
        return {}
    return _get_registry(module) or {}


def fsdp2_param_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """The FSDP2 modules of `model` (by path) whose MixedPrecisionPolicy gathers their parameters in a `param_dtype`
    for compute: FSDP2 keeps the policy in its state, with no public getter. Checked on torch 2.13 and 2.11. Pinned by
    tests/test_fsdp.py (test_fsdp2_casting_the_parameters_is_refused_with_the_fix)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    policies = {name: getattr(m._get_fsdp_state(), "_mp_policy", None)
                for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    return {name: policy.param_dtype for name, policy in policies.items() if getattr(policy, "param_dtype", None)}


# The base class of BatchNorm*, SyncBatchNorm and InstanceNorm*: normalizations with running statistics. Pinned by
# tests/test_backend.py (test_o2_keeps_normalization_weights_fp32).
NormBase = nn.modules.batchnorm._NormBase


def rerun_checkpointed_region_as(wrap) -> None:
    """In the forward of a non-reentrant torch.utils.checkpoint region on this thread: make backward rerun the region's
    function as `wrap(function)`, innermost, inside the autocast state the checkpoint restores (once per region: a
    function `wrap` returns carries `graphamp_wrapped`). The region is found through the saved-tensor hooks it pushed,
    the function in its frame's `recompute_fn`. Checked on torch 2.11 and 2.13. Pinned by tests/test_eager_policy.py
    (test_a_checkpointed_region_is_recomputed_under_the_policy_it_ran_under)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = hooks[0] if hooks else None
    if getattr(pack, "__qualname__", None) != "_checkpoint_hook.__init__.<locals>.pack_hook":
        return
    frame = _closure_cell(pack, "frame")
    recompute = getattr(frame.cell_contents, "recompute_fn", None) if frame is not None else None
    function = _closure_cell(recompute, "fn") if recompute is not None else None
    if function is not None and not getattr(function.cell_contents, "graphamp_wrapped", False):
        function.cell_contents = wrap(function.cell_contents)


def _closure_cell(function, name: str):
    """The cell through which `function` reads the enclosing variable `name`, or None."""
    return dict(zip(function.__code__.co_freevars, function.__closure__ or ())).get(name)


# -- tensors and optimizers --------------------------------------------------------------------------------------

def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter: each in-place write adds one. Pinned by tests/test_clipping.py
    (test_clipping_scaled_gradients_before_unscale_is_refused_and_nothing_steps)."""
    return tensor._version


def sparse_values(tensor: torch.Tensor) -> torch.Tensor:
    """A sparse tensor's values as stored, coalesced or not (GradScaler unscales a sparse gradient through them). Pinned
    by tests/test_decorate.py (test_unscale_gives_a_sparse_gradient_its_true_values)."""
    return tensor._values()


def group_by_device_and_dtype(tensors: list[torch.Tensor]) -> dict:
    """`tensors` grouped as torch.optim's foreach paths group them: {(device, dtype): ([tensors], indices)}. Pinned by
    tests/test_loss_scaling.py (test_unscale_divides_gradients_of_every_dtype_and_finds_no_inf)."""
    return torch.utils._foreach_utils._group_tensors_by_device_and_dtype([tensors])


def fused_step_takes_loss_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step unscales by `grad_scale` and skips on `found_inf` inside its kernel (fused Adam,
    AdamW, SGD): GradScaler's contract with them. Pinned by tests/test_decorate.py
    (test_skipped_step_leaves_fused_adamw_state_bit_identical)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


# -- devices -----------------------------------------------------------------------------------------------------

def cpu_runs_bfloat16_natively() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (AVX512-BF16 or AMX); without them bfloat16 matmuls are emulated
    and run many times slower than FP32. Pinned by every bfloat16 rewrite on a CPU, first tests/test_failed_rewrite.py
    (test_the_example_call_restores_a_buffer_the_forward_reassigns)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
