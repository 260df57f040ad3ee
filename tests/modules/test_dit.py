"""The compact video DiT's inputs: what it would take without a word or fail on deep inside is refused up front,
naming the argument."""

import pytest
import torch

from dsv.modules.config import AttentionConfig
from dsv.modules.dit import ModelConfig, VideoDiT, flow_matching_loss, sample_euler


def dit(num_classes: int = 0) -> VideoDiT:
    torch.manual_seed(0)
    return VideoDiT(ModelConfig(hidden=32, depth=1, heads=2, num_classes=num_classes),
                    AttentionConfig(mode="dense", cube=(2, 2, 2)))


def test_class_labels_are_checked():
    x, t = torch.randn(2, 3, 2, 8, 8), torch.rand(2)
    # Ignored before: an unconditional model's output was the same with and without labels.
    with pytest.raises(ValueError, match=r"y \(class labels\) given to a model without classes"):
        dit()(x, t, torch.tensor([0, 1]))
    conditional = dit(num_classes=4)
    for y in (torch.tensor([[0], [1]]), torch.tensor([0.0, 1.0])):  # a broadcast error or an index error before
        with pytest.raises(ValueError, match=r"y must be integer \[B\]=2 class ids in \[0, 4\]"):
            conditional(x, t, y)
    assert conditional(x, t, torch.tensor([0, 4])).shape == x.shape  # 4: the null class, a valid id
    for y in (torch.tensor([0, 5]), torch.tensor([-1, 0])):  # the embedding's IndexError before
        with pytest.raises(ValueError, match=r"y must be class ids in \[0, 4\] .* got values from"):
            conditional(x, t, y)


def test_flow_matching_noise_must_match_the_clips():
    x0 = torch.randn(2, 3, 2, 8, 8)
    with pytest.raises(ValueError, match=r"noise must have x0's shape \(2, 3, 2, 8, 8\), got \(1, 3, 2, 8, 8\)"):
        flow_matching_loss(dit(), x0, torch.rand(2), torch.randn(1, 3, 2, 8, 8))  # broadcast before: one draw


@pytest.mark.parametrize("steps", [0, -2, 2.0, True])
def test_sampling_steps_must_be_a_positive_int(steps):
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        sample_euler(dit(), torch.randn(1, 3, 2, 8, 8), steps)
