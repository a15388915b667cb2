"""Will it fit? The memory each device needs to restore a checkpoint onto a mesh and
train it, from the checkpoint's metadata alone (nothing is allocated, no device
is needed: a 1,024-device plan runs on a laptop).

Every array leaf of the step's items (params, params_ema, opt_state...) is laid
out on the mesh by the layout rules given (--rules), else by the sharding the
checkpoint recorded (its mesh axes taken by name), else by --shard-largest AXIS
(its largest dimension AXIS divides, split over AXIS: FSDP's layout for a
checkpoint that records none, as Hugging Face's), else replicated (a plan where
every leaf is replicated over several devices says so first); with
--optimizer, the optimizer's state (jax.eval_shape of optax's init, each moment
laid out like its param) replaces a stored opt_state; the gradients a step holds
are counted like the params (--no-grads: not). Printed: the fullest device's
bytes per part, the verdict against --device-memory, the host memory of a
restore (one device block plus the stored chunk decoded for it), replicated
leaves a mesh axis could split, and the largest leaves per device.

--rules FILE is a .json or .toml file of layout rules, the first whose regex
matches a leaf's part/path giving its PartitionSpec:
  {"partition": [["embedding$", ["tensor", "fsdp"]], ["kernel$", [null, "fsdp"]]]}
(in TOML write null as "None"). The restore rules of the other commands do not
apply here.

Examples:
  treetools plan runs/demo/checkpoints                            the mesh it was saved on
  treetools plan runs/demo/checkpoints --mesh data=8,fsdp=16 --optimizer adamw --device-memory 80GiB
  treetools plan model.safetensors --mesh fsdp=8 --rules layout.toml --format json
  treetools plan model.safetensors --mesh fsdp=8 --shard-largest fsdp --optimizer adamw

--format json prints one object, "schema": 1 (docs/json-schema.md).

The reading flags of every command (docs/cli.md) are taken: --follow-links
and --memory-budget apply to the metadata read; plan reads no array data, so
--block-size, --workers and --progress change nothing (a note says so), and
--processes is refused (one process).

Exit codes: 0 fits (or no --device-memory given); 1 does not fit, or a known
error (missing path, not a checkpoint); 2 usage (a bad --mesh, --device-memory
or rules file; a recorded sharding over an axis --mesh lacks).
"""

from __future__ import annotations

import argparse
import json

from treetools.cli import KNOWN_ERRORS, _output
from treetools.cli.options import (add_item, add_output_format, add_prefix, add_reading, add_step, read_options,
                                   reading_given)
from treetools.shared.errors import UsageError
from treetools.shared.rows import parse_size

OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion")  # treetools.checkpoint_jax.memory.OPTIMIZERS (jax side)


def mesh_axes(text: str) -> dict[str, int]:
    """``--mesh data=8,fsdp=16`` -> ``{"data": 8, "fsdp": 16}``.

    >>> mesh_axes("data=8, fsdp=16")
    {'data': 8, 'fsdp': 16}
    >>> mesh_axes("data=8,data=2")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected AXIS=SIZE,... with each axis once and each size a positive integer
    (data=8,fsdp=16); got 'data=8,data=2'
    """
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        name = name.strip()
        if not name.isidentifier() or not size.strip().isdigit() or int(size) < 1 or name in out:
            raise argparse.ArgumentTypeError(
                "expected AXIS=SIZE,... with each axis once and each size a positive integer (data=8,fsdp=16); "
                f"got {text!r}")
        out[name] = int(size)
    return out


def device_memory(text: str) -> int:
    """``--device-memory 80GiB`` -> bytes (``shared.rows.parse_size``: 80GB decimal, 80GiB binary, or bytes).

    >>> device_memory("80GiB")
    85899345920
    """
    try:
        return parse_size(text, what="--device-memory")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("`", "")) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="CKPT", help="the checkpoint (any format treetools reads)")
    parser.add_argument("--mesh", type=mesh_axes, default=None, metavar="AXIS=SIZE,...",
                        help="the mesh to plan for, e.g. data=8,fsdp=16 (default: the mesh the checkpoint recorded, "
                             "else one device)")
    parser.add_argument("--rules", metavar="FILE", default=None,
                        help="layout rules, .json or .toml: {\"partition\": [[regex, spec], ...]}, first match wins, "
                             "before the recorded sharding")
    parser.add_argument("--shard-largest", metavar="AXIS", default=None,
                        help="lay out each leaf the rules and the checkpoint leave unsharded (a Hugging Face "
                             "checkpoint's: all of them) by splitting its largest dimension AXIS divides over AXIS "
                             "(FSDP's default); default: such leaves are replicated")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                        help="plan this optax optimizer's state for training (replaces a stored opt_state)")
    parser.add_argument("--no-grads", dest="grads", action="store_false",
                        help="leave out the gradients a training step holds (to serve, not train)")
    parser.add_argument("--device-memory", type=device_memory, default=None, metavar="SIZE",
                        help="one device's memory (80GiB or 80G binary, 40GB decimal, bytes): exit 1 when the state "
                             "does not fit")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="largest leaves shown (default 10)")
    add_step(parser, allow_all=False)
    add_prefix(parser)
    add_item(parser)
    add_output_format(parser, ("table", "json"))
    add_reading(parser, data=False, processes=False)


def main(args: argparse.Namespace) -> int:
    # Here, not at the top: planning traces the optimizer with jax, which `treetools plan --help` does not need.
    from treetools.checkpoint_jax.memory import LayoutRules, plan_checkpoint

    if args.top < 0:
        raise UsageError(f"--top {args.top}: expected a number >= 0")
    rules = None
    if args.rules is not None:
        try:
            rules = LayoutRules.from_file(args.rules)
        except (ValueError, OSError) as e:
            raise UsageError(f"--rules: {e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror
                             else " ".join(str(e).split())) from None
    unused = reading_given(args, data_only=True)
    if unused:  # taken, as by every command that reads, and said to change nothing: never dropped silently
        _output.note(f"plan reads metadata only: {', '.join(unused)} change{'s' * (len(unused) == 1)} nothing here")
    try:
        plan = plan_checkpoint(args.path, step=args.step, item=args.item, mesh=args.mesh, rules=rules,
                               optimizer=args.optimizer, grads=args.grads, device_memory=args.device_memory,
                               prefix=args.prefix, top=args.top, shard_largest=args.shard_largest,
                               read=read_options(args))
    except KNOWN_ERRORS:
        raise  # one `treetools: error:` line, exit 1
    except ValueError as e:  # the mesh and the checkpoint's layout do not fit together: the arguments' fault
        raise UsageError(" ".join(str(e).split())) from None
    _output.out(json.dumps(plan.to_json(), indent=2) if args.format == "json" else str(plan))
    return 1 if plan.fits is False else 0
