"""A/B: torch.autocast, an empty TorchFunctionMode, the committed auto_cast (old: `git show d79bea5:graphamp/frontends/eager_policy.py > /tmp/old_policy.py`) and the working tree's (new), interleaved, best of rounds.

    PYTHONPATH=. python benchmarks/results/cpu-2026-11-28c/ab_old_new_per_op.py "" 25 /tmp/old_policy.py
"""
import sys, time, contextlib, importlib.util
import torch, torch.nn.functional as F
import graphamp
from graphamp.frontends import eager_policy as new
spec = importlib.util.spec_from_file_location("old_policy", sys.argv[3] if len(sys.argv) > 3 else "/tmp/old_policy.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_policy"] = old; spec.loader.exec_module(old)
torch.set_num_threads(1)
lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
x, low = torch.randn(4, 16), torch.randn(4, 16, dtype=torch.bfloat16)
w, b = torch.randn(16, 16, requires_grad=True), torch.randn(16, requires_grad=True)
lw, lb = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
xb = x.bfloat16()
calls = {"linear": lambda: F.linear(x, w, b), "add": lambda: low + 1, "relu": lambda: torch.relu(low),
         "mul": lambda: low * low, "view": lambda: low.view(64), "sum(black)": lambda: low.sum(-1), "softmax(black)": lambda: torch.softmax(low, -1),
         "add fp32+bf16": lambda: x + xb, "layer_norm": lambda: F.layer_norm(low, (16,), lw, lb),
         "batch_norm": lambda: F.batch_norm(lowc, rm, rv, lw[:4], lb[:4])}
lowc, rm, rv = torch.randn(2, 4, 4, 4, dtype=torch.bfloat16), torch.zeros(4), torch.ones(4)
only = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else list(calls)
class Nothing(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
ctx = {"no AMP": contextlib.nullcontext, "autocast": lambda: torch.autocast("cpu", torch.bfloat16), "empty mode": Nothing,
       "old": lambda: old.EagerPolicy(old.rules_for(new.AmpConfig(lists, "O1"))),
       "new": lambda: new.EagerPolicy(new.rules_for(new.AmpConfig(lists, "O1")))}
N, R = 1000, int(sys.argv[2]) if len(sys.argv) > 2 else 25
print("| call | " + " | ".join(f"{c} µs" for c in ctx) + " | old − autocast | new − autocast |")
print("|---|" + "---:|" * (len(ctx) + 2))
for name in only:
    call = calls[name]
    best = dict.fromkeys(ctx, 1e9)
    for _ in range(R):
        for m, c in ctx.items():
            with c():
                t = time.perf_counter_ns()
                for _ in range(N):
                    call()
                best[m] = min(best[m], (time.perf_counter_ns() - t) / N / 1e3)
    print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in best.values()) +
          f" | {best['old']-best['autocast']:+.2f} | {best['new']-best['autocast']:+.2f} |", flush=True)
