"""The module users train: the original's FP32 master weights, driving rewritten graphs.

`rewrite(model, ...)` captures the model, runs the cast pass and returns an `AmpModule`. Each train/eval
mode and input signature (dtypes, devices, keyword names, non-tensor values) gets its own capture, kept in a
small cache: torch.export's `ep.module()` cannot switch modes, so graphamp captures per mode. Sizes follow
the "automatic dynamic" rule of graphamp.runtime.shapes: a signature's second size gets one capture with dynamic dims.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Hashable

import torch
import torch.utils._pytree as pytree
from torch import nn

from graphamp.cache_pytree import update_given_caches
from graphamp.capture import Captured, capture
from graphamp.cast_pass import RewriteReport, check_level, insert_casts
from graphamp.runtime.bound_ops import bind_ops
from graphamp.runtime.checkpointing import checkpointed, marking_checkpoints, matching_modules
from graphamp.runtime.compiled import CompiledGraph
from graphamp.runtime.deferred_upcast import plain_arguments
from graphamp.dtypes import HALF_DTYPES, check_dtype_runs_on, dtype_name
from graphamp.errors import ArgumentError, DoubleAmpError
from graphamp.runtime.grouped_query_attention import attend_grouped_queries
from graphamp.runtime.in_graph_scaling import register_parameters, run_scaled
from graphamp.runtime.input_free_values import compute_input_free_values
from graphamp.runtime.generation import GenerationCall, generate
from graphamp.runtime.fingerprint import DeathWatch, module_fingerprint
from graphamp.lists import AutoMixedPrecisionLists
from graphamp.runtime.module_hooks import check_global_hooks
from graphamp.runtime.progress import Progress
from graphamp.runtime.recycled_outputs import RecycledOutputs
from graphamp.runtime.regions import Regions, called_module_paths, root_is_called_as_module
from graphamp.dynamic_dims import size_oblivious
from graphamp.runtime.shapes import InputGuard, InputSignature, is_dynamic, signature_of, specialized_dims, without_defaults
from graphamp.runtime.weight_cache import WeightCache, feed_weight_casts

__all__ = ["AmpModule", "rewrite"]

DEFAULT_MAX_CAPTURES = 8
CAPTURE_PHASE = "capturing the model with torch.export"
CAST_PASS_PHASE = "inserting casts"


class AmpModule(nn.Module):
    """Runs `model` through graphs rewritten for mixed precision; its parameters are the model's own.

    The parameter, buffer and child tables are the original model's (shared, not copied), so the
    parameters are the same objects, `state_dict()` has the original keys and loads into the original,
    and `.to()`/`.train()`/`.eval()` act on both.

    To frameworks it looks like the model: it is an instance of `Amp<Original>`, a subclass of both AmpModule
    and the original's class (isinstance checks, class-based label detection), `forward`'s signature is the
    original's, and `save_pretrained` is the original's (config.json included).
    """

    def __new__(cls, model=None, *args, **kwargs):
        if cls is AmpModule and isinstance(model, nn.Module):
            cls = _class_looking_like(type(model))
        return object.__new__(cls)  # not the original class's __new__ (FSDP2's builds another object)

    def __init__(
        self, model, amp_lists, level="O1", compile=False, fp32_outputs=True, max_captures=DEFAULT_MAX_CAPTURES,
        progress=None, regions=None, dynamic=None, checkpoint=None, weight_cache=False, compile_mode=None,
    ):
        nn.Module.__init__(self)  # not super(): the next class may be the original's, whose __init__ builds a model
        self.__dict__["_original"] = model  # not registered: its tables are ours already
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
        self.__dict__["_modules"] = model._modules
        self.amp_lists = amp_lists
        self.level = level
        self.compile = compile
        self.fp32_outputs = fp32_outputs
        self.max_captures = max_captures
        if regions is not None and dynamic:
            raise ValueError(
                "regions= runs each block from a static capture: pass dynamic=None or False with regions "
                "(each new input shape is then captured once)."
            )
        self.dynamic = dynamic
        self.progress = Progress(progress)
        self.checkpoint = checkpoint
        # Keys: an InputSignature for a static capture, (signature without sizes, InputGuard) for a dynamic one.
        self.compile_mode = compile_mode
        self.weight_cache = WeightCache() if weight_cache else None
        if self.weight_cache is not None:
            self.weight_cache.static_addresses = compile_mode == "reduce-overhead"
        self._captures: OrderedDict[Hashable, Captured] = OrderedDict()
        self._sizes_captured: dict[InputSignature, list[tuple]] = {}  # per signature without sizes
        self._last: Captured | None = None
        self._region_patterns = regions
        self._regions: Regions | None = None
        self._linked_optimizer: weakref.ref | None = None
        register_parameters(self)
        self._fingerprint: tuple | None = None  # of the model as the cached captures saw it
        self._watch = DeathWatch()  # a module or tensor the captures read has died: its id() may come back
        # torch.export swaps fake tensors into the model while it captures: no other thread may run it then.
        self._lock = threading.RLock()
        self._recycled = RecycledOutputs()  # one float32 output storage per output, shared by every capture
        self._generation: GenerationCall | None = None  # while a generate() call runs (graphamp.runtime.generation)
        self._calls_run = 0  # graph runs, so that a patched forward that bypasses them is noticed
        self._sync_regions()

    @property
    def original_module(self) -> nn.Module:
        return self._original

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The rewritten graph used by the latest call (or built by `rewrite`)."""
        return self._last.graph_module

    @property
    def report(self) -> RewriteReport:
        """What the cast pass decided for `graph_module`."""
        return self._last.report

    @property
    def timings(self) -> dict:
        """Seconds per phase of the latest call's capture: capture, cast pass, and inductor's compiles."""
        return self._last.timings

    @property
    def captures(self) -> list[Captured]:
        """Every cached capture, oldest first (one per mode and input signature)."""
        return list(self._captures.values())

    @property
    def training(self) -> bool:
        """The original's mode: `model.eval()` and `amp_model.eval()` are the same switch."""
        original = self.__dict__.get("_original")
        return original.training if original is not None else True

    @training.setter
    def training(self, mode: bool) -> None:
        original = self.__dict__.get("_original")
        if original is not None:  # nn.Module.__init__ sets it before the original is attached
            original.training = mode

    def train(self, mode: bool = True):
        self._original.train(mode)
        return self

    def forward(self, *args, **kwargs):
        return self._run(args, kwargs)

    def __call__(self, *args, **kwargs):
        replaced = self.__dict__.get("forward")
        if replaced is None:
            return super().__call__(*args, **kwargs)
        # A forward set on the instance (a trainer's patch) that never reaches graphamp runs the original's FP32
        # modules through attribute fall-through: training goes on, silently without mixed precision.
        runs = self._calls_run
        result = super().__call__(*args, **kwargs)
        if self._calls_run == runs and self.__dict__.get("_warned_forward") is not replaced:
            self.__dict__["_warned_forward"] = replaced
            warnings.warn(
                f"the AmpModule's forward was replaced by {getattr(replaced, '__qualname__', replaced)!r}, which "
                f"ran the original model's modules in float32 without graphamp's graph: this call had no mixed "
                f"precision. Fix: patch the original model before graphamp.rewrite(), or have the new forward "
                f"call the AmpModule's own forward.",
                stacklevel=2,
            )
        return result

    # torch.compile(amp_model) leaves the call to graphamp: it runs its own (compile=True: inductor) graphs, and
    # dynamo tracing into capture and the per-call checks would freeze them.
    @torch.compiler.disable
    def _run(self, args: tuple, kwargs: dict, dynamic: bool | None = None):
        with self._lock:
            return self._run_locked(args, kwargs, dynamic)

    def _run_locked(self, args: tuple, kwargs: dict, dynamic: bool | None):
        check_no_autocast(device_of(self._original))
        self._calls_run += 1
        args, kwargs = plain_arguments(args, kwargs)  # another compiled AmpModule's float32 output, not yet cast
        captured, flat_inputs = self._captured_for(args, kwargs, dynamic)
        scale = self._loss_scaling_for_this_call()
        if self._regions is not None:
            return update_given_caches(args, kwargs, self._regions.call(captured, args, kwargs, scale))
        lifted = [source.get() for source in captured.lifted]
        if scale is None:
            outputs = captured.run(*lifted, *flat_inputs, *self._weight_casts(captured, lifted))
        else:
            weight_casts = functools.partial(self._weight_casts, captured, lifted)
            outputs = run_scaled(captured.run, [*lifted, *flat_inputs], scale, weight_casts)
        results = pytree.tree_unflatten([outputs[i] for i in captured.user_outputs], captured.out_spec)
        return update_given_caches(args, kwargs, results)

    def _weight_casts(self, captured: Captured, lifted: list, gradient_factor: torch.Tensor | None = None) -> list:
        """The low-precision weights a graph that takes them after the user inputs is called with: kept between
        forwards by the weight cache, or for the length of a generate() call; else cast for this call alone (a
        graph captured during generate() and called outside it)."""
        if not captured.fed_weights:
            return []
        cache = self.weight_cache
        if cache is None:
            cache = self._generation.weights if self._generation is not None else WeightCache()
        return cache.casts_of([(lifted[i], dtype) for i, dtype in captured.fed_weights], gradient_factor)

    def recapture(self) -> None:
        """Drop every cached capture: the next call captures the model as it is then.

        Edits to the module tree, its parameters, buffers and hooks are noticed on their own; call this after a
        change graphamp cannot see, such as a Python attribute that forward reads (`self.use_relu = False`).
        """
        self._captures.clear()
        self._fingerprint = None

    def _sync_regions(self) -> None:
        """Derive again which modules run as modules (regions named, hooked, sharded) and install their forwards."""
        paths = called_module_paths(self._original, self._region_patterns)
        wanted = bool(paths) or root_is_called_as_module(self._original)
        if self._regions is not None:
            if wanted and self._regions.paths == paths:
                return
            self._regions.uninstall()
        self._regions = Regions(self._original, paths) if wanted else None

    def _captured_for(self, args: tuple, kwargs: dict, dynamic: bool | None = None) -> tuple[Captured, list]:
        """The capture serving this call (made if none does) and the call's flat inputs.

        dynamic: True captures with dynamic dims at once, as generation does; None follows `self.dynamic`.
        """
        generation = self._generation
        if generation is None or not generation.model_checked:  # a generate() call checks the model once
            fingerprint = self._model_fingerprint()
            if (fingerprint is not None and fingerprint != self._fingerprint) or self._watch.changed:
                self._captures.clear()  # a graph of the model as it was must never run again
                self._sync_regions()
        # One capture whatever order keywords come in, and whether or not a default is passed explicitly.
        kwargs = dict(sorted(without_defaults(self._original, kwargs).items()))
        signature, flat_inputs = signature_of(self.training, device_of(self._original), args, kwargs)
        key = self._cached_key(signature, flat_inputs)
        if key is None:
            if not self._captures:
                check_master_weights(self._original)  # again: `.half()` or a swapped-in module since rewrite
            check_global_hooks()
            key = self._capture_signature(signature, args, kwargs, self.dynamic if dynamic is None else dynamic)
            # Taken after capture: a model may register hooks on its first call (transformers' output capturing).
            self._fingerprint = self._model_fingerprint() or self._fingerprint
            self._watch.watch(self._original, parameters=not _sharded_by_fsdp2(self))
        else:
            self._captures.move_to_end(key)
        self._last = self._captures[key]
        if generation is not None:
            generation.model_checked = True
        return self._last, flat_inputs

    def _model_fingerprint(self) -> tuple:
        return module_fingerprint(self._original, parameter_identity=not _sharded_by_fsdp2(self))

    def _cached_key(self, signature: InputSignature, flat_inputs: list) -> Hashable | None:
        if signature in self._captures:
            return signature
        shape_free = signature.without_sizes()
        return next(
            (key for key in reversed(self._captures) if isinstance(key, tuple) and key[0] == shape_free and key[1].fits(flat_inputs)),
            None,
        )

    def _capture_signature(self, signature: InputSignature, args: tuple, kwargs: dict, dynamic: bool | None) -> Hashable:
        """Capture for a new signature (static, or dynamic by the automatic rule) and cache it; return its key."""
        shape_free = signature.without_sizes()
        sizes_captured = self._sizes_captured.setdefault(shape_free, [])
        if signature.sizes not in sizes_captured:  # a recapture of the same sizes (after an edit) is no variation
            sizes_captured.append(signature.sizes)
        # Once any signature's sizes have varied, a new keyword set is captured dynamic at once: one capture each.
        make_dynamic = bool(dynamic) or (dynamic is None and any(len(sizes) > 1 for sizes in self._sizes_captured.values()))
        make_dynamic = make_dynamic and self._regions is None  # a region's pieces are keyed by their shapes
        captured = self._capture(args, kwargs, make_dynamic)
        key = signature
        if make_dynamic and is_dynamic(captured.graph_module):
            key = (shape_free, InputGuard(captured.graph_module, len(captured.lifted)))
            specialized = specialized_dims(captured.graph_module, len(captured.lifted), signature, sizes_captured)
            if specialized:
                warnings.warn(
                    "graphamp captured with dynamic shapes, but some dims that changed between calls stay static, "
                    "so each new size of them costs a capture: " + "; ".join(specialized) + ".",
                    stacklevel=4,
                )
        previous = next(reversed(self._captures), None)
        for older in self._captures.values():
            older.example_inputs = None  # only the newest capture keeps its batch, for export's reruns
        self._captures[key] = captured
        if len(self._captures) > self.max_captures:
            self._captures.popitem(last=False)
            self._warn_overflow(key, previous)
        return key

    def _warn_overflow(self, key: Hashable, previous: Hashable) -> None:
        def signature(k):
            return k[0] if isinstance(k, tuple) else k

        differences = signature(key).differences(signature(previous)) if previous is not None else []
        warnings.warn(
            f"graphamp has seen more than max_captures={self.max_captures} input signatures and dropped the "
            f"oldest capture; each new one costs a capture. This call differs from the previous one in: "
            f"{', '.join(differences)}. Keep those fixed between calls (pass optional keywords always or never), "
            f"or pass a larger max_captures to rewrite().",
            stacklevel=5,
        )

    def _capture(self, args: tuple, kwargs: dict, dynamic: bool = False) -> Captured:
        timings = {}
        regions = self._regions.capturing() if self._regions is not None else contextlib.nullcontext()
        # Regions first: checkpoint= marks the class forwards of the modules it matches, regions or not.
        with self.progress.phase(CAPTURE_PHASE, timings), regions, marking_checkpoints(self._original, self.checkpoint):
            captured = capture(
                self._original, args, kwargs, tuple(self._regions.paths) if self._regions is not None else (),
                dynamic=dynamic, promote_ops=self.amp_lists.promote_ops,
            )
        with self.progress.phase(CAST_PASS_PHASE, timings), size_oblivious(dynamic):  # no guard on a size of 1
            captured.report = insert_casts(
                captured.graph_module, self.amp_lists, self.level, self.fp32_outputs,
                fp32_placeholders(self._original, captured, self.level),
            )
        captured.timings = timings
        if self._regions is not None:
            captured.run = self._regions.split(captured, self.compile, self.progress, timings)
            return captured
        # The passes below edit the graph that runs; graph_module stays the cast pass's, for the tools that show it.
        graph_to_run = copy.deepcopy(captured.graph_module)
        if self.weight_cache is not None or self._generation is not None:
            captured.fed_weights = feed_weight_casts(graph_to_run, list(captured.parameter_placeholders))
        attend_grouped_queries(graph_to_run)
        compute_input_free_values(graph_to_run)
        runnable = checkpointed(graph_to_run)
        if not self.compile:
            bind_ops(runnable)
        captured.run = (
            CompiledGraph(
                runnable, self.progress, timings, is_dynamic(captured.graph_module), self.compile_mode, self._recycled,
                defer_casts_up=True,
            )
            if self.compile
            else runnable
        )
        return captured

    def _link_optimizer(self, optimizer) -> None:
        """Scale gradients in the graph by this decorated optimizer's loss scaling (the latest link wins)."""
        self._linked_optimizer = weakref.ref(optimizer)

    def _loss_scaling_for_this_call(self) -> torch.Tensor | None:
        """The linked optimizer's scale tensor when this call's gradients must be scaled in the graph, else None."""
        optimizer = self._linked_optimizer() if self._linked_optimizer is not None else None
        if optimizer is None or not torch.is_grad_enabled():
            return None
        return optimizer._scale_in_graph(device_of(self._original))

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        check_master_weights(self._original)  # `.to(torch.bfloat16)` / `.half()` get rewrite's check
        return result

    def __getstate__(self) -> dict:
        """Copies (deepcopy, pickle, torch.save) drop the captured graphs: the copy recaptures on first use.
        They drop the link too: the linked optimizer holds the original's parameters, not the copy's."""
        state = dict(super().__getstate__())
        state.update(_captures=OrderedDict(), _last=None, _fingerprint=None, _sizes_captured={}, _linked_optimizer=None)
        state.update(  # made anew
            _regions=None, _watch=None, _lock=None, _warned_forward=None, _recycled=None, _generation=None
        )
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        register_parameters(self)  # so that decorate() over the copy's parameters links the copy
        self._watch, self._lock, self._recycled = DeathWatch(), threading.RLock(), RecycledOutputs()
        self._sync_regions()

    def __reduce_ex__(self, protocol):
        # Amp<Original> is made at run time, so pickle finds it through the original's class, not by name.
        return (_new_amp_module, (type(self._original),), self.__getstate__())

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None:
                raise
            if name == "generate" and hasattr(original, "generate"):
                return functools.partial(generate, self)  # through rewritten graphs, not the FP32 original
            return getattr(original, name)  # model.config and friends, as on the original

    def extra_repr(self) -> str:
        return f"dtype={self.amp_lists.dtype_name}, level={self.level}, compile={self.compile}, dynamic={self.dynamic}"


_classes_looking_like: dict[type, type] = {}


def _class_looking_like(original_class: type) -> type:
    """`Amp<Original>`: AmpModule first, then the original's class; its forward shows the original's signature."""
    original_class = _users_class(original_class)
    cls = _classes_looking_like.get(original_class)
    if cls is not None:
        return cls

    def forward(self, *args, **kwargs):
        return AmpModule.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(original_class.forward)
    forward.__doc__ = original_class.forward.__doc__
    namespace = {"forward": forward, "__module__": __name__}
    if callable(getattr(original_class, "save_pretrained", None)):
        namespace["save_pretrained"] = _save_pretrained
    if callable(getattr(original_class, "generate", None)):
        namespace["generate"] = generate  # through rewritten graphs, not the class's own FP32 loop
    name = f"Amp{original_class.__name__}"
    try:
        cls = type(name, (AmpModule, original_class), namespace)
    except TypeError:  # a metaclass or layout the two classes cannot share: keep the signature, lose isinstance
        cls = type(name, (AmpModule,), namespace)
    _classes_looking_like[original_class] = cls
    return cls


def _sharded_by_fsdp2(amp_model: AmpModule) -> bool:
    """FSDP2 around the AmpModule, or on the model's root (per-block sharding)."""
    fsdp_module = getattr(torch.distributed.fsdp, "FSDPModule", None) if torch.distributed.is_available() else None
    return fsdp_module is not None and (isinstance(amp_model, fsdp_module) or isinstance(amp_model._original, fsdp_module))


def _users_class(cls: type) -> type:
    """The model's own class under FSDP2's FSDP<Model>: FSDPModule's methods keep state per module, so they must
    run on the original (through __getattr__), never on the AmpModule."""
    fsdp_module = getattr(torch.distributed.fsdp, "FSDPModule", None) if torch.distributed.is_available() else None
    while fsdp_module is not None and len(cls.__bases__) > 1 and cls.__bases__[0] is fsdp_module:
        cls = cls.__bases__[1]
    return cls


def _new_amp_module(original_class: type) -> AmpModule:
    """An empty AmpModule of the class made for `original_class`, for pickle to fill in."""
    return object.__new__(_class_looking_like(original_class))


def _save_pretrained(self, *args, **kwargs):
    """The original model's save_pretrained (same weights, its config.json): from_pretrained loads it back."""
    return self._original.save_pretrained(*args, **kwargs)


def check_no_autocast(device: torch.device | None) -> None:
    """Refuse a call inside an active torch.autocast region: autocast would recast the rewritten graph's ops."""
    if device is not None and torch.is_autocast_enabled(device.type):
        raise DoubleAmpError(
            f"an AmpModule was called inside an active torch.autocast region on {device.type}: two AMP systems are "
            "on, and autocast would override graphamp's lists. Turn one off: drop the torch.autocast context (with "
            "accelerate, Accelerator(mixed_precision='no'); with the HF Trainer, bf16=False and fp16=False), or "
            "train the original model under autocast without graphamp."
        )


def rewrite(
    model: nn.Module,
    example_args=(),
    example_kwargs=None,
    amp_lists: AutoMixedPrecisionLists | None = None,
    level: str = "O1",
    compile: bool = False,
    fp32_outputs: bool = True,
    max_captures: int = DEFAULT_MAX_CAPTURES,
    progress: bool | None = None,
    regions: str | list[str] | None = None,
    dynamic: bool | None = None,
    checkpoint: str | None = None,
    weight_cache: bool = False,
    compile_mode: str | None = None,
) -> AmpModule:
    """Capture `model` with torch.export and return an AmpModule that runs it in mixed precision.

    Args:
        model: the FP32 nn.Module to train; its parameters stay the master weights.
        example_args: positional inputs of one call, for the first capture (in the model's current train/eval
            mode); other modes and input signatures are captured on first use. A single tensor may be passed bare.
        example_kwargs: keyword inputs of that call.
        amp_lists: the white/black/gray lists and dtype (default: the shipped lists, float16).
        level: "O1" — the lists decide; "O2" — everything but black ops and normalization parameters runs low.
        compile: hand each rewritten graph to torch.compile (inductor).
        fp32_outputs: cast floating outputs back to float32 (the loss comes back FP32).
        max_captures: how many captures (mode and input signature) to keep; the oldest is dropped past it.
        progress: a line on stderr per phase (capture, cast pass, inductor compiles) — None: phases still
            running after 2 s; True: every phase; False: none. `timings` has the seconds either way.
        regions: module-path patterns of the blocks that run as their own graphs, called through their modules
            (hooks, FSDP2 sharding, activation checkpointing), e.g. "transformer.h.*"; identical blocks share
            one graph and one compile. See docs/distributed.md.
        dynamic: None — a signature's first capture is static, and a call differing only in sizes is captured
            once with dynamic dims, which serves every later size; True — dynamic dims from the first capture;
            False — one static capture per input shape. See docs/shapes_and_generation.md.
        checkpoint: activation checkpointing of every submodule whose path matches this fnmatch pattern
            ("transformer.h.*"): its activations are recomputed in backward instead of saved. Checkpointing the
            model does itself (torch.utils.checkpoint, HF gradient_checkpointing_enable()) is kept without it.
            See docs/module_contract.md.
        weight_cache: keep the float16/bfloat16 copies of the weights between forwards, recast once after each
            optimizer step instead of at every forward. Off by default: writes through `param.data` cannot be
            seen, and the copies cost memory between steps (docs/performance.md has the figures).
        compile_mode: torch.compile's mode, e.g. "reduce-overhead" (CUDA graphs) or "max-autotune"; needs
            compile=True.

    Returns:
        An AmpModule to train in place of `model`.
    """
    example_args, example_kwargs, amp_lists = check_entry_arguments(
        "rewrite", model, example_args, example_kwargs, amp_lists, level, compile
    )
    check_max_captures(max_captures)
    matching_modules(model, checkpoint)  # a pattern that matches nothing fails before the capture
    if compile_mode is not None and not compile:
        raise ValueError(f"compile_mode={compile_mode!r} is torch.compile's mode: pass compile=True with it.")
    amp_model = AmpModule(
        model, amp_lists, level, compile, fp32_outputs, max_captures, progress, regions, dynamic, checkpoint,
        weight_cache, compile_mode,
    )
    amp_model._captured_for(example_args, example_kwargs)
    return amp_model


def check_entry_arguments(
    entry_point: str, model, example_args, example_kwargs, amp_lists, level: str, compile: bool = False
) -> tuple[tuple, dict, AutoMixedPrecisionLists]:
    """What every entry point (rewrite, doctor, auto_mixed_precision, the CLI) checks before any work starts.

    Returns the example call as (args tuple, kwargs dict) and the lists (the shipped ones when None).
    """
    if isinstance(model, AmpModule):
        raise ValueError("this model was already rewritten by graphamp; pass the original nn.Module.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{entry_point}() takes an nn.Module, got {type(model).__name__}.")
    check_level(level)
    check_argument_types(entry_point, example_args, example_kwargs, amp_lists)
    amp_lists = amp_lists if amp_lists is not None else AutoMixedPrecisionLists()
    check_master_weights(model)
    check_dtype_runs_on(device_of(model), amp_lists.dtype, compile)
    amp_lists.warn_unmatched_black_modules(model)
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    return example_args, dict(example_kwargs or {}), amp_lists


def check_argument_types(entry_point: str, example_args, example_kwargs, amp_lists) -> None:
    """Raise ArgumentError for arguments of the wrong kind, before they fail deep inside capture."""
    if amp_lists is not None and not isinstance(amp_lists, AutoMixedPrecisionLists):
        dtype = f"dtype={amp_lists!r}" if isinstance(amp_lists, (str, torch.dtype)) else "..."
        raise ArgumentError(
            f"{entry_point}(amp_lists=...) got a {type(amp_lists).__name__}; "
            f"pass graphamp.AutoMixedPrecisionLists({dtype})."
        )
    if isinstance(example_args, list):
        raise ArgumentError(
            f"{entry_point}() got example_args as a list; the positional arguments are a tuple: (x,) or (x, y). "
            f"For a model whose one argument is a list, pass ([x, y],)."
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise ArgumentError(
            f"{entry_point}() got example_kwargs as a {type(example_kwargs).__name__}; pass a dict of keyword "
            f"arguments, e.g. {{'attention_mask': mask}}."
        )


def check_max_captures(max_captures) -> None:
    """max_captures below 1 would drop every capture as soon as it is made: each call would recapture."""
    if isinstance(max_captures, bool) or not isinstance(max_captures, int) or max_captures < 1:
        raise ArgumentError(
            f"max_captures={max_captures!r}: pass a whole number of cached captures, at least 1 (default "
            f"{DEFAULT_MAX_CAPTURES})."
        )


def device_of(model: nn.Module):
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else None


def fp32_placeholders(model: nn.Module, captured: Captured, level: str) -> frozenset[str]:
    """The parameter placeholders the cast pass never casts down: normalization parameters under O2."""
    if level != "O2":
        return frozenset()
    return frozenset(
        name for name, fqn in captured.parameter_placeholders.items() if _is_norm_parameter(model, fqn)
    )


def _is_norm_parameter(model: nn.Module, fqn: str) -> bool:
    """Normalization-layer parameters stay FP32 under O2 (BatchNorm, LayerNorm, GroupNorm, RMSNorm, ...)."""
    owner = model.get_submodule(fqn.rpartition(".")[0])
    norm_types = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", nn.LayerNorm))
    return isinstance(owner, norm_types) or "Norm" in type(owner).__name__


def check_master_weights(model: nn.Module) -> None:
    for name, parameter in model.named_parameters():
        if parameter.dtype in HALF_DTYPES:
            raise ValueError(
                f"parameter '{name}' is {dtype_name(parameter.dtype)}: graphamp keeps FP32 master "
                f"weights and casts inside the graph. Keep the model in float32 (drop .half()/.to(dtype)) and rewrite it."
            )
