"""The command line as a user meets it, against a real tritonserver over gRPC: `classify`'s rows, errors and exit
status, the admin key (none, wrong, from the file `serve` keeps), and `serve`'s start and stop."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PROJECT, local_server_only, make_image
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from {{ cookiecutter.package_name }} import admin_key, restarts
from {{ cookiecutter.package_name }}.client import ImageClassifier
from {{ cookiecutter.package_name }}.console import HARMLESS_WITHOUT_GPU
from {{ cookiecutter.package_name }}.health import orphaned_stubs, stub_processes
from {{ cookiecutter.package_name }}.model_repository import (
    labels_path,
    load_config,
    loaded_versions,
    python_models,
    set_parameter,
    top_k,
)
from {{ cookiecutter.package_name }}.server import free_port, visible_gpus
from {{ cookiecutter.package_name }}.stages import read_labels

pytestmark = pytest.mark.e2e
CLI = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli"]


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """The environment of a user with no admin key anywhere: no TRITON_ADMIN_KEY, an empty config directory."""
    config = tmp_path / "config"
    config.mkdir()
    return {**{k: v for k, v in os.environ.items() if k != admin_key.ENV}, "XDG_CONFIG_HOME": str(config)}


@pytest.fixture
def images(tmp_path) -> dict[str, Path]:
    """Two images, a text file and a path that does not exist, in the project directory of a user."""
    files = {"cat.jpg": make_image(90), "dog.png": make_image(91, fmt="PNG"), "notes.txt": b"buy milk\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return {name: tmp_path / name for name in [*files, "missing.jpg"]}


def classify(server, env, *args, cwd=None) -> subprocess.CompletedProcess:
    argv = [*CLI, "classify", *map(str, args), "--url", server.grpc_url]
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def rows(stdout: str) -> dict[str, list[tuple[float, int, str]]]:
    """The table: {image: [(score, class id, label), ...]}; the header is checked first."""
    lines = stdout.splitlines()
    assert lines[0].split() == ["image", "score", "class", "id", "label"], stdout
    table, image = {}, None
    for line in lines[1:]:
        if not line.startswith(" "):
            image, line = line.split(maxsplit=1)[0], line[len(line.split(maxsplit=1)[0]) :]
        score, class_id, label = line.split(maxsplit=2)
        table.setdefault(image, []).append((float(score), int(class_id), label))
    return table


@pytest.fixture(scope="module")
def labels(model_repository) -> list[str]:
    return read_labels(labels_path(model_repository))


def test_classify_prints_a_header_and_each_images_top_k(server, env, images, labels, model_repository):
    done = classify(server, env, "cat.jpg", "dog.png", cwd=images["cat.jpg"].parent)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    table = rows(done.stdout)
    assert list(table) == ["cat.jpg", "dog.png"]
    with ImageClassifier(server.grpc_url) as client:
        expected = client.classify([images["cat.jpg"].read_bytes(), images["dog.png"].read_bytes()])
    for got, want in zip(table.values(), expected):
        assert len(got) == top_k(model_repository)
        assert [(c, label) for _, c, label in got] == [(p.class_id, p.label) for p in want]
        assert all(label == labels[c] for _, c, label in got)


def test_a_mixed_batch_prints_the_good_images_and_names_each_bad_one(server, env, images):
    """cat.jpg notes.txt dog.png missing.jpg: both images are classified; one error line per bad file; exit 1."""
    order = ["cat.jpg", "notes.txt", "dog.png", "missing.jpg"]
    done = classify(server, env, *order, cwd=images["cat.jpg"].parent)
    assert done.returncode == 1
    assert list(rows(done.stdout)) == ["cat.jpg", "dog.png"]
    errors = done.stderr.splitlines()
    assert len(errors) == 2 and "Traceback" not in done.stderr, done.stderr
    assert errors[0].startswith("error: notes.txt: ") and "not a JPEG or PNG image" in errors[0]
    assert errors[1] == "error: missing.jpg: no such file"


def test_a_model_that_is_not_loaded_is_one_error_line_not_a_traceback(server, env, images):
    """As when the pipeline is unloaded: one `error:` line that names the model and what to run, exit 2."""
    done = classify(server, env, "--model", "nonesuch", images["cat.jpg"])
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith("error: the server at ") and "no model 'nonesuch' ready" in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def test_a_bad_file_alone_is_one_error_line_and_exit_1(server, env, images):
    done = classify(server, env, images["notes.txt"])
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(f"error: {images['notes.txt']}: ") and len(done.stderr.splitlines()) == 1


def test_a_missing_file_alone_is_one_error_line_and_exit_1(server, env, images):
    done = classify(server, env, images["missing.jpg"])
    assert (done.returncode, done.stdout, done.stderr) == (1, "", f"error: {images['missing.jpg']}: no such file\n")


def test_json_is_one_array_with_predictions_or_an_error_per_image(server, env, images, model_repository):
    done = classify(server, env, "--json", *images.values())
    assert done.returncode == 1 and done.stderr == ""
    answers = json.loads(done.stdout)
    assert [a["image"] for a in answers] == [str(p) for p in images.values()]
    good, bad = answers[:2], answers[2:]
    assert all(len(a["predictions"]) == top_k(model_repository) and "error" not in a for a in good)
    assert set(good[0]["predictions"][0]) == {"score", "class_id", "label"}
    assert "not a JPEG or PNG image" in bad[0]["error"] and bad[1]["error"] == "no such file"


def test_no_server_is_one_line_that_says_how_to_start_one(env, images):
    argv = [*CLI, "classify", str(images["cat.jpg"]), "--url", f"localhost:{free_port()}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: no server answers at localhost:") and " serve`" in done.stderr


def test_files_that_cannot_be_read_are_named_without_asking_a_server(env, images, tmp_path):
    argv = [*CLI, "classify", str(images["missing.jpg"]), str(tmp_path), "--url", f"localhost:{free_port()}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr.splitlines() == [
        f"error: {images['missing.jpg']}: no such file",
        f"error: {tmp_path}: is a directory, not an image",
    ]


@local_server_only
def test_shared_memory_without_a_key_names_the_variable_and_the_key_file(server, env, images):
    done = classify(server, env, images["cat.jpg"], "--shared-memory", "system")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "set TRITON_ADMIN_KEY" in done.stderr and str(admin_key.key_file()) not in done.stderr
    assert str(Path(env["XDG_CONFIG_HOME"]) / "{{ cookiecutter.project_slug }}" / "admin-key") in done.stderr
    assert "admin_key=" not in done.stderr, "a Python argument means nothing on the command line"


@local_server_only
def test_a_wrong_key_is_rejected_by_name(server, env, images):
    done = classify(server, {**env, admin_key.ENV: "wrong"}, images["cat.jpg"], "--shared-memory", "system")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: admin key rejected: ") and "from TRITON_ADMIN_KEY" in done.stderr


@local_server_only
def test_the_key_file_is_read_when_no_key_is_given(server, env, images):
    key_file = Path(env["XDG_CONFIG_HOME"]) / "{{ cookiecutter.project_slug }}" / "admin-key"
    key_file.parent.mkdir()
    key_file.write_text("wrong\n")
    done = classify(server, env, images["cat.jpg"], "--shared-memory", "system")
    assert done.returncode == 2 and f"from {key_file}" in done.stderr, done.stderr
    key_file.write_text(server.settings.admin_key + "\n")
    done = classify(server, env, images["cat.jpg"], "--shared-memory", "system")
    assert done.returncode == 0, done.stderr
    assert list(rows(done.stdout)) == [str(images["cat.jpg"])]


@local_server_only
@pytest.mark.parametrize("container", ["--container", "--no-container"])
def test_print_flags_shows_every_flag_but_the_admin_key(env, container):
    """The flags are for reading (docs/deployment.md shows how): the key in them is masked, from the environment
    or drawn for the run."""
    key = "a-key-no-printout-may-show"
    for run_env in ({**env, "TRITON_ADMIN_KEY": key}, env):
        argv = [*CLI, "serve", container, "--print-flags", "--model-repository", str(PROJECT / "model_repository")]
        done = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        restricted = [f for f in done.stdout.split() if "restricted" in f]
        assert len(restricted) == 2 and all(f.endswith(":admin-key=***") for f in restricted), restricted
        assert key not in done.stdout + done.stderr


def test_serve_keeps_one_key_per_user_in_a_private_file_until_rotated(tmp_path, monkeypatch):
    monkeypatch.delenv(admin_key.ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    key, where = admin_key.for_serve()
    path = tmp_path / "{{ cookiecutter.project_slug }}" / "admin-key"
    assert where == str(path) and path.read_text() == key + "\n" and len(key) >= 32
    assert path.stat().st_mode & 0o777 == 0o600
    assert admin_key.for_serve() == (key, where), "a restart keeps the key"
    assert admin_key.find() == (key, where), "a same-host client finds it"
    rotated, _ = admin_key.for_serve(rotate=True)
    assert rotated != key and admin_key.find()[0] == rotated and path.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv(admin_key.ENV, "from-the-environment")
    assert admin_key.for_serve() == ("from-the-environment", admin_key.ENV) == admin_key.find()
    assert path.read_text() == rotated + "\n", "TRITON_ADMIN_KEY wins and leaves the file alone"


CPU_HOST_LOG = """\
W1201 07:49:24.926676 20300 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, pinned memory \
pool will not be available: CUDA driver version is insufficient for CUDA runtime version"
E1201 07:49:24.926816 20300 server.cc:241] "CudaDriverHelper has not been initialized."
I1201 07:49:24.927943 20300 model_lifecycle.cc:472] "loading: resnet:1"
I1201 07:49:24.927944 20300 model_lifecycle.cc:472] "loading: resnet:2"
E1201 07:49:50.107123 20300 ensemble_scheduler.cc:1468] "unable to create stream for ensemble: CUDA driver version \
is insufficient for CUDA runtime version"
I1201 07:49:50.106598 20300 model_lifecycle.cc:839] "successfully loaded 'resnet'"
E1201 07:49:50.107300 20300 model_lifecycle.cc:642] "failed to load 'pipeline' version 1: Internal: boom"
Error: Failed to initialize NVML
W1201 07:49:50.108245 20300 metrics.cc:798] "DCGM unable to start: DCGM initialization error"
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_the_log_goes_to_its_file_and_the_terminal_sees_progress_and_errors(tmp_path, capsys, verbose):
    """What `serve` shows of tritonserver's output on a host without a GPU: every line into the file; on the
    terminal each model once as loading and as loaded, real errors, and (--verbose) the rest, less the harmless
    CUDA/NVML/DCGM lines, which one note explains."""
    import io

    from {{ cookiecutter.package_name }}.console import LogPump

    log = tmp_path / "triton.log"
    pump = LogPump(io.BytesIO(CPU_HOST_LOG.encode()), log, gpus=[], verbose=verbose, started=time.monotonic())
    pump.run()
    assert log.read_text() == CPU_HOST_LOG
    shown = capsys.readouterr().out
    assert "boom" in shown and not any(text in shown for text in HARMLESS_WITHOUT_GPU)
    if verbose:
        assert shown.count("no GPU: Triton's lines about CUDA, NVML and DCGM are harmless here") == 1
        assert shown.count("\n") == 1 + 4  # the note, the two loading lines, loaded, failed
    else:
        lines = shown.splitlines()
        assert lines[0] == "  loading  resnet" and lines[1].startswith("  loaded   resnet ") and lines[1][-2:] == " s"
        assert len(lines) == 3 and lines[2].startswith("  tritonserver: E1201 ") and "to load 'pipeline'" in lines[2]


@local_server_only
def test_serve_shows_progress_keeps_the_log_in_a_file_and_says_when_it_stopped(model_repository, env, tmp_path):
    """A real `serve` start and Ctrl-C: the log file first, each model loading and loaded, `ready in`, the key
    file; Triton's own lines (on a CPU host: its alarming CUDA/NVML ones) only in the file; `stopped in` last, also
    when a second signal comes while it stops."""
    log = tmp_path / "triton.log"
    ports = [str(free_port()) for _ in range(3)]
    argv = [*CLI, "serve", "--model-repository", str(model_repository), "--log-file", str(log)]
    argv += ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2], "--watchdog-interval", "0"]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if line.startswith("admin key: "):
                break
        # on a GPU, the compiled resnet's line (compiled.py; the session's package, cached) comes before the log's
        lines = [line for line in lines if not line.startswith(("compiled resnet: cached", "  still compiling"))]
        assert lines[0].startswith("instances: ") and " -> pipeline " in lines[0], lines  # the sized counts
        assert lines[1] == f"tritonserver log: {log}  (--verbose shows it here)", lines
        assert any(line.startswith("ready in ") and f"gRPC localhost:{ports[1]}" in line for line in lines), lines
        for model in ("preprocess", "resnet", "postprocess", "pipeline"):
            assert f"  loading  {model}" in lines and any(line.startswith(f"  loaded   {model} ") for line in lines)
        key_file = Path(env["XDG_CONFIG_HOME"]) / "{{ cookiecutter.project_slug }}" / "admin-key"
        assert lines[-1].startswith(f"admin key: in {key_file} ") and key_file.stat().st_mode & 0o777 == 0o600
        key = key_file.read_text().strip()
        with ImageClassifier(f"localhost:{ports[1]}", shared_memory="system", admin_key=key):
            pass  # the server takes the key from the file
    finally:
        # SIGTERM (docker stop) takes serve's Ctrl-C path; a SIGINT is ignored where the tests run as a background job
        process.send_signal(signal.SIGTERM)
        stopping = process.stdout.readline()
        process.send_signal(signal.SIGTERM)  # impatient: ignored, the stop is bounded
        rest, _ = process.communicate(timeout=300)
    lines += [stopping.rstrip("\n"), *rest.splitlines()]
    assert process.returncode == 0, lines
    assert "stopping (in-flight requests finish first)..." in lines and lines[-1].startswith("stopped in ")
    logged = log.read_text()
    assert key not in "\n".join(lines) and key not in logged, "the key is in no printout and no log"
    assert logged.startswith("# tritonserver log, started ") and "successfully loaded 'pipeline'" in logged
    assert not any(text in "\n".join(lines) for text in HARMLESS_WITHOUT_GPU)
    if not visible_gpus():
        assert "CUDA driver version is insufficient" in logged, "the CPU host's CUDA lines are kept in the file"
    assert len(lines) < 30, "a short view: " + "\n".join(lines)


def tritonserver_of(serve_pid: int) -> int:
    """The tritonserver child of a `serve` process."""
    from {{ cookiecutter.package_name }} import mps

    (server,) = [p.pid for p in mps.processes() if p.ppid == serve_pid and p.comm == "tritonserver"]
    return server


@local_server_only
def test_serve_sizes_the_counts_to_this_machine_and_leaves_the_users_files_alone(env, tmp_path):
    """The project's repository as shipped (its counts the ceiling), served by `serve` with no flag: the first line
    says the counts chosen for this machine and why, the server runs exactly those stubs, `health` says the same,
    an edit of config.pbtxt goes live with `reload` at the sized count, and after Ctrl-C nothing in the repository
    differs from what the user wrote (config.pbtxt never rewritten; the sized configs gone)."""
    from {{ cookiecutter.package_name }}.weights import write_random_versions

    repo = tmp_path / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repo, ignore=shutil.ignore_patterns("*.pt", "__pycache__", "configs"))
    write_random_versions(repo)

    def files() -> dict[str, bytes]:
        return {
            p.relative_to(repo).as_posix(): p.read_bytes()
            for p in repo.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }

    shipped = files()
    ports = [str(free_port()) for _ in range(3)]
    url = f"localhost:{ports[1]}"
    argv = [*CLI, "serve", "--model-repository", str(repo), "--log-file", str(tmp_path / "triton.log")]
    argv += ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        while (line := process.stdout.readline()) and not line.startswith("admin key: "):
            lines.append(line.rstrip("\n"))
        assert any(line.startswith("ready in ") for line in lines), lines
        planned = re.match(r"instances: (CPU|GPU 0): .* -> (.*) \(~\d+\.\d GiB, ", lines[0])
        assert planned, lines[0]
        counts = {m: int(n) for m, n in (part.rsplit(" ", 1) for part in planned.group(2).split(", "))}
        assert set(counts) == set(python_models(repo)), "every Python-backend model, the user's own too"
        running = [m for m in stub_processes(tritonserver_of(process.pid)).values() if m is not None]
        versions = {m: loaded_versions(repo / m, load_config(repo / m)) for m in counts}  # recipe 3: two resnets
        expected = {m: n * versions[m] for m, n in counts.items()}
        assert {m: running.count(m) for m in counts} == expected, "the server runs the stubs the plan chose"
        if not visible_gpus() and (os.cpu_count() or 1) <= 3:
            assert counts == dict.fromkeys(counts, 1), "a small CPU host: one instance each"
        health = subprocess.run([*CLI, "health", "--url", url], env=env, capture_output=True, text=True, timeout=120)
        assert health.returncode == 0 and lines[0] in health.stdout, health.stdout
        config = repo / "pipeline" / "config.pbtxt"
        config.write_text(config.read_text().replace('"30000000"', '"20000000"'))  # bls_timeout_us, a hot change
        done = subprocess.run(
            [*CLI, "reload", "pipeline", "--url", url, "--model-repository", str(repo)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0 and done.stdout == f"reloaded pipeline ({counts['pipeline']} instances)\n", done
        with ImageClassifier(url) as client:
            live = client.config("pipeline")
        assert live.parameters["bls_timeout_us"].string_value == "20000000"
        assert sum(g.count for g in live.instance_group) == counts["pipeline"]
    finally:
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=300)
    assert process.returncode == 0, lines + rest.splitlines()
    edited = {**shipped, "pipeline/config.pbtxt": config.read_bytes()}
    assert files() == edited, "the repository holds what the user wrote, and nothing else"
    assert b'"20000000"' in config.read_bytes()


def test_serve_on_a_port_another_program_holds_fails_at_once_naming_the_port_and_the_program(env, tmp_path):
    """Another program listens on the gRPC port: `serve` says so within seconds, naming the port and the program,
    before it plans, writes or starts anything."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = [*CLI, "serve", "--grpc-port", str(port), "--http-port", str(free_port())]
        argv += ["--metrics-port", str(free_port()), "--model-repository", str(PROJECT / "model_repository")]
        started = time.monotonic()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and time.monotonic() - started < 10, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: port {port} (gRPC) is in use by pid {os.getpid()}: "), done.stderr
    assert "--grpc-port" in done.stderr and done.stdout == ""
    assert not list((PROJECT / "model_repository").glob(f"*/configs/sized-{port}.pbtxt"))


@local_server_only
def test_a_second_serve_on_a_running_servers_ports_fails_at_once_and_the_first_keeps_answering(server, env, images):
    """`serve` owns one server: started on the ports of one that runs, it fails within seconds, naming the port and
    the program, and the running server answers before, during and after, and still serves its models."""
    first = classify(server, env, images["cat.jpg"])
    assert first.returncode == 0, first.stderr
    settings = server.settings
    argv = [*CLI, "serve", "--model-repository", str(settings.model_repository), "--grpc-port", str(settings.grpc_port)]
    argv += ["--http-port", str(settings.http_port), "--metrics-port", str(settings.metrics_port)]
    started = time.monotonic()
    second = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    during = classify(server, env, images["cat.jpg"])
    out, err = second.communicate(timeout=120)
    assert second.returncode == 1 and time.monotonic() - started < 15, out + err
    assert f"error: port {settings.http_port} (HTTP) is in use by pid {server.process.pid}: " in err, err
    after = classify(server, env, images["cat.jpg"])
    assert during.returncode == after.returncode == 0, during.stderr + after.stderr
    # the same answer: on a GPU each resnet instance autotunes its own cuDNN algorithms (fp16 scores differ in the
    # third decimal from one instance to the next), so the top class and its score within 0.02
    [(first_score, first_id, _), *_] = rows(first.stdout)[str(images["cat.jpg"])]
    for answer in (rows(during.stdout), rows(after.stdout)):
        [(score, class_id, _), *_] = answer[str(images["cat.jpg"])]
        assert class_id == first_id and abs(score - first_score) <= 0.02, (first.stdout, during.stdout, after.stdout)
    assert not list(settings.model_repository.glob(f"*/configs/sized-{settings.grpc_port}.pbtxt"))


def test_missing_weights_are_said_once_before_anything_loads(env, tmp_path):
    repo = tmp_path / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repo, ignore=shutil.ignore_patterns("*.pt", "__pycache__", "configs"))
    ports = [str(free_port()) for _ in range(3)]
    argv = [*CLI, "serve", "--model-repository", str(repo), "--http-port", ports[0], "--grpc-port", ports[1]]
    started = time.monotonic()
    done = subprocess.run([*argv, "--metrics-port", ports[2]], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and time.monotonic() - started < 10, done.stderr
    missing = ", ".join(str(v.parent / "weights.pt") for v in sorted(repo.glob("resnet/*/model.py")))  # each version
    assert done.stderr == (
        f"error: missing weights {missing}: run "
        "`{{ cookiecutter.project_slug }} weights random` (offline), "
        "`weights pretrained` (downloads torchvision's) or `weights import YOUR.pt`\n"
    )


def test_a_config_that_does_not_parse_is_named_with_its_line_before_anything_starts(env, tmp_path):
    repo = tmp_path / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repo, ignore=shutil.ignore_patterns("*.pt", "__pycache__", "configs"))
    config = repo / "resnet" / "config.pbtxt"
    lines = config.read_text().splitlines()
    broken = next(i for i, line in enumerate(lines) if line.startswith("max_batch_size:"))
    lines[broken] += " oops"
    config.write_text("\n".join(lines) + "\n")
    ports = [str(free_port()) for _ in range(3)]
    argv = [*CLI, "serve", "--model-repository", str(repo), "--http-port", ports[0], "--grpc-port", ports[1]]
    done = subprocess.run([*argv, "--metrics-port", ports[2]], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: {config}:{broken + 1}:"), done.stderr
    assert len(done.stderr.splitlines()) == 1


@local_server_only
@pytest.mark.parametrize(
    "failure, says",
    [
        ("raise RuntimeError('boom in initialize')", "failed to load: Internal: RuntimeError: boom in initialize"),
        # whichever notices first: serve (the stub a zombie) or the Python backend (the stub's health)
        ("import os; os._exit(3)", r"(its stub \(pid \d+\) exited|failed to load: .*'postprocess_0_0' is not healthy)"),
    ],
    ids=["initialize-raises", "stub-exits"],
)
def test_serve_fails_fast_naming_a_model_that_cannot_load(model_repository, env, tmp_path, failure, says):
    """A model whose initialize raises, or whose stub exits at start-up: `serve` fails within 30 s, exit 1, with
    the model named, why, and the log's last lines, instead of waiting for every other model to load and for the
    Python backend's stub timeout (on a GPU a dead stub can keep Triton waiting for good). A repository of that one
    model, so that the 30 s measure the failure, not a loaded CI machine's other loads."""
    repo = tmp_path / "model_repository"
    (repo / "postprocess" / "1").mkdir(parents=True)
    shutil.copy(model_repository / "postprocess" / "config.pbtxt", repo / "postprocess" / "config.pbtxt")
    model = (model_repository / "postprocess" / "1" / "model.py").read_text()
    marker = "    def initialize(self, args):\n"
    (repo / "postprocess" / "1" / "model.py").write_text(model.replace(marker, f"{marker}        {failure}\n", 1))
    ports = [str(free_port()) for _ in range(3)]
    argv = [*CLI, "serve", "--model-repository", str(repo), "--log-file", str(tmp_path / "triton.log")]
    argv += ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2], "--timeout", "300"]
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    print(f"\nserve failed after {took:.1f} s:\n{done.stderr}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(f"error: model 'postprocess': {says}", done.stderr), done.stderr
    assert "the log's last lines:" in done.stderr
    assert took < 30, took


@local_server_only
def test_an_ensemble_whose_shapes_do_not_fit_its_steps_is_named_not_a_model_it_calls(model_repository, env, tmp_path):
    """An ensemble that says top-(k+1) where its step answers top-k: serve fails naming the ensemble and the
    shape Triton found wrong (it named a step's stub, which exited as the server stopped)."""
    repo = tmp_path / "model_repository"
    (repo / "postprocess" / "1").mkdir(parents=True)
    for name in ("config.pbtxt", "1/model.py"):
        shutil.copy(model_repository / "postprocess" / name, repo / "postprocess" / name)
    post = load_config(repo / "postprocess")
    classes, k = post.input[0].dims[0], post.output[0].dims[0]
    (repo / "top_k" / "1").mkdir(parents=True)
    ensemble = model_config_pb2.ModelConfig(name="top_k", platform="ensemble", max_batch_size=post.max_batch_size)
    ensemble.input.add(name="LOGITS", data_type=model_config_pb2.TYPE_FP32, dims=[classes])
    ensemble.output.add(name="SCORES", data_type=model_config_pb2.TYPE_FP32, dims=[k + 1])
    step = ensemble.ensemble_scheduling.step.add(model_name="postprocess", model_version=-1)
    step.input_map["LOGITS"], step.output_map["SCORES"] = "LOGITS", "SCORES"
    (repo / "top_k" / "config.pbtxt").write_text(text_format.MessageToString(ensemble))
    shutil.copy(labels_path(model_repository), repo / "postprocess" / "labels.txt")
    set_parameter(repo, "postprocess", "labels_file", "labels.txt")
    ports = [str(free_port()) for _ in range(3)]
    argv = [*CLI, "serve", "--model-repository", str(repo), "--log-file", str(tmp_path / "triton.log")]
    argv += ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2], "--timeout", "300"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    says = "error: model 'top_k': failed to load: ensemble tensor SCORES: inconsistent shape"
    assert says in done.stderr, done.stderr


@local_server_only
def test_serve_starts_a_killed_tritonserver_again_and_health_says_so(model_repository, env, tmp_path):
    """tritonserver killed by hand (SIGKILL) under `serve`, as a crash of the server itself would end it: serve
    says why and starts it again on the same ports, serving within 60 s on the CPU, with the dead server's stubs
    ended; `health` answers healthy and says how often and why; Ctrl-C then stops everything, exit 0."""
    ports = [str(free_port()) for _ in range(3)]
    argv = [*CLI, "serve", "--model-repository", str(model_repository), "--log-file", str(tmp_path / "triton.log")]
    argv += ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []

    def read_until(prefix: str, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (line := process.stdout.readline()):
            lines.append(line.rstrip("\n"))
            if line.startswith(prefix):
                return time.monotonic()
        raise AssertionError(f"no line starting {prefix!r}:\n" + "\n".join(lines))

    def tritonserver() -> tuple[int, str]:
        """(pid, /dev/shm prefix) of serve's tritonserver."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                argv = (stat.parent / "cmdline").read_bytes().decode().split("\0")
                if int(fields[1]) == process.pid and Path(argv[0]).name == "tritonserver":
                    flag = next(a for a in argv if "shm-region-prefix-name=" in a)
                    return int(stat.parent.name), flag.split("=", 1)[1]
        raise AssertionError("serve has no tritonserver")

    try:
        read_until("admin key: ", 600)
        first, prefix = tritonserver()
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        served_again = read_until("serving again ", 120)
        print(f"\nserved again {served_again - killed:.1f} s after the kill:\n" + "\n".join(lines[-8:]))
        assert "tritonserver killed by SIGKILL: starting it again (restart 1)" in lines
        assert served_again - killed < 60
        second, _ = tritonserver()
        assert second != first
        assert set(orphaned_stubs(prefix)) <= set(stub_processes(second)), "the dead server's stubs are gone"
        health = subprocess.run([*CLI, "health", "--url", f"localhost:{ports[1]}"], env=env, capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        assert health.returncode == 0, health.stdout + health.stderr
        assert health.stdout.startswith("healthy\n")
        assert "tritonserver restarted by serve 1 time; last at " in health.stdout
        assert health.stdout.rstrip().endswith(": killed by SIGKILL"), health.stdout
    finally:
        process.send_signal(signal.SIGTERM)
        stopping = process.stdout.readline()
        process.send_signal(signal.SIGTERM)  # impatient: ignored, the stop is bounded
        rest, _ = process.communicate(timeout=300)
    lines += [stopping.rstrip("\n"), *rest.splitlines()]
    assert process.returncode == 0, lines
    assert lines[-1].startswith("stopped in ")
    assert orphaned_stubs(prefix) == [], "no stub left"
    assert not restarts.record_path(int(ports[1])).exists(), "serve's record goes with it"
