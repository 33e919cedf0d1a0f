"""Validate every answer before anything is generated; on a bad one print `ERROR: ...` and exit 1."""

import json
import keyword
import re
import sys

# The answers arrive as JSON data, never pasted into code.
ANSWERS = json.loads({{ cookiecutter | jsonify | tojson }})

# resnet_variant and precision are choices: cookiecutter itself refuses any other value.
# Triton container release -> the tritonserver version inside it. The local runtime (nvidia-pytriton 0.7.0)
# bundles 2.51.0, so only 24.10 keeps the container and the tested local server the same version.
SUPPORTED_TRITON = {"24.10": "2.51.0"}
# Package names that would shadow a module the generated project imports.
RESERVED_PACKAGES = {"torch", "torchvision", "numpy", "PIL", "tritonclient", "pytriton", "triton",
                     "triton_python_backend_utils", "google", "pytest", "test", "tests"}


def integer(name, low, high):
    value = ANSWERS[name]
    # Digits only, no leading zero: the value is rendered as is into Python, protobuf text and YAML.
    if isinstance(value, bool) or not re.fullmatch(r"0|[1-9][0-9]*", str(value)):
        return f"{name} must be a whole number from {low} to {high}, got {value!r}"
    if not low <= int(value) <= high:
        return f"{name} must be from {low} to {high}, got {int(value)}"
    return None


def errors():
    a = ANSWERS
    if not str(a["project_name"]).strip():
        yield "project_name is empty: give the project a name"
    for field in ("project_name", "description", "author_name"):
        if any(ord(c) < 32 or ord(c) == 127 for c in str(a[field])):
            yield f"{field} contains a control character (a newline, a tab, ...): keep it to one line of text"
    if not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", a["project_slug"]):
        yield (f"project_slug {a['project_slug']!r} must be lowercase letters, digits and single hyphens, "
               "starting with a letter (e.g. image-classifier)")
    pkg = a["package_name"]
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", pkg) or keyword.iskeyword(pkg):
        yield f"package_name {pkg!r} must be a lowercase Python identifier that is not a keyword (e.g. image_classifier)"
    elif pkg in RESERVED_PACKAGES or pkg in sys.stdlib_module_names:
        yield f"package_name {pkg!r} would shadow the module of the same name: choose another"
    yield integer("max_batch_size", 1, 1024)
    yield integer("top_k", 1, 1000)
    if a["triton_version"] not in SUPPORTED_TRITON:
        yield (f"triton_version {a['triton_version']!r} is not supported: use one of {', '.join(SUPPORTED_TRITON)} "
               "(the local runtime bundles tritonserver 2.51.0 = container 24.10; another release would "
               "make the container and the tested local server disagree)")
    ports = ("http_port", "grpc_port", "metrics_port")
    port_errors = [integer(p, 1024, 65535) for p in ports]
    yield from port_errors
    if not any(port_errors) and len({int(a[p]) for p in ports}) < 3:
        yield "http_port, grpc_port and metrics_port must be three different ports"
    if str(a["include_ensemble"]).lower() not in ("true", "false", "yes", "no", "1", "0"):
        yield f"include_ensemble must be true or false, got {a['include_ensemble']!r}"


def main():
    found = [e for e in errors() if e]
    for error in found:
        print(f"ERROR: {error}", file=sys.stderr)
    if found:
        # cookiecutter 2.x then logs "Stopping generation ..." with a traceback of its own (hooks.py calls
        # logger.exception; a hook cannot silence it): say which lines to read.
        print("Nothing was generated. The ERROR line(s) above say what to fix; the traceback cookiecutter prints "
              "next only reports that this check stopped the bake.", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
