"""Bad input gets a clear answer: a typed graphamp error (or a warning) that names the argument, file, line or
pattern and says the fix, raised before any long work starts; the CLI answers with one `error:` line.

New bad-input cases join the tables: BAD_CALLS (a call, the error type, a regex of its message) and
BAD_COMMANDS (a `graphamp` command line, its exit status, a regex of its stderr).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch import nn

import graphamp
from graphamp import ArgumentError, AutoMixedPrecisionLists, DoubleAmpError, ExportError, ListFileError
from graphamp.cli import main
from graphamp.policy.list_files import OP_LIST_FILES, default_lists_dir
from conftest import write_list_folder

REPO = Path(__file__).resolve().parents[1]


class Head(nn.Module):
    """A model whose output projection is `head` (not `lm_head`)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def x():
    return torch.randn(2, 4)


def bf16_lists(**options):
    return AutoMixedPrecisionLists(dtype="bfloat16", **options)


def program():
    return graphamp.export_program(nn.Linear(4, 4), (x(),), amp_lists=bf16_lists())


def rewritten_model():
    return graphamp.rewrite(nn.Linear(4, 4), (x(),), amp_lists=bf16_lists())


def exported_twice(tmp_path, make=program):
    what = make()
    graphamp.export(what, tmp_path / "out")
    graphamp.export(what, tmp_path / "out")


def export_into_a_file(tmp_path, make=program):
    (tmp_path / "out").write_text("not a folder")
    graphamp.export(make(), tmp_path / "out")


def rewritten_twice(tmp_path):
    graphamp.rewrite(rewritten_model(), (x(),), amp_lists=bf16_lists())


def rewritten_model_called_under_autocast(tmp_path):
    model = rewritten_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a second AMP system around graphamp's
        model(x())


def exported_under_autocast(tmp_path):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        program()


def lists_folder(**files):
    """A call that loads AutoMixedPrecisionLists from a folder holding `files` (name: text) only."""

    def load(tmp_path):
        folder = tmp_path / "lists"
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")
        return AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder)

    return load


BAD_CALLS = [
    # argument types
    pytest.param(lambda tmp: AutoMixedPrecisionLists(custom_white_list=123), ListFileError,
                 r"custom_white_list=123: pass a list of names", id="custom_white_list-not-a-list"),
    pytest.param(lambda tmp: AutoMixedPrecisionLists(custom_white_list=b"mm"), ListFileError,
                 r"custom_white_list=b'mm': pass a list of names .*, not a bytes", id="custom_white_list-bytes"),
    pytest.param(lambda tmp: AutoMixedPrecisionLists(custom_black_list=[torch.matmul]), ListFileError,
                 r"custom_black_list: <built-in method matmul .* is not an op name; .* Did you mean 'matmul'\?",
                 id="custom_black_list-a-torch-function"),
    pytest.param(lambda tmp: AutoMixedPrecisionLists(custom_white_list=["MM"]), ListFileError,
                 r"custom_white_list: unknown op 'MM': .* Did you mean 'mm'", id="custom_white_list-op-in-capitals"),
    pytest.param(lambda tmp: graphamp.rewrite(nn.Linear(4, 4), (x(),), amp_lists="bfloat16"), ArgumentError,
                 r"rewrite\(amp_lists=\.\.\.\) got a str; pass graphamp\.AutoMixedPrecisionLists\(dtype='bfloat16'\)",
                 id="rewrite-amp_lists-a-string"),
    pytest.param(lambda tmp: graphamp.export_program(nn.Linear(4, 4), (x(),), amp_lists="bf16"), ArgumentError,
                 r"export_program\(amp_lists=\.\.\.\) got a str; "
                 r"pass graphamp\.AutoMixedPrecisionLists\(dtype='bf16'\)",
                 id="export_program-amp_lists-a-string"),
    pytest.param(lambda tmp: graphamp.doctor(nn.Linear(4, 4), (x(),), amp_lists=torch.float16), ArgumentError,
                 r"doctor\(amp_lists=\.\.\.\) got a dtype", id="doctor-amp_lists-a-dtype"),
    pytest.param(lambda tmp: graphamp.decorate(torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1), "float16"),
                 ArgumentError, r"decorate\(amp_lists=\.\.\.\) got a str; pass the "
                 r"graphamp\.AutoMixedPrecisionLists\(dtype='float16'\)", id="decorate-amp_lists-a-string"),
    pytest.param(lambda tmp: graphamp.rewrite(nn.Linear(4, 4), [x()]), ArgumentError,
                 r"rewrite\(\) got example_args as a list; the positional arguments are a tuple: \(x,\)",
                 id="rewrite-example_args-a-list"),
    pytest.param(lambda tmp: graphamp.export_program(nn.Linear(4, 4), [x()]), ArgumentError,
                 r"export_program\(\) got example_args as a list; the positional arguments are a tuple: \(x,\)",
                 id="export_program-example_args-a-list"),
    pytest.param(lambda tmp: graphamp.rewrite(nn.Linear(4, 4), (x(),), example_kwargs=[1]), ArgumentError,
                 r"example_kwargs as a list; pass a dict", id="example_kwargs-a-list"),
    pytest.param(lambda tmp: graphamp.rewrite(lambda t: t, (x(),)), ArgumentError,
                 r"rewrite\(\) takes an nn\.Module, got function", id="rewrite-a-function"),
    pytest.param(lambda tmp: graphamp.export_program(lambda t: t, (x(),)), ArgumentError,
                 r"export_program\(\) takes an nn\.Module, got function", id="export_program-a-function"),
    pytest.param(lambda tmp: graphamp.auto_cast(bf16_lists(), model=nn.Linear(4, 4).forward), ArgumentError,
                 r"auto_cast\(model=\.\.\.\) takes an nn\.Module, got method", id="auto_cast-model-a-method"),
    pytest.param(lambda tmp: graphamp.backend(bf16_lists(), model="model"), ArgumentError,
                 r"backend\(model=\.\.\.\) takes an nn\.Module, got str", id="backend-model-a-string"),
    pytest.param(lambda tmp: graphamp.rewrite(nn.Linear(4, 4).half(), (x().half(),), amp_lists=bf16_lists()),
                 ArgumentError, r"parameter 'weight' is float16: .*Keep the model in float32",
                 id="rewrite-a-half-model"),
    pytest.param(lambda tmp: graphamp.export_program(nn.Linear(4, 4), (x(),), amp_lists=bf16_lists(), level="O3"),
                 ArgumentError, r"level='O3': use 'O1' \(lists decide\) or 'O2'", id="export_program-level-O3"),
    # rewrite()'s own arguments
    pytest.param(rewritten_twice, ArgumentError,
                 r"this Linear was already rewritten by graphamp\.rewrite\(\): .*rewrite a fresh FP32 model",
                 id="rewrite-a-rewritten-model"),
    pytest.param(lambda tmp: graphamp.rewrite(nn.Linear(4, 4), (x(),), amp_lists=bf16_lists(), fp32_output=False),
                 ArgumentError, r"rewrite\(\) got an unexpected keyword argument 'fp32_output'",
                 id="rewrite-unknown-keyword"),
    pytest.param(lambda tmp: graphamp.rewrite(nn.Linear(4, 4), (x(),), amp_lists=bf16_lists(), mode="max-autotune"),
                 ArgumentError, r"mode='max-autotune' is inductor's: pass compile=True with it",
                 id="rewrite-mode-without-compile"),
    pytest.param(lambda tmp: graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16_lists(), compile=True, mode="fastest"),
                 ArgumentError, r"mode='fastest' is not one of torch\.compile's modes: use one of default, ",
                 id="rewrite-unknown-mode"),
    pytest.param(lambda tmp: graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16_lists(), compile=True,
                                              mode="max-autotune", options={"max_autotune": True}),
                 ArgumentError, r"mode='max-autotune' and options= both set inductor's settings",
                 id="rewrite-mode-and-options"),
    pytest.param(lambda tmp: graphamp.rewrite(Head(), (x(),), amp_lists=bf16_lists(), checkpoint="layers.*"),
                 ArgumentError,
                 r"checkpoint='layers\.\*' matches no submodule of Head; module paths look like body, head",
                 id="rewrite-checkpoint-matching-nothing"),
    pytest.param(lambda tmp: graphamp.rewrite(Head(), (x(),), amp_lists=bf16_lists(), checkpoint=["head"]),
                 ArgumentError, r"checkpoint=\['head'\]: pass one module path or glob", id="rewrite-checkpoint-a-list"),
    pytest.param(rewritten_model_called_under_autocast, DoubleAmpError,
                 r"Linear, rewritten by graphamp, was called inside an active torch\.autocast region on cpu: .*"
                 r"drop the torch\.autocast context", id="rewritten-model-called-under-autocast"),
    pytest.param(exported_under_autocast, DoubleAmpError,
                 r"graphamp\.export_program\(\) of Linear was called inside an active torch\.autocast region on cpu: "
                 r".*drop the torch\.autocast context", id="export_program-under-autocast"),
    pytest.param(lambda tmp: graphamp.backend(bf16_lists(), inductor_options={"max_autotuen": True}), ArgumentError,
                 r"backend\(inductor_options=\.\.\.\) got 'max_autotuen', which is not one of inductor's options "
                 r"\(torch\._inductor\.list_options\(\)\); did you mean 'max_autotune'", id="backend-unknown-inductor-option"),
    pytest.param(lambda tmp: graphamp.backend(bf16_lists(), inductor=False, inductor_options={"max_autotune": True}),
                 ArgumentError, r"backend\(inductor_options=\.\.\.\) are inductor's: pass inductor=True with them",
                 id="backend-inductor-options-without-inductor"),
    pytest.param(lambda tmp: graphamp.rewritten_graphs(nn.Linear(4, 4)), ArgumentError,
                 r"rewritten_graphs\(\) takes a model graphamp\.rewrite\(\) converted .* got a Linear that was not "
                 r"rewritten", id="rewritten_graphs-of-an-fp32-model"),
    pytest.param(lambda tmp: graphamp.doctor(nn.Linear(4, 4), (x(),), amp_lists=bf16_lists(),
                                             loss_scaling=math.nan), ArgumentError, r"loss_scaling=nan: pass a positive finite number", id="doctor-loss_scaling-nan"),
    # lists folders from Python, checked as `graphamp check-lists` checks them
    pytest.param(lists_folder(), ListFileError, r"holds none of white\.txt, black\.txt, gray\.txt, "
                 r"black_modules\.txt", id="lists_dir-without-list-files"),
    pytest.param(lists_folder(**{"White.txt": "mm\n"}), ListFileError,
                 r"White\.txt: graphamp does not read this file; did you mean white\.txt\?", id="lists_dir-White.txt"),
    pytest.param(lists_folder(**{"black.txt": "softmax\n", "white.TXT": "mm\n"}), ListFileError,
                 r"white\.TXT: graphamp does not read this file; did you mean white\.txt\?", id="lists_dir-white.TXT"),
    pytest.param(lists_folder(**{"black.txt": "softmax\n", "white.list": "mm\n"}), ListFileError,
                 r"white\.list: graphamp does not read this file; did you mean white\.txt\?", id="lists_dir-white.list"),
    pytest.param(lists_folder(**{"white.txt": "mm\n", "Black_Modules.TXT": "head\n"}), ListFileError,
                 r"Black_Modules\.TXT: graphamp does not read this file; did you mean black_modules\.txt\?",
                 id="lists_dir-Black_Modules.TXT"),
    pytest.param(lambda tmp: AutoMixedPrecisionLists(lists_dir=5), ListFileError,
                 r"lists_dir=5: pass the path of a lists folder", id="lists_dir-a-number"),
    pytest.param(lambda tmp: AutoMixedPrecisionLists(lists_dir=tmp / "missing"), ListFileError,
                 r"missing: lists_dir is not a folder", id="lists_dir-missing"),
    pytest.param(lists_folder(**{"gray.txt": "[float16]\nexpp\n"}), ListFileError,
                 r"gray\.txt:2: unknown op 'expp'.*Did you mean 'exp'", id="typo-under-the-other-dtype"),
    pytest.param(lists_folder(**{"white.txt": "mm\n", "promote.txt": "[float16]\natan22\n"}), ListFileError,
                 r"promote\.txt:2: unknown op 'atan22'.*Did you mean 'atan2'", id="promote-typo-under-the-other-dtype"),
    pytest.param(lists_folder(**{"white.txt": "mm\n", "black_modules.txt": "[float16]\nlayers.[0\n"}), ListFileError,
                 r"black_modules\.txt:2: 'layers\.\[0' is not a valid glob", id="glob-under-the-other-dtype"),
    # lines as an editor counts them: \n, \r\n or \r end one; \f and U+2028 do not (str.splitlines() breaks at both)
    pytest.param(lists_folder(**{"white.txt": "mm  # matmuls\u2028softmax\nexpp\n"}), ListFileError,
                 r"white\.txt:2: unknown op 'expp'", id="line-separator-in-a-comment"),
    pytest.param(lists_folder(**{"white.txt": "mm\n\f\nexpp\n"}), ListFileError,
                 r"white\.txt:2: .* holds the invisible character '\\x0c'", id="form-feed-line"),
    # invisible characters, shown escaped with file:line
    pytest.param(lists_folder(**{"white.txt": "# matmuls\nm\u200bm\n"}), ListFileError,
                 r"white\.txt:2: 'm\\u200bm' holds the invisible character '\\u200b'", id="zero-width-space"),
    pytest.param(lists_folder(**{"black.txt": "soft\u00a0max\n"}), ListFileError,
                 r"black\.txt:1: .* holds the invisible character '\\xa0'", id="no-break-space"),
    pytest.param(lists_folder(**{"white.txt": "mm\nsilu\u00a0  # pasted\n"}), ListFileError,
                 r"white\.txt:2: 'silu\\xa0' holds the invisible character '\\xa0'", id="trailing-no-break-space"),
    pytest.param(lambda tmp: AutoMixedPrecisionLists(custom_black_list=["soft\u200dmax"]), ListFileError,
                 r"custom_black_list: .* holds the invisible character '\\u200d'", id="zero-width-joiner-custom"),
    # module patterns
    pytest.param(lambda tmp: AutoMixedPrecisionLists(custom_black_modules=["[invalid"]), ListFileError,
                 r"custom_black_modules: \[invalid: '\[invalid' is not a valid glob", id="glob-unclosed-bracket"),
    pytest.param(lists_folder(**{"white.txt": "mm\n", "black_modules.txt": "layers.[0\n"}), ListFileError,
                 r"black_modules\.txt:1: 'layers\.\[0' is not a valid glob", id="glob-unclosed-bracket-in-file"),
    pytest.param(lists_folder(**{"white.txt": "mm\n", "black_modules.txt": "[invalid\n"}), ListFileError,
                 r"black_modules\.txt:1: '\[invalid' is not a valid glob", id="glob-unclosed-bracket-first-in-file"),
    pytest.param(lambda tmp: AutoMixedPrecisionLists(custom_black_modules=[""]), ListFileError,
                 r"custom_black_modules: '' is not a module pattern; pass module paths or globs like 'lm_head'",
                 id="empty-module-pattern"),
    # op names
    pytest.param(lambda tmp: AutoMixedPrecisionLists(custom_black_list=["::silu"]), ListFileError,
                 r"custom_black_list: '::silu' is not an op name: .*Did you mean 'silu'", id="empty-namespace-custom"),
    pytest.param(lists_folder(**{"white.txt": "mm\n::silu\n"}), ListFileError,
                 r"white\.txt:2: '::silu' is not an op name: .*Did you mean 'silu'", id="empty-namespace-in-file"),
    # export
    pytest.param(exported_twice, ExportError,
                 r"out/graph\.py: already exists; pass overwrite=True \(graphamp export --force\)",
                 id="export-over-an-earlier-export"),
    pytest.param(lambda tmp: exported_twice(tmp, rewritten_model), ExportError,
                 r"out/graph_0/graph\.py: already exists; pass overwrite=True \(graphamp export --force\)",
                 id="export-a-rewritten-model-over-an-earlier-export"),
    pytest.param(export_into_a_file, ExportError, r"out: is a file, not a folder", id="export-into-a-file"),
    pytest.param(lambda tmp: export_into_a_file(tmp, rewritten_model), ExportError, r"out: is a file, not a folder",
                 id="export-a-rewritten-model-into-a-file"),
    pytest.param(lambda tmp: graphamp.export(program(), tmp / "out", example_args=[x()]), ArgumentError,
                 r"export\(\) got example_args as a list.*pass a tuple of positional arguments",
                 id="export-example_args-a-list"),
    pytest.param(lambda tmp: graphamp.export(program(), tmp / "out", model="model"), ArgumentError,
                 r"export\(\) got .* model as a str", id="export-model-a-string"),
    pytest.param(lambda tmp: graphamp.export(program(), tmp / "out", example_args=(torch.randn(2, 5),)),
                 ArgumentError, r"export\(\): the program cannot run on the example inputs \(.*\); pass "
                 r"example_args/example_kwargs of one call that fits it", id="export-examples-that-do-not-fit"),
    pytest.param(lambda tmp: graphamp.export(nn.Linear(4, 4), tmp / "out"), ArgumentError,
                 r"export\(\) takes the ExportedProgram graphamp\.export_program\(\) returns.*For an FP32 model: "
                 r"graphamp\.export\(graphamp\.export_program\(model, example_args\), out_dir, model=model\)",
                 id="export-an-fp32-model"),
]


@pytest.mark.parametrize("call, error, message", BAD_CALLS)
def test_bad_call_raises_a_typed_error_that_names_the_fix(call, error, message, tmp_path):
    with pytest.raises(error, match=message):
        call(tmp_path)


# -- torch.compile's settings: refused before the conversion, the model left as it was -------------------------

@pytest.mark.parametrize("settings, message", [
    pytest.param({"compile": True, "options": {"max_autotuen": True}},
                 r"rewrite\(options=\.\.\.\) got 'max_autotuen', which is not one of inductor's options "
                 r"\(torch\._inductor\.list_options\(\)\); did you mean 'max_autotune', ", id="rewrite-unknown-option"),
    pytest.param({"compile": True, "options": {"dtype": "float16"}},
                 r"got 'dtype', which is not one of inductor's options .*it is graphamp's: pass "
                 r"amp_lists=graphamp\.AutoMixedPrecisionLists\(\.\.\.\) or level= instead", id="rewrite-a-list-option"),
    pytest.param({"options": {"max_autotune": True}},
                 r"options=\{'max_autotune': True\} are inductor's: pass compile=True with them",
                 id="rewrite-options-without-compile"),
    pytest.param({"mode": "max-autotune"}, r"mode='max-autotune' is inductor's: pass compile=True with it",
                 id="rewrite-mode-without-compile"),
    pytest.param({"compile": "yes"}, r"rewrite\(\) got compile='yes': pass True or False", id="rewrite-compile-not-bool"),
    pytest.param({"dynamic": "yes"}, r"rewrite\(\) got dynamic='yes': pass None, True or False",
                 id="rewrite-dynamic-not-bool"),
    pytest.param({"fullgraph": None}, r"rewrite\(\) got fullgraph=None: pass True or False",
                 id="rewrite-fullgraph-not-bool"),
])
def test_rewrite_refuses_inductor_settings_it_would_not_use_and_leaves_the_model_unconverted(settings, message):
    model = Head()

    with pytest.raises(ArgumentError, match=message):
        graphamp.rewrite(model, (x(),), amp_lists=bf16_lists(), **settings)

    assert not graphamp.is_rewritten(model)


def test_model_compile_refuses_an_unknown_inductor_option_and_keeps_its_settings():
    model = rewritten_model()

    with pytest.raises(ArgumentError, match=r"model\.compile\(options=\.\.\.\) got 'epilogue_fusoin', which is not "
                                            r"one of inductor's options .*did you mean 'epilogue_fusion'"):
        model.compile(options={"epilogue_fusoin": False})

    assert graphamp.is_rewritten(model) and not model._graphamp.settings.inductor


# -- lists ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["README.md", "notes.txt", "white.txt~", "white.txt.bak", ".white.txt.swp"])
def test_a_lists_folder_may_hold_files_that_are_no_misnamed_list(name, tmp_path):
    folder = write_list_folder(tmp_path, white="mm\n", **{name: "not a list\n"})

    assert AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder).white_list == {"mm"}


def test_a_byte_order_mark_is_skipped(tmp_path):
    folder = write_list_folder(tmp_path, white="\ufeffmm\n")

    assert "mm" in AutoMixedPrecisionLists(lists_dir=folder).white_list


@pytest.mark.parametrize("spelling", ["aten.gelu.default", "torch.ops.aten.gelu.default", "aten::gelu.default"])
def test_an_op_spelled_as_node_target_prints_it_is_that_overload(spelling, tmp_path):
    folder = write_list_folder(tmp_path, white=f"{spelling}\n")

    entry = AutoMixedPrecisionLists(lists_dir=folder).classify(torch.ops.aten.gelu.default)

    assert (entry.name, entry.color) == ("gelu.default", "white")


def test_a_packet_spelled_with_the_aten_namespace_is_the_packet():
    lists = bf16_lists(custom_black_list=["aten.gelu"])

    assert lists.classify(torch.ops.aten.gelu.default).color == "black"


@torch.library.custom_op("graphamp_bad_input::fused_gelu", mutates_args=())
def fused_gelu(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x)


def test_a_typo_of_a_registered_custom_op_gets_a_suggestion():
    with pytest.warns(UserWarning, match=r"^custom_white_list: custom op 'graphamp_bad_input::fused_gleu' is not "
                                          r"registered \(yet\): it is kept, and applies if torch\.library registers "
                                          r"it before the model is rewritten \(did you mean "
                                          r"'graphamp_bad_input::fused_gelu'\?\)\.$"):
        bf16_lists(custom_white_list=["graphamp_bad_input::fused_gleu"])


@torch.library.custom_op("graphamp_no_fake::doubled", mutates_args=())
def doubled_without_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class CallsAnOpWithoutFake(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return doubled_without_fake(self.linear(x))


NO_FAKE = (r"cannot capture CallsAnOpWithoutFake at .*: the custom op 'graphamp_no_fake::doubled' has no fake "
           r"implementation.*Fix: register one with torch\.library\.register_fake\('graphamp_no_fake::doubled'\)")


@pytest.mark.parametrize("entry_point", [graphamp.rewrite, graphamp.export_program, graphamp.doctor])
def test_a_custom_op_without_fake_implementation_is_named_with_the_fix_and_the_model_left_as_it_was(entry_point):
    """torch.compile and torch.export need its output's shape and dtype: dynamo's raw error (or a CaptureError
    whose fix says 'make that construct traceable') becomes graphamp's, naming the op and register_fake."""
    model = CallsAnOpWithoutFake()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    with pytest.raises(graphamp.CaptureError, match=NO_FAKE):
        entry_point(model, (x(),), amp_lists=bf16_lists())

    assert not graphamp.is_rewritten(model) and model._compiled_call_impl is None
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    assert model(x()).dtype == torch.float32


def test_a_custom_op_without_fake_implementation_is_named_at_the_first_call_of_a_model_rewritten_without_examples():
    model = graphamp.rewrite(CallsAnOpWithoutFake(), amp_lists=bf16_lists())

    with pytest.raises(graphamp.CaptureError, match=NO_FAKE):
        model(x())


def test_many_unregistered_custom_ops_give_one_warning(tmp_path):
    entries = "".join(f"unloaded_lib::op{i}\n" for i in range(100_000))
    folder = write_list_folder(tmp_path, white=entries)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lists = AutoMixedPrecisionLists(lists_dir=folder)

    assert len(caught) == 1
    assert "100000 custom ops are not registered (yet)" in str(caught[0].message)
    assert "and 99995 more" in str(caught[0].message)
    assert len(lists.white_list) == 100_000


@pytest.mark.parametrize("file", OP_LIST_FILES.values())
def test_a_shipped_list_ends_in_the_all_section(file):
    lines = (default_lists_dir() / file).read_text().splitlines()
    headers = [line.split("#")[0].strip() for line in lines if line.startswith("[")]

    assert headers[-1:] in ([], ["[all]"])


def test_an_entry_appended_to_a_copy_of_gray_txt_is_gray_in_both_dtypes(tmp_path):
    folder = tmp_path / "lists"
    folder.mkdir()
    for file in OP_LIST_FILES.values():
        (folder / file).write_text((default_lists_dir() / file).read_text())
    with open(folder / "gray.txt", "a") as gray:
        gray.write("mylib_not_loaded::op\n")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the op is not registered
        colors = {dtype: AutoMixedPrecisionLists(dtype=dtype, lists_dir=folder).gray_list for dtype in
                  ("float16", "bfloat16")}

    assert all("mylib_not_loaded::op" in gray for gray in colors.values())


# -- module patterns -----------------------------------------------------------------------------------------

def test_an_unmatched_black_module_pattern_warns_on_rewrite_with_the_closest_paths():
    lists = bf16_lists(custom_black_modules=["lm_head"])

    with pytest.warns(UserWarning, match=r"custom_black_modules: lm_head: black-module pattern 'lm_head' matches "
                                          r"no module of Head, so it keeps nothing in FP32; closest module paths: head"):
        graphamp.rewrite(Head(), (x(),), amp_lists=lists)


def test_an_unmatched_pattern_of_black_modules_txt_names_its_line(tmp_path):
    folder = write_list_folder(tmp_path, white="addmm\n", **{"black_modules.txt": "# fp32\nbody.*\n"})

    with pytest.warns(UserWarning, match=r"black_modules\.txt:2: black-module pattern 'body\.\*' matches no module"):
        graphamp.doctor(Head(), (x(),), amp_lists=AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder))


def test_a_matched_black_module_pattern_gives_no_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*black-module pattern")
        graphamp.rewrite(Head(), (x(),), amp_lists=bf16_lists(custom_black_modules=["he*"]))
        graphamp.export_program(Head(), (x(),), amp_lists=bf16_lists(custom_black_modules=["he*"]))


def test_an_unmatched_black_module_pattern_warns_on_export_program_too():
    lists = bf16_lists(custom_black_modules=["lm_head"])

    with pytest.warns(UserWarning, match=r"black-module pattern 'lm_head' matches no module of Head.*closest module "
                                          r"paths: head"):
        graphamp.export_program(Head(), (x(),), amp_lists=lists)



class BranchingHead(Head):
    """The head called in one branch of a torch.cond: non-strict torch.export records no module path in its body."""

    def forward(self, x):
        hidden = self.body(x)
        return torch.cond(hidden.sum() > 0, lambda h: self.head(h), lambda h: h[..., :2] * 2, (hidden,))


@pytest.mark.parametrize("entry_point", ["export_program", "doctor", "auto_mixed_precision"])
def test_entry_points_reading_the_exported_program_say_black_module_patterns_cannot_reach_a_cond_bodys_ops(entry_point):
    """Kept FP32 by rewrite(), which knows the body's module paths; the exported program (export_program's, and the
    one the doctor and auto_mixed_precision measure) cannot tell, and each says so, at the user's line."""
    with pytest.warns(UserWarning, match=rf"^{entry_point}\(\): torch\.export records no module path inside cond "
                                          r"bodies, so the black-module patterns cannot keep their ops FP32.*"
                                          r"rewrite\(\) knows those paths") as caught:
        getattr(graphamp, entry_point)(BranchingHead(), (x(),), amp_lists=bf16_lists(custom_black_modules=["head"]))

    assert {w.filename for w in caught if "records no module path" in str(w.message)} == {__file__}


def test_an_unmatched_black_module_pattern_warns_at_every_auto_cast_of_a_model_it_matches_nothing_in():
    """Not once per lists: lists rewrite() used already, a second model, a second entry each say so (Python's own
    filters show a warning once per line of code, which a training loop entering auto_cast each step relies on)."""
    lists = bf16_lists(custom_black_modules=["lm_head"])
    graphamp.rewrite(Head(), (x(),), amp_lists=lists)
    unmatched = r"black-module pattern 'lm_head' matches no module of Head.*closest module paths: head"

    for model in (Head(), Head(), Head()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with graphamp.auto_cast(lists, model=model):
                model(x())
        assert [str(w.message) for w in caught if re.search(unmatched, str(w.message))] != []
        assert [w.filename for w in caught] == [__file__]  # the user's line, not graphamp's


def test_an_unmatched_black_module_pattern_of_a_backend_names_the_callers_line():
    with pytest.warns(UserWarning, match=r"black-module pattern 'lm_head' matches no module of Head") as caught:
        graphamp.backend(bf16_lists(custom_black_modules=["lm_head"]), model=Head())

    assert [w.filename for w in caught] == [__file__]


# -- rewrite()'s arguments of the export-based release --------------------------------------------------------

# Each argument the export-based rewrite() had and torch.compile made moot, and words of what replaces it.
DEPRECATED = {
    "fp32_outputs": "dtypes the model's own code gives them",
    "max_captures": "recompile_limit",
    "progress": "TORCH_LOGS",
    "regions": "within the whole model's capture",
    "weight_cache": "inductor casts each weight",
}


@pytest.mark.parametrize("argument", DEPRECATED)
def test_a_deprecated_rewrite_argument_warns_naming_its_replacement_and_is_ignored(argument):
    model = Head()
    expected = model(x := torch.randn(2, 4))

    with pytest.warns(DeprecationWarning, match=rf"rewrite\({argument}=\.\.\.\) is ignored since graphamp 0\.3.*"
                                                rf"{re.escape(DEPRECATED[argument])}"):
        rewritten = graphamp.rewrite(model, (x,), amp_lists=bf16_lists(), **{argument: False})

    assert rewritten is model
    out = model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=3e-2, atol=3e-2)


def test_compile_mode_warns_that_it_is_now_mode_and_still_sets_it():
    with pytest.warns(DeprecationWarning, match=r"rewrite\(compile_mode=\.\.\.\) is now rewrite\(mode=\.\.\.\)"):
        with pytest.raises(ArgumentError, match=r"mode='max-autotune' is inductor's: pass compile=True"):
            graphamp.rewrite(Head(), (x(),), amp_lists=bf16_lists(), compile_mode="max-autotune")


# -- export --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [program, rewritten_model], ids=["program", "rewritten-model"])
def test_a_failed_export_leaves_no_folder_it_made_and_a_folder_that_was_there_as_it_was(tmp_path, make, monkeypatch):
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "notes.md").write_text("mine")
    what = make()

    def fails(*args):
        raise ExportError("dot failed")  # as graph.svg's Graphviz can, after the folders were made

    monkeypatch.setattr("graphamp.inspection.export_files.render_svg", fails)
    for out in (tmp_path / "new" / "out", tmp_path / "there"):
        with pytest.raises(ExportError, match="dot failed"):
            graphamp.export(what, out)

    assert _files_in(tmp_path) == ["there", "there/notes.md"]


@pytest.mark.parametrize("make", [program, rewritten_model], ids=["program", "rewritten-model"])
def test_export_overwrites_an_earlier_export_when_told(tmp_path, make):
    what = make()
    graphamp.export(what, tmp_path)
    written = sorted(tmp_path.rglob("graph.py"))
    for path in written:
        path.write_text("stale")

    graphamp.export(what, tmp_path, overwrite=True)

    assert written and all(path.read_text() != "stale" for path in written)


# -- the cast pass -------------------------------------------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_spectral_norm_rewrite_prints_no_fake_tensor_errors(capfd):
    """The probe's expected refusal (spectral_norm's vdot on mixed dtypes) logs nothing: a handler on the fake-tensor
    logger itself sees any record torch would print, and nothing reaches the process's stderr."""
    records = _Records()
    fake_tensor_logger = logging.getLogger("torch._subclasses.fake_tensor")
    fake_tensor_logger.addHandler(records)
    try:
        torch.manual_seed(0)
        m = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)), nn.ReLU())
        x = torch.randn(2, 8)
        expected = m(x)
        amp = graphamp.rewrite(m, (x,), amp_lists=graphamp.AutoMixedPrecisionLists(dtype="bfloat16"))
        out = amp(x)
    finally:
        fake_tensor_logger.removeHandler(records)
    err = capfd.readouterr().err

    torch.testing.assert_close(out, expected, rtol=3e-2, atol=3e-2)
    assert [record.getMessage() for record in records.records] == []
    assert "fake_tensor" not in err
    assert "Traceback" not in err


# -- the CLI, in this process (tests/test_cli.py runs `python -m graphamp.cli` in a subprocess) -----------------

class Run(NamedTuple):
    returncode: int
    stderr: str


@pytest.fixture
def run_cli(tmp_path, monkeypatch, capsys):
    """`graphamp ARGV` run from tmp_path by graphamp.cli.main: its exit status (argparse's SystemExit included) and
    its stderr; the factory modules it imports are dropped from sys.modules afterwards."""
    monkeypatch.chdir(tmp_path)
    for name in FACTORIES:
        monkeypatch.delitem(sys.modules, name.removesuffix(".py"), raising=False)

    def run(argv):
        capsys.readouterr()
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
        return Run(status, capsys.readouterr().err)

    return run


FACTORIES = {
    "raises.py": "def make():\n    raise RuntimeError('no weights here')\n",
    "broken.py": "def make(:\n    pass\n",
    "needs_missing.py": "import graphamp_no_such_package\n\ndef make():\n    pass\n",
    "fine.py": "import torch\nfrom torch import nn\n\ndef make():\n    return nn.Linear(4, 4), (torch.randn(2, 4),)\n",
    "listed.py": "import torch\nfrom torch import nn\n\ndef make():\n    return nn.Linear(4, 4), [torch.randn(2, 4)]\n",
}

BAD_COMMANDS = [
    pytest.param(["export", "raises:make", "--out", "out"], 1,
                 r"^error: raises:make: make\(\) raised RuntimeError: no weights here\n\(run with --debug",
                 id="factory-raises"),
    pytest.param(["export", "broken:make", "--out", "out"], 1,
                 r"^error: broken:make: importing broken failed: SyntaxError: .*broken\.py, line 1",
                 id="factory-module-syntax-error"),
    pytest.param(["export", "needs_missing:make", "--out", "out"], 1,
                 r"^error: needs_missing:make: importing needs_missing failed: ModuleNotFoundError: "
                 r"No module named 'graphamp_no_such_package'", id="factory-module-import-fails"),
    pytest.param(["export", "listed:make", "--out", "out"], 1, r"^error: listed:make returned example_args as a list; "
                 r"return a tuple: \(x,\) or \(x, y\)", id="factory-returns-example_args-as-a-list"),
    pytest.param(["export", "fine:make", "--out", "a_file"], 1, r"^error: a_file: is a file, not a folder",
                 id="export-out-is-a-file"),
    pytest.param(["export", "fine:make", "--out", "a_file/out"], 1,
                 r"^error: a_file/out: cannot create the folder \(Not a directory\)", id="export-out-inside-a-file"),
    pytest.param(["export", "fine:make", "--out", "done"], 1,
                 r"^error: done/graph\.py: already exists; pass overwrite=True \(graphamp export --force\)",
                 id="export-over-an-earlier-export"),
    pytest.param(["export", "fine:make", "--out", "new/out", "--lists", "empty"], 1,
                 r"^error: empty: holds none of white\.txt", id="export-lists-fail-after-the-out-folder-is-checked"),
    pytest.param(["doctor", "raises:make", "--out", "report", "--apply", "new/applied"], 1,
                 r"^error: raises:make: make\(\) raised RuntimeError", id="doctor-factory-raises"),
    pytest.param(["doctor", "fine:make", "--loss-scaling", "nan"], 2,
                 r"argument --loss-scaling: 'nan' is not a positive finite number", id="doctor-nan-scaling"),
    pytest.param(["doctor", "fine:make", "--top", "-3"], 2,
                 r"argument --top: '-3' is not a whole number of at least 0", id="doctor-negative-top"),
    pytest.param(["doctor", "fine:make", "--auto", "-1"], 2,
                 r"argument --auto: '-1' is not a positive finite number", id="doctor-negative-auto"),
    pytest.param(["doctor", "fine:make", "--apply", str(REPO / "lists"), "--out", "report"], 1,
                 r"^error: .*lists: is the folder of graphamp's shipped lists, which is never written over",
                 id="doctor-apply-to-the-shipped-lists"),
    pytest.param(["lists", "--lists", "empty"], 1, r"^error: empty: holds none of white\.txt",
                 id="lists-folder-without-list-files"),
    pytest.param(["check-lists", "latin1"], 1,
                 r"^error: latin1/white\.txt:2: byte 0xe9 \(offset 8\) is not UTF-8; save the file as UTF-8\.\n\Z",
                 id="check-lists-a-latin-1-file"),
]


@pytest.mark.parametrize("argv, status, message", BAD_COMMANDS)
def test_bad_command_gets_one_error_line_and_no_traceback(argv, status, message, tmp_path, run_cli):
    for name, source in FACTORIES.items():
        (tmp_path / name).write_text(source)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "graph.py").write_text("an earlier export")
    (tmp_path / "empty").mkdir()
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "white.txt").write_bytes("mm\n# café\n".encode("latin-1"))
    before = _files_in(tmp_path)

    result = run_cli(argv)

    assert result.returncode == status
    assert "Traceback" not in result.stderr
    assert re.search(message, result.stderr, flags=re.MULTILINE | re.DOTALL), result.stderr
    assert _files_in(tmp_path) == before  # no --out or --apply folder it made is left, empty or partial
    assert (tmp_path / "done" / "graph.py").read_text() == "an earlier export"


def _files_in(folder: Path) -> list[str]:
    """Every file and folder under `folder` but Python's bytecode caches of the imported factories."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if "__pycache__" not in path.parts)


def test_debug_prints_the_traceback_of_the_users_error(tmp_path, run_cli):
    (tmp_path / "raises.py").write_text(FACTORIES["raises.py"])

    result = run_cli(["export", "raises:make", "--out", "out", "--debug"])

    assert result.returncode == 1
    assert "Traceback" in result.stderr
    assert "raise RuntimeError('no weights here')" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == "error: raises:make: make() raised RuntimeError: no weights here"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_folder_is_an_error_line(tmp_path, run_cli):
    (tmp_path / "fine.py").write_text(FACTORIES["fine.py"])
    (tmp_path / "locked").mkdir(mode=0o555)

    result = run_cli(["export", "fine:make", "--out", "locked/out"])

    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: locked/out: cannot create the folder (Permission denied)")


def test_no_plain_value_error_is_raised_to_users():
    """Every error graphamp raises on purpose is typed (docs/errors.md): a GraphampError subclass names the fix."""
    import ast
    from pathlib import Path

    package = Path(graphamp.__file__).parent
    plain = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
        and getattr(node.exc.func, "id", None) in ("ValueError", "TypeError", "RuntimeError")
    ]
    assert plain == []


def function_kept_fp32_by_its_author():
    """apex and xformers keep a fused op FP32 with torch.amp.custom_fwd(cast_inputs=torch.float32)."""

    class MatmulKeptFloat32ByItsAuthor(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx, a, b):
            return a @ b

    return MatmulKeptFloat32ByItsAuthor


@pytest.mark.parametrize("entry_point", ["rewrite", "export_program", "auto_cast"])
def test_a_function_declaring_custom_fwd_cast_inputs_is_named_with_the_fix(entry_point, bf16):
    """The decorator casts only while torch.autocast is on, which graphamp never turns on, and no graph or function
    mode can tell its calls: graphamp says so at each entry point, naming the Function and the fix. The Function
    lives for this test only: loaded, it is warned of at every entry point, which other tests would see."""
    function = function_kept_fp32_by_its_author()
    try:
        with pytest.warns(UserWarning, match=r"MatmulKeptFloat32ByItsAuthor \(cast_inputs=torch.float32\).*black"):
            if entry_point == "auto_cast":  # lists not used before: auto_cast looks once per lists
                graphamp.auto_cast(graphamp.AutoMixedPrecisionLists(dtype="bfloat16", custom_black_list=["softplus"]))
            else:
                getattr(graphamp, entry_point)(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)
    finally:
        del function
        gc.collect()  # a class lives in reference cycles: collected, it leaves Function.__subclasses__()
    assert "MatmulKeptFloat32ByItsAuthor" not in {c.__name__ for c in torch.autograd.Function.__subclasses__()}
