"""Synthetic data that a model can actually learn, made deterministically from a generator.

- :func:`image_batch`: images of a fixed low-frequency pattern per class plus Gaussian noise,
  with labels; a small CNN gets well above chance within a few dozen steps.
- :func:`token_batch`: token sequences from a fixed sparse Markov chain (each token has a few
  possible successors), so a language model's loss can fall from ``log(vocab_size)`` towards
  ``log(branching)``.

The class patterns and the Markov chain depend only on their shape arguments and a fixed
``structure_seed``, never on the batch generator: every batch comes from the same task.

Example::

    g = torch.Generator().manual_seed(0)
    images, labels = image_batch(32, generator=g)       # (32, 3, 32, 32) float32, (32,) int64
    tokens = token_batch(8, block_size=64, generator=g)  # (8, 65) int64
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from memfit.errors import ConfigError

#: The seed of the task's fixed structure (class patterns, Markov transitions).
STRUCTURE_SEED = 1234


def _as_generator(generator: torch.Generator | int | None) -> torch.Generator | None:
    if isinstance(generator, int):
        return torch.Generator().manual_seed(generator)
    return generator


@functools.lru_cache(maxsize=16)
def class_patterns(
    num_classes: int, channels: int, image_size: int, structure_seed: int = STRUCTURE_SEED
) -> torch.Tensor:
    """One unit-variance pattern per class, shape ``(num_classes, channels, size, size)``.

    The patterns are random 4x4 fields plus a random colour, upsampled to the image size:
    smooth, so a convolution stack can tell them apart, and different per channel.
    Cached; treat the result as read-only.

    Example::

        class_patterns(10, 3, 32).shape  # torch.Size([10, 3, 32, 32])
    """
    g = torch.Generator().manual_seed(structure_seed)
    # A class colour (per-channel offset) on top of a coarse spatial field: the colour is
    # found quickly through global pooling, the spatial part takes real convolution work.
    coarse = torch.randn(num_classes, channels, 4, 4, generator=g)
    coarse = coarse + torch.randn(num_classes, channels, 1, 1, generator=g)
    fine = F.interpolate(
        coarse, size=(image_size, image_size), mode="bilinear", align_corners=False
    )
    fine = fine - fine.mean(dim=(1, 2, 3), keepdim=True)
    return fine / fine.std(dim=(1, 2, 3), keepdim=True)


def image_batch(
    batch_size: int,
    num_classes: int = 10,
    image_size: int = 32,
    channels: int = 3,
    noise: float = 1.0,
    generator: torch.Generator | int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch ``(images, labels)`` of a learnable image classification task.

    Each image is its class's pattern (see :func:`class_patterns`) plus ``noise`` times
    standard Gaussian noise; labels are uniform over the classes. The same generator state
    (or integer seed) gives the same batch.

    Example::

        x, y = image_batch(64, generator=0)
        x.shape, y.shape  # (torch.Size([64, 3, 32, 32]), torch.Size([64]))
    """
    if batch_size <= 0 or num_classes <= 0 or image_size <= 0 or channels <= 0:
        raise ConfigError(
            "batch_size, num_classes, image_size and channels must be positive, got "
            f"{batch_size}, {num_classes}, {image_size}, {channels}"
        )
    g = _as_generator(generator)
    labels = torch.randint(0, num_classes, (batch_size,), generator=g)
    patterns = class_patterns(num_classes, channels, image_size)
    images = patterns[labels] + noise * torch.randn(
        batch_size, channels, image_size, image_size, generator=g
    )
    images = images.to(dtype)
    if device is not None:
        images, labels = images.to(device), labels.to(device)
    return images, labels


@functools.lru_cache(maxsize=16)
def markov_successors(
    vocab_size: int, branching: int, structure_seed: int = STRUCTURE_SEED
) -> torch.Tensor:
    """The chain's table: row ``t`` lists the ``branching`` tokens that may follow ``t``.

    Cached; treat the result as read-only.

    Example::

        markov_successors(256, 4).shape  # torch.Size([256, 4])
    """
    g = torch.Generator().manual_seed(structure_seed)
    return torch.stack(
        [torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)]
    )


def token_batch(
    batch_size: int,
    block_size: int,
    vocab_size: int = 256,
    branching: int = 4,
    generator: torch.Generator | int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Token sequences of shape ``(batch_size, block_size + 1)``, int64, from a Markov chain.

    The first token is uniform; each next one is drawn uniformly from the current token's
    ``branching`` successors (:func:`markov_successors`). The best possible loss is therefore
    ``log(branching)`` nats per token (1.39 for 4) against ``log(vocab_size)`` (5.55 for 256)
    for a model that learned nothing. Layout as :meth:`memfit.data.text.TextCorpus.batch`:
    inputs ``batch[:, :-1]``, targets ``batch[:, 1:]``.

    Example::

        b = token_batch(16, 128, generator=0)
        b.shape  # torch.Size([16, 129])
    """
    if batch_size <= 0 or block_size <= 0:
        raise ConfigError(
            f"batch_size and block_size must be positive, got {batch_size} and {block_size}"
        )
    if not 1 <= branching <= vocab_size:
        raise ConfigError(f"branching must be in [1, vocab_size={vocab_size}], got {branching}")
    g = _as_generator(generator)
    table = markov_successors(vocab_size, branching)
    choices = torch.randint(0, branching, (batch_size, block_size), generator=g)
    out = torch.empty(batch_size, block_size + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=g)
    # Sequential in time (each token depends on the last) but vectorized over the batch;
    # block_size small vector ops are cheap next to a training step.
    for t in range(block_size):
        out[:, t + 1] = table[out[:, t], choices[:, t]]
    return out if device is None else out.to(device)
