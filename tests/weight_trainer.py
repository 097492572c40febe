"""A trainer in a process of its own, for the weight-transfer group tests: it loads a
checkpoint with transformers, moves its weights as `perturb` does, joins the group as
rank 0 and sends them.

    python -m tests.weight_trainer CHECKPOINT PORT WORLD_SIZE SEED [--bad-shape]

--bad-shape sends the first tensor with a row too few, which the workers must refuse
before any weight changes. Exit status 0 once sent; 3 when the workers refused.
"""

from __future__ import annotations

import argparse
import sys

import torch
import transformers

from zmqworker.distributed.trainer_sender import TrainerWeightSender


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """A training step's worth of change: every weight moves by a seeded random amount."""
    generator = torch.Generator().manual_seed(seed)
    for _, param in model.named_parameters():
        param.add_(0.05 * torch.randn(param.shape, generator=generator))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("port", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("seed", type=int)
    parser.add_argument("--bad-shape", action="store_true")
    args = parser.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    perturb(model, args.seed)
    weights = list(model.named_parameters())
    if args.bad_shape:
        name, first = weights[0]
        weights[0] = (name, first[1:])
    # Small pieces, so that a tensor crosses in several broadcasts.
    with TrainerWeightSender(
        "127.0.0.1", args.port, args.world_size, timeout_s=60.0, piece_bytes=4096
    ) as sender:
        try:
            sender.send(weights)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
