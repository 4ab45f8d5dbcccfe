"""Inspection: what the cast pass did, as files (graph.py, graph.json, graph.svg, report.html, diff.txt).

`graphamp.export(program_or_model, out_dir)` is the entry point; `recording.DtypeRecorder` counts the dtypes kernels
execute with.
"""
