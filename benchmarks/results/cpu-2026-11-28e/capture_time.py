"""Seconds to the end of the first train step (capture + first run), one fresh process per (model, mode).

Run from the repository root: python benchmarks/results/cpu-2026-11-28e/capture_time.py {bert,gpt2,llama} {graphamp,autocast}
"""
import sys, time, torch
sys.path.insert(0, "benchmarks")
import graphamp
from bench_models import bert, gpt2, llama
model_name, mode = sys.argv[1], sys.argv[2]
w = {"bert": bert, "gpt2": gpt2, "llama": llama}[model_name]("cpu")
inputs, target = w.batches[0]
# the same imports and first-compile set-up in both modes, outside the timing
_warm = torch.nn.Linear(4, 4)
with torch.autocast("cpu", torch.bfloat16):
    torch.compile(_warm, backend="aot_eager")(torch.randn(2, 4)).sum().backward()
torch._dynamo.reset()
t = time.perf_counter()
if mode == "graphamp":
    graphamp.rewrite(w.model, amp_lists=graphamp.AutoMixedPrecisionLists(dtype="bfloat16"))
    w.loss(w.model(**inputs), target).backward()
else:
    net = torch.compile(w.model, backend="aot_eager")
    with torch.autocast("cpu", torch.bfloat16):
        loss = w.loss(net(**inputs), target)
    loss.backward()
print("RESULT", model_name, mode, round(time.perf_counter() - t, 3))
