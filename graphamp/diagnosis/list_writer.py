"""write_lists(): a lists folder holding the effective lists, with changes for one dtype.

A lists folder replaces the shipped one (it is not merged with it), so every effective entry is written, each
with where it came from as a comment. Changes apply to the diagnosed dtype only: entries both dtypes share go
under [all], the others under [float16] or [bfloat16], so the other dtype reads back the lists it had.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from graphamp.errors import ListFileError
from graphamp.policy.dtypes import HALF_DTYPES, dtype_name
from graphamp.policy.list_files import BLACK_MODULES_FILE, LIST_FILES, PROMOTE_FILE, default_lists_dir
from graphamp.policy.lists import BLACK, COLORS, GRAY, WHITE, AutoMixedPrecisionLists, canonical_op_name, check_op_name

__all__ = ["write_lists"]

_WHAT = {
    "white.txt": "ops that run in the low dtype", "black.txt": "ops that run in float32",
    "gray.txt": "ops that follow their inputs", "black_modules.txt": "module patterns whose ops all run in float32",
    PROMOTE_FILE: "ops whose mixed floating inputs are cast to the widest",
}
_HEADER = """# {file}: {what}. Written by graphamp doctor for {dtype}.
# This folder replaces graphamp's shipped lists (it is not merged with them): use it with
# AutoMixedPrecisionLists(lists_dir={folder!r}). Each entry's comment says where it came from.
"""


def write_lists(
    folder, amp_lists: AutoMixedPrecisionLists, op_changes: Mapping[str, tuple[str, str]] | None = None,
    black_modules: Sequence[tuple[str, str]] = (), overwrite: bool = False,
) -> Path:
    """Write white.txt, black.txt, gray.txt and black_modules.txt to `folder` (created if missing): the lists
    of `amp_lists` with `op_changes` ({entry: (color, reason)}) and `black_modules` ([(pattern, reason)])
    applied for `amp_lists.dtype`; the other low dtype keeps what it had. Returns the folder."""
    folder = Path(folder)
    diagnosed = amp_lists.dtype
    other = next(d for d in HALF_DTYPES if d != diagnosed)
    changes = _checked_changes(op_changes or {})
    new_modules = [(_checked_pattern(pattern), reason) for pattern, reason in black_modules]
    refuse_to_overwrite(folder, amp_lists, overwrite)
    # The other dtype's lists come from the same folder and custom lists, rebuilt for that dtype.
    other_lists = AutoMixedPrecisionLists(
        custom_white_list=amp_lists.custom_lists[WHITE], custom_black_list=amp_lists.custom_lists[BLACK],
        custom_gray_list=amp_lists.custom_lists[GRAY], custom_black_modules=amp_lists.custom_black_modules,
        dtype=other, lists_dir=amp_lists.lists_dir,
    )
    ops = {lists.dtype: {e.name: (e.color, e.source) for e in lists.entries()} for lists in (amp_lists, other_lists)}
    for name, (color, reason) in changes.items():
        # An overload on no list of its own was decided by its packet entry ('mul.Tensor' by 'mul').
        was = ops[diagnosed].get(name) or ops[diagnosed].get(name.partition(".")[0], ("unlisted",))
        ops[diagnosed][name] = (color, f"doctor: {_one_line(reason)} (was {was[0]})")
    modules = {lists.dtype: {e.name: (BLACK, e.source) for e in lists.black_modules}
               for lists in (amp_lists, other_lists)}
    for pattern, reason in new_modules:
        modules[diagnosed].setdefault(pattern, (BLACK, f"doctor: {_one_line(reason)}"))

    folder.mkdir(parents=True, exist_ok=True)
    for file in LIST_FILES:
        header = _HEADER.format(file=file, what=_WHAT[file], dtype=dtype_name(diagnosed), folder=str(folder))
        if file == PROMOTE_FILE:  # no change of the doctor's touches it; each dtype keeps its own entries
            promote = {lists.dtype: {e.name: (e.color, e.source) for e in lists.promote_entries}
                       for lists in (amp_lists, other_lists)}
            body = _sections(promote, "promote", diagnosed, other)
        else:
            entries, color = (modules, BLACK) if file == BLACK_MODULES_FILE else (ops, file.removesuffix(".txt"))
            body = _sections(entries, color, diagnosed, other)
        (folder / file).write_text(header + body, encoding="utf-8")
    return folder


def _sections(entries: dict, color: str, diagnosed, other) -> str:
    """The [all], [float16] and [bfloat16] sections of the entries of `color`, one sorted entry a line."""
    sections: dict[str, list[tuple[str, str]]] = {"all": [], **{dtype_name(d): [] for d in HALF_DTYPES}}
    for name in sorted(set(entries[diagnosed]) | set(entries[other])):
        mine, theirs = entries[diagnosed].get(name, ("", "")), entries[other].get(name, ("", ""))
        if mine[0] == color and theirs[0] == color:
            # Same color, maybe from different lines: both sources stay visible, the diagnosed dtype's first.
            source = mine[1] if mine[1] == theirs[1] else f"{mine[1]}; {dtype_name(other)}: {theirs[1]}"
            sections["all"].append((name, source))
        elif mine[0] == color:
            sections[dtype_name(diagnosed)].append((name, mine[1]))
        elif theirs[0] == color:
            sections[dtype_name(other)].append((name, theirs[1]))
    width = max((len(name) for lines in sections.values() for name, _ in lines), default=0) + 2
    return "".join(
        f"\n[{section}]\n" + "".join(f"{name:<{width}}# {source}\n" for name, source in lines)
        for section, lines in sections.items() if lines
    )


def _checked_changes(op_changes: Mapping[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """The changes keyed by canonical name; a bad color or an unknown aten op fails before anything is written."""
    changes = {}
    for name, (color, reason) in op_changes.items():
        if color not in COLORS:
            raise ListFileError(f"op change {name!r}: color {color!r} is not one of {', '.join(COLORS)}.")
        check_op_name(canonical_op_name(name), f"op change {name!r}")
        changes[canonical_op_name(name)] = (color, reason)
    return changes


def _checked_pattern(pattern: str) -> str:
    """A module pattern that reads back as one name on its line: no spaces, no '#', no leading '['."""
    pattern = pattern.strip()
    if not pattern or len(pattern.split()) != 1 or "#" in pattern or pattern.startswith("["):
        raise ListFileError(
            f"black module pattern {pattern!r} cannot be a list line; "
            f"write one glob without spaces, '#' or a leading '['."
        )
    return pattern


def _one_line(reason: str) -> str:
    """A reason as one comment line, so that no part of it reads back as an entry."""
    return " ".join(str(reason).split())


def refuse_to_overwrite(folder: Path, amp_lists: AutoMixedPrecisionLists, overwrite: bool) -> None:
    """Raise ListFileError for a folder the lists may not be written to: the shipped or the read lists, a file,
    or (without overwrite) a folder already holding list files."""
    target = folder.resolve()
    for protected, what in ((default_lists_dir(), "graphamp's shipped lists"), (amp_lists.lists_dir, "the lists read")):
        if target == Path(protected).resolve():
            raise ListFileError(f"{folder}: is the folder of {what}, which is never written over; name a new folder.")
    if folder.exists() and not folder.is_dir():
        raise ListFileError(f"{folder}: is a file, not a folder; name a new folder for the lists.")
    existing = [name for name in LIST_FILES if (folder / name).exists()]
    if existing and not overwrite:
        raise ListFileError(
            f"{folder / existing[0]}: already exists; pass overwrite=True to replace it, or name a new folder."
        )
