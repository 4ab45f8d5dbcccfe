"""write_lists(): a lists folder holding the effective lists, with changes for one dtype.

A lists folder replaces the shipped one (it is not merged with it), so every effective entry is written, each
with where it came from as a comment. Changes apply to the diagnosed dtype only: entries both dtypes share go
under [all], the others under [float16] or [bfloat16], so the other dtype reads the lists it had.
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphamp.errors import ListFileError
from graphamp.lists import BLACK, COLORS, GRAY, WHITE, AutoMixedPrecisionLists, canonical_op_name, default_lists_dir, dtype_name

FILES = tuple(f"{color}.txt" for color in COLORS) + ("black_modules.txt",)
_HEADER = """# {what}, written by graphamp doctor (changes for {dtype}).
# This folder replaces graphamp's shipped lists: AutoMixedPrecisionLists(lists_dir="{folder}").
# Each entry ends with where it came from; "doctor:" marks a change and the measurement behind it.
"""
_WHAT = {WHITE: "WHITE: ops that run low", BLACK: "BLACK: ops that run in float32",
         GRAY: "GRAY: ops that follow their inputs", "modules": "BLACK MODULES: module patterns kept in float32"}


def write_lists(folder, amp_lists: AutoMixedPrecisionLists, op_changes=None, black_modules=(), overwrite=False) -> Path:
    """Write white.txt, black.txt, gray.txt and black_modules.txt to `folder`: `amp_lists` with `op_changes`
    ({entry: (color, reason)}) and `black_modules` ([(pattern, reason)]) applied for `amp_lists.dtype`."""
    folder = Path(folder)
    _refuse_to_overwrite(folder, amp_lists, overwrite)
    diagnosed = amp_lists.dtype
    other = torch.bfloat16 if diagnosed == torch.float16 else torch.float16
    other_lists = AutoMixedPrecisionLists(
        custom_white_list=amp_lists.custom_lists[WHITE], custom_black_list=amp_lists.custom_lists[BLACK],
        custom_gray_list=amp_lists.custom_lists[GRAY], custom_black_modules=amp_lists.custom_black_modules,
        dtype=other, lists_dir=amp_lists.lists_dir,
    )
    ops = {lists.dtype: {e.name: (e.color, e.source) for e in lists.entries()} for lists in (amp_lists, other_lists)}
    for name, (color, reason) in (op_changes or {}).items():
        if color not in COLORS:
            raise ValueError(f"op change {name!r}: color {color!r} is not one of {', '.join(COLORS)}.")
        was = ops[diagnosed].get(canonical_op_name(name), ("unlisted",))[0]
        ops[diagnosed][canonical_op_name(name)] = (color, f"doctor: {reason} (was {was})")
    modules = {lists.dtype: {e.name: ("modules", e.source) for e in lists.black_modules} for lists in (amp_lists, other_lists)}
    for pattern, reason in black_modules:
        modules[diagnosed][pattern] = ("modules", f"doctor: {reason}")

    folder.mkdir(parents=True, exist_ok=True)
    header = {"dtype": dtype_name(diagnosed), "folder": folder}
    for color in COLORS:
        text = _HEADER.format(what=_WHAT[color], **header) + _sections(ops, color)
        (folder / f"{color}.txt").write_text(text, encoding="utf-8")
    text = _HEADER.format(what=_WHAT["modules"], **header) + _sections(modules, "modules")
    (folder / "black_modules.txt").write_text(text, encoding="utf-8")
    return folder


def _sections(entries: dict, color: str) -> str:
    """[all], [float16] and [bfloat16] sections of the entries of `color`, one sorted entry a line."""
    float16, bfloat16 = entries[torch.float16], entries[torch.bfloat16]
    sections = {"all": [], "float16": [], "bfloat16": []}
    for name in sorted(set(float16) | set(bfloat16)):
        in_float16 = float16.get(name, ("",))[0] == color
        in_bfloat16 = bfloat16.get(name, ("",))[0] == color
        if in_float16 and in_bfloat16:
            # Shared: the source of a change wins, so a doctor's note is never hidden.
            source = next((s for _, s in (float16[name], bfloat16[name]) if s.startswith("doctor:")), float16[name][1])
            sections["all"].append((name, source))
        elif in_float16:
            sections["float16"].append((name, float16[name][1]))
        elif in_bfloat16:
            sections["bfloat16"].append((name, bfloat16[name][1]))
    width = max((len(name) for lines in sections.values() for name, _ in lines), default=0) + 2
    text = ""
    for section, lines in sections.items():
        text += f"\n[{section}]\n" + "".join(f"{name:<{width}}# {source}\n" for name, source in lines)
    return text


def _refuse_to_overwrite(folder: Path, amp_lists: AutoMixedPrecisionLists, overwrite: bool) -> None:
    target = folder.resolve()
    for protected, what in ((default_lists_dir(), "graphamp's shipped lists"), (amp_lists.lists_dir, "the lists read")):
        if target == Path(protected).resolve():
            raise ListFileError(
                f"{folder}: is the folder of {what}, which is never written over; name a new folder."
            )
    existing = [name for name in FILES if (folder / name).exists()]
    if existing and not overwrite:
        raise ListFileError(
            f"{folder / existing[0]}: already exists; pass overwrite=True to replace it, or name a new folder."
        )
