"""Checkpoints: pickle-free layout, atomic commit (a real SIGKILL in the middle of a save), the fingerprint
manifest catching a one-bit flip by tensor name, and `detrace verify-checkpoint`'s exit codes."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _ranks import spawn_ranks
from _tools import flip_one_bit

from detrace.cli import main as detrace
from detrace.digest.scheme import Fingerprint
from detrace.errors import CheckpointCorrupted, CheckpointError
from detrace.state import TrainState, verify_checkpoint


def make_state(seed: int = 0, *, head: bool = False, outputs: int = 3) -> TrainState:
    """A small model with AdamW after one step: parameters and optimizer moments to save."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, outputs))
    if head:
        model.append(torch.nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 6)).square().sum().backward()
    optimizer.step()
    return TrainState(model=model, optimizer=optimizer)


def test_layout_is_sharded_atomic_and_pickle_free(tmp_path: Path) -> None:
    state = make_state()
    state.step = 7
    version = state.save(tmp_path)
    assert version == tmp_path / "step-00000007"
    assert (tmp_path / "latest").read_text() == "step-00000007\n"
    names = sorted(path.name for path in version.iterdir())
    assert names == ["__0_0.distcp", "dcp_metadata.json", "manifest.json", "rank-0.json"]
    for path in version.iterdir():
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:  # torch.save records (zip archives), which DCP reads back with weights_only=True
            assert path.read_bytes()[:2] == b"PK"
    manifest = json.loads((version / "manifest.json").read_text())
    assert manifest["schema"] == "detrace.checkpoint/2"
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert {"model.0.weight", "optimizer.state.0.weight.exp_avg", "rank0.rng.torch"} <= set(manifest["tensors"])
    assert set(manifest["files"]) == {"dcp_metadata.json", "rank-0.json"}
    # The rank's file holds the skeleton of its model/optimizer state (ranks may differ) and of its own.
    own = json.loads((version / "rank-0.json").read_text())
    assert own["rank"] == 0 and own["step"] == 7 and set(own["local"]) == {"rng", "extra"}
    hyper = own["shared"]["optimizer"]["param_groups"][0]
    assert hyper["lr"] == 0.01 and hyper["betas"] == {"__tuple__": [0.9, 0.999]}
    assert own["shared"]["model"]["0.weight"] == {"__tensor__": "model.0.weight"}


def test_load_restores_the_saved_bits(tmp_path: Path) -> None:
    state = make_state(seed=0)
    state.step = 3
    state.save(tmp_path)
    other = make_state(seed=1)
    assert other.load(tmp_path) == 3 and other.step == 3
    for a, b in zip(state.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    saved, loaded = state.optimizer.state_dict(), other.optimizer.state_dict()
    assert all(torch.equal(saved["state"][0][k], loaded["state"][0][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert loaded["param_groups"][0]["betas"] == (0.9, 0.999)


def test_saves_keep_the_latest_versions(tmp_path: Path) -> None:
    state = make_state()
    for step in (1, 2, 2):
        state.step = step
        state.save(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step-00000002.1"]
    state.step = 3
    state.save(tmp_path, keep=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step-00000002.1", "step-00000003"]
    assert verify_checkpoint(tmp_path / "step-00000002.1").step == 2


def test_a_flipped_bit_is_reported_by_tensor_name(tmp_path: Path) -> None:
    state = make_state()
    version = state.save(tmp_path)
    flip_one_bit(version, state.model[2].weight)
    with pytest.raises(CheckpointCorrupted, match=r"tensor 'model\.2\.weight'") as caught:
        verify_checkpoint(tmp_path)
    assert caught.value.exit_code == 1
    other = make_state(seed=1)
    before = [parameter.clone() for parameter in other.model.parameters()]
    with pytest.raises(CheckpointCorrupted, match=r"'model\.2\.weight'"):
        other.load(tmp_path)
    assert all(map(torch.equal, before, other.model.parameters()))  # nothing was loaded


def test_manifests_of_either_fingerprint_scheme_verify_whatever_the_scheme_in_force(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest names its fingerprint scheme; one without the key (written before fp2) is fp1, and verify and load
    recompute each manifest's own scheme, whatever DETRACE_FINGERPRINT_SCHEME says now."""
    state = make_state()
    old = state.save(tmp_path / "fp1")
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest.pop("fingerprint") == "detrace-fp1"
    (old / "manifest.json").write_text(json.dumps(manifest))  # as written before fp2 existed
    monkeypatch.setenv("DETRACE_FINGERPRINT_SCHEME", "fp2")
    new = state.save(tmp_path / "fp2")
    manifest2 = json.loads((new / "manifest.json").read_text())
    assert manifest2["fingerprint"] == "detrace-fp2"
    assert manifest2["tensors"]["model.2.weight"] != manifest["tensors"]["model.2.weight"]
    assert verify_checkpoint(old).fingerprint == "detrace-fp1"
    make_state(seed=1).load(tmp_path / "fp1")
    monkeypatch.setenv("DETRACE_FINGERPRINT_SCHEME", "fp1")
    assert verify_checkpoint(new).fingerprint == "detrace-fp2"
    flip_one_bit(new, state.model[2].weight)
    with pytest.raises(CheckpointCorrupted, match=r"tensor 'model\.2\.weight'"):
        verify_checkpoint(new)


def test_an_edited_state_file_is_reported_by_name(tmp_path: Path) -> None:
    version = make_state().save(tmp_path)
    text = (version / "rank-0.json").read_text().replace("0.01", "0.02")
    (version / "rank-0.json").write_text(text)
    with pytest.raises(CheckpointCorrupted, match=r"file rank-0\.json does not match its checksum"):
        verify_checkpoint(tmp_path)
    with pytest.raises(CheckpointCorrupted, match=r"file rank-0\.json does not match its checksum"):
        make_state().load(tmp_path)


def test_a_checkpoint_of_another_format_version_is_refused(tmp_path: Path) -> None:
    """Format 1 kept one state.json for every rank; a format 1 (or a future) checkpoint is refused by name,
    before anything is read, by verify-checkpoint and by load alike."""
    version = make_state().save(tmp_path)
    manifest = version / "manifest.json"
    for schema in ("detrace.checkpoint/1", "detrace.checkpoint/3"):
        document = json.loads(manifest.read_text())
        document.update(schema=schema, detrace="0.0.1")
        manifest.write_text(json.dumps(document))
        message = rf"written by detrace 0\.0\.1 in checkpoint format {schema}, and this detrace reads only .*/2"
        with pytest.raises(CheckpointError, match=message):
            verify_checkpoint(tmp_path)
        other = make_state(seed=1)
        before = [parameter.clone() for parameter in other.model.parameters()]
        with pytest.raises(CheckpointError, match=message):
            other.load(tmp_path)
        assert all(map(torch.equal, before, other.model.parameters()))
    document.update(schema="someone.else/1")
    manifest.write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match=r"is not a detrace checkpoint manifest \(detrace\.checkpoint/2\)"):
        verify_checkpoint(tmp_path)


def test_a_checkpoint_of_another_model_or_world_size_is_refused(tmp_path: Path) -> None:
    make_state().save(tmp_path)
    with pytest.raises(CheckpointError, match=r"training state has tensor 'model\.3\.bias'"):
        make_state(head=True).load(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds tensor 'optimizer\.state\.0\.bias\.exp_avg' that this"):
        TrainState(model=make_state().model).load(tmp_path)
    narrower = make_state(outputs=2)
    before = [parameter.clone() for parameter in narrower.model.parameters()]
    with pytest.raises(CheckpointError, match=r"does not fit this training state: Size mismatch .* for model\.2\.bias"):
        narrower.load(tmp_path)
    assert all(map(torch.equal, before, narrower.model.parameters()))
    manifest = tmp_path / "step-00000000" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"world_size": 1', '"world_size": 2'))
    with pytest.raises(CheckpointError, match="saved by 2 ranks and cannot resume 1"):
        make_state().load(tmp_path)


# --- a real crash in the middle of a save ------------------------------------------------------------------

CRASHING_SAVER = """
import pathlib, sys, time
import torch
import torch.distributed.checkpoint.filesystem as filesystem
from detrace.state import TrainState

root, marker = sys.argv[1], pathlib.Path(sys.argv[2])
model = torch.nn.Linear(32, 32)
state = TrainState(model=model)
state.step = 1
state.save(root)

# Injected fault (test only): the next save stalls after writing its first tensor record, so that the
# parent can SIGKILL the process in the middle of it.
write_item = filesystem._write_item
def stalling_write_item(*args, **kwargs):
    result = write_item(*args, **kwargs)
    marker.touch()
    time.sleep(120)
    return result
filesystem._write_item = stalling_write_item

with torch.no_grad():
    model.weight.add_(1.0)
state.step = 2
state.save(root)
"""


@pytest.mark.slow
def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    root, marker = tmp_path / "ckpt", tmp_path / "in-save"
    with subprocess.Popen([sys.executable, "-c", CRASHING_SAVER, str(root), str(marker)]) as process:
        deadline = time.monotonic() + 120
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the save never started"
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL

    assert (root / "latest").read_text() == "step-00000001\n"
    assert list(root.glob(".tmp-*/*.distcp"))  # the half-written save, invisible (its writer's lock now free)
    assert verify_checkpoint(root).step == 1
    model = torch.nn.Linear(32, 32)
    state = TrainState(model=model)
    assert state.load(root) == 1
    saved_weight = model.weight.detach().clone()

    state.step = 2  # the next save clears the debris and commits
    state.save(root)
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step-00000002"]
    assert TrainState(model=torch.nn.Linear(32, 32)).load(root) == 2
    assert torch.equal(model.weight, saved_weight)


def test_a_save_removes_only_what_dead_writers_left(tmp_path: Path) -> None:
    """Two jobs saving into one root: a save clears the debris of writers whose lock is free (dead), never the
    temporary directory of a writer that holds its lock (another job's save in progress)."""
    import fcntl

    root = tmp_path / "ckpt"
    root.mkdir()
    live, dead = root / ".tmp-00000000000000aa", root / ".tmp-00000000000000bb"
    for directory in (live, dead, root / ".tmp-step-00000003"):  # the last: an older detrace's debris
        directory.mkdir()
        (directory / "__0_0.distcp").write_bytes(b"part")
    (root / ".tmp-00000000000000bb.lock").touch()  # its writer died: nobody holds it
    with (root / ".tmp-00000000000000aa.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other job's rank 0, still writing
        state = make_state()
        state.step = 1
        state.save(root)
        left = sorted(path.name for path in root.iterdir())
        assert left == [".tmp-00000000000000aa", ".tmp-00000000000000aa.lock", "latest", "step-00000001"]
        assert (live / "__0_0.distcp").read_bytes() == b"part"
    # Its process gone (the lock free), the next save removes what it left.
    state.save(root, step=2)
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step-00000002"]


# --- detrace verify-checkpoint -----------------------------------------------------------------------------


def test_verify_checkpoint_command_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = make_state()
    version = state.save(tmp_path / "ckpt")
    assert detrace(["verify-checkpoint", str(tmp_path / "ckpt")]) == 0
    assert "step 0" in capsys.readouterr().out

    (tmp_path / "empty").mkdir()
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "manifest.json").write_text("{not json")
    for path, message in [
        (tmp_path / "missing", "there is no checkpoint at"),
        (tmp_path / "empty", "is not a detrace checkpoint"),
        (tmp_path / "garbled", "manifest.json is not valid JSON"),
    ]:
        assert detrace(["verify-checkpoint", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("detrace verify-checkpoint: error: ") and message in err
    assert detrace(["verify-checkpoint"]) == 2

    flip_one_bit(version, state.model[0].bias)
    assert detrace(["verify-checkpoint", str(version)]) == 1
    assert "'model.0.bias'" in capsys.readouterr().err


def test_a_latest_that_names_no_version_is_quoted_short_and_sanitized(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n" * 40 + "the last line\n")
    for name, make in [("binary", lambda p: p.write_bytes(b"step-\xff\xfe\x00\x1b[31m\n")),
                       ("linked", lambda p: p.symlink_to(secret))]:
        root = tmp_path / name
        root.mkdir()
        make(root / "latest")
        assert detrace(["verify-checkpoint", str(root)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "does not name a checkpoint version" in err and "Traceback" not in err
        assert "\x1b" not in err and "the last line" not in err and len(err) < 300 + len(str(root))


@pytest.mark.slow
def test_verify_checkpoint_command_in_a_real_process(tmp_path: Path) -> None:
    state = make_state()
    flip_one_bit(state.save(tmp_path), state.model[2].bias)
    done = subprocess.run(
        [sys.executable, "-m", "detrace", "verify-checkpoint", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 1
    assert "tensor 'model.2.bias'" in done.stderr and "Traceback" not in done.stderr


# --- errors on 2 ranks: every rank raises, none hangs ------------------------------------------------------


def _batchnorm_resumes(rank: int, root: Path) -> dict[str, bool]:
    import torch.distributed as dist

    """A DDP model with BatchNorm, whose ranks' running statistics differ after a step (each rank's forward
    updates its own; DDP broadcasts rank 0's at the next forward): saved, trained one more step, restored and
    trained that step again. Whether each rank got its own statistics back, and whether the step after the
    restore is the continuous run's, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=optimizer)

    def step(seed: int) -> list[torch.Tensor]:
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed + 100 * rank))  # each rank its batch
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return [tensor.detach().clone() for tensor in model.module.state_dict().values()]

    def statistics() -> list[torch.Tensor]:  # this rank's running mean and the other rank's
        mean = model.module[1].running_mean.clone()
        gathered = [torch.empty_like(mean) for _ in range(2)]
        dist.all_gather(gathered, mean)
        return gathered

    own = step(1)
    ranks_differ = not torch.equal(*statistics())
    state.end_of_step(1)
    state.save(root)
    continuous = step(2)
    state.load(root)
    restored = [tensor.detach().clone() for tensor in model.module.state_dict().values()]
    resumed = step(2)
    return {"own_restored": all(torch.equal(a, b) for a, b in zip(own, restored, strict=True)),
            "statistics_differ": ranks_differ,
            "exact": all(torch.equal(a, b) for a, b in zip(continuous, resumed, strict=True))}


def _two_ranks(rank: int, root: str, port: int) -> None:
    import torch.distributed as dist

    from detrace._exit import leave

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    errors = {}
    # Rank 1 alone holds a value that cannot be stored without pickle.
    unsaveable = TrainState(model=model, extra={"schedule": (lambda step: step) if rank == 1 else 0})
    try:
        unsaveable.save(root)
    except CheckpointError as err:
        errors["save"] = str(err)
    state = TrainState(model=model)
    version = state.save(root)
    dist.barrier()
    if rank == 0:  # damage the chunk that rank 1 verifies (chunks are shared out in name order)
        flip_one_bit(version, model.module.weight)
    dist.barrier()
    try:
        state.load(root)
    except CheckpointCorrupted as err:
        errors["load"] = str(err)
    errors["batchnorm"] = _batchnorm_resumes(rank, Path(root) / "bn")
    Path(root, f"errors-{rank}.json").write_text(json.dumps(errors))
    dist.barrier()
    dist.destroy_process_group()
    leave(0)  # gloo's threads outlive the group: no interpreter finalization to race with


@pytest.mark.slow
def test_a_failure_on_one_rank_stops_every_rank_and_ranks_keep_their_own_buffers(tmp_path: Path) -> None:
    spawn_ranks(_two_ranks, (str(tmp_path),), timeout=180)
    errors = [json.loads((tmp_path / f"errors-{rank}.json").read_text()) for rank in range(2)]
    assert "another rank failed to prepare" in errors[0]["save"]
    assert "cannot save 'rank1.extra.schedule'" in errors[1]["save"]
    # Rank 0 checks model.bias (first in name order), rank 1 model.weight, which was damaged.
    assert "another rank found damage" in errors[0]["load"]
    assert "tensor 'model.weight'" in errors[1]["load"]
    # BatchNorm under DDP: every rank gets its own running statistics back, and the resume is exact.
    assert all(rank_errors["batchnorm"] == {"own_restored": True, "statistics_differ": True, "exact": True}
               for rank_errors in errors), errors


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scheduler": True}, "holds model, optimizer; this TrainState has model, optimizer, scheduler"),
        ({"extra": {"tokens": 0}}, r"holds extra state \[\], this TrainState has \['tokens'\]"),
        ({"generators": (torch.Generator(),)}, "holds 0 explicit generators, this TrainState was given 1"),
        ({"data": True}, "disagree on whether there is data state"),
    ],
)
def test_a_checkpoint_with_other_parts_is_refused_before_anything_is_loaded(
    tmp_path: Path, change: dict, message: str
) -> None:
    from detrace.state import ResumableSampler

    make_state(seed=0).save(tmp_path)
    mine = make_state(seed=1)
    if change.pop("scheduler", False):
        change["scheduler"] = torch.optim.lr_scheduler.StepLR(mine.optimizer, step_size=1)
    if change.pop("data", False):
        change["data"] = ResumableSampler(4)
    other = TrainState(model=mine.model, optimizer=mine.optimizer, **change)
    before = [parameter.clone() for parameter in other.model.parameters()]
    with pytest.raises(CheckpointError, match=message):
        other.load(tmp_path)
    assert all(map(torch.equal, before, other.model.parameters()))


@pytest.mark.parametrize(("where", "message"), [
    ("file", "is a file, not a directory"),
    ("under", "cannot be created: {blocker} is a file"),
    ("unwritable", "cannot be created: Operation not permitted"),
])
def test_an_unusable_checkpoint_directory_is_one_sentence(tmp_path: Path, where: str, message: str) -> None:
    """F5: DETRACE_CKPT_DIR naming a file, a path under a file, or a place that cannot be written."""
    blocker = tmp_path / "plain"
    blocker.write_text("not a directory")
    # /sys refuses every mkdir, even root's (the tests may run as root, to whom chmod forbids nothing)
    root = {"file": blocker, "under": blocker / "ckpt", "unwritable": Path("/sys/detrace-ckpt")}[where]
    with pytest.raises(CheckpointError) as caught:
        make_state().save(root)
    assert str(caught.value) == f"checkpoint directory {root} " + message.format(blocker=blocker)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("tensors", None, "field 'tensors' must be an object"),
    ("step", "one", "field 'step' must be a non-negative integer"),
    ("world_size", "x", "field 'world_size' must be a positive integer"),
    ("files", [1], "field 'files' must be an object"),
    ("tensors", {"model.0.weight": [{"offsets": "x"}]}, "the chunks of tensor 'model.0.weight' must be"),
    ("fingerprint", "detrace-fp9", "field 'fingerprint' must be one of detrace-fp1, detrace-fp2"),
    ("tensors", {"model.0.weight": [{"offsets": [0, 0], "digest": "0", "dtype": "float32", "shape": [5, 6],
                                     "numel": 30, "data_at": -1, "frame": "0"}]},
     "the chunks of tensor 'model.0.weight' must be"),
    ("tensors", {"model.0.weight": [{"offsets": [0, 0], "digest": "0", "dtype": "qint8", "shape": [5, 6],
                                     "numel": 30, "data_at": 0, "frame": "0"}]},
     "the chunks of tensor 'model.0.weight' must be"),
])
def test_a_manifest_of_wrong_types_is_refused_by_verify_and_load_alike(
        tmp_path: Path, field: str, value: object, words: str, capsys: pytest.CaptureFixture[str]) -> None:
    """F6: verify refuses what load refuses, in one sentence (it was an AttributeError, or passed verify)."""
    state = make_state()
    version = state.save(tmp_path / "ckpt")
    manifest = version / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), field: value}))
    assert detrace(["verify-checkpoint", str(version)]) == 2
    err = capsys.readouterr().err
    assert err == f"detrace verify-checkpoint: error: {manifest} is malformed: {words}" + err.split(words)[1]
    assert err.count("\n") == 1
    with pytest.raises(CheckpointError, match="is malformed"):
        make_state().load(tmp_path / "ckpt")


def test_the_docs_state_what_the_distcp_files_hold(tmp_path: Path) -> None:
    """m7: "pickle-free" was not exact: each .distcp holds torch.save records (with a small data.pkl) that are
    read only with the restricted unpickler. The docs now say exactly that, and it is what the files hold."""
    version = make_state().save(tmp_path / "ckpt")
    (shard,) = version.glob("*.distcp")
    assert b"data.pkl" in shard.read_bytes() and b"PK\x03\x04" in shard.read_bytes()  # torch.save zip records
    docs = (Path(__file__).parents[2] / "docs" / "resume.md").read_text()
    assert "each `.distcp` file holds `torch.save` records" in docs and "restricted unpickler" in docs
    assert "nothing is written or read with pickle" not in docs


def test_a_manifest_of_two_ranks_with_one_rank_file_names_the_missing_rank(tmp_path: Path) -> None:
    version = make_state().save(tmp_path)
    path = version / "manifest.json"
    path.write_text(path.read_text().replace('"world_size": 1', '"world_size": 2'))  # said "ok" before
    with pytest.raises(CheckpointCorrupted, match=r"rank 1's state file rank-1\.json is missing \(the manifest "
                                                  r"says world size 2\)"):
        verify_checkpoint(tmp_path)


def test_verify_reads_chunks_ahead_in_order_and_keeps_damage_in_place(tmp_path: Path) -> None:
    """verify reads the next chunks in threads while it hashes: same chunks, same order, a damaged record reported
    where it stands (and the rest still read)."""
    from detrace.state import manifest
    from detrace.state.storage import load_chunk, stored_chunks

    version = make_state().save(tmp_path)
    chunks = stored_chunks(version)
    sequential = [load_chunk(version, chunk) for chunk in chunks]
    ahead = list(manifest._read_ahead(version, chunks, 3))
    assert [chunk for chunk, _ in ahead] == chunks
    assert all(torch.equal(a, b) for (_, a), b in zip(ahead, sequential, strict=True))  # type: ignore[arg-type]
    broken = [chunks[0], type(chunks[1])(fqn=chunks[1].fqn, offsets=chunks[1].offsets, file=chunks[1].file,
                                         start=chunks[1].start, length=chunks[1].length + 10**9), chunks[2]]
    got = [data for _, data in manifest._read_ahead(version, broken, 2)]
    assert isinstance(got[1], CheckpointCorrupted) and "is truncated" in str(got[1])
    assert torch.equal(got[0], sequential[0]) and torch.equal(got[2], sequential[2])  # type: ignore[arg-type]


def _framed(version: Path) -> list[tuple[object, dict]]:
    """(stored chunk, its manifest entry) of every chunk of a version."""
    from detrace.state.storage import stored_chunks

    entries = json.loads((version / "manifest.json").read_text())["tensors"]
    return [(chunk, next(e for e in entries[chunk.fqn] if tuple(e["offsets"]) == chunk.offsets))
            for chunk in stored_chunks(version)]


def _flip_at(path: Path, at: int) -> None:
    content = bytearray(path.read_bytes())
    content[at] ^= 0x10
    path.write_bytes(bytes(content))


@pytest.mark.parametrize("backend", ["auto", "eager"])
def test_verify_reads_every_record_in_place_without_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           backend: str) -> None:
    """Every chunk this detrace saves is located in its record (`data_at`, `frame`), and verify reads them all
    without torch's record reader (which unpickles data.pkl), in several batches: with the native kernel, every
    record hashed piece by piece where it lies in the mapped file; with another kernel (`eager`), mapped in place
    where aligned (the tensors it maps are the ones torch's reader gives), read into buffers piece by piece where
    not."""
    from detrace.state import records
    from detrace.state.manifest import _wanted
    from detrace.state.storage import load_chunk

    torch.manual_seed(0)
    big = torch.nn.Linear(300, 700)  # 840 KB of weights: more than one 4 KiB row and more than a piece of the test
    state = TrainState(model=torch.nn.Sequential(big, torch.nn.Tanh(), torch.nn.Linear(700, 3)),
                       optimizer=torch.optim.AdamW(big.parameters(), lr=0.01))
    state.model(torch.randn(2, 300)).sum().backward()  # type: ignore[operator]
    state.optimizer.step()  # type: ignore[union-attr]
    version = state.save(tmp_path, step=1)
    framed = _framed(version)
    assert framed and all("frame" in entry and "data_at" in entry for _, entry in framed)
    wanted = [_wanted(chunk, entry) for chunk, entry in framed]  # type: ignore[arg-type]
    aligned = [(w.start + w.frame.data_at) % 8 == 0 for w in wanted]
    assert any(aligned) and not all(aligned)  # both ways of reading are exercised

    def no_pickle(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_pickle)
    monkeypatch.setattr(records, "_PIECE", 64 * 1024)  # the large tensors' bytes in many pieces
    monkeypatch.setenv("DETRACE_FINGERPRINT_BACKEND", backend)
    batches = list(records.read_batches(version, wanted, batch_bytes=4096, workers=3, scheme="detrace-fp1"))
    assert len(batches) > 2 and [w for batch in batches for w, _ in batch] == wanted
    assert verify_checkpoint(version).step == 1
    monkeypatch.undo()
    got = [found for batch in batches for _, found in batch]
    mapped = [found for found in got if isinstance(found, torch.Tensor)]
    assert all(isinstance(found, Fingerprint) for found in got) if backend == "auto" else 0 < len(mapped) < len(got)
    for (chunk, _), found in zip(framed, got, strict=True):
        if isinstance(found, torch.Tensor):  # mapped: the bytes torch's reader gives (a hashed one was compared)
            assert torch.equal(found, load_chunk(version, chunk))  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["auto", "eager"])
@pytest.mark.parametrize("where", ["aligned data", "unaligned data", "data.pkl"])
def test_a_flipped_byte_of_a_record_is_found_when_read_in_place(tmp_path: Path, where: str, backend: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte flipped in a tensor's data (hashed in the mapped file by the native kernel; with another kernel,
    mapped or read into buffers) or in its record's data.pkl (where the strides are: a checkpoint that would load
    other values) is damage, reported by tensor name, never read with pickle."""
    monkeypatch.setenv("DETRACE_FINGERPRINT_BACKEND", backend)
    version = make_state().save(tmp_path)
    picked = None
    for chunk, entry in _framed(version):
        at = chunk.start + entry["data_at"]  # type: ignore[attr-defined]
        if entry["numel"] > 1 and (at % 8 == 0) == (where == "aligned data"):
            picked = chunk, entry, at
            break
    assert picked is not None
    chunk, entry, at = picked
    shard = version / chunk.file  # type: ignore[attr-defined]
    if where == "data.pkl":
        record = shard.read_bytes()[chunk.start : chunk.start + chunk.length]  # type: ignore[attr-defined]
        _flip_at(shard, chunk.start + record.index(b"_rebuild_tensor_v2"))  # type: ignore[attr-defined]
        message = "stored record (what describes its bytes) does not match the manifest"
    else:
        _flip_at(shard, at + 4)
        message = "does not match its fingerprint in the manifest"
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(CheckpointCorrupted, match=re.escape(f"tensor '{chunk.fqn}'") + ".*" + re.escape(message)):  # type: ignore[attr-defined]
        verify_checkpoint(version)


def test_a_truncated_shard_file_is_reported_without_reading_past_its_end(tmp_path: Path) -> None:
    version = make_state().save(tmp_path)
    (shard,) = version.glob("*.distcp")
    with shard.open("r+b") as stream:
        stream.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointCorrupted, match=rf"{shard} is truncated: tensor '.*' is missing \d+ bytes"):
        verify_checkpoint(version)


def test_a_shard_file_truncated_while_verify_reads_it_is_one_sentence(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify hashes the records where they lie in the mapped file: a file that another process truncates after
    its size was checked makes the kernel's read fault (SIGBUS). That is one sentence, not the end of the process."""
    from detrace.state import records
    from detrace.state.records import hashes_in_place

    if not hashes_in_place("detrace-fp1"):
        pytest.skip("the native kernel was not built: records are read into buffers, not mapped")
    torch.manual_seed(0)
    big = torch.nn.Linear(300, 700)  # 840 KB of weights: rows mapped, not only a partial row read
    version = TrainState(model=big).save(tmp_path, step=1)
    checked = records._check

    def check_then_truncate(file: records._File, item: records.Wanted) -> CheckpointCorrupted | None:
        found = checked(file, item)
        if item.frame.data_bytes > 8 * 4096:  # the weight passed the size check, then the file shrinks
            os.truncate(file.path, item.start)
        return found

    monkeypatch.setattr(records, "_check", check_then_truncate)
    with pytest.raises(CheckpointError, match=r"\.distcp changed while it was being verified$"):
        verify_checkpoint(version)


def test_a_manifest_without_record_frames_is_verified_with_torchs_reader(tmp_path: Path) -> None:
    """Checkpoints saved before the records were located (no `data_at`/`frame`) verify as they did, and a flipped
    bit is still found."""
    state = make_state()
    version = state.save(tmp_path)
    path = version / "manifest.json"
    document = json.loads(path.read_text())
    for entries in document["tensors"].values():
        for entry in entries:
            del entry["data_at"], entry["frame"]
    path.write_text(json.dumps(document))
    assert verify_checkpoint(version).step == 0
    flip_one_bit(version, state.model[2].weight)  # type: ignore[index]
    with pytest.raises(CheckpointCorrupted, match=r"tensor 'model\.2\.weight' does not match its fingerprint"):
        verify_checkpoint(version)


def _unblock_readers(fifo: Path, stop: threading.Event) -> None:
    """Open `fifo` for writing as soon as a reader waits on it (and close it: the reader then reads nothing), so
    that a verify that opened it fails an assertion instead of waiting for a writer for ever."""
    while not stop.wait(0.05):
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: no reader yet
            continue
        return


@pytest.mark.parametrize("name", ["__0_0.distcp", "rank-0.json", "dcp_metadata.json"])
@pytest.mark.parametrize("framed", [True, False])
def test_a_checkpoint_file_that_is_a_fifo_is_refused_before_it_is_read(
        tmp_path: Path, name: str, framed: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """#49.9: a FIFO in place of a shard file made verify wait for a writer for ever (killed at 60 s)."""
    version = make_state().save(tmp_path)
    if not framed:  # a checkpoint saved before the records were located: read with torch's reader
        path = version / "manifest.json"
        document = json.loads(path.read_text())
        for entries in document["tensors"].values():
            for entry in entries:
                del entry["data_at"], entry["frame"]
        path.write_text(json.dumps(document))
    fifo = version / name
    fifo.unlink()
    os.mkfifo(fifo)
    stop = threading.Event()
    guard = threading.Thread(target=_unblock_readers, args=(fifo, stop), daemon=True)
    guard.start()
    try:
        assert detrace(["verify-checkpoint", str(tmp_path)]) == 1
    finally:
        stop.set()
        guard.join()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{fifo} is not a regular file (a FIFO)" in err, err


def test_a_missing_shard_file_and_a_missing_rank_file_are_both_damage(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """#49.11: a missing shard exited 2 (no answer), a missing rank file 1 (damage): both are a checkpoint that is
    not what its manifest says, exit 1."""
    for name in ("__0_0.distcp", "rank-0.json"):
        version = make_state().save(tmp_path / name)
        (version / name).unlink()
        assert detrace(["verify-checkpoint", str(version)]) == 1
        assert capsys.readouterr().err.endswith(f"{version / name} is missing\n")


def test_a_file_truncated_after_verify_began_is_no_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """#49.11: a shard truncated by another process after verify began, before verify opened it, was reported as
    "is truncated" (exit 1, damage the checkpoint may not have had): verify could not tell, so it is "changed
    while it was being verified", exit 2, as docs/resume.md says. Truncated before verify began, it is damage."""
    from detrace.state import manifest

    version = make_state().save(tmp_path)
    (shard,) = version.glob("*.distcp")
    checked = manifest._check_files

    def check_then_truncate(directory: Path, found: manifest.Manifest) -> list[str]:
        problems = checked(directory, found)
        os.truncate(shard, shard.stat().st_size - 100)
        return problems

    monkeypatch.setattr(manifest, "_check_files", check_then_truncate)
    assert detrace(["verify-checkpoint", str(version)]) == 2
    assert capsys.readouterr().err.endswith(f"{shard} changed while it was being verified\n")
    monkeypatch.setattr(manifest, "_check_files", checked)  # now short before verify begins: damage
    assert detrace(["verify-checkpoint", str(version)]) == 1
    assert f"{shard} is truncated" in capsys.readouterr().err


def test_an_elastic_save_refused_for_own_states_that_differ_names_the_value(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """#49.12: ranks whose own states differ were refused without a word on which value. The collectives stand in
    for a rank 1 whose `extra` counts one token more (dist.differing's rule: a key both hold, another digest)."""
    from detrace.state import dist, ranks, tree

    def state(tokens: int) -> TrainState:
        torch.manual_seed(0)
        return TrainState(model=torch.nn.Linear(2, 2), extra={"tokens": tokens}, elastic=True)

    skeleton, tensors = tree.split(state(65)._local(), "")
    theirs = {**ranks.digests(tensors), **ranks.value_digests(skeleton)}
    monkeypatch.setattr(dist, "differs", lambda value: True)
    monkeypatch.setattr(dist, "differing", lambda digests: {k for k, v in digests.items() if theirs.get(k, v) != v})
    with pytest.raises(CheckpointError, match=r"keep the replicas of a parameter equal \(first: 'extra\.tokens'\)$"):
        state(64).save(tmp_path)
    assert not any(tmp_path.glob("step-*"))
