"""PyTorch's own autocast test table (torch/testing/_internal/autocast_test_lists.py, its CUDA lists), read on CPU.

The module imports torch's test utilities (which need `expecttest`) only for TEST_WITH_ROCM and TestCase, so the
class `AutocastTestLists` is taken from its source and run on its own. Each entry becomes (group, op, call,
inputs, expected output dtype under autocast float16).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.testing._internal

SOURCE = Path(torch.testing._internal.__file__).parent / "autocast_test_lists.py"
LOW_GROUPS = ("torch_fp16", "nn_fp16", "linalg_fp16", "methods_fp16")
FP32_GROUPS = ("torch_fp32", "nn_fp32", "methods_fp32")
PROMOTE_GROUPS = ("torch_need_autocast_promote",)
BUILTIN_GROUPS = ("torch_expect_builtin_promote", "methods_expect_builtin_promote")
NAMESPACES = {"nn": torch._C._nn, "linalg": torch._C._linalg, "methods": torch.Tensor, "torch": torch}


def autocast_test_lists(device: str = "cpu"):
    tree = ast.parse(SOURCE.read_text())
    (table,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "AutocastTestLists"]
    namespace = {"torch": torch, "TEST_WITH_ROCM": False}
    exec(compile(ast.Module([table], type_ignores=[]), str(SOURCE), "exec"), namespace)
    return namespace["AutocastTestLists"](device)


def entries(device: str = "cpu"):
    """(group, op name, function, args, kwargs, expected dtype) for every entry but the banned ones."""
    lists = autocast_test_lists(device)
    for group in (*LOW_GROUPS, *FP32_GROUPS, *PROMOTE_GROUPS, *BUILTIN_GROUPS):
        function_of = NAMESPACES[group.split("_")[0]]
        for entry in getattr(lists, group):
            op, args = entry[0], entry[1]
            extra = entry[2:]
            kwargs = next((e for e in extra if isinstance(e, dict)), {})
            if group in LOW_GROUPS:
                expected = torch.float16
            elif group in BUILTIN_GROUPS:
                expected = extra[0]
            else:  # FP32 ops, and promote ops on float16/float32 mixes: the widest type
                expected = torch.float32
            function = getattr(function_of, op, None)
            if function is not None:
                yield group, op, function, args, kwargs, expected
