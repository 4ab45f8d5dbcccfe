"""The `graphamp` command: look at the lists, check a lists folder, export a model's rewritten graph, and
diagnose its numerics (doctor).

Each subcommand is one `_add_<name>(subcommands)` function that declares its arguments and the function
that runs it; `main` lists them. Exit status: 0 done, 1 the work failed (the message says why), 2 usage.
A failure prints one `error:` line, never a traceback; `--debug` prints the traceback too.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import math
import os
import sys
import tempfile
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from graphamp.diagnosis.auto_lists import auto_mixed_precision
from graphamp.diagnosis.diagnose import doctor, format_report
from graphamp.diagnosis.list_writer import refuse_to_overwrite
from graphamp.errors import GraphampError, ListFileError
from graphamp.frontends.export_program import export_program
from graphamp.inspection.export_files import FILES, check_out_dir, export, made_folders_removed_on_failure
from graphamp.policy.list_files import no_white_entries
from graphamp.policy.lists import COLORS, WHITE, AutoMixedPrecisionLists

__all__ = ["main"]

DTYPES = ("float16", "bfloat16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="graphamp",
        description="Static-graph automatic mixed precision for PyTorch: inspect the op lists and rewritten graphs, "
        "and diagnose a model's numerics.",
        epilog="Run `graphamp COMMAND --help` for what each command does, with an example.",
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error, too")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in (_add_lists, _add_check_lists, _add_export, _add_doctor):
        add_command(subcommands)
    args = parser.parse_args(argv)
    try:
        return args.run(args, parser)
    except BrokenPipeError:  # `graphamp lists | head` stopped reading: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:  # a user's model or file can fail in any way: one line, the traceback on demand
        if args.debug:
            traceback.print_exc()
        # graphamp's own errors say the fix already; any other is named by its type
        print(f"error: {error if isinstance(error, GraphampError) else f'{type(error).__name__}: {error}'}",
              file=sys.stderr)
        # a list file's error names the file, line and fix: its cause (a decoding error) is no code of the user's
        from_users_code = error.__cause__ is not None and not isinstance(error, ListFileError)
        if not args.debug and (from_users_code or not isinstance(error, GraphampError)):
            print("(run with --debug for the traceback)", file=sys.stderr)
        return 1


def _subcommand(subcommands, name: str, run, summary: str, description: str, example: str):
    command = subcommands.add_parser(
        name, help=summary, description=f"{summary}\n\n{description}", epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.set_defaults(run=run)
    # also after the command name; SUPPRESS keeps a `graphamp --debug COMMAND` from being reset
    command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="print the traceback of an error, too")
    return command


def _add_lists(subcommands) -> None:
    command = _subcommand(
        subcommands, "lists", _lists,
        "print the effective op lists, with where each entry comes from",
        "Prints the white, black and gray op lists and the FP32 module patterns in effect for one dtype, each\n"
        "entry with the file line (or argument) it comes from.",
        "graphamp lists --dtype bfloat16 --lists my_lists",
    )
    _add_lists_arguments(command)


def _lists(args, parser) -> int:
    print(AutoMixedPrecisionLists(dtype=args.dtype, lists_dir=args.lists).describe())
    return 0


def _add_check_lists(subcommands) -> None:
    command = _subcommand(
        subcommands, "check-lists", _check_lists,
        "check a lists folder of your own",
        "Reads white.txt, black.txt, gray.txt and black_modules.txt for float16 and bfloat16: unknown ops, ops\n"
        "on two lists, bad section headers, misnamed files and a white list with no entries (every op would run\n"
        "in float32) are errors that name file:line and suggest the fix (exit status 1). Prints the entry counts\n"
        "when the folder is good.",
        "graphamp check-lists my_lists",
    )
    command.add_argument("folder", metavar="DIR", help="the lists folder to check")


def _check_lists(args, parser) -> int:
    folder = Path(args.folder)
    counts, without_white = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in DTYPES:
            lists = AutoMixedPrecisionLists(dtype=dtype, lists_dir=folder)
            counts.append(f"{dtype}: " + ", ".join(f"{len(lists.entries(c))} {c}" for c in COLORS))
            if not lists.entries(WHITE):
                without_white.append(dtype)
    if len(without_white) == len(DTYPES):  # loads, but runs every op in float32: not a folder to pass as OK
        raise ListFileError(no_white_entries(folder) or f"{folder}: white.txt holds no entries for either dtype.")
    for message in dict.fromkeys(str(warning.message) for warning in caught):  # once, not once per dtype
        print(f"warning: {message}", file=sys.stderr)
    for dtype in without_white:
        print(f"warning: {folder / 'white.txt'}: no entries for {dtype} (its section and [all] are empty): with "
              f"--dtype {dtype} no op runs in low precision.", file=sys.stderr)
    print(f"{folder}: OK ({'; '.join(counts)})")
    return 0


def _add_export(subcommands) -> None:
    command = _subcommand(
        subcommands, "export", _export,
        "export a model with graphamp's casts and write its graph, picture and report",
        "Imports MODULE (from the current folder or the Python path), calls FACTORY(), which returns\n"
        "(model, example_args) or (model, example_args, example_kwargs), exports the model with the casts\n"
        "(graphamp.export_program) and writes graph.py, graph.json, graph.svg, report.html (the casts executed,\n"
        "next to torch.autocast's on the FP32 model) and diff.txt to the --out folder.",
        "graphamp export my_models:tiny_gpt2 --out gpt2_amp --dtype bfloat16",
    )
    _add_model_arguments(command)
    command.add_argument("--out", metavar="DIR", required=True, help="the folder to write (created if missing)")
    command.add_argument("--force", action="store_true", help="replace the files of an earlier export in --out")


def _export(args, parser) -> int:
    with made_folders_removed_on_failure(Path(args.out)):
        check_out_dir(Path(args.out), args.force)
        lists = AutoMixedPrecisionLists(dtype=args.dtype, lists_dir=args.lists)
        model, example_args, example_kwargs = _factory_call(args, parser)
        with _checks_named(args.factory):
            program = export_program(model, example_args, example_kwargs, amp_lists=lists, level=args.level)
        out = export(program, args.out, overwrite=args.force, model=model)
    print(program.graph_module.meta["graphamp_report"])
    print(f"wrote {out}/: {' '.join(FILES)}")
    return 0


def _add_doctor(subcommands) -> None:
    command = _subcommand(
        subcommands, "doctor", _doctor,
        "find the op that overflows, measure each op against FP32, and suggest list edits",
        "Runs FACTORY()'s model forward and backward in FP32 and rewritten, node by node on the same inputs.\n"
        "Prints the first op that gives inf/NaN, the top offenders (overflow in the low dtype, error against FP32)\n"
        "and the suggested list edits, each fix verified by a rerun; writes report.json and report.html (a plot\n"
        "of per-node error and range) to --out. --apply DIR writes the lists with the suggestions applied;\n"
        "--auto TOL searches the lists that run the most ops low with the loss within TOL and writes them.",
        "graphamp doctor my_models:tiny_gpt2 --dtype float16 --out doctor_out --apply my_lists",
    )
    _add_model_arguments(command)
    command.add_argument("--out", metavar="DIR", default="graphamp_doctor",
                         help="the report folder (default graphamp_doctor)")
    command.add_argument("--steps", type=_count(1), default=1, help="runs to measure, the worst kept (default 1)")
    command.add_argument("--loss-scaling", type=_positive_number, default=1.0, metavar="S",
                         help="multiply the loss by S before backward, as a loss scaler would (default 1)")
    command.add_argument("--top", type=_count(0), default=10, metavar="N", help="offenders to print (default 10)")
    command.add_argument("--apply", metavar="DIR", help="write a lists folder with the suggested fixes applied")
    command.add_argument("--speedups", action="store_true", help="with --apply: also move the white candidates")
    command.add_argument("--auto", type=_positive_number, metavar="TOL",
                         help="search lists with the loss's relative error within TOL; written to OUT/auto_lists")


def _number(convert, fits, wanted: str):
    """An argparse type: `convert(text)` where it `fits`, else an error saying what was wanted."""
    def number(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not fits(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}")
        return value
    return number


def _count(least: int):
    return _number(int, lambda value: value >= least, f"a whole number of at least {least}")


_positive_number = _number(float, lambda v: math.isfinite(v) and v > 0, "a positive finite number (e.g. 1024 or 0.01)")


def _doctor(args, parser) -> int:
    with made_folders_removed_on_failure(*(Path(folder) for folder in (args.out, args.apply) if folder)):
        return _diagnose(args, parser)


def _diagnose(args, parser) -> int:
    lists = AutoMixedPrecisionLists(dtype=args.dtype, lists_dir=args.lists)
    # The folders are checked (and created) now, not after the whole diagnosis ran.
    if Path(args.out).is_file():
        raise GraphampError(f"{args.out}: is a file; pass --out a folder for the reports (created if missing).")
    if args.apply:  # every refusal before any folder is created
        refuse_to_overwrite(Path(args.apply), lists, overwrite=False)
    _check_writable(Path(args.out), "--out")
    if args.apply:
        _check_writable(Path(args.apply), "--apply")
    model, example_args, example_kwargs = _factory_call(args, parser)
    with _checks_named(args.factory):
        report = doctor(model, example_args, example_kwargs, lists, args.steps, args.level,
                        loss_scaling=args.loss_scaling)
    print(format_report(report, args.top))
    out = report.write(args.out)
    print(f"\nwrote {out}/: report.json report.html")
    if args.apply:
        print(f"wrote {report.apply(args.apply, speedups=args.speedups)}/: the lists with the suggestions applied")
    if args.auto is not None:
        with _checks_named(args.factory):
            found = auto_mixed_precision(model, example_args, example_kwargs, args.auto, lists, args.level)
        print(f"\n{found}")
        print(f"wrote {found.write(out / 'auto_lists', overwrite=True)}/: the lists found")
    return 0


def _check_writable(folder: Path, option: str) -> None:
    """Create `folder` if missing and write a file into it, or fail with what the OS said (as root, a folder's mode
    does not stop writes: only trying tells)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = error.strerror or error
        raise GraphampError(f"{folder}: cannot write there ({reason}); pass {option} a folder you can write.") from error


def _add_lists_arguments(command) -> None:
    command.add_argument("--lists", metavar="DIR", help="a lists folder replacing the shipped lists/")
    command.add_argument("--dtype", choices=DTYPES, default="float16", help="the low-precision dtype (default float16)")


def _add_model_arguments(command) -> None:
    command.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. my_models:tiny_gpt2")
    _add_lists_arguments(command)
    command.add_argument(
        "--level", choices=("O1", "O2"), default="O1", help="O1: lists decide (default); O2: all but black ops run low"
    )


@contextmanager
def _checks_named(factory: str):
    """export_program()'s and doctor()'s own checks (FP16 parameters, ...) say the fix already: name the factory."""
    try:
        yield
    except (TypeError, ValueError) as error:  # graphamp's ArgumentError is both
        raise GraphampError(f"{factory}: {error}") from error


def _factory_call(args, parser):
    """(model, example_args, example_kwargs) from calling MODULE:FACTORY, checked."""
    spec = args.factory
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name.isidentifier():
        parser.error(f"MODULE:FACTORY expected, got {spec!r} (for example my_models:tiny_gpt2)")
    here = os.getcwd()
    sys.path.insert(0, here)  # `graphamp export my_models:f` finds my_models.py here, as `python -m` would
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
        if missing is not None and (module_name + ".").startswith(missing + "."):  # not found: MODULE or a parent
            raise GraphampError(
                f"{spec}: cannot import {module_name!r} ({error}); run from the folder that holds it."
            ) from error
        # found, but running it failed (a syntax error, a failing import inside, ...): say what failed
        raise GraphampError(f"{spec}: importing {module_name} failed: {type(error).__name__}: {error}") from error
    finally:
        sys.path.remove(here)
    factory = getattr(module, factory_name, None)
    if factory is None:
        functions = [name for name, value in vars(module).items() if callable(value) and not name.startswith("_")]
        close = difflib.get_close_matches(factory_name, functions, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        raise GraphampError(f"{spec}: {module_name} has no {factory_name!r}{hint}")
    if not callable(factory):
        raise GraphampError(
            f"{spec}: {module_name}.{factory_name} is of type {type(factory).__name__}; FACTORY must be a function."
        )
    try:
        result = factory()
    except Exception as error:
        raise GraphampError(f"{spec}: {factory_name}() raised {type(error).__name__}: {error}") from error
    if not (isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], nn.Module)):
        if isinstance(result, tuple):
            got = f"({', '.join(type(item).__name__ for item in result)})"
        else:
            got = f"a {type(result).__name__}"
        raise GraphampError(
            f"{spec} returned {got}; it must return (model, example_args) or (model, example_args, example_kwargs)."
        )
    model, example_args, example_kwargs = (*result, {}) if len(result) == 2 else result
    if isinstance(example_args, list):  # as export_program() refuses it: one list argument or several arguments?
        raise GraphampError(f"{spec} returned example_args as a list; return a tuple: (x,) or (x, y), or ([x, y],) "
                            f"for a model whose one argument is a list.")
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    if not isinstance(example_kwargs, dict):
        raise GraphampError(f"{spec} returned example_kwargs of type {type(example_kwargs).__name__}; return a dict.")
    return model, example_args, example_kwargs


if __name__ == "__main__":
    sys.exit(main())
