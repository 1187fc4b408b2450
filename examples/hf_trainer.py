"""A Hugging Face Trainer run with memfit's plan: a tiny GPT-2 from a config, CPU, seconds.

python examples/hf_trainer.py
"""

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from memfit.integrations.hf import MemfitCallback


class Windows(torch.utils.data.Dataset):
    """Random token windows; labels make the model compute its own loss."""

    def __init__(self, n: int = 32, length: int = 64) -> None:
        self.ids = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    config = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    model = GPT2LMHeadModel(config)
    callback = MemfitCallback(budget="16MiB")  # the peak of a whole training step
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            max_steps=4,
            logging_steps=2,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Windows(), callbacks=[callback])
        trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    print({k: v for k, v in last.items() if k.startswith("memfit/plan/")})


if __name__ == "__main__":
    main()
