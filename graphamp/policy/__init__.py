"""The policy, defined once: the lists, the dtypes, what the passes ask of an op, and AmpConfig."""
