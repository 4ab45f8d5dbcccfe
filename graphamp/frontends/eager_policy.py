"""graphamp.auto_cast(): the lists as a runtime policy for code that runs eagerly, beside the cast pass.

Paddle keeps its dygraph `auto_cast(custom_white_list=..., custom_black_list=..., level=...)` beside the static
`rewrite_program`, one AutoMixedPrecisionLists for both. Here the static side is the cast pass on every graph
torch.compile or torch.export hands graphamp; this is the eager side: a TorchFunctionMode that sees each torch
call the model's Python code makes (F.linear, torch.matmul, Tensor.__add__, ...), names the ATen op it is, and
casts its floating inputs by the same rule (policy/cast_rule.py): white low, black float32, gray and unlisted
follow their inputs, O2 all but black low, the model's own casts and its `torch.autocast(enabled=False)` regions
kept, black-module patterns by the module the call runs in. It works above autograd, as torch.autocast's kernels do,
so the casts are differentiable and the FP32 parameters stay the master weights. What the lists say of each torch
callable (its op, decision, written arguments) is eager_rules.py's; this module applies it to each call's inputs.

Under torch.compile the mode does nothing while dynamo traces (the cast pass rewrites what it captures) and is
lifted while graphamp's graphs run, so no value is cast twice; what dynamo runs itself (code between graphs at a
graph break, skipped modules, a call past the recompile limit, a thread waiting for a compile, a call under a
dispatch mode) runs under it. rewrite() enters it around every call of the converted model.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import threading
import types
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode

from graphamp.errors import ArgumentError, DoubleAmpError, GraphampError, RewriteError
from graphamp.frontends.eager_rules import (
    FOLLOW, FOLLOWS_INPUTS, SCALED_CAST, SCALED_WRITE, UNKNOWN, ByOverload, Rule, Rules, all_tensors, first_tensor,
    has_rules, rules_for, runs_low_on_cached,
)
from graphamp.frontends.low_storage import stored_values
from graphamp.policy.cast_rule import cannot_run_fix, cast_target, decides_dtype
from graphamp.policy.config import (
    AmpConfig, check_level, check_module, is_normalization_module, warn_of_custom_fwd_casts,
)
from graphamp.policy.dtypes import HALF_DTYPES, dtype_name
from graphamp.policy.lists import BLACK, WHITE, AutoMixedPrecisionLists
from graphamp.torch_private import (
    dynamo_traces_this_thread, never_a_frame_of_its_own, outside_every_mode, rerun_checkpointed_region_as,
    tensor_version, tracing_on_fake_tensors,
)

__all__ = ["EagerPolicy", "ModelFacts", "auto_cast", "policy_lifted", "rules_for"]

_HALF = frozenset(HALF_DTYPES)
_WIDE = (torch.float32, torch.float64)
_OUT = frozenset({"out"})  # an out= buffer keeps its tensor: the result is written into it
_SCALAR_TYPE_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16"}  # as kernels' errors name them
_DTYPE = operator.attrgetter("dtype")
# Bound once: each is asked on every torch call, and an attribute chain costs more than the call.
_is_compiling = torch.compiler.is_compiling
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_increment_autocast_nesting = torch.autocast_increment_nesting
_decrement_autocast_nesting = torch.autocast_decrement_nesting
# The casts as Tensor methods: x.bfloat16() parses one signature, x.to(dtype) tries several (~0.9 µs less per cast).
_CAST_METHODS = {
    torch.float16: torch.Tensor.half, torch.bfloat16: torch.Tensor.bfloat16, torch.float32: torch.Tensor.float,
}


class EagerPolicy(TorchFunctionMode):
    """The mode auto_cast() enters: casts the floating inputs of each torch call by the lists (see the module's
    docstring). One per context; the rules are shared."""

    def __init__(self, rules: Rules, model_facts: ModelFacts | None = None, enabled: bool = True,
                 scaling=None):
        super().__init__()
        self._rules = rules
        # `scaling`: the linked loss scaling's edges (training/eager_scaling.ScaledCasts), for float16 lists
        self.scaling = scaling
        self._by_function = rules.by_function if scaling is None else rules.scaled_by_function
        self._rule_for = rules.rule_for if scaling is None else rules.scaled_rule_for
        self.low = rules.config.dtype
        self.level = rules.config.level
        self.enabled = enabled
        self._model = model_facts or ModelFacts()
        # Without black-module patterns a call's decision is its rule's alone: the hot path can skip the stack walk.
        self._by_op_alone = not self._model.black_modules
        # target dtype -> {id(weight): (weight, its version, its cast)}: as torch.autocast caches a weight's cast
        # for its context; and {id(activation): its cast, held weakly (_cast_once)}
        self._weight_casts: dict[torch.dtype, dict[int, tuple]] = {}
        self._activation_casts: dict[torch.dtype, dict[int, tuple]] = {}
        self._casters: dict = {}  # target dtype -> its cast (_cast_to)
        self._to_low = self._cast_to(self.low)
        self._autocast_nesting = 0
        self.cast_low = False  # whether this context cast a value low: rewrite() warns where loss scaling misses it

    def __enter__(self):
        if self.enabled:
            _refuse_enabled_autocast()
        self._autocast_nesting = _autocast_nesting()
        _entered.stack.append((self, self._autocast_nesting))
        if not self.enabled:
            return self
        _o2_running.depth += self.level == "O2"
        return super().__enter__()

    def __call__(self, function):
        """`@graphamp.auto_cast(lists)`: each call of the function runs in a context of its own, as under `with`
        (torch.autocast and Paddle's auto_cast decorate too); no cast outlives the call."""

        @functools.wraps(function)
        def under_the_policy(*args, **kwargs):
            with EagerPolicy(self._rules, self._model, self.enabled, self.scaling):
                return function(*args, **kwargs)

        return under_the_policy

    def __exit__(self, *exc):
        stack = _entered.stack
        del stack[max(i for i, (policy, _) in enumerate(stack) if policy is self)]
        if not self.enabled:
            return False
        _o2_running.depth -= self.level == "O2"
        for casts in (*self._weight_casts.values(), *self._activation_casts.values()):
            casts.clear()  # each caster holds its own dict: emptied, not replaced
        return super().__exit__(*exc)

    @never_a_frame_of_its_own
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # While dynamo traces, the cast pass decides what it captures. is_dynamo_compiling() is a constant to dynamo
        # and False eagerly in every thread, so dynamo inlines nothing of this mode but the call (GPT-2's trace
        # under the policy: +0.8 s -> +0.2 s over 2.1 s); other tracers (torch.export's) are told by the flag and
        # this thread's context.
        if _is_dynamo_compiling() or (_is_compiling() and dynamo_traces_this_thread()):
            return func(*args, **(kwargs or {}))
        rule = self._by_function.get(func, UNKNOWN)
        if rule is UNKNOWN:
            rule = self._rule_for(func)
        if type(rule) is ByOverload:  # (under linked scaling, its rules are scaled already: Rules.scaled_rule_for)
            rule = rule.pick(args, kwargs)
        try:
            if rule is None or (self._by_op_alone and rule is not FOLLOW and
                                rule.keeps((*args, kwargs.get("input"), *kwargs.values()) if kwargs else args)):
                # the common case, decided from the input dtypes alone (torch passes kwargs=None for a positional call;
                # `input` first: a norm's data, which a keyword call may pass after the weight)
                return func(*args, **kwargs) if kwargs else func(*args)
            return self._run_cast(func, rule, args, kwargs or {})
        except RuntimeError as error:  # free unless raised (Python 3.11's exception tables)
            if rule is None or rule is FOLLOW or isinstance(error, GraphampError) or \
                    _SCALAR_TYPE_NAMES[self.low] not in str(error):
                raise
            # the kernel has no implementation for the low dtype (fft_fft: "Unsupported dtype BFloat16")
            raise RewriteError(
                f"{rule.op} ({rule.decision}{f', {rule.source}' if rule.source else ''}) cannot run on "
                f"{dtype_name(self.low)} inputs under auto_cast's policy: {str(error).strip().splitlines()[0]}. "
                f"Fix: {cannot_run_fix(rule.op, rule.decision, rule.source)}."
            ) from error

    def _run_cast(self, func, rule, args, kwargs):
        """A call whose inputs the rule may cast: the rest of the rule, in order."""
        entered = _entered.stack
        if _lifted.depth or tracing_on_fake_tensors() or (entered and entered[-1][0] is not self):
            return func(*args, **kwargs)  # (an auto_cast entered inside this one decides: enabled=False, as written)
        rerun_checkpointed_region_as(self._under_this_policy)
        if rule is FOLLOW:
            return self._follow(func, args, kwargs)
        if rule is SCALED_CAST:
            return self._model_cast(func, args, kwargs)
        if rule is SCALED_WRITE:
            return self._as_written(func, rule, args, kwargs)
        if rule.same_dtype and 0 in rule.written and args and isinstance(args[0], torch.Tensor):
            # buffer.index_copy_(0, i, source): the source in the buffer's dtype, as in a graph (cast_pass.py)
            args, kwargs = _map_inputs(args, kwargs, rule, self._caster(args[0].dtype, ()))
            return func(*args, **kwargs)
        if _autocast_nesting() != (entered[-1][1] if entered else self._autocast_nesting) and \
                self._in_autocast_region(args):
            return self._as_written(func, rule, args, kwargs)  # the model's torch.autocast(enabled=False) region
        decision = rule.decision
        if not self._by_op_alone and self._model.black_module_running() is not None:
            decision = BLACK
        elif decision is WHITE and not kwargs and _hot_path_fits(rule, args):
            # the hot path (a GEMM or convolution on positional tensors): each float32 input cast down, nothing else
            to_low, cast = self._to_low, []
            for value in args:  # a loop: a comprehension costs a frame more on every call
                cast.append(to_low(value) if isinstance(value, torch.Tensor) else value)
            return func(*cast)
        if "dtype" in kwargs and isinstance(kwargs["dtype"], torch.dtype) and kwargs["dtype"].is_floating_point:
            return self._as_written(func, rule, args, kwargs)  # softmax(x, dtype=torch.float32): the model's dtype
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor) and decision in (WHITE, BLACK):
            # torch.mm(a, b, out=buffer): the op runs in its listed dtype, as it would in a graph (where out= is a
            # copy into the buffer), and the buffer keeps the dtype the code gave it.
            args, kwargs = self._cast_inputs(func, rule, decision, args, {k: v for k, v in kwargs.items() if k != "out"})
            return out.copy_(func(*args, **kwargs))
        cast_args, cast_kwargs = self._cast_inputs(func, rule, decision, args, kwargs)
        if self.scaling is not None:
            cast_args, cast_kwargs = self._across_the_edge(rule, cast_args, cast_kwargs)
        if cast_kwargs.get("dtype") is kwargs.get("dtype"):
            return func(*cast_args, **cast_kwargs)
        try:  # a black op given dtype=float32 (_cast_inputs)
            return func(*cast_args, **cast_kwargs)
        except RuntimeError:  # linalg.matrix_norm of ord 2 or 'nuc' refuses low inputs whatever the dtype: cast them
            cast_args, cast_kwargs = _map_inputs(args, kwargs, rule, self._cast_to(torch.float32))
            return func(*cast_args, **cast_kwargs)

    def _as_written(self, func, rule, args, kwargs):
        if self.scaling is not None:
            args, kwargs = self._across_the_edge(rule, args, kwargs)
        return func(*args, **kwargs)

    def _model_cast(self, func, args, kwargs):
        """The model's own cast (`x.float()`, `x.to(dtype)`) of a value needing a gradient, under linked float16
        scaling: one across float16's edge is a scaled cast too (its first autograd record is dropped)."""
        result = func(*args, **kwargs)
        source, low = args[0], self.low
        if not (isinstance(result, torch.Tensor) and isinstance(source, torch.Tensor) and torch.is_grad_enabled()):
            return result
        into_low = type(result) is torch.Tensor and result.dtype == low and source.dtype in _WIDE
        if into_low or (type(source) is torch.Tensor and source.dtype == low and result.dtype in _WIDE):
            self.cast_low |= into_low
            return self.scaling.cast(source, lambda _: result.detach(), into_low)
        return result

    def _across_the_edge(self, rule, args, kwargs):
        """The call's inputs needing a gradient on the other side of float16's edge from its result cast there by
        scaled casts, under linked float16 scaling: the op would cross inside (promotion, an in-place op into the
        other dtype, `dtype=float32`, a normalization's float32 parameters), where autograd casts the gradient
        back unscaled."""
        tensors = [t for t in all_tensors(args, kwargs) if t.dtype.is_floating_point]
        low = self.low
        if not torch.is_grad_enabled() or not any(type(t) is torch.Tensor and t.dtype == low for t in tensors):
            return args, kwargs
        target = args[0] if 0 in rule.written and args and isinstance(args[0], torch.Tensor) else None
        data = _norm_data(args, kwargs) if rule.norm else None
        dtype = kwargs.get("dtype")
        if target is not None or data is not None:  # the op writes into its target, or normalizes in its data's dtype
            result_low = (target if target is not None else data).dtype == low
        elif isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            result_low = dtype == low
        else:  # type promotion: a 0-dim tensor takes no part
            result_low = not any(t.dtype in _WIDE and t.dim() > 0 for t in tensors)
        crossing = {id(t) for t in tensors if t.requires_grad and t is not target and (t.dtype == low) != result_low}
        if not crossing:
            return args, kwargs
        if result_low:
            def cast(t):  # a normalization's float32 parameter stays float32: only its gradient is unscaled
                return self.scaling.cast(t, _same, True) if data is not None and t is not data else self._to_low(t)
        else:
            cast = self._cast_to(torch.float32)
        return _mapped(args, kwargs, lambda t: cast(t) if id(t) in crossing else t)

    def _under_this_policy(self, function):
        """`function` run under a policy of the same rules and model: a torch.utils.checkpoint region this policy
        casts in is rerun in backward, where no policy is entered; so it saves what the forward saved (torch checks),
        as the checkpoint reenters autocast for autocast's casts."""
        def under_the_policy(*args, **kwargs):
            with EagerPolicy(self._rules, self._model, scaling=self.scaling):
                return function(*args, **kwargs)

        under_the_policy.graphamp_wrapped = True
        return under_the_policy

    # -- deciding --------------------------------------------------------------------------------------------
    def _cast_inputs(self, func, rule: Rule, decision: str, args, kwargs):
        floats = _floating_inputs(args, kwargs, rule)
        if not floats:
            return args, kwargs
        follows_inputs = decision in FOLLOWS_INPUTS
        # only a gray op's inputs decide (white and black name their dtype)
        target = cast_target(decision, self.level, self.low, _deciding_dtypes(floats) if follows_inputs else [])
        if target is None:
            return args, kwargs
        if target == torch.float32 and follows_inputs and not (rule.promotes or rule.same_dtype) and \
                self._promotes_to_fp32(func, args, kwargs):
            return args, kwargs  # add(bf16, fp32) computes in FP32 inside the kernel: a cast would only cost
        if target == self.low and rule.norm and not runs_low_on_cached(rule.op, floats[0].device, self.low):
            target = torch.float32  # this device's norm kernel wants X in its parameters' dtype
        if target == torch.float32 and decision == BLACK:
            if not any(tensor.dtype in _HALF for tensor in floats):
                return args, kwargs  # no low input
            if rule.dtype_argument and kwargs.get("dtype") is None:  # torch.norm passes dtype=None on
                return args, {**kwargs, "dtype": torch.float32}  # the kernel reads low X and computes in float32
        return _map_inputs(args, kwargs, rule, self._cast_to(target))

    def _cast_to(self, target: torch.dtype):
        """The cast to `target` of the lists' rule, made once per policy (O2's norm parameters stay FP32)."""
        cast = self._casters.get(target)
        if cast is None:
            cast = self._casters[target] = self._caster(target, self._model.kept_fp32 if target == self.low else ())
        return cast

    def _caster(self, target: torch.dtype, kept: set):
        """The cast of one input to `target`: only float32 down to low (as torch.autocast), any other floating dtype
        but float64 up to float32; a weight's cast made once per context and version."""
        weight_casts = self._weight_casts.setdefault(target, {})
        activation_casts = self._activation_casts.setdefault(target, {})
        convert = _CAST_METHODS.get(target) or (lambda tensor: tensor.to(target))
        low_target = target in HALF_DTYPES
        if self.scaling is not None:  # linked float16 scaling: a cast across float16's edge scales the gradient
            unscaled, scaling, into_low = convert, self.scaling, target == self.low

            def convert(tensor):
                if into_low or tensor.dtype == self.low:
                    return scaling.cast(tensor, unscaled, into_low)
                return unscaled(tensor)
        float32, float64 = torch.float32, torch.float64

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            dtype = tensor.dtype
            if low_target:
                if dtype is not float32 or (kept and id(tensor) in kept):
                    return tensor  # O2's norm parameters (kept) stay FP32
                self.cast_low = True
            elif dtype is target or dtype is float64 or not dtype.is_floating_point:
                return tensor
            if tensor.requires_grad and tensor.is_leaf:  # a weight: cast once per context, as torch.autocast
                cached = weight_casts.get(id(tensor))
                version, grad_enabled = tensor_version(tensor), torch.is_grad_enabled()
                # a cast made under no_grad has no history: a forward with grad on would train nothing through it
                if cached is not None and cached[0] is tensor and cached[1] == version and cached[3] >= grad_enabled:
                    return cached[2]
                result = convert(tensor)
                if not torch.is_inference_mode_enabled():  # an inference tensor cannot join a graph later
                    weight_casts[id(tensor)] = (tensor, version, result, grad_enabled)
                return result
            return _cast_once(tensor, convert, activation_casts)

        return cast

    def _promotes_to_fp32(self, func, args, kwargs) -> bool:
        """Whether torch's type promotion runs this call in FP32 on its mixed inputs as they are (asked once per
        function and input dtypes, on meta tensors)."""
        key = (func, *map(_DTYPE, all_tensors(args, kwargs)))
        known = self._rules.promotion.get(key)
        if known is None:
            known = self._rules.promotion[key] = _promotes_on_meta(func, args, kwargs)
        return known

    def _in_autocast_region(self, args) -> bool:
        """Inside a torch.autocast region the model's code entered: disabled, its ops run as written; enabled
        (accelerate's mixed_precision wraps forward in one), two AMP systems: refused as the cast pass refuses it."""
        devices = {t.device.type for t in all_tensors(args, None)} or {"cpu"}
        if any(torch.amp.autocast_mode.is_autocast_available(d) and torch.is_autocast_enabled(d) for d in devices):
            raise DoubleAmpError(
                "the model's code turns torch.autocast on inside graphamp's policy: two AMP systems are on, and "
                "autocast would override graphamp's lists. Turn one off: with accelerate, Accelerator("
                "mixed_precision='no'); with the HF Trainer (or TRL's configs), bf16=False and fp16=False; or drop "
                "the model's own torch.autocast."
            )
        return True

    # -- following Python functions ----------------------------------------------------------------------------
    def _follow(self, func, args, kwargs):
        """Run a torch.nn.functional Python function (F.cross_entropy) with this policy deciding its ATen calls:
        a copy of it whose torch-function checks are off, so that its body runs instead of dispatching here."""
        TorchFunctionMode.__enter__(self)  # pushed again for the body; the context's own state stays
        try:
            return _unchecked(func)(*args, **kwargs)
        finally:
            TorchFunctionMode.__exit__(self, None, None, None)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _unchecked_globals(module_globals: dict) -> dict:
    patched = dict(module_globals)
    for name in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
        if name in patched:
            patched[name] = _no_torch_function
    return patched


def _no_torch_function(*_args) -> bool:
    return False


_UNCHECKED: dict = {}
_UNCHECKED_GLOBALS: dict = {}


def _unchecked(function: types.FunctionType) -> types.FunctionType:
    copy = _UNCHECKED.get(function)
    if copy is None:
        module = function.__module__
        namespace = _UNCHECKED_GLOBALS.get(module)
        if namespace is None:
            namespace = _UNCHECKED_GLOBALS[module] = _unchecked_globals(function.__globals__)
        copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                                  function.__closure__)
        copy.__kwdefaults__ = function.__kwdefaults__
        _UNCHECKED[function] = copy
    return copy


# -- inputs -----------------------------------------------------------------------------------------------------
def _hot_path_fits(rule: Rule, args) -> bool:
    """Whether a white call's positional tensors, each cast down, are all its rule casts: the op writes none of them
    and is no normalization (plain), and no argument is a list or tuple but one holding no tensor (conv2d's stride)."""
    if not rule.plain:
        return False
    for value in args:  # isinstance: a named tuple of operands (einsum's, multi_dot's) is cast on the full path
        if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
            return False
    return True


def _deciding_dtypes(floats: list[torch.Tensor]) -> list[torch.dtype]:
    """The dtypes that decide a gray op: its floating inputs' but a 0-dim or empty tensor's (cast_rule.decides_dtype),
    unless it has no other. A graph's low output presented as float32 decides by its storage, as the next graph
    decides on it (cast_pass.py): code dynamo runs between two graphs decides as it would without the break."""
    dtypes = [stored_values(tensor).dtype for tensor in floats if decides_dtype(tensor)]
    return dtypes or [stored_values(tensor).dtype for tensor in floats]


def _floating_inputs(args, kwargs, rule: Rule) -> list[torch.Tensor]:
    """The floating tensors that decide and get cast: not an in-place op's target, an `out=`, or a norm's
    parameters."""
    if rule.norm:  # only its data decides and is cast
        data = _norm_data(args, kwargs)
        return [data] if data is not None and data.dtype.is_floating_point else []
    written = rule.written
    kept = [*(v for i, v in enumerate(args) if i in written), *(v for k, v in kwargs.items() if k in written)]
    tensors = []
    for value in (*args, *(v for k, v in kwargs.items() if k != "out")) if kwargs else args:
        if isinstance(value, torch.Tensor):
            if value.dtype.is_floating_point and not any(value is t for t in kept):
                tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors += [t for t in value if isinstance(t, torch.Tensor) and t.dtype.is_floating_point
                        and not any(t is k for k in kept)]
    return tensors


def _norm_data(args, kwargs) -> torch.Tensor | None:
    """A normalization's data: its first argument, `input`, which a keyword call may pass after the weight."""
    return first_tensor(args[:1] or (kwargs.get("input"),))


def _mapped(args, kwargs, function, left: frozenset = frozenset()):
    """The call's arguments with `function` applied to each tensor, into the lists and tuples that hold one (the
    others are passed on as they are), but the arguments at the positions and names in `left`."""
    def one(value):
        if isinstance(value, torch.Tensor):
            return function(value)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return _rebuilt(value, [one(v) for v in value])
        return value

    args = tuple(value if index in left else one(value) for index, value in enumerate(args))
    return args, {k: (v if k in left else one(v)) for k, v in kwargs.items()} if kwargs else {}


def _rebuilt(container: list | tuple, items: list):
    """`container`'s type holding `items`: a named tuple takes them by field."""
    return type(container)(*items) if hasattr(container, "_fields") else type(container)(items)


def _map_inputs(args, kwargs, rule: Rule, cast):
    """The call's floating inputs the rule casts, each through `cast`: not those it writes, an `out=`, or a norm's
    parameters."""
    data = _norm_data(args, kwargs) if rule.norm else None

    def one(tensor):
        if not tensor.dtype.is_floating_point or (rule.norm and tensor is not data):
            return tensor
        return cast(tensor)

    return _mapped(args, kwargs, one, rule.written | _OUT)


def _cast_once(tensor: torch.Tensor, convert, casts: dict) -> torch.Tensor:
    """An activation several ops read (q, k and v of one normalized hidden state) is cast once per context, as the
    cast pass casts a value once: one cast kernel, and its readers' gradients summed before one cast back. Both held
    weakly, so that the context keeps nothing alive; a cast made under another grad mode is not reused."""
    if tensor.is_inference() or torch.is_inference_mode_enabled():  # no version counter (of it, or its cast)
        return convert(tensor)
    grad_enabled = torch.is_grad_enabled()
    cached = casts.get(id(tensor))
    if cached is not None:
        source, version, result, made_with_grad, result_version = cached
        result = result()
        if source() is tensor and version == tensor_version(tensor) and made_with_grad == grad_enabled and \
                result is not None and result_version == tensor_version(result):
            return result
    result = convert(tensor)
    casts[id(tensor)] = (weakref.ref(tensor), tensor_version(tensor), weakref.ref(result), grad_enabled,
                         tensor_version(result))
    return result


def _promotes_on_meta(func, args, kwargs) -> bool:
    def meta(value):
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        if isinstance(value, (list, tuple)):
            return _rebuilt(value, [meta(v) for v in value])
        return value

    try:  # outside the caller's dispatch modes: a recorder or a FlopCounterMode sees no call of this probe
        with torch.no_grad(), warnings.catch_warnings(), outside_every_mode():
            warnings.simplefilter("ignore")
            result = func(*(meta(a) for a in args), **{k: meta(v) for k, v in kwargs.items()})
    except Exception:  # the op wants matching dtypes: cast explicitly
        return False
    results = result if isinstance(result, (list, tuple)) else (result,)
    floats = [t for t in results if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return bool(floats) and all(t.dtype == torch.float32 for t in floats)


def _autocast_nesting() -> int:
    """How many torch.autocast regions are open on this thread (read through the public increment/decrement)."""
    _increment_autocast_nesting()
    return _decrement_autocast_nesting()


# -- the model ----------------------------------------------------------------------------------------------------
class ModelFacts:
    """What the policy needs of the model the code runs: the modules black-module patterns keep FP32 (with the
    code of their forward, to find them on the stack) and, under O2, the normalization parameters."""

    def __init__(self, model: torch.nn.Module | None = None, config: AmpConfig | None = None):
        self.black_modules: dict[int, str] = {}  # id(module) -> the pattern's source
        self.black_codes: set = set()
        self.kept_fp32: set[int] = set()
        if model is None:
            return
        if config.lists.black_modules:
            for path, pattern in config.lists.black_modules_in(model).items():  # one walk of the model
                module = model.get_submodule(path)
                self.black_modules[id(module)] = pattern.source
                forward = module.forward
                self.black_codes.add(getattr(getattr(forward, "__func__", forward), "__code__", None))
        if config.level == "O2":
            for module in model.modules():
                if is_normalization_module(type(module)):
                    self.kept_fp32.update(id(parameter) for parameter in module.parameters(recurse=False))
                elif isinstance(module, torch.nn.RNNBase) and module not in _RNNS_HOOKED:
                    module.register_forward_pre_hook(_rnn_input_in_weight_dtype)
                    _RNNS_HOOKED.add(module)

    def black_module_running(self) -> str | None:
        """The black-module pattern of the innermost listed module whose forward is on the stack, if any."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in self.black_codes:
                source = self.black_modules.get(id(frame.f_locals.get("self")))
                if source is not None:
                    return source
            frame = frame.f_back
        return None


class _Depth(threading.local):
    depth = 0  # how many are entered on this thread


_o2_running = _Depth()  # O2 policies


class _Entered(threading.local):
    """The policies entered on this thread (enabled or not), innermost last, each with the torch.autocast nesting at
    its entry: only the innermost decides, as with nested torch.autocast contexts. (An autograd worker thread has
    none: there the policy the mode stack reached decides.)"""

    def __init__(self):
        self.stack: list[tuple[EagerPolicy, int]] = []


_entered = _Entered()

_RNNS_HOOKED: weakref.WeakSet = weakref.WeakSet()


def _rnn_input_in_weight_dtype(module: torch.nn.RNNBase, args: tuple):
    """nn.LSTM/GRU/RNN's Python forward refuses an input of another dtype than its weights before any op runs, and
    O2 makes the layer before it low: the input goes in at the weights' dtype and the RNN op, all but black low under
    O2, casts it down again, as it runs in a graph (where dynamo checked the dtypes before the casts were put in)."""
    if _is_compiling() or not _o2_running.depth or not args:
        return None
    first = args[0]
    data = first.data if isinstance(first, torch.nn.utils.rnn.PackedSequence) else first
    weight_dtype = module.weight_ih_l0.dtype
    if isinstance(data, torch.Tensor) and data.is_floating_point() and data.dtype != weight_dtype:
        return (first.to(weight_dtype), *args[1:])
    return None


def _refuse_enabled_autocast() -> None:
    for device in ("cpu", "cuda"):
        if torch.amp.autocast_mode.is_autocast_available(device) and torch.is_autocast_enabled(device):
            raise DoubleAmpError(
                f"graphamp's policy was entered inside an active torch.autocast region on {device}: two AMP systems "
                "are on, and autocast would override graphamp's lists. Turn one off: drop the torch.autocast context "
                "(with accelerate, Accelerator(mixed_precision='no'); with Lightning, precision='32-true'; with the "
                "HF Trainer, bf16=False and fp16=False), or train under autocast without graphamp."
            )


# -- graphamp's graphs --------------------------------------------------------------------------------------------
_lifted = _Depth()  # policy_lifted() blocks


@contextlib.contextmanager
def policy_lifted():
    """While graphamp's own graphs run: their casts are in them, the policy leaves their torch calls alone."""
    _lifted.depth += 1
    try:
        yield
    finally:
        _lifted.depth -= 1


def auto_cast(amp_lists: AutoMixedPrecisionLists | None = None, level: str = "O1", enabled: bool = True, *,
              model: torch.nn.Module | None = None) -> EagerPolicy:
    """Run the code inside in mixed precision by graphamp's lists, eagerly (Paddle's dygraph `auto_cast`).

    `with graphamp.auto_cast(lists): loss = model(x)` decides each torch call as the cast pass decides the same op
    in a graph: white ops in the lists' dtype, black ops in float32, gray ops follow their floating inputs; the
    model's own casts and `torch.autocast(enabled=False)` regions stay as written. Parameters stay FP32 (the
    master weights); their casts are made once per context, as torch.autocast's. Around a torch.compile'd call,
    graphamp's graphs keep their own casts and the code dynamo runs eagerly follows the lists.

    Args:
        amp_lists: the lists and dtype (default: the shipped lists in float16).
        level: "O1" (the lists decide) or "O2" (all but black ops run low; normalization parameters stay FP32,
            which needs `model`).
        enabled: False runs the code inside as written (as torch.autocast(enabled=False)).
        model: the model the code runs, for black-module patterns (module paths are its own) and O2's
            normalization parameters.

    Returns:
        The context manager (a TorchFunctionMode), which also decorates a function, as torch.autocast does.
    """
    if amp_lists is not None and not isinstance(amp_lists, AutoMixedPrecisionLists):
        raise ArgumentError(
            f"auto_cast(amp_lists=...) got a {type(amp_lists).__name__}; pass graphamp.AutoMixedPrecisionLists(...)."
        )
    if not isinstance(enabled, bool):
        raise ArgumentError(f"auto_cast(enabled={enabled!r}): pass True or False.")
    check_level(level)
    if model is not None:
        check_module(model, "auto_cast(model=...)")
    config = AmpConfig(amp_lists if amp_lists is not None else AutoMixedPrecisionLists(), level)
    if not has_rules(config):  # once per lists: the scan costs ~1 ms, and a loop enters auto_cast every step
        warn_of_custom_fwd_casts("auto_cast")
    if model is not None:  # at every entry, as rewrite() does: the lists may be new to this model
        config.lists.warn_unmatched_black_modules(model, stacklevel=3)
    if model is None and config.lists.black_modules:
        warnings.warn(
            f"auto_cast(): the lists' black-module patterns ({', '.join(p.name for p in config.lists.black_modules)}) "
            f"apply only with auto_cast(..., model=model), whose module paths they name; without it those modules "
            f"follow the op lists.",
            stacklevel=2,
        )
    return EagerPolicy(rules_for(config), ModelFacts(model, config) if model is not None else None, enabled)

