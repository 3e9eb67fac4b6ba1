"""`--ort-providers` and `--device` beyond CUDA: parsing, the choice against what is installed, the
one-line fallback and the errors that name what is missing. No such hardware is here, so the provider
lists name providers this onnxruntime lacks (OpenVINO, ROCm, CANN: the CPU wheel has only CPU and
Azure), and the devices name torch types whose plugin or hardware is missing."""
from __future__ import annotations

import logging

import onnxruntime as ort
import pytest
import torch

from cosyvoice_triton.engines import providers
from cosyvoice_triton.errors import DeviceUnavailable, EngineUnavailable
from cosyvoice_triton.engines.onnx_export import token2wav_onnx
from cosyvoice_triton.engines.onnx_graphs import example_inputs, token2wav_specs
from cosyvoice_triton.engines.ort_runner import OrtRunner
from cosyvoice_triton.engines.providers import (Provider, check_torch_device, choose_providers,
                                                parse_providers)
from cosyvoice_triton.engines.select import build_token2wav, open_campplus
from cosyvoice_triton.models.flow import FlowModel
from cosyvoice_triton.models.hift import HiFTGenerator

MISSING = [name for name in ("OpenVINOExecutionProvider", "ROCMExecutionProvider", "CANNExecutionProvider")
           if name not in ort.get_available_providers()]


def test_provider_list_with_options_and_short_names():
    assert parse_providers("OpenVINOExecutionProvider:device_type=CPU;precision=FP32,rocm, migraphx,cann,dml,cpu") == (
        Provider("OpenVINOExecutionProvider", (("device_type", "CPU"), ("precision", "FP32"))),
        Provider("ROCMExecutionProvider"), Provider("MIGraphXExecutionProvider"), Provider("CANNExecutionProvider"),
        Provider("DmlExecutionProvider"), Provider("CPUExecutionProvider"))
    assert parse_providers("openvino:device_type=GPU")[0].as_ort() == ("OpenVINOExecutionProvider",
                                                                       {"device_type": "GPU"})
    with pytest.raises(ValueError, match="unknown provider 'vulkan'"):
        parse_providers("vulkan,cpu")
    with pytest.raises(ValueError, match="option 'device_type' of OpenVINOExecutionProvider is not key=value"):
        parse_providers("openvino:device_type")
    with pytest.raises(ValueError, match="empty provider entry"):
        parse_providers("openvino,,cpu")


@pytest.fixture(autouse=True)
def fresh_fallback_log(monkeypatch):
    """Each test sees its fallbacks logged anew (they are logged once per process and provider list)."""
    monkeypatch.setattr(providers, "_warned", set())


def test_missing_providers_fall_back_to_the_next_with_one_line(caplog):
    assert len(MISSING) >= 2, "this test needs an onnxruntime without OpenVINO and ROCm"
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton"):
        chosen = choose_providers(",".join([*MISSING, "cpu"]))
    assert chosen == [Provider("CPUExecutionProvider")]
    (line,) = [r.getMessage() for r in caplog.records]
    assert all(name in line for name in MISSING) and "onnxruntime-openvino" in line
    assert line.endswith("using CPUExecutionProvider")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton"):
        assert choose_providers(",".join([*MISSING, "cpu"])) == chosen  # the next graph: no second line
    assert not caplog.records
    assert choose_providers("cpu") == [Provider("CPUExecutionProvider")] and not caplog.records


def test_no_installed_provider_is_an_error_naming_what_is_missing():
    with pytest.raises(EngineUnavailable) as error:
        choose_providers(",".join(MISSING))
    message = str(error.value)
    assert all(name in message for name in MISSING) and f"onnxruntime {ort.__version__} has" in message
    assert "onnxruntime-openvino" in message
    # the same list given as installed passes, in its order
    assert [p.name for p in choose_providers(",".join(MISSING), available=MISSING[::-1])] == MISSING


def test_token2wav_and_campplus_take_the_provider_list(tiny_model_dir, tmp_path, caplog):
    """The list reaches every session: a missing OpenVINO falls back to CPU once per graph, same numbers."""
    paths = token2wav_onnx(tiny_model_dir, tmp_path)
    flow, hift = FlowModel.from_model_dir(tiny_model_dir), HiFTGenerator.from_model_dir(tiny_model_dir)
    spec = token2wav_specs(flow.config)["flow_estimator"]
    inputs = example_inputs("flow_estimator", flow.config, hift.config, batch=2, frames=40)
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton"):
        listed = OrtRunner(paths["flow_estimator"], spec, providers="openvino:device_type=CPU,cpu")
    assert len(caplog.records) == 1 and "OpenVINOExecutionProvider" in caplog.records[0].getMessage()
    assert listed.session.get_providers() == ["CPUExecutionProvider"]
    assert torch.equal(listed(*inputs), OrtRunner(paths["flow_estimator"], spec)(*inputs))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cosyvoice_triton"):
        built, _ = build_token2wav(tiny_model_dir, "onnxruntime", onnx_dir=tmp_path, ort_providers="rocm,cpu")
        campplus = open_campplus(tiny_model_dir, "onnxruntime", ort_providers="rocm,cpu")
    assert len(caplog.records) == 1  # one line for the flow encoder, estimator, HiFT decode and CAM++
    assert built.decoder.estimator.runner.session.get_providers() == ["CPUExecutionProvider"]
    assert campplus.session.get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(EngineUnavailable, match="ROCMExecutionProvider"):
        build_token2wav(tiny_model_dir, "onnxruntime", onnx_dir=tmp_path, ort_providers="rocm")


def test_torch_devices_are_checked():
    assert check_torch_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailable, match="unknown torch device 'quantum'"):
        check_torch_device("quantum")
    with pytest.raises(DeviceUnavailable, match="needs the torch plugin torch-npu .*not installed"):
        check_torch_device("npu:0")
    with pytest.raises(DeviceUnavailable, match="needs the torch plugin .*habana"):
        check_torch_device("hpu")
    if not torch.xpu.is_available():  # torch knows the type; this machine has no such device
        with pytest.raises(DeviceUnavailable, match="sees no xpu device"):
            check_torch_device("xpu")
    if not torch.backends.mps.is_available():
        with pytest.raises(DeviceUnavailable, match="sees no mps device"):
            check_torch_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable, match="sees no cuda device"):
            check_torch_device("cuda:0")


def test_serve_renders_the_providers_and_checks_the_device_at_start(tiny_model_dir, tmp_path):
    """`--ort-providers` reaches token2wav's and speaker_embedding's parameters; `--engine openvino` runs
    CAM++ on OpenVINO too; a device torch cannot use stops `serve` before tritonserver starts."""
    import pb_fake
    from cosyvoice_triton.server.launcher import DEFAULT_REPOSITORY, ServeOptions, prepare, repository_values
    from cosyvoice_triton.server.templates import render_template
    from cosyvoice_triton.triton.params import SpeakerEmbeddingParams, Token2WavParams, parse_parameters

    def params(name: str, cls, **options):
        values = repository_values(ServeOptions(**options), tmp_path, "/tmp/unused.sqlite")[name]
        text = render_template((DEFAULT_REPOSITORY / name / "config.pbtxt").read_text(), values, name=name)
        return parse_parameters(cls, pb_fake.pbtxt_to_dict(text), name)

    providers = "OpenVINOExecutionProvider:device_type=CPU;precision=FP32,cpu"
    token2wav = params("token2wav", Token2WavParams, engine="onnxruntime", ort_providers=providers)
    campplus = params("speaker_embedding", SpeakerEmbeddingParams, engine="onnxruntime", ort_providers=providers)
    assert token2wav.ort_providers == campplus.ort_providers == providers
    assert params("token2wav", Token2WavParams).ort_providers is None
    openvino = params("speaker_embedding", SpeakerEmbeddingParams, engine="openvino")
    assert (openvino.engine, openvino.device) == ("openvino", "cpu")
    assert params("token2wav", Token2WavParams, engine="openvino", device="cpu").engine == "openvino"
    for device, error in (("quantum", "unknown torch device"), ("npu", "torch-npu")):
        with pytest.raises(DeviceUnavailable, match=error):
            prepare(ServeOptions(model_dir=tiny_model_dir, run_dir=tmp_path / device, device=device))
        assert not (tmp_path / device / "repo").exists()
    with pytest.raises(ValueError, match="unknown provider 'vulkan'"):
        prepare(ServeOptions(model_dir=tiny_model_dir, run_dir=tmp_path / "p", engine="onnxruntime",
                             ort_providers="vulkan"))
