"""What an AmpModule composes at run time around its rewritten graphs.

Which capture serves a call (shapes, fingerprint), how the graph runs (compiled, progress, regions,
checkpointing, module_hooks), loss scaling inside the graph (in_graph_scaling), the low-precision weights kept
between forwards (weight_cache), and HF generate() through rewritten graphs (generation).
"""
