"""A local attacker: another user of this host who plants what the project would keep in shared places (/tmp,
/dev/shm) before it starts. The project's own directories there are made private (paths.private_dir) or refused,
and it deletes only its own files. "Another user" is `nobody`: the files are handed to it with chown, which needs
root (CI runs as root); elsewhere these tests skip."""

import os
import shutil
import signal
import tempfile
import time

import pytest
from conftest import image_input, infer, local_server_only, make_image
from test_reliability import start_server, stub_pids

from {{ cookiecutter.package_name }} import mps, paths, stub_deaths
from {{ cookiecutter.package_name }}.health import StubWatchdog, probe

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="plants another user's files with chown: needs root")


@pytest.fixture
def tmp(monkeypatch):
    """A temporary directory of the test's own, as TMPDIR (gettempdir() reads it again): short, as the MPS root's
    socket paths must be."""
    shared = paths.Path(tempfile.mkdtemp(prefix="sec-", dir="/tmp"))
    os.chmod(shared, 0o1777)  # as /tmp: everyone may create, the sticky bit keeps each one's own
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert mps.run_root().parent == shared
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


def plant_folder(path) -> None:
    path.mkdir(mode=0o777)
    os.chmod(path, 0o777)
    os.chown(path, NOBODY, NOBODY)


def test_a_private_dir_is_made_0700_and_its_mode_narrowed(tmp):
    made = paths.private_dir(tmp / "mine")
    assert made.stat().st_mode & 0o777 == 0o700
    os.chmod(made, 0o755)
    assert paths.private_dir(made).stat().st_mode & 0o777 == 0o700


def test_a_symlink_planted_as_the_mps_root_is_refused_and_nothing_behind_it_is_deleted(tmp):
    victim = tmp / "victim"
    (victim / "123-abcd").mkdir(parents=True)  # the shape of an MPS run: what remove_stale would delete
    mps.run_root().symlink_to(victim)
    with pytest.raises(paths.NotPrivate, match="not a directory of this user's"):
        paths.private_dir(mps.run_root())
    if shutil.which(mps.CONTROL):  # on a GPU host: the daemon does not start there
        with pytest.raises(mps.MpsUnavailable, match="symlink"):
            mps.MpsDaemon.start()
    assert (victim / "123-abcd").is_dir()


@as_root
def test_another_users_stub_deaths_folder_is_never_trusted(tmp):
    """A planted records folder would let its owner fail every waiting BLS call by touching a file: a death
    recorded there is not seen, and the watchdog's own record says why it cannot be made, without stopping it."""
    planted = paths.user_tmp("stub-deaths")
    plant_folder(planted)
    (planted / "4242").mkdir()
    (planted / "4242" / "preprocess").touch()
    assert not stub_deaths.died_since("preprocess", time.time() - 60, server_pid=4242)
    with pytest.raises(paths.NotPrivate, match="belongs to uid 65534"):
        stub_deaths.record(4242, "resnet")
    lines = []
    watchdog = StubWatchdog("localhost:1", {}, server_pid=4242, log=lines.append)
    assert watchdog.died(["resnet"]) == ["resnet"]  # the watchdog goes on to reload it
    stub_deaths.forget(4242)
    stub_deaths.forget_stale()
    assert (planted / "4242" / "preprocess").exists(), "nothing of the other user's is deleted"


@as_root
def test_an_mps_root_of_another_user_is_refused(tmp):
    plant_folder(mps.run_root())
    with pytest.raises(paths.NotPrivate, match="belongs to uid 65534"):
        paths.private_dir(mps.run_root())


def test_an_empty_xdg_cache_home_is_the_default_not_a_relative_path(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert paths.cache_dir().is_absolute() and paths.cache_dir().parent == paths.Path.home() / ".cache"


@as_root
@local_server_only
def test_a_server_among_planted_files_starts_heals_a_killed_stub_and_stops_deleting_none_of_them(
    model_repository, tmp_path, tmp
):
    """Another user's file under this server's /dev/shm prefix and their folder in place of the stub-deaths
    records: the server starts, the watchdog heals a killed stub, the server stops, and both are still there."""
    planted = paths.user_tmp("stub-deaths")
    plant_folder(planted)
    triton = start_server(model_repository, tmp_path)
    foreign = paths.Path("/dev/shm") / f"{triton.settings.shm_prefix}of-another-user"
    foreign.write_bytes(b"theirs")
    os.chown(foreign, NOBODY, NOBODY)
    lines = []
    watchdog = StubWatchdog(
        triton.grpc_url, triton.settings.admin_headers, server_pid=triton.process.pid, log=lines.append
    )
    try:
        os.kill(stub_pids(triton, "postprocess")[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(line.startswith("watchdog: reloaded") for line in lines):
            watchdog.check(probe_too=True)
            time.sleep(1)
        assert any(line.startswith("watchdog: reloaded postprocess") for line in lines), lines
        assert probe(triton.grpc_url, timeout_s=30) is None
        assert infer(triton.grpc_url, [image_input([make_image(1)])]).as_numpy("CLASS_IDS").shape[0] == 1
    finally:
        watchdog.stop()
        code = triton.stop()
        try:
            assert foreign.read_bytes() == b"theirs", "another user's file is never deleted"
        finally:
            foreign.unlink(missing_ok=True)
    assert code in (0, None)
    assert planted.is_dir() and planted.stat().st_uid == NOBODY
