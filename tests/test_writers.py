"""Sample writers: grid.png has one condition per row (sample i is conditions[i % len(conditions)]), an
upscaled grid_large.png when the tiles are small, and samples.npz holds every sample in index order."""
import numpy as np
from PIL import Image

from opendit.families.writers import ImageWriter, VideoWriter
from opendit.images import grid_rows, large_factor


def shade(condition, index):
    """A sample's flat colour: red says its condition, green its index."""
    return np.array([10 * condition, index, 0], np.uint8)


def write_images(out, num, conditions, size=16):
    writer = ImageWriter(out, npz=True)
    for i in range(num):
        writer.write(i, np.broadcast_to(shade(conditions[i % len(conditions)], i), (size, size, 3)).copy())
    return writer.finish(num, conditions)


def tile_colours(grid, rows, cols, size):
    """The colour at each tile's centre of a grid of size-px tiles 2 px apart."""
    at = [2 + k * (size + 2) + size // 2 for k in range(max(rows, cols))]
    return [[tuple(grid[at[r], at[c]]) for c in range(cols)] for r in range(rows)]


def test_grid_rows_one_condition_per_row():
    # --class_labels 3 3 7: samples 0, 1, 3, 4, ... are 3s and 2, 5, 8, 11 are 7s
    assert grid_rows(12, [3, 3, 7]) == [[0, 1, 3, 4, 6, 7, 9, 10], [2, 5, 8, 11]]
    assert grid_rows(40, list(range(10)))[:2] == [[0, 10, 20, 30], [1, 11, 21, 31]]
    assert len(grid_rows(100, [1, 2])[0]) == 16  # up to 16 a row
    assert len(grid_rows(2000, list(range(1000)))) == 32  # up to 32 rows
    assert grid_rows(5, [None]) == [[0, 1, 2], [3, 4]]  # a single condition: square-ish
    assert grid_rows(20, list(range(20))) == [list(range(16)), list(range(16, 20))]  # one each: rows of 16
    assert grid_rows(4, ["a cat", "a dog", "a cat"]) == [[0, 2, 3], [1]]  # prompts group the same way


def test_image_grid_groups_repeated_labels_and_npz_is_unchanged(tmp_path):
    conditions, num, size = [3, 3, 7], 12, 16
    written = write_images(tmp_path, num, conditions, size)
    assert written == ["grid.png", "grid_large.png", "images/", "samples.npz"]
    grid = np.asarray(Image.open(tmp_path / "grid.png"))
    assert grid.shape == (2 * (size + 2) + 2, 8 * (size + 2) + 2, 3)
    colours = tile_colours(grid, 2, 8, size)
    assert [c[0] for c in colours[0]] == [30] * 8 and [c[1] for c in colours[0]] == [0, 1, 3, 4, 6, 7, 9, 10]
    assert [c[0] for c in colours[1][:4]] == [70] * 4 and colours[1][4] == (255, 255, 255)  # short row: white
    large = np.asarray(Image.open(tmp_path / "grid_large.png"))
    assert large.shape == (grid.shape[0] * 8, grid.shape[1] * 8, 3)  # 16 px tiles -> 128 px
    np.testing.assert_array_equal(large[::8, ::8], grid)  # nearest neighbour
    arr = np.load(tmp_path / "samples.npz")["arr_0"]
    assert arr.shape == (num, size, size, 3) and arr.dtype == np.uint8
    for i in range(num):
        np.testing.assert_array_equal(arr[i, 0, 0], shade(conditions[i % 3], i))


def test_large_grid_factor():
    assert large_factor(16, 290) == 8 and large_factor(100, 1000) == 2
    assert large_factor(128, 500) == 1 and large_factor(256, 4000) == 1  # big enough already
    assert large_factor(2, 4000) == 2  # the grid's longer side stays under 8192 px


def test_big_images_get_no_large_grid(tmp_path):
    assert write_images(tmp_path, 2, [0, 1], size=128) == ["grid.png", "images/", "samples.npz"]
    assert not (tmp_path / "grid_large.png").exists()


def test_video_strip_grid_groups_conditions(tmp_path):
    conditions, num, frames, size = [1, 2], 5, 3, 8
    writer = VideoWriter(tmp_path, npz=True)
    for i in range(num):
        writer.write(i, np.broadcast_to(shade(conditions[i % 2], i), (frames, size, size, 3)).copy())
    written = writer.finish(num, conditions)
    assert "grid.png" in written and "grid_large.png" in written and "samples.npz" in written
    grid = np.asarray(Image.open(tmp_path / "grid.png"))
    assert grid.shape == (num * (size + 2) + 2, frames * size + 4, 3)  # a strip per row
    rows = [tuple(grid[2 + r * (size + 2) + 1, 3]) for r in range(num)]
    assert [(c[0], c[1]) for c in rows] == [(10, 0), (10, 2), (10, 4), (20, 1), (20, 3)]
    assert np.asarray(Image.open(tmp_path / "grid_large.png")).shape == (grid.shape[0] * 16, grid.shape[1] * 16, 3)
    clips = np.load(tmp_path / "samples.npz")["arr_0"]
    assert clips.shape == (num, frames, size, size, 3)
    np.testing.assert_array_equal(clips[3, 2, 0, 0], shade(2, 3))
