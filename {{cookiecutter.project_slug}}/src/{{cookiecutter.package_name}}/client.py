"""A small gRPC client for the `pipeline` (BLS) and `ensemble` models."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient

DEFAULT_URL = "localhost:{{ cookiecutter.grpc_port }}"


@dataclass(frozen=True)
class Prediction:
    class_id: int
    label: str
    score: float


class ImageClassifier:
    """classify([jpeg_or_png_bytes, ...]) -> one list of top-k Predictions per image, best first."""

    def __init__(self, url: str = DEFAULT_URL, model: str = "pipeline", timeout_s: float | None = 60):
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.timeout_s = timeout_s

    def infer(self, images: list[bytes], parameters: dict | None = None) -> grpcclient.InferResult:
        """The raw Triton result (SCORES, CLASS_IDS, LABELS) for a batch of encoded images. `parameters` go with
        the request; a BLS model.py reads them with `request.parameters()` (docs/customizing.md, recipe 3)."""
        batch = np.array([[image] for image in images], dtype=object)
        inputs = [grpcclient.InferInput("IMAGE", list(batch.shape), "BYTES")]
        inputs[0].set_data_from_numpy(batch)
        outputs = [grpcclient.InferRequestedOutput(name) for name in ("SCORES", "CLASS_IDS", "LABELS")]
        return self.client.infer(
            self.model, inputs, outputs=outputs, client_timeout=self.timeout_s, parameters=parameters
        )

    def classify(self, images: list[bytes], parameters: dict | None = None) -> list[list[Prediction]]:
        result = self.infer(images, parameters)
        scores, class_ids, labels = (result.as_numpy(n) for n in ("SCORES", "CLASS_IDS", "LABELS"))
        return [
            [Prediction(int(class_id), label.decode(), float(score)) for score, class_id, label in zip(*row)]
            for row in zip(scores, class_ids, labels)
        ]

    def close(self) -> None:
        self.client.close()
