"""The node agent's parsers against recorded vendor-tool output, and detect()'s tool order."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from zml_health.hardware import validate_hardware
from zml_nodeagent import smi

DATA = Path(__file__).resolve().parents[1] / "data" / "engines" / "agent"


def text(name: str) -> str:
    return (DATA / name).read_text()


def test_nvidia_query_csv() -> None:
    hw = smi.parse_nvidia_smi_query(text("nvidia-smi-query.csv"))
    assert hw.accelerator_type == "nvidia_h100" and hw.device_count == 2
    assert hw.driver_version == "535.129.03" and hw.product_name == "NVIDIA H100 80GB HBM3"
    assert hw.memory_gib == round(2 * 81559 / 1024, 2) and hw.free_memory_gib == round((80987 + 1024) / 1024, 2)
    assert smi.parse_cuda_version(text("nvidia-smi.txt")) == "12.2"


def test_nvidia_with_units_and_old_driver_fails_validation() -> None:
    hw = smi.parse_nvidia_smi_query(text("nvidia-smi-query-a100-old.csv"))
    assert hw.accelerator_type == "nvidia_a100" and hw.memory_gib == 80.0
    check = validate_hardware("nvidia_a100", hw.to_dict())
    assert not check.ok and "510.47.03 is older than the minimum 515.48" in check.reason


def test_rocm_smi_json_and_rocm_version() -> None:
    hw = smi.parse_rocm_smi_json(text("rocm-smi.json"))
    assert hw.accelerator_type == "amd_mi300x" and hw.device_count == 2
    assert hw.driver_detail == {"amdgpu": "6.7.0"}  # the kernel driver, not the ROCm version
    assert hw.memory_gib == round(2 * 206141652992 / 2**30, 2)
    assert smi.parse_rocm_version(text("amd-smi-version.txt")) == "6.2.4"
    assert smi.parse_rocm_version(text("rocm-info-version.txt")) == "5.7.1"


def test_hl_smi_gaudi2() -> None:
    hw = smi.parse_hl_smi_query(text("hl-smi-query.csv"))
    assert hw.accelerator_type == "intel_gaudi2" and hw.device_count == 2
    assert hw.driver_version == "1.17.0-e4b9d9d" and hw.memory_gib == 192.0
    assert validate_hardware("intel_gaudi2", hw.to_dict()).ok


def test_neuron_ls_inf2() -> None:
    hw = smi.parse_neuron_ls(text("neuron-ls.txt"))
    assert hw.accelerator_type == "aws_inferentia2" and hw.device_count == 1 and hw.memory_gib == 32.0
    assert hw.driver_version == ""  # neuron-ls does not print the SDK version


def test_detect_prefers_the_tool_present_and_reads_rocm_version() -> None:
    outputs = {"rocm-smi": text("rocm-smi.json"), "amd-smi": text("amd-smi-version.txt")}

    def run(argv: Sequence[str]) -> str | None:
        return outputs.get(argv[0])

    hw = smi.detect(run=run, read=lambda p: None, env={})
    assert hw.accelerator_type == "amd_mi300x" and hw.driver_version == "6.2.4"
    assert validate_hardware("amd_mi300x", hw.to_dict()).ok
    # declared H100, reports MI300X: a clear mismatch
    check = validate_hardware("nvidia_h100", hw.to_dict())
    assert not check.ok and "reports amd_mi300x (AMD Instinct MI300X OAM)" in check.reason


def test_detect_neuron_sdk_version_from_env_and_nothing_found() -> None:
    def run(argv: Sequence[str]) -> str | None:
        return text("neuron-ls.txt") if argv[0] == "neuron-ls" else None

    hw = smi.detect(run=run, read=lambda p: None, env={"ZML_NEURON_SDK_VERSION": "2.19.1"})
    assert hw.driver_version == "2.19.1" and validate_hardware("aws_inferentia2", hw.to_dict()).ok
    empty = smi.detect(run=lambda argv: None, read=lambda p: None, env={})
    assert empty.accelerator_type == "" and not validate_hardware("nvidia_h100", empty.to_dict()).ok


def test_mixed_products_never_match() -> None:
    hw = smi.parse_nvidia_smi_query("0, NVIDIA H100 80GB HBM3, 535.1, 1, 1\n1, NVIDIA A100-SXM4-80GB, 535.1, 1, 1\n")
    assert hw.accelerator_type == "mixed" and not validate_hardware("nvidia_h100", hw.to_dict()).ok
