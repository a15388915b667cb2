"""Convert a checkpoint to Hugging Face safetensors or to Orbax, without model
code: any format treetools reads (Orbax, T5X, Flax msgpack, safetensors,
Hugging Face sharded, npz; local, gs:// or s3://), one item of one step (the
params unless --item says otherwise), through rename/drop/cast/transpose/
unstack rules (docs/rules.md).

DST ending in .safetensors is one file; any other DST is a Hugging Face
folder: model-0000K-of-0000N.safetensors shards of at most --shard-size with
model.safetensors.index.json (model.safetensors when one shard holds it
all), local or in a bucket. --to orbax writes an Orbax checkpoint folder
(ocp.StandardCheckpointer); with --dst-step N, step N of a CheckpointManager
root (item params). A --preset to reference or maxtext writes Orbax into a
local folder unless --to says otherwise (their trees nest on /).

Tensor names are the paths with / turned into . (params/Dense_0/kernel ->
params.Dense_0.kernel) unless --rename gives others. Every safetensors
header carries format=pt unless --metadata format=... says otherwise.

Both outputs are streamed block by block (memory stays a few blocks, or
a stripe of whole stored chunks, whatever the model's size; a stored chunk
over --memory-budget is refused); Orbax output is stored in chunks of at
most a block. Writes are atomic: a temporary name beside
DST renamed at the end (in a bucket, objects that appear only when whole,
the index last); an existing DST needs --overwrite; nothing is written under
SRC.

Examples:
  treetools convert runs/demo/checkpoints model.safetensors
  treetools convert runs/demo/checkpoints hf_model/ --shard-size 2GB --dtype bfloat16 --verify
  treetools convert flax_model.msgpack gpt2/ --rules gpt2_to_pt.toml --dry-run
  treetools convert model.safetensors orbax_ckpt/ --to orbax
  treetools convert gs://bucket/run/checkpoints s3://bucket/export/model/ --step 1000
  treetools convert Llama-3.2-1B/ llama_ref/ --preset llama:hf:reference --to orbax
  treetools convert llama_ref/ llama_hf/ --preset llama:reference:hf --config Llama-3.2-1B/config.json

--preset FAMILY:SOURCE:TARGET applies a preset (docs/presets.md), the rules
flags after it; its sizes come from the model's config.json (--config, or
the one beside SRC). Its options follow a comma: --preset
llama:hf:maxtext,scale_query=false leaves MaxText's query scale out. A conversion to hf writes config.json (and
generation_config.json when there is one) beside the shards, so that
transformers' from_pretrained(DST) loads it.

Exit codes: 0 written (and, with --verify, read back equal); 1 a known error
(missing source, existing DST, rules that do not fit) or --verify found
differences; 2 usage.
"""

from __future__ import annotations

import argparse

from treetools.cli import _output
from treetools.cli.options import (
    add_item,
    add_output_format,
    add_prefix,
    add_preset,
    add_reading,
    add_rules,
    add_step,
    options_from,
    rules_from,
)


def _metadata(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="the checkpoint to read (any format treetools reads)")
    parser.add_argument("dst", metavar="DST", help="a .safetensors file, or a folder (Hugging Face shards, or Orbax)")
    add_step(parser, allow_all=False)
    add_prefix(parser)
    add_item(parser)
    add_rules(parser)
    add_preset(parser)
    parser.add_argument("--to", choices=("safetensors", "orbax"), default=None,
                        help="output format (default safetensors; orbax for a --preset to reference or maxtext "
                             "into a local folder)")
    parser.add_argument("--shard-size", default="5GB", metavar="SIZE",
                        help="most bytes per shard of a safetensors folder: 5GB (default), 500MB, 2GiB or 2G, or bytes")
    parser.add_argument("--metadata", type=_metadata, action="append", default=[], metavar="KEY=VALUE",
                        help="a string into every safetensors header's __metadata__ (format=pt unless given); "
                             "repeatable")
    parser.add_argument("--dst-step", type=int, default=None, metavar="N",
                        help="with --to orbax: DST is a CheckpointManager root; write step N of it (item params)")
    parser.add_argument("--verify", action="store_true",
                        help="read DST back and compare every tensor with SRC after the rules, bit for bit")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mapping (source -> name, shape, dtype, shard) and write nothing")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false", help=argparse.SUPPRESS)
    add_output_format(parser, ("table", "json"))
    add_reading(parser)


def main(args: argparse.Namespace) -> int:
    # Here, not at the top: the reading modules import numpy, which `treetools convert --help` does not need.
    from treetools.checkpoint_tools.convert import convert
    from treetools.checkpoint_tools.options import ConvertOptions
    from treetools.checkpoint_tools.text import render_convert

    # Arguments that cannot work together (--to orbax with a .safetensors DST, --step all...) are the library's
    # UsageError (exit 2), checked before anything is read.
    options = options_from(args, ConvertOptions, rules=rules_from(args), metadata=dict(args.metadata))
    report = convert(args.src, args.dst, options)
    for note in report.notes:
        _output.note(note)
    _output.out(render_convert(report, args.format))
    return 0 if report.ok else 1
