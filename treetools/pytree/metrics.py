"""Metrics files: written by ``JsonlWriter`` / ``MetricsLogger``, read by ``read_metrics``.

A metrics file (``metrics.jsonl``) holds one JSON object per line,
``{"step": 20, "loss": 2.31, "grad_norm": 0.84, ...}``, strict JSON: a
non-finite value is written as ``null`` and its kind recorded under the
reserved key ``nonfinite`` (``{"loss": null, "nonfinite": {"loss": "nan"}}``,
``treetools.shared.records``); ``read_metrics`` gives it back as a float NaN
or Inf (and still reads the bare ``NaN`` of files written before). This module
is the only place that writes or reads the format (``treetools plot`` reads
through ``read_metrics``).

Writers (``MetricsLogger(writer)``): a path (``JsonlWriter``), a
``TensorBoardWriter(logdir)`` (event files, with the ``tensorboard`` extra:
``pip install 'jax-treetools[tensorboard]'``), a ``WandbWriter(project)`` (a
W&B run, with the ``wandb`` extra), any callable ``(step, {name: number})``
(``lambda step, m: run.log(m, step=step)`` for a W&B run of your own), or a
list of them. A metric that is an array of more than one element is logged as one
number per element, ``name/0``, ``name/1``, ... (``name/i/j`` for 2-D): every
writer takes numbers, and ``treetools plot --heatmap 'name/(\\d+)$'`` draws them.

Starting afresh or continuing (the ``resume_step`` rule):

* ``JsonlWriter(path)`` / ``MetricsLogger(path)`` start a **fresh** file: one
  left by an earlier run at that path is emptied when the writer is made, so
  two runs never interleave in one file.
* ``JsonlWriter(path, resume_step=N)`` / ``MetricsLogger(path, resume_step=N)``
  **continue** a run resumed from its checkpoint at step ``N``: the records up
  to and including step ``N`` are kept, and those after it (logged after that
  checkpoint by the run that stopped, and about to be logged again) are
  dropped; the file is rewritten atomically. The steps in the file then read
  exactly as those of a run that never stopped. ``resume_step=None`` means a
  fresh run. The reference trainer passes the step it restored, or None.

Only jax's process 0 writes in a multi-process run (unless ``all_processes``).
jax is imported only when metrics are written, so reading costs no jax import.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
>>> log = MetricsLogger(path, every=10)
>>> for step in range(1, 31):
...     _ = log(step, {"loss": 1.0 / step})
>>> [r["step"] for r in read_metrics(path)]
[10, 20, 30]
>>> # The run stopped after logging step 30 but its last checkpoint was step 20:
>>> log = MetricsLogger(path, every=10, resume_step=20)
>>> [r["step"] for r in read_metrics(path)]
[10, 20]
"""

from __future__ import annotations

import json
import operator
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from treetools.shared.files import open_append, replace_file
from treetools.shared.install import install_hint
from treetools.shared.records import NONFINITE, decode_record, encode_record


METRICS_FILE = "metrics.jsonl"
_NOT_METRICS = "is it a metrics.jsonl written by MetricsLogger / `treetools train`?"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _writes(all_processes: bool) -> bool:
    """Whether this process writes: process 0 only, unless ``all_processes``."""
    if all_processes:
        return True
    import jax

    return jax.process_index() == 0


MAX_ELEMENTS = 1024
"""A metric with more elements than this is refused (log a reduction of it): each element becomes a key."""


def _start_transfer(metrics: Mapping[str, Any]) -> None:
    """Start copying every device array of ``metrics`` to the host, without waiting (where jax allows it)."""
    for value in metrics.values():
        copy = getattr(value, "copy_to_host_async", None)
        if copy is not None:
            try:
                copy()
            except Exception:  # an array that cannot start early is fetched by device_get below
                pass


def _to_host(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """Device scalars -> Python ``int`` (integer and bool dtypes) or ``float``, in one ``jax.device_get``.

    An array of several elements gives one key per element (``name/0``, ...;
    ``name/i/j`` for 2-D), in C order.

    Raises:
      TypeError: a value is not a number or a numeric array (names its key).
      ValueError: an array has more than ``MAX_ELEMENTS`` elements, or a
        metric is named ``nonfinite`` (reserved by the file format).
    """
    import jax
    import numpy as np

    if NONFINITE in metrics:
        raise ValueError(f"metric name `{NONFINITE}` is reserved (the file records which values are NaN/Inf there); "
                         "rename that metric.")
    host = jax.device_get(dict(metrics))
    out: dict[str, float | int] = {}
    for key, value in host.items():
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise TypeError(f"metric `{key}` is a {type(value).__name__} of dtype {array.dtype}, not a number; log "
                            "numbers or numeric arrays (strings and objects go to your own writer).")
        if array.size > MAX_ELEMENTS:
            raise ValueError(f"metric `{key}` has {array.size} elements (shape {array.shape}), more than "
                             f"{MAX_ELEMENTS} keys to write; log a reduction of it (a norm, a max) instead.")
        cast = int if array.dtype.kind in "biu" else float
        if array.ndim == 0:
            out[key] = cast(array)
            continue
        for index in np.ndindex(array.shape):
            out["/".join([key, *map(str, index)])] = cast(array[index])
    return out


def _parse(path: str, data: bytes) -> list[tuple[int, bytes, dict]]:
    """``(line number, raw line, record)`` per non-blank line of a metrics file.

    An unterminated last line that is not JSON is skipped: a write in
    progress (a run being watched) or cut short (a run that was killed).
    """
    if data.startswith(b"PK\x03\x04"):
        raise ValueError(f"{path}: a zip archive (.npz?), not a metrics JSONL file; {_NOT_METRICS}")
    if b"\x00" in data:
        raise ValueError(f"{path}: binary data, not a metrics JSONL file; {_NOT_METRICS}")
    lines = data.split(b"\n")
    out = []
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}:{lineno}: not UTF-8 text, so not a metrics JSONL file; {_NOT_METRICS}") from None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            if lineno == len(lines):  # no newline after it: still being written, or cut short
                continue
            raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg}); {_NOT_METRICS}") from None
        except RecursionError:  # json parses nesting by recursion: [[[[...]]]] 100,000 deep
            raise ValueError(f"{path}:{lineno}: a JSON line nested too deeply to be a metrics record; "
                             f"{_NOT_METRICS}") from None
        if not isinstance(record, dict) or not _is_number(record.get("step")):
            raise ValueError(f"{path}:{lineno}: not a metrics record (a JSON object with a numeric `step`); "
                             f"{_NOT_METRICS}")
        out.append((lineno, raw, record))
    return out


def read_metrics(path: str | os.PathLike, *, drop_superseded: bool = True) -> list[dict]:
    """The records of a metrics file, one dict per logged step.

    Args:
      path: a ``metrics.jsonl``, or a folder holding one (a ``treetools train``
        WORKDIR).
      drop_superseded: a file that an older treetools (or another writer)
        appended to across reruns has its steps going back where a rerun
        started; keep only the latest run's records, as TensorBoard does: a
        record at step ``s`` drops the earlier records at steps ``>= s``
        (records at the same step are merged, the later values winning). The
        result is ordered by strictly increasing step. ``False``: every record
        in file order.

    Returns:
      A list of dicts, each with a numeric ``step``.

    Raises:
      FileNotFoundError: no such file (or no ``metrics.jsonl`` in the folder).
      ValueError: not a metrics file (binary, not JSON lines, a record without
        ``step``) or no records; the message names the file and line.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> _ = open(os.path.join(folder, "metrics.jsonl"), "w").write(
    ...     '{"step": 1, "loss": 3.0}\\n{"step": 2, "loss": 2.0}\\n'
    ...     '{"step": 2, "loss": 2.5}\\n{"step": 3, "loss": 1.5}\\n')
    >>> [(r["step"], r["loss"]) for r in read_metrics(folder)]
    [(1, 3.0), (2, 2.5), (3, 1.5)]
    """
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, METRICS_FILE)):
            raise FileNotFoundError(f"{path}: folder has no {METRICS_FILE}; pass the metrics file itself, or the "
                                    f"--workdir of `treetools train`.")
        path = os.path.join(path, METRICS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such metrics file; `treetools train --workdir DIR` writes "
                                f"DIR/{METRICS_FILE}.")
    if not os.path.isfile(path):  # a FIFO would block the open for ever: never opened
        raise ValueError(f"{path}: not a regular file, so not a metrics file.")
    with open(path, "rb") as f:
        records = [decode_record(record) for _, _, record in _parse(path, f.read())]
    if not records:
        raise ValueError(f"{path}: no records; {_NOT_METRICS}")
    if not drop_superseded:
        return records
    kept: list[dict] = []
    for record in records:
        while kept and kept[-1]["step"] > record["step"]:
            kept.pop()
        if kept and kept[-1]["step"] == record["step"]:
            kept[-1] = {**kept[-1], **record}
        else:
            kept.append(record)
    return kept


def _keep_until(path: str, resume_step: int) -> None:
    """Rewrite ``path`` (atomically) with only its records at steps ``<= resume_step``."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        data = f.read()
    try:
        entries = _parse(path, data)
    except ValueError as e:
        raise ValueError(f"{e} Cannot resume it from step {resume_step}: move it away, or log to a fresh file "
                         "(resume_step=None).") from None
    if all(record["step"] <= resume_step for _, _, record in entries) and (not data or data.endswith(b"\n")):
        return  # nothing to drop, and the next line will start on a line of its own
    kept = b"".join(raw + b"\n" for _, raw, record in entries if record["step"] <= resume_step)
    replace_file(path, kept)


class JsonlWriter:
    """Write one JSON line per call, ``{"step": step, **metrics}``, to a metrics file.

    Made with ``resume_step=None`` it starts the file afresh (an earlier run's
    file is emptied); with ``resume_step=N`` it continues the file of a run
    resumed from step ``N`` (records after ``N`` dropped); see the module doc.
    Each call appends and closes the file, so it can be read (plotted) while
    the run goes on.

    Args:
      path: the file; its folder is created if needed.
      resume_step: the step the run resumed from, or None for a fresh run.
      all_processes: write from every jax process (default: process 0 only).

    Raises:
      ValueError: ``resume_step`` is negative, or the file to resume is not a
        metrics file.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.jsonl")
    >>> JsonlWriter(path)(10, {"grad_norm": 1.5})
    >>> open(path).read()
    '{"step": 10, "grad_norm": 1.5}\\n'
    """

    def __init__(self, path: str | os.PathLike, *, resume_step: int | None = None, all_processes: bool = False):
        if resume_step is not None:
            resume_step = operator.index(resume_step)
            if resume_step < 0:
                raise ValueError(f"`resume_step` must be a step >= 0 (or None for a fresh run), got {resume_step}.")
        self.path = os.path.expanduser(os.fspath(path))
        self.resume_step = resume_step
        self.all_processes = all_processes
        if not _writes(all_processes):
            return
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        if os.path.islink(self.path) and resume_step is not None:  # never read nor written through a link
            raise ValueError(f"{self.path} is a symbolic link; treetools never writes a metrics file through a link "
                             "(remove it, or log to another file).")
        if resume_step is None:
            replace_file(self.path, b"")  # a link planted at the name is replaced, not written through
        else:
            _keep_until(self.path, resume_step)

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        if not _writes(self.all_processes):
            return
        with open_append(self.path) as f:  # O_NOFOLLOW: a link planted since is refused, not appended through
            f.write(json.dumps(encode_record({"step": int(step), **metrics}), allow_nan=False) + "\n")


class TensorBoardWriter:
    """Write each metric as a TensorBoard scalar (``tag = name``) to event files in ``logdir``.

    Through ``tensorboardX`` (the ``tensorboard`` extra: ``pip install
    'jax-treetools[tensorboard]'``); TensorBoard reads the folder (``tensorboard
    --logdir``). Resuming from step ``N`` (``resume_step=N``) marks the events
    after ``N`` as superseded (TensorBoard's ``purge_step``), so a resumed run
    reads as one straight run there too. Only jax's process 0 writes unless
    ``all_processes``.

    Args:
      logdir: the folder for the event files (created if needed).
      resume_step: the step the run resumed from, or None for a fresh run.
      all_processes: write from every jax process.

    Raises:
      ImportError: tensorboardX is not installed (the message says how to install it).

    >>> import tempfile
    >>> writer = TensorBoardWriter(tempfile.mkdtemp())
    >>> writer(10, {"loss": 2.5, "grad_norm/layers/0": 0.1}); writer.close()
    """

    def __init__(self, logdir: str | os.PathLike, *, resume_step: int | None = None, all_processes: bool = False):
        self.logdir = os.path.expanduser(os.fspath(logdir))
        self.all_processes = all_processes
        self._writer = None
        if not _writes(all_processes):
            return
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError(f"TensorBoardWriter needs tensorboardX; install it: "
                              f"{install_hint('tensorboard')}") from None
        purge = None if resume_step is None else operator.index(resume_step) + 1
        # tensorboardX names its file by the second and the host: a writer made in the same second (a quick
        # restart) would truncate the earlier file. A process- and time-unique suffix keeps both.
        suffix = f".{os.getpid()}.{time.time_ns()}"
        self._writer = SummaryWriter(self.logdir, purge_step=purge, flush_secs=30, filename_suffix=suffix)

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, int(step))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbWriter:
    """Log each metric to a Weights & Biases run: ``run.log(metrics, step=step)``.

    Through ``wandb`` (the ``wandb`` extra: ``pip install 'jax-treetools[wandb]'``). The run is started here
    (``wandb.init(project=..., dir=...)``) and finished by ``close()``; W&B's own settings apply, so
    ``WANDB_MODE=offline`` writes the run under ``dir/wandb/offline-run-*`` without any network (``wandb
    sync`` uploads it later). A resumed trainer run is a new W&B run starting at the step after
    ``resume_step`` (recorded in the run's config). Only jax's process 0 logs unless ``all_processes``.

    Args:
      project: the W&B project.
      dir: the folder W&B writes its ``wandb/`` files in (created if needed; None: W&B's default, the current folder).
      config: the run's config (hyperparameters), shown by W&B.
      resume_step: the step the run resumed from, or None for a fresh run.
      all_processes: log from every jax process.

    Raises:
      ImportError: wandb is not installed (the message says how to install it).
    """

    def __init__(self, project: str, *, dir: str | os.PathLike | None = None, config: Mapping[str, Any] | None = None,
                 resume_step: int | None = None, all_processes: bool = False):
        self.project = project
        self.all_processes = all_processes
        self.run = None
        if not _writes(all_processes):
            return
        try:
            import wandb
        except ImportError:
            raise ImportError(f"WandbWriter needs wandb; install it: {install_hint('wandb')}") from None
        config = dict(config or {})
        if resume_step is not None:
            config["resume_step"] = operator.index(resume_step)
        if dir is not None:
            dir = os.path.expanduser(os.fspath(dir))
            os.makedirs(dir, exist_ok=True)
        self.run = wandb.init(project=project, dir=dir, config=config, reinit="create_new")

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


Writer = Callable[[int, dict[str, float]], Any]
"""``writer(step, {name: number})``: what ``MetricsLogger`` hands each logged step to."""


def _writer(writer: Writer | str | os.PathLike, resume_step: int | None) -> Writer:
    if isinstance(writer, (str, os.PathLike)):
        return JsonlWriter(writer, resume_step=resume_step)
    if not callable(writer):
        raise TypeError(f"`writer` must be a callable (step, metrics), a path, or a list of those; got "
                        f"{type(writer).__name__}.")
    if resume_step is not None:
        raise ValueError("`resume_step` applies to a path `writer`; for a callable, pass it to the writer "
                         "(e.g. JsonlWriter(path, resume_step=...), TensorBoardWriter(logdir, resume_step=...)).")
    return writer


class MetricsLogger:
    """Every ``every`` steps, turn a metric dict into host numbers and hand it to the writers.

    On other steps the arrays are not touched, so no host sync happens and the
    device keeps running ahead. A due step's dict comes to the host in one
    ``jax.device_get``. With ``asynchronous=True`` that transfer is started
    (``copy_to_host_async``) and the dict is written at the next call (or at
    ``flush()``/``close()``, or leaving a ``with`` block), by which time the
    device has long finished it and the next step is already queued: logging
    every step does not make the host wait for each step. Writes are then one
    call late; the order and the values are the same.

    A writer is any callable ``writer(step, {name: number})``; a path means a
    ``JsonlWriter`` on it, started afresh, or continued after ``resume_step``
    (see the module doc); a list gives each logged dict to every writer.
    Arrays of several elements are logged one number per element
    (``name/0``, ``name/1``, ...; see the module doc).

    Args:
      writer: callable ``(step, metrics) -> None``, a path for a JSONL file,
        or a list of those (``[path, TensorBoardWriter(logdir), wandb_fn]``).
      every: log when ``step % every == 0``.
      resume_step: with a path: the step the run resumed from (None: a fresh
        run). A callable writer handles its own file: pass it there.
      asynchronous: start the transfer and write at the next call (see above).

    Raises:
      TypeError: ``writer`` is neither a callable nor a path; at a logged
        step, a metric that is not numeric (named).
      ValueError: ``every`` is not a positive int, or ``resume_step`` was given
        with a callable writer; at a logged step, a metric named ``nonfinite``
        or with more than ``MAX_ELEMENTS`` elements (named).

    >>> import jax.numpy as jnp
    >>> seen = []
    >>> log = MetricsLogger(lambda step, m: seen.append((step, m)), every=2)
    >>> [log(step, {"grad_norm": jnp.float32(step)}) for step in range(1, 5)]
    [False, True, False, True]
    >>> seen
    [(2, {'grad_norm': 2.0}), (4, {'grad_norm': 4.0})]
    >>> log(6, {"per_layer": jnp.array([0.5, 0.25])}); seen[-1]     # a vector: one key per element
    True
    (6, {'per_layer/0': 0.5, 'per_layer/1': 0.25})
    """

    def __init__(
        self,
        writer: Writer | str | os.PathLike | Sequence[Writer | str | os.PathLike],
        *,
        every: int = 1,
        resume_step: int | None = None,
        asynchronous: bool = False,
    ):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"`every` must be a positive int, got {every!r}.")
        given = list(writer) if isinstance(writer, Sequence) and not isinstance(writer, (str, bytes)) else [writer]
        self.writers = [_writer(w, resume_step) for w in given]
        self.writer = self.writers[0] if len(self.writers) == 1 else self._write_all
        self.every = every
        self.asynchronous = asynchronous
        self._pending: tuple[int, dict[str, Any]] | None = None

    def _write_all(self, step: int, host: dict[str, float | int]) -> None:
        for writer in self.writers:
            writer(step, host)

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Log ``metrics`` if ``step`` is due; returns whether it was.

        ``step`` should be the host loop counter (a Python int): a device
        array step would itself need a sync to test.
        """
        step = operator.index(step)
        self.flush()
        if step % self.every:
            return False
        if self.asynchronous:
            _start_transfer(metrics)
            self._pending = (step, dict(metrics))
        else:
            self.writer(step, _to_host(metrics))
        return True

    def flush(self) -> None:
        """Write the dict whose transfer ``asynchronous=True`` started, if any."""
        if self._pending is not None:
            step, metrics = self._pending
            self._pending = None
            self.writer(step, _to_host(metrics))

    def close(self) -> None:
        """Flush, then close the writers that can be closed (``TensorBoardWriter``)."""
        self.flush()
        for writer in self.writers:
            close = getattr(writer, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
