"""``te_fl_attention.workers``: which GPU a worker process may see."""

from __future__ import annotations

import pytest

from te_fl_attention.workers import DEVICE_ENV, current_device, visible_device, worker_env


@pytest.mark.parametrize(
    "ordinal, parent, expected",
    [(3, None, "3"), (3, "", "3"), (3, "4,5,6,7", "7"), (1, "GPU-a, GPU-b", "GPU-b"),
     (0, "MIG-x", "MIG-x"), (4, "0,1", None), (1, "0,,2", None)],
)  # fmt: skip
def test_visible_device_names_the_parents_device(ordinal, parent, expected):
    assert visible_device(ordinal, parent) == expected


def test_worker_env_narrows_and_says_which_device():
    env = worker_env({"CUDA_VISIBLE_DEVICES": "4,5,6,7", "X": "y"}, 2)
    assert env == {"CUDA_VISIBLE_DEVICES": "6", DEVICE_ENV: "2", "X": "y"}
    assert worker_env({"X": "y"}, None) == {"X": "y"}


@pytest.mark.parametrize("fake_gpu", ["b200:ordinal=6,count=8"], indirect=True)
def test_current_device_is_the_callers(fake_gpu):
    assert current_device() == 6
    fake_gpu.set_device(1)
    assert current_device() == 1
