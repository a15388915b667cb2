"""``treetools train``: the reference trainer (``treetools.reference``)."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = parser.add_argument_group("run")
    d.add_argument("--steps", type=int, default=200, help="total training steps (default: 200)")
    d.add_argument("--workdir", default="runs/demo", help="where checkpoints/ and metrics.jsonl go (default: runs/demo)")
    d.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue from the latest checkpoint in WORKDIR (default: on)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--learning-rate", type=float, default=3e-3)
    d.add_argument("--log-every", type=int, default=20, help="log norms to metrics.jsonl every N steps")
    d.add_argument("--ckpt-every", type=int, default=100, help="save a checkpoint every N steps")
    d.add_argument("--freeze-embeddings", action="store_true",
                   help="freeze embed/ with optax.multi_transform + get_param_label_fn")
    d.add_argument("--ema-decay", type=float, default=0.99)
    d.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="simulate N CPU devices (sets XLA_FLAGS; only before jax starts)")
    d.add_argument("--quiet", action="store_true", help="print nothing but errors")


def main(args: argparse.Namespace) -> int:
    if args.cpu_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
    from treetools.reference.train import TrainConfig, train

    cfg = TrainConfig(workdir=args.workdir, steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                      learning_rate=args.learning_rate, log_every=args.log_every, ckpt_every=args.ckpt_every,
                      freeze_embeddings=args.freeze_embeddings, ema_decay=args.ema_decay, resume=args.resume,
                      quiet=args.quiet)
    train(cfg)
    return 0
