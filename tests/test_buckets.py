"""Aspect-ratio buckets: the sizes, which bucket an item goes to, the resize-and-crop, and the sampler's
one-bucket global batches (a pure function of seed and epoch, the same at every data-parallel size, resumable
mid-epoch); datasets deliver each item at its bucket's size and replace an unreadable item from its own bucket."""
import math

import numpy as np
import pytest
import torch
from PIL import Image

from opendit.data import ResumableDistributedSampler
from opendit.data.buckets import (Bucket, assign_buckets, auto_buckets, bucket_ids, bucket_summary, nearest_bucket,
                                  parse_buckets)
from opendit.data.captions import CaptionedImageDataset
from opendit.data.transforms import center_crop_arr, resize_crop


def _image(width, height, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


def mixed_shape_folder(root, shapes=((48, 16), (16, 48), (32, 32), (40, 20), (20, 40), (30, 31)), repeat=4):
    """A captioned folder of landscape, portrait and square images (photo.png + photo.txt), `repeat` of each."""
    root.mkdir(parents=True, exist_ok=True)
    for k in range(repeat):
        for j, (w, h) in enumerate(shapes):
            stem = root / f"img{k}_{j}"
            _image(w, h, seed=10 * k + j).save(f"{stem}.png")
            (root / f"{stem.name}.txt").write_text(f"a picture {j}")
    return root


# ---- sizes ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("area,step", [(256 ** 2, 16), (1024 ** 2, 16), (16 ** 2, 2), (480 * 832, 16)])
def test_auto_buckets_keep_area_step_and_ratio_range(area, step):
    buckets = auto_buckets(area, step)
    side = math.isqrt(area)
    assert Bucket(side, side) in buckets if side * side == area else any(abs(b.width - b.height) <= step
                                                                          for b in buckets)
    for b in buckets:
        assert b.width % step == 0 and b.height % step == 0 and b.width * b.height <= area
        assert 1 / 4 <= b.width / b.height <= 4
    ratios = [b.width / b.height for b in buckets]
    assert ratios == sorted(ratios) and len(set(ratios)) == len(ratios)
    assert ratios[0] <= 1 / 3 and ratios[-1] >= 3  # spans portrait to landscape
    assert len({b.height for b in buckets}) == len(buckets)  # one width per height: the widest that fits


def test_parse_buckets_list_and_errors():
    assert parse_buckets("32x16, 16x32", 0, 8) == [Bucket(16, 32), Bucket(32, 16)]
    assert parse_buckets("32x16", 0, 8, frames=(9, 5)) == [Bucket(32, 16, 9), Bucket(32, 16, 5)]
    with pytest.raises(ValueError, match="multiples of 16.*e.g. 32x16"):
        parse_buckets("40x16", 0, 16)
    with pytest.raises(ValueError, match="not WIDTHxHEIGHT"):
        parse_buckets("wide", 0, 8)
    with pytest.raises(ValueError, match="--bucket_area 10 is smaller"):
        parse_buckets("auto", 10, 8)


def test_nearest_bucket_by_log_ratio_and_frames():
    buckets = [Bucket(16, 32), Bucket(24, 24), Bucket(32, 16)]
    assert nearest_bucket(buckets, 100, 210) == 0 and nearest_bucket(buckets, 200, 190) == 1
    assert nearest_bucket(buckets, 1000, 10) == 2  # beyond 4:1 still goes to the widest
    video = parse_buckets("16x32,32x16", 0, 8, frames=(9, 5))
    assert video[nearest_bucket(video, 60, 30, frames=12)] == Bucket(32, 16, 9)
    assert video[nearest_bucket(video, 60, 30, frames=7)] == Bucket(32, 16, 5)
    assert nearest_bucket(video, 60, 30, frames=4) == -1  # too short for any bucket: left out


def test_resize_crop_covers_then_crops_the_center():
    image = _image(48, 24)
    assert resize_crop(image, 32, 16).tobytes() == image.resize((32, 16), Image.BICUBIC).tobytes()  # same ratio
    out = resize_crop(_image(30, 50), 16, 32)
    assert out.size == (16, 32)
    assert resize_crop(image, 24, 24).tobytes() == center_crop_arr(image, 24).tobytes()
    big = _image(200, 90)  # both sides >= twice the box: halved with BOX first, as ADM's crop does
    assert resize_crop(big, 40, 20).tobytes() == resize_crop(big.resize((100, 45), Image.BOX), 40, 20).tobytes()
    wide = np.asarray(resize_crop(image, 32, 8))  # 48x24 -> 32x16 (cover), rows 4..12 kept
    assert wide.shape == (8, 32, 3)
    assert np.array_equal(wide, np.asarray(image.resize((32, 16), Image.BICUBIC))[4:12])


# ---- the sampler ----------------------------------------------------------------------------------------------
def _groups(seed=0, n=90, k=4):
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, k, n)
    groups[:3] = -1  # left out (unreadable)
    return groups


def _global_batches(groups, dp, epoch=0, seed=3, batch=8, consumed=0):
    """The global batches of an epoch as the DP ranks see them, stitched back together."""
    samplers = [ResumableDistributedSampler(len(groups), dp, r, seed=seed, global_batch_size=batch, groups=groups)
                for r in range(dp)]
    for s in samplers:
        s.set_epoch(epoch)
        s.consumed = consumed
    per_rank = [torch.tensor(list(s)).view(-1, batch // dp) for s in samplers]
    return torch.cat(per_rank, dim=1), len(samplers[0])


def test_grouped_batches_hold_one_bucket_each_and_leave_out_remainders():
    groups = _groups()
    batches, _ = _global_batches(groups, dp=2)
    counts = np.bincount(groups[groups >= 0])
    assert len(batches) == (counts // 8).sum()
    for batch in batches:
        assert len(set(groups[batch.numpy()])) == 1  # one bucket per global batch, so per micro-batch
    used = batches.flatten().numpy()
    assert len(set(used)) == len(used) and (groups[used] >= 0).all()
    assert np.array_equal(np.bincount(groups[used], minlength=len(counts)), counts // 8 * 8)


def test_grouped_order_depends_on_seed_and_epoch_only_and_not_on_dp_size():
    groups = _groups()
    one, _ = _global_batches(groups, dp=1)
    for dp in (2, 4, 8):
        assert torch.equal(_global_batches(groups, dp)[0], one)
    assert torch.equal(_global_batches(groups, 2, epoch=0)[0], one)  # again: a pure function
    assert not torch.equal(_global_batches(groups, 1, epoch=1)[0], one)
    assert not torch.equal(_global_batches(groups, 1, seed=4)[0], one)


def test_grouped_resume_mid_epoch_at_another_dp_size():
    groups = _groups()
    full, _ = _global_batches(groups, dp=4)
    first = ResumableDistributedSampler(len(groups), 4, 0, seed=3, global_batch_size=8, groups=groups)
    first.advance(3)
    state = first.state_dict()
    resumed = [ResumableDistributedSampler(len(groups), 2, r, seed=3, global_batch_size=8, groups=groups)
               for r in range(2)]
    for s in resumed:
        s.load_state_dict(state)
    rest = torch.cat([torch.tensor(list(s)).view(-1, 4) for s in resumed], dim=1)
    assert torch.equal(rest, full[3:])
    steps_per_epoch = first.epoch_samples(0) // 8
    assert len(resumed[0]) == (steps_per_epoch - 3) * 4


def test_grouped_resume_refuses_other_buckets_and_empty_epochs():
    groups = _groups()
    state = ResumableDistributedSampler(len(groups), 1, 0, global_batch_size=8, groups=groups).state_dict()
    other = groups.copy()
    other[5] = (other[5] + 1) % 4
    with pytest.raises(ValueError, match="same --buckets"):
        ResumableDistributedSampler(len(groups), 1, 0, global_batch_size=8, groups=other).load_state_dict(state)
    with pytest.raises(ValueError, match="same --buckets"):
        ResumableDistributedSampler(len(groups), 1, 0, global_batch_size=8).load_state_dict(state)
    with pytest.raises(ValueError, match="no aspect-ratio bucket holds a whole global batch of 64"):
        ResumableDistributedSampler(len(groups), 1, 0, global_batch_size=64, groups=groups)


def test_bucket_summary_counts_items_batches_and_left_out():
    groups = np.array([0] * 10 + [1] * 3 + [-1] * 2)
    text = bucket_summary(groups, [Bucket(16, 32), Bucket(32, 16)], batch=4)
    assert "16x32" in text and "32x16" in text
    assert "15 items, 8 trained per epoch in global batches of 4, 2 never" in text


# ---- datasets -------------------------------------------------------------------------------------------------
def test_captioned_images_come_at_their_bucket_size(tmp_path):
    root = mixed_shape_folder(tmp_path / "photos", repeat=1)
    (root / "broken.png").write_bytes(b"not a png")
    (root / "broken.txt").write_text("broken")
    ds = CaptionedImageDataset(str(root), 32)
    assignment = ds.use_buckets(parse_buckets("auto", 32 * 32, 8))
    assert (assignment.ids < 0).sum() == 1  # the broken file: left out, counted
    for i in range(len(ds)):
        if assignment.ids[i] < 0:
            continue
        x, caption = ds[i]
        bucket = assignment.size_of(i)
        assert x.shape == (3, bucket.height, bucket.width) and caption.startswith("a picture")
    path = {p: i for i, (p, _) in enumerate(ds.samples)}
    wide = assignment.size_of(path[str(root / "img0_0.png")])
    tall = assignment.size_of(path[str(root / "img0_1.png")])
    assert wide.width / wide.height >= 2 and tall.height / tall.width >= 2
    assert bucket_ids(torch.utils.data.Subset(ds, [2, 0])).tolist() == [assignment.ids[2], assignment.ids[0]]


def test_an_unreadable_item_is_replaced_from_its_own_bucket(tmp_path):
    root = mixed_shape_folder(tmp_path / "photos", repeat=3)
    ds = CaptionedImageDataset(str(root), 32)
    assignment = ds.use_buckets(parse_buckets("auto", 32 * 32, 8))
    victim = 0
    data = open(ds.samples[victim][0], "rb").read()
    open(ds.samples[victim][0], "wb").write(data[: len(data) // 3])  # the header still reads, the pixels do not
    x, _ = ds[victim]
    bucket = assignment.size_of(victim)
    assert x.shape[1:] == (bucket.height, bucket.width) and ds.num_skipped == 1


def test_assign_buckets_maps_sizes():
    buckets = [Bucket(16, 32), Bucket(32, 16)]
    assignment = assign_buckets([(10, 30, None), None, (30, 10, None)], buckets)
    assert assignment.ids.tolist() == [0, -1, 1] and assignment.counts() == {"16x32": 1, "32x16": 1}
