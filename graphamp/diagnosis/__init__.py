"""Diagnosis: which op overflows or loses accuracy, measured node by node against FP32, and lists that fix it.

`graphamp.doctor` (diagnose.py) and `graphamp.auto_mixed_precision` (auto_lists.py) are the entry points.
"""
