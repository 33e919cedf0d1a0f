"""End to end over gRPC against a real tritonserver: the BLS pipeline, the ensemble and bad input."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import image_input, infer, make_image
from tritonclient.utils import InferenceServerException

from {{ cookiecutter.package_name }}.client import ImageClassifier
from {{ cookiecutter.package_name }}.stages import imagenet_labels

pytestmark = pytest.mark.e2e


def tolerance(reference) -> dict:
    """Same code, same weights: exact up to float noise on the CPU; on a GPU, cuDNN picks its kernels per batch."""
    if reference.preprocess.dtype != torch.float32:
        return {"atol": 2e-2, "rtol": 0}
    return {"atol": 1e-4, "rtol": 0} if reference.preprocess.device.type == "cpu" else {"atol": 1e-3, "rtol": 1e-2}


def assert_matches_reference(result, images, reference):
    scores, class_ids = reference(images)
    np.testing.assert_allclose(result.as_numpy("SCORES"), scores.cpu().numpy(), **tolerance(reference))
    assert (result.as_numpy("CLASS_IDS")[:, 0] == class_ids[:, 0].cpu().numpy()).all()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_one_image_matches_the_in_process_reference(client, reference, fmt):
    image = make_image(10, fmt=fmt)
    assert_matches_reference(client.infer([image]), [image], reference)


def test_a_batch_answers_each_image_with_sorted_top_k_and_labels(client, reference, max_batch):
    n = min(8, max_batch)
    images = [make_image(20 + i, size=(200 + 37 * i, 180 + 11 * i), fmt="PNG" if i % 3 else "JPEG") for i in range(n)]
    result = client.infer(images)
    assert_matches_reference(result, images, reference)
    scores, class_ids, labels = (result.as_numpy(n) for n in ("SCORES", "CLASS_IDS", "LABELS"))
    assert scores.shape == class_ids.shape == labels.shape == (n, reference.postprocess.top_k)
    assert (np.diff(scores, axis=1) <= 0).all() and (scores > 0).all() and (scores.sum(1) <= 1 + 1e-5).all()
    names = imagenet_labels()
    assert [[label.decode() for label in row] for row in labels] == [[names[i] for i in row] for row in class_ids]


def test_client_api_returns_predictions(client):
    (predictions,) = client.classify([make_image(30)])
    assert len(predictions) > 0 and predictions[0].label in imagenet_labels()
    assert predictions == sorted(predictions, key=lambda p: -p.score)


def test_concurrent_clients_each_get_their_own_answer(server, reference):
    images = [make_image(40 + i) for i in range(6)]
    expected = reference(images)[1][:, 0].tolist()

    def worker(i):
        classifier = ImageClassifier(server.grpc_url)
        try:
            return [classifier.classify([images[(i + n) % 6]])[0][0].class_id for n in range(5)]
        finally:
            classifier.close()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(worker, range(8)))
    assert answers == [[expected[(i + n) % 6] for n in range(5)] for i in range(8)]


def test_pipeline_and_ensemble_answer_the_same(server, model_repository, max_batch):
    if not (model_repository / "ensemble").is_dir():
        pytest.skip("this project was baked without the ensemble")
    images = [make_image(50), make_image(51, fmt="PNG")][:max_batch]
    bls, ens = (
        infer(server.grpc_url, [image_input(images)], "pipeline"),
        infer(server.grpc_url, [image_input(images)], "ensemble"),
    )
    np.testing.assert_allclose(bls.as_numpy("SCORES"), ens.as_numpy("SCORES"), atol=1e-5, rtol=0)
    for name in ("CLASS_IDS", "LABELS"):
        np.testing.assert_array_equal(bls.as_numpy(name), ens.as_numpy(name))


@pytest.mark.parametrize("mode, fmt", [("L", "PNG"), ("RGBA", "PNG"), ("CMYK", "JPEG"), ("L", "JPEG")])
def test_grayscale_alpha_and_cmyk_are_served(client, reference, mode, fmt):
    image = make_image(60, mode=mode, fmt=fmt)
    assert_matches_reference(client.infer([image]), [image], reference)


def test_a_bad_request_fails_alone_while_concurrent_good_ones_succeed(server, reference):
    good = [make_image(80 + i) for i in range(4)]
    expected = reference(good)[1][:, 0].tolist()

    def send(i):
        try:
            result = infer(server.grpc_url, [image_input([good[i % 4]] if i % 5 else [b"bad bytes"])])
            return int(result.as_numpy("CLASS_IDS")[0, 0])
        except InferenceServerException as exc:
            return exc.status()

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(send, range(40)))
    assert answers == [expected[i % 4] if i % 5 else "StatusCode.INVALID_ARGUMENT" for i in range(40)]


def test_cli_classify_prints_top_k(server, tmp_path):
    path = tmp_path / "cat.jpg"
    path.write_bytes(make_image(90))
    cli = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "classify", str(path), "--url", server.grpc_url]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == str(path)
    assert lines[1].split()[2] in " ".join(imagenet_labels())
