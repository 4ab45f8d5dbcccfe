"""write_lists: a lists folder that reads back as the effective lists with the changes, for one dtype only."""

import warnings

import pytest
import torch

from conftest import write_list_folder
from graphamp.errors import ListFileError
from graphamp.diagnosis.list_writer import write_lists
from graphamp.policy.lists import AutoMixedPrecisionLists, default_lists_dir

FILES = ("white.txt", "black.txt", "gray.txt", "black_modules.txt", "promote.txt")


def colors(lists):
    return {(e.name, e.color) for e in lists.entries()}


def read_back(folder, dtype):
    return AutoMixedPrecisionLists(dtype=dtype, lists_dir=folder)


def module_names(lists):
    return sorted(p.name for p in lists.black_modules)


def line_of(path, name):
    """The line that lists `name`, and the section header above it."""
    section = "[all]"
    for line in path.read_text().splitlines():
        if line.startswith("["):
            section = line
        elif line.split("#", 1)[0].strip() == name:
            return section, line
    raise AssertionError(f"{name} is not in {path}")


# -- round trip -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("diagnosed", ["float16", "bfloat16"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_shipped_lists_read_back_the_same_for_both_dtypes(tmp_path, diagnosed, dtype):
    folder = write_lists(tmp_path / "copy", AutoMixedPrecisionLists(dtype=diagnosed))

    shipped = AutoMixedPrecisionLists(dtype=dtype)
    assert colors(read_back(folder, dtype)) == colors(shipped)
    assert module_names(read_back(folder, dtype)) == module_names(shipped)


def test_the_written_files_read_back_without_warnings(fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16, {"softmax": ("white", "fits")}, [("lm_head", "overflows")])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_back(folder, "float16")
        read_back(folder, "bfloat16")


def test_the_folder_is_created_and_returned_as_a_path(fp16, tmp_path):
    folder = write_lists(str(tmp_path / "new" / "lists"), fp16)

    assert folder == tmp_path / "new" / "lists"
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)


# -- file layout ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("file", FILES)
def test_each_file_starts_with_a_header_saying_who_wrote_it_and_how_to_use_it(fp16, tmp_path, file):
    folder = write_lists(tmp_path / "mine", fp16)

    header = (folder / file).read_text().split("\n[", 1)[0]
    assert header.startswith(f"# {file}: ")
    assert "written by graphamp doctor for float16" in header.lower()
    assert "replaces graphamp's shipped lists" in header
    assert f"AutoMixedPrecisionLists(lists_dir={str(folder)!r})" in header


def test_entries_both_dtypes_share_are_under_all_and_the_others_under_their_dtype(fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16)

    assert line_of(folder / "black.txt", "softmax")[0] == "[all]"
    assert line_of(folder / "black.txt", "exp")[0] == "[float16]"  # float16's range only
    assert line_of(folder / "gray.txt", "exp")[0] == "[bfloat16]"


def test_entries_are_sorted_within_each_section(fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16)

    for file in FILES[:3]:
        sections = (folder / file).read_text().split("\n[")[1:]
        for section in sections:
            names = [line.split("#")[0].strip() for line in section.splitlines()[1:] if line.strip()]
            assert names == sorted(names)


def test_each_entry_comment_is_where_the_entry_came_from(fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16)

    for entry in fp16.entries():
        assert line_of(folder / f"{entry.color}.txt", entry.name)[1].endswith(f"# {entry.source}")


# -- op changes -------------------------------------------------------------------------------------------
def test_a_change_applies_to_the_diagnosed_dtype_only(bf16, fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16, {"softmax": ("white", "error 2e-4")})

    assert colors(read_back(folder, "float16")) == colors(fp16) - {("softmax", "black")} | {("softmax", "white")}
    assert colors(read_back(folder, "bfloat16")) == colors(bf16)


def test_a_change_for_bfloat16_leaves_float16_as_it_was(bf16, fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", bf16, {"exp": ("black", "overflows")})

    assert colors(read_back(folder, "bfloat16")) == colors(bf16) - {("exp", "gray")} | {("exp", "black")}
    assert colors(read_back(folder, "float16")) == colors(fp16)
    assert line_of(folder / "black.txt", "exp")[0] == "[all]"  # now black in both dtypes


def test_a_change_says_its_reason_and_the_color_it_had(fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16, {"softmax": ("white", "error 2e-4")})

    section, line = line_of(folder / "white.txt", "softmax")
    assert section == "[float16]"
    assert line.endswith("# doctor: error 2e-4 (was black)")


def test_an_unlisted_op_gets_an_entry(fp16, tmp_path):
    assert fp16.classify(torch.ops.aten.polar.default) is None

    folder = write_lists(tmp_path / "mine", fp16, {"polar": ("black", "overflows")})

    assert read_back(folder, "float16").classify(torch.ops.aten.polar.default).color == "black"
    assert line_of(folder / "black.txt", "polar")[1].endswith("(was unlisted)")


def test_an_overload_change_sits_beside_its_packet_entry(fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16, {"aten::mul.Tensor": ("black", "overflows")})
    lists = read_back(folder, "float16")

    assert {("mul.Tensor", "black"), ("mul", "gray")} <= colors(lists)
    assert lists.classify(torch.ops.aten.mul.Tensor).color == "black"
    assert lists.classify(torch.ops.aten.mul.Scalar).color == "gray"
    assert line_of(folder / "black.txt", "mul.Tensor")[1].endswith("(was gray)")  # its packet decided it


def test_a_reason_over_several_lines_stays_one_comment(fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16, {"softmax": ("white", "error 2e-4\nmean\n")})

    assert colors(read_back(folder, "float16")) == colors(fp16) - {("softmax", "black")} | {("softmax", "white")}
    assert line_of(folder / "white.txt", "softmax")[1].endswith("# doctor: error 2e-4 mean (was black)")


# -- custom lists and modules -----------------------------------------------------------------------------
def test_custom_lists_carry_over_to_both_dtypes(tmp_path):
    custom = dict(custom_white_list=["gelu"], custom_black_list=["exp"], custom_gray_list=["softmax"],
                  custom_black_modules=["lm_head"])

    folder = write_lists(tmp_path / "mine", AutoMixedPrecisionLists(dtype="float16", **custom))

    for dtype in ("float16", "bfloat16"):
        expected = AutoMixedPrecisionLists(dtype=dtype, **custom)
        assert colors(read_back(folder, dtype)) == colors(expected)
        assert module_names(read_back(folder, dtype)) == ["lm_head"]
    assert line_of(folder / "white.txt", "gelu")[1].endswith("# custom_white_list")


def test_a_black_module_is_added_for_the_diagnosed_dtype_only(tmp_path):
    start = AutoMixedPrecisionLists(dtype="float16", custom_black_modules=["lm_head"])

    folder = write_lists(tmp_path / "mine", start, black_modules=[("encoder.*.pool", "max |x| 8e4")])

    assert module_names(read_back(folder, "float16")) == ["encoder.*.pool", "lm_head"]
    assert module_names(read_back(folder, "bfloat16")) == ["lm_head"]
    section, line = line_of(folder / "black_modules.txt", "encoder.*.pool")
    assert (section, line) == ("[float16]", "encoder.*.pool  # doctor: max |x| 8e4")


@pytest.mark.parametrize("diagnosed", ["float16", "bfloat16"])
def test_promote_entries_of_one_dtype_read_back_for_that_dtype_only(tmp_path, diagnosed):
    source = write_list_folder(tmp_path / "source", white="mm\n", promote="atan2\n[float16]\nlerp\n")

    folder = write_lists(tmp_path / "written", AutoMixedPrecisionLists(dtype=diagnosed, lists_dir=source))

    assert read_back(folder, "float16").promote_ops == {"atan2", "lerp"}
    assert read_back(folder, "bfloat16").promote_ops == {"atan2"}


# -- safety -----------------------------------------------------------------------------------------------
def test_the_shipped_folder_is_never_written_over(fp16, tmp_path):
    shipped = default_lists_dir() / ".." / default_lists_dir().name  # resolves to the shipped folder

    with pytest.raises(ListFileError, match="shipped lists, which is never written over; name a new folder"):
        write_lists(shipped, fp16)


def test_the_folder_the_lists_were_read_from_is_never_written_over(fp16, tmp_path):
    mine = write_lists(tmp_path / "mine", fp16)

    with pytest.raises(ListFileError, match=f"{mine}: is the folder of the lists read.*name a new folder"):
        write_lists(mine, read_back(mine, "float16"), overwrite=True)


def test_an_existing_list_file_is_kept_unless_overwrite_is_passed(fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16)
    before = (folder / "white.txt").read_text()

    with pytest.raises(ListFileError, match="white.txt: already exists; pass overwrite=True"):
        write_lists(folder, fp16, {"softmax": ("white", "fits")})
    assert (folder / "white.txt").read_text() == before


def test_overwrite_replaces_the_files(fp16, tmp_path):
    folder = write_lists(tmp_path / "mine", fp16)

    write_lists(folder, fp16, {"softmax": ("white", "fits")}, overwrite=True)

    assert ("softmax", "white") in colors(read_back(folder, "float16"))


def test_a_change_to_an_unknown_color_is_refused_before_writing(fp16, tmp_path):
    with pytest.raises(ListFileError, match="'softmax': color 'red' is not one of white, black, gray"):
        write_lists(tmp_path / "mine", fp16, {"softmax": ("red", "why")})
    assert not (tmp_path / "mine").exists()


def test_a_change_to_an_unknown_op_is_refused_before_writing(fp16, tmp_path):
    with pytest.raises(ListFileError, match="op change 'softmx': unknown op 'softmx'.*'softmax'"):
        write_lists(tmp_path / "mine", fp16, {"softmx": ("white", "why")})
    assert not (tmp_path / "mine").exists()


def test_a_module_pattern_that_cannot_be_a_list_line_is_refused(fp16, tmp_path):
    with pytest.raises(ListFileError, match="'encoder layer' cannot be a list line"):
        write_lists(tmp_path / "mine", fp16, black_modules=[("encoder layer", "why")])
