"""Contracts a checker enforces (issue 45): the plug-in bases are ABCs, layouts are types owned by the base (no mode
strings in the checkpoint layer), the item rules are called from above, and built data is frozen."""

from __future__ import annotations

import abc
import ast
import dataclasses
import importlib
import inspect
import os
import pathlib
import pkgutil
import re

import numpy as np
import pytest

import treetools
from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.leaves import DEFAULT_ITEM, Item, Snapshot
from treetools.checkpoint_io.readers import ArrayReader, SequentialReader
from treetools.checkpoint_io.source import FileSource, ItemLayout, Layout, RootLayout, Source, StepLayout
from treetools.checkpoint_io.storage import Storage, Upload

PACKAGE = pathlib.Path(treetools.__file__).resolve().parent


# ---------------------------------------------------------------------------- the bases are ABCs

# Storage and Upload join this list when they become ABCs (issue 45, the storage half).
CONTRACTS = {
    Source: {"item_names", "read_items"},
    ArrayReader: {"read"},
    SequentialReader: {"blocks"},
    Layout: {"listing", "step", "step_folder"},
    # bytes and names only: a backend that forgets `confine` cannot be built (it would read outside)
    Storage: {"confine", "create", "open", "read_range", "remove", "scandir", "stat", "write_atomically"},
    Upload: {"abort", "commit", "write"},
}


@pytest.mark.parametrize("base", list(CONTRACTS), ids=lambda c: c.__name__)
def test_each_contract_is_an_abc_whose_subclass_must_implement_it(base):
    assert isinstance(base, abc.ABCMeta)
    assert set(base.__abstractmethods__) == CONTRACTS[base]
    for missing in sorted(CONTRACTS[base]):  # leave out one method: the class cannot be built
        body = {name: (lambda self, *a, **k: None) for name in CONTRACTS[base] if name != missing}
        partial = type(f"Without_{missing}", (base,), body)
        with pytest.raises(TypeError, match=missing):
            partial("x") if issubclass(base, Layout) else partial()


def test_no_contract_body_raises_not_implemented():
    # The contracts say what a subclass owes by being abstract, not by a body that fails when called.
    for module in ("checkpoint_io/source.py", "checkpoint_io/readers.py"):
        tree = ast.parse((PACKAGE / module).read_text())
        raised = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None
                  and "NotImplementedError" in ast.unparse(n.exc)]
        assert not raised, f"{module}: raise NotImplementedError at lines {raised}"


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_built_in_source_and_reader_is_concrete():
    import treetools.checkpoint_io.formats as formats
    import treetools.checkpoint_io.mapping  # noqa: F401  (RuledReader)

    for info in pkgutil.iter_modules(formats.__path__):
        importlib.import_module(f"{formats.__name__}.{info.name}")
    sources = [c for c in _subclasses(Source) if c.__module__.startswith("treetools.")]
    readers = [c for c in _subclasses(ArrayReader) if c.__module__.startswith("treetools.")]
    # Counted by hand in checkpoint_io (FileSource and seven format sources; ten readers and SequentialReader).
    assert len(sources) >= 8 and len(readers) >= 10, (sources, readers)
    for cls in sources + readers:
        if cls is SequentialReader:
            continue
        assert not inspect.isabstract(cls), f"{cls.__qualname__} leaves {sorted(cls.__abstractmethods__)} out"
    for cls in sources:  # where a source was opened is its Layout, not a mode string
        assert "mode" not in inspect.signature(cls.__init__).parameters, cls.__qualname__


def test_a_sequential_reader_streams_and_refuses_random_access():
    class Counting(SequentialReader):
        def __init__(self, n):
            self.shape, self.dtype = (n,), np.dtype(np.float32)

        def blocks(self, plan):
            for index in plan:
                yield np.arange(self.shape[0], dtype=self.dtype)[index]

    reader = Counting(10)
    assert reader.sequential
    np.testing.assert_array_equal(reader.read_all(), np.arange(10, dtype=np.float32))
    with pytest.raises(TypeError, match="front to back"):
        reader.read((slice(0, 2),))


# ---------------------------------------------------------------------------- layouts, not mode strings

def _mode_branches(tree: ast.AST) -> list[str]:
    """Comparisons of a name or attribute called ``mode`` with string constants (``mode == "root"``,
    ``self.mode in ("step", "item")``)."""
    def is_mode(node):
        return (isinstance(node, ast.Name) and node.id == "mode") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "mode")

    def strings(node):
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(strings(e) for e in node.elts)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_mode(s) for s in sides) and any(strings(s) for s in sides):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_mode_branch_check_finds_what_it_looks_for():
    tree = ast.parse('if self.mode == "root": pass\nx = mode in ("step", "item")\ny = st.st_mode == 0o100644\n')
    assert [f.split(":")[0] for f in _mode_branches(tree)] == ["line 1", "line 2"]


def test_no_mode_string_branches_in_the_checkpoint_layer():
    found = {}
    for path in sorted((PACKAGE / "checkpoint_io").rglob("*.py")):
        branches = _mode_branches(ast.parse(path.read_text()))
        if branches:
            found[str(path.relative_to(PACKAGE))] = branches
    assert not found, found


class _Toy(Source):
    """A source of one item per step, its folder's name; built with a layout and Levanter-like step names."""

    format = "toy"

    def __init__(self, display, context, layout):
        super().__init__(display, context, layout=layout, names=re.compile(r"^step-(?P<step>\d+)$"),
                         commit_rule=lambda folder, storage: storage.lexists(os.path.join(folder, "done")))

    def item_names(self, step):
        return self.layout.item_names(self.step_folder(step), lambda folder: sorted(os.listdir(folder)))

    def read_items(self, step, names):
        return Snapshot(step, {name: Item(name, "pytree", []) for name in names})


def test_the_base_decides_steps_and_step_folders_from_the_layout(tmp_path):
    for n, done in ((3, True), (12, True), (20, False)):  # step 20 has no commit marker: listed as incomplete
        (tmp_path / f"step-{n}" / "params").mkdir(parents=True)
        if done:
            (tmp_path / f"step-{n}" / "done").write_text("")
    (tmp_path / "logs").mkdir()
    context = ReadContext()
    root = _Toy("run", context.confined_to(str(tmp_path)), RootLayout(str(tmp_path)))
    assert root.steps == [3, 12] and root.step is None
    assert root.incomplete == ["step-20"]
    assert root.step_folder(12) == str(tmp_path / "step-12")
    assert root.item_names(12) == ["done", "params"]

    step_dir = str(tmp_path / "step-12")
    step = _Toy("run/step-12", context.confined_to(step_dir), StepLayout(step_dir))
    assert (step.steps, step.step, step.step_folder(None)) == (None, 12, step_dir)
    assert step.layout.given_step() == step_dir and root.layout.given_step() is None

    item_dir = os.path.join(step_dir, "params")
    item = _Toy("run/step-12/params", context.confined_to(step_dir), ItemLayout(item_dir, name="params"))
    assert (item.steps, item.step, item.step_folder(None), item.item_names(None)) == (None, 12, step_dir, ["params"])
    assert item.layout.whole_item(step_dir, lambda folder: None) == item_dir
    unnumbered = ItemLayout(item_dir, name="params", numbered=False)
    assert unnumbered.step(lambda name: 99) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.layout.location = "elsewhere"  # type: ignore[misc]
    with pytest.raises(TypeError, match="layout"):
        FileSource("f", context, "toy", []).step_folder(None)


# ---------------------------------------------------------------------------- the item rules are asked from above

def test_items_module_takes_no_source():
    # items.py sits below source.py: it is handed names and items, and never calls back into a Source.
    tree = ast.parse((PACKAGE / "checkpoint_io" / "items.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            assert "Protocol" not in bases, f"items.py: {node.name} is a Protocol of something above"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.args + node.args.kwonlyargs]
            assert "source" not in names, f"items.py: {node.name}({', '.join(names)}) takes a source"


def test_find_params_is_asked_of_the_source(tmp_path):
    # A whole train state in one file: the source reads it, items.params_from narrows it, the note says where.
    from treetools.checkpoint_io.opening import open_source

    path = tmp_path / "state.npz"
    np.savez(path, **{"params/dense/w": np.ones((2, 3), np.float32), "opt_state/mu/dense/w": np.zeros((2, 3))})
    source = open_source(str(path))
    assert source.params_item(None) == DEFAULT_ITEM
    found, note = source.find_params(None)
    assert [leaf.name for leaf in found.leaves] == ["dense/w"]
    assert "`params` of item `default`" in note
    named, none = source.find_params(None, item="default/opt_state")
    assert [leaf.name for leaf in named.leaves] == ["mu/dense/w"] and none is None


# ---------------------------------------------------------------------------- frozen data

def _package_modules():
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="treetools."):
        if info.name.endswith("__main__"):
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError as e:  # an optional extra that is not installed (keras, h5py...)
            if getattr(e, "name", None) and not str(e.name).startswith("treetools"):
                continue
            raise


def test_items_snapshots_reports_and_plans_are_frozen():
    checked, thawed = set(), []
    for module in _package_modules():
        for name, cls in vars(module).items():
            if not (inspect.isclass(cls) and dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__):
                continue
            if name.endswith(("Report", "Plan")) or issubclass(cls, (Item, Snapshot)):
                checked.add(f"{module.__name__}.{name}")
                if not cls.__dataclass_params__.frozen:
                    thawed.append(f"{module.__name__}.{name}")
    assert not thawed, thawed
    # The walk found them (names from the modules, listed by hand): not a check of nothing.
    for expected in ("checkpoint_io.leaves.Item", "checkpoint_io.leaves.Snapshot", "checkpoint_tools.report.Report",
                     "checkpoint_tools.diff.DiffReport", "checkpoint_tools.verify.VerifyReport",
                     "checkpoint_tools.convert.ConvertReport", "checkpoint_tools.show.ShowReport",
                     "checkpoint_jax.restore_plan.RestorePlan", "pytree.memory.MemoryPlan"):
        assert f"treetools.{expected}" in checked, expected


def test_a_narrowed_diff_side_is_a_new_snapshot(tmp_path):
    # diff narrows a train state to its params to compare it with a params-only export: the read snapshot stays.
    from treetools.checkpoint_io.opening import open_source
    from treetools.checkpoint_tools.diff import _pair_params

    state, export = tmp_path / "state.npz", tmp_path / "export.npz"
    np.savez(state, **{"params/w": np.ones(3, np.float32), "opt_state/mu/w": np.zeros(3, np.float32)})
    np.savez(export, **{"w": np.ones(3, np.float32)})
    src_a, src_b = open_source(str(state)), open_source(str(export))
    snap_a, snap_b = src_a.snapshot(), src_b.snapshot()
    leaves_before = [leaf.name for leaf in snap_a.items[DEFAULT_ITEM].leaves]
    new_a, new_b, notes = _pair_params(src_a, snap_a, src_b, snap_b)
    assert new_b is snap_b and new_a is not snap_a and notes
    assert [leaf.name for leaf in new_a.items[DEFAULT_ITEM].leaves] == ["w"]
    assert [leaf.name for leaf in snap_a.items[DEFAULT_ITEM].leaves] == leaves_before == ["params/w", "opt_state/mu/w"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap_a.items = {}  # type: ignore[misc]
