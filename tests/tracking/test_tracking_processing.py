"""Crops, the box mapping into and out of them, jitter, clipping and the joint flip."""

import numpy as np
import pytest

from visionssm.tracking.data.processing import clip_box, crop_image, crop_transform, jitter_box
from visionssm.tracking.data.transforms import PairAugmentation


@pytest.mark.parametrize("box", [
    (40.0, 30.0, 20.0, 12.0),      # inside
    (-8.5, 2.25, 30.0, 40.0),      # over the left border: crop padded
    (150.0, 100.0, 9.5, 15.0),     # near the bottom-right corner
    (10.0, 10.0, 140.0, 100.0),    # large: the crop shrinks the image (area filter path)
])
@pytest.mark.parametrize("factor,size", [(2.0, 128), (4.0, 256)])
def test_crop_round_trip(box, factor, size):
    box = np.array(box)
    tf = crop_transform(box, factor, size)
    in_crop = tf.box_to_crop(box)
    # The target box sits in the middle of the crop with side size / factor (geometric mean).
    np.testing.assert_allclose(in_crop[:2] + in_crop[2:] / 2, [size / 2, size / 2], atol=1e-9)
    np.testing.assert_allclose(np.sqrt(in_crop[2] * in_crop[3]), size / factor, rtol=1e-12)
    np.testing.assert_allclose(tf.box_to_image(in_crop), box, atol=1e-9)


@pytest.mark.parametrize("box,factor,size", [
    ((37.0, 21.0, 24.0, 16.0), 4.0, 256),   # upscaling crop
    ((3.0, 5.0, 40.0, 30.0), 2.0, 128),     # top-left corner: padding
    ((20.0, 10.0, 120.0, 90.0), 4.0, 256),  # the crop is larger than the image: downscaling path
])
def test_crop_pixels_match_mapped_box(box, factor, size):
    """A bright rectangle drawn at ``box`` appears in the crop where ``box_to_crop`` says (±1 px)."""
    image = np.zeros((120, 160, 3), np.uint8)
    x, y, w, h = (int(v) for v in box)
    image[y:y + h, x:x + w] = 255
    tf = crop_transform(np.array(box), factor, size)
    crop, pad = crop_image(image, tf)
    assert crop.shape == (size, size, 3) and pad.shape == (size, size)
    ys, xs = np.nonzero(crop[..., 0] > 127)
    found = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=float)
    bx, by, bw, bh = tf.box_to_crop(np.array(box, dtype=float))
    np.testing.assert_allclose(found, [bx, by, bx + bw, by + bh], atol=1.0 + 1e-6)
    # Padding is exactly the part of the crop that maps outside the image, and it is black.
    assert not crop[pad].any()
    corner = tf.box_to_image(np.zeros(4))  # the crop's top-left corner in the image
    assert pad[0, 0] == (corner[0] < 0 or corner[1] < 0)


def test_crop_rejects_degenerate_box():
    with pytest.raises(ValueError, match="width and height"):
        crop_transform(np.array([0.0, 0.0, 0.0, 5.0]), 2.0, 128)


def test_jitter():
    rng = np.random.default_rng(0)
    box = np.array([10.0, 20.0, 30.0, 40.0])
    np.testing.assert_allclose(jitter_box(box, 0.0, 0.0, rng), box)
    jittered = np.stack([jitter_box(box, 3.0, 0.25, rng) for _ in range(2000)])
    log_scale = np.log(jittered[:, 2:] / box[2:])
    assert abs(log_scale.std() - 0.25) < 0.02
    centre_shift = jittered[:, :2] + jittered[:, 2:] / 2 - (box[:2] + box[2:] / 2)
    side = np.sqrt(jittered[:, 2] * jittered[:, 3])
    assert (np.abs(centre_shift) <= 1.5 * side[:, None] + 1e-9).all()
    assert np.abs(centre_shift).max() > 0.5 * side.mean()


def test_clip_box():
    np.testing.assert_allclose(clip_box(np.array([-5.0, 10.0, 20.0, 20.0]), 100, 80), [0, 10, 15, 20])
    np.testing.assert_allclose(clip_box(np.array([95.0, 75.0, 20.0, 20.0]), 100, 80), [90, 70, 10, 10])
    np.testing.assert_allclose(clip_box(np.array([10.0, 10.0, 2.0, 3.0]), 100, 80), [10, 10, 10, 10])


def test_joint_flip_moves_boxes_with_pixels():
    aug = PairAugmentation(grayscale_prob=0.0, flip_prob=1.0)
    image = np.zeros((40, 60, 3), np.uint8)
    image[5:15, 10:30] = 200
    box = np.array([10.0, 5.0, 20.0, 10.0])
    t, s, tb, sb = aug.frames(image, image.copy(), box, box, seed=1)
    ys, xs = np.nonzero(t[..., 0])
    np.testing.assert_allclose(tb, [xs.min(), ys.min(), xs.max() + 1 - xs.min(), ys.max() + 1 - ys.min()])
    np.testing.assert_allclose(sb, tb)
    np.testing.assert_array_equal(s, t)
    no_flip = PairAugmentation(grayscale_prob=0.0, flip_prob=0.0)
    _, _, tb2, _ = no_flip.frames(image, image, box, box, seed=1)
    np.testing.assert_allclose(tb2, box)
