"""gs:// and s3:// checkpoints read in place, against real local servers (moto, fake-gcs-server).

Each checkpoint is written locally by its real writer, uploaded, then read
through the bucket; every result must equal the local read of the same files.
The servers sit behind a counting proxy (tests/_buckets.py), so a test can say
how many bytes a read moved.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization
from safetensors.numpy import save_file

import treetools as tt
from treetools.cli import main
from tests._t5x_writer import save_t5x


def _params(scale: float = 1.0) -> dict:
    rng = np.random.default_rng(0)
    return {
        "embed": (rng.standard_normal((64, 16)) * scale).astype(np.float32),
        "Dense_0": {"kernel": (rng.standard_normal((16, 32)) * scale).astype(np.float32),
                    "bias": np.arange(32, dtype=np.float32) * scale},
        "norm": {"scale": np.ones(16, jnp.bfloat16)},
    }


def _orbax_run(root, steps=(1, 2)) -> None:
    """A manager root with committed steps and two unfinished saves: an Orbax tmp folder (local disks), and a
    step folder without commit (on GCS, which has no atomic rename, Orbax writes in place and commits with
    ``commit_success.txt`` and the commit time in ``_CHECKPOINT_METADATA``)."""
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root, async_save=False)
    for s in steps:
        tt.save_checkpoint(mngr, s, {"params": _params(s), "data_iter": {"epoch": s}}, metrics={"loss": 1.0 / s})
    mngr.close()
    partial = os.path.join(root, f"{steps[-1] + 1}.orbax-checkpoint-tmp-1700000000")
    shutil.copytree(os.path.join(root, str(steps[-1])), partial)
    os.remove(os.path.join(partial, "_CHECKPOINT_METADATA"))
    with open(os.path.join(partial, "params", "_METADATA"), "w") as f:
        f.write("{ not json: a half-written save must never be parsed")
    in_place = os.path.join(root, str(steps[-1] + 2))
    shutil.copytree(os.path.join(root, str(steps[-1])), in_place)
    os.remove(os.path.join(in_place, "commit_success.txt"))
    with open(os.path.join(in_place, "_CHECKPOINT_METADATA")) as f:
        meta = json.load(f)
    del meta["commit_timestamp_nsecs"]
    with open(os.path.join(in_place, "_CHECKPOINT_METADATA"), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(in_place, "params", "_METADATA"), "w") as f:
        f.write("{ not json either")


def _json(args: list[str], capsys) -> tuple[int, dict]:
    code = main([*args, "--format", "json"])
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else {})


def _same_report(local: dict, remote: dict) -> None:
    """Everything but the path as typed is the same."""
    assert remote.pop("path").startswith(("s3://", "gs://"))
    local.pop("path")
    assert remote == local


def test_orbax_run_in_a_bucket_reads_as_on_disk(tmp_path, remote_store, capsys):
    root = tmp_path / "run"
    _orbax_run(str(root))
    remote_store.upload(root, "exp", "ckpts")
    url = remote_store.url("exp", "ckpts")

    for extra in ([], ["--stats"], ["--step", "all"], ["--step", "1", "--leaves"]):
        code_l, local = _json(["inspect", str(root), *extra], capsys)
        code_r, remote = _json(["inspect", url, *extra], capsys)
        assert (code_l, code_r) == (0, 0), extra
        _same_report(local, remote)
    assert remote["incomplete"] == ["3.orbax-checkpoint-tmp-1700000000", "4"]  # listed, never read (junk JSON)
    assert remote["steps"] == [1, 2]

    # --show, verify, diff local vs remote
    assert main(["inspect", url, "--show", "params/Dense_0/kernel[1:3, 2:5]", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    np.testing.assert_array_equal(np.array(shown["value"], np.float32), _params(2)["Dense_0"]["kernel"][1:3, 2:5])
    assert main(["verify", url]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert main(["diff", str(root), url, "--values"]) == 0
    capsys.readouterr()
    assert main(["diff", url, str(root), "--values", "--step", "1"]) == 0  # step 1 of both
    capsys.readouterr()
    assert main(["diff", url, "--step", "1", "--step", "2", "--values"]) == 1  # two remote steps: values differ
    assert "outside tolerance" in capsys.readouterr().out


def test_load_parameters_and_restore_onto_a_mesh(tmp_path, remote_store, devices):
    root = tmp_path / "run"
    _orbax_run(str(root))
    remote_store.upload(root, "ckpts")
    url = remote_store.url("ckpts")

    local = tt.load_parameters(str(root), step=1)
    remote = tt.load_parameters(url, step=1)
    assert jax.tree.structure(remote) == jax.tree.structure(local)
    jax.tree.map(np.testing.assert_array_equal, remote, local)

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    shardings = {
        "embed": jax.NamedSharding(mesh, jax.P("data", "model")),
        "Dense_0": {"kernel": jax.NamedSharding(mesh, jax.P(None, "model")),
                    "bias": jax.NamedSharding(mesh, jax.P())},
        "norm": {"scale": jax.NamedSharding(mesh, jax.P("model"))},
    }
    target = tt.make_abstract(_params(), shardings)
    out = tt.restore_checkpoint(url, "latest", {"params": target, "data_iter": None})
    want = tt.restore_checkpoint(str(root), "latest", {"params": target, "data_iter": None})
    assert out["data_iter"] == want["data_iter"] == {"epoch": 2}
    for got, exp in zip(jax.tree.leaves(out["params"]), jax.tree.leaves(want["params"])):
        assert got.sharding == exp.sharding and got.dtype == exp.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
    # each device holds only its block: the embed shard on device 0 is rows 0:16, columns 0:8
    shard = out["params"]["embed"].addressable_shards[0]
    np.testing.assert_array_equal(np.asarray(shard.data), _params(2)["embed"][shard.index])

    with pytest.raises(tt.CheckpointMismatchError, match="shape"):
        bad = dict(target, embed=jax.ShapeDtypeStruct((64, 18), np.float32, sharding=shardings["embed"]))
        tt.restore_checkpoint(url, 1, {"params": bad})


def _write_format(kind: str, where) -> str:
    """One checkpoint of ``kind`` written by its own writer under ``where``; its local path."""
    params = _params()
    flat = {"/".join(k): v for k, v in _flatten(params).items()}
    os.makedirs(where, exist_ok=True)
    if kind == "t5x":
        state = {"target": params, "state": {"step": np.int64(7), "param_states": {"embed": np.zeros(4, np.float32)}}}
        save_t5x(os.path.join(where, "model"), 7, state, target_elements=256)
        save_t5x(os.path.join(where, "model"), 9, state, finish=False)  # an interrupted save
        return os.path.join(where, "model")
    if kind == "safetensors":
        path = os.path.join(where, "model.safetensors")
        save_file({k: np.asarray(v, np.float32) for k, v in flat.items()}, path)
        return path
    if kind == "hf-sharded":
        names = sorted(flat)
        shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
        for shard, keys in shards.items():
            save_file({k: np.asarray(flat[k], np.float32) for k in keys}, os.path.join(where, shard))
        index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
        with open(os.path.join(where, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        return where
    if kind == "flax-msgpack":
        for step in (3, 4):
            with open(os.path.join(where, f"checkpoint_{step}"), "wb") as f:
                f.write(serialization.to_bytes({"params": params, "step": step}))
        return where
    if kind == "npz":
        path = os.path.join(where, "w.npz")
        np.savez(path, **flat)
        return path
    if kind == "levanter":  # issue 29's formats: a run with a preempted step, a trainer folder, single files
        from tests.test_format_levanter import write_run

        write_run(os.path.join(where, "run"))
        return os.path.join(where, "run")
    if kind == "easydel":
        from tests.test_format_easydel import write_trainer_run

        write_trainer_run(os.path.join(where, "out"))
        return os.path.join(where, "out")
    if kind == "equinox":
        path = os.path.join(where, "model.eqx")
        with open(path, "wb") as f:
            for value in flat.values():
                np.save(f, value)  # what eqx.tree_serialise_leaves writes, leaf after leaf
        return path
    if kind == "keras":
        h5py = pytest.importorskip("h5py")
        path = os.path.join(where, "model.weights.h5")
        with h5py.File(path, "w") as f:  # Keras's layout: layers/<name>/vars/<i>
            for i, value in enumerate(flat.values()):
                f.create_dataset(f"layers/dense/vars/{i}", data=np.asarray(value, np.float32))
        return path
    raise AssertionError(kind)


def _flatten(tree: dict, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
    return out


@pytest.mark.parametrize("kind", ["t5x", "safetensors", "hf-sharded", "flax-msgpack", "npz", "levanter", "easydel",
                                  "equinox", "keras"])
def test_every_format_reads_in_place(tmp_path, remote_store, capsys, kind):
    local = _write_format(kind, str(tmp_path / "ckpt"))
    rel = os.path.relpath(local, tmp_path)
    remote_store.upload(tmp_path / "ckpt", "ckpt")
    url = remote_store.url(*rel.split(os.sep))
    for extra in ([], ["--stats", "--leaves"]):
        code_l, want = _json(["inspect", local, *extra], capsys)
        code_r, got = _json(["inspect", url, *extra], capsys)
        assert (code_l, code_r) == (0, 0), (kind, extra)
        _same_report(want, got)
    assert main(["verify", url]) == 0
    capsys.readouterr()
    jax.tree.map(np.testing.assert_array_equal, tt.load_parameters(url), tt.load_parameters(local))
    if kind == "t5x":
        assert got["incomplete"] == ["checkpoint_9.tmp-1700000000"]
    if kind in ("levanter", "easydel"):
        assert got["incomplete"] == {"levanter": ["step-30"], "easydel": ["run-15"]}[kind]


def test_metadata_mode_moves_only_metadata(tmp_path, remote_store, capsys):
    """A 64 MiB array: inspect without --stats transfers a few KB (counted at the server), --stats all of it."""
    big = np.random.default_rng(1).standard_normal((4096, 4096)).astype(np.float32)  # 64 MiB
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "run", async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": {"w": big, "b": np.zeros(8, np.float32)}})
    mngr.close()
    save_file({"w": big}, str(tmp_path / "m.safetensors"))
    remote_store.upload(tmp_path / "run", "run")
    remote_store.upload(tmp_path / "m.safetensors", "m.safetensors")

    for url in (remote_store.url("run"), remote_store.url("m.safetensors")):
        remote_store.counter.reset()
        assert main(["inspect", url]) == 0
        requests, moved = remote_store.counter.snapshot()
        assert moved < 256 * 1024, (url, requests, moved)  # metadata only: headers, listings, JSON
        capsys.readouterr()
    remote_store.counter.reset()
    assert main(["inspect", remote_store.url("m.safetensors"), "--stats"]) == 0
    assert remote_store.counter.snapshot()[1] >= big.nbytes  # --stats reads every byte, once
    assert remote_store.counter.snapshot()[1] < 1.2 * big.nbytes


def test_a_standalone_save_in_a_bucket_is_inspected_in_its_own_folder(tmp_path, remote_store, capsys):
    """A StandardCheckpointer save given directly: its handler is asked of the step folder above it only when it
    decides what is read (one leaf `checkpoint`), so a metadata inspect asks for nothing outside the folder.

    It asked whether the bucket's top level held a `_CHECKPOINT_METADATA` naming the folder (3 requests on GCS,
    2 on S3, at every inspect). Counted at the server, cold (a fresh bucket, as each CLI run is): the folder's own
    probe (2: gcsfs' object GET beside a one-key listing; s3fs' HEAD, then a one-key listing), the one listing of
    everything below it, `_METADATA` (no `_sharding`: host arrays), the OCDBT manifest and b-tree root read for
    the budget check, the same two read by TensorStore, `_CHECKPOINT_METADATA`: 9 (12 and 11 before).
    """
    import orbax.checkpoint as ocp

    local = tmp_path / "standalone"
    tree = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.ones(6, np.float32)}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(local, tree)
    url = remote_store.upload(local, "standalone")
    code_l, want = _json(["inspect", str(local)], capsys)
    remote_store.counter.reset()
    code_r, got = _json(["inspect", url], capsys)
    requests, _ = remote_store.counter.snapshot()
    assert (code_l, code_r) == (0, 0)
    _same_report(want, got)
    outside = [(m, p) for m, p in remote_store.counter.seen() if "standalone" not in urllib.parse.unquote(p)]
    assert outside == [], outside
    assert requests <= 9, remote_store.counter.seen()


def test_bucket_errors_are_one_line(tmp_path, remote_store, capsys):
    scheme = remote_store.scheme
    assert main(["inspect", f"{scheme}://no-such-bucket-tt/ckpt"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("treetools: error:") and "no such bucket 'no-such-bucket-tt'" in err and "\n" not in err

    assert main(["inspect", remote_store.url("nothing", "here")]) == 1
    err = capsys.readouterr().err.strip()
    assert "no such file or folder" in err and "\n" not in err

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("not a checkpoint")
    remote_store.upload(tmp_path / "notes", "notes")
    assert main(["inspect", remote_store.url("notes")]) == 1
    err = capsys.readouterr().err.strip()
    assert "not a checkpoint that treetools can read" in err and "\n" not in err

    with pytest.raises(tt.CheckpointNotFoundError, match="no such bucket"):
        tt.load_parameters(f"{scheme}://no-such-bucket-tt/run")


def test_a_remote_path_without_the_extra_names_it(tmp_path, remote_store):
    """With gcsfs / s3fs absent (import blocked), a remote path is one line naming the `remote` extra."""
    package = {"s3": "s3fs", "gs": "gcsfs"}[remote_store.scheme]
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            "from treetools.cli import main\n"
            f"raise SystemExit(main(['inspect', {remote_store.url('x')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **remote_store.env})
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip()
    assert "pip install 'jax-treetools[remote]'" in err and package in err and "\n" not in err


def test_local_paths_never_import_the_remote_clients(tmp_path):
    np.savez(tmp_path / "w.npz", w=np.ones(3))
    code = ("import sys\nfrom treetools.cli import main\n"
            f"assert main(['inspect', {str(tmp_path / 'w.npz')!r}]) == 0\n"
            "bad = [m for m in ('s3fs', 'gcsfs', 'fsspec', 'botocore') if m in sys.modules]\n"
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def s3_with_auth(s3_store, monkeypatch):
    """The S3 server checking signatures and IAM policies (moto's auth switched on), with a user allowed
    everything and one allowed nothing: ``(store, {name: (key id, secret)})``."""
    import boto3
    import moto.settings

    iam = boto3.client("iam", endpoint_url=s3_store.endpoint, region_name="us-east-1")
    keys = {}
    for user, actions in (("admin", "*"), ("nobody", None)):
        name = f"{user}-{s3_store.bucket}"
        iam.create_user(UserName=name)
        if actions:
            iam.put_user_policy(UserName=name, PolicyName="all", PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    return s3_store, keys


def test_s3_credential_errors_are_one_line(tmp_path, s3_with_auth):
    store, keys = s3_with_auth
    np.savez(tmp_path / "w.npz", w=np.arange(4.0))
    admin_id, admin_secret = keys["admin"]
    base = {**os.environ, **store.env, "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    subprocess.run([sys.executable, "-c", "import s3fs; s3fs.S3FileSystem().put_file(*__import__('sys').argv[1:])",
                    str(tmp_path / "w.npz"), f"{store.bucket}/w.npz"], check=True, timeout=120,
                   env={**base, "AWS_ACCESS_KEY_ID": admin_id, "AWS_SECRET_ACCESS_KEY": admin_secret})
    url = store.url("w.npz")

    def cli(**env):
        full = {k: v for k, v in {**base, **env}.items() if v is not None}
        return subprocess.run([sys.executable, "-m", "treetools", "inspect", url, "--stats"], env=full,
                              capture_output=True, text=True, timeout=120)

    ok = cli(AWS_ACCESS_KEY_ID=admin_id, AWS_SECRET_ACCESS_KEY=admin_secret)
    assert ok.returncode == 0 and "w" in ok.stdout, ok.stderr
    for env, words in (
        (dict(AWS_ACCESS_KEY_ID=keys["nobody"][0], AWS_SECRET_ACCESS_KEY=keys["nobody"][1]), "permission denied"),
        (dict(AWS_ACCESS_KEY_ID=admin_id, AWS_SECRET_ACCESS_KEY="wrong"), "permission denied"),
        (dict(AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None), "no credentials for s3://"),
    ):
        proc = cli(**env)
        lines = [l for l in proc.stderr.splitlines() if l.startswith("treetools:")]
        assert proc.returncode == 1 and len(lines) == 1 and words in lines[0], (env, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr


def _gcs_refusing(status: int, message: str):
    """A local server answering every request as GCS refuses one: ``status`` with GCS's JSON error body.

    fake-gcs-server takes any caller, so the two refusals users meet (an
    anonymous caller, 401; a caller without the permission, 403) come from here,
    with the texts GCS sends."""
    import http.server
    import threading

    body = json.dumps({"error": {"code": status, "message": message,
                                 "errors": [{"message": message, "domain": "global", "reason": "required"}]}}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _refuse(self):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_POST = _refuse

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("status, message, words", [
    (401, "Anonymous caller does not have storage.objects.list access to the Google Cloud Storage bucket. "
          "Permission 'storage.objects.list' denied on resource (or it may not exist).", "no credentials for gs://"),
    (403, "ci@proj.iam.gserviceaccount.com does not have storage.objects.list access to the Google Cloud Storage "
          "bucket. Permission 'storage.objects.list' denied on resource (or it may not exist).", "permission denied"),
])
def test_gcs_refusals_are_one_line(tmp_path, status, message, words):
    server = _gcs_refusing(status, message)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        env = {**os.environ, "STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}
        for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"):
            env.pop(name, None)
        proc = subprocess.run([sys.executable, "-m", "treetools", "inspect", "gs://private-bucket/run"], env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    lines = [l for l in proc.stderr.splitlines() if l.startswith("treetools:")]
    assert proc.returncode == 1 and len(lines) == 1 and words in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "hint" not in lines[0]


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Waits:
    """Every TCP connection attempt (address, timeout) and every bounded wait (``storage._within``'s timeout) made
    while it is installed: what a command waits on, read from the calls rather than from a clock (issue 39.2)."""

    def __init__(self, monkeypatch):
        import socket

        from treetools.checkpoint_io.storage import reach as storage

        self.attempts: list[tuple[tuple[str, int], float | None]] = []
        self.waits: list[float] = []
        connect, within = socket.create_connection, storage._within

        def recorded_connect(address, timeout=None, *args, **kwargs):
            self.attempts.append((tuple(address), timeout))
            return connect(address, timeout, *args, **kwargs)

        def recorded_within(timeout, fn, late):
            self.waits.append(timeout)
            return within(timeout, fn, late)

        monkeypatch.setattr(socket, "create_connection", recorded_connect)
        monkeypatch.setattr(storage, "_within", recorded_within)


def test_an_unreachable_gcs_endpoint_fails_after_one_bounded_wait_with_one_line(tmp_path, monkeypatch, capsys):
    # Issue 24.16: offline, `inspect gs://...` waited ~50 s in silence (gcsfs's retries) before its error. Now one
    # connection attempt, bounded by REACH_TIMEOUT, decides it, and gcsfs is never asked.
    gcsfs_core = pytest.importorskip("gcsfs.core")
    from treetools.checkpoint_io import storage
    from treetools.checkpoint_io.storage import reach

    port = _closed_port()
    url = f"http://127.0.0.1:{port}"  # nothing listens there: as unreachable as the cloud offline
    env = {**os.environ, "STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    for argv in (["inspect", "gs://bucket/run/checkpoints"], ["diff", "gs://bucket/a", "gs://bucket/b"]):
        proc = subprocess.run([sys.executable, "-m", "treetools", *argv], env=env, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == (2 if argv[0] == "diff" else 1) and proc.stdout == ""
        assert proc.stderr == (f"treetools: error: {argv[1]}: cannot reach {url} ({url[7:]} refused the connection): "
                               "is the GCS emulator that STORAGE_EMULATOR_HOST names running? Start it, or unset the "
                               "variable.\n")
    # What it waits on, in process: the one attempt and its bound; gcsfs (and its retries) never reached.
    for name in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
        monkeypatch.setenv(name, url)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setattr(storage.schemes, "_BACKENDS", {})  # this process's first gs:// URL
    monkeypatch.setattr(gcsfs_core, "GCSFileSystem", lambda *a, **k: pytest.fail("gcsfs was asked"))
    recorded = _Waits(monkeypatch)
    assert main(["inspect", "gs://bucket/run/checkpoints"]) == 1
    assert "refused the connection" in capsys.readouterr().err
    assert recorded.attempts == [(("127.0.0.1", port), reach.REACH_TIMEOUT)]
    assert recorded.waits == [reach.REACH_TIMEOUT + 0.5] and reach.REACH_TIMEOUT <= 3


def test_gcs_credentials_are_decided_without_waiting_for_a_metadata_server(tmp_path, monkeypatch):
    # Issue 24.16: without credentials, gcsfs asked a metadata server that is not there for ~15 s; now "anon" at
    # once (a public bucket still reads; a private one says "no credentials"), Google's own search where a
    # credentials file or a metadata server is there.
    import socket
    import threading

    from treetools.checkpoint_io.storage import reach as storage

    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GCE_METADATA_IP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    port = _closed_port()
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{port}")
    try:  # gcsfs's own search (google-auth), which waits ~15 s for a metadata server that is not there: not asked
        import google.auth

        monkeypatch.setattr(google.auth, "default", lambda *a, **k: pytest.fail("google.auth.default was asked"))
    except ImportError:
        pass
    recorded = _Waits(monkeypatch)
    assert storage.gcs_token() == "anon"
    # one attempt at the metadata server, bounded by METADATA_TIMEOUT (not a clock reading: issue 39.2)
    assert recorded.attempts == [(("127.0.0.1", port), storage.METADATA_TIMEOUT)]
    assert recorded.waits == [storage.METADATA_TIMEOUT + 0.5] and storage.METADATA_TIMEOUT <= 1
    adc = tmp_path / ".config" / "gcloud" / "application_default_credentials.json"
    adc.parent.mkdir(parents=True)
    adc.write_text("{}")
    assert storage.gcs_token() is None  # gcsfs's own search finds that file first
    adc.unlink()
    with socket.socket() as server:  # a metadata server, answering as Google's does
        server.bind(("127.0.0.1", 0))
        server.listen()

        def answer():
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.0 200 OK\r\nMetadata-Flavor: Google\r\n\r\ncomputeMetadata/\n")

        threading.Thread(target=answer, daemon=True).start()
        monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{server.getsockname()[1]}")
        assert storage.gcs_token() is None
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")
    assert storage.gcs_token() == "anon"
