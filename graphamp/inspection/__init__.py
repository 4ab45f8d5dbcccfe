"""Inspection: what the cast pass did, as files (graph.py, graph.json, graph.svg, report.html, diff.txt).

`graphamp.export(amp_model, out_dir)` is the entry point; `recording.DtypeRecorder` counts the dtypes kernels
execute with.
"""
