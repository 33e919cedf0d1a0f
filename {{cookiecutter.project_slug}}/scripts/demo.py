"""Start the local Triton on the model repository, classify a few generated images over gRPC, stop."""

import io
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from {{ cookiecutter.package_name }}.client import ImageClassifier
from {{ cookiecutter.package_name }}.server import ServerSettings, TritonServer, print_model_states
from {{ cookiecutter.package_name }}.sizing import plan_for_serve


def sample_images() -> dict[str, bytes]:
    """Two synthetic pictures (a JPEG and a PNG): no dataset download needed."""
    y, x = np.mgrid[0:240, 0:320] / 320
    samples = {}
    for name, fmt, freq in (("waves.jpg", "JPEG", 3), ("stripes.png", "PNG", 9)):
        rgb = ((np.stack([np.sin(freq * x), np.cos(freq * y), np.sin(freq * (x + y))], -1) + 1) * 127.5).astype(
            np.uint8
        )
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, format=fmt)
        samples[name] = buffer.getvalue()
    return samples


def main() -> int:
    settings = ServerSettings()
    # The counts this machine carries, as `serve` sizes them (sizing.py): one instance each on a small CPU host.
    (plan, *_) = plan_for_serve(settings.model_repository, settings.gpus, None, {}, settings.mps)
    settings.instance_counts = plan.overrides
    with tempfile.TemporaryFile("w+") as log, TritonServer(settings, log=log) as server:
        print(f"instances: {plan.line()}")
        print(f"starting tritonserver on {settings.model_repository} ...")
        try:
            server.wait_ready(600, progress=print_model_states)
        except Exception:
            log.seek(0)
            print(log.read()[-4000:], file=sys.stderr)
            raise
        images = sample_images()
        for model in ("pipeline", "ensemble"):
            if not (Path(settings.model_repository) / model).is_dir():
                continue
            client = ImageClassifier(server.grpc_url, model)
            print(f"\n{model} over gRPC at {server.grpc_url}:")
            for name, predictions in zip(images, client.classify(list(images.values()))):
                print(f"  {name}: " + ", ".join(f"{p.label} {p.score:.3f}" for p in predictions))
            client.close()
        print("\nstopping tritonserver")
    return 0


if __name__ == "__main__":
    sys.exit(main())
