"""Two train-step modes of interleaved_step.py, A/B: only those two models in memory, their order reversed every
round, so neither always runs after a third mode (the four-mode run puts autocast between FP32 and graphamp).

    PYTHONPATH=. python benchmarks/ab_step.py --model gpt2 --modes autocast,auto_cast --rounds 16

Prints each mode's median step time and the first mode's step time over each other's, per round (median, range).
"""

from __future__ import annotations

import argparse
import statistics

from interleaved_step import measure, steps_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--modes", default="autocast,auto_cast", help="two of interleaved_step.py's modes")
    parser.add_argument("--compiled", action="store_true", help="the compiled modes (auto_cast has none)")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    args = parser.parse_args()
    modes = args.modes.split(",")
    steps = steps_for(args.model, args.compiled, "cpu")
    result = measure({mode: steps[mode] for mode in modes}, args.rounds, args.steps, "cpu")
    base = result[modes[0]][2]
    for mode in modes[1:]:
        ratios = [a / b for a, b in zip(base, result[mode][2])]
        print(f"{args.model}: {modes[0]} {result[modes[0]][0] * 1e3:.1f} ms, {mode} {result[mode][0] * 1e3:.1f} ms; "
              f"{modes[0]}/{mode} per round: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
