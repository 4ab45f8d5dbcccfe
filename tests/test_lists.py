"""AutoMixedPrecisionLists: list files, custom lists, and the errors bad input gets."""

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphamp import ArgumentError, AutoMixedPrecisionLists, ListFileError

REPO = Path(__file__).resolve().parents[1]


def test_default_lists_hold_the_gemm_class_white_and_range_sensitive_ops_black():
    lists = AutoMixedPrecisionLists()
    assert {"mm", "bmm", "addmm", "matmul", "linear", "conv2d", "scaled_dot_product_attention"} <= lists.white_list
    assert {"exp", "log", "pow", "softmax", "log_softmax", "rms_norm", "cross_entropy_loss", "sum"} <= lists.black_list
    assert {"add", "mul", "relu", "view", "reshape", "transpose", "cat"} <= lists.gray_list
    # normalizations accumulate in FP32 inside their kernels: they follow X, with FP32 parameters
    assert {"layer_norm", "group_norm", "batch_norm"} <= lists.gray_list


def test_bfloat16_keeps_fewer_ops_fp32_than_float16():
    fp16, bf16 = AutoMixedPrecisionLists(dtype="float16"), AutoMixedPrecisionLists(dtype="bfloat16")
    assert len(bf16.black_list) < len(fp16.black_list)
    assert bf16.black_list <= fp16.black_list  # every op too risky for bf16 is too risky for fp16
    assert "exp" in fp16.black_list and "exp" not in bf16.black_list  # a range problem only fp16 has


def test_no_op_is_on_two_default_lists():
    for dtype in ("float16", "bfloat16"):
        lists = AutoMixedPrecisionLists(dtype=dtype)
        assert not (lists.white_list & lists.black_list)
        assert not (lists.white_list & lists.gray_list)
        assert not (lists.black_list & lists.gray_list)


def test_comments_blank_lines_overloads_and_namespaces_parse(tmp_path, write_lists):
    folder = write_lists(
        tmp_path, white="# GEMMs\n\nlinear   # trailing comment\naten::mm\n", black="add.Tensor\n", gray="relu\n"
    )
    lists = AutoMixedPrecisionLists(lists_dir=folder)
    assert lists.white_list == {"linear", "mm"}
    assert lists.black_list == {"add.Tensor"}
    assert lists.classify(torch.ops.aten.add.Tensor).color == "black"
    assert lists.classify(torch.ops.aten.add.Scalar) is None  # the overload entry covers one overload only


def test_section_scopes_entries_to_one_dtype(tmp_path, write_lists):
    folder = write_lists(tmp_path, black="softmax\n[float16]\nexp\n[bfloat16]\nrsqrt\n[all]\nlog\n")
    assert AutoMixedPrecisionLists(dtype="float16", lists_dir=folder).black_list == {"softmax", "exp", "log"}
    assert AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder).black_list == {"softmax", "rsqrt", "log"}


@pytest.mark.parametrize("files, message", [
    ({"white": "linear\nmm bmm\n"}, r"white\.txt:2: 'mm bmm' holds more than one name"),
    ({"gray": "relu\n[fp8]\n"}, r"gray\.txt:2: unknown section '\[fp8\]'"),
    ({"white": "linear\nlinaer\n"}, r"white\.txt:2: unknown op 'linaer'.*Did you mean 'linear'"),
], ids=["two names on a line", "unknown section", "unknown op"])
def test_a_malformed_line_names_the_file_the_line_and_the_fix(tmp_path, write_lists, files, message):
    folder = write_lists(tmp_path, **files)
    with pytest.raises(ListFileError, match=message):
        AutoMixedPrecisionLists(lists_dir=folder)


def test_a_list_file_not_in_utf8_names_the_line_and_says_to_save_it_as_utf8(tmp_path, write_lists):
    folder = write_lists(tmp_path)
    (folder / "black.txt").write_bytes("softmax\n# café\n".encode("latin-1"))
    with pytest.raises(ListFileError, match=r"black\.txt:2: byte 0xe9 \(offset 13\) is not UTF-8; save the file as "
                                            r"UTF-8\."):
        AutoMixedPrecisionLists(lists_dir=folder)


@pytest.mark.parametrize("entry", ["::silu", "mylib::", "a::b::silu"])
def test_an_entry_with_an_empty_namespace_or_name_is_an_error_naming_the_closest_op(tmp_path, write_lists, entry):
    with pytest.raises(ListFileError, match=rf"custom_black_list: '{entry}' is not an op name.*Did you mean 'silu'"
                       if "silu" in entry else rf"custom_black_list: '{entry}' is not an op name"):
        AutoMixedPrecisionLists(custom_black_list=[entry])
    folder = write_lists(tmp_path, white="mm\n", black=f"softmax\n{entry}\n")
    with pytest.raises(ListFileError, match=rf"black\.txt:2: '{entry}' is not an op name"):
        AutoMixedPrecisionLists(lists_dir=folder)


def test_op_objects_are_list_entries_as_their_names():
    lists = AutoMixedPrecisionLists(custom_black_list=[torch.ops.aten.softmax.int, torch.ops.aten.gelu],
                                    custom_white_list=torch.ops.aten.relu.default)
    assert lists.custom_lists["black"] == ("softmax.int", "gelu") and lists.custom_lists["white"] == ("relu.default",)
    assert lists.classify(torch.ops.aten.softmax.int).source == "custom_black_list"


def test_unknown_overload_lists_the_known_overloads(tmp_path, write_lists):
    folder = write_lists(tmp_path, gray="add.Tensr\n")
    with pytest.raises(ListFileError, match=r"gray\.txt:1: 'add' has no overload 'Tensr'.*did you mean 'Tensor'"):
        AutoMixedPrecisionLists(lists_dir=folder)


def test_unknown_op_in_a_custom_list_names_the_argument():
    with pytest.raises(ListFileError, match=r"custom_black_list: unknown op 'sofmax'.*'softmax'"):
        AutoMixedPrecisionLists(custom_black_list=["sofmax"])


def test_unregistered_custom_op_is_accepted_with_a_warning(tmp_path, write_lists):
    folder = write_lists(tmp_path, white="not_registered_lib::fused_gelu\n")
    with pytest.warns(UserWarning, match=r"white\.txt:1: custom op 'not_registered_lib::fused_gelu' is not registered"):
        lists = AutoMixedPrecisionLists(lists_dir=folder)
    assert "not_registered_lib::fused_gelu" in lists.white_list


def test_registered_custom_op_is_accepted_and_classified():
    import models  # registers graphamp_test::scaled_tanh

    lists = AutoMixedPrecisionLists(custom_white_list=["graphamp_test::scaled_tanh"])
    assert lists.classify(models.scaled_tanh._opoverload).color == "white"


def test_same_op_in_two_files_names_both_places(tmp_path, write_lists):
    folder = write_lists(tmp_path, white="mm\n", black="# fp32\nmm\n")
    with pytest.raises(ListFileError, match=r"black\.txt:2: 'mm' is already white at .*white\.txt:1"):
        AutoMixedPrecisionLists(lists_dir=folder)


def test_custom_white_op_leaves_black_and_gray():
    lists = AutoMixedPrecisionLists(custom_white_list=["softmax", "relu"])
    assert {"softmax", "relu"} <= lists.white_list
    assert "softmax" not in lists.black_list and "relu" not in lists.gray_list


def test_custom_black_op_leaves_white_and_gray():
    lists = AutoMixedPrecisionLists(custom_black_list=["linear", "gelu"])
    assert {"linear", "gelu"} <= lists.black_list
    assert "linear" not in lists.white_list and "gelu" not in lists.gray_list


def test_custom_gray_op_leaves_white_and_black():
    lists = AutoMixedPrecisionLists(custom_gray_list=["softmax"])
    assert "softmax" in lists.gray_list and "softmax" not in lists.black_list


def test_custom_packet_entry_takes_every_overload_away_from_other_lists(tmp_path, write_lists):
    folder = write_lists(tmp_path, black="add.Tensor\n", gray="add.Scalar\n")
    lists = AutoMixedPrecisionLists(custom_white_list=["add"], lists_dir=folder)
    assert lists.classify(torch.ops.aten.add.Tensor).color == "white"
    assert lists.classify(torch.ops.aten.add.Scalar).color == "white"


def test_op_in_custom_white_and_black_is_a_list_file_error_naming_it():
    with pytest.raises(ListFileError, match="'matmul' is in both custom_white_list and custom_black_list; keep it"):
        AutoMixedPrecisionLists(custom_white_list=["matmul"], custom_black_list=["matmul"])


def test_lists_dir_replaces_the_defaults(tmp_path, write_lists):
    folder = write_lists(tmp_path, white="mm\n")
    lists = AutoMixedPrecisionLists(lists_dir=folder)
    assert lists.white_list == {"mm"} and not lists.black_list and not lists.gray_list


def test_lists_dir_that_is_not_a_folder_is_an_error(tmp_path):
    with pytest.raises(ListFileError, match="not a folder"):
        AutoMixedPrecisionLists(lists_dir=tmp_path / "missing")


@pytest.mark.parametrize(
    "given, expected",
    [("float16", torch.float16), ("fp16", torch.float16), (torch.float16, torch.float16),
     ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
)
def test_dtype_accepts_names_and_torch_dtypes(given, expected):
    assert AutoMixedPrecisionLists(dtype=given).dtype == expected


def test_dtype_that_is_not_half_precision_is_an_argument_error_naming_the_fix():
    with pytest.raises(ArgumentError, match="float32.*'float16' or 'bfloat16'") as raised:
        AutoMixedPrecisionLists(dtype=torch.float32)
    assert isinstance(raised.value, ValueError)  # callers that catch ValueError keep working


def test_describe_shows_each_entry_with_its_source(tmp_path, write_lists):
    folder = write_lists(tmp_path, white="mm\nlinear\n", black="softmax\n")
    lists = AutoMixedPrecisionLists(custom_black_list=["gelu"], custom_black_modules=["lm_head"], lists_dir=folder)
    text = lists.describe()
    assert f"{folder / 'white.txt'}:2" in text.split("linear", 1)[1].splitlines()[0]
    assert "custom_black_list" in text.split("gelu", 1)[1].splitlines()[0]
    assert "custom_black_modules: lm_head" in text
    assert "gelu" in repr(lists) and "lm_head" in repr(lists)


def test_default_sources_are_shown_as_lists_file_and_line():
    entry = AutoMixedPrecisionLists().classify(torch.ops.aten.linear.default)
    assert entry.source.startswith("lists/white.txt:")
    line = int(entry.source.rsplit(":", 1)[1])
    assert (REPO / "lists" / "white.txt").read_text().splitlines()[line - 1].split("#")[0].strip() == "linear"


def test_a_bracketed_line_of_black_modules_txt_is_a_glob_unless_it_names_a_section(tmp_path, write_lists):
    folder = write_lists(tmp_path, white="mm\n", black_modules="[ab]*\n[bfloat16]\nhead\n[all]\n[0-9].fc\n")
    for dtype, patterns in (("float16", ["[ab]*", "[0-9].fc"]), ("bfloat16", ["[ab]*", "head", "[0-9].fc"])):
        lists = AutoMixedPrecisionLists(dtype=dtype, lists_dir=folder)
        assert [pattern.name for pattern in lists.black_modules] == patterns
    assert lists.black_module_for("a.body").name == "[ab]*" and lists.black_module_for("c.body") is None


def test_an_unclosed_bracket_of_black_modules_txt_gets_the_glob_message(tmp_path, write_lists):
    folder = write_lists(tmp_path, white="mm\n", black_modules="[invalid\n")
    with pytest.raises(ListFileError, match=r"black_modules\.txt:1: '\[invalid' is not a valid glob: its '\[' opens"):
        AutoMixedPrecisionLists(lists_dir=folder)


def test_an_empty_module_pattern_gets_a_module_pattern_message():
    with pytest.raises(ListFileError, match=r"custom_black_modules: '' is not a module pattern; pass module paths"):
        AutoMixedPrecisionLists(custom_black_modules=[""])


def test_black_modules_come_from_the_file_and_the_argument(tmp_path, write_lists):
    folder = write_lists(tmp_path, black_modules="# stays fp32\nencoder.layer.*.attention\n")
    lists = AutoMixedPrecisionLists(custom_black_modules=["lm_head"], lists_dir=folder)
    assert lists.black_module_for("encoder.layer.3.attention.self.query").source.endswith("black_modules.txt:2")
    assert lists.black_module_for("lm_head").source == "custom_black_modules: lm_head"
    assert lists.black_module_for("encoder.layer.3.output") is None


def _this_environment_builds_wheels() -> bool:
    """pip --no-build-isolation builds with this environment's setuptools: from 70.1 it builds wheels itself,
    before that only with the `wheel` package installed."""
    setuptools = tuple(int(part) for part in importlib.metadata.version("setuptools").split(".")[:2])
    return setuptools >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.mark.skipif(not _this_environment_builds_wheels(), reason="this environment's setuptools is older than 70.1 "
                    "and has no `wheel` package, so pip --no-build-isolation cannot build graphamp's wheel here")
def test_default_lists_are_found_after_a_non_editable_install(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "--no-compile",
         "--disable-pip-version-check", "--target", str(target), str(REPO)],
        check=True, cwd=tmp_path,
    )
    check = (
        "import graphamp, pathlib; l = graphamp.AutoMixedPrecisionLists(); "
        "assert 'linear' in l.white_list; print(pathlib.Path(graphamp.__file__).parent)"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": ""},
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target / "graphamp")
    assert (target / "graphamp" / "default_lists" / "white.txt").is_file()
