"""Remove what was not selected. No network."""

import json
import shutil
from pathlib import Path

INCLUDE_ENSEMBLE = str(json.loads({{ cookiecutter.include_ensemble | tojson | tojson }})).lower() in ("true", "yes", "1")


def remove_ensemble():
    shutil.rmtree(Path("model_repository") / "ensemble")


def main():
    if not INCLUDE_ENSEMBLE:
        remove_ensemble()


if __name__ == "__main__":
    main()
