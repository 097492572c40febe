"""A trainer in a process of its own, for the weight-transfer group tests: it loads the
named weights the test saved (torch.save of a list of (name, tensor) pairs, in the order
the test announced them), joins the group as rank 0 and sends them. It imports neither
transformers nor the model: starting it is most of a test's time otherwise.

    python -m tests.weight_trainer WEIGHTS PORT WORLD_SIZE [--bad-shape]

--bad-shape sends the first tensor with a row too few, which the workers must refuse
before any weight changes. --differ-then-fail sends, under the right announcement,
tensors that differ from it (the sender refuses them, the workers with it), then the
right ones over the same group, then them again, failing at the fourth broadcast. --kill
sends them until its fourth broadcast, then dies by SIGKILL (a trainer that crashed
mid-send). Exit status 0 once sent; 3 when the workers refused; 5 when a send failed
midway.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

from zmqworker.distributed.trainer_sender import TrainerWeightSender


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """A training step's worth of change: every weight moves by a seeded random amount."""
    generator = torch.Generator().manual_seed(seed)
    for _, param in model.named_parameters():
        param.add_(0.05 * torch.randn(param.shape, generator=generator))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("weights")
    parser.add_argument("port", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("--bad-shape", action="store_true")
    parser.add_argument("--differ-then-fail", action="store_true")
    parser.add_argument("--kill", action="store_true")
    args = parser.parse_args()
    weights = torch.load(args.weights, weights_only=True)
    if args.bad_shape:
        name, first = weights[0]
        weights[0] = (name, first[1:])
    # Small pieces, so that a tensor crosses in several broadcasts.
    with TrainerWeightSender(
        "127.0.0.1", args.port, args.world_size, timeout_s=60.0, piece_bytes=4096
    ) as sender:
        try:
            if args.differ_then_fail:
                update = sender.announce(weights)
                wrong = [(weights[0][0], weights[0][1][1:]), *weights[1:]]
                try:
                    sender.send(wrong, update)
                except ValueError:
                    pass
                else:
                    return 4
                sender.send(weights)
                broadcast, sent = sender.group.broadcast, []

                def failing(tensor: torch.Tensor) -> None:
                    if len(sent) == 3:
                        raise OSError("the trainer's device fell off the bus")
                    sent.append(tensor)
                    broadcast(tensor)

                sender.group.broadcast = failing  # type: ignore[method-assign]
            if args.kill:
                broadcast, count = sender.group.broadcast, [0]

                def dying(tensor: torch.Tensor) -> None:
                    count[0] += 1
                    if count[0] == 4:
                        os.kill(os.getpid(), signal.SIGKILL)
                    broadcast(tensor)

                sender.group.broadcast = dying  # type: ignore[method-assign]
            sender.send(weights)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 3
        except OSError:
            return 5
    return 0


if __name__ == "__main__":
    sys.exit(main())
