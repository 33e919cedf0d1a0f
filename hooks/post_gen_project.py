"""Remove what was not selected, then say what to run next. No network."""

import json
import shutil
from pathlib import Path

SLUG = {{ cookiecutter.project_slug | tojson }}
INCLUDE_ENSEMBLE = str(json.loads({{ cookiecutter.include_ensemble | tojson | tojson }})).lower() in ("true", "yes", "1")


def remove_ensemble():
    shutil.rmtree(Path("model_repository") / "ensemble")


NEXT = f"""
Baked {SLUG}/. Next:

  cd {SLUG} && make setup weights-random demo

make setup makes .venv (Python 3.10-3.12; about 6 GB and several minutes: torch with its CUDA libraries,
or far less with a CPU-only torch, see README.md); weights-random writes random weights offline; demo starts
Triton, classifies two images and stops. Then: make serve, make test, make help.
"""


def main():
    if not INCLUDE_ENSEMBLE:
        remove_ensemble()
    print(NEXT)


if __name__ == "__main__":
    main()
