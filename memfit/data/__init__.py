"""Built-in data: a byte-level corpus of the Python standard library's sources, synthetic data;
and :class:`ResumableLoader`, a DataLoader whose place in its epochs resumes exactly.

The built-in data of ``memfit train`` is a function of the step: the batch of step ``k`` is
drawn with the seed ``seed * 1_000_003 + k``, so a resumed run trains on exactly the batches
the uninterrupted one did, with no state to save.

Example::

    from memfit.data import TextCorpus, image_batch, token_batch

    corpus = TextCorpus.load(max_bytes=2_000_000)
    text = corpus.batch("train", batch_size=8, block_size=128, generator=0)  # (8, 129) int64
    images, labels = image_batch(32, generator=0)                            # synthetic CIFAR-sized
"""

from memfit.data.loader import ResumableLoader
from memfit.data.synthetic import class_patterns, image_batch, markov_successors, token_batch
from memfit.data.text import DEFAULT_MAX_BYTES, TextCorpus, default_cache_dir, list_source_files

__all__ = [
    "DEFAULT_MAX_BYTES",
    "ResumableLoader",
    "TextCorpus",
    "class_patterns",
    "default_cache_dir",
    "image_batch",
    "list_source_files",
    "markov_successors",
    "token_batch",
]
