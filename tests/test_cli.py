"""The `treetools` command line: parser, dispatch, import cost, views and options of `inspect`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

import treetools as tt
from treetools import cli
from treetools.cli import main
from treetools.checkpoint_tools.progress import Progress
from tests.test_inspect import inspect_json, numpy_stats, one_error_line, run

def only_item(data: dict, name: str = "default") -> dict:
    """The one item of a single checkpoint in the schema-2 JSON object."""
    assert data["schema"] == 2 and data["steps"] is None and "items" not in data
    (checkpoint,) = data["checkpoints"]
    assert checkpoint["step"] is None and list(checkpoint["items"]) == [name]
    return checkpoint["items"][name]


def shared_folder(paths: list[list[str]]) -> list[str]:
    """The folder parts that two or more paths all lie below (a path's own last part never counts), by hand."""
    if len(paths) < 2:
        return []
    out = []
    for parts in zip(*(p[:-1] for p in paths)):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return out


# ----------------------------------------------------------------------------- import cost


HEAVY = ("jax", "numpy", "orbax", "flax", "optax", "tensorstore", "matplotlib")
"""Packages whose import a command that needs none of them must not pay (jax alone is ~0.5 s)."""

NO_JAX = (
    "import sys\n"
    "import treetools.cli\n"
    "rc = treetools.cli.main(sys.argv[1:])\n"
    f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
    "print('RESULT', rc, ','.join(heavy) or '-')\n"
)


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["diff", "--help"], ["train", "--help"],
                                  ["plot", "--help"], ["plan", "--help"]])
def test_help_imports_no_jax(argv):
    # Proved by the modules loaded, not by a clock (issue 39.2: a 0.3 s budget failed on a busy machine); the time
    # it takes is benchmarks/test_cli_speed_bench.py's.
    proc = subprocess.run([sys.executable, "-c", NO_JAX, *argv], capture_output=True, text=True, timeout=60)
    _, rc, heavy = proc.stdout.strip().splitlines()[-1].split(" ")
    assert rc == "0" and heavy == "-", proc.stdout


def _imported(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime ARGV``; the process and every top-level package it imported (Python's own record)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=60)
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \| +([\w.]+)$", proc.stderr, re.M)
    assert names, proc.stderr[-2000:]  # the record is there (a change of its format must not pass silently)
    return proc, {name.split(".")[0] for name in names}


@pytest.mark.parametrize("argv", [["--help"], ["plot", "--help"]])
def test_the_help_process_imports_nothing_heavy(argv):
    # The whole process a user starts (`python -m treetools`: runpy, treetools/__main__.py, the CLI), from Python's
    # own import record: none of the packages whose import takes the time.
    proc, imported = _imported(["-m", "treetools", *argv])
    assert proc.returncode == 0 and "usage: treetools" in proc.stdout
    assert "treetools" in imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("suffix", ["npz", "safetensors"])
def test_inspect_of_npz_and_safetensors_imports_no_jax(tmp_path, suffix, filtered):
    """Metadata, --stats, --include/--exclude and --depth on npz and safetensors: numpy is the one heavy import."""
    from safetensors.numpy import save_file

    # Flat-key formats keep the names as stored: "/" in the npz, "." in the safetensors file.
    sep = "/" if suffix == "npz" else "."
    tree = {p.replace("/", sep): x for p, x in _tree().items()}
    f = tmp_path / f"tree.{suffix}"
    if suffix == "npz":
        np.savez(f, **tree)
    else:
        save_file(tree, str(f))
    options = ["--include", "^encoder" + re.escape(sep), "--exclude", "bias$", "--depth", "1", "--stats"] if filtered else []
    proc = subprocess.run([sys.executable, "-c", NO_JAX, "inspect", str(f), *options, "--format", "json"],
                          capture_output=True, text=True, timeout=60)
    *out, result = proc.stdout.strip().splitlines()
    _, rc, heavy = result.split(" ")
    assert rc == "0" and heavy == "numpy", (result, proc.stderr)
    # The output is still right: leaves kept by the patterns; under --depth 1 summed per first part below the
    # kept leaves' shared folder (encoder), i.e. per layer.
    keep = {p: x for p, x in tree.items()
            if not filtered or (p.startswith("encoder" + sep) and not p.endswith("bias"))}
    cut = len(shared_folder([p.split(sep) for p in keep])) + 1
    assert not filtered or cut == 2
    groups: dict[str, list[np.ndarray]] = {}
    for p, x in keep.items():
        groups.setdefault(sep.join(p.split(sep)[:cut]) if filtered else p, []).append(x)
    assert not filtered or set(groups) == {f"encoder{sep}layer_0", f"encoder{sep}layer_1"}
    item = only_item(json.loads("\n".join(out)))
    got = {leaf["path"]: leaf for leaf in item["leaves"]}  # safetensors keeps its own (header) order
    assert len(item["leaves"]) == len(got) and set(got) == set(groups)
    for path, members in groups.items():
        leaf = got[path]
        assert leaf["params"] == sum(x.size for x in members) and leaf["bytes"] == sum(x.nbytes for x in members)
        assert leaf.get("num_leaves", 1) == len(members)
        if options:
            want = numpy_stats(np.concatenate([x.ravel() for x in members]))
            for key, value in want.items():
                np.testing.assert_allclose(leaf["stats"][key], value, rtol=1e-5)
    assert item["total_params"] == sum(x.size for x in keep.values())


def test_console_script_and_python_dash_m(tmp_path):
    f = tmp_path / "w.npz"
    np.savez(f, w=np.ones((2, 3), np.float32))
    script = Path(sys.executable).parent / "treetools"
    for cmd in ([sys.executable, "-m", "treetools"], [str(script)] if script.exists() else None):
        if cmd is None:
            continue
        proc = subprocess.run([*cmd, "inspect", str(f), "--format", "json"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert only_item(json.loads(proc.stdout))["total_params"] == 6


def _read_one_line_then_close(argv: list[str]) -> tuple[int, str, str]:
    """``treetools ARGV | head -1`` without a shell: read one line of stdout, close it, wait for the exit code."""
    proc = subprocess.Popen([sys.executable, "-m", "treetools", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=120), first, err


def test_a_reader_that_closes_stdout_early_changes_no_exit_code(tmp_path):
    # Issue 24.10: `diff ... --values | head -1` exited 0 (BrokenPipe) in 2 runs of 3, reading as "same".
    # 3000 leaves: the JSON (~400 KB) is far more than a pipe holds, so the writer meets the closed pipe every time.
    a = {f"layers_{i}/kernel": np.full(4, i, np.float32) for i in range(3000)}
    b = {**a, "layers_7/kernel": np.full(4, -1, np.float32)}
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    for _ in range(3):
        rc, first, err = _read_one_line_then_close(["diff", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"),
                                                    "--values", "--format", "json"])
        assert (rc, first.strip(), err) == (1, "{", "")  # different: 1, as without the pipe; no traceback
        rc, first, err = _read_one_line_then_close(["diff", str(tmp_path / "a.npz"), str(tmp_path / "a.npz"),
                                                    "--values", "--format", "json"])
        assert (rc, first.strip(), err) == (0, "{", "")
    rc, _, err = _read_one_line_then_close(["inspect", str(tmp_path / "b.npz"), "--leaves"])
    assert (rc, err) == (0, "")


# A child that runs the `treetools` program as the console script does (`run()`), after leaving two witnesses: an
# atexit handler and a `__del__` of a `__main__` global (run by the teardown of modules of Python's ordinary exit).
_PROGRAM = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("WITNESS atexit ran\\n"))
class Witness:
    def __del__(self):
        sys.stderr.write("WITNESS teardown ran\\n")
witness = Witness()
sys.argv = ["treetools", *sys.argv[1:]]
from treetools.cli import run
run()
"""


def _program(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROGRAM, *argv], capture_output=True, text=True, timeout=120)


def test_every_command_ends_through_pythons_ordinary_exit_with_its_output_and_code(tmp_path, capsys):
    # Issue 36: the read-only commands ended through CPython internals (atexit._run_exitfuncs, os._exit, a hand-made
    # 120), skipping the teardown of modules. Now every command ends with sys.exit: the teardown runs too.
    a = {f"layers_{i}/kernel": np.full(4, i, np.float32) for i in range(3000)}  # far more output than a pipe holds
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **{**a, "layers_7/kernel": np.full(4, -1, np.float32)})
    a_, b_ = str(tmp_path / "a.npz"), str(tmp_path / "b.npz")
    for argv, code in ((["inspect", a_, "--leaves", "--format", "json"], 0), (["diff", a_, b_, "--values"], 1),
                       (["verify", a_], 0), (["inspect", str(tmp_path / "missing")], 1)):
        proc = _program(*argv)
        assert proc.returncode == code, proc.stderr
        assert "WITNESS atexit ran" in proc.stderr and "WITNESS teardown ran" in proc.stderr, (argv, proc.stderr)
        expected = run(capsys, *argv)  # the same command in this process, through main(): every byte of stdout arrived
        assert (proc.returncode, proc.stdout) == expected[:2], argv
    assert len(json.loads(_program("inspect", a_, "--leaves", "--format", "json").stdout)["checkpoints"][0]
               ["items"]["default"]["leaves"]) == 3000


def test_the_cli_ends_the_process_through_no_interpreter_internals():
    source = (Path(cli.__file__).parent / "__init__.py").read_text() + (Path(cli.__file__).parent / "_output.py").read_text()
    for internal in ("_run_exitfuncs", "os._exit(", "code = 120", "import threading", "sys.stdout, sys.stderr = "):
        assert internal not in source, internal


def test_main_replaces_no_stream_while_a_command_runs(monkeypatch, capsys):
    # Issue 36: main() swapped sys.stdout/sys.stderr process-wide for the whole command (other threads of a calling
    # program wrote through the swap). The streams a command sees are the caller's own objects.
    seen = []
    mod = types.ModuleType("treetools.cli.verify")
    mod.add_arguments = lambda p: None
    mod.main = lambda args: seen.append((sys.stdout, sys.stderr)) or 0
    monkeypatch.setitem(sys.modules, "treetools.cli.verify", mod)
    outer = (sys.stdout, sys.stderr)
    assert main(["verify"]) == 0
    assert seen == [outer] and (sys.stdout, sys.stderr) == outer


# main() called from Python with stdout a pipe whose reader leaves: the exit code is kept, and after main() returns
# the process's streams are what they were (the same objects, descriptor 1 still the pipe, not /dev/null).
_CALLER = """
import os, stat, sys
from treetools.cli import main
before = (sys.stdout, sys.stderr, stat.S_ISFIFO(os.fstat(1).st_mode))
rc = main(sys.argv[1:])
after = (sys.stdout, sys.stderr, stat.S_ISFIFO(os.fstat(1).st_mode))
sys.stderr.write(f"rc={rc} same={before == after} fifo={after[2]}\\n")
sys.stderr.flush()
os._exit(0)  # what Python does at exit with the caller's unwritable stdout is the caller's business
"""


def test_main_called_from_python_keeps_the_exit_code_and_leaves_the_streams_as_they_were(tmp_path):
    a = {f"layers_{i}/kernel": np.full(4, i, np.float32) for i in range(3000)}
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **{**a, "layers_7/kernel": np.full(4, -1, np.float32)})
    proc = subprocess.Popen([sys.executable, "-c", _CALLER, "diff", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"),
                             "--values", "--format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and first.strip() == "{"
    assert err == "rc=1 same=True fifo=True\n"  # different: 1, as without the pipe; no traceback


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full: a file whose every write fails (ENOSPC)")
@pytest.mark.parametrize("argv, redirect", [
    (argv, redirect) for argv in (["inspect", "{a}"], ["inspect", "--help"], ["inspect", "--bogus"], ["verify", "{a}"])
    for redirect in (">&-", "2>&-", "2>/dev/full", ">/dev/full")])
def test_closed_or_failing_stdout_and_stderr_keep_the_commands_exit_code(tmp_path, argv, redirect):
    # The program (`python -m treetools`, the console script) ends with sys.exit and the command's code: a stream
    # closed when the process started is skipped; diagnostics that cannot be written are dropped; output that
    # cannot be written (a full disk) is one error line, exit 1, --help included (it was Python's 120 and an
    # "Exception ignored" report).
    np.savez(tmp_path / "a.npz", w=np.ones(4, np.float32))
    argv = [a.format(a=tmp_path / "a.npz") for a in argv]
    proc = subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", sys.executable, "-m", "treetools", *argv],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": ""})
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    usage = argv[1] == "--bogus"
    if redirect == ">/dev/full" and not usage:
        assert (proc.returncode, proc.stderr) == (1, "treetools: error: cannot write to stdout (No space left on "
                                                     "device).\n")
    else:
        assert proc.returncode == (2 if usage else 0), proc.stderr
        if redirect.startswith("2"):
            assert proc.stderr == ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full: a file whose every write fails (ENOSPC)")
def test_diff_whose_output_cannot_be_written_is_trouble_not_same(tmp_path):
    np.savez(tmp_path / "a.npz", w=np.ones(4, np.float32))
    a = str(tmp_path / "a.npz")
    proc = subprocess.run(["sh", "-c", 'exec "$@" >/dev/full', "sh", sys.executable, "-m", "treetools", "diff", a, a],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, "treetools: error: cannot write to stdout (No space left on device).\n")


def test_a_profiler_or_a_calling_program_gets_the_process_back(tmp_path):
    np.savez(tmp_path / "a.npz", w=np.ones(4, np.float32))
    a = str(tmp_path / "a.npz")
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-m", "treetools", "inspect", a], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "function calls" in proc.stdout, proc.stderr  # the profile printed at the end
    program = ("import runpy, sys\nsys.argv = ['treetools', 'inspect', sys.argv[1]]\n"
               "try:\n    runpy.run_module('treetools', run_name='__main__')\n"
               "except SystemExit as e:\n    print('exit', e.code)\nprint('alive')\n")
    proc = subprocess.run([sys.executable, "-c", program, a], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines()[-2:] == ["exit 0", "alive"], proc.stderr


def test_metadata_inspect_loads_neither_the_rules_nor_the_block_engine_nor_the_statistics(tmp_path):
    # What keeps whole-process metadata inspect near 0.3x `import jax` (benchmarks/test_stream_bench.py): these load
    # only for --stats, rules and the other commands. (The rules spec, standard library only, loads with the parser:
    # its field table gives the rules flags.)
    np.savez(tmp_path / "a.npz", w=np.ones((2, 4), np.float32))
    later = ["treetools.rules.plan", "treetools.checkpoint_io.mapping", "treetools.checkpoint_io.stream", "treetools.checkpoint_tools.stats",
             "treetools.checkpoint_tools.progress"]
    code = ("import io, contextlib, sys\nfrom treetools.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    assert main(sys.argv[1:]) == 0\n"
            f"print([m for m in {later!r} if m in sys.modules])\n")
    loaded = lambda *argv: subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,  # noqa: E731
                                          timeout=120, check=True).stdout.strip()
    assert loaded("inspect", str(tmp_path / "a.npz")) == "[]"
    assert loaded("inspect", str(tmp_path / "a.npz"), "--stats") == str(later[2:])
    assert loaded("inspect", str(tmp_path / "a.npz"), "--unstack", "w") == str(later[:2])


# ----------------------------------------------------------------------------- dispatch


def _fake_module(monkeypatch, name: str, *, with_arguments: bool) -> list:
    calls: list = []
    mod = types.ModuleType(f"treetools.cli.{name}")
    if with_arguments:
        mod.add_arguments = lambda p: p.add_argument("--steps", type=int, default=1)
    mod.main = lambda args: calls.append(args) or 5
    monkeypatch.setitem(sys.modules, f"treetools.cli.{name}", mod)
    return calls


def test_subcommand_module_adds_its_arguments_and_runs(monkeypatch):
    calls = _fake_module(monkeypatch, "train", with_arguments=True)
    assert main(["train", "--steps", "3"]) == 5
    assert calls[0].steps == 3 and calls[0].command == "train"


def test_train_and_plot_options_reach_their_commands():
    a = cli.build_parser("train").parse_args(
        ["train", "--steps", "4", "--workdir", "w", "--no-resume", "--seed", "1", "--batch-size", "8",
         "--log-every", "2", "--ckpt-every", "3", "--freeze-embeddings", "--ema-decay", "0.9"])
    assert (a.steps, a.workdir, a.resume, a.seed, a.batch_size, a.log_every, a.ckpt_every, a.freeze_embeddings,
            a.ema_decay) == (4, "w", False, 1, 8, 2, 3, True, 0.9)
    p = cli.build_parser("plot").parse_args(["plot", "m.jsonl", "-o", "out.png"])
    assert (p.metrics, p.output) == (["m.jsonl"], "out.png")


def test_the_rules_flags_are_the_rules_field_table(tmp_path):
    # One table (treetools.rules.spec.FIELDS) gives every rules flag: each field is a flag of convert and diff with
    # its metavar and help, inspect takes --unstack alone, and the flags parse into the Rules the library builds.
    from treetools.cli.options import rules_from
    from treetools.rules.spec import FIELDS, Rules

    values = {"rename": ["^a/(.*)$=>b.\\1"], "drop": ["^opt/"], "keep": ["^(a|opt)/"], "cast": ["(?=x)=float16"],
              "dtype": "bfloat16", "transpose": ["w$=1,0"], "unstack": ["^a/"], "stack": ["^c/"],
              "split": ["f$=>names=g,u axis=0"], "concat": ["(?P<part>g|u)$=>name=gu axis=0 parts=g,u"],
              "reshape": ["w$=>axis=0 into=-1,4"], "permute": ["q$=>axis=0 head_dim=4 to=half"],
              "slice": ["e$=>axis=0 stop=3"], "pad": ["e$=>axis=0 size=8"], "tie": ["e$=>name=h axes=1,0"],
              "scale": ["q$=1/sqrt(4)"], "allow_unmatched": True}
    assert set(values) == set(FIELDS)  # a new field needs a value here
    (tmp_path / "r.json").write_text(json.dumps({"drop": ["^first$"], "cast": {"(?=x)": "float32"}}))
    for command in ("convert", "diff"):
        parser = cli.build_parser(command)
        sub = parser._subparsers._group_actions[0].choices[command]  # noqa: SLF001  (the subcommand's own parser)
        text = sub.format_help()
        for name, field in FIELDS.items():
            assert f"{field.flag(name)}" + (f" {field.metavar}" if field.metavar else "") in text, (command, name)
        argv = [command, "A", "B", "--rules", str(tmp_path / "r.json")]
        for name, value in values.items():
            flag = FIELDS[name].flag(name)
            argv += [flag] if value is True else [flag, value] if isinstance(value, str) else [flag, *value]
        args = parser.parse_args(argv)
        rules = rules_from(args)
        assert rules == Rules.from_cli(rules_file=tmp_path / "r.json", **values)
        assert rules == Rules(rename=[(r"^a/(.*)$", r"b.\1")], drop=["^first$", "^opt/"], keep=["^(a|opt)/"],
                              cast={"(?=x)": "float16"}, dtype="bfloat16", transpose={"w$": (1, 0)},
                              unstack=["^a/"], stack=["^c/"], split={"f$": {"names": ["g", "u"], "axis": 0}},
                              concat={"(?P<part>g|u)$": {"name": "gu", "axis": 0, "parts": ["g", "u"]}},
                              reshape={"w$": {"axis": 0, "into": [-1, 4]}},
                              permute={"q$": {"axis": 0, "head_dim": 4, "to": "half"}},
                              slice={"e$": {"axis": 0, "stop": 3}}, pad={"e$": {"axis": 0, "size": 8}},
                              tie={"e$": {"name": "h", "axes": [1, 0]}}, scale={"q$": "1/sqrt(4)"},
                              allow_unmatched=True)
        assert rules_from(parser.parse_args([command, "A", "B"])) is None
    inspect = cli.build_parser("inspect")._subparsers._group_actions[0].choices["inspect"]  # noqa: SLF001
    flags = {o for a in inspect._actions for o in a.option_strings}  # noqa: SLF001
    assert {FIELDS[n].flag(n) for n in FIELDS} & flags == {"--unstack"} and "--rules" not in flags


@pytest.mark.parametrize("argv", [[], ["inspect"], ["inspect", "x", "--format", "yaml"], ["inspect", "x", "--depth", "0"],
                                  ["inspect", "x", "--include", "("], ["inspect", "x", "--sort", "size"],
                                  ["diff", "a", "b", "--atol", "-1"], ["frobnicate"]])
def test_usage_errors_exit_2(argv, capsys, tmp_path):
    f = tmp_path / "w.npz"
    np.savez(f, w=np.ones(2))
    argv = [str(f) if a == "x" else a for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == "" and ("usage" in err or "error" in err)


def test_a_usage_error_raised_anywhere_is_one_line_exit_2_for_every_command(monkeypatch, capsys):
    # Issue 36: usage errors are one exception type that the dispatcher maps to exit 2 (also for diff, whose other
    # known errors are 2 as well), replacing a usage() closure per command.
    def fake(name, exc):
        mod = types.ModuleType(f"treetools.cli.{name}")
        mod.add_arguments = lambda p: None

        def command(args):
            raise exc

        mod.main = command
        monkeypatch.setitem(sys.modules, f"treetools.cli.{name}", mod)

    for name in ("inspect", "convert", "plot", "verify", "train"):
        fake(name, tt.UsageError("--frob 3 (`frob`) needs\n--bar"))
        assert main([name]) == 2, name
        assert capsys.readouterr().err == f"treetools {name}: error: --frob 3 (`frob`) needs --bar\n"
    fake("inspect", ValueError("a bug"))  # any other ValueError of a checkpoint command is a bug: its traceback
    with pytest.raises(ValueError, match="a bug"):
        main(["inspect"])


def test_an_error_with_many_problems_is_one_line_each_the_first_20_and_a_count(tmp_path, capsys):
    # Issue 39.9: a --rename that collides 30 pairs came out as one line of 30 problems (a resumed
    # `train --scan-layers`: 144 problems, ~15k characters).
    np.savez(tmp_path / "pairs.npz", **{f"{side}_{i}/w": np.ones(2, np.float32) for i in range(30) for side in "ab"})
    argv = [str(tmp_path / "pairs.npz"), str(tmp_path / "o.safetensors")]
    with pytest.raises(tt.RulesError) as e:  # the library's own error: every problem, in its order
        tt.convert(*argv, rules=tt.Rules(rename=[(r"^[ab]_(\d+)/w", r"\1/w")]))
    assert len(e.value.problems) == 30
    assert main(["convert", *argv, "--rename", r"^[ab]_(\d+)/w=>\1/w"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["treetools: error: the rules do not fit the leaves (30 problems):",
                   *(f"  {p}" for p in e.value.problems[:20]), "  ... and 10 more (30 problems in all)"]


def test_a_mismatch_error_lists_its_problems_and_ends_with_its_fix_and_nothing_forges_a_line(monkeypatch, capsys):
    from treetools.shared.errors import CheckpointMismatchError, Mismatch

    problems = [Mismatch(f"params/layers/{i}/w", "missing", "(4,)", "nothing") for i in range(3)]
    problems.append(Mismatch("params/x\ntreetools: note: forged", "shape", "(2,)", "(3,)"))
    exc = CheckpointMismatchError(5, "run/ckpt", problems)
    mod = types.ModuleType("treetools.cli.train")
    mod.add_arguments = lambda p: None

    def command(args):
        raise exc

    mod.main = command
    monkeypatch.setitem(sys.modules, "treetools.cli.train", mod)
    assert main(["train"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "treetools: error: checkpoint step 5 under run/ckpt does not match the restore target (4 problems):"
    assert err[1:4] == [f"  params/layers/{i}/w: missing in checkpoint (target expects (4,))" for i in range(3)]
    assert err[4] == "  params/x treetools: note: forged: shape mismatch, target (2,) vs checkpoint (3,)"
    assert err[5] == "  " + exc.hint and exc.hint.startswith("fix the target") and len(err) == 6
    assert [line for line in err if line.startswith("treetools:")] == err[:1]


def test_no_command_module_prints_its_own_usage_errors():
    # The commands raise UsageError; only the dispatcher prints errors (no `usage()` closure, no prog= per command).
    for module in sorted((Path(cli.__file__).parent).glob("*.py")):
        if module.name in ("__init__.py", "_output.py"):
            continue
        text = module.read_text()
        assert "_output.error(message, prog=" not in text and "_output.error(e, prog=" not in text, module.name
        assert "def usage" not in text and "def _usage" not in text, module.name


def test_a_mistyped_option_is_named_with_the_option_it_is_close_to(capsys, tmp_path):
    # Issue 24.23: `--itme` got the top-level usage and no hint; now the subcommand's usage and the fix.
    f = tmp_path / "w.npz"
    np.savez(f, w=np.ones(2))
    rc, out, err = run(capsys, "inspect", f, "--itme", "params")
    assert rc == 2 and out == ""
    assert err.splitlines() == ["usage: treetools inspect [OPTIONS] PATH  (treetools inspect --help lists the options)",
                                "treetools inspect: error: unrecognized arguments: --itme params; did you mean --item?"]
    rc, _, err = run(capsys, "diff", f, f, "--atoll=1e-3")
    assert rc == 2 and err.startswith("usage: treetools diff [OPTIONS] A [B]  (") and "did you mean --atol?" in err
    rc, _, err = run(capsys, "inspct", f)
    assert rc == 2 and err.splitlines()[-1].endswith("; did you mean inspect?")


@pytest.mark.parametrize("argv, usage", [
    (["inspect"], "treetools inspect [OPTIONS] PATH"),
    (["diff", "--atol", "x", "a"], "treetools diff [OPTIONS] A [B]"),
    (["verify"], "treetools verify [OPTIONS] PATH [PATH ...]"),
    (["convert", "a"], "treetools convert [OPTIONS] SRC DST"),
    (["plot", "--keys"], "treetools plot [OPTIONS] RUN_OR_METRICS [RUN_OR_METRICS ...]"),
    (["plan", "c", "--mesh"], "treetools plan [OPTIONS] CKPT"),
    (["train", "--steps", "0"], "treetools train [OPTIONS]"),
    (["inspct"], "treetools [OPTIONS] COMMAND ..."),
])
def test_a_usage_error_is_one_short_usage_line_and_one_error_line(capsys, argv, usage):
    # docs/cli.md: "the command's usage line and one `treetools COMMAND: error: ...` line" (not argparse's block).
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    lines = err.splitlines()
    prog = usage.split(" [OPTIONS]")[0]
    assert len(lines) == 2 and lines[0] == f"usage: {usage}  ({prog} --help lists the options)", err
    assert lines[1].startswith(f"{prog}: error: ")


def test_bare_treetools_prints_the_help_and_exits_2(capsys):
    # Issue 24.23: no command printed an error; now the whole help (on stderr: a missing command is usage, exit 2).
    rc, out, err = run(capsys)
    _, help_out, _ = run(capsys, "--help")
    assert rc == 2 and out == ""
    assert err == help_out and "error" not in err.split("Exit codes")[0]
    assert all(name in err for name in cli.COMMANDS)


def test_version_and_help_return_0(capsys):
    assert run(capsys, "--version")[0] == 0
    rc, out, _ = run(capsys, "inspect", "--help")
    assert rc == 0 and "--fail-on-nonfinite" in out and "--chunk-mb" not in out


def test_inspect_help_names_every_built_in_format_and_statistic(capsys):
    from treetools.checkpoint_io.registry import registered_formats
    from treetools.shared.rows import STATS

    rc, out, _ = run(capsys, "inspect", "--help")
    text = " ".join(out.split())
    assert rc == 0
    missing = [f.name for f in registered_formats() if f.name not in text]
    assert not missing, f"`inspect --help` does not name the formats {missing}"
    assert " ".join(STATS) in text  # the --stats help lists every statistic, from the one tuple


def test_every_registered_format_is_described_in_inspect_help_and_named_in_the_readme(capsys):
    # Issue 24.24: `inspect --help` listed fewer formats than the README. Both now name every registered format;
    # --help takes them (and their descriptions) from the registry, read without importing numpy.
    from treetools.checkpoint_io.formats import catalog
    from treetools.checkpoint_io.registry import registered_formats

    formats = [(f.name, f.description) for f in registered_formats()]
    assert catalog() == formats
    rc, out, _ = run(capsys, "inspect", "--help")
    listed = out.split("formats (asked in this order; the first that claims PATH reads it):\n", 1)[1]
    entries = re.findall(r"^  (\S+) +(.*(?:\n {4,}.*)*)", listed, re.M)
    assert [(name, " ".join(text.split())) for name, text in entries] == formats
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert [name for name, _ in formats if f"`{name}`" not in readme] == []


# ----------------------------------------------------------------------------- views and options


def _tree() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "encoder/layer_0/kernel": rng.standard_normal((16, 8)).astype(np.float32),
        "encoder/layer_0/bias": rng.standard_normal(8).astype(np.float32),
        "encoder/layer_1/kernel": rng.standard_normal((8, 8)).astype(np.float32),
        "decoder/kernel": rng.standard_normal((8, 4)).astype(np.float16),
        "decoder/steps": np.arange(5, dtype=np.int64),
    }


@pytest.fixture
def npz(tmp_path) -> Path:
    f = tmp_path / "tree.npz"
    np.savez(f, **_tree())
    return f


def test_table_view_has_rows_totals_and_dtypes(npz, capsys):
    rc, out, _ = run(capsys, "inspect", npz)
    assert rc == 0
    tree = _tree()
    assert out.splitlines()[0] == f"{npz} (npz)"
    for path, x in tree.items():
        row = next(line for line in out.splitlines() if line.startswith(path + " "))
        assert f"{x.size:,}" in row and str(x.dtype) in row
    total = sum(x.size for x in tree.values())
    nbytes = sum(x.nbytes for x in tree.values())
    assert nbytes < 1024  # no human size in parentheses below 1 KiB
    assert f"Total: {total:,} params, {nbytes:,} bytes" in out.splitlines()
    for dtype in {str(x.dtype) for x in tree.values()}:
        d_params = sum(x.size for x in tree.values() if str(x.dtype) == dtype)
        assert f"  {dtype}: {d_params:,} params" in out


def test_markdown_and_tree_views(npz, capsys):
    rc, out, _ = run(capsys, "inspect", npz, "--format", "markdown")
    assert rc == 0 and out.startswith("# ") and "| path" in out and "|---" in out.replace("-|-", "---")
    rc, out, _ = run(capsys, "inspect", npz, "--format", "tree")
    lines = out.splitlines()
    tree = _tree()
    encoder = sum(x.size for p, x in tree.items() if p.startswith("encoder/"))
    layer_0 = sum(x.size for p, x in tree.items() if p.startswith("encoder/layer_0/"))
    kernel = tree["encoder/layer_0/kernel"]
    # Every folder line carries its params subtotal (and bytes: issue 24, point 22); shapes print as tuples.
    encoder_bytes = sum(x.nbytes for p, x in tree.items() if p.startswith("encoder/"))
    assert f"encoder/  {encoder:,} params, {encoder_bytes} B" in lines and encoder_bytes < 1024
    assert any(line.startswith(f"  layer_0/  {layer_0:,} params, ") for line in lines)
    assert f"    kernel (16, 8) float32  {kernel.size:,} params, {kernel.nbytes} B" in lines and kernel.shape == (16, 8)
    assert any(line.startswith(f"    bias (8,) float32  {tree['encoder/layer_0/bias'].size} params, ") for line in lines)


def test_depth_sums_per_prefix(npz, capsys):
    item = only_item(inspect_json(capsys, npz, "--depth", "1"))
    tree = _tree()
    got = {leaf["path"]: leaf for leaf in item["leaves"]}
    assert list(got) == ["encoder", "decoder"]
    for prefix in got:
        members = [x for p, x in tree.items() if p.split("/")[0] == prefix]
        assert got[prefix]["params"] == sum(x.size for x in members)
        assert got[prefix]["bytes"] == sum(x.nbytes for x in members)
        assert got[prefix]["num_leaves"] == len(members)
    assert item["total_params"] == sum(x.size for x in tree.values())


def test_depth_with_stats_merges_member_streams(npz, capsys):
    item = only_item(inspect_json(capsys, npz, "--depth", "2", "--stats", "--chunk-mb", "0.001"))
    got = {leaf["path"]: leaf for leaf in item["leaves"]}
    members = [x for p, x in _tree().items() if p.startswith("encoder/layer_0/")]
    want = numpy_stats(np.concatenate([x.ravel().astype(np.float64) for x in members]))
    for key, value in want.items():
        np.testing.assert_allclose(got["encoder/layer_0"]["stats"][key], value, rtol=1e-5)


@pytest.mark.parametrize("include,exclude", [(["kernel"], []), ([], ["^encoder"]), (["encoder", "steps$"], ["bias"])])
def test_include_exclude_filter_leaves_and_totals(npz, capsys, include, exclude):
    argv = [a for pat in include for a in ("--include", pat)] + [a for pat in exclude for a in ("--exclude", pat)]
    item = only_item(inspect_json(capsys, npz, *argv))
    tree = _tree()
    keep = {p: x for p, x in tree.items()
            if (not include or any(re.search(i, p) for i in include)) and not any(re.search(e, p) for e in exclude)}
    assert [leaf["path"] for leaf in item["leaves"]] == list(keep)
    assert item["total_params"] == sum(x.size for x in keep.values())


def test_unmatched_pattern_names_it(npz, capsys):
    rc, out, err = run(capsys, "inspect", npz, "--exclude", "kernal")
    assert rc == 1 and "'kernal'" in one_error_line(err) and out == ""


@pytest.mark.parametrize("key", ["params", "bytes", "path"])
def test_sort(npz, capsys, key):
    item = only_item(inspect_json(capsys, npz, "--sort", key))
    tree = _tree()
    if key == "path":
        want = sorted(tree)
    else:
        size = {p: (x.size if key == "params" else x.nbytes) for p, x in tree.items()}
        want = sorted(tree, key=lambda p: (-size[p], p))
    assert [leaf["path"] for leaf in item["leaves"]] == want


def test_stats_table_columns_and_no_progress_when_not_a_tty(npz, capsys):
    rc, out, err = run(capsys, "inspect", npz, "--stats")
    assert rc == 0 and err == ""
    header = next(line for line in out.splitlines() if line.startswith("path"))
    # A compact set by default; --stats-columns chooses (`all`: every statistic). With --stats the table shows
    # the statistics in place of counts and sharding (the totals stay below it): issue 24, point 17.
    assert header.split() == ["path", "shape", "dtype", "mean", "std", "min", "max", "nonfinite"]
    rc, out, _ = run(capsys, "inspect", npz, "--stats", "--stats-columns", "all", "--leaves")
    header = next(line for line in out.splitlines() if line.startswith("path"))
    assert header.split()[3:] == ["mean", "std", "min", "max", "l2", "abs_max", "zeros", "nan", "posinf", "neginf",
                                  "nonfinite"]
    rc, out, _ = run(capsys, "inspect", npz, "--stats", "--stats-columns", "l2,zeros")
    header = next(line for line in out.splitlines() if line.startswith("path"))
    assert header.split()[3:] == ["l2", "zeros"]


def test_progress_bar_draws_only_on_a_tty():
    class Tty:
        def __init__(self, tty):
            self.text, self.tty = "", tty

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return self.tty

    for tty in (True, False):
        stream = Tty(tty)
        bar = Progress(100, stream=stream)
        bar.start("params/w")
        bar.advance(100)
        bar.close()
        assert ("params/w" in stream.text and "[" in stream.text) == tty
        assert (stream.text == "") == (not tty)


def test_root_table_lists_steps_and_incomplete(tmp_path, capsys):
    root = tmp_path / "run"
    with ocp.CheckpointManager(str(root)) as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.ones(3, np.float32) * step})))
        mgr.wait_until_finished()
    (root / "3.orbax-checkpoint-tmp-1700000000").mkdir()
    rc, out, _ = run(capsys, "inspect", root)
    assert rc == 0
    assert "steps: 1, 2 (showing 2)" in out and "incomplete (not read): 3.orbax-checkpoint-tmp-1700000000" in out
    assert "[params]" in out
    rc, out, _ = run(capsys, "inspect", root, "--step", "all", "--format", "markdown")
    # Issue 24, point 14: --step all is one compact row per step (step, save time, metrics, size), not full tables.
    rows = [line for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 2 and "| path" not in out
    rc, out, _ = run(capsys, "inspect", root, "--step", "all", "--stats", "--stats-columns", "mean")
    # With --stats: one column per step of the chosen statistic, against numpy per step (w = 1 * step).
    (row,) = [line.split() for line in out.splitlines() if line.startswith("w ")]
    assert row == ["w", "1", "2"]


# ----------------------------------------------------------------------------- review: help, train and plot errors


@pytest.mark.parametrize("command", ["inspect", "diff", "train", "plot", "plan"])
def test_every_option_has_help_and_the_command_a_description(command, capsys):
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0
    description = out.split("\n\n")[1]
    assert len(description.split()) > 8, description  # more than a title
    options = re.findall(r"^  (-[^\n]*?)(?:  +(\S.*))?$", out, re.M)
    for flag, text in options:
        if not text:  # help on the next line
            text = out.split(flag, 1)[1].split("\n", 2)[1].strip()
        assert text and not text.startswith("-"), f"{command} {flag} has no help"


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--steps", "-1"], ["--ckpt-every", "0"], ["--log-every", "0"],
                                  ["--batch-size", "0"], ["--ema-decay", "2"], ["--learning-rate", "0"],
                                  ["--cpu-devices", "0"]])
def test_train_bad_options_are_usage_errors(argv, capsys, tmp_path):
    rc, out, err = run(capsys, "train", "--workdir", tmp_path / "w", *argv)
    assert rc == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith(f"treetools train: error: argument {argv[0]}")
    assert not (tmp_path / "w").exists()


def _committed_step(workdir: Path, step: int) -> None:
    folder = workdir / "checkpoints" / str(step)
    folder.mkdir(parents=True)
    (folder / "commit_success.txt").write_text("ok")


def test_train_batch_size_must_split_over_the_devices(capsys, tmp_path, devices):
    rc, out, err = run(capsys, "train", "--workdir", tmp_path / "w", "--batch-size", "12", "--quiet")
    line = one_error_line(err)
    assert rc == 1 and "--batch-size 12" in line and str(len(devices)) in line


def test_train_already_at_steps_does_nothing(capsys, tmp_path):
    _committed_step(tmp_path, 20)
    rc, out, err = run(capsys, "train", "--workdir", tmp_path, "--steps", "10")
    assert rc == 0 and out == ""
    assert "already at step 20" in err and "--steps" in err and len(err.strip().splitlines()) == 1


def test_train_no_resume_refuses_existing_checkpoints(capsys, tmp_path):
    _committed_step(tmp_path, 20)
    rc, out, err = run(capsys, "train", "--workdir", tmp_path, "--steps", "30", "--no-resume")
    line = one_error_line(err)
    assert rc == 1 and str(tmp_path / "checkpoints") in line and "--workdir" in line


def test_train_refuses_a_workdir_inside_a_checkpoint(capsys, tmp_path, monkeypatch):
    # Issue 24.11: `--workdir runs/demo/checkpoints/200` wrote a run inside a committed step.
    from tests.test_checkpoint_layer import write_train_workdir

    write_train_workdir(tmp_path / "runs" / "demo")
    monkeypatch.chdir(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    cases = {"runs/demo/checkpoints/3": "is a checkpoint (orbax)",                       # a committed step
             "runs/demo/checkpoints": "is a checkpoint (orbax)",                         # the root
             "runs/demo/checkpoints/3/params": "is a checkpoint (orbax)",                # an item folder
             "runs/demo/checkpoints/3/params/run": "is inside the checkpoint runs/demo/checkpoints/3/params (orbax)",
             "runs/demo/checkpoints/3/run": "is inside the checkpoint runs/demo/checkpoints/3 (orbax)",
             "runs/demo/checkpoints/400": "is inside the checkpoint runs/demo/checkpoints (orbax)"}  # a root's step
    for workdir, where in cases.items():
        rc, out, err = run(capsys, "train", "--workdir", workdir, "--steps", "1")
        assert rc == 1 and out == ""
        assert one_error_line(err) == (f"treetools: error: --workdir {workdir} {where}: a run written there would "
                                       "read as part of it; pick a folder outside it (to continue the run it "
                                       "belongs to: --workdir runs/demo).")
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written
    from treetools.cli.train import check_workdir

    for fine in ("runs/demo", "runs/other", "runs/demo/checkpoints-old", "runs/demo/checkpoints/notes"):
        check_workdir(fine)  # the run folder itself, a fresh one, a stranger beside the steps: no error


def test_a_new_workdir_beside_an_orbax_folder_is_not_inside_it(tmp_path, monkeypatch):
    # README's `treetools convert ... orbax_ckpt/ --to orbax` leaves a folder holding one Orbax save; that folder
    # reads as an (old-Orbax) step whose item is `orbax_ckpt`, but a path not there yet is no part of it.
    from treetools.cli.train import check_workdir

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "orbax_ckpt", {"w": np.ones(2, np.float32)})
        ckptr.wait_until_finished()
    assert sorted(os.listdir(tmp_path)) == ["orbax_ckpt"]
    monkeypatch.chdir(tmp_path)
    for fine in ("runs/demo2", "runs", "orbax_ckpt-old/run"):
        check_workdir(fine)
    (tmp_path / "runs").mkdir()  # a stranger folder beside the save: what is under it too
    check_workdir("runs/demo2")
    # Inside the save itself, existing or not, is still refused.
    for inside, where in {"orbax_ckpt": "is a checkpoint (orbax)",
                          "orbax_ckpt/run": "is inside the checkpoint orbax_ckpt (orbax)",
                          "orbax_ckpt/d/run": "is inside the checkpoint orbax_ckpt (orbax)"}.items():
        with pytest.raises(ValueError, match=re.escape(f"--workdir {inside} {where}: ")):
            check_workdir(inside)
    # A step with its own commit marker, given alone (no root around it): a new folder in it is inside it.
    with ocp.CheckpointManager(tmp_path / "mngr") as mngr:
        mngr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.ones(2, np.float32)})))
        mngr.wait_until_finished()
    os.rename(tmp_path / "mngr" / "1", tmp_path / "step_copy")
    with pytest.raises(ValueError, match=re.escape("--workdir step_copy/run is inside the checkpoint step_copy (orbax)")):
        check_workdir("step_copy/run")


METRICS = [{"step": s, "loss": 3.0 / s, "grad_norm": 1.0, "param_norm": 10.0 + s, "update_ratio": 1e-3} for s in (1, 2, 3)]


@pytest.fixture
def metrics(tmp_path) -> Path:
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    return f


def test_plot_without_matplotlib_is_a_known_error(metrics, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rc, out, err = run(capsys, "plot", metrics, "-o", metrics.parent / "n.png")
    line = one_error_line(err)
    assert rc == 1 and "matplotlib" in line and "pip install" in line and "internal error" not in line
    assert not (metrics.parent / "n.png").exists()


@pytest.mark.parametrize("line", ["5", '"step"', '{"step": "one", "loss": 1}', "[1, 2]"])
def test_plot_rejects_records_that_are_not_metrics(tmp_path, capsys, line):
    f = tmp_path / "m.jsonl"
    f.write_text(line + "\n")
    rc, out, err = run(capsys, "plot", f, "-o", tmp_path / "n.png")
    msg = one_error_line(err)
    assert rc == 1 and "m.jsonl" in msg and "internal error" not in msg


def test_plot_output_errors_name_the_output(metrics, capsys, tmp_path):
    rc, _, err = run(capsys, "plot", metrics, "-o", tmp_path / "nowhere" / "n.png")
    assert rc == 1 and str(tmp_path / "nowhere") in one_error_line(err)
    rc, _, err = run(capsys, "plot", metrics, "-o", tmp_path / "n.txt")
    assert rc == 1 and "n.txt" in one_error_line(err) and ".png" in err
    (tmp_path / "adir.png").mkdir()
    rc, _, err = run(capsys, "plot", metrics, "-o", tmp_path / "adir.png")
    assert rc == 1 and one_error_line(err).startswith(f"treetools: error: {tmp_path / 'adir.png'}: ")


def test_plot_accepts_a_workdir(metrics, capsys):
    rc, out, err = run(capsys, "plot", metrics.parent)
    png = metrics.parent / "norms.png"
    assert rc == 0 and out.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", ["inspect", "diff", "verify"])
def test_a_negative_step_other_than_minus_1_is_usage_and_minus_1_is_the_latest(command, tmp_path, capsys):
    # Issue 24, point 2: `--step -2` printed a traceback and exited 1 (for diff, "different").
    np.savez(tmp_path / "a.npz", w=np.ones(2))
    rc, out, err = run(capsys, command, str(tmp_path / "a.npz"), "--step", "-2")
    assert rc == 2 and "Traceback" not in err and "-1 or `latest`" in err, err
    rc, _, err = run(capsys, "inspect", "--help")
    assert "-1 is the latest too" in " ".join(err.split()) or rc == 0
    rc, out, _ = run(capsys, "inspect", "--help")
    assert "-1 is the latest too" in " ".join(out.split())


def test_step_all_stats_columns_equal_numpy_per_step(tmp_path, capsys):
    # Issue 25: statistics across steps, one column per step, against numpy float64 of each step's leaf.
    rng = np.random.default_rng(3)
    root, truth = tmp_path / "run", {}
    with ocp.CheckpointManager(str(root)) as mgr:
        for step in (10, 20, 30):
            truth[step] = {"a": rng.standard_normal((8, 5)).astype(np.float32) * step,
                           "b": rng.uniform(-1, 1, 7).astype(np.float32)}
            mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(truth[step])))
        mgr.wait_until_finished()
    rc, out, _ = run(capsys, "inspect", root, "--step", "all", "--stats", "--stats-columns", "std,abs_max")
    assert rc == 0
    sections = out.split("[params] ")[1:]
    assert [s.split()[0] for s in sections] == ["std", "abs_max"]
    for section in sections:
        stat = section.split()[0]
        header = next(line.split() for line in section.splitlines() if line.startswith("path"))
        assert header == ["path", "10", "20", "30"]
        for leaf in ("a", "b"):
            (row,) = [line.split() for line in section.splitlines() if line.startswith(f"{leaf} ")]
            want = [np.std(truth[s][leaf].astype(np.float64)) if stat == "std"
                    else np.abs(truth[s][leaf].astype(np.float64)).max() for s in (10, 20, 30)]
            assert row[1:] == [f"{w:.4g}" for w in want], (stat, leaf)


def test_stats_columns_implies_stats(tmp_path, capsys):
    # Issue 24, point 8: `--stats-columns` without `--stats` was silently ignored (metadata only, no column).
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    w[0, :3] = 0
    np.savez(tmp_path / "w.npz", w=w)
    rc, text, err = run(capsys, "inspect", tmp_path / "w.npz", "--stats-columns", "l2,zeros")
    assert rc == 0, err
    header = next(line for line in text.splitlines() if line.startswith("path"))
    assert header.split()[-2:] == ["l2", "zeros"]
    row = next(line for line in text.splitlines() if line.split()[:1] == ["w"]).split()
    assert float(row[-2]) == pytest.approx(float(np.linalg.norm(w.astype(np.float64))), rel=1e-3)  # 4 digits shown
    assert int(row[-1]) == int((w == 0).sum()) == 3
    # In JSON too: every statistic, as with --stats.
    data = inspect_json(capsys, tmp_path / "w.npz", "--stats-columns", "l2")
    stats = data["checkpoints"][0]["items"]["default"]["leaves"][0]["stats"]
    assert stats["l2"] == pytest.approx(float(np.linalg.norm(w.astype(np.float64))), rel=1e-6)
    assert stats == pytest.approx(numpy_stats(w), rel=1e-5, abs=1e-6)
    rc, help_text, _ = run(capsys, "inspect", "--help")
    assert "implies --stats" in " ".join(help_text.split())


def test_a_help_that_cannot_be_written_is_an_error_whatever_its_length(monkeypatch, capsys):
    # argparse swallows an OSError of its own write: a help longer than stdout's buffer (8 KiB, `inspect --help`
    # with the format list) to a full disk ended with exit 0 and nothing written. Its text goes through the CLI's
    # output now, which reports it: one line, exit 1, as for any output that cannot be written.
    import errno
    import io

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    assert cli.main(["inspect", "--help"]) == 1
    assert capsys.readouterr().err == "treetools: error: cannot write to stdout (No space left on device).\n"
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert cli.main(["inspect", "--help"]) == 0 and len(sys.stdout.getvalue()) > 1000
