"""A/B of auto_cast's cost per torch call: per_call_overhead.py's calls and contexts, plus the committed auto_cast
(old) beside the working tree's (new, the "graphamp.auto_cast" column), interleaved, best of rounds. Made the table
per_op_old_new.md (that run used this script's first, stand-alone version; the calls and the measure are these).

    git show d79bea5:graphamp/frontends/eager_policy.py > /tmp/old_policy.py
    PYTHONPATH=.:benchmarks python benchmarks/results/cpu-2026-11-28c/ab_old_new_per_op.py /tmp/old_policy.py 25
"""

import importlib.util
import sys

import torch

import graphamp
from graphamp.policy.config import AmpConfig
from per_call_overhead import best_per_call, per_op_calls, per_op_contexts

spec = importlib.util.spec_from_file_location("old_policy", sys.argv[1] if len(sys.argv) > 1 else "/tmp/old_policy.py")
old = importlib.util.module_from_spec(spec)
sys.modules["old_policy"] = old
spec.loader.exec_module(old)
torch.set_num_threads(1)

lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
contexts = {**per_op_contexts(lists), "old": lambda: old.EagerPolicy(old.rules_for(AmpConfig(lists, "O1")))}
print("| call | " + " | ".join(f"{c} µs" for c in contexts) + " | old − autocast | new − autocast |")
print("|---|" + "---:|" * (len(contexts) + 2))
for name, t in best_per_call(per_op_calls(), contexts, int(sys.argv[2]) if len(sys.argv) > 2 else 25).items():
    print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in t.values())
          + f" | {t['old'] - t['torch.autocast']:+.2f} | {t['graphamp.auto_cast'] - t['torch.autocast']:+.2f} |")
