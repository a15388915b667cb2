"""``convert``: any checkpoint treetools reads to Hugging Face safetensors or to Orbax, without model code.

One item of one step (the params unless ``item`` says otherwise) goes
through ``tt.Rules`` (rename, drop/keep, cast, transpose, unstack/stack) and
out through a writer of the checkpoint layer (``treetools.checkpoint_io.writers``):

* safetensors, streamed: each target leaf is read block by block through the
  block engine (``treetools.checkpoint_io.stream``), a leaf the rules transform through
  ``treetools.checkpoint_io.mapping.RuledReader`` (exactly the source blocks a target
  block needs, as ``restore_checkpoint`` with rules reads them), and written in
  C order, so memory holds a few blocks whatever the model's size;
* Orbax, through Orbax's own save with a type handler that writes each leaf
  chunk by chunk as the block engine reads it
  (``treetools.checkpoint_io.writers.orbax``): memory holds a few blocks too.

Names: safetensors tensor names are the target paths with ``/`` turned into
``.`` (``params/Dense_0/kernel`` -> ``params.Dense_0.kernel``; write the names
you want with ``rename`` rules); Orbax trees nest on ``/`` (on ``.`` for a flat
name such as ``model.layers.0.weight``). Non-array leaves (a step counter kept
as a plain value) are left out, each named in a note.

Writes are atomic (see ``treetools.checkpoint_io.writers``), an existing destination
is refused without ``overwrite``, and nothing is ever written under the
source. ``verify`` reads the destination back through treetools' own readers
and compares every tensor, bit for bit, with the source after the rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import time
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.readers import ArrayReader, bits_differ, is_numeric, np_dtype
from treetools.checkpoint_io.storage import as_typed, backend, is_url, join, location, parent, realpath
from treetools.checkpoint_io.stream import Failed, reduce_blocks
from treetools.checkpoint_io.mapping import RuledReader
from treetools.checkpoint_io.leaves import Item, Leaf
from treetools.checkpoint_io.items import MODEL_FILES
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_io.source import Source
from treetools.checkpoint_io.steps import parse_step
from treetools.checkpoint_io.writers.orbax import check_orbax, write_orbax
from treetools.checkpoint_io.writers.safetensors import (
    Tensor,
    parse_size,
    plan_layout,
    write_safetensors,
)
from treetools.shared.errors import CheckpointError, UsageError
from treetools.shared.files import NAME_MAX
from treetools.checkpoint_tools.options import ConvertOptions, resolve
from treetools.checkpoint_tools.progress import Progress
from treetools.shared.files import check_writable, existing_folder, free_bytes
from treetools.shared.render import json_object, safe_text
from treetools.shared.rows import human
from treetools.rules.plan import TargetLeaf
from treetools.rules.presets import Preset, preset, preset_spec, split_name
from treetools.rules.spec import Rules

TARGETS = ("safetensors", "orbax")
OTHER_FILES = (".npz", ".npy", ".msgpack", ".eqx", ".h5", ".keras", ".pt", ".pth", ".bin", ".pkl")
"""Suffixes of single-file checkpoints convert does not write (numpy, Flax msgpack, Equinox, Keras, PyTorch,
pickles): a DST ending in one is a mistake, never a folder to write (a Hugging Face folder named ``out.npz``)."""
SCHEMA = 1
"""Version of ``ConvertReport.to_json``."""


@dataclasses.dataclass(frozen=True)
class ConvertRow:
    """One tensor written: where it comes from (``path``, ``path[3]`` for a layer, a stack's range), its name,
    shapes and dtypes before and after the rules, the file holding it, and what the rules do to it."""

    source: str
    name: str
    source_shape: tuple[int, ...]
    shape: tuple[int, ...]
    source_dtype: str
    dtype: str
    file: str
    ops: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np_dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    """What ``convert`` did (or, with ``dry_run``, would do).

    ``rows``: every tensor written; ``dropped``: source leaves the rules left
    out; ``skipped``: ``(path, why)`` of leaves that cannot be written (not
    arrays); ``files``: the files written, relative to ``dst`` for a folder;
    ``problems``: what ``verify`` found (empty when it found nothing, or did
    not run: see ``verified``).
    """

    src: str
    dst: str
    format: str
    step: int | None
    item: str
    to: str
    layout: str
    rows: list[ConvertRow]
    dropped: list[str] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    files: list[str] = dataclasses.field(default_factory=list)
    dry_run: bool = False
    verified: bool | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        """One line: what was written (or, in a dry run, would be), from where, how fast."""
        where = f"{self.src} ({self.format}" + (f", step {self.step}" if self.step is not None else "") + \
            f", item {self.item})"
        what = f"{len(self.rows)} tensors, {human(self.total_bytes, 'B')}"
        if self.dry_run:
            return f"dry run: {where} -> {self.dst} ({self.to}, {self.layout}): {what}; nothing written."
        rate = f" in {self.seconds:.2f} s ({human(self.total_bytes / self.seconds, 'B')}/s)" if self.seconds > 0 else ""
        return f"wrote {self.dst} ({self.to}, {self.layout}): {what} from {where}{rate}."

    def verify_verdict(self) -> str | None:
        """One line: what ``verify`` found; None when it did not run."""
        if self.verified is None:
            return None
        if self.ok:
            return f"verify: ok: {len(self.rows)} tensors read back equal, bit for bit."
        n = len(self.problems)
        return f"verify: FAILED: {n} problem{'s' * (n != 1)}."

    def to_json(self) -> dict[str, Any]:
        return json_object(SCHEMA, {
            "src": self.src, "dst": self.dst, "format": self.format, "step": self.step,
            "item": self.item, "to": self.to, "layout": self.layout, "dry_run": self.dry_run,
            "total_bytes": self.total_bytes, "files": self.files,
            "tensors": [{"source": r.source, "name": r.name, "source_shape": list(r.source_shape),
                         "shape": list(r.shape), "source_dtype": r.source_dtype, "dtype": r.dtype, "file": r.file,
                         "ops": list(r.ops)} for r in self.rows],
            "dropped": self.dropped, "skipped": [{"path": p, "why": w} for p, w in self.skipped],
            "verified": self.verified, "ok": self.ok, "problems": self.problems, "seconds": self.seconds,
        })


# ---------------------------------------------------------------------------------------------- planning


def safetensors_name(path: str) -> str:
    """A target path as a safetensors tensor name: ``/`` becomes ``.`` (the Hugging Face convention).

    >>> safetensors_name("params/Dense_0/kernel"), safetensors_name("model.layers.0.weight")
    ('params.Dense_0.kernel', 'model.layers.0.weight')
    """
    return path.replace("/", ".")


def orbax_parts(path: str) -> tuple[str, ...]:
    """A target path as the keys of a nested tree: split on ``/``, or on ``.`` for a flat name.

    >>> orbax_parts("Dense_0/kernel"), orbax_parts("model.layers.0.weight")
    (('Dense_0', 'kernel'), ('model', 'layers', '0', 'weight'))
    """
    return tuple(path.split("/" if "/" in path or "." not in path else "."))


def _check_places(src: str, dst: str) -> tuple[str, str]:
    """Absolute source and destination, as the OS resolves them (``location``: a ``..`` goes up from where the
    part before it leads); the destination never inside, equal to, or holding the source.

    Compared where they are: the source wherever it leads; the destination
    both as the entry written (its folder resolved: a link there is replaced)
    and wherever it leads (a root ``--dst-step`` writes into), so a link or a
    ``..`` cannot hide that one lies in the other.
    """
    a, b = location(src, name="src"), location(dst, name="dst")
    for at, typed in ((a, src), (b, dst)):
        try:
            backend(at)
        except CheckpointError as e:  # named as typed (`file:///x`, not `file://x`)
            raise as_typed(e, at, os.fspath(typed) if isinstance(typed, (str, os.PathLike)) else str(typed)) from None
    ra = realpath(a)
    above = parent(b)
    written = join(realpath(above), os.path.basename(b)) if above is not None else b
    for rb in {written, realpath(b)}:
        if ra == rb or ra.startswith(rb.rstrip("/") + "/") or rb.startswith(ra.rstrip("/") + "/"):
            raise CheckpointError(
                f"{dst}: the destination is, holds, or lies inside the source {src}; nothing is ever written under "
                "the checkpoint read. Choose a destination beside it."
            )
    return a, b


def _check_names(paths: Any) -> None:
    """Refuse a target name no file can hold: text that is not UTF-8 (a lone surrogate, ``a\\ud800b``, which a
    JSON header may spell), before anything is written.

    >>> _check_names(["a/b", "a\\ud800b"])
    Traceback (most recent call last):
    treetools.shared.errors.CheckpointError: `a\\ud800b`: not UTF-8 text (a lone surrogate), which neither safetensors
    nor Orbax can store; rename it (--rename).
    """
    for path in paths:
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise CheckpointError(f"`{safe_text(path, width=200)}`: not UTF-8 text (a lone surrogate), which neither "
                                  "safetensors nor Orbax can store; rename it (--rename).") from None


def _readable(t: TargetLeaf) -> str | None:
    """Why a target leaf cannot be written (None when it can)."""
    if t.shape is None:
        return "not an array"
    if not isinstance(t.dtype, np.dtype) or not is_numeric(t.dtype):
        return f"dtype {t.dtype} is not a numeric array dtype"
    return None


@dataclasses.dataclass(frozen=True)
class _Plan:
    source: Source
    step: int | None
    item: Item
    targets: list[TargetLeaf]
    readers: list[ArrayReader]
    dropped: list[str]
    skipped: list[tuple[str, str]]
    notes: list[str] = dataclasses.field(default_factory=list)
    """Which path the parameters were taken from (``Source.find_params``), for the report's notes."""


def _plan(src: str, opts: ConvertOptions, context: ReadContext) -> _Plan:
    source = open_source(src, context)
    step = source.resolve(opts.step)
    item, found_at = source.find_params(step, item=opts.item)
    by_name: dict[str, Leaf] = {leaf.name: leaf for leaf in item.leaves}
    rules = opts.rules if opts.rules is not None else Rules()
    plan = rules.plan([(leaf.name, leaf.row.shape, leaf.row.dtype) for leaf in item.leaves])

    sources = {name: leaf.reader for name, leaf in by_name.items() if leaf.reader is not None}

    targets, readers, skipped = [], [], []
    for t in plan:
        why = _readable(t)
        if why is None and any(by_name[p.path].reader is None for p in t.pieces):
            why = "not an array"
        if why is not None:
            skipped.append((t.path, why))
            continue
        targets.append(t)
        readers.append(sources[t.source] if t.identity else RuledReader(t, sources))  # as map_item reads it
    return _Plan(source, step, item, targets, readers, list(plan.dropped), skipped, [found_at] if found_at else [])


# ---------------------------------------------------------------------------------------------- the command


JAX_TARGETS = ("reference", "maxtext")
"""Preset targets that are JAX trees nesting on ``/``: written as Orbax where ``to`` is not given."""


def _preset_name(opts: ConvertOptions) -> str | None:
    """The preset ``opts`` names (``preset``, options left out), or whose rules ``opts.rules`` are; None for none."""
    if opts.preset is not None:
        return split_name(opts.preset)[0]
    return opts.rules.preset if isinstance(opts.rules, Preset) else None


def default_target(dst: str, opts: ConvertOptions) -> str:
    """The format ``convert`` writes where ``to`` is not given: safetensors, but Orbax for a preset whose target
    is the reference model or MaxText (a JAX tree: ``load_parameters(DST)`` returns the nested params the
    model's ``apply`` takes, where a safetensors folder holds them under dotted names), into a local folder
    (Orbax output is not written to a bucket; a ``.safetensors`` destination names its format).

    >>> default_target("ref", ConvertOptions(preset="llama:hf:reference")), default_target("ref", ConvertOptions())
    ('orbax', 'safetensors')
    >>> default_target("ref.safetensors", ConvertOptions(preset="llama:hf:maxtext,scale_query=false"))
    'safetensors'
    """
    name = _preset_name(opts)
    if name is None or name.split(":")[-1] not in JAX_TARGETS or is_url(str(dst)) or \
            str(dst).lower().endswith(".safetensors"):
        return "safetensors"
    return "orbax"


def check_arguments(dst: str, opts: ConvertOptions) -> str:
    """The output format ``convert`` writes, once its arguments are known to work together.

    Raises:
      UsageError: an unknown ``to``; a destination named like a file the format does not write (``.safetensors``
        with ``to="orbax"``, ``out.npz`` with either: ``OTHER_FILES``); ``dst_step`` without ``to="orbax"`` or
        below 0; a ``shard_size`` that is not a size; a ``step`` that is not one step.

    >>> check_arguments("out.safetensors", ConvertOptions(step="all"))
    Traceback (most recent call last):
    ...
    treetools.shared.errors.UsageError: --step all (`step='all'`): convert writes one step; pick one (--step N, or
    latest).
    """
    to = opts.to or default_target(dst, opts)
    name = os.path.basename(os.path.normpath(str(dst)))
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise UsageError(f"{dst}: its last part is {len(name.encode('utf-8', 'surrogateescape')):,} bytes long; a "
                         f"file system names a file in at most {NAME_MAX}: pick a shorter name.")
    if to not in TARGETS:
        raise UsageError(f"--to {opts.to} (`to`): one of {', '.join(TARGETS)}.")
    suffix = os.path.splitext(str(dst))[1]  # "out.npz/" names a folder: no suffix
    if to == "orbax" and suffix.lower() in (".safetensors", *OTHER_FILES):
        raise UsageError(f"--to orbax writes a folder; {dst} names a {suffix} file: name a folder instead.")
    if suffix.lower() in OTHER_FILES:
        raise UsageError(f"{dst} names a {suffix} file, which convert does not write: end it in .safetensors "
                         "(one safetensors file), or name a folder (Hugging Face shards; Orbax with --to orbax).")
    if opts.dst_step is not None and to != "orbax":
        raise UsageError("--dst-step (`dst_step`) writes a step of an Orbax manager root; add --to orbax "
                         "(`to='orbax'`).")
    if opts.dst_step is not None and (isinstance(opts.dst_step, bool) or not isinstance(opts.dst_step, int)
                                      or opts.dst_step < 0):
        raise UsageError(f"--dst-step {opts.dst_step} (`dst_step`): a step is a number >= 0.")
    try:
        parse_size(opts.shard_size)
    except ValueError as e:
        raise UsageError(f"--shard-size: {e}") from None
    if opts.step == "all":
        raise UsageError("--step all (`step='all'`): convert writes one step; pick one (--step N, or latest).")
    try:
        parse_step(opts.step)
    except TypeError as e:
        raise UsageError(f"--step: {e}") from None
    return to


def convert(src: str, dst: str, options: ConvertOptions | None = None, /, **fields: Any) -> ConvertReport:
    """Convert one item of one step of any checkpoint to safetensors or Orbax, streamed and atomic.

    Args:
      src: anything ``treetools inspect`` reads (every format, local, ``gs://`` or ``s3://``).
      dst: ``*.safetensors`` (one file), a folder (Hugging Face shards with their index, or ``to="orbax"``:
        an Orbax checkpoint), local or in a bucket (safetensors).
      options: a ``ConvertOptions``.
      **fields: the same fields as keywords (``step=-1, item=None, rules=None, to=None, shard_size="5GB",
        verify=False, metadata=..., overwrite=..., dry_run=..., memory_budget=..., progress=...``).

    Returns:
      A ``ConvertReport``; with ``verify``, ``.ok`` says whether the destination reads back equal.

    Raises:
      CheckpointError: the destination exists (without ``overwrite``) or is under the source; a dtype the
        destination cannot hold; the errors of reading the source (a stored chunk over the memory budget).
      RulesError: the rules do not fit the checkpoint (every problem, before anything is read).
      UsageError: a ``ValueError``: arguments that cannot work (``check_arguments``), before anything is read.

    >>> import numpy as np, tempfile, os, safetensors.numpy
    >>> d = tempfile.mkdtemp(); np.savez(os.path.join(d, "w.npz"), **{"dense/kernel": np.ones((2, 3), np.float32)})
    >>> report = convert(os.path.join(d, "w.npz"), os.path.join(d, "w.safetensors"), verify=True)
    >>> report.ok, list(safetensors.numpy.load_file(os.path.join(d, "w.safetensors")))
    (True, ['dense.kernel'])
    """
    opts = resolve(ConvertOptions, options, fields)
    to = check_arguments(dst, opts)
    metadata = {str(k): str(v) for k, v in dict(opts.metadata).items()}
    src_loc, dst_loc = _check_places(src, dst)
    rules, model_files, model_notes = _preset(src_loc, dst, opts, to)
    opts = dataclasses.replace(opts, rules=rules)
    context = opts.read_context()
    exists = backend(dst_loc).lexists(dst_loc)  # a dangling symlink is something there too
    if exists and not opts.overwrite and not opts.dry_run and opts.dst_step is None:
        raise CheckpointError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it.")
    if not opts.dry_run and not is_url(dst_loc):  # a read-only place fails now, not after the read (Orbax: minutes)
        check_writable(os.path.join(dst_loc, str(opts.dst_step)) if opts.dst_step is not None else dst_loc)
    plan = _plan(src, opts, context)
    _check_names(t.path for t in plan.targets)
    notes = plan.notes + model_notes + [f"left out `{p}`: {why}" for p, why in plan.skipped]
    if opts.dry_run and exists and opts.dst_step is None:
        notes.append(f"{dst} exists: the write would need --overwrite")
    planned = ConvertReport(str(src), str(dst), plan.source.format, plan.step, plan.item.name, to, "", [],
                            dropped=plan.dropped, skipped=plan.skipped, dry_run=opts.dry_run, notes=notes)
    started = time.perf_counter()
    if to == "safetensors":
        tensors = [Tensor(safetensors_name(t.path), r) for t, r in zip(plan.targets, plan.readers)]
        layout = plan_layout(dst_loc, tensors, shard_size=opts.shard_size)
        file_of = layout.file_of()
        report = dataclasses.replace(
            planned, layout="folder" if layout.folder else "file",
            files=[f.name for f in layout.files] + (["model.safetensors.index.json"] if layout.index else []),
            rows=_rows(plan.targets, [t.name for t in tensors], [file_of[t.name] for t in tensors]))
        if not opts.dry_run:
            _check_space(dst_loc, layout.total_size)
            with _progress(report, opts) as on_block:
                write_safetensors(layout, metadata=metadata, block_bytes=context.block_bytes,
                                  overwrite=opts.overwrite, on_block=on_block, fsync=opts.fsync,
                                  share=context.share)
    else:
        parts = [orbax_parts(t.path) for t in plan.targets]
        report = dataclasses.replace(planned, layout="step" if opts.dst_step is not None else "checkpoint",
                                     rows=_rows(plan.targets, ["/".join(p) for p in parts], [""] * len(parts)))
        check_orbax(list(zip(parts, plan.readers)))
        if not opts.dry_run:
            with _progress(report, opts) as on_block, _full_disk(dst):
                write_orbax(dst_loc, list(zip(parts, plan.readers)), step=opts.dst_step,
                            item=plan.item.name if opts.item is not None else "params", overwrite=opts.overwrite,
                            block_bytes=context.block_bytes, on_block=on_block, share=context.share)
    report = dataclasses.replace(report, files=report.files + list(model_files))
    if opts.dry_run:
        return report
    if context.share is None or context.share.index == 0:  # one writer of the model files in a run of several
        _write_model_files(dst_loc, model_files)
    report = dataclasses.replace(report, seconds=time.perf_counter() - started)
    if opts.verify:
        started = time.perf_counter()
        problems = verify_written(dst_loc, report, plan, opts, context)
        report = dataclasses.replace(report, problems=problems, verified=True,
                                     verify_seconds=time.perf_counter() - started)
    return report


def _preset(src: str, dst: str, opts: ConvertOptions, to: str) -> tuple[Any, dict[str, bytes], list[str]]:
    """The rules to apply (a preset's, filled with the model's sizes, then ``opts.rules``), the model files to
    write beside the weights (``config.json``, ``generation_config.json``), and notes; checked before any read.

    The model files are ``opts.config``'s (a dict, a ``config.json``, or its folder) or the source's (in the
    source folder, beside a source file, or in the root above a step folder). A preset whose target is ``hf``
    needs a ``config.json`` (transformers' ``from_pretrained`` reads it); the others carry it over when there is
    one, so that the way back finds it beside its source.

    Raises:
      UsageError: an unknown preset; a conversion to ``hf`` with no ``config.json``; a ``config.json`` of
        another family than the preset's, or that does not parse.
    """
    rules = opts.rules
    if opts.preset is not None:
        preset_spec(opts.preset)  # an unknown name: a usage error listing the presets, before anything is read
    name = _preset_name(opts)
    if name is None:
        if opts.config is not None:
            raise UsageError("--config (`config`) gives a preset its model's config.json; add --preset "
                             "FAMILY:SOURCE:TARGET (`preset=`), or drop it.")
        return rules, {}, []
    files = _model_files(src, opts.config)
    config = json.loads(files["config.json"]) if "config.json" in files else None
    family, _, target = name.split(":")
    if config is not None and config.get("model_type") not in (None, family):
        raise UsageError(f"--preset {name}: the config.json {_config_where(src, opts.config)} is of model_type "
                         f"{config.get('model_type')!r}, not {family!r}; pick the preset of that family, or pass "
                         "this model's config (--config).")
    if target == "hf" and config is None:
        raise UsageError(f"--preset {name} writes a Hugging Face folder, which needs its config.json: {src} has "
                         "none beside it; pass the model's config.json (--config FILE, config=...; for the "
                         "reference model, ModelConfig.to_hf() gives it).")
    if opts.preset is not None:
        built: Rules = preset(opts.preset, config=config)  # with the options it names
        rules = built if rules is None else built.merge(rules)
    elif config is not None and not rules.sizes:  # the config's sizes, keeping any rules merged after the preset
        fresh = preset(name, config=config, **dict(rules.options))
        rules = fresh if not Rules.to_dict(rules) else dataclasses.replace(rules, sizes=fresh.sizes)
    notes = []
    folder = to == "orbax" or not str(dst).lower().endswith(".safetensors")
    if files and not folder:
        notes.append(f"{', '.join(files)} not written: {dst} is one .safetensors file; name a folder to get a "
                     "model folder transformers loads")
        files = {}
    return rules, files, notes


def _config_where(src: str, config: Any) -> str:
    return "given" if isinstance(config, Mapping) else str(config) if config is not None else f"beside {src}"


def _model_files(src: str, config: Any) -> dict[str, bytes]:
    """``config.json`` and ``generation_config.json`` as bytes: ``config``'s (a dict, a file, its folder), or the
    source's; empty when there is none."""
    if hasattr(config, "to_json_string") and not isinstance(config, (str, os.PathLike)):
        return {"config.json": config.to_json_string().encode("utf-8")}  # a transformers PretrainedConfig
    if isinstance(config, Mapping):
        return {"config.json": (json.dumps(dict(config), indent=2) + "\n").encode("utf-8")}
    if config is not None:
        path = os.path.expanduser(os.fspath(config))
        folders = [path] if os.path.isdir(path) else [os.path.dirname(path) or "."]
        first = path if not os.path.isdir(path) else os.path.join(path, "config.json")
        if not os.path.isfile(first):
            raise UsageError(f"--config {config}: no such file (pass a config.json, or the folder holding it).")
    else:
        parent = _parent(src)
        if backend(src).isdir(src):
            up = os.path.basename(src.rstrip("/")).isdigit() and parent is not None  # a step folder: its root
            folders = [src] + ([parent] if up and parent is not None else [])
        else:
            folders = [parent] if parent is not None else []
        first = None
    for folder in folders:
        store = backend(folder)
        names = {name: _join(folder, name) for name in MODEL_FILES}
        if first is not None:
            names["config.json"] = first
        if not store.isfile(names["config.json"]):
            continue
        out = {}
        for name, path in names.items():
            if store.isfile(path):
                with store.open(path) as f:
                    out[name] = f.read()
        try:
            json.loads(out["config.json"])
        except ValueError as e:
            raise UsageError(f"{names['config.json']}: not JSON ({e}); pass a readable config.json "
                             "(--config).") from None
        return out
    return {}


def _parent(path: str) -> str | None:
    """The folder holding ``path`` (a local path or a bucket URL); None at a bucket's top."""
    if not is_url(path):
        return os.path.dirname(os.path.normpath(path))
    scheme, _, rest = path.rstrip("/").partition("://")
    return f"{scheme}://{rest.rsplit('/', 1)[0]}" if "/" in rest else None


def _join(folder: str, name: str) -> str:
    return folder.rstrip("/") + "/" + name if is_url(folder) else os.path.join(folder, name)


def _write_model_files(dst: str, files: Mapping[str, bytes]) -> None:
    """The model files into the folder just written (after the weights: transformers reads them together)."""
    if not files:
        return
    store = backend(dst)
    for name, data in files.items():
        with store.create(_join(dst, name)) as out:
            out.write(data)


def _check_space(dst: str, nbytes: int) -> None:
    """Refuse a local safetensors write its file system has no room for (its size is known exactly), before any
    byte is written."""
    if is_url(dst):
        return
    folder = existing_folder(dst)
    free = free_bytes(folder)
    if free is not None and free < nbytes:
        raise OSError(errno.ENOSPC, f"no room: the output takes {human(nbytes, 'B')}, {human(free, 'B')} free", folder)


@contextlib.contextmanager
def _full_disk(dst: str) -> Iterator[None]:
    """Orbax's own error for a full disk (a ``ValueError`` from TensorStore, ``RESOURCE_EXHAUSTED ... No space
    left on device``) as the ``OSError`` every other write gives, naming ``dst``; Orbax has removed what it wrote.
    The traceback Orbax's writing thread logs for the same error is left out (the one line says it)."""
    absl = logging.getLogger("absl")
    quiet = _DropWriteErrors()
    absl.addFilter(quiet)
    try:
        yield
    except ValueError as e:
        text = str(e)
        for code, words in zip((errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES), _WRITE_FAILURES):
            if words in text:
                raise OSError(code, os.strerror(code), str(dst)) from None
        raise
    finally:
        absl.removeFilter(quiet)


_WRITE_FAILURES = ("No space left", "quota exceeded", "Read-only file system", "Permission denied")


class _DropWriteErrors(logging.Filter):
    """Drops a log record about a write the place refused (reported once, as one line, by ``_full_disk``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        texts, error = [record.getMessage()], record.exc_info[1] if record.exc_info else None
        while error is not None and len(texts) < 20:  # the error and what it was raised from
            texts.append(str(error))
            error = error.__cause__ or error.__context__
        return not any(words in text for text in texts for words in _WRITE_FAILURES)


def _rows(targets: Sequence[TargetLeaf], names: Sequence[str], files: Sequence[str]) -> list[ConvertRow]:
    out = []
    for t, name, file in zip(targets, names, files):
        r = t.row()
        renamed = not t.stacked and t.layer is None and t.path != t.source  # a rename rule's work, shown as an op
        out.append(ConvertRow(r.source, name, tuple(r.source_shape or ()), tuple(t.shape or ()),
                              str(r.source_dtype), str(r.dtype), file, ("rename",) * renamed + tuple(r.ops)))
    return out


class _progress:
    """A progress bar over the bytes written, advanced per block (drawn when stderr is a terminal)."""

    def __init__(self, report: ConvertReport, opts: ConvertOptions):
        self.bar = Progress(report.total_bytes, enabled=opts.progress)
        self.name = ""

    def __enter__(self) -> Any:
        def on_block(name: str, nbytes: int) -> None:
            if name != self.name:
                self.name = name
                self.bar.start(name)
            self.bar.advance(nbytes)

        return on_block

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()


# ---------------------------------------------------------------------------------------------- verify


def verify_written(dst: str, report: ConvertReport, plan: _Plan, opts: ConvertOptions,
                   context: ReadContext) -> list[str]:
    """Read ``dst`` back through treetools' readers and compare every tensor with the source after the rules.

    Bit for bit: the source's bytes, or for a cast leaf the bytes of the same
    cast; NaNs compare by their bits. Returns every problem, one sentence each.
    """
    problems: list[str] = []
    written = open_source(dst, context.replace(prefix=None))
    if report.to == "orbax" and opts.dst_step is not None:
        snap = written.snapshot(opts.dst_step)
    else:
        snap = written.snapshot()
    leaves = {leaf.name: leaf for item in snap.items.values() for leaf in item.leaves}
    expected = {row.name: reader for row, reader in zip(report.rows, plan.readers)}
    for name in sorted(set(leaves) - set(expected)):
        problems.append(f"`{name}`: in {report.dst} but not among the tensors converted.")
    jobs: list[tuple[ArrayReader, ArrayReader]] = []
    names: list[str] = []
    for name, reader in expected.items():
        leaf = leaves.get(name)
        if leaf is None or leaf.reader is None:
            problems.append(f"`{name}`: missing from {report.dst}.")
            continue
        got = leaf.reader
        # (a byte order is no difference: safetensors is little-endian, a big-endian npz source is written so)
        if tuple(got.shape) != tuple(reader.shape) or \
                np.dtype(got.dtype).newbyteorder("=") != np.dtype(reader.dtype).newbyteorder("="):
            problems.append(f"`{name}`: {report.dst} holds {np.dtype(got.dtype).name}{list(got.shape)}, "
                            f"expected {np.dtype(reader.dtype).name}{list(reader.shape)}.")
            continue
        jobs.append((got, reader))
        names.append(name)
    # The block engine, as ``verify`` and ``diff --values`` read: both sides of each tensor in one block plan.
    bar = Progress(sum(r.dtype.itemsize * math.prod(r.shape) for job in jobs for r in job), enabled=opts.progress)
    try:
        # Half blocks: each of the engine's threads holds both sides of one, so verify's blocks in flight take
        # about what the write's read-ahead took, and the peak stays that of the write.
        parts = reduce_blocks(jobs, lambda j: _BitDiff(), _fold_bits, block_bytes=max(1, context.block_bytes // 2),
                              progress=bar, labels=names, errors=(CheckpointError, OSError, ValueError))
    finally:
        bar.close()
    for name, (got, _), part in zip(names, jobs, parts):
        if isinstance(part, Failed):
            problems.append(f"`{name}`: cannot be read back from {report.dst} ({part.error}).")
            continue
        problem = _BitDiff.merged(part).problem(name, tuple(got.shape))
        if problem:
            problems.append(problem)
    return problems


@dataclasses.dataclass
class _BitDiff:
    """Elements of one tensor whose bytes differ, and the first of them in C order (an index tuple)."""

    differ: int = 0
    first: tuple[int, ...] | None = None

    @staticmethod
    def merged(parts: list[_BitDiff]) -> _BitDiff:
        """The parts of one tensor as one."""
        firsts = [p.first for p in parts if p.first is not None]
        return _BitDiff(sum(p.differ for p in parts), min(firsts) if firsts else None)

    def problem(self, name: str, shape: tuple[int, ...]) -> str | None:
        """One sentence when some element differs, else None."""
        if not self.differ:
            return None
        return (f"`{name}`: {self.differ:,} of {math.prod(shape):,} elements differ from the source "
                f"(first at {self.first}).")


def _fold_bits(acc: _BitDiff, index: Any, blocks: tuple[np.ndarray, ...]) -> None:
    """Compare one block of the written tensor with the same block of the source after the rules, bit for bit
    (NaNs by their bits; a cast leaf against the bytes of the same cast)."""
    got, want = blocks
    dtype = np.dtype(got.dtype)
    bad = bits_differ(np.asarray(got), np.asarray(want).astype(dtype, copy=False).reshape(got.shape))
    n = int(np.count_nonzero(bad))
    if not n:
        return
    acc.differ += n
    # A block is a box of the tensor, so its own C order is the tensor's: its first bad element, offset by the
    # box's corner, is the first in the tensor among the box's elements; the earliest box wins in ``merged``.
    within = np.unravel_index(int(np.argmax(bad)), got.shape) if got.ndim else ()
    corner = tuple(s.start or 0 for s in index) if index is not None else (0,) * got.ndim
    first = tuple(int(c + w) for c, w in zip(corner, within))
    acc.first = first if acc.first is None else min(acc.first, first)
