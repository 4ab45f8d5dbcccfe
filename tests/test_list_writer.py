"""write_lists: a lists folder that reads back as the effective lists with the changes, for one dtype only."""

import pytest

from graphamp.errors import ListFileError
from graphamp.list_writer import write_lists
from graphamp.lists import AutoMixedPrecisionLists, default_lists_dir

FP16 = AutoMixedPrecisionLists(dtype="float16")


def colors(lists):
    return {(e.name, e.color) for e in lists.entries()}


def read_back(folder, dtype):
    return AutoMixedPrecisionLists(dtype=dtype, lists_dir=folder)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_shipped_lists_read_back_the_same_for_both_dtypes(tmp_path, dtype):
    folder = write_lists(tmp_path / "copy", FP16)

    assert colors(read_back(folder, dtype)) == colors(AutoMixedPrecisionLists(dtype=dtype))


def test_a_change_applies_to_the_diagnosed_dtype_only(tmp_path):
    folder = write_lists(tmp_path / "mine", FP16, {"softmax": ("white", "error 2e-4")})

    assert ("softmax", "white") in colors(read_back(folder, "float16"))
    assert ("softmax", "black") in colors(read_back(folder, "bfloat16"))
    line = next(l for l in (folder / "white.txt").read_text().splitlines() if l.startswith("softmax "))
    assert line.endswith("# doctor: error 2e-4 (was black)")
    assert colors(read_back(folder, "float16")) - {("softmax", "white")} == colors(FP16) - {("softmax", "black")}


def test_an_unlisted_op_and_an_overload_beside_its_packet_get_entries(tmp_path):
    folder = write_lists(tmp_path / "mine", FP16, {
        "polar": ("black", "overflows"),           # on no shipped list
        "mul.Tensor": ("black", "overflows"),      # 'mul' stays gray for the other overloads
    })
    lists = read_back(folder, "float16")

    assert {("polar", "black"), ("mul.Tensor", "black"), ("mul", "gray")} <= colors(lists)
    assert "was unlisted" in (folder / "black.txt").read_text()


def test_custom_lists_carry_over_to_both_dtypes(tmp_path):
    custom = AutoMixedPrecisionLists(custom_black_list=["gelu"], custom_black_modules=["lm_head"], dtype="float16")

    folder = write_lists(tmp_path / "mine", custom)

    for dtype in ("float16", "bfloat16"):
        lists = read_back(folder, dtype)
        assert ("gelu", "black") in colors(lists)
        assert [p.name for p in lists.black_modules] == ["lm_head"]
    assert "custom_black_list" in (folder / "black.txt").read_text()


def test_a_black_module_is_added_for_the_diagnosed_dtype(tmp_path):
    folder = write_lists(tmp_path / "mine", FP16, black_modules=[("encoder.*.pool", "max |x| 8e4")])

    assert [p.name for p in read_back(folder, "float16").black_modules] == ["encoder.*.pool"]
    assert read_back(folder, "bfloat16").black_modules == ()


def test_the_shipped_folder_and_the_folder_read_are_never_written_over(tmp_path):
    mine = write_lists(tmp_path / "mine", FP16)
    from_mine = AutoMixedPrecisionLists(dtype="float16", lists_dir=mine)

    with pytest.raises(ListFileError, match="shipped lists, which is never written over; name a new folder"):
        write_lists(default_lists_dir(), FP16, overwrite=True)
    with pytest.raises(ListFileError, match="the lists read"):
        write_lists(mine, from_mine, overwrite=True)


def test_an_existing_list_file_is_replaced_only_when_asked(tmp_path):
    folder = write_lists(tmp_path / "mine", FP16)

    with pytest.raises(ListFileError, match="white.txt: already exists; pass overwrite=True"):
        write_lists(folder, FP16, {"softmax": ("white", "fits")})
    write_lists(folder, FP16, {"softmax": ("white", "fits")}, overwrite=True)
    assert ("softmax", "white") in colors(read_back(folder, "float16"))


def test_a_change_to_an_unknown_color_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'softmax': color 'red'"):
        write_lists(tmp_path / "mine", FP16, {"softmax": ("red", "why")})
