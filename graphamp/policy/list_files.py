"""The list files on disk: their names, where the shipped ones live, and how one file is read.

A list file holds one op (or, in black_modules.txt, one module pattern) a line, `#` comments, and optional
`[all]`/`[float16]`/`[bfloat16]` sections; lists/README.md is the format's manual.
"""

from __future__ import annotations

import codecs
import difflib
import os
import re
import warnings
from pathlib import Path

import torch

from graphamp.errors import ListFileError

__all__ = [
    "BLACK_MODULES_FILE", "LIST_FILES", "OP_LIST_FILES", "PROMOTE_FILE", "SECTIONS", "check_lists_folder",
    "check_visible", "default_lists_dir", "no_white_entries", "read_list_entries",
]

OP_LIST_FILES = {"white": "white.txt", "black": "black.txt", "gray": "gray.txt"}  # by color
BLACK_MODULES_FILE = "black_modules.txt"
PROMOTE_FILE = "promote.txt"  # ops whose mixed floating inputs are cast to the widest (autocast's promote)
LIST_FILES = (*OP_LIST_FILES.values(), BLACK_MODULES_FILE, PROMOTE_FILE)
SECTIONS = {"all": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_lists_dir() -> Path:
    """The shipped lists: graphamp/default_lists in an installed wheel, the top-level lists/ in a checkout."""
    package_dir = Path(__file__).resolve().parent.parent
    installed = package_dir / "default_lists"
    return installed if installed.is_dir() else package_dir.parent / "lists"


def check_lists_folder(folder: Path) -> None:
    """Raise ListFileError for a folder that would silently load as empty or partial lists (a misnamed list file
    would be ignored); warn for one whose white.txt holds no entry."""
    if not isinstance(folder, (str, os.PathLike)):
        raise ListFileError(f"lists_dir={folder!r}: pass the path of a lists folder (a str or a Path).")
    folder = Path(folder)
    if not folder.is_dir():
        raise ListFileError(f"{folder}: lists_dir is not a folder; pass a folder holding {', '.join(LIST_FILES)}.")
    for path in sorted(folder.iterdir()):
        if path.is_file() and (meant := _meant_list_file(path.name)):
            raise ListFileError(f"{path}: graphamp does not read this file; did you mean {meant}?")
    if not {p.name for p in folder.glob("*.txt")} & set(LIST_FILES):
        raise ListFileError(
            f"{folder}: holds none of {', '.join(LIST_FILES)}; a lists folder replaces the shipped lists, "
            f"so it would leave every op unlisted. Copy graphamp's lists/ folder and edit it."
        )
    if message := no_white_entries(folder):
        warnings.warn(message, stacklevel=3)  # at the caller of AutoMixedPrecisionLists(lists_dir=...)


def _meant_list_file(name: str) -> str | None:
    """The list file a file of a lists folder was meant to be ('White.txt', 'white.TXT', 'white.list', 'whitelist.txt':
    all white.txt), or None for one graphamp may ignore (README.md, notes.txt, an editor's backup white.txt~)."""
    if name in LIST_FILES or name.startswith(".") or name.lower().endswith(("~", ".bak", ".orig", ".swp")):
        return None
    stem, _, extension = name.lower().rpartition(".") if name.count(".") == 1 else (name.lower(), "", "")
    stem = re.sub(r"[_-]?lists?$", "", stem) or stem  # 'whitelist', Paddle's 'white_list'
    stems = {file.removesuffix(".txt"): file for file in LIST_FILES}
    if extension != "txt":  # another extension (white.list, white): the list's own name only, not graph.json
        return stems.get(stem)
    close = difflib.get_close_matches(stem, stems, n=1, cutoff=0.6)
    return stems[close[0]] if close else None


def no_white_entries(folder: Path) -> str | None:
    """What to say of a lists folder whose white.txt is missing or holds no entry in any section (None if it holds
    one): with it nothing runs in low precision at level O1, since gray ops follow FP32 inputs."""
    path = Path(folder) / OP_LIST_FILES["white"]
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines() if path.exists() else []
    except (OSError, UnicodeDecodeError):
        return None  # reading it again raises the ListFileError that names the cause
    entries = [line.split("#", 1)[0].strip() for line in lines]
    if any(entry and not entry.startswith("[") for entry in entries):
        return None
    return (f"{path}: {'holds no entries' if path.exists() else 'is missing'}, so with the lists of {folder} no op "
            f"runs in low precision (level O1): every op but those a custom_white_list names runs in float32. Add "
            f"the ops to run low to {path.name}, e.g. mm, addmm, linear (graphamp's lists/white.txt is a start).")


def check_visible(text: str, where: str) -> None:
    """Raise ListFileError for an invisible or control character (zero-width space, ...), shown escaped: it makes
    'mm' a different, unknown name while the message would print them alike."""
    for character in text:
        if not character.isprintable() and character not in " \t":
            escaped = character.encode("unicode_escape").decode("ascii")
            shown = text.strip(" \t")  # not strip(): that would drop a no-break space from the line shown
            raise ListFileError(
                f"{where}: {shown!r} holds the invisible character '{escaped}'; delete it (retype the line)."
            )


def read_list_entries(path: Path, display: str, globs: bool = False) -> list[tuple[str, str, torch.dtype | None]]:
    """(entry, 'file:line', section dtype) triples of one list file, every section, in file order; the section
    dtype is None under [all] (and at the top of a file). Raises ListFileError for an unreadable file, an unknown
    section, an invisible character or a line holding more than one name. With `globs` (black_modules.txt) a
    bracketed line that names no section is an entry: '[ab]*' is a glob."""
    try:
        data = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # editors on Windows start files with a BOM
    except OSError as error:
        raise ListFileError(f"{display}: cannot read list file ({error}).") from error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ListFileError(
            f"{display}:{line}: byte {data[error.start]:#04x} (offset {error.start}) is not UTF-8; save the file as "
            f"UTF-8."
        ) from error
    section_dtype = None
    entries = []
    # Lines end at \n, \r\n or \r, as an editor counts them: str.splitlines() also breaks at \f, \x85 and U+2028,
    # which would shift every later line number and make the text after one in a comment an entry.
    for number, raw in enumerate(re.split(r"\r\n|\r|\n", text), start=1):
        where = f"{display}:{number}"
        check_visible(raw.split("#", 1)[0], where)  # before strip(), which would drop a trailing no-break space
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        section = line.strip("[]").strip() if line.endswith("]") else None
        if line.startswith("[") and not (globs and section not in SECTIONS):
            if section not in SECTIONS:
                raise ListFileError(
                    f"{where}: unknown section {line!r}; use [all], [float16] or [bfloat16] on a line of its own."
                )
            section_dtype = SECTIONS[section]
            continue
        if len(line.split()) != 1:
            raise ListFileError(f"{where}: {line!r} holds more than one name; write one op a line.")
        entries.append((line, where, section_dtype))
    return entries

