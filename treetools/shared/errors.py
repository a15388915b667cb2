"""The exceptions treetools users catch. docs/errors.md is the one list of every exception a user can meet (its
base, when it is raised, the ``treetools`` program's exit code for it); each is exported from ``treetools``.

Every one derives from ``TreetoolsError`` (``except tt.TreetoolsError`` catches them all) and keeps its
standard base: all but ``CheckpointNotFoundError`` (a ``FileNotFoundError``) are ``ValueError`` subclasses,
so code written against the older ``except ValueError`` keeps working. The errors with several problems
(``RulesError``, ``CheckpointMismatchError``) also carry ``problems``, ``header`` (the first line of the
message) and ``hint`` (the fix common to them all, or None), so a caller can show the first few problems and
a count (the CLI does) without parsing the message. Importing this module imports nothing heavy (no jax, no
numpy). The errors of the storage and format layers are defined beside their code, under ``CheckpointError``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence


class TreetoolsError(Exception):
    """The base of every exception treetools raises for its user: ``except tt.TreetoolsError`` catches any of
    them, and nothing else (a bug keeps its own type). Each subclass keeps its standard base too
    (``ValueError``, ``FileNotFoundError``, ``PermissionError``); docs/errors.md lists them with the exit code
    the ``treetools`` program gives each.

    >>> issubclass(CheckpointError, TreetoolsError), issubclass(CheckpointNotFoundError, FileNotFoundError)
    (True, True)
    """


class CheckpointError(TreetoolsError, ValueError):
    """A known problem with a checkpoint: missing, not a checkpoint, corrupt, unreadable, unknown step.

    The message is one line naming the path and, where there is one, the fix.

    >>> str(CheckpointError("runs/x: no such file or folder."))
    'runs/x: no such file or folder.'
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class NotACheckpointError(CheckpointError):
    """A path that is there but that no format reads (a folder of other things, a repository root): the message
    names the checkpoints nearby where there are some ("did you mean runs/demo/checkpoints (orbax)?").

    Not damage: ``verify`` reports it as the one error line of a PATH it cannot read, never as a failed check.
    """


class CheckpointNotFoundError(TreetoolsError, FileNotFoundError):
    """The path, step or item asked for does not exist; the message lists what does.

    >>> isinstance(CheckpointNotFoundError("runs/x: no step 5; committed steps: 100, 200."), FileNotFoundError)
    True
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class StepDeletedError(CheckpointNotFoundError):
    """A step folder vanished between listing the steps and reading it (a manager pruning old steps).

    Reading again sees the steps present now; ``treetools inspect`` does so
    once by itself when the step was the latest.
    """


class UsageError(TreetoolsError, ValueError):
    """An argument that cannot work as given: a value out of its range, or options that contradict each other.

    Checked once, where the argument is taken (the library, or the CLI for an
    option the library does not have), before anything is read; the message is
    one line naming the argument and the fix. The CLI exits 2 on it.

    >>> isinstance(UsageError("`to='orbax'` writes a folder; out.safetensors names a file."), ValueError)
    True
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class OutputError(TreetoolsError):
    """stdout cannot be written (a full disk, an I/O error): the ``treetools`` program stops with this one line
    (exit 1; diff 2). A reader that leaves early (``| head``) is no error."""


class PatternError(TreetoolsError, ValueError):
    """A path pattern that is not a valid regex, or that matches no leaf.

    >>> isinstance(PatternError("`exclude` pattern 'bias$' matches no leaf"), ValueError)
    True
    """


class RulesError(PatternError):
    """``tt.Rules`` that do not fit the leaves they are applied to; ``problems`` has one line each.

    Raised while planning (``Rules.plan``, ``convert``, ``diff``, ``inspect
    --unstack``, ``load_parameters`` without a target), before any array data
    is read. A restore reports the same lines as problems of its plan
    (``Mismatch`` of kind ``"rules"``) in one ``CheckpointMismatchError``. A
    single problem is the whole message; several are listed one per line
    under a header.

    >>> e = RulesError(["`drop` pattern 'opt' matches no leaf; nearby paths: ['params/w']."])
    >>> isinstance(e, PatternError), str(e).startswith("`drop` pattern")
    (True, True)
    """

    hint: str | None = None
    """No fix common to every problem: each problem line names its own."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        self.header = f"the rules do not fit the leaves ({len(self.problems)} problems):"
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  {p}" for p in self.problems)
            message = f"{self.header}\n{lines}"
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One leaf where a restore target and the checkpoint disagree.

    ``kind`` is ``"missing"`` (the target has it, the checkpoint does not),
    ``"unexpected"`` (the checkpoint has it, the target does not), ``"shape"``
    or ``"dtype"``; ``path`` is the leaf's path in ``items`` (``params/layers/3/w``).
    A ``found`` that starts with ``fill_missing`` is the value ``fill_missing``
    offered for a leaf the checkpoint lacks. ``"rules"``: the item's ``Rules``
    do not fit the checkpoint; ``path`` is the item and ``found`` the rules'
    line (``RulesError``'s) naming the rule, the leaf and the fix.

    >>> str(Mismatch("params", "rules", "rules that fit the checkpoint", "`drop` pattern 'x' matches no leaf"))
    "params: `drop` pattern 'x' matches no leaf"
    """

    path: str
    kind: str
    expected: str
    found: str

    def __str__(self) -> str:
        if self.kind == "rules":
            return f"{self.path}: {self.found}"
        if self.kind == "missing":
            has = "" if self.found == "nothing" else f"; checkpoint has {self.found}"
            return f"{self.path}: missing in checkpoint (target expects {self.expected}{has})"
        if self.kind == "unexpected":
            return f"{self.path}: in checkpoint as {self.found} but not in the target"
        where = "" if self.found.startswith("fill_missing") else "checkpoint "
        return f"{self.path}: {self.kind} mismatch, target {self.expected} vs {where}{self.found}"


class CheckpointMismatchError(CheckpointError):
    """A restore target does not match the checkpoint; ``problems`` lists every leaf.

    >>> e = CheckpointMismatchError(5, "ckpt", [Mismatch("params/w", "shape", "(2,)", "(3,)")])
    >>> e.problems[0].kind, str(e).splitlines()[0]
    ('shape', 'checkpoint step 5 under ckpt does not match the restore target (1 problem):')
    """

    def __init__(self, step: int | None, root: Any, problems: Sequence[Mismatch]):
        self.step, self.root, self.problems = step, root, list(problems)
        kinds = {p.kind for p in problems}
        hint = "fix the target (model config, layer count, dtypes) or restore a matching step"
        if "missing" in kinds:
            hint += "; fill_missing=TREE takes the missing leaves from TREE (a fresh init)"
        if "unexpected" in kinds:
            hint += "; allow_unused=True leaves checkpoint leaves unused (a params-only target from a train state)"
        if "dtype" in kinds:
            hint += "; pass allow_dtype_cast=True (or a cast rule) for a deliberate dtype change"
        if kinds & {"missing", "unexpected"}:
            hint += "; Rules(rename=...) maps checkpoint names onto the target's"
        if "rules" in kinds:
            hint += "; fix the rules (tt.Rules: docs/rules.md)"
        lines = "\n".join(f"  {p}" for p in problems)
        where = f"checkpoint step {step} under {root}" if step is not None else f"checkpoint {root}"
        n = len(problems)
        self.header = f"{where} does not match the restore target ({n} problem{'s' * (n != 1)}):"
        self.hint = f"{hint}."
        # Not CheckpointError.__init__: the per-leaf lines must stay on their own lines.
        ValueError.__init__(self, f"{self.header}\n{lines}\n{self.hint}")
