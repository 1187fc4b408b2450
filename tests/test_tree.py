"""Candidate units: block detection, user-named units, structure fingerprints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from memfit.checkpoint.apply import apply_plan, remove_plan
from memfit.checkpoint.tree import (
    UnitTree,
    find_units,
    original_class,
    structure_fingerprint,
    unit_tree,
)
from memfit.errors import PlanError

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        # A stack of plain layers inside a block: not split into units.
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Transformer(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(n)])
        self.acts = nn.ModuleList([nn.ReLU(), nn.GELU()])  # no parameters: not a chain
        self.head = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 10))  # short stack

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Res(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.short = nn.Sequential(nn.Conv2d(c, c, 1), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)) + self.short(x))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.stages = nn.Sequential(nn.Sequential(Res(4), Res(4)), nn.Sequential(Res(4), Res(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


class Body(nn.Module):
    """Holds a deep stack of plain layers (VGG-style) outside any block."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.MaxPool2d(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def test_transformer_blocks() -> None:
    tree = find_units(Transformer())
    assert tree.names() == ["", "blocks", "blocks.0", "blocks.1", "blocks.2"]
    assert tree["blocks"].is_chain and not tree["blocks.0"].is_chain
    assert [c.name for c in tree.root.children] == ["blocks"]
    assert tree.parent("blocks.1") is tree["blocks"]
    assert tree.parent("") is None
    assert isinstance(tree["blocks.0"].module, Block)
    assert len(tree) == 5 and "blocks.2" in tree and "head" not in tree
    assert "blocks: ModuleList [chain]" in repr(tree)


def test_one_layer_model_still_has_a_unit() -> None:
    assert find_units(Transformer(n=1)).names() == ["", "blocks", "blocks.0"]


def test_nested_stages_and_blocks() -> None:
    names = find_units(CNN()).names()
    assert names == [
        "",
        "stages",
        "stages.0",
        "stages.0.0",
        "stages.0.1",
        "stages.1",
        "stages.1.0",
        "stages.1.1",
    ]


def test_stacked_rnn_layers() -> None:
    class RNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.LSTM(4, 4), nn.GRU(4, 4)])

    assert find_units(RNN()).names() == ["", "layers", "layers.0", "layers.1"]


def test_stacks_of_plain_layers() -> None:
    # The model itself as a Sequential of layers: its children are units.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    tree = find_units(model)
    assert tree.names() == ["", "0", "1", "2"] and tree.root.is_chain
    # A deep stack outside blocks is a chain; a short one is not.
    assert find_units(Body()).names() == ["", "features", *(f"features.{i}" for i in range(5))]
    # One layer with parameters is no chain of layers.
    with pytest.raises(PlanError):
        find_units(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_no_blocks_raises_with_instructions() -> None:
    with pytest.raises(PlanError, match=r"units=\[") as err:
        find_units(Plain())
    assert "extra=" in str(err.value) and "fc1 (Linear)" in str(err.value)


def test_extra_units() -> None:
    tree = find_units(Plain(), extra=["fc1"])
    assert tree.names() == ["", "fc1"]
    tree = find_units(Transformer(), extra=["head", "blocks.0.mlp"])
    assert tree.names() == [
        "",
        "blocks",
        "blocks.0",
        "blocks.0.mlp",
        "blocks.1",
        "blocks.2",
        "head",
    ]
    assert tree.parent("blocks.0.mlp").name == "blocks.0"
    with pytest.raises(PlanError, match="Did you mean 'head'"):
        find_units(Transformer(), extra=["haed"])


def test_unit_tree_exact_names() -> None:
    model = Transformer()
    tree = unit_tree(model, ["blocks.1", "blocks.0.mlp", "blocks.0"])
    assert isinstance(tree, UnitTree)
    assert tree.names() == ["", "blocks.0", "blocks.0.mlp", "blocks.1"]
    assert not any(u.is_chain for u in tree)
    full = unit_tree(model, ["blocks", "blocks.0", "blocks.1", "blocks.2"])
    assert full["blocks"].is_chain
    assert not unit_tree(model, ["blocks", "blocks.0"])["blocks"].is_chain


def test_structure_fingerprint() -> None:
    small, big = Transformer(n=2), Transformer(n=3)
    fp = structure_fingerprint(small, find_units(small))
    assert fp == [
        ("", "Transformer"),
        ("blocks", "ModuleList"),
        ("blocks.0", "Block"),
        ("blocks.1", "Block"),
    ]
    # Containers list all their children, so a plan naming only some layers still tells.
    assert structure_fingerprint(small, ["", "blocks"]) == fp
    assert structure_fingerprint(big, [n for n, _ in fp]) != fp
    assert structure_fingerprint(small, ["nope"]) == [("nope", "<missing>")]
    # The class memfit swaps in for segments does not change the fingerprint.
    apply_plan(small, {"decisions": {}, "segments": {"blocks": [(0, 1)]}})
    assert type(small.blocks) is not nn.ModuleList
    assert original_class(small.blocks) is nn.ModuleList
    assert structure_fingerprint(small, find_units(small)) == fp
    remove_plan(small)


def test_builtin_models() -> None:
    models = pytest.importorskip("memfit.models")
    gpt = models.GPT(models.GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8))
    assert find_units(gpt).names() == ["", "blocks", "blocks.0", "blocks.1"]
    resnet = models.ResNet(models.ResNetConfig(widths=(4, 8), blocks_per_stage=(1, 2)))
    assert find_units(resnet).names() == [
        "",
        "stages",
        "stages.0",
        "stages.0.0",
        "stages.1",
        "stages.1.0",
        "stages.1.1",
    ]
    lstm = models.LSTMLM(models.LSTMConfig(n_layer=3, n_embd=8, hidden_size=8))
    assert find_units(lstm).names() == ["", "layers", "layers.0", "layers.1", "layers.2"]


# --------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def transformers() -> Any:
    return pytest.importorskip("transformers")


def _layers(tree: UnitTree, prefix: str) -> list[str]:
    return [n for n in tree.names() if n.startswith(prefix)]


def test_hf_gpt2(transformers: Any) -> None:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    tree = find_units(transformers.GPT2LMHeadModel(cfg))
    assert _layers(tree, "transformer.h") == ["transformer.h", "transformer.h.0", "transformer.h.1"]
    assert tree["transformer.h.0"].class_name == "GPT2Block"


def test_hf_bert(transformers: Any) -> None:
    cfg = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
    )
    tree = find_units(transformers.BertModel(cfg))
    assert _layers(tree, "encoder.layer") == ["encoder.layer", "encoder.layer.0", "encoder.layer.1"]


def test_hf_llama(transformers: Any) -> None:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
    )
    tree = find_units(transformers.LlamaForCausalLM(cfg))
    assert _layers(tree, "model.layers") == ["model.layers", "model.layers.0", "model.layers.1"]
