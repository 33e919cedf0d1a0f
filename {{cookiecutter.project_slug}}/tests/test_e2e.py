"""End to end over gRPC against a real tritonserver: the BLS pipeline, the ensemble and bad input."""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import (
    EXTERNAL_GRPC_URL,
    PROJECT,
    assert_same_answers,
    image_input,
    infer,
    local_server,
    local_server_only,
    make_image,
    outputs,
)
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from {{ cookiecutter.package_name }}.client import ImageClassifier
from {{ cookiecutter.package_name }}.model_repository import (
    BLS_CALLS,
    labels_path,
    load_config,
    parameters,
    python_models,
    set_instance_counts,
    set_parameter,
)
from {{ cookiecutter.package_name }}.stages import read_labels

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


@pytest.fixture(scope="module")
def labels(model_repository) -> list[str]:
    """The class names the server was given: resnet's labels.txt."""
    return read_labels(labels_path(model_repository))


def test_a_batch_answers_each_image_with_sorted_top_k_and_labels(client, reference, max_batch, labels):
    n = min(8, max_batch)
    images = [make_image(20 + i, size=(200 + 37 * i, 180 + 11 * i), fmt="PNG" if i % 3 else "JPEG") for i in range(n)]
    result = client.infer(images)
    assert_matches_reference(result, images, reference)
    scores, class_ids, names = (result.as_numpy(n) for n in ("SCORES", "CLASS_IDS", "LABELS"))
    assert scores.shape == class_ids.shape == names.shape == (n, reference.postprocess.top_k)
    assert (np.diff(scores, axis=1) <= 0).all() and (scores > 0).all() and (scores.sum(1) <= 1 + 1e-5).all()
    assert [[name.decode() for name in row] for row in names] == [[labels[i] for i in row] for row in class_ids]


def test_client_api_returns_predictions(client, labels):
    (predictions,) = client.classify([make_image(30)])
    assert len(predictions) > 0 and predictions[0].label == labels[predictions[0].class_id]
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
    steps = {step.model_name for step in load_config(model_repository / "ensemble").ensemble_scheduling.step}
    if steps != set(BLS_CALLS["pipeline"]):
        calls, steps = sorted(BLS_CALLS["pipeline"]), sorted(steps)
        pytest.skip(f"the pipeline calls {calls}, the ensemble {steps}: they answer alike only with the same steps")
    images = [make_image(50), make_image(51, fmt="PNG")][:max_batch]
    bls, ens = (
        infer(server.grpc_url, [image_input(images)], "pipeline"),
        infer(server.grpc_url, [image_input(images)], "ensemble"),
    )
    assert_same_answers(outputs(bls), outputs(ens), model_repository)


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


def test_resnet_answers_triton_classification_requests_with_its_labels_file(server, model_repository, labels):
    """Triton's classification extension: LOGITS with class_count=k come back as "score:index:label" strings,
    the label from resnet's `label_filename` (labels.txt)."""
    pixels = next(i for i in load_config(model_repository / "resnet").input if i.name == "PIXELS")
    datatype = model_config_pb2.DataType.Name(pixels.data_type).removeprefix("TYPE_")
    data = np.random.default_rng(0).standard_normal((1, *pixels.dims))
    data = data.astype(np.float16 if datatype == "FP16" else np.float32)  # BF16 is sent from FP32 data
    tensor = grpcclient.InferInput("PIXELS", list(data.shape), datatype)
    tensor.set_data_from_numpy(data)
    k = min(3, len(labels))
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        result = c.infer("resnet", [tensor], outputs=[grpcclient.InferRequestedOutput("LOGITS", class_count=k)])
        logits = c.infer("resnet", [tensor]).as_numpy("LOGITS")[0]
    answers = [entry.decode().split(":", 2) for entry in result.as_numpy("LOGITS").reshape(-1)]
    assert [int(index) for _, index, _ in answers] == np.argsort(-logits, kind="stable")[:k].tolist()
    assert [label for _, _, label in answers] == [labels[int(index)] for _, index, _ in answers]
    scores = [float(score) for score, _, _ in answers]
    np.testing.assert_allclose(scores, np.sort(logits)[::-1][:k], atol=1e-5, rtol=1e-5)


STAGES = ("preprocess", "postprocess")  # the pipeline's parameters of these names: "bls" or "in_process"


def stage_calls(url: str, headers: dict) -> dict[str, int]:
    """How many requests each stage model has executed on the server at `url`."""
    with grpcclient.InferenceServerClient(url) as c:
        return {m: c.get_inference_statistics(m, headers=headers).model_stats[0].inference_count for m in STAGES}


@pytest.mark.skipif(bool(EXTERNAL_GRPC_URL), reason="starts its own local server")
def test_the_other_stage_settings_answer_as_the_shipped_ones(server, model_repository, tmp_path):
    """The pipeline parameters `preprocess` and `postprocess` (docs/performance.md, "The fused pipeline"), each set
    to the value the shipped config does not have: the same answers as the shipped pipeline, a bad image still
    fails alone, and each stage model is called by the pipeline with "bls" and never with "in_process"."""
    shipped = {stage: parameters(model_repository / "pipeline")[stage] for stage in STAGES}
    other = {stage: {"bls": "in_process", "in_process": "bls"}[value] for stage, value in shipped.items()}
    repo = tmp_path / "model_repository"
    # Every file a hard link (the weights of each version: 100 MB); a config rewrite replaces its own link only.
    shutil.copytree(model_repository, repo, copy_function=os.link, ignore=shutil.ignore_patterns("__pycache__"))
    set_instance_counts(repo, dict.fromkeys(python_models(repo), 1))
    for stage, value in other.items():
        set_parameter(repo, "pipeline", stage, value)
    requests = [
        [make_image(90, fmt="PNG"), make_image(91, size=(500, 375))],
        [make_image(92, size=(200, 300))],
        [make_image(93), b"not an image"],
        [make_image(94, mode="L")],
    ]
    with local_server(repo, tmp_path / "tritonserver.log") as triton:

        def send(images):
            try:
                return outputs(infer(triton.grpc_url, [image_input(images)]))
            except InferenceServerException as exc:
                return exc.status()

        with ThreadPoolExecutor(len(requests)) as pool:  # at once: one execute may get several of them
            answers = list(pool.map(send, requests))
        called = stage_calls(triton.grpc_url, triton.settings.admin_headers)
    assert answers[2] == "StatusCode.INVALID_ARGUMENT"
    before = stage_calls(server.grpc_url, server.settings.admin_headers)
    for images, answer in zip(requests, answers):
        if answer != "StatusCode.INVALID_ARGUMENT":
            assert_same_answers(answer, outputs(infer(server.grpc_url, [image_input(images)])), model_repository)
    after = stage_calls(server.grpc_url, server.settings.admin_headers)
    for settings, calls in ((other, called), (shipped, {m: after[m] - before[m] for m in STAGES})):
        for stage, value in settings.items():
            assert (calls[stage] > 0) == (value == "bls"), f"{stage}: {value!r}, its model called {calls[stage]}x"


def doc_snippet(marker: str) -> str:
    """The code block after `<!-- marker -->` in docs/deployment.md."""
    text = (PROJECT / "docs" / "deployment.md").read_text()
    return text.split(f"<!-- {marker} -->\n", 1)[1].split("```", 2)[1].split("\n", 1)[1]


@local_server_only
@pytest.mark.parametrize("marker", ["http-python", "http-curl"])
def test_the_http_examples_in_the_docs_answer_as_grpc_does(server, tmp_path, marker):
    """docs/deployment.md's tritonclient.http and curl examples, as written, against the server's HTTP port."""
    image = make_image(7)
    (tmp_path / "cat.jpg").write_bytes(image)
    code = doc_snippet(marker).replace("localhost:{{ cookiecutter.http_port }}", f"localhost:{server.settings.http_port}")
    argv = [sys.executable, "-c", code] if marker == "http-python" else ["bash", "-eo", "pipefail", "-c", code]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = outputs(infer(server.grpc_url, [image_input([image])]))
    want = {"SCORES": expected["SCORES"], "LABELS": np.array([[v.decode() for v in expected["LABELS"][0]]])}
    if marker == "http-curl":
        answer = {o["name"]: o["data"] for o in json.loads(done.stdout)["outputs"]}
        got = {"SCORES": np.array([answer["SCORES"]]), "LABELS": np.array([answer["LABELS"]])}
    else:  # a line per class: "photocopier 0.8286"
        rows = [line.rsplit(" ", 1) for line in done.stdout.splitlines()]
        got = {"SCORES": np.array([[float(s) for _, s in rows]]), "LABELS": np.array([[label for label, _ in rows]])}
    # the rule for two gRPC answers: on a GPU, several ResNet instances differ in the last digits
    assert_same_answers(got, want, server.settings.model_repository)
