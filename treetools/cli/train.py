"""Train the reference model: a small decoder-only Transformer (Flax + Optax) on a
synthetic next-token task that needs no download, FSDP-sharded over a
data x fsdp mesh of all devices (CPU by default).

WORKDIR/checkpoints/ gets an Orbax checkpoint every --ckpt-every steps
(params, params_ema, opt_state and the data iterator); WORKDIR/metrics.jsonl
gets loss and norm metrics every --log-every steps (`treetools plot` draws
them), per module at --norm-depth (default: one norm per block). --steps is
the total: a WORKDIR with checkpoints resumes from its latest step and trains
up to --steps, bit for bit as one straight run. A WORKDIR inside a checkpoint
(runs/demo/checkpoints/200, an item folder, a root's step) is refused.

--scan-layers puts the blocks under one nn.scan named `layers`
(metadata_params={nn.PARTITION_NAME: "layers"}): each block parameter is one
stacked leaf (layers/qkv/kernel of shape (n_layers, ...)), and the norms are
logged per layer (grad_norm/layers/0, ...: the layer index is a path part,
so a block is 2 parts deep where unscanned it is 1, layers_0). A resumed run
keeps the setting it was saved with, whatever the flag says, and a note says
so (the checkpoint's paths differ: layers/qkv/kernel against layers_0/qkv/kernel).

--health logs per-layer training health per module at --norm-depth
(update_ratio/<module>, nonfinite_grads/<module>, grad_abs_max/<module>,
Adam's mu_norm/nu_norm), watches loss and grad_norm with a spike/NaN detector
(a flagged step skips its update, and the log names the module that jumped
most), keeps the last 32 steps of it in a ring buffer on the device, and
writes WORKDIR/health/health_<step>.json 4 steps after a flagged step
(`treetools plot` draws it). --inject-spike STEP feeds a deliberately bad
batch (every token 0) at STEP to show the whole loop; it implies --health.

Examples:
  treetools train --workdir runs/demo --cpu-devices 4
  treetools train --workdir runs/demo --steps 400        (continue to step 400)
  treetools inspect runs/demo/checkpoints
  treetools plot runs/demo/metrics.jsonl -o norms.png
  treetools train --workdir runs/scan --scan-layers --cpu-devices 4
  treetools plot runs/scan --heatmap 'grad_norm/layers/(\\d+)$' -o layers.png
  treetools train --workdir runs/spike --steps 60 --inject-spike 40 --cpu-devices 4
  treetools plot runs/spike/health/health_00000044.json
  treetools train --workdir runs/ft --init-from HF_DIR --steps 50   (fine-tune a Hugging Face model)
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from treetools.cli import _output
from treetools.cli._args import positive_float, positive_int, unit_float
from treetools.shared.files import check_writable, refuse_link_out
from treetools.shared.install import install_hint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = parser.add_argument
    d("--steps", type=positive_int, default=200, metavar="N", help="total training steps (default: 200)")
    d("--workdir", default="runs/demo", metavar="DIR",
      help="where checkpoints/ and metrics.jsonl go (default: runs/demo)")
    d("--resume", action=argparse.BooleanOptionalAction, default=True,
      help="continue from the latest checkpoint in DIR (default: on); --no-resume needs a DIR without checkpoints")
    d("--seed", type=int, default=0, help="model init and data seed (default: 0); a resumed run must keep it")
    d("--batch-size", type=positive_int, default=32, metavar="B",
      help="global batch, a multiple of the device count (default: 32)")
    d("--learning-rate", type=positive_float, default=3e-3, metavar="LR",
      help="peak AdamW learning rate (default: 3e-3)")
    d("--log-every", type=positive_int, default=20, metavar="N",
      help="log norms to metrics.jsonl every N steps (default: 20)")
    d("--ckpt-every", type=positive_int, default=100, metavar="N",
      help="save a checkpoint every N steps (default: 100)")
    d("--freeze-embeddings", action="store_true", help="freeze embed/ with optax.multi_transform + get_param_label_fn")
    d("--scan-layers", action="store_true",
      help="the blocks as one nn.scan named `layers` (stacked leaves); norms logged per layer. A resumed run "
           "keeps the setting it was saved with")
    d("--norm-depth", type=positive_int, default=None, metavar="K",
      help="log per-module norms of the first K path parts, a scanned layer's index being one (default: one per "
           "block: 1, or 2 with --scan-layers)")
    d("--health", action="store_true",
      help="per-layer health, a spike/NaN detector that skips flagged updates, and dumps to DIR/health/")
    d("--inject-spike", type=positive_int, default=None, metavar="STEP",
      help="feed a deliberately bad batch (every token 0) at STEP; implies --health")
    d("--ema-decay", type=unit_float, default=0.99, metavar="D", help="decay of the EMA params (default: 0.99)")
    d("--tensorboard", default=None, metavar="DIR",
      help="also write the metrics as TensorBoard event files in DIR (tt.TensorBoardWriter; needs tensorboardX, "
           "the tensorboard extra); view with `tensorboard --logdir DIR`")
    d("--wandb", default=None, metavar="PROJECT",
      help="also log the metrics to a W&B run in PROJECT (tt.WandbWriter; needs wandb, the wandb extra), its files "
           "under DIR/wandb; WANDB_MODE=offline logs without network (`wandb sync` uploads later)")
    d("--init-from", default=None, metavar="HF_DIR",
      help="start from a Hugging Face model folder (llama, mistral, qwen2, gemma or gpt2: config.json and "
           "safetensors): the model is its config.json, the weights its own, read through the preset "
           "FAMILY:hf:reference; DIR/config.json is written for the way back (convert --preset FAMILY:reference:hf "
           "--config DIR/config.json). Give it again to resume the run")
    d("--cpu-devices", type=positive_int, default=None, metavar="N",
      help="simulate N CPU devices (sets XLA_FLAGS; only before jax starts)")
    d("--quiet", action="store_true", help="print nothing but errors")


def check_workdir(workdir: str) -> None:
    """Refuse a workdir inside (or equal to) a checkpoint: a step folder, an item folder, a step of a root.

    The run's ``checkpoints/`` and ``metrics.jsonl`` would be written into it and read as part of it
    (``treetools verify`` names such strangers in a committed Orbax step).

    Raises:
      ValueError: naming the checkpoint, and the run folder to use where it is a trainer's ``checkpoints/``.
    """
    # The checkpoint layer imports numpy, which `treetools train --help` does not need.
    from treetools.checkpoint_io.diagnose import enclosing_checkpoints, shown_path

    inside = enclosing_checkpoints(workdir, include_self=True)
    if not inside:
        return
    nearest, fmt = inside[0]
    outer = inside[-1][0]
    same = os.path.abspath(os.path.expanduser(workdir)) == nearest
    where = f"is a checkpoint ({fmt.name})" if same else \
        f"is inside the checkpoint {shown_path(nearest, workdir)} ({fmt.name})"
    fix = "pick a folder outside it"
    if os.path.basename(outer) == "checkpoints":  # a trainer's layout: WORKDIR/checkpoints
        fix += f" (to continue the run it belongs to: --workdir {shown_path(os.path.dirname(outer), workdir)})"
    raise ValueError(f"--workdir {workdir} {where}: a run written there would read as part of it; {fix}.")


def _check_writers(args: argparse.Namespace) -> None:
    """--tensorboard and --wandb fail now, before jax starts, when their package is missing or DIR is read-only."""
    if args.tensorboard is not None:
        if importlib.util.find_spec("tensorboardX") is None:
            raise ImportError(f"--tensorboard needs tensorboardX; install it: {install_hint('tensorboard')}")
        check_writable(os.path.join(args.tensorboard, "events"))
    if args.wandb is not None:
        if not args.wandb.strip() or "/" in args.wandb:
            raise ValueError(f"--wandb {args.wandb!r}: give a W&B project name (no '/'), e.g. --wandb treetools-demo.")
        if importlib.util.find_spec("wandb") is None:
            raise ImportError(f"--wandb needs wandb; install it: {install_hint('wandb')}")


def main(args: argparse.Namespace) -> int:
    check_workdir(args.workdir)
    # Orbax would save (and prune) through a link planted at WORKDIR/checkpoints; metrics.jsonl is guarded where
    # it is written (tt.JsonlWriter).
    refuse_link_out(os.path.join(args.workdir, "checkpoints"), args.workdir)
    check_writable(os.path.join(args.workdir, "metrics.jsonl"))  # a read-only place fails now, before jax starts
    if args.health or args.inject_spike is not None:  # health dumps go to WORKDIR/health (checked again at each)
        refuse_link_out(os.path.join(args.workdir, "health"), args.workdir)
    _check_writers(args)
    if args.init_from is not None and not os.path.isfile(os.path.join(args.init_from, "config.json")):
        raise ValueError(f"--init-from {args.init_from}: no config.json there; give a Hugging Face model folder "
                         "(config.json beside its safetensors).")
    if args.cpu_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
    # The trainer is jax: imported after XLA_FLAGS is set, and never by `treetools train --help`.
    from treetools.reference.model import ModelConfig
    from treetools.reference.train import TrainConfig, train

    cfg = TrainConfig(workdir=args.workdir, steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                      learning_rate=args.learning_rate, log_every=args.log_every, ckpt_every=args.ckpt_every,
                      freeze_embeddings=args.freeze_embeddings, ema_decay=args.ema_decay, resume=args.resume,
                      quiet=args.quiet, norm_depth=args.norm_depth, model=ModelConfig(scan_layers=args.scan_layers),
                      health=args.health or args.inject_spike is not None, inject_spike=args.inject_spike,
                      tensorboard=args.tensorboard, wandb_project=args.wandb, init_from=args.init_from,
                      log=lambda line: _output.out(line, flush=True))  # `| head`: training goes on, exit code kept
    train(cfg)
    return 0
