"""A Lightning run with memfit's plan: a small MLP stack, CPU, seconds.

python examples/lightning_fit.py
"""

import lightning.pytorch as pl
import torch
from torch import nn

from memfit.integrations.lightning import MemfitCallback


class Stack(pl.LightningModule):
    def __init__(self, width: int = 128, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                for _ in range(depth)
            ]
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(1024, 128, generator=g), torch.randn(1024, generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=256)
    callback = MemfitCallback(budget="19MiB")
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=2,
        callbacks=[callback],
    )
    trainer.fit(Stack(), loader)
    print(
        {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("memfit/plan/")}
    )


if __name__ == "__main__":
    main()
