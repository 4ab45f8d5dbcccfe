"""AutoMixedPrecisionLists: which ops run low (white), stay FP32 (black) or follow their inputs (gray).

The lists are data: plain text files (see lists/README.md) read here, plus the custom lists a user passes.
Every effective entry remembers where it came from, so a decision can always be traced to a file line or
an argument.
"""

from __future__ import annotations

import difflib
import enum
import fnmatch
import functools
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from graphamp.policy.dtypes import dtype_name, resolve_dtype
from graphamp.errors import ListFileError
from graphamp.policy.list_files import (
    BLACK_MODULES_FILE, OP_LIST_FILES, PROMOTE_FILE, check_lists_folder, check_visible, default_lists_dir,
    read_list_entries,
)
from graphamp.torch_private import (
    OpOverload, OpOverloadPacket, all_op_schemas, op_schema, op_schemas_named, qualified_op_name,
)

__all__ = ["AutoMixedPrecisionLists", "COLORS", "Decision", "ListEntry"]


class Decision(str, enum.Enum):
    """What the cast pass decided for a graph node: the three list colors, and what no list decides."""

    WHITE = "white"  # runs in the low dtype
    BLACK = "black"  # runs in float32
    GRAY = "gray"  # follows its floating inputs
    UNLISTED = "unlisted"  # on no list: acts gray, and is reported
    EXPLICIT_CAST = "explicit-cast"  # the model's own cast (x.float(), softmax(dtype=...)): kept as written
    INSERTED_CAST = "inserted-cast"  # a cast graphamp inserted
    HIGHER_ORDER = "higher-order"  # torch.cond, no_grad regions: their sub-graphs are decided node by node

    def __str__(self) -> str:
        return self.value


WHITE, BLACK, GRAY = Decision.WHITE, Decision.BLACK, Decision.GRAY
COLORS = (WHITE, BLACK, GRAY)


@dataclass(frozen=True)
class ListEntry:
    """One effective list entry: the op (or module pattern), its color and where it came from."""

    name: str
    color: str
    source: str


@functools.lru_cache(maxsize=1)
def _known_op_names() -> tuple[str, ...]:
    """Every registered op as a list file would name it (aten ops bare), for 'did you mean' suggestions."""
    names = {s.name.removeprefix("aten::") for s in all_op_schemas()}
    return tuple(sorted(n for n in names if not n.startswith(("prim::", "_caffe2::"))))


def canonical_op_name(name: str) -> str:
    """`aten::add.Tensor` and `add.Tensor` are the same entry; aten is the default namespace.

    The spellings `node.target` prints are accepted too: `aten.gelu.default` and `torch.ops.aten.gelu.default`
    are `gelu.default`, `mylib.fused_gelu.default` is `mylib::fused_gelu.default`, `aten.gelu` is `gelu`.
    """
    name = name.strip().removeprefix("torch.ops.")
    if "::" not in name:
        parts = name.split(".")
        if len(parts) == 3:
            name = f"{parts[0]}::{parts[1]}.{parts[2]}"
        elif len(parts) == 2 and parts[0] == "aten":
            name = parts[1]
    return name.removeprefix("aten::")


def op_lookup_keys(op) -> tuple[str, str]:
    """The list keys an OpOverload answers to, most specific first: ('add.Tensor', 'add')."""
    schema = op_schema(op)
    packet = canonical_op_name(schema.name)
    return f"{packet}.{schema.overload_name or 'default'}", packet


def _split_overload(entry: str) -> tuple[str, str | None]:
    namespace, _, rest = entry.rpartition("::")
    packet, dot, overload = rest.partition(".")
    qualified = f"{namespace}::{packet}" if namespace else f"aten::{packet}"
    return qualified, (overload if dot else None)


# Namespaces the shipped lists name: their ops register when the library is imported, which a model using them
# has done; a list that names them before (or without) that is expected, not a typo worth a warning.
_LIBRARY_NAMESPACES = ("transformers::",)


def check_op_name(entry: str, where: str, unregistered: list[tuple[str, str]] | None = None) -> None:
    """Raise ListFileError for an op torch does not know; warn for a custom op not registered yet, or append it to
    `unregistered` where given (for one warning about them all, see warn_unregistered)."""
    parts = entry.split("::")
    if len(parts) > 2 or not all(parts):  # '::silu', 'mylib::': a namespace or a name lost in an edit
        close = difflib.get_close_matches(max(parts, key=len), _known_op_names(), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ListFileError(
            f"{where}: '{entry}' is not an op name: write 'name' for an aten op or 'namespace::name' for a "
            f"torch.library op, neither part empty.{hint}"
        )
    qualified, overload = _split_overload(entry)
    schemas = op_schemas_named(qualified)
    if not schemas:
        if not qualified.startswith("aten::"):
            if qualified.startswith(_LIBRARY_NAMESPACES):
                return
            note = (entry, where)
            if unregistered is None:
                warn_unregistered([note], stacklevel=4)
            else:
                unregistered.append(note)
            return
        # aten names are lowercase: 'MM' is 'mm'
        close = difflib.get_close_matches(entry.partition(".")[0].lower(), _known_op_names(), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ListFileError(f"{where}: unknown op '{entry}': torch.ops.aten has no such operator.{hint}")
    if overload is not None:
        overloads = {s.overload_name or "default" for s in schemas}
        if overload not in overloads:
            close = difflib.get_close_matches(overload, sorted(overloads), n=3, cutoff=0.0)
            raise ListFileError(
                f"{where}: '{qualified.removeprefix('aten::')}' has no overload '{overload}'. "
                f"Known overloads: {', '.join(sorted(overloads))}"
                + (f"; did you mean '{close[0]}'?" if close else ".")
            )


def _namespace_hints(entries: list[str]) -> list[str]:
    """'did you mean ...?' for each entry that is a typo of an op registered in its namespace, else ''."""
    registered: dict[str, list[str]] = {}
    for schema in all_op_schemas():  # read now: ops registered since the last lists count
        registered.setdefault(schema.name.partition("::")[0], []).append(schema.name)
    hints = []
    for entry in entries:
        qualified = _split_overload(entry)[0]
        close = difflib.get_close_matches(qualified, registered.get(qualified.partition("::")[0], []), n=3)
        hints.append(f"did you mean {', '.join(repr(c) for c in close)}?" if close else "")
    return hints


def warn_unregistered(unregistered: list[tuple[str, str]], stacklevel: int = 3) -> None:
    """One warning for the custom ops not registered yet, however many: (entry, where) pairs; the likely
    typos of registered ops come first, each with its suggestion."""
    if not unregistered:
        return
    hints = _namespace_hints([entry for entry, _ in unregistered])
    notes = [(entry, where, hint) for (entry, where), hint in zip(unregistered, hints)]
    notes.sort(key=lambda note: not note[2])  # the likely typos first
    if len(notes) == 1:
        ((entry, where, hint),) = notes
        message = (f"{where}: custom op '{entry}' is not registered (yet): it is kept, and applies if torch.library "
                   f"registers it before the model is rewritten{f' ({hint})' if hint else ''}.")
    else:
        shown = ", ".join(f"'{entry}' ({where}{f', {hint}' if hint else ''})" for entry, where, hint in notes[:5])
        more = f" and {len(notes) - 5} more" if len(notes) > 5 else ""
        message = (f"{len(notes)} custom ops are not registered (yet): {shown}{more}: they are kept, and apply if "
                   f"torch.library registers them before the model is rewritten.")
    warnings.warn(message, stacklevel=stacklevel)


def check_module_pattern(pattern: str, where: str) -> None:
    """Raise ListFileError for a glob fnmatch would read as a literal: a '[' no ']' closes matches no module."""
    opened = pattern.find("[")
    if opened != -1 and "]" not in pattern[opened + 2:]:
        raise ListFileError(
            f"{where}: '{pattern}' is not a valid glob: its '[' opens a character set no ']' closes, and module "
            f"paths hold no '['; close the set (layers.[01]) or drop the '['."
        )


class AutoMixedPrecisionLists:
    """The white/black/gray op lists and FP32 module patterns for one low-precision dtype.

    Defaults come from the `lists/` files (or `lists_dir`, which replaces them); custom lists follow
    Paddle's rules: a custom white op leaves black and gray, a custom black op leaves white and gray, a
    custom gray op leaves white and black, and an op in two custom lists is a ValueError.

    Args:
        custom_white_list: ops that run in the low dtype ('linear', 'add.Tensor', 'mylib::op').
        custom_black_list: ops that run in float32.
        custom_gray_list: ops that follow their floating inputs.
        custom_black_modules: module paths or glob patterns ('lm_head', 'encoder.layer.*.attention') whose ops
            all run in float32.
        dtype: 'float16' or 'bfloat16' (or the torch dtype).
        lists_dir: a folder of list files that replaces the shipped lists/ (see lists/README.md).
    """

    def __init__(
        self, custom_white_list=None, custom_black_list=None, custom_gray_list=None, custom_black_modules=None,
        dtype="float16", lists_dir=None,
    ):
        self.dtype = resolve_dtype(dtype)
        if lists_dir is not None:
            check_lists_folder(lists_dir)
        self.lists_dir = Path(lists_dir) if lists_dir is not None else default_lists_dir()
        self._entries: dict[str, ListEntry] = {}
        unregistered: list[str] = []
        self._read_default_files(unregistered)
        # Kept as given (canonical names), so that with_changes() and the list writer can build on them.
        self.custom_lists = {
            color: tuple(canonical_op_name(op) for op in _as_names(ops, f"custom_{color}_list", _OP_NAMES))
            for color, ops in ((WHITE, custom_white_list), (BLACK, custom_black_list), (GRAY, custom_gray_list))
        }
        self._apply_custom_lists(self.custom_lists, unregistered)
        warn_unregistered(unregistered)
        self.custom_black_modules = tuple(_as_names(custom_black_modules, "custom_black_modules", _MODULE_PATTERNS))
        self.black_modules = self._read_black_modules(self.custom_black_modules)
        self.promote_entries = self._read_promote_entries()
        self.promote_ops = frozenset(entry.name for entry in self.promote_entries)

    # -- reading -------------------------------------------------------------------------------------------
    def _display(self, path: Path) -> str:
        """`lists/white.txt` for the shipped files, the path as given for a user's folder."""
        return f"lists/{path.name}" if self.lists_dir == default_lists_dir() else str(path)

    def _read_default_files(self, unregistered: list[str]) -> None:
        for color in COLORS:
            path = self.lists_dir / OP_LIST_FILES[color]
            if not path.exists():
                if self.lists_dir == default_lists_dir():
                    raise ListFileError(f"{path}: the shipped list file is missing; reinstall graphamp.")
                continue  # a user's folder may leave a color empty
            for entry, where, section_dtype in read_list_entries(path, self._display(path)):
                name = canonical_op_name(entry)
                check_op_name(name, where, unregistered)  # every section's, so a typo shows whatever the dtype
                if section_dtype not in (None, self.dtype):
                    continue
                earlier = self._entries.get(name)
                if earlier is not None:
                    raise ListFileError(
                        f"{where}: '{name}' is already {earlier.color} at {earlier.source}; "
                        f"keep it on one list for {self.dtype_name}."
                    )
                self._entries[name] = ListEntry(name, color, where)

    def _apply_custom_lists(self, custom: dict[str, tuple[str, ...]], unregistered: list[str]) -> None:
        owners: dict[str, str] = {}
        for color, names in custom.items():
            for name in names:
                if name in owners and owners[name] != color:
                    raise ListFileError(
                        f"op '{name}' is in both custom_{owners[name]}_list and custom_{color}_list; keep it in one."
                    )
                owners[name] = color
        for name, color in owners.items():
            check_op_name(name, f"custom_{color}_list", unregistered)
            # A custom packet entry ('add') takes all its overloads ('add.Tensor') away from other lists.
            for other in [n for n in self._entries if n == name or n.startswith(name + ".")]:
                del self._entries[other]
            self._entries[name] = ListEntry(name, color, f"custom_{color}_list")

    def _read_entries(self, file: str, check, globs: bool = False) -> list[tuple[str, str]]:
        """The (entry, 'file:line') pairs of one of the folder's files that apply to the dtype ([] without the file);
        `check(entry, where)` runs on the entries of every section, so a typo shows whatever the dtype."""
        path = self.lists_dir / file
        entries = read_list_entries(path, self._display(path), globs) if path.exists() else []
        for entry, where, _ in entries:
            check(entry, where)
        return [(entry, where) for entry, where, section in entries if section in (None, self.dtype)]

    def _read_black_modules(self, custom_black_modules) -> tuple[ListEntry, ...]:
        listed = self._read_entries(BLACK_MODULES_FILE, check_module_pattern, globs=True)
        custom = [(p, f"custom_black_modules: {p}") for p in custom_black_modules]
        for pattern, where in custom:
            check_module_pattern(pattern, where)
        return tuple(ListEntry(name, BLACK, where) for name, where in [*listed, *custom])

    def _read_promote_entries(self) -> tuple[ListEntry, ...]:
        """The entries of the folder's promote.txt (none when it has no such file), colored 'promote'."""
        entries = self._read_entries(PROMOTE_FILE, lambda entry, where: check_op_name(canonical_op_name(entry), where))
        return tuple(ListEntry(canonical_op_name(entry), "promote", where) for entry, where in entries)

    def warn_unmatched_black_modules(self, model: torch.nn.Module, stacklevel: int = 4) -> None:
        """Warn for each black-module pattern that matches no module of `model`, naming the closest paths:
        the user believes those ops run in FP32 while they run low. `stacklevel` points at the user's call."""
        if not self.black_modules:
            return
        # remove_duplicate=False: a module shared under two names answers to both
        paths = [name for name, _ in model.named_modules(remove_duplicate=False) if name]
        for pattern, close in self.unmatched_black_modules(paths):
            hint = f"closest module paths: {', '.join(close)}" if close else "see model.named_modules()"
            warnings.warn(
                f"{pattern.source}: black-module pattern '{pattern.name}' matches no module of "
                f"{type(model).__name__}, so it keeps nothing in FP32; {hint}.",
                stacklevel=stacklevel,
            )

    def unmatched_black_modules(self, paths: list[str]) -> list[tuple[ListEntry, list[str]]]:
        """The black-module patterns that match none of the module `paths`, each with the closest paths (a typo's
        likely target)."""
        return [
            (pattern, difflib.get_close_matches(pattern.name, paths, n=3, cutoff=0.5))
            for pattern in self.black_modules
            if not any(fnmatch.fnmatchcase(path, pattern.name) for path in paths)
        ]

    def with_changes(self, white=(), black=(), black_modules=()) -> AutoMixedPrecisionLists:
        """These lists with more custom entries: `white`/`black` ops (taken off any other custom list) and
        `black_modules` patterns, for the same dtype and lists folder."""
        moved = {canonical_op_name(op) for op in (*white, *black)}
        custom = {color: [op for op in ops if op not in moved] for color, ops in self.custom_lists.items()}
        return AutoMixedPrecisionLists(
            custom_white_list=custom[WHITE] + list(white),
            custom_black_list=custom[BLACK] + list(black),
            custom_gray_list=custom[GRAY],
            custom_black_modules=[*self.custom_black_modules, *black_modules],
            dtype=self.dtype,
            lists_dir=self.lists_dir,
        )

    # -- queries -------------------------------------------------------------------------------------------
    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def entries(self, color: str | None = None) -> list[ListEntry]:
        """The effective op entries, sorted by name; only those of `color` when given."""
        return sorted((e for e in self._entries.values() if color is None or e.color == color), key=lambda e: e.name)

    # Paddle's white_list, black_list and gray_list: the names of that color's effective op entries.
    @property
    def white_list(self) -> frozenset[str]:
        return frozenset(e.name for e in self.entries(WHITE))

    @property
    def black_list(self) -> frozenset[str]:
        return frozenset(e.name for e in self.entries(BLACK))

    @property
    def gray_list(self) -> frozenset[str]:
        return frozenset(e.name for e in self.entries(GRAY))

    def classify(self, op) -> ListEntry | None:
        """The entry deciding an OpOverload (overload entry before packet entry), or None if unlisted."""
        return next((self._entries[key] for key in op_lookup_keys(op) if key in self._entries), None)

    def classify_packet(self, name: str) -> ListEntry | None:
        """The entry deciding an op known only by its packet name ('add', 'mylib::op'), as a torch call names it:
        the packet's entry, else its overloads' entries where they all agree on the color; None if unlisted."""
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        overloads = [e for key, e in self._entries.items() if key.startswith(name + ".")]
        return overloads[0] if overloads and len({e.color for e in overloads}) == 1 else None

    def overload_entries(self, name: str) -> dict[str, ListEntry]:
        """{overload: entry} of the entries that name one overload of the packet `name` ('add.Tensor': 'Tensor')."""
        return {key.removeprefix(name + "."): e for key, e in self._entries.items() if key.startswith(name + ".")}

    def promotes_packet(self, name: str) -> bool:
        """promotes(), for an op known only by its packet name."""
        return name in self.promote_ops or any(key.startswith(name + ".") for key in self.promote_ops)

    def promotes(self, op) -> bool:
        """Whether mixed floating inputs of this OpOverload are cast to the widest of them (promote.txt)."""
        return any(key in self.promote_ops for key in op_lookup_keys(op))

    def black_module_for(self, module_path: str) -> ListEntry | None:
        """The pattern that keeps `module_path` (or a module containing it) in FP32, if any."""
        if not self.black_modules or not module_path:
            return None
        parts = module_path.split(".")
        prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
        for pattern in self.black_modules:
            if any(fnmatch.fnmatchcase(prefix, pattern.name) for prefix in prefixes):
                return pattern
        return None

    def black_modules_in(self, model: torch.nn.Module) -> dict[str, ListEntry]:
        """{path: pattern} for every path of `model` whose module a pattern keeps FP32 by any of its paths: a module
        registered under two names (`self.b = self.a`) is one module, whichever name the code calls it by."""
        named = list(model.named_modules(remove_duplicate=False)) if self.black_modules else []
        kept = {}
        for path, module in named:
            if (pattern := self.black_module_for(path)) is not None:
                kept.setdefault(id(module), pattern)
        return {path: kept[id(module)] for path, module in named if id(module) in kept}

    def describe(self) -> str:
        """Every effective entry with its source, one a line, grouped white/black/gray."""
        lines = [f"AutoMixedPrecisionLists(dtype={self.dtype_name}, lists_dir={self.lists_dir})"]
        for color in COLORS:
            entries = self.entries(color)
            lines.append(f"{color} ({len(entries)}):")
            lines += [f"  {e.name:<40} {e.source}" for e in entries]
        for title, entries in (("promote", self.promote_entries), ("black modules", self.black_modules)):
            if entries:
                lines.append(f"{title} ({len(entries)}):")
                lines += [f"  {e.name:<40} {e.source}" for e in entries]
        return "\n".join(lines)

    def __repr__(self) -> str:
        counts = ", ".join(f"{c}={len(self.entries(c))}" for c in COLORS)
        customs = [e for e in self._entries.values() if e.source.startswith("custom_")]
        custom = "".join(f", {e.source}+={e.name}" for e in sorted(customs, key=lambda e: e.name))
        modules = f", black_modules={[e.name for e in self.black_modules]}" if self.black_modules else ""
        return f"AutoMixedPrecisionLists(dtype={self.dtype_name}, {counts}{custom}{modules})"


# What each custom list argument holds, and examples of it, for its errors.
_OP_NAMES = ("an op name", "names like 'linear' or 'mylib::op'")
_MODULE_PATTERNS = ("a module pattern", "module paths or globs like 'lm_head' or 'encoder.layer.*'")


def _as_names(values, argument: str, kind: tuple[str, str]) -> list[str]:
    """A custom list argument as a list of names (`kind`: _OP_NAMES or _MODULE_PATTERNS); a bare string is one name,
    not its characters. An op list takes torch.ops.aten.softmax.int and torch.ops.aten.softmax too."""
    ops = (OpOverload, OpOverloadPacket) if kind is _OP_NAMES else ()
    if values is None:
        return []
    if isinstance(values, (str, *ops)):
        values = [values]
    if isinstance(values, (bytes, bytearray)) or not isinstance(values, Iterable):  # bytes would iterate as ints
        raise ListFileError(f"{argument}={values!r}: pass a list of {kind[1]}, not a {type(values).__name__}.")
    names = []
    for value in values:
        if isinstance(value, ops):  # str(): 'aten.softmax.int', which canonical_op_name reads
            value = str(value) if isinstance(value, OpOverload) else qualified_op_name(value)
        if not isinstance(value, str) or not value.strip():
            # torch.matmul, F.linear: a Python function, named as the op it calls
            name = str(getattr(value, "__name__", "")).lower() if kind is _OP_NAMES else ""
            hint = f" Did you mean {name!r}?" if name in _known_op_names() else ""
            raise ListFileError(f"{argument}: {value!r} is not {kind[0]}; pass {kind[1]}.{hint}")
        check_visible(value, argument)
        names.append(value.strip())
    return names
