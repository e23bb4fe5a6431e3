"""Editing pairs: item = (target float32 [C, S, S] in [-1, 1], controls float32 [K, C, S, S], str instruction).

EditPairsDataset reads a captioned folder of target images (photo.png + photo.txt, the instruction; see
captions.py) and a control folder beside it whose images are named as their targets (musubi-tuner's
`control_directory`): photo.png (any image extension), or photo_0.png, photo_1.png, ... for several controls of
one target, in that order; subfolders mirror the target folder's. Every target of a run has the same number of
controls (a batch holds K of each). A target without a control and a control without a target are counted and
named in the log, and left out. The controls go through the target's aspect-ratio bucket, resized and cropped to
its size as the target is (and flipped with it), so one bucket holds the pair.

EditDigitsDataset is the built-in demo: scikit-learn's digits with four edits, every scan the input of each
(item i: scan i // 4, edit i % 4): "the next digit" (a target of the next digit, 9 -> 0, written by another hand),
"mirror it" (left to right), "rotate it a quarter turn" (counter-clockwise) and "make the strokes thicker" (each
ink pixel grown by its neighbours).
"""
import logging
import os
import re

import numpy as np
import torch
from PIL import Image, ImageFilter

from opendit.data.captions import CaptionedImageDataset
from opendit.data.digits import DigitsDataset
from opendit.data.image_folder import IMAGE_EXTENSIONS, _unlistable
from opendit.data.skipped import first_readable
from opendit.data.spec import DatasetSpec
from opendit.data.transforms import to_signed_tensor
from opendit.seeding import mix_seed

logger = logging.getLogger(__name__)

SHOWN = 10  # names a warning lists before "and N more"
CONTROL_HINT = ("name each control as its target (photo.png for photo.png; photo_0.png, photo_1.png, ... for "
                "several), in --control_directory (a dataset config's control_directory)")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def numbered(stem: str) -> tuple[str, int]:
    """A control's name without its extension -> (the target's stem it belongs to, its place among that target's
    controls): photo_2 -> ("photo", 2); photo -> ("photo", -1)."""
    found = re.fullmatch(r"(.*)_(\d+)", stem)
    return (found[1], int(found[2])) if found else (stem, -1)


def scan_controls(root: str) -> dict[str, list[str]]:
    """{relative stem of the target: [control paths in order]} of a control folder: stem.ext, or stem_0.ext,
    stem_1.ext, ... (a numbered control sorts by its number)."""
    found: dict[str, list[tuple[int, str]]] = {}
    for dirpath, _, filenames in sorted(os.walk(root, onerror=_unlistable, followlinks=True), key=lambda e: e[0]):
        for fname in sorted(filenames):
            if fname.startswith(".") or not fname.lower().endswith(IMAGE_EXTENSIONS):
                continue
            stem = os.path.relpath(os.path.join(dirpath, os.path.splitext(fname)[0]), root)
            key, order = numbered(stem)
            found.setdefault(key, []).append((order, os.path.join(dirpath, fname)))
    return {key: [path for _, path in sorted(paths)] for key, paths in found.items()}


class EditPairsDataset(CaptionedImageDataset):
    """A captioned folder of targets (or a .csv / .jsonl listing them) with their controls from `control_directory`
    (see the module doc). `num_without_control` / `num_unmatched_controls` count what was left out;
    `controls_per_target` is K."""

    def __init__(self, data_path: str, image_size: int, control_directory: str | None = None, **options):
        super().__init__(data_path, image_size, **options)
        if not control_directory:
            raise ValueError(f"edit pairs {data_path!r}: no control folder; pass --control_directory <folder> "
                             f"({CONTROL_HINT})")
        if not os.path.isdir(control_directory):
            raise FileNotFoundError(f"--control_directory {control_directory!r} is not a folder; {CONTROL_HINT}")
        controls = scan_controls(control_directory)
        root = self.data_path if os.path.isdir(self.data_path) else os.path.dirname(os.path.abspath(self.data_path))
        stems = [os.path.relpath(os.path.splitext(path)[0], root) for path, _ in self.samples]
        missing = [s for s in stems if s not in controls]
        unmatched = sorted(set(controls) - set(stems))
        self.num_without_control, self.num_unmatched_controls = len(missing), len(unmatched)
        if missing:
            logger.warning("%s: leaving out %d target(s) without a control in %s: %s", self.data_path, len(missing),
                           control_directory, _listed(missing))
        if unmatched:
            logger.warning("%s: leaving out %d control(s) that no target is named as: %s", control_directory,
                           len(unmatched), _listed(unmatched))
        pairs = [(sample, controls[s]) for sample, s in zip(self.samples, stems) if s in controls]
        if not pairs:
            raise ValueError(f"no target of {self.data_path!r} has a control in {control_directory!r} "
                             f"({len(stems)} targets, {len(controls)} controls); {CONTROL_HINT}")
        counts = {len(c) for _, c in pairs}
        if len(counts) > 1:
            shown = {os.path.basename(s[0]): len(c) for s, c in pairs[:SHOWN]}
            raise ValueError(f"{control_directory!r}: targets have different numbers of controls ({shown}); a run "
                             f"batches the same number for every target: give each target as many, or split the "
                             f"data into datasets of one count each")
        self.samples = [sample for sample, _ in pairs]
        self.controls = [c for _, c in pairs]
        self.controls_per_target = counts.pop()

    def _image(self, path: str, width: int, height: int, flip: bool) -> torch.Tensor:
        image = self._load(path, width, height)
        return to_signed_tensor(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image)

    def _read_pair(self, i: int, index: int):
        width, height = self.target_size(i, self.image_size)
        flip = self._flip(index)
        target = self._image(self.samples[i][0], width, height, flip)
        controls = torch.stack([self._image(p, width, height, flip) for p in self.controls[i]])
        return target, controls, self.samples[i][1]

    def __getitem__(self, index: int):
        return first_readable(self, index, lambda i: self._read_pair(i, index))


EDITS = ("the next digit", "mirror it", "rotate it a quarter turn", "make the strokes thicker")


class EditDigitsDataset(DigitsDataset):
    """The editing demo: item i is edit EDITS[i % 4] of digit scan i // 4 (module doc). `labels`: the digit each
    item's target shows (what an independent classifier should read), `edits`: each item's edit index, `scans`: its
    input's scan."""

    num_classes = 0
    controls_per_target = 1

    def __init__(self, image_size: int, channels: int = 1, seed: int = 0, split: str = "all", digits=None):
        super().__init__(image_size, channels=channels, split=split, digits=digits)
        self.seed = int(seed)
        items = np.arange(len(self._labels) * len(EDITS))
        self.scans, self.edits = items // len(EDITS), items % len(EDITS)
        by_digit = {d: np.flatnonzero(self._labels == d) for d in range(10)}
        # the next digit's scan: another hand's, picked by (seed, item); a subset without that digit keeps the scan
        self.partner = np.array([by_digit[(d + 1) % 10][mix_seed(self.seed, i) % len(by_digit[(d + 1) % 10])]
                                 if len(by_digit[(d + 1) % 10]) else s
                                 for i, (s, d) in enumerate(zip(self.scans, self._labels[self.scans]))])
        self.labels = np.where(self.edits == 0, self._labels[self.partner], self._labels[self.scans])
        self.captions = [EDITS[e] for e in self.edits]

    def caption(self, index: int) -> str:
        return self.captions[index]

    def preview_prompts(self, k: int) -> list[str]:
        return list(EDITS[:k])

    def _pixels(self, scan: int, edit: int) -> Image.Image:
        image = Image.fromarray(self._images[scan]).resize((self.image_size,) * 2, resample=Image.BICUBIC)
        if edit == 1:
            return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if edit == 2:
            return image.transpose(Image.Transpose.ROTATE_90)
        if edit == 3:
            return image.filter(ImageFilter.MaxFilter(2 * max(1, self.image_size // 16) + 1))
        return image

    def _tensor(self, image: Image.Image) -> torch.Tensor:
        x = to_signed_tensor(image)
        return x.expand(3, -1, -1).contiguous() if self.channels == 3 else x

    def __len__(self) -> int:
        return len(self.edits)

    def __getitem__(self, index: int):
        edit, scan = int(self.edits[index]), int(self.scans[index])
        control = self._tensor(self._pixels(scan, -1))
        target = self._tensor(self._pixels(self.partner[index], -1) if edit == 0 else self._pixels(scan, edit))
        return target, control[None], self.captions[index]


EDIT_DIGITS = DatasetSpec("edit_digits", "built in editing demo: digit pairs with the instructions \"the next "
                                         "digit\", \"mirror it\", \"rotate it a quarter turn\", \"make the strokes "
                                         "thicker\" (the digits' training split: benchmarks/edit_quality.py edits the "
                                         "held-out fifth)",
                          lambda path, size, **kw: EditDigitsDataset(size, split="train", **kw), channels=1,
                          pairs=True)
EDIT_PAIRS = DatasetSpec("edit_pairs", "editing pairs: captioned target images (the instructions) and a control "
                                       "folder of images named as their targets (--control_directory)",
                         lambda path, size, **kw: EditPairsDataset(path, size, **kw),
                         path="folder of target images with .txt instructions, or a .csv / .jsonl of path,caption",
                         settings=("caption_extension", "control_directory"), demo="edit_digits", pairs=True)
