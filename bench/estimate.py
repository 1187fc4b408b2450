"""Estimates at scale on this CPU: a Llama-2-7B-shaped Hugging Face model and a 64-layer,
4096-wide built-in GPT, each estimated on fake tensors (no weights allocated), with the
wall time, the process's CPU time (``time.process_time``: the wall time on an idle core,
whatever else shares the machine) and its peak resident memory (``resource.getrusage``
maxrss).

Run: ``python bench/estimate.py [--device-memory 80GB]``; the numbers are in
docs/estimate.md.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch

from memfit.cli.estimate_command import builtin_spec, hf_spec
from memfit.estimator import estimate
from memfit.units import format_bytes

CASES = {
    "llama-2-7b (HF config), seq 2048, batch 1": (
        lambda: hf_spec(
            "llama",
            [
                "num_hidden_layers=32",
                "hidden_size=4096",
                "intermediate_size=11008",
                "num_attention_heads=32",
                "num_key_value_heads=32",
                "vocab_size=32000",
                "max_position_embeddings=2048",
            ],
            2048,
        ),
        1,
    ),
    "gpt (built-in), 64 layers x 4096 wide, block 2048, batch 1": (
        lambda: builtin_spec("gpt", ["n_layer=64", "n_embd=4096", "n_head=32", "block_size=2048"]),
        1,
    ),
}


def max_rss_bytes() -> int:
    """The process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device-memory", default="80GB")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name, (make, batch_size) in CASES.items():
        model_fn, inputs_fn, loss_fn = make()
        start, cpu = time.perf_counter(), time.process_time()
        est = estimate(
            model_fn,
            inputs_fn,
            batch_size=batch_size,
            loss_fn=loss_fn,
            precisions=["fp32", "bf16-mixed", "bf16-master"],
            device_memory=args.device_memory,
        )
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"## {name}")
        print(
            f"wall {seconds:.1f} s, CPU {cpu:.1f} s, "
            f"peak RSS of the process so far {format_bytes(max_rss_bytes())}"
        )
        print(est.summary(rich=False))
        for precision in ("fp32", "bf16-mixed", "bf16-master"):
            row = est.row(precision, "none")
            static = row.parts["params"] + row.parts["grads"] + row.parts["optimizer"]
            print(f"{precision}: static bytes per parameter {static / est.parameters:.3f}")
        print()


if __name__ == "__main__":
    main()
