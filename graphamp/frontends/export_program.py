"""export_program(): the whole model as one static program with graphamp's casts in it, for reading and deploying.

torch.export (non-strict, training IR), then the passes; the result stays an ExportedProgram (save/load, `.module()`,
AOTInductor): docs/how_it_works.md, "The whole static program".
"""

from __future__ import annotations

import contextlib
import inspect
import re
import traceback
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import TensorArgument

from graphamp.errors import ArgumentError, CaptureError
from graphamp.frontends.compile_backend import refuse_outer_autocast
from graphamp.frontends.dynamic_dims import automatic_dynamic_dims, sizes_from_one
from graphamp.frontends.device_moves import DeviceMovesAsRun
from graphamp.frontends.type_promotion import PromoteMixedInputs
from graphamp.passes import run_passes
from graphamp.passes.number_range import CONSTANT_INPUT
from graphamp.passes.marks import mark_of
from graphamp.policy.config import check_entry_arguments
from graphamp.torch_private import (
    HigherOrderOperator, OpOverload, call_module_with_hooks, global_module_hooks_removed_on_failure, pytree,
)

__all__ = [
    "capture_program", "explain_capture_failure", "export_program", "op_without_fake_impl", "refuse_examples_that_do_not_fit",
    "rewrite_program", "warn_of_bodies_without_module_paths",
]

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_GRAPHAMP_DIR = str(Path(__file__).resolve().parent.parent)


def export_program(
    model: nn.Module, example_args=(), example_kwargs=None, amp_lists=None, level: str = "O1", dynamic: bool = False
) -> ExportedProgram:
    """The whole model as a torch.export ExportedProgram with graphamp's casts inserted by the lists.

    Args:
        model: the FP32 nn.Module, captured in its current train/eval mode.
        example_args: positional inputs of one call (a single tensor may be passed bare).
        example_kwargs: keyword inputs of that call.
        amp_lists: the white/black/gray lists and dtype (default: the shipped lists, float16).
        level: "O1" — the lists decide; "O2" — everything but black ops and normalization parameters runs low.
        dynamic: keep every input dim of size 2 or more symbolic, from 1 up, where the model allows.

    Returns:
        The ExportedProgram: `.module()` runs it, `torch.export.save` writes it, `graphamp.export(program, dir)`
        shows it; `program.graph_module.meta["graphamp_report"]` is the cast pass's RewriteReport.
    """
    args, kwargs, config = check_entry_arguments("export_program", model, example_args, example_kwargs, amp_lists, level)
    # Traced under an outer autocast, the program would hold autocast's dtypes as the model's own.
    refuse_outer_autocast(
        pytree.tree_leaves((args, kwargs)), f"graphamp.export_program() of {type(model).__name__} was called"
    )
    program = capture_program(model, args, kwargs, dynamic, config.lists.promote_ops)
    warn_of_bodies_without_module_paths(program.graph_module, config.lists, "export_program")
    return rewrite_program(program, config.for_model(model))  # a shared module is black by any of its names


def warn_of_bodies_without_module_paths(graph_module: torch.fx.GraphModule, lists, entry_point: str) -> None:
    """torch.export (non-strict) records no module path in the bodies of torch.cond, while_loop, ...: black-module
    patterns cannot reach the ops there, which the lists then decide by op alone. Say so, rather than run them low:
    `entry_point` (export_program, doctor, auto_mixed_precision) decides by the captured program."""
    if not lists.black_modules:
        return
    found = {
        node.target.__name__
        for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes if isinstance(node.target, HigherOrderOperator)
        and not node.target.__name__.startswith("wrap_with_")  # no_grad and autocast regions keep their paths
        for body in node.args if isinstance(body, torch.fx.Node) and body.op == "get_attr"
        if any(isinstance(op.target, OpOverload) and not op.meta.get("nn_module_stack")
               for op in getattr(module, body.target).graph.nodes)
    }
    if found:
        warnings.warn(
            f"{entry_point}(): torch.export records no module path inside {', '.join(sorted(found))} bodies, so the "
            f"black-module patterns cannot keep their ops FP32: there the op lists alone decide. rewrite() knows those "
            f"paths; or put the ops on custom_black_list.", stacklevel=3,
        )


def rewrite_program(program: ExportedProgram, config) -> ExportedProgram:
    """The passes on `program`'s graph in place; the signature's outputs follow the values that now leave."""
    graph_module = program.graph_module
    graph_module.meta["graphamp_original_code"] = graph_module.print_readable(print_output=False)
    outputs_before = _output_names(graph_module)
    for placeholder in graph_module.graph.find_nodes(op="placeholder"):  # constants the model made, lifted to inputs
        if placeholder.name in program.graph_signature.inputs_to_lifted_tensor_constants:
            placeholder.meta[CONSTANT_INPUT] = True
    report = run_passes(graph_module, config, frozenset(program.graph_signature.inputs_to_parameters))
    renamed = dict(zip(outputs_before, _output_names(graph_module)))
    for spec in program.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and renamed.get(spec.arg.name, spec.arg.name) != spec.arg.name:
            spec.arg = TensorArgument(name=renamed[spec.arg.name])
    for node in graph_module.graph.nodes:  # the decisions, where torch.export.save keeps them
        if (mark := mark_of(node)) is not None:
            node.meta.setdefault("custom", {})["graphamp"] = mark.to_json()
    graph_module.meta["graphamp_report"] = report
    return program


def _output_names(graph_module: torch.fx.GraphModule) -> list:
    output = graph_module.graph.find_nodes(op="output")[0]
    return [value.name if isinstance(value, torch.fx.Node) else value for value in pytree.tree_leaves(output.args)]


def capture_program(
    model: nn.Module, args: tuple, kwargs: dict, dynamic: bool, promote_ops: frozenset[str]
) -> ExportedProgram:
    """torch.export of `model` on (args, kwargs) in FP32, its current train/eval mode; CaptureError if it cannot be.

    dynamic: leave every dim of the tensor inputs symbolic, from size 1 up, where the model allows.
    promote_ops: the ops whose mixed floating inputs meet at the widest while capturing (the lists' promote.txt).
    """
    args, kwargs = _ordinary_tensors((args, kwargs))
    try:
        # Grad mode is fixed so that one program serves calls under no_grad/inference_mode too.
        dims = automatic_dynamic_dims((args, kwargs)) if dynamic else contextlib.nullcontext()
        with torch.inference_mode(False), torch.enable_grad(), warnings.catch_warnings(), dims, \
                PromoteMixedInputs(promote_ops), DeviceMovesAsRun(), global_module_hooks_removed_on_failure():
            # nn.RNN keeps a Python list of its own parameters; export flags it, but they are parameters.
            warnings.filterwarnings("ignore", message=r"The tensor attributes self\..*_flat_weights")
            program = torch.export.export(model, tuple(args), kwargs, strict=False)
    except CaptureError:
        raise
    except Exception as error:
        refuse_examples_that_do_not_fit("the", model, args, kwargs, CaptureError)  # as other capture failures
        raise CaptureError(explain_capture_failure(model, error)) from error
    if dynamic:
        sizes_from_one(program.graph_module)
    return program


def _ordinary_tensors(tree):
    """Inference-mode tensors cannot be traced for autograd: capture on plain copies (values do not matter)."""
    def plain(t):
        if t.is_inference():
            with torch.inference_mode(False):
                return t.clone()
        return t
    return pytree.tree_map_only(torch.Tensor, plain, tree)


def refuse_examples_that_do_not_fit(whose: str, model: nn.Module, args: tuple, kwargs: dict,
                                    error_type: type = ArgumentError) -> None:
    """After a capture or compiled call failed: if the model's own FP32 code fails on the examples too, say so, not
    that torch.export, dynamo or graphamp cannot capture a construct. The model's buffers (BatchNorm's running
    statistics) are put back after the try."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            call_module_with_hooks(model, *args, **kwargs)
    except Exception as eager_error:
        raise error_type(
            f"{whose} example inputs do not fit {type(model).__name__}: its own FP32 code raises on them "
            f"({type(eager_error).__name__}: {str(eager_error).splitlines()[0] if str(eager_error) else ''}). "
            f"Fix: pass example_args/example_kwargs as one training call would (the model's forward signature), "
            f"or make the model's FP32 code run on them."
        ) from eager_error
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                if buffer.shape == saved.shape:
                    buffer.copy_(saved)


def explain_capture_failure(model: nn.Module, error: Exception) -> str:
    """One message: which construct failed, where in the user's code, and the fix."""
    text = str(error)
    where = _user_frame(error) or _forward_location(model)
    at = f" at {where}" if where else ""
    name = type(model).__name__
    if "Cache" in text and "not a known type" in text:
        return (
            f"cannot capture {name}: it returns a transformers Cache (past_key_values){at}, which torch.export "
            f"cannot flatten. Fix: set use_cache=False (model.config.use_cache = False, or pass use_cache=False)."
        )
    if "not a known type" in text:
        kind = text.split("Found ", 1)[-1].split(" in output", 1)[0]
        return (
            f"cannot capture {name}: forward returns {kind}{at}, which torch.export cannot flatten. Fix: return "
            f"tensors, tuples or dicts, or register the class with torch.utils._pytree.register_pytree_node."
        )
    if type(error).__name__ in ("GuardOnDataDependentSymNode", "UserError") and "data-dependent" in text:
        return (
            f"cannot capture {name}: Python control flow depends on a tensor's value{at} (an `if`, `int()` or "
            f"`.item()` on a tensor). Fix: express it with torch.cond / torch.where, or compute it outside forward; "
            f"for a transformers model given `labels`, call it without them and compute the loss from the logits."
        )
    if op := op_without_fake_impl(error):
        return (
            f"cannot capture {name}{at}: the custom op '{op}' has no fake implementation, which torch.compile and "
            f"torch.export run to learn the shape and dtype of its output. Fix: register one with "
            f"torch.library.register_fake('{op}') (lists/README.md, 'A custom torch.library op', shows one)."
        )
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return (
        f"cannot capture {name} with torch.export{at}: {type(error).__name__}: {first_line}. Fix: make that "
        f"construct traceable (see the torch.export docs on non-strict mode), or keep it out of forward()."
    )


# torch's words for an op without a fake (meta) kernel: a custom_op's, and a Library.define op's (no Meta kernel)
_NO_FAKE_IMPL = re.compile(r"no fake impl registered for <CustomOpDef\(([\w.]+::[\w.]+)\)>"
                           r"|([\w.]+::[\w.]+): attempted to run this operator with Meta tensors")


def op_without_fake_impl(error: BaseException) -> str | None:
    """The custom op ('mylib::op') whose missing fake implementation `error`, or an error it was raised from, reports
    (dynamo wraps torch's error in its own)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if match := _NO_FAKE_IMPL.search(str(error)):
            return match.group(1) or match.group(2)
        error = error.__cause__ or error.__context__
    return None


def _user_frame(error: Exception) -> str:
    """'file:line (code)' of the deepest frame outside torch itself, where the construct is."""
    frames = traceback.extract_tb(error.__traceback__)
    user = [
        f for f in frames
        if not f.filename.startswith("<")  # code torch generates (<string>, <eval_with_key>) is nobody's to fix
        and not str(Path(f.filename).resolve()).startswith((_TORCH_DIR, _GRAPHAMP_DIR))
    ]
    if not user:
        return ""
    frame = user[-1]
    code = f" ({frame.line.strip()})" if frame.line else ""
    return f"{frame.filename}:{frame.lineno}{code}"


def _forward_location(model: nn.Module) -> str:
    """'file:line (Class.forward)' where the model's forward is defined, when no frame names the construct."""
    try:
        forward = inspect.unwrap(type(model).forward)
        return f"{inspect.getsourcefile(forward)}:{inspect.getsourcelines(forward)[1]} ({type(model).__name__}.forward)"
    except (OSError, TypeError):
        return ""
