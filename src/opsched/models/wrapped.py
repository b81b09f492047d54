"""Zoo networks taken from torchvision and timm, with random weights (no download is ever attempted)."""

from __future__ import annotations

import torch


def inception_v3(batch: int = 1, image_size: int | None = None, num_classes: int = 1000):
    """torchvision's Inception V3 (no auxiliary head) at 299x299; returns ``(model, (x,))``."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False,
                                            num_classes=num_classes)
    size = image_size or 299
    return model.eval(), (torch.randn(batch, 3, size, size),)


def nasnet(batch: int = 1, image_size: int | None = None, num_classes: int = 1000):
    """timm's NASNet-A large (``nasnetalarge``) at 331x331; returns ``(model, (x,))``."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("nasnetalarge", pretrained=False, num_classes=num_classes)
    size = image_size or 331
    return model.eval(), (torch.randn(batch, 3, size, size),)
