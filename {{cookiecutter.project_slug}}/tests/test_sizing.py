"""The sizing rule `serve` starts with (sizing.py), on made-up machines: GPUs of a given free memory, a CPU host of a
given RAM and cores, a small /dev/shm. No server and no GPU needed: the plans are computed from the configs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import PROJECT
from tritonclient.grpc import model_config_pb2

from {{ cookiecutter.package_name }} import sized, sizing
from {{ cookiecutter.package_name }}.model_repository import (
    BLS_CALLS,
    load_config,
    load_configs,
    loaded_versions,
    save_config,
    set_instance_counts,
)
from {{ cookiecutter.package_name }}.shm import dev_shm_need

GiB, MiB = sizing.GiB, sizing.MiB
CLI = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli"]


@pytest.fixture
def repository(tmp_path):
    """The project's model repository as shipped: its counts are the ceiling."""
    repo = tmp_path / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repo, ignore=shutil.ignore_patterns("*.pt", "__pycache__", "configs"))
    return repo


def gpus(free_gib: float, count: int = 1, total_gib: float = 80) -> list[sizing.Device]:
    return [sizing.Device(i, "NVIDIA H100 80GB HBM3", int(total_gib * GiB), int(free_gib * GiB)) for i in range(count)]


def ceiling(repository) -> dict[str, int]:
    return sizing.ceilings(load_configs(repository), 0)


@pytest.mark.parametrize("free_gib", [8, 12, 16, 24, 32, 80])
def test_the_counts_fit_the_budget_with_a_reload_beside_them_and_stay_under_the_configs(repository, free_gib):
    (plan,) = sizing.plan(repository, gpus(free_gib), shm_free=None)
    assert plan.budget_bytes == int(free_gib * GiB * (1 - sizing.MARGIN))
    assert plan.estimated_bytes + plan.headroom_bytes <= plan.budget_bytes
    assert all(1 <= plan.counts[m] <= n for m, n in ceiling(repository).items())
    assert set(plan.counts) == set(ceiling(repository))
    assert plan.mps_clients <= sizing.MAX_MPS_CLIENTS
    line = plan.line()
    assert line.startswith(f"GPU 0: {free_gib}.0 GiB free -> pipeline {plan.counts['pipeline']}, preprocess "), line
    assert f"(~{plan.estimated_bytes / GiB:.1f} GiB, " in line


def test_the_headroom_is_the_largest_single_reload_as_the_watchdog_reloads_a_stage_then_its_callers(repository):
    """The watchdog reloads a stage whose stub died, and its BLS callers only once that stage's replaced stubs have
    ended (health.StubWatchdog.reload): the headroom is the largest of those reloads alone (a stage's new stubs less the
    dead one, or a caller's new stubs beside all its old ones), never a stage's and its callers' together."""
    counts = ceiling(repository)
    cost = {m: (k + 1) * 100 * MiB for k, m in enumerate(counts)}
    size, stubs, which = sizing.reload_headroom(counts, cost)
    alone = {m: (counts[m] - 1) * cost[m] for m in counts} | {c: counts[c] * cost[c] for c in BLS_CALLS if c in counts}
    assert size == max(alone.values()) and alone[which] == size
    assert stubs == counts[which] - (which not in BLS_CALLS)
    # MPS clients: the stubs of every loaded version, tritonserver, and the reload with the most new stubs (a
    # model's reload starts the stubs of each version it loads)
    (plan,) = sizing.plan(repository, gpus(80), shm_free=None)
    configs = load_configs(repository)
    on_gpu = {m: n * loaded_versions(repository / m, configs[m]) for m, n in plan.counts.items()}
    most = max([n - 1 for n in on_gpu.values()] + [on_gpu[c] for c in BLS_CALLS if c in on_gpu])
    assert plan.mps_clients == sum(on_gpu.values()) + 1 + most


def test_more_memory_never_means_fewer_instances_and_a_whole_gpu_gets_the_configs_counts(repository):
    plans = [sizing.plan(repository, gpus(g), shm_free=None)[0].counts for g in (6, 8, 12, 16, 24, 32, 48, 80)]
    for smaller, larger in zip(plans, plans[1:]):
        assert all(larger[m] >= smaller[m] for m in smaller), (smaller, larger)
    (whole,) = sizing.plan(repository, gpus(80), shm_free=None)
    if whole.limited_by == "limited by MPS's 48 clients":  # your repository: more models or versions than shipped
        assert sum(whole.counts.values()) < sum(ceiling(repository).values())
        return
    assert plans[-1] == ceiling(repository)
    assert whole.overrides is None and "the configs' counts" in whole.line()


def test_a_pinned_count_is_kept_and_the_others_are_sized_around_it(repository):
    (plan,) = sizing.plan(repository, gpus(16), pinned={"pipeline": 2}, shm_free=None)
    assert plan.counts["pipeline"] == 2 and "pinned: pipeline=2" in plan.line()
    (free,) = sizing.plan(repository, gpus(16), shm_free=None)
    assert plan.counts["preprocess"] >= free.counts["preprocess"], "what the pipeline leaves goes to the stages"
    with pytest.raises(ValueError, match="--instances names nosuch"):
        sizing.plan(repository, gpus(16), pinned={"nosuch": 1})


def test_when_one_instance_of_each_does_not_fit_it_says_how_much_is_needed_and_found(repository):
    with pytest.raises(sizing.NothingFits) as failed:
        sizing.plan(repository, gpus(3), shm_free=None)
    message = str(failed.value)
    assert re.match(r"GPU 0: needs about \d+\.\d GiB for one instance of each model \(.*\), 3\.0 GiB free", message)
    with pytest.raises(sizing.NothingFits, match="for the pinned counts"):
        sizing.plan(repository, gpus(16), pinned={"preprocess": 40}, shm_free=None)


def test_the_tightest_gpu_sets_the_counts_of_every_gpu(repository):
    devices = gpus(80, count=2)
    devices[1].free = 16 * GiB
    plans = sizing.plan(repository, devices, shm_free=None)
    assert plans[0].counts == plans[1].counts == sizing.plan(repository, gpus(16), shm_free=None)[0].counts


def test_a_budget_cap_as_a_size_or_a_fraction_of_the_gpu(repository):
    (capped,) = sizing.plan(repository, gpus(80), cap=16 * GiB, shm_free=None)
    (fraction,) = sizing.plan(repository, gpus(80, total_gib=80), cap=0.2, shm_free=None)
    assert capped.counts == sizing.plan(repository, gpus(16), shm_free=None)[0].counts
    assert fraction.counts == capped.counts and "--gpu-memory 0.2 of 80.0 GiB" in fraction.line()


def test_mps_clients_bound_the_counts_of_a_large_gpu(repository):
    set_instance_counts(repository, {"pipeline": 40})
    (plan,) = sizing.plan(repository, gpus(140, total_gib=140), shm_free=None)
    assert plan.counts["pipeline"] < 40 and "MPS's 48 clients" in plan.line()
    assert plan.mps_clients <= sizing.MAX_MPS_CLIENTS
    (no_mps,) = sizing.plan(repository, gpus(140, total_gib=140), shm_free=None, mps=False)
    assert no_mps.counts["pipeline"] == 40


def test_dev_shm_bounds_the_counts_and_too_little_is_said_before_anything_starts(repository):
    (unbounded,) = sizing.plan(repository, gpus(80), shm_free=None)
    need = sum(dev_shm_need(repository, gpus=1, counts=unbounded.counts))
    (plan,) = sizing.plan(repository, gpus(80), shm_free=need // 2)
    assert sum(dev_shm_need(repository, gpus=1, counts=plan.counts)) <= need // 2 and "/dev/shm" in plan.line()
    with pytest.raises(sizing.NothingFits, match=r"^/dev/shm: needs about \d+ MiB for one instance of each model"):
        sizing.plan(repository, gpus(80), shm_free=64 * MiB)


@pytest.mark.parametrize("cores, expected", [(2, 1), (8, 2), (16, 4)])
def test_a_cpu_host_sizes_from_its_cores_and_ram(repository, cores, expected):
    host = sizing.Device(None, "CPU", 64 * GiB, 48 * GiB, cores)
    (plan,) = sizing.plan(repository, [host], shm_free=None)
    stages = {m: n for m, n in plan.counts.items() if m != "pipeline"}
    assert all(n == min(expected, ceiling(repository)[m]) for m, n in stages.items()), plan.counts
    assert plan.counts["pipeline"] == min(max(1, cores // 2), ceiling(repository)["pipeline"])
    assert plan.line().startswith(f"CPU: 48.0 GiB RAM available, {cores} cores -> ")
    small = sizing.Device(None, "CPU", 4 * GiB, 1 * GiB, cores)
    with pytest.raises(sizing.NothingFits, match="of RAM available"):
        sizing.plan(repository, [small], shm_free=None)


def test_a_model_of_your_own_costs_what_its_config_says(repository):
    config = load_config(repository / "postprocess")
    config.parameters["instance_gpu_memory"].string_value = "5GiB"
    save_config(repository / "postprocess", config)
    assert sizing.instance_bytes("postprocess", load_configs(repository)) == 5 * GiB


@pytest.mark.parametrize(
    "text, value",
    [("16GiB", 16 * GiB), ("16G", 16 * GiB), ("16gb", 16 * GiB), ("800MiB", 800 * MiB), ("0.5", 0.5), ("1", 1.0)],
)
def test_gpu_memory_reads_a_size_or_a_fraction(text, value):
    assert sizing.parse_size(text) == value
    for bad in ("lots", "0", "-1GiB"):
        with pytest.raises(ValueError):
            sizing.parse_size(bad)


def test_instances_read_from_the_flag_or_the_environment():
    assert sizing.parse_instances(["pipeline=8", "preprocess=2"]) == {"pipeline": 8, "preprocess": 2}
    assert sizing.parse_instances("pipeline=8, preprocess=2") == {"pipeline": 8, "preprocess": 2}
    with pytest.raises(ValueError, match="MODEL=COUNT"):
        sizing.parse_instances(["pipeline=0"])


def test_the_sized_configs_are_the_users_configs_with_the_count_and_follow_their_edits(repository):
    before = {p: p.read_bytes() for p in repository.glob("*/config.pbtxt")}
    written = sized.write_configs(repository, {"pipeline": 3, "preprocess": 2}, "sized-1")
    assert sorted(p.relative_to(repository).as_posix() for p in written) == [
        "pipeline/configs/sized-1.pbtxt",
        "preprocess/configs/sized-1.pbtxt",
    ]
    assert {p: p.read_bytes() for p in repository.glob("*/config.pbtxt")} == before
    pipeline = repository / "pipeline" / "configs" / "sized-1.pbtxt"
    assert "count: 3" in pipeline.read_text() and 'string_value: "30000000"' in pipeline.read_text()
    edited = before[repository / "pipeline" / "config.pbtxt"].decode().replace('"30000000"', '"20000000"')
    (repository / "pipeline" / "config.pbtxt").write_text(edited)
    assert sized.sync_configs(repository, "sized-1") == ["pipeline"]
    assert "count: 3" in pipeline.read_text() and 'string_value: "20000000"' in pipeline.read_text()
    sized.remove_configs(repository, "sized-1")
    assert not list(repository.glob("*/configs"))


def test_plan_prints_json_for_a_budget_without_a_gpu_or_a_server(repository):
    argv = [*CLI, "plan", "--model-repository", str(repository), "--gpu-memory", "16GiB", "--gpus", "2", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    devices = json.loads(done.stdout)["devices"]
    assert [d["device"] for d in devices] == ["GPU 0", "GPU 1"]
    for device in devices:
        assert device["budget_bytes"] == int(16 * GiB * (1 - sizing.MARGIN))
        assert set(device["counts"]) == set(ceiling(repository)) and device["estimated_bytes"] > 0
    argv = [*CLI, "plan", "--model-repository", str(repository), "--gpu-memory", "2GiB", "--gpus", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("error: GPU 0: needs about "), done.stderr


def test_a_count_costs_every_loaded_version_as_recipe_3_keeps_two_resnets(repository):
    """Recipe 3 keeps resnet versions 1 and 2 loaded (version_policy specific): each version has its own
    instances, so a resnet count costs twice the memory, and the plan fits that."""
    (before,) = sizing.plan(repository, gpus(16), shm_free=None)
    config = load_config(repository / "resnet")
    loaded = loaded_versions(repository / "resnet", config)
    versions = sorted(int(p.name) for p in (repository / "resnet").iterdir() if p.name.isdigit())
    shutil.copytree(repository / "resnet" / str(versions[0]), repository / "resnet" / str(versions[-1] + 1))
    config.ClearField("version_policy")
    config.version_policy.specific.versions[:] = [*versions, versions[-1] + 1]
    save_config(repository / "resnet", config)
    (after,) = sizing.plan(repository, gpus(16), shm_free=None)
    assert after.cost["resnet"] * loaded == before.cost["resnet"] * (len(versions) + 1)
    assert after.estimated_bytes + after.headroom_bytes <= after.budget_bytes
    assert after.counts["resnet"] <= before.counts["resnet"]


def test_the_preprocess_cost_is_scaled_from_the_peak_it_was_measured_at():
    """sizing.PREPROCESS_BYTES was measured at the defaults (max batch 128, crop 224, fp16), whose peak is
    PREPROCESS_PEAK_BYTES; a config's preprocess cost follows its own peak against that one
    (sizing.preprocess_bytes). A change to stages.preprocess_peak_bytes must restate the constant (and re-measure
    the stub)."""
    from {{ cookiecutter.package_name }}.stages import preprocess_peak_bytes

    assert sizing.PREPROCESS_PEAK_BYTES == preprocess_peak_bytes(128, 224, 2)


@pytest.mark.parametrize(
    "max_batch_size, dtype", [(1, "FP16"), (8, "FP32"), (64, "FP16"), (128, "FP16"), (128, "FP32")]
)
def test_a_smaller_max_batch_keeps_the_preprocess_cost_that_does_not_follow_it(repository, max_batch_size, dtype):
    """At the defaults it was measured at (max batch 128, fp16) the cost is the measured one, and a larger peak
    (fp32) scales it by torch's cap. A smaller max batch lowers the cap, but nvJPEG's buffers and the kernels do not
    shrink with it: the cost is that fixed part plus torch's measured share or the whole cap, whichever is less
    (scaling alone counted 89 MiB less than a stub held at max batch 8: sizing.preprocess_bytes)."""
    from {{ cookiecutter.package_name }}.stages import preprocess_peak_bytes

    config = load_config(repository / "preprocess")
    config.max_batch_size = max_batch_size
    config.output[0].data_type = model_config_pb2.DataType.Value(f"TYPE_{dtype}")
    save_config(repository / "preprocess", config)
    cost = sizing.instance_bytes("preprocess", load_configs(repository)) - sizing.CONTEXT_BYTES
    peak = preprocess_peak_bytes(max_batch_size, 224, 4 if dtype == "FP32" else 2)
    fixed, share = sizing.PREPROCESS_BYTES - sizing.PREPROCESS_TORCH_BYTES, sizing.PREPROCESS_TORCH_BYTES
    expected = {
        (1, "FP16"): fixed + peak,  # the cap (173 MiB) is below torch's measured share
        (8, "FP32"): fixed + peak,
        (64, "FP16"): fixed + share,
        (128, "FP16"): sizing.PREPROCESS_BYTES,
        (128, "FP32"): sizing.PREPROCESS_BYTES * peak // sizing.PREPROCESS_PEAK_BYTES,
    }
    assert cost == expected[max_batch_size, dtype]
    assert peak < share if max_batch_size <= 8 else peak > share
