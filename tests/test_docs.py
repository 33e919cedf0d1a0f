"""The docs stay short, carry no lab-notebook traces into a generated project, cite evidence that exists, and state
each default as its one source has it (issue: "Docs that are true and short").

Each check is a function of a baked project (and this repository's root) that returns what it found wrong, so that
a default changed in its source and not in the docs fails here, naming the doc and the value.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import bake
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks"

MAX_LINES = {"README.md": 200, "docs/performance.md": 250}
MAX_CELL = 200  # characters in one table cell of the generated README
MAX_BENCHMARKS_ENTRIES = 40
MAX_BENCHMARKS_README_LINES = 120

# A commit hash looks like 7 to 40 hex digits standing alone. Tokens of that shape that are not hashes, and why:
NOT_HASHES = {
    "67108864": "64 MiB in bytes (deployment.md: Docker's default /dev/shm)",
}
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)

MODELS = ("pipeline", "preprocess", "resnet", "postprocess")


def generated_markdown(project: Path) -> list[Path]:
    return sorted(p for p in project.rglob("*.md") if ".venv" not in p.parts)


def repository_markdown() -> list[Path]:
    """This repository's own Markdown, the template's included; not the run history under docs/benchmarks/history
    (it cites files by their names before the curation, on purpose) and not build or environment folders."""
    skip = {".git", ".venv", "build", ".gpu-bake", ".pytest_cache", "node_modules"}
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not skip & set(p.relative_to(ROOT).parts) and BENCHMARKS / "history" not in p.parents
    )


def table_cells(text: str) -> list[tuple[int, str]]:
    cells = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            cells += [(number, cell.strip()) for cell in line.strip().strip("|").split("|")]
    return cells


# -- (a) the generated docs: short, and nothing that only makes sense in the template's own history --------------


def length_problems(project: Path) -> list[str]:
    problems = []
    for name, limit in MAX_LINES.items():
        lines = len((project / name).read_text().splitlines())
        if lines > limit:
            problems.append(f"{name}: {lines} lines, at most {limit}")
    for number, cell in table_cells((project / "README.md").read_text()):
        if len(cell) > MAX_CELL:
            problems.append(f"README.md:{number}: a table cell of {len(cell)} characters: {cell[:60]}...")
    return problems


def history_problems(project: Path) -> list[str]:
    problems = []
    for path in generated_markdown(project):
        name = path.relative_to(project)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for token in HASH.findall(line):
                if token not in NOT_HASHES:
                    problems.append(f"{name}:{number}: {token!r} looks like a commit hash")
            problems += [f"{name}:{number}: a date of a reading, {d!r}" for d in DATE.findall(line)]
            problems += [f"{name}:{number}: an issue number, {i!r}" for i in ISSUE.findall(line)]
    return problems


def test_generated_docs_are_short(default_project):
    assert length_problems(default_project) == []


def test_generated_docs_carry_no_commit_hashes_dates_or_issue_numbers(default_project):
    assert history_problems(default_project) == []


def test_the_hash_check_catches_a_hash_and_spares_the_allowed_numbers(tmp_path):
    (tmp_path / "a.md").write_text("measured at 5f484bb on 2026-12-05 (issue 33); 67108864 bytes; 1,083,912 requests\n")
    found = history_problems(tmp_path)
    assert len(found) == 3 and "'5f484bb'" in found[0], found


# -- (b) the evidence: a curated folder, a short map, and every cited path there ---------------------------------


def cited_benchmark_paths(text: str) -> list[str]:
    """docs/benchmarks/... paths in a text, trailing punctuation dropped; `{a,b}` and `*` are kept for globbing;
    placeholders (`<commit>`, COMMIT) are not paths."""
    paths = []
    for match in re.findall(r"docs/benchmarks/[A-Za-z0-9_.{},*/<>-]*", text):
        path = match.rstrip(".,;:)")
        if "<" not in path and "COMMIT" not in path:
            paths.append(path)
    return paths


def expand_braces(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [
        expanded
        for option in match.group(1).split(",")
        for expanded in expand_braces(pattern[: match.start()] + option + pattern[match.end() :])
    ]


def exists(base: Path, pattern: str) -> bool:
    return all(glob.glob(str(base / expanded)) for expanded in expand_braces(pattern))


def missing_citations(markdown: list[Path]) -> list[str]:
    missing = []
    for path in markdown:
        for cited in cited_benchmark_paths(path.read_text()):
            if not exists(ROOT, cited):
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
    return missing


def test_the_benchmarks_folder_holds_current_evidence_only_and_a_short_map():
    entries = sorted(p.name for p in BENCHMARKS.iterdir())
    assert len(entries) <= MAX_BENCHMARKS_ENTRIES, entries
    assert {"README.md", "notes", "probes", "history"} <= set(entries)
    assert (BENCHMARKS / "history" / "INDEX.md").is_file()
    lines = len((BENCHMARKS / "README.md").read_text().splitlines())
    assert lines <= MAX_BENCHMARKS_README_LINES, f"docs/benchmarks/README.md: {lines} lines"


def test_every_cited_benchmarks_path_exists():
    assert missing_citations(repository_markdown()) == []


def test_every_file_the_benchmarks_map_names_exists():
    """The backticked file names in the map's table, relative to docs/benchmarks (or this repository's root)."""
    text = "\n".join(line for line in (BENCHMARKS / "README.md").read_text().splitlines() if line.startswith("|"))
    names = [
        token
        for token in re.findall(r"`([^`\s]+)`", text)
        if re.fullmatch(r"[A-Za-z0-9_.{},*/-]+", token)
        and re.search(r"(\.(xml|json|md|png|log|txt|py|\*)|\}|/)$", token)
    ]
    assert len(names) > 20
    missing = [name for name in names if not (exists(BENCHMARKS, name) or exists(ROOT, name))]
    assert missing == []


def test_the_citation_check_finds_a_moved_file(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("see `docs/benchmarks/bls-path-r24.10.md` and docs/benchmarks/gpu-budgets.{json,md}.\n")
    assert cited_benchmark_paths(doc.read_text()) == [
        "docs/benchmarks/bls-path-r24.10.md",
        "docs/benchmarks/gpu-budgets.{json,md}",
    ]
    assert not exists(ROOT, "docs/benchmarks/bls-path-r24.10.md")  # it lives in notes/ now
    assert exists(ROOT, "docs/benchmarks/gpu-budgets.{json,md}")


# -- (c) one source for each default: the docs state what the source says ---------------------------------------


def config(project: Path, model: str) -> model_config_pb2.ModelConfig:
    text = (project / "model_repository" / model / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def package_dir(project: Path) -> Path:
    (package,) = [p for p in (project / "src").iterdir() if p.is_dir() and (p / "server.py").is_file()]
    return package


def instance_count_problems(project: Path, root_readme: str) -> list[str]:
    counts = {model: sum(g.count for g in config(project, model).instance_group) for model in MODELS}
    phrase = ", ".join(f"{model} {counts[model]}" for model in MODELS)  # pipeline 10, preprocess 5, ...
    short = "/".join(str(counts[model]) for model in MODELS)  # 10/5/2/1
    docs = {
        "README.md": (project / "README.md").read_text(),
        "docs/performance.md": (project / "docs" / "performance.md").read_text(),
        "the template's README.md": root_readme,
    }
    problems = [
        f"{name} does not state the configs' counts as {phrase!r}" for name, t in docs.items() if phrase not in t
    ]
    if short not in docs["docs/performance.md"]:
        problems.append(f"docs/performance.md does not state the configs' counts as {short!r}")
    # Wherever a doc names the configs' counts, the numbers that follow are the configs'.
    for name, text in docs.items():
        for stated in re.findall(r"(?:configs'|instance_group`?) counts[^(.]{0,40}\(([^)]*)\)", text):
            pairs = dict(re.findall(r"\b(pipeline|preprocess|resnet|postprocess) (\d+)", stated))
            wrong = {m: int(n) for m, n in pairs.items() if int(n) != counts[m]}
            if wrong:
                problems.append(f"{name}: the configs' counts stated as {wrong}, the configs have {counts}")
    return problems


def stage_setting_problems(project: Path, root_readme: str) -> list[str]:
    parameters = config(project, "pipeline").parameters
    shipped = {stage: parameters[stage].string_value for stage in ("preprocess", "postprocess")}
    problems = []
    if len(set(shipped.values())) != 1:
        return [f"pipeline/config.pbtxt ships {shipped}: the docs say both stages ship alike"]
    (value,) = set(shipped.values())
    statements = {
        "README.md": r'\(both `"(\w+)"` as shipped\)',
        "docs/performance.md": r'both ship as\s+`"(\w+)"`',
    }
    for name, pattern in statements.items():
        found = re.findall(pattern, (project / name).read_text())
        if found != [value]:
            problems.append(f"{name}: the pipeline's shipped stage setting stated as {found}, the config has {value!r}")
    # The default is the three-model pipeline exactly when both stages call their models.
    three_models = value == "bls"
    table = re.search(r"\| \*\*three models \(default\)\*\* \|", (project / "docs" / "performance.md").read_text())
    if bool(table) != three_models:
        problems.append(
            f"docs/performance.md's table calls the three-model pipeline the default; the config ships {value!r}"
        )
    if ("the pipeline calls the three models" in root_readme) != three_models:
        problems.append(f"the template's README.md says the default calls the three models; the config ships {value!r}")
    return problems


def shm_problems(project: Path) -> list[str]:
    compose = yaml.safe_load((project / "docker-compose.yml").read_text())
    shm_size = compose["services"]["triton"]["shm_size"]  # ${TRITON_SHM_SIZE:-4gb}
    gib = int(re.fullmatch(r"\$\{TRITON_SHM_SIZE:-(\d+)gb\}", shm_size).group(1))
    deployment = (project / "deploy" / "kubernetes" / "base" / "deployment.yaml").read_text()
    (limit,) = re.findall(r"sizeLimit: (\d+)Gi", deployment)
    problems = [] if int(limit) == gib else [f"compose shm_size {gib}gb, Kubernetes sizeLimit {limit}Gi"]
    patterns = {
        "docs/deployment.md": [r"`shm_size: (\d+)gb`", r"asks for about (\d+) GiB"],
        "docs/kubernetes.md": [r"sizeLimit: (\d+)Gi"],
    }
    for name, regexes in patterns.items():
        text = (project / name).read_text()
        for regex in regexes:
            found = re.findall(regex, text)
            if not found or any(int(n) != gib for n in found):
                problems.append(f"{name}: /dev/shm stated as {found} ({regex}), compose and Kubernetes give {gib} GiB")
    return problems


def server_flag_problems(project: Path) -> list[str]:
    source = (package_dir(project) / "server.py").read_text()
    body = re.search(r"\ndef server_flags\(.*?\n(?=\S)", source, re.DOTALL).group(0)
    flags = set(re.findall(r'"(--[a-z][a-z-]*)', body)) | set(re.findall(r'f"(--[a-z][a-z-]*)=', body))
    defaults = {
        name: eval(value, {"MiB": 1 << 20})
        for name, value in re.findall(r"^    (\w+): int = ([\d *]+(?:MiB)?)\s*(?:#.*)?$", source, re.MULTILINE)
    }
    problems = []
    if "--exit-timeout-secs" not in flags or "{settings.exit_timeout_s}" not in body:
        problems.append("server_flags() no longer passes --exit-timeout-secs from ServerSettings.exit_timeout_s")
    texts = {p.relative_to(project): p.read_text() for p in generated_markdown(project)}
    for name, text in texts.items():
        for flag in set(re.findall(r"(--[a-z][a-z-]*-(?:secs|byte-size|mode|readiness|config|name))\b", text)):
            if flag not in flags and flag.startswith(("--exit", "--cuda", "--model-control", "--strict", "--disable")):
                problems.append(f"{name}: names tritonserver flag {flag}, which server_flags() does not pass")
        for value in re.findall(r"--exit-timeout-secs=(\d+)", text) + re.findall(r"(\d+) s exit timeout", text):
            if int(value) != defaults["exit_timeout_s"]:
                problems.append(f"{name}: exit timeout {value} s, ServerSettings has {defaults['exit_timeout_s']}")
        for value in re.findall(r"region starts at (\d+) MiB", text):
            if int(value) << 20 != defaults["shm_default_bytes"]:
                problems.append(f"{name}: a stub's region starts at {value} MiB, ServerSettings: shm_default_bytes")
        for value in re.findall(r"grows in (\d+) MiB steps", text):
            if int(value) << 20 != defaults["shm_growth_bytes"]:
                problems.append(f"{name}: regions grow in {value} MiB steps, ServerSettings: shm_growth_bytes")
    stated = {
        name: re.findall(r"--exit-timeout-secs=\d+|\d+ s exit timeout|region starts at|MiB steps", text)
        for name, text in texts.items()
    }
    if not any(stated.values()):
        problems.append("no generated doc states the exit timeout or the /dev/shm region sizes any more")
    return problems


def base_image_problems(project: Path, root_readme: str) -> list[str]:
    dockerfile = (project / "Dockerfile").read_text()
    ngc = (project / "docker" / "ngc.Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.MULTILINE).group(1)
    ngc_base = re.search(r"^ARG NGC_IMAGE=(\S+)$", ngc, re.MULTILINE).group(1)
    problems = []
    if not re.search(r"^FROM \$\{BASE_IMAGE\} AS runtime$", dockerfile, re.MULTILINE):
        problems.append("Dockerfile's runtime stage is no longer FROM ${BASE_IMAGE}")
    if not re.search(r"^FROM \$\{NGC_IMAGE\} AS ngc$", ngc, re.MULTILINE):
        problems.append("docker/ngc.Dockerfile's stage is no longer FROM ${NGC_IMAGE}")
    docs = {str(p.relative_to(project)): p.read_text() for p in generated_markdown(project)}
    docs["the template's README.md"] = root_readme
    for name in ("README.md", "the template's README.md"):
        if f"FROM {base}" not in docs[name]:
            problems.append(f"{name} does not say the Dockerfile is FROM {base}")
    for name, text in docs.items():
        for image in re.findall(r"\bFROM ([\w.:/-]+)", text):
            if image not in (base, ngc_base) and not image.startswith("$"):
                problems.append(f"{name}: FROM {image}, the Dockerfiles' bases are {base} and {ngc_base}")
        for image in re.findall(r"\bpython:\d[\w.-]*", text):
            if image != base:
                problems.append(f"{name}: names {image} as an image, the Dockerfile's base is {base}")
        for image in re.findall(r"nvcr\.io/nvidia/tritonserver:[\w.-]+", text):
            if image != ngc_base:
                problems.append(f"{name}: names {image}, docker/ngc.Dockerfile's base is {ngc_base}")
    return problems


DEFAULT_CHECKS = {
    "instance counts": lambda project, readme: instance_count_problems(project, readme),
    "the pipeline's stage settings": lambda project, readme: stage_setting_problems(project, readme),
    "/dev/shm size": lambda project, readme: shm_problems(project),
    "server flags": lambda project, readme: server_flag_problems(project),
    "base images": lambda project, readme: base_image_problems(project, readme),
}


@pytest.mark.parametrize("default", DEFAULT_CHECKS)
def test_the_docs_state_each_default_as_its_source_has_it(default_project, default):
    assert DEFAULT_CHECKS[default](default_project, (ROOT / "README.md").read_text()) == []


def test_the_readmes_sizing_example_is_what_serve_prints_for_it(tmp_path):
    """The generated README shows serve's first line for an fp16 bake on a GPU with 16 GiB free: it is the line
    sizing.plan gives those configs (a GPU it has not seen is costed as an H100)."""
    project = bake(tmp_path, precision="fp16")
    readme = (project / "README.md").read_text()
    assert "(here an fp16 bake on a GPU with 16 GiB free)" in readme
    (stated,) = re.findall(r"^instances: (GPU 0: 16\.0 GiB free -> .*)$", readme, re.M)
    code = (
        f"from {package_dir(project).name} import sizing as s; g = s.GiB; "
        "print(s.plan('model_repository', [s.Device(0, 'GPU', 80 * g, 16 * g)], shm_free=None)[0].line())"
    )
    env = dict(os.environ, PYTHONPATH=str(project / "src"))
    run = subprocess.run([sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == stated
