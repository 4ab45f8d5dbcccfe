"""The list files on disk: their names, where the shipped ones live, and how one file is read.

A list file holds one op (or, in black_modules.txt, one module pattern) a line, `#` comments, and optional
`[all]`/`[float16]`/`[bfloat16]` sections; lists/README.md is the format's manual.
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphamp.errors import ListFileError

__all__ = [
    "BLACK_MODULES_FILE", "LIST_FILES", "OP_LIST_FILES", "PROMOTE_FILE", "SECTIONS", "default_lists_dir",
    "read_list_file",
]

OP_LIST_FILES = {"white": "white.txt", "black": "black.txt", "gray": "gray.txt"}  # by color
BLACK_MODULES_FILE = "black_modules.txt"
PROMOTE_FILE = "promote.txt"  # ops whose mixed floating inputs are cast to the widest (autocast's promote)
LIST_FILES = (*OP_LIST_FILES.values(), BLACK_MODULES_FILE, PROMOTE_FILE)
SECTIONS = {"all": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_lists_dir() -> Path:
    """The shipped lists: graphamp/default_lists in an installed wheel, the top-level lists/ in a checkout."""
    package_dir = Path(__file__).resolve().parent
    installed = package_dir / "default_lists"
    return installed if installed.is_dir() else package_dir.parent / "lists"


def read_list_file(path: Path, dtype: torch.dtype, display: str | None = None) -> list[tuple[str, str]]:
    """(entry, 'file:line') pairs of one list file that apply to `dtype`, in file order.

    Raises ListFileError for an unreadable file, an unknown section or a line holding more than one name.
    """
    display = display or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ListFileError(f"{display}: cannot read list file ({error}).") from error
    section_dtype = None
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        where = f"{display}:{number}"
        if not line:
            continue
        if line.startswith("["):
            name = line.strip("[]").strip()
            if not line.endswith("]") or name not in SECTIONS:
                raise ListFileError(
                    f"{where}: unknown section {line!r}; use [all], [float16] or [bfloat16] on a line of its own."
                )
            section_dtype = SECTIONS[name]
            continue
        if len(line.split()) != 1:
            raise ListFileError(f"{where}: {line!r} holds more than one name; write one op a line.")
        if section_dtype is None or section_dtype == dtype:
            entries.append((line, where))
    return entries
