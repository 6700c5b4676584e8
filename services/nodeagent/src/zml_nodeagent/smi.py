"""Parsers for the vendor tools' output (pure) and :func:`detect`, which runs the tools present.

Commands run (each parser takes that command's stdout):

* NVIDIA: ``nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.free
  --format=csv,noheader,nounits`` and plain ``nvidia-smi`` (header: ``CUDA Version: 12.2``).
* AMD: ``amd-smi version`` (``... | ROCm version: 6.2.4``) or ``/opt/rocm/.info/version``
  for the ROCm version (what the API reference's minimum is stated in; the amdgpu kernel
  driver version rocm-smi prints is not it), and ``rocm-smi --showproductname --showmeminfo
  vram --json`` for products and memory.
* Intel Gaudi: ``hl-smi -Q index,name,driver_version,memory.total,memory.free -f csv,noheader``
  (Gaudi2 reports itself as ``HL-225``).
* AWS Neuron: ``neuron-ls`` (table; ``instance-type: inf2.xlarge`` header). neuron-ls does not
  print the Neuron SDK version: give it with ``--driver-version`` / ``ZML_NEURON_SDK_VERSION``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MIB_PER_GIB = 1024.0


@dataclass(slots=True)
class Hardware:
    """What the agent found: the body of ``/zml/v1/node`` (plus engine fields added later)."""

    accelerator_type: str = ""
    product_name: str = ""
    device_count: int = 0
    driver_version: str = ""
    #: Extra version facts (CUDA version, kernel driver...), informational.
    driver_detail: dict[str, str] = field(default_factory=dict)
    memory_gib: float | None = None
    free_memory_gib: float | None = None
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Product-name fragments -> ZML type IDs (checked in order, case-insensitive).
PRODUCTS: list[tuple[str, str]] = [
    ("h100", "nvidia_h100"),
    ("a100", "nvidia_a100"),
    ("mi300x", "amd_mi300x"),
    ("hl-225", "intel_gaudi2"),
    ("gaudi2", "intel_gaudi2"),
    ("inf2", "aws_inferentia2"),
    ("inferentia2", "aws_inferentia2"),
]


def type_for(product: str) -> str:
    """The ZML type ID of a product name; "" when it is none we know (e.g. an L4 or a Gaudi3)."""
    low = product.lower()
    for frag, type_id in PRODUCTS:
        if frag in low:
            return type_id
    return ""


def _num(text: str) -> float | None:
    m = re.search(r"[-+]?\d+(?:\.\d+)?", text)
    return float(m.group()) if m else None


def _mib(text: str) -> float | None:
    """``"81559"`` / ``"81559 MiB"`` -> MiB."""
    value = _num(text)
    if value is None:
        return None
    low = text.lower()
    if "gib" in low or "gb" in low:
        return value * MIB_PER_GIB
    return value


def _csv_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.lower().startswith(("index", "name")):
            continue  # blank or a header line
        rows.append([c.strip() for c in line.split(",")])
    return rows


def _summarise(products: list[str], drivers: list[str], total_mib: list[float], free_mib: list[float],
               source: str) -> Hardware:
    product = products[0] if products else ""
    hw = Hardware(accelerator_type=type_for(product), product_name=product, device_count=len(products),
                  driver_version=drivers[0] if drivers else "", source=source)
    if len(set(type_for(p) for p in products)) > 1:
        hw.accelerator_type = "mixed"  # never matches a declared type: a mixed node is invalid
    if total_mib:
        hw.memory_gib = round(sum(total_mib) / MIB_PER_GIB, 2)
    if free_mib:
        hw.free_memory_gib = round(sum(free_mib) / MIB_PER_GIB, 2)
    return hw


def parse_nvidia_smi_query(text: str) -> Hardware:
    """``index, name, driver_version, memory.total, memory.free`` CSV (with or without units)."""
    products, drivers, total, free = [], [], [], []
    for row in _csv_rows(text):
        if len(row) < 5:
            continue
        _, name, driver, mem_total, mem_free = row[:5]
        products.append(name)
        drivers.append(driver)
        if (t := _mib(mem_total)) is not None:
            total.append(t)
        if (f := _mib(mem_free)) is not None:
            free.append(f)
    return _summarise(products, drivers, total, free, "nvidia-smi")


def parse_cuda_version(text: str) -> str:
    """The ``CUDA Version: 12.2`` of plain nvidia-smi's header ("" if absent)."""
    m = re.search(r"CUDA Version:\s*([\d.]+)", text)
    return m.group(1) if m else ""


def parse_hl_smi_query(text: str) -> Hardware:
    """``index, name, driver_version, memory.total, memory.free`` CSV from hl-smi -Q."""
    hw = parse_nvidia_smi_query(text)
    hw.source = "hl-smi"
    return hw


def parse_rocm_version(text: str) -> str:
    """ROCm version from ``amd-smi version`` or ``/opt/rocm/.info/version`` ("6.2.4-120")."""
    m = re.search(r"ROCm version:\s*([\d.]+)", text)
    if m:
        return m.group(1)
    m = re.match(r"\s*(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else ""


def parse_rocm_smi_json(text: str) -> Hardware:
    """``rocm-smi --showproductname --showmeminfo vram --json``: one object per ``cardN``."""
    data = json.loads(text)
    products, total, free = [], [], []
    for key in sorted(k for k in data if k.lower().startswith("card")):
        card = {k.lower(): v for k, v in data[key].items()}
        products.append(str(card.get("card series") or card.get("card model") or card.get("device name") or ""))
        t = card.get("vram total memory (b)")
        u = card.get("vram total used memory (b)")
        if t is not None:
            total.append(float(t) / 2**20)
            if u is not None:
                free.append((float(t) - float(u)) / 2**20)
    kernel = str({k.lower(): v for k, v in data.get("system", {}).items()}.get("driver version", ""))
    hw = _summarise(products, [], total, free, "rocm-smi")
    if kernel:
        hw.driver_detail["amdgpu"] = kernel
    return hw


_NEURON_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|(.*)$")


def parse_neuron_ls(text: str) -> Hardware:
    """The neuron-ls table: one row per device; memory is the first "NN GB" cell."""
    instance = ""
    m = re.search(r"instance-type:\s*(\S+)", text)
    if m:
        instance = m.group(1)
    count, total = 0, []
    for line in text.splitlines():
        row = _NEURON_ROW.match(line.strip())
        if not row:
            continue
        count += 1
        mem = re.search(r"(\d+(?:\.\d+)?)\s*GB", row.group(3))
        if mem:
            total.append(float(mem.group(1)) * MIB_PER_GIB)
    product = f"AWS Inferentia2 ({instance})" if instance.startswith("inf2") else (instance or "AWS Neuron device")
    hw = Hardware(accelerator_type=type_for(instance), product_name=product, device_count=count,
                  source="neuron-ls")
    if total:
        hw.memory_gib = round(sum(total) / MIB_PER_GIB, 2)
    return hw


Runner = Callable[[Sequence[str]], str | None]


def run_tool(argv: Sequence[str], timeout: float = 10.0) -> str | None:
    """stdout of a tool, or None when absent or failing."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def detect(run: Runner = run_tool, read: Callable[[str], str | None] = _read,
           env: dict[str, str] | None = None) -> Hardware:
    """Run the vendor tools present and describe the node; an empty Hardware if none is."""
    env = dict(os.environ) if env is None else env
    out = run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,memory.free",
               "--format=csv,noheader,nounits"])
    if out and out.strip():
        hw = parse_nvidia_smi_query(out)
        cuda = parse_cuda_version(run(["nvidia-smi"]) or "")
        if cuda:
            hw.driver_detail["cuda"] = cuda
        return hw
    out = run(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"])
    if out and out.strip():
        try:
            hw = parse_rocm_smi_json(out)
        except (ValueError, AttributeError):
            hw = Hardware(source="rocm-smi")
        hw.driver_version = parse_rocm_version(run(["amd-smi", "version"]) or "") or parse_rocm_version(
            read("/opt/rocm/.info/version") or "")
        return hw
    out = run(["hl-smi", "-Q", "index,name,driver_version,memory.total,memory.free", "-f", "csv,noheader"])
    if out and out.strip():
        return parse_hl_smi_query(out)
    out = run(["neuron-ls"])
    if out and out.strip():
        hw = parse_neuron_ls(out)
        hw.driver_version = env.get("ZML_NEURON_SDK_VERSION", "")
        return hw
    return Hardware()
