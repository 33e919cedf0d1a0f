"""The docs stay short, carry no lab-notebook traces into a generated project, cite evidence that exists, and state
each default as its one source has it (issue: "Docs that are true and short").

Each check is a function of a baked project (and this repository's root) that returns what it found wrong, so that
a default changed in its source and not in the docs fails here, naming the doc and the value.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import shutil
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


def doc_texts(project: Path, root_readme: str) -> dict[str, str]:
    """{name: text} of every generated markdown file and of the template's README.md."""
    docs = {str(p.relative_to(project)): p.read_text() for p in generated_markdown(project)}
    docs["the template's README.md"] = root_readme
    return docs


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
    docs = doc_texts(project, root_readme)
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


# -- (d) what the docs say the code does: settings, restarts, files written, what the CLI prints --------------------


def flat(text: str) -> str:
    """A text with its line breaks and runs of spaces as one space, so that a phrase survives re-wrapping."""
    return " ".join(text.split())


def python_strings(path: Path) -> str:
    """The string constants of a Python file (f-strings' literal parts included), not its docstrings or comments."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return "\n".join(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    )


class AnyTagLoader(yaml.SafeLoader):
    """Compose's own tags (`!reset []`, `!override`) read as their plain value."""


AnyTagLoader.add_multi_constructor(
    "!",
    lambda loader, tag, node: (
        loader.construct_sequence(node)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_scalar(node)
    ),
)


def yaml_strings(value) -> list[str]:
    """Every key and string value of parsed YAML, so that comments do not count."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in yaml_strings(k) + yaml_strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in yaml_strings(v)]
    return [str(value)] if value is not None else []


def env_variable_pattern(project: Path) -> re.Pattern:
    """TRITON_* and the package's own prefix (IMAGE_CLASSIFIER_*), standing alone: `module.TRITON_TYPES` is a name in
    the code, not a setting."""
    prefix = package_dir(project).name.upper()
    return re.compile(rf"(?<![\w.])(?:TRITON|{prefix})_[A-Z0-9_]*[A-Z0-9]\b")


def environment_sources(project: Path) -> dict[str, str]:
    """Where a setting can be read or set: the package's code, the compose files, the Kubernetes manifests (and the
    Secret's env file), the Dockerfiles; comments and docstrings left out."""
    sources = {str(p.relative_to(project)): python_strings(p) for p in package_dir(project).rglob("*.py")}
    for path in [*project.glob("docker-compose*.yml"), *(project / "deploy").rglob("*.yaml")]:
        sources[str(path.relative_to(project))] = "\n".join(
            s for document in yaml.load_all(path.read_text(), AnyTagLoader) for s in yaml_strings(document)
        )
    for path in [
        *(project / "deploy").rglob("*.env"),
        project / "Dockerfile",
        *(project / "docker").glob("*Dockerfile"),
    ]:
        lines = path.read_text().splitlines()
        sources[str(path.relative_to(project))] = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    return sources


def environment_reads(project: Path) -> set[str]:
    """The variables the package reads: `os.environ.get("NAME")`, `os.environ[NAME]` of a `NAME = "..."` constant."""
    reads = set()
    for path in package_dir(project).rglob("*.py"):
        source = path.read_text()
        for literal, constant in re.findall(r'(?:environ\.get\(|environ\[|getenv\()\s*(?:"(\w+)"|([A-Z_]+)\b)', source):
            reads |= {literal} if literal else set(re.findall(rf'^{constant} = "(\w+)"', source, re.MULTILINE))
    return reads


def compose_environment_table(deployment_md: str) -> dict[str, list[str]]:
    """docs/deployment.md's "### Environment variables" table, the one that ends "Set them in the shell or in a `.env`
    file next to `docker-compose.yml`": {variable: the backticked defaults of its row}."""
    section = re.search(r"^### Environment variables\n(.*?)^#", deployment_md, re.MULTILINE | re.DOTALL).group(1)
    assert "`.env` file next to `docker-compose.yml`" in section, "the table is no longer the compose settings'"
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2 and cells[0].startswith("`TRITON_"):
            names, defaults = re.findall(r"`(\w+)`", cells[0]), re.findall(r"`([^`]*)`", cells[1])
            for i, name in enumerate(names):  # `A`, `B` | `1`, `2`: A's is 1
                table[name] = [defaults[i]] if len(defaults) == len(names) else defaults
    return table


def environment_problems(project: Path, root_readme: str) -> list[str]:
    pattern = env_variable_pattern(project)
    sources = environment_sources(project)
    known = {name for text in sources.values() for name in pattern.findall(text)}
    docs = doc_texts(project, root_readme)
    problems = [
        f"{name}: names {variable}, which no code, compose file, manifest or Dockerfile reads or sets"
        for name, text in docs.items()
        for variable in sorted(set(pattern.findall(text)) - known)
    ]
    # The compose settings: each reaches the triton service, with the default the table gives it.
    compose = yaml.safe_load((project / "docker-compose.yml").read_text())
    triton = compose["services"]["triton"]
    interpolated = {}  # variable -> its default in ${VAR:-default}
    for text in yaml_strings(triton):
        interpolated |= dict(re.findall(r"\$\{(\w+):-([^}]*)\}", text))
    environment = triton.get("environment", {})
    package_reads = environment_reads(project)
    table = compose_environment_table(docs["docs/deployment.md"])
    if not table:
        problems.append("docs/deployment.md's environment table lists no variable")
    for variable, stated in table.items():
        if variable not in interpolated:
            problems.append(
                f"docs/deployment.md lists {variable} as a compose setting; the triton service never reads it"
            )
            continue
        if variable in package_reads and variable not in environment:
            problems.append(
                f"docs/deployment.md lists {variable}, which serve reads; the triton service's environment lacks it"
            )
        default = interpolated[variable]
        if default and default not in stated:
            problems.append(
                f"docs/deployment.md: {variable}'s default stated as {stated}, docker-compose.yml has {default!r}"
            )
        if not default and stated:
            problems.append(f"docs/deployment.md: {variable}'s default stated as {stated}, docker-compose.yml has none")
    for variable in sorted(set(interpolated) - set(table)):
        if variable not in docs["docs/deployment.md"]:
            problems.append(f"docker-compose.yml's triton service reads {variable}; docs/deployment.md never names it")
    # The pod's settings in kubernetes.md's tables are the manifests' (the container's env or the Secret's file).
    manifests = {name for path, text in sources.items() if path.startswith("deploy/") for name in pattern.findall(text)}
    for line in docs["docs/kubernetes.md"].splitlines():
        if line.startswith("|"):
            for variable in pattern.findall(line):
                if variable not in manifests:
                    problems.append(f"docs/kubernetes.md: a pod setting {variable} that no manifest sets")
    return problems


def module_constants(project: Path, *names: str) -> dict[str, tuple[object, str]]:
    """{NAME: (its value, the source it is defined in)} for module-level constants of the package."""
    found = {}
    for path in package_dir(project).rglob("*.py"):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id in names:
                        found[target.id] = (node.value.value, source)
    return found


def f_string_pattern(template: str) -> re.Pattern:
    """An f-string's text, `{expression}` by `{expression}`, as a regex a printed line fullmatches."""
    parts = re.split(r"\{[^{}]*\}", template)
    return re.compile(".+?".join(re.escape(part) for part in parts))


def restart_problems(project: Path, root_readme: str) -> list[str]:
    constants = module_constants(project, "RESTART_LIMIT", "RESTART_WINDOW_S")
    if set(constants) != {"RESTART_LIMIT", "RESTART_WINDOW_S"}:
        return [f"the package no longer defines RESTART_LIMIT and RESTART_WINDOW_S (found {sorted(constants)})"]
    limit, source = constants["RESTART_LIMIT"]
    minutes = constants["RESTART_WINDOW_S"][0] / 60
    # How many restarts a window allows: `len(recent) < RESTART_LIMIT` allows RESTART_LIMIT of them.
    comparison = re.search(r"len\(\w+\) (<=?) RESTART_LIMIT", source)
    if comparison is None:
        return ["restarts are no longer counted as `len(recent) < RESTART_LIMIT`: update restart_problems"]
    allowed = limit if comparison.group(1) == "<" else limit + 1
    serving = (package_dir(project) / "serving.py").read_text()
    announced = re.findall(r'f"(tritonserver \{\w+\}: starting it again[^"]*)"', serving)
    if len(announced) != 1:
        return [
            f"serving.py announces a restart in {len(announced)} f-strings `tritonserver {{why}}: starting it again`"
        ]
    announced = announced[0]
    docs = {name: flat(text) for name, text in doc_texts(project, root_readme).items()}
    problems, stated = [], 0
    for name, text in docs.items():
        claims = [(int(n), int(m)) for n, m in re.findall(r"(\d+) restarts (?:with)?in (\d+) minutes", text)]
        claims += [(int(n), int(m)) for n, m in re.findall(r"up to (\d+) times within (\d+) minutes", text)]
        for n, m in claims:
            stated += 1
            if (n, m) != (allowed, minutes):
                problems.append(f"{name}: {n} restarts in {m} minutes; the code allows {allowed} in {minutes:g}")
        for n in re.findall(r"\bdie a (\d+)(?:st|nd|rd|th) time", text):
            stated += 1
            if int(n) != allowed + 1:
                problems.append(f"{name}: serve exits at the {n}th death; the code at the {allowed + 1}th")
        for line in re.findall(r"`(tritonserver [^`]*: starting it again[^`]*)`", text):
            if not f_string_pattern(announced).fullmatch(line):
                problems.append(f"{name}: serve announces a restart as {line!r}; serving.py prints f{announced!r}")
    if not stated:
        problems.append("no doc states how many times serve restarts tritonserver any more")
    return problems


def benchmark_outputs(project: Path) -> dict[str, set[str]]:
    """{benchmark module: the file names it writes into its --out folder}, from its source: `_common.write(name, ...)`
    writes name + each suffix its body writes; others write `out / "file"` themselves; run.py runs the modules it
    imports."""
    folder = project / "benchmarks"
    common = (folder / "_common.py").read_text()
    body = re.search(r"\ndef write\(.*?\n(?=\S)", common, re.DOTALL).group(0)
    suffixes = re.findall(r'out / f"\{name\}(\.\w+)"', body)
    direct = r'\(\s*out / "([\w.-]+\.\w+)"\)\.write_(?:text|bytes)\(|savefig\(\s*out / "([\w.-]+\.\w+)"'
    outputs, runs = {}, {}
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        source = path.read_text()
        names = []
        imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.module == "_common"]
        if any(alias.name == "write" for node in imports for alias in node.names):
            names = re.findall(r'\bwrite\(\s*"([\w-]+)"', source)
            if re.search(r"\bwrite\(\s*args\.name\b", source):
                names += re.findall(r'add_argument\("--name", default="([\w-]+)"', source)
        files = {name + suffix for name in names for suffix in suffixes}
        files |= {name for pair in re.findall(direct, source) for name in pair if name}
        outputs[path.stem] = files
        runs[path.stem] = [
            m.strip()
            for m in ",".join(re.findall(r"^from \. import ([\w, ]+)$", source, re.MULTILINE)).split(",")
            if m.strip()
        ]
    for module, others in runs.items():
        for other in others:
            outputs[module] |= outputs.get(other, set())
    return outputs


def make_targets(project: Path) -> dict[str, str]:
    """{make target: the benchmark module its recipe runs}."""
    makefile = (project / "Makefile").read_text()
    return dict(re.findall(r"^([\w-]+):[^\n]*\n(?:\t[^\n]*\n)*?\t[^\n]*-m benchmarks\.(\w+)", makefile, re.MULTILINE))


def output_file_problems(project: Path) -> list[str]:
    outputs = benchmark_outputs(project)
    common = (project / "benchmarks" / "_common.py").read_text()
    problems = []
    if not re.search(r'^RESULTS = PROJECT / "benchmarks" / "results"$', common, re.MULTILINE):
        problems.append("benchmarks/_common.py's RESULTS is no longer benchmarks/results")
    targets = make_targets(project)
    written = set().union(*outputs.values())
    stated = 0
    for path in generated_markdown(project):
        name = path.relative_to(project)
        for paragraph in re.split(r"\n\s*\n", path.read_text()):
            # A file named under benchmarks/results/ is written by a benchmark the paragraph runs (else by any).
            modules = set(re.findall(r"benchmarks/(\w+)\.py|-m benchmarks\.(\w+)", paragraph))
            modules = {m for pair in modules for m in pair if m} | {
                targets[t] for t in re.findall(r"`make ([\w-]+)", paragraph) if t in targets
            }
            for cited in re.findall(r"benchmarks/results/([\w.{},-]+\.(?:\w+|\{[\w,]+\}))", paragraph):
                for file in expand_braces(cited):
                    stated += 1
                    writers = {m for m in modules if file in outputs.get(m, set())} if modules else set()
                    if file not in written or (modules and not writers):
                        by = ", ".join(sorted(modules)) if modules else "any benchmark"
                        problems.append(f"{name}: benchmarks/results/{file}, which {by} does not write")
        # performance.md: "Each writes `<name>.json` and `<name>.md` to `benchmarks/results/`, and all but budgets a
        # plot, `<name>.png`": each command of the code block above it.
        text = path.read_text()
        for match in re.finditer(
            r"```\n(?P<block>(?:(?!```).*\n)*)```\n\nEach writes (?P<each>(?:`<name>\.\w+`(?: and |, )?)+) to "
            r"`benchmarks/results/`, and all but (?P<but>[\w, ]+?) a plot, `<name>\.(?P<plot>\w+)`",
            text,
        ):
            each = re.findall(r"`<name>(\.\w+)`", match["each"])
            but = set(re.split(r",\s*|\s+and\s+", match["but"]))
            commands = re.findall(r"-m benchmarks\.(\w+)", match["block"]) + [
                targets.get(t, f"make {t}") for t in re.findall(r"^make ([\w-]+)", match["block"], re.MULTILINE)
            ]
            for module in commands:
                stated += 1
                files = outputs.get(module, set())
                stems = {f.rsplit(".", 1)[0] for f in files}
                if not any(all(stem + suffix in files for suffix in each) for stem in stems):
                    problems.append(f"{name}: {module} writes {sorted(files)}, not <name>{' and <name>'.join(each)}")
                plots = any(f.endswith("." + match["plot"]) for f in files)
                if plots == (module in but):
                    says = "no plot" if module in but else "a plot"
                    problems.append(f"{name}: {module} writes {sorted(files)}; the doc says {says}")
    if not stated:
        problems.append("no generated doc says what a benchmark writes any more")
    return problems


def first_stdout_print(function: ast.FunctionDef) -> ast.Call | None:
    """The first print() to stdout of a run that starts the server: not one to a file=, not one under `if args.print_`
    (--print-flags and --print-shm print, then return)."""

    def prints(node):
        return [
            call
            for call in ast.walk(node)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "print"
            and not any(keyword.arg == "file" for keyword in call.keywords)
        ]

    def visit(statements):
        for statement in statements:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(statement, ast.If) and "args.print_" in ast.unparse(statement.test):
                yield from visit(statement.orelse)
                continue
            blocks = [getattr(statement, field, []) for field in ("body", "handlers", "orelse", "finalbody")]
            if not any(blocks):
                yield from prints(statement)
                continue
            for header in ast.iter_child_nodes(statement):  # an if's test, a with's items, ...
                if not isinstance(header, (ast.stmt, ast.excepthandler)):
                    yield from prints(header)
            for block in blocks:
                yield from visit(block)

    return next(visit(function.body), None)


def printed_shape(shape: str) -> re.Pattern:
    """A doc's shape of a printed line (`ready in N s`, `error: <file>: <reason>`, `instances: ...`) as a regex over
    the source of an f-string: N, <word> and ... stand for an `{expression}`."""
    parts = re.split(r"\bN\b|<\w+>|\.\.\.", shape)
    return re.compile(r"f[\"']" + r"\{[^{}]*\}".join(re.escape(part) for part in parts))


def cli_output_problems(project: Path) -> list[str]:
    package = package_dir(project)
    serving = (package / "serving.py").read_text()
    cli = (package / "cli.py").read_text()
    readme = flat((project / "README.md").read_text())
    problems = []
    # serve: its first line, the lines the README quotes, the example of the first line.
    serve = next(n for n in ast.parse(serving).body if isinstance(n, ast.FunctionDef) and n.name == "serve")
    first = first_stdout_print(serve)
    first_text = ast.unparse(first.args[0]) if first and first.args else ""
    said = re.search(r"`serve` says the instance counts it chose \(its first line: `([^`]*)`\)", readme)
    if said is None:
        problems.append("README.md no longer says serve's first line (`serve` says the instance counts it chose ...)")
    elif not printed_shape(said.group(1)).match(first_text):
        problems.append(f"README.md: serve's first line is {said.group(1)!r}; serving.serve first prints {first_text}")
    for quoted in ("ready in N s", "tritonserver log:"):
        if f"`{quoted}`" not in readme:
            problems.append(f"README.md no longer quotes serve's `{quoted}` line")
        elif not printed_shape(quoted).search(serving):
            problems.append(f"README.md quotes serve's `{quoted}`, which serving.py does not print")
    if said:
        prefix = said.group(1).split("...")[0]
        example = re.findall(r"```text\n(.*?)\n```", (project / "README.md").read_text(), re.DOTALL)
        if not any(block.startswith(prefix) for block in example):
            problems.append(f"README.md's example of serve's first line does not start {prefix!r}")
    # classify: a row per top-k class (image, score, class id, label) or an error line, and its exit status.
    claim = re.search(
        r"`classify` prints a row per top-(\d+) class of each image \(([^)]*)\) or `([^`]*)`, and exits (\d+) if any "
        r"failed \(`(--[\w-]+)` for scripts\)",
        readme,
    )
    if claim is None:
        return problems + [
            "README.md no longer says what classify prints (`classify` prints a row per top-k class ...)"
        ]
    k, columns, error, status, flag = claim.groups()
    scores = next(o for o in config(project, "postprocess").output if o.name == "SCORES")
    if int(k) != scores.dims[-1]:
        problems.append(f"README.md: classify prints the top-{k}; postprocess's SCORES has dims {list(scores.dims)}")
    header = re.search(r"^HEADER = (\(.*\))$", cli, re.MULTILINE)
    if header is None or ["image", *ast.literal_eval(header.group(1))] != [c.strip() for c in columns.split(",")]:
        problems.append(
            f"README.md: classify's columns ({columns}); cli.py prints image and HEADER {header and header.group(1)}"
        )
    if not re.search(r"for \w+, \w+ in enumerate\(result\):\n\s+print\(", cli):
        problems.append("cli.print_table no longer prints a row per class of an image")
    if not printed_shape(error).search(cli):
        problems.append(f"README.md: classify's error line {error!r}, which cli.py does not print")
    if not re.search(rf"return {status} if any\(isinstance\(result, str\)", cli):
        problems.append(f"README.md: classify exits {status} if any image failed; cli.report returns otherwise")
    if f'"{flag}"' not in cli:
        problems.append(f"README.md: classify {flag}, which cli.py does not define")
    return problems


def kubernetes_problems(project: Path) -> list[str]:
    """docs/kubernetes.md against deploy/kubernetes/: its tree names every manifest of base/, its startupProbe row
    the probe's own budget, and every image it pushes or runs the tag compose builds (the project's version)."""
    text = (project / "docs/kubernetes.md").read_text()
    problems = []
    tree = text.split("```text", 1)[1].split("```", 1)[0] if "```text" in text else ""
    for manifest in sorted((project / "deploy/kubernetes/base").iterdir()):
        if manifest.name not in tree:
            problems.append(f"docs/kubernetes.md: its deploy/kubernetes/ tree lacks base/{manifest.name}")
    deployment = next(yaml.safe_load_all((project / "deploy/kubernetes/base/deployment.yaml").read_text()))
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if "startupProbe" in c]
    probe = container["startupProbe"]
    stated = re.findall(r"`startupProbe`[^|]*up to (\d+) x (\d+) s", text)
    if stated != [(str(probe["failureThreshold"]), str(probe["periodSeconds"]))]:
        problems.append(
            f"docs/kubernetes.md: startupProbe stated as {stated}; deployment.yaml has "
            f"{probe['failureThreshold']} x {probe['periodSeconds']} s"
        )
    version = re.search(r'^version = "([^"]+)"', (project / "pyproject.toml").read_text(), re.M).group(1)
    for tag in sorted(set(re.findall(rf"registry\.example\.com/{re.escape(project.name)}:([\w.-]+)", text))):
        if tag != version:
            problems.append(f"docs/kubernetes.md: pushes or runs the image tagged {tag}; compose builds {version}")
    return problems


DEFAULT_CHECKS = {
    "instance counts": lambda project, readme: instance_count_problems(project, readme),
    "the pipeline's stage settings": lambda project, readme: stage_setting_problems(project, readme),
    "/dev/shm size": lambda project, readme: shm_problems(project),
    "server flags": lambda project, readme: server_flag_problems(project),
    "base images": lambda project, readme: base_image_problems(project, readme),
    "environment variables": lambda project, readme: environment_problems(project, readme),
    "restart counts": lambda project, readme: restart_problems(project, readme),
    "benchmark output files": lambda project, readme: output_file_problems(project),
    "CLI output": lambda project, readme: cli_output_problems(project),
    "Kubernetes manifests": lambda project, readme: kubernetes_problems(project),
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
    (stated,) = re.findall(r"^instances: (GPU 0: 16\.0 GiB free -> .*)$", readme, re.MULTILINE)
    code = (
        f"from {package_dir(project).name} import sizing as s; g = s.GiB; "
        "print(s.plan('model_repository', [s.Device(0, 'GPU', 80 * g, 16 * g)], shm_free=None)[0].line())"
    )
    env = dict(os.environ, PYTHONPATH=str(project / "src"))
    run = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=project, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == stated


def altered_copy(project: Path, tmp_path: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """A copy of the bake with `old` replaced by `new` once in each named file (each edit must apply)."""
    copy = Path(shutil.copytree(project, tmp_path / project.name))
    for name, (old, new) in edits.items():
        path = copy / name.replace("<package>", package_dir(copy).relative_to(copy).as_posix())
        text = path.read_text()
        assert old in text, (name, old)
        path.write_text(text.replace(old, new, 1))
    return copy


def test_the_environment_check_catches_an_unknown_variable_a_dropped_pass_through_and_a_wrong_default(
    default_project, tmp_path
):
    copy = altered_copy(
        default_project,
        tmp_path,
        {
            "README.md": ("`TRITON_GPU_MEMORY`)", "`TRITON_GPU_BUDGET`)"),
            "docker-compose.yml": ("      TRITON_TRACE: ${TRITON_TRACE:-}", "      OTEL_TRACE: ${TRITON_TRACE:-}"),
            "docs/deployment.md": ("| `TRITON_GPU_COUNT` | `1` |", "| `TRITON_GPU_COUNT` | `all` |"),
        },
    )
    found = environment_problems(copy, (ROOT / "README.md").read_text())
    assert len(found) == 3, found
    assert "README.md: names TRITON_GPU_BUDGET" in found[0]
    assert any("TRITON_GPU_COUNT's default stated as ['all']" in f and "'1'" in f for f in found), found
    assert any("lists TRITON_TRACE, which serve reads; the triton service's environment lacks it" in f for f in found)


def test_the_restart_check_catches_a_changed_limit_and_window(default_project, tmp_path):
    copy = altered_copy(
        default_project,
        tmp_path,
        {
            "<package>/restarts.py": (
                "RESTART_LIMIT = 5\nRESTART_WINDOW_S = 600.0",
                "RESTART_LIMIT = 3\nRESTART_WINDOW_S = 300.0",
            )
        },
    )
    found = restart_problems(copy, "")
    assert any(f.startswith("README.md: 5 restarts in 10 minutes; the code allows 3 in 5") for f in found), found
    assert any(f.startswith("docs/kubernetes.md: serve exits at the 6th death; the code at the 4th") for f in found)
    assert any(f.startswith("docs/deployment.md: 5 restarts in 10 minutes") for f in found), found


def test_the_restart_check_catches_an_off_by_one_and_a_misquoted_line(default_project, tmp_path):
    copy = altered_copy(
        default_project,
        tmp_path,
        {
            "<package>/restarts.py": ("< RESTART_LIMIT", "<= RESTART_LIMIT"),
            "<package>/serving.py": ("starting it again (restart {", "starting it again (attempt {"),
        },
    )
    found = restart_problems(copy, "")
    assert any("the code allows 6 in 10" in f for f in found) and any("the 7th" in f for f in found), found
    assert any(f.startswith("docs/deployment.md: serve announces a restart as 'tritonserver killed") for f in found)


def test_the_output_file_check_catches_a_plot_no_longer_drawn_and_a_file_never_written(default_project, tmp_path):
    copy = altered_copy(
        default_project,
        tmp_path,
        {
            "benchmarks/_common.py": (
                '    fig.savefig(out / f"{name}.png", dpi=120)\n',
                "    fig.savefig(out, dpi=120)\n",
            ),
            "docs/deployment.md": ("benchmarks/results/soak.{json,md,png}", "benchmarks/results/soak.{json,md,csv}"),
        },
    )
    found = output_file_problems(copy)
    assert "docs/deployment.md: benchmarks/results/soak.csv, which soak does not write" in found, found
    assert any(f.startswith("docs/performance.md: hop writes") and f.endswith("the doc says a plot") for f in found)


def test_the_cli_output_check_catches_a_new_first_line_a_changed_column_and_top_k(default_project, tmp_path):
    copy = altered_copy(
        default_project,
        tmp_path,
        {
            "<package>/serving.py": (
                "    for device_plan in plans:\n",
                '    print("admin key ready")\n    for device_plan in plans:\n',
            ),
            "<package>/cli.py": ('HEADER = ("score", "class id", "label")', 'HEADER = ("score", "label")'),
            "README.md": ("class of each image (image,", "class of each image (image, rank,"),
            "model_repository/postprocess/config.pbtxt": (
                '"SCORES", data_type: TYPE_FP32, dims: [ 5 ]',
                '"SCORES", data_type: TYPE_FP32, dims: [ 3 ]',
            ),
        },
    )
    found = cli_output_problems(copy)
    assert any("serve's first line is 'instances: ...'" in f and "admin key ready" in f for f in found), found
    assert any(f.startswith("README.md: classify's columns (image, rank,") for f in found), found
    assert "README.md: classify prints the top-5; postprocess's SCORES has dims [3]" in found, found
    assert len(found) == 3, found


def test_the_kubernetes_check_catches_a_missing_manifest_a_shorter_probe_and_another_tag(default_project, tmp_path):
    copy = altered_copy(
        default_project,
        tmp_path,
        {"docs/kubernetes.md": ("up to 90 x 10 s", "up to 60 x 10 s")},
    )
    (copy / "deploy/kubernetes/base/limitrange.yaml").write_text("kind: LimitRange\n")
    docs = copy / "docs/kubernetes.md"
    docs.write_text(docs.read_text().replace(":0.1.0\n\ncd deploy", ":1.0\n\ncd deploy"))
    found = kubernetes_problems(copy)
    assert "docs/kubernetes.md: its deploy/kubernetes/ tree lacks base/limitrange.yaml" in found, found
    assert any(f.startswith("docs/kubernetes.md: startupProbe stated as [('60', '10')]") for f in found), found
    assert "docs/kubernetes.md: pushes or runs the image tagged 1.0; compose builds 0.1.0" in found, found
    assert len(found) == 3, found
