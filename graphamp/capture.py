"""Capture: torch.export (non-strict, training IR) of a model for one train/eval mode and input signature.

The exported graph is kept *lifted*: parameters, buffers and constants are placeholders, fed on every
call from the user's model itself, so the model's own FP32 tensors stay the master weights. The training
IR is not functional: BatchNorm's running statistics are updated in place on those very buffers.
"""

from __future__ import annotations

import contextlib
import inspect
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

from graphamp.cache_pytree import register_cache_pytree_for
from graphamp.dynamic_dims import automatic_dynamic_dims, sizes_from_one
from graphamp.errors import CaptureError
from graphamp.list_files import default_lists_dir
from graphamp.lists import read_promote_ops
from graphamp.type_promotion import PromoteMixedInputs

__all__ = ["Captured", "LiftedInput", "capture", "explain_capture_failure"]

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_GRAPHAMP_DIR = str(Path(__file__).resolve().parent)


@dataclass
class LiftedInput:
    """Where a lifted placeholder's tensor lives: `owner._parameters[name]`, `owner._buffers[name]`, or fixed."""

    owner: nn.Module | None
    table: str
    name: str
    constant: torch.Tensor | None = None

    def get(self):
        return self.constant if self.owner is None else getattr(self.owner, self.table)[self.name]


@dataclass
class Captured:
    """One exported graph with what is needed to call it like the original model."""

    graph_module: torch.fx.GraphModule
    lifted: list[LiftedInput]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    user_outputs: list[int]
    parameter_placeholders: dict[str, str]  # placeholder name -> parameter FQN
    report: object = None  # the cast pass's RewriteReport, once rewritten
    run: object = None  # graph_module, or its torch.compile'd form
    timings: dict = field(default_factory=dict)  # phase -> seconds: capture, cast pass, inductor compiles
    original_code: str = ""  # the graph as captured, before the cast pass (export's diff.txt)
    # The (args, kwargs) it was captured on, for export's reruns; an AmpModule keeps them on its newest capture only.
    example_inputs: tuple | None = None
    training: bool = True  # the model's mode when captured
    # Module path -> torch.export's ModuleCallSignature, for the modules captured with preserve_module_call_signature.
    module_calls: dict = field(default_factory=dict)
    # (index among the lifted inputs, dtype) of each weight cast `run` takes after the user inputs (weight cache).
    fed_weights: list = field(default_factory=list)


def capture(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    preserve_module_call_signature: tuple = (),
    dynamic: bool = False,
    promote_ops: frozenset[str] | None = None,
) -> Captured:
    """Export `model` on (args, kwargs) in its current train/eval mode; raise CaptureError if it cannot be.

    preserve_module_call_signature: module paths whose calls' inputs and outputs are recorded in `module_calls`.
    dynamic: leave every dim of the tensor inputs symbolic, from size 1 up, where the model allows
    (graphamp.dynamic_dims).
    promote_ops: ops whose mixed floating inputs are cast to the widest, as autocast does (default: the
    shipped lists/promote.txt).
    """
    args, kwargs = _ordinary_tensors((args, kwargs))
    register_cache_pytree_for(model)  # a decoder's default use_cache=True returns its DynamicCache
    if promote_ops is None:
        promote_ops = read_promote_ops(default_lists_dir(), torch.float32, "lists/promote.txt")
    try:
        # Grad mode is fixed so that one graph serves calls under no_grad/inference_mode too.
        dims = automatic_dynamic_dims((args, kwargs)) if dynamic else contextlib.nullcontext()
        with torch.inference_mode(False), torch.enable_grad(), warnings.catch_warnings(), dims, \
                PromoteMixedInputs(promote_ops):
            # nn.RNN keeps a Python list of its own parameters; export flags it, but they are parameters.
            warnings.filterwarnings("ignore", message=r"The tensor attributes self\..*_flat_weights")
            program = torch.export.export(
                model, tuple(args), kwargs, strict=False,
                preserve_module_call_signature=tuple(preserve_module_call_signature),
            )
    except CaptureError:
        raise
    except Exception as error:
        raise CaptureError(explain_capture_failure(model, error)) from error
    if dynamic:
        sizes_from_one(program.graph_module)
    captured = _from_program(model, program)
    captured.example_inputs = (tuple(args), kwargs)
    captured.training = model.training
    captured.module_calls = {e.fqn: e.signature for e in program.module_call_graph if e.signature is not None}
    return captured


def _ordinary_tensors(tree):
    """Inference-mode tensors cannot be traced for autograd: capture on plain copies (values do not matter)."""
    def plain(t):
        if t.is_inference():
            with torch.inference_mode(False):
                return t.clone()
        return t
    return pytree.tree_map_only(torch.Tensor, plain, tree)


def _from_program(model: nn.Module, program: torch.export.ExportedProgram) -> Captured:
    signature = program.graph_signature
    graph_module = program.graph_module
    placeholders = {n.name: n for n in graph_module.graph.find_nodes(op="placeholder")}
    lifted, parameter_placeholders, first_holder = [], {}, {}
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            owner_path, _, name = spec.target.rpartition(".")
            owner = model.get_submodule(owner_path)
            table = "_parameters" if spec.kind == InputKind.PARAMETER else "_buffers"
            lifted.append(LiftedInput(owner, table, name))
            tensor = getattr(owner, table)[name]
            if spec.kind == InputKind.PARAMETER:
                parameter_placeholders[spec.arg.name] = spec.target
            # Tied weights (GPT-2's lm_head and wte) are one tensor: one placeholder serves, one cast.
            holder = first_holder.setdefault(id(tensor), placeholders[spec.arg.name])
            if holder is not placeholders[spec.arg.name]:
                placeholders[spec.arg.name].replace_all_uses_with(holder)
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            lifted.append(LiftedInput(None, "", spec.target, constant=program.constants[spec.target]))
        else:
            raise CaptureError(f"torch.export produced an input of kind {spec.kind.name}, which graphamp cannot feed.")
    user_outputs = [i for i, s in enumerate(signature.output_specs) if s.kind == OutputKind.USER_OUTPUT]
    if len(user_outputs) != len(signature.output_specs):
        kinds = sorted({s.kind.name for s in signature.output_specs} - {"USER_OUTPUT"})
        raise CaptureError(
            f"the model mutates its inputs or state in a way graphamp does not replay ({', '.join(kinds)}); "
            f"make forward() return new tensors instead of writing into its inputs."
        )
    return Captured(
        graph_module=graph_module,
        lifted=lifted,
        in_spec=program.call_spec.in_spec,
        out_spec=program.call_spec.out_spec,
        user_outputs=user_outputs,
        parameter_placeholders=parameter_placeholders,
        original_code=graph_module.print_readable(print_output=False),
    )


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
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return (
        f"cannot capture {name} with torch.export{at}: {type(error).__name__}: {first_line}. Fix: make that "
        f"construct traceable (see the torch.export docs on non-strict mode), or keep it out of forward()."
    )


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
