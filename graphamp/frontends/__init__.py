"""The front ends: rewrite() and graphamp.backend() train under torch.compile; export_program() is the static program."""
