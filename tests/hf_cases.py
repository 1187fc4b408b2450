"""A tiny Hugging Face GPT-2 built from a config, and token windows with labels, for the
tests that train it in a framework's loop (the Trainer, accelerate)."""

from __future__ import annotations

import torch


class Tokens(torch.utils.data.Dataset):
    """``rows`` fixed token windows of ``seq`` tokens with labels: the model computes its
    own loss."""

    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(n_layer: int, seq: int, vocab: int) -> torch.nn.Module:
    """A GPT-2 of ``n_layer`` blocks of width 32 without dropout (plans compared bitwise)
    and without a key/value cache (a cached block does other work when recomputed)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=n_layer,
        n_embd=32,
        n_head=2,
        vocab_size=vocab,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel(cfg)
